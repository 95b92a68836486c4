"""What of a task library's registry rayeval runs (``rayeval tasks --check``).

Every leaf task the library registers (lm-eval's or lmms-eval's ``TaskManager``) is built with
the library's own constructor up to the moment it would load its documents, and put through the
rules a run applies to the tasks it loads (``refusal`` of each slice: lm-eval's
``harness.render``, lmms-eval's ``lmms.rules``): ``accepted``, or
the first reason it is refused and what would lift it. Nothing is downloaded: the construction
stops at the data (``without_data``), where the task already holds everything the rules read
(its class, output type, generation_kwargs, metrics and their aggregations). A task the library
cannot build here (a package it needs is missing) is refused with the library's own message.

The rules that need documents (different generation_kwargs per document, requests that are
not text) are not checked here: a run still applies them when it renders the task.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

ACCEPTED, REFUSED = "accepted", "refused"
# Nothing from the network while tasks are built: the Hugging Face libraries read these when
# first imported (a metric lm-eval does not know is looked up on the Hub by ``evaluate``, which
# retries for minutes offline).
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}


@dataclass(frozen=True)
class Verdict:
    """One leaf task of a registry: ``accepted`` or ``refused``, and the reason (the run's own
    message; for an accepted task, what its entry needs, if anything)."""
    task: str
    status: str
    reason: str = ""


class NoData(Exception):
    """Raised where a task being built would load its documents."""


@contextlib.contextmanager
def without_data(task_classes: Iterable[type]):
    """Every task built inside stops where it would load its documents (``NoData``): the
    classes' ``download`` and, for a task class that downloads its own way, ``datasets``'
    ``load_dataset`` and the Hugging Face Hub's ``snapshot_download``. Offline, so that a
    loader this misses fails at once instead of waiting on the network."""
    import datasets
    import huggingface_hub

    def stop(*args, **kwargs):
        raise NoData()

    patched = [(cls, "download") for cls in task_classes]
    patched += [(datasets, "load_dataset"), (huggingface_hub, "snapshot_download")]
    evaluate = sys.modules.get("evaluate.config")
    if evaluate is not None:                    # imported before: its flag, read then
        patched.append((evaluate, "HF_EVALUATE_OFFLINE"))
    saved = [(owner, name, owner.__dict__.get(name, getattr(owner, name)))
             for owner, name in patched]
    env = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    for owner, name in patched:
        setattr(owner, name, True if name == "HF_EVALUATE_OFFLINE" else stop)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stopped_task(error: BaseException, base: type):
    """The task object whose construction ``error`` (a NoData) stopped: the ``self`` of the
    outermost constructor frame in the traceback that is an instance of ``base``."""
    tb = error.__traceback__
    found = None
    while tb is not None:
        me = tb.tb_frame.f_locals.get("self")
        if found is None and isinstance(me, base):
            found = me
        tb = tb.tb_next
    return found


def matching(names: Iterable[str], pattern: str | None) -> list[str]:
    """The names that match the shell-style ``pattern`` (every name for None)."""
    from fnmatch import fnmatchcase

    return [n for n in names if pattern is None or fnmatchcase(n, pattern)]


def check(names: Iterable[str], load: Callable[[str], object], base: type,
          rule: Callable[[object, str], tuple[str, str] | None],
          note: Callable[[object, str], str] = lambda task, name: "",
          library: str = "lm-eval") -> list[Verdict]:
    """Each task of ``names`` built by ``load(name)`` (inside ``without_data``) and judged by
    ``rule(task, name)`` (a slice's ``refusal``); ``note(task, name)``: what an accepted
    task's entry needs (a judge), if anything."""
    out = []
    silenced = logging.root.manager.disable
    logging.disable(logging.CRITICAL)         # the libraries log every task they build
    try:
        for name in names:
            out.append(_one(name, load, base, rule, note, library))
    finally:
        logging.disable(silenced)
    return out


def _one(name, load, base, rule, note, library) -> Verdict:
    task = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            load(name)
    except NoData as stop:
        task = stopped_task(stop, base)
    except (Exception, SystemExit) as error:  # noqa: BLE001 - a task module may exit
        first = (str(error).splitlines() or [""])[0][:200]
        return Verdict(name, REFUSED, f"{library} cannot build it here: "
                                      f"{type(error).__name__}: {first}")
    if task is None:        # built whole without loading data (a task that makes its own)
        return Verdict(name, REFUSED, f"{library} built it without stopping at its data; "
                                      "rayeval cannot tell what it asks")
    try:
        refused = rule(task, name)
    except Exception as error:  # noqa: BLE001 - a task whose config the rules cannot read
        return Verdict(name, REFUSED, f"its configuration cannot be read before its "
                                      f"documents: {type(error).__name__}: {error}"[:300])
    if refused:
        return Verdict(name, REFUSED, refused[1])
    return Verdict(name, ACCEPTED, note(task, name))


def summary(verdicts: list[Verdict]) -> tuple[int, int, list[tuple[str, int]]]:
    """(accepted, total, [(reason kind, count)] most common first): a reason's kind is its
    text with the task's own name taken out."""
    from collections import Counter

    kinds = Counter(v.reason.replace(repr(v.task), "TASK") for v in verdicts
                    if v.status == REFUSED)
    accepted = sum(v.status == ACCEPTED for v in verdicts)
    return accepted, len(verdicts), kinds.most_common()
