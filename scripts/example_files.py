"""What the make_*_example.py scripts share: a fixed thread count for torch, and checkpoints
written whole or not at all.

A checkpoint is written inside a hidden folder beside its final place (``.NAME.partial/NAME``:
rayeval's checkpoint globs skip hidden names, ``rayeval.io.checkpoints.in_progress``) and
renamed into place once complete, so an interrupted script leaves no checkpoint that a sweep's
glob would match, and a re-run clears what a killed one left behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil

# The examples' models are tiny: a second thread gains nothing, and on a busy 2-core machine
# torch's OpenMP workers wait on each other. scripts/make_vlm_example.py (issue 47), the first
# 200 steps: 22-23 s on one thread, 37 s on torch's default two (load average 3); the first
# 100 steps: 13 s against 255 s (load 6-11, other sessions' runs). torch.set_num_threads(1)
# here is as fast as OMP_NUM_THREADS=1 (25-28 s), so `python scripts/make_...py` needs no
# variable. One thread also keeps the weights the same on any core count (two threads trained
# other weights: loss 0.442 at step 200 against 0.419).
THREADS = 1


@contextlib.contextmanager
def threads(n: int = THREADS):
    """torch's intra-op thread count set to ``n`` for the block (the earlier count put back:
    the scripts are imported by tests too)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _partial(target: str) -> str:
    head, name = os.path.split(os.path.normpath(target))
    return os.path.join(head, f".{name}.partial")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


@contextlib.contextmanager
def whole(target: str):
    """Yield a path to write a file or a folder into, of ``target``'s name inside a hidden
    folder beside it (the same name: ``torch.save`` names its archive's records after the
    file, so the bytes are those of a direct write); on success it replaces ``target`` (an
    earlier folder of the name is removed first: os.replace cannot put a folder over a
    non-empty one), on an exception it is removed. What a killed run left is cleared first."""
    partial = _partial(target)
    _remove(partial)
    os.makedirs(partial)
    path = os.path.join(partial, os.path.basename(os.path.normpath(target)))
    try:
        yield path
        if os.path.isdir(path) and os.path.lexists(target):
            _remove(target)
        os.replace(path, target)
    finally:
        _remove(partial)


def clear(folder: str) -> None:
    """Empty ``folder`` (made if missing): a stale checkpoint of an earlier run, whole or
    partial, would match the sweep's glob or be mistaken for this run's."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
