"""The sweep files a store's cells came from: ``{root}/sweeps/sweep-{digest}/{text digest}.yaml``.

A run keeps its sweep file's text, as the user wrote it, before it writes any cell
(``execution.driver.keep_sweep``), so that a report can show the sweep behind a store's rows. A
sweep's folder is named by the digest of its name, as its parts' folder is
(``store.layout.sweep_folder``); a file by the digest of the text, so a re-run of the same file
writes nothing and every edit adds one file. A file is the text under one header line, a YAML
comment that names the sweep (a folder's digest cannot be read back) and when it was kept::

    # rayeval: {"sweep": "digits", "kept": "2025-01-02T03:04:05.678901+00:00"}

A sweep's newest text is the one kept last by that time, not by the file's modification time
(copying a store, as ``aws s3 sync`` does, resets it; S3 keeps whole seconds). A text kept
again after another (an edit, then reverted) is written again under its name with a new time.
Local files are written under a hidden temporary name and renamed, object-store files in one PUT
(``paths.put``): a reader sees a whole file or none. Readers of rows list only ``results/`` and
``parts/``, so this folder is invisible to them.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from typing import NamedTuple

import pyarrow.fs as pafs

from rayeval.io import paths
from rayeval.io.store.layout import sweep_folder

FOLDER = "sweeps"
HEADER = "# rayeval: "


class SweepText(NamedTuple):
    """One stored text of a sweep file: when it was written (ISO 8601, UTC; the header's
    ``kept`` field, the name the files have always had) and the text."""
    written: str
    text: str


def file_name(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16] + ".yaml"


def keep(fs: pafs.FileSystem, root: str, sweep: str, text: str) -> str | None:
    """Keep ``text`` as the newest sweep file of ``sweep``; the path written, or None when it
    already is the newest (a re-run of the same file). OSError as the filesystem raises it."""
    folder = f"{root}/{FOLDER}/{sweep_folder(sweep)}"
    name = file_name(text)
    newest = next(iter(_read(fs, folder, recursive=False).get(sweep, [])), None)
    if newest is not None and newest.text == text:
        return None
    now = datetime.now(timezone.utc).isoformat(timespec="microseconds")   # sorts as text
    header = json.dumps({"sweep": sweep, "kept": now}, ensure_ascii=False)
    return paths.put(fs, folder, name, f"{HEADER}{header}\n{text}".encode("utf-8"))


def read(fs: pafs.FileSystem, root: str, sweep: str | None = None) -> dict[str, list[SweepText]]:
    """Every stored text of ``sweep`` (of every sweep when None), per sweep name, newest first."""
    folder = f"{root}/{FOLDER}" + (f"/{sweep_folder(sweep)}" if sweep is not None else "")
    found = _read(fs, folder, recursive=sweep is None)
    return found if sweep is None else {k: v for k, v in found.items() if k == sweep}


def _read(fs: pafs.FileSystem, folder: str, recursive: bool) -> dict[str, list[SweepText]]:
    infos = fs.get_file_info(pafs.FileSelector(folder, recursive=recursive,
                                               allow_not_found=True))
    out: dict[str, list[SweepText]] = {}
    for info in sorted(infos, key=lambda i: i.path):
        if info.type != pafs.FileType.File or not info.base_name.endswith(".yaml") \
                or info.base_name.startswith((".", "_")):       # a writer's temporary
            continue
        try:
            with fs.open_input_stream(info.path) as f:
                parsed = parse(f.read().decode("utf-8", "replace"))
        except FileNotFoundError:       # removed since listed
            continue
        if parsed is not None:
            sweep, text = parsed
            out.setdefault(sweep, []).append(text)
    for texts in out.values():
        texts.sort(key=lambda t: t.written, reverse=True)
    return out


def parse(content: str) -> tuple[str, SweepText] | None:
    """(sweep name, SweepText) of a stored file's content; None for a file without the header."""
    first, sep, text = content.partition("\n")
    if not sep or not first.startswith(HEADER):
        return None
    try:
        header = json.loads(first[len(HEADER):])
        return str(header["sweep"]), SweepText(str(header["kept"]), text)
    except (ValueError, KeyError, TypeError):
        return None
