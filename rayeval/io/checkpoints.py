"""Checkpoints: found from globs (with the step and epoch from their names), and fetched from object
storage into a node-local cache once per node.

What a checkpoint holds is read by ``layouts``; fitting it to the model is ``loading``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from rayeval.io import paths
from rayeval.errors import CheckpointError, SpecError

_STEP_WORD = re.compile(r"(?:^|[^a-z])(?:global_step|step|iter|iteration)[=_-]?(\d+)", re.I)
_EPOCH_WORD = re.compile(r"(?:^|[^a-z])epoch[=_-]?(\d+)", re.I)
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class CheckpointRef:
    location: str           # as expanded from the glob (absolute path or URI)
    step: int | None
    epoch: int | None = None

    @property
    def name(self) -> str:
        return self.location.rstrip("/").rsplit("/", 1)[-1]


def _stem(location: str) -> str:
    name = location.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"\.(pt|pth|bin|ckpt|safetensors)$", "", name, flags=re.I)


def parse_step(location: str) -> int | None:
    """The training step in a checkpoint's name: ``step=N``/``step_N``/``iter-N`` first, else
    the last number in the name (``checkpoint-500`` -> 500); None when there is none.

    A name with an epoch (``epoch=3``, ``epoch_3``) and no step word has no step: its numbers
    are the epoch and things like a run number (``run2_epoch5``), and an epoch plotted or
    sorted as a step would put epoch 8 before step 10."""
    stem = _stem(location)
    m = _STEP_WORD.search(stem)
    if m:
        return int(m.group(1))
    if _EPOCH_WORD.search(stem):
        return None
    numbers = _DIGITS.findall(stem)
    return int(numbers[-1]) if numbers else None


def parse_epoch(location: str) -> int | None:
    """The epoch in a checkpoint's name (``epoch=3``, ``epoch_3``, ``epoch-3``, ``epoch3``,
    as in Lightning's ``epoch=3-step=1200.ckpt``); None when the name has none."""
    m = _EPOCH_WORD.search(_stem(location))
    return int(m.group(1)) if m else None


IN_PROGRESS = (".tmp", ".part", ".partial", ".incomplete", ".lock")


def in_progress(location: str) -> bool:
    """A name that writers use before the final rename: hidden, or a temporary suffix."""
    name = location.rstrip("/").rsplit("/", 1)[-1]
    return name.startswith(".") or name.endswith(IN_PROGRESS)


def expand_checkpoints(patterns: tuple[str, ...], keys: tuple[str, ...] | None = None,
                       allow_empty: bool = False) -> list[CheckpointRef]:
    """Every checkpoint the patterns match, once each, ordered by step, then epoch (names with
    an epoch and no step: ``epoch_8`` before ``epoch_10``), then location. Globs
    skip names still being written (``in_progress``).

    A pattern that matches nothing is a SpecError naming it (``checkpoints[i]``), unless
    ``allow_empty`` (watching for checkpoints still to come)."""
    seen: dict[str, CheckpointRef] = {}
    for i, pattern in enumerate(patterns):
        key = keys[i] if keys else f"checkpoints[{i}]"
        try:
            found = paths.glob(pattern)
        except OSError as e:
            raise SpecError(f"{key}: {paths.explain(e, pattern)}") from None
        if paths.has_glob(pattern):
            found = [f for f in found if not in_progress(f)]
        if not found and (why := paths.missing_bucket(pattern)):
            raise SpecError(f"{key}: {why}")
        if not found and not allow_empty:
            kind = "glob" if paths.has_glob(pattern) else "path"
            raise SpecError(f"{key}: {kind} {pattern!r} matches no file or folder; "
                            "check the path (relative paths start at the sweep file's folder)")
        for location in found:
            seen.setdefault(location, CheckpointRef(location, parse_step(location),
                                                    parse_epoch(location)))
    return sorted(seen.values(), key=lambda c: (c.step is None, c.step or 0,
                                                c.epoch is None, c.epoch or 0, c.location))


def _download(fs, src: str, dest: str) -> None:
    """Copy a file, or a folder with every file under it (hidden ones too: DCP's .metadata)."""
    import shutil

    import pyarrow.fs as pafs

    def copy(path: str, out: str) -> None:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with fs.open_input_stream(path) as fin, open(out, "wb") as fout:
            while chunk := fin.read(1 << 24):
                fout.write(chunk)

    if fs.get_file_info(src).type != pafs.FileType.Directory:
        copy(src, dest)
        return
    shutil.rmtree(dest, ignore_errors=True)          # a partial copy from an earlier crash
    os.makedirs(dest)
    root = src.rstrip("/")
    for item in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        if item.type == pafs.FileType.File:
            copy(item.path, os.path.join(dest, item.path[len(root):].lstrip("/")))


def fetch(location: str, cache_dir: str, version: str = "") -> str:
    """A local path for a checkpoint location. Object-store checkpoints are copied into
    ``cache_dir`` (keyed by location and ``version``, its fingerprint: a checkpoint rewritten
    in place is fetched again) once per node: the first worker on a node downloads under
    a file lock, the others wait for it and reuse the copy."""
    if not paths.is_uri(location):
        return location
    import fcntl
    import hashlib

    digest = hashlib.sha256(f"{location}|{version}".encode()).hexdigest()[:16]
    target = os.path.join(cache_dir, digest, location.rstrip("/").rsplit("/", 1)[-1])
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(os.path.join(cache_dir, digest + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(target):
            return target
        fs, src = paths.filesystem(location)
        tmp = target + ".partial"
        try:
            _download(fs, src, tmp)
        except OSError as e:
            raise CheckpointError(f"{location}: cannot fetch the checkpoint: "
                                  f"{paths.explain(e, location)}") from None
        os.replace(tmp, target)
        with open(os.path.join(os.path.dirname(target), ".fetched"), "a") as f:
            f.write(f"{os.getpid()}\n")      # who downloaded it: one line per download
    return target
