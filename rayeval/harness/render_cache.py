"""Renderings of ``lm_eval:`` and ``lmms_eval:`` entries cached by content, so that planning an
entry rendered before imports neither library: a re-run whose cells are all in the store
pays no rendering at all.

What an entry renders to is decided by (the *key*, ``content_key``, computed without importing
lm-eval or lmms-eval):

    the library's version (and datasets', pyarrow's, jinja2's, Python's) and rayeval's own
    rendering code (the source of ``harness``' and ``lmms``' render, requests, groups, store
    and this module);
    the entry's settings (every field of its LmEvalSpec / LmmsEvalSpec; an lmms-eval entry's
    judge or not; with apply_chat_template, the tokenizer folder and its tokenizer files);
    every file under ``include_path`` (its YAMLs, ``utils.py`` and anything beside them), by
    content, and what its YAMLs ``include:`` and ``!function`` from outside it;
    the local data files a YAML names (``dataset_path``, ``dataset_kwargs``: data_files,
    data_dir), by content (files over 1 MiB by size and modification time, as the data sets'
    fingerprints are).

Rendering also records the files the library opened while it rendered that none of the above
covers (an image a document names, a module ``utils.py`` imports from elsewhere): the cached
rendering lists them with their fingerprints, and is served only while every one is unchanged.

Not cached, so rendered on every run as before: an entry whose task is not defined by its
``include_path``'s YAMLs (a Hub task, named only: what it renders depends on the Hub and the
datasets cache, which cannot be keyed offline), one whose YAMLs read a Hub data set (a
``dataset_path`` that is neither a local path nor a packaged builder such as ``parquet`` or
``json``), one with a ``!function`` of an importable module outside the library, and one whose
tokenizer lives in an object store.

What is cached is plain data (JSON, never code): per task the digest of its request table and
the sha256 of its bytes, its metric layout, decoding, group structure, ``limit:`` count: what
planning reads (the cell keys' inputs). The table itself is the result store's; the task object
the workers score with is rendered when a run has cells to evaluate (``CachedTask.rendered``) and
its digest checked against the cached one: a difference is a one-line error and the cached
rendering is dropped, never a number.

The folder: ``$RAYEVAL_RENDER_CACHE`` (``off`` keeps nothing), else
``$XDG_CACHE_HOME/rayeval/rendered`` (``~/.cache/rayeval/rendered``); a local folder of the
machine that plans (a store that others write is never trusted for it).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading

from rayeval.errors import RunError
from rayeval.harness.content_key import (FORMAT, SKIP, NotKeyed, Recording, fingerprint,
                                         key, read_elsewhere)

ENV = "RAYEVAL_RENDER_CACHE"


def folder() -> str | None:
    """Where cached renderings are, or None when caching is off."""
    env = os.environ.get(ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "false", "no") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rayeval", "rendered")


# --- cached renderings ---------------------------------------------------------------------------

def _file(k: str) -> str | None:
    where = folder()
    return None if where is None else os.path.join(where, f"{k}.json")


def load(k: str) -> dict | None:
    """The rendering cached under key ``k``, when every file it read is unchanged; else None."""
    path = _file(k)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            cached = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or cached.get("format") != FORMAT:
        return None
    for p, want in (cached.get("read") or {}).items():
        if fingerprint(p) != want:
            return None
    return cached


def save(k: str, tasks: list[dict], groups: list[dict], read: dict[str, str]) -> None:
    """Keep a rendering under key ``k`` (written whole: a temporary file renamed); a folder
    that cannot be written keeps nothing."""
    path = _file(k)
    if path is None:
        return
    body = json.dumps({"format": FORMAT, "tasks": tasks, "groups": groups, "read": read},
                      sort_keys=True)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError:
        pass


def drop(k: str) -> None:
    path = _file(k)
    if path is not None:
        try:
            os.remove(path)
        except OSError:
            pass


class Source:
    """The renderer of one cached entry, run when something needs what is not cached (the task
    object, the table's bytes): once, with every digest checked against the cached ones."""

    def __init__(self, k: str, library: str, where: str, render):
        self.key, self.library, self.where, self.render = k, library, where, render
        self.done: dict | None = None

    def get(self, task: str, digest: str):
        if self.done is None:
            tasks, _ = self.render()
            self.done = {t.task: t for t in tasks}
        got = self.done.get(task)
        if got is None or got.digest != digest:
            drop(self.key)
            raise RunError(
                f"{self.where}: the cached rendering of {self.library} task {task!r} is not what "
                f"{self.library} renders now (digest {digest}, now "
                f"{getattr(got, 'digest', 'no such task')}): something it depends on changed "
                "that its key does not cover; it is dropped, run again")
        return got


class CachedTask:
    """A task rendered by an earlier run, as planning reads it: the plain attributes of a
    ``Rendered`` (``PLAIN``) from the cached JSON; ``table``, ``blob`` and ``lm`` from the task
    rendered again (``Source``) when first asked for."""

    def __init__(self, fields: dict, source: Source):
        self.__dict__.update(fields)
        self._source = source

    @property
    def rendered(self):
        return self._source.get(self.task, self.digest)

    @property
    def table(self):
        return self.rendered.table

    @property
    def blob(self) -> bytes:
        return self.rendered.blob

    @property
    def lm(self):
        return self.rendered.lm

    @property
    def is_rendered(self) -> bool:
        return self._source.done is not None


def plain_task(rendered, fields: tuple[str, ...]) -> dict:
    """What is cached of a rendered task: ``fields``, the table's sha256 and its ``limit:``
    count (``store.LIMITED_FROM``), as JSON values."""
    from rayeval.harness import store

    out = {f: getattr(rendered, f) for f in fields}
    out["table_sha256"] = hashlib.sha256(store.table_bytes(rendered)).hexdigest()
    out["limited_from"] = getattr(rendered.lm, store.LIMITED_FROM, None)
    return json.loads(json.dumps(out))


def task_fields(cached: dict) -> dict:
    """A cached task's fields with the types a Rendered has (JSON has lists for tuples)."""
    out = dict(cached)
    out["metrics"] = [tuple(m) for m in out["metrics"]]
    for name in ("until", "sampling"):
        if name in out:
            out[name] = tuple(out[name])
    return out


def rendering(library: str, spec, where: str, render, fields: tuple[str, ...],
              extra_of=None) -> tuple[list, list]:
    """An entry's (tasks, groups) for planning: cached by an earlier run (``CachedTask``s, the
    library not imported), else ``render()``'s, cached for the next run when the entry can be
    keyed. ``fields``: the attributes of a rendered task that planning reads (the entry
    kind's ``PLAIN``); ``extra_of()``: what else the rendering depends on (NotKeyed when it
    cannot say)."""
    from rayeval.harness.groups import Group

    try:
        k = None if folder() is None else \
            key(library, spec, extra_of() if extra_of is not None else None)
    except NotKeyed:
        k = None
    if k is None:
        return render()
    found = load(k)
    if found is not None:
        source = Source(k, library, where, render)
        return ([CachedTask(task_fields(t), source) for t in found["tasks"]],
                [Group(g["name"], list(g["leaves"]),
                       [(m, f, bool(w)) for m, f, w in g["aggregates"]])
                 for g in found["groups"]])
    with Recording() as rec:
        tasks, groups = render()
    save(k, [plain_task(t, fields) for t in tasks],
         [{"name": g.name, "leaves": list(g.leaves),
           "aggregates": [list(a) for a in g.aggregates]} for g in groups],
         read_elsewhere(rec.files, SKIP.get(k, [spec.include_path]), folder()))
    return tasks, groups
