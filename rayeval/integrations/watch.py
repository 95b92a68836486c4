"""``rayeval watch``: evaluate checkpoints as a training run writes them.

Every ``interval`` seconds the sweep's globs are expanded again. A checkpoint is ready once its
fingerprint (sizes and modification times of its files) has not changed for ``settle`` seconds
or, with a ``watch.ready`` marker, as soon as the trainer wrote the marker (``COMPLETE`` inside
a checkpoint folder, ``*.done`` beside a checkpoint: ``step_100.pt.done``); names still being
written (hidden, ``.tmp``, ``.partial``, ...) are not even looked at. The cells of ready
checkpoints (x every evaluation) the store does not hold are evaluated in one
``TorchTrainer.fit()`` per poll, in ``watch.order`` (oldest first, newest first, or coarse to
fine), on a Ray that stays up between polls. A checkpoint that fails is not tried again until it
changes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import fnmatch

from rayeval._internal.execution import driver, signals
from rayeval.io import paths
from rayeval.reporting import trackers
from rayeval.io.checkpoints import CheckpointRef, expand_checkpoints
from rayeval.config.schema import Sweep, WatchSpec
from rayeval.errors import RunError
from rayeval.plan.cells import checkpoint_fingerprint


class Settling:
    """Which checkpoints have stopped changing."""

    def __init__(self, settle_s: float):
        self.settle_s = settle_s
        self.seen: dict[str, tuple[str, float]] = {}   # location -> (fingerprint, since)

    def ready(self, refs: list[CheckpointRef], now: float) -> list[tuple[CheckpointRef, str]]:
        out = []
        for ref in refs:
            try:
                fp = checkpoint_fingerprint(ref.location)
            except OSError:          # gone between the glob and the stat: a writer's rename
                continue
            prev = self.seen.get(ref.location)
            if prev is None or prev[0] != fp:
                self.seen[ref.location] = (fp, now)
            elif now - prev[1] >= self.settle_s:
                out.append((ref, fp))
        return out


class Marked:
    """Which checkpoints the trainer marked complete (``watch.ready``): ready at once, however
    recently they changed."""

    def __init__(self, ready: str):
        self.ready = ready
        self.warned: set[str] = set()

    def marker(self, location: str) -> str:
        """``*.done``: the checkpoint's name in the pattern, beside it; ``COMPLETE``: inside
        the checkpoint folder."""
        location = location.rstrip("/")
        if "*" in self.ready:
            parent, _, name = location.rpartition("/")
            return f"{parent}/{self.ready.replace('*', name)}"
        return f"{location}/{self.ready}"

    def is_marker(self, location: str) -> bool:
        """A marker file a checkpoint glob matched (``ckpts/*`` matches ``step_1.pt.done``)."""
        return "*" in self.ready and fnmatch.fnmatchcase(location.rstrip("/").rsplit("/", 1)[-1],
                                                         self.ready)

    def select(self, refs: list[CheckpointRef], say) -> list[tuple[CheckpointRef, str]]:
        out = []
        for ref in refs:
            if "*" not in self.ready and not paths.is_dir(ref.location):
                if ref.location not in self.warned:
                    self.warned.add(ref.location)
                    say(f"[rayeval] {ref.location} is a file: watch.ready {self.ready!r} names "
                        "a file inside a checkpoint folder; for files use a pattern such as "
                        "'*.done'")
                continue
            if not _exists(self.marker(ref.location)):
                continue
            try:
                out.append((ref, checkpoint_fingerprint(ref.location)))
            except OSError:
                continue
        return out


def _exists(location: str) -> bool:
    import pyarrow.fs as pafs

    try:
        fs, path = paths.filesystem(location)
        return fs.get_file_info(path).type != pafs.FileType.NotFound
    except OSError:
        return False


def ordered(ready: list[tuple[CheckpointRef, str]], order: str) -> list[tuple[CheckpointRef, str]]:
    """Ready checkpoints (oldest first, as globs expand) in the order to evaluate them:
    ``oldest``; ``newest``; ``bisect``, coarse to fine for backfilling a long run: the first,
    the last, the middle, then the middles of the halves, and so on."""
    if order == "newest":
        return ready[::-1]
    if order != "bisect" or len(ready) < 3:
        return list(ready)
    picked = [0, len(ready) - 1]
    spans = [(0, len(ready) - 1)]
    while spans:                          # breadth first: each round halves every span
        lo, hi = spans.pop(0)
        if hi - lo < 2:
            continue
        mid = (lo + hi) // 2
        picked.append(mid)
        spans += [(lo, mid), (mid, hi)]
    return [ready[i] for i in picked]


@dataclass
class WatchState:
    evaluated: int = 0
    failed: set[str] = field(default_factory=set)     # cell keys: not retried until changed
    known: set[str] = field(default_factory=set)      # cell keys the store holds


def watch(sweep: Sweep, *, interval_s: float, settle_s: float, address: str | None = None,
          verbose: bool = False, display_for: Callable = lambda: None,
          say: Callable[[str], None] = print, stop: threading.Event | None = None) -> WatchState:
    """Poll until ``stop`` is set or Ctrl-C (KeyboardInterrupt; SIGTERM is treated alike).
    The sweep's trackers get each cell as it finishes, and the leaderboard after each poll
    that added to it."""
    trackers.require(sweep.trackers)
    evaluations, store = driver.check_inputs(sweep)
    spec: WatchSpec = sweep.watch
    settling = Settling(settle_s)
    marked = Marked(spec.ready) if spec.ready else None
    state = WatchState()
    stop = stop or threading.Event()
    started = False
    signals.install()
    when = (f"ready once the trainer writes {spec.ready} "
            + ("beside it" if "*" in spec.ready else "inside it") if marked
            else f"ready when unchanged for {settle_s:g} s")
    say(f"[rayeval] watching {', '.join(sweep.checkpoints)} every {interval_s:g} s "
        f"({when}; {spec.order} first); Ctrl-C stops")
    publisher = trackers.Publisher(sweep, say=say, warn=say)
    group: driver.Standing | None = None
    try:
        while True:
            refs = expand_checkpoints(sweep.checkpoints, allow_empty=True)
            if marked:
                refs = [r for r in refs if not marked.is_marker(r.location)]
                ready = marked.select(refs, say)
            else:
                ready = settling.ready(refs, time.monotonic())
            ready = ordered(ready, spec.order)
            plan = driver.plan_cells(sweep, evaluations, store, ready=ready,
                                     skip=state.failed | state.known)
            state.known.update(c.key for c in plan.cached)
            for o in plan.failed:
                state.failed.add(o.key)
                say(f"[rayeval] failed: {o.error}")
            if plan.cells:
                if not started:
                    started = driver.start_ray(sweep, address, verbose)
                names = dict.fromkeys(c.checkpoint.name for c in plan.cells)
                say(f"[rayeval] {len(names)} new checkpoint(s): " + ", ".join(names))
                if group is None or not group.alive:
                    # One worker group for every poll; a new one only after a failure.
                    group = driver.Standing(sweep, evaluations)
                    say(f"[rayeval] worker group started ({sweep.workers} worker(s)); it "
                        "stays up for the next checkpoints")
                try:
                    outcomes = group.run(plan, display_for(),
                                         on_cell=publisher.cell if publisher.live else None)
                except KeyboardInterrupt as e:
                    # Ray is shut down only when no thread is left inside it (see run_sweep).
                    started = started and getattr(e, "group_stopped", False)
                    group = None
                    raise
                except RunError as e:      # workers lost beyond the restart budget: next poll
                    say(f"[rayeval] run failed: {e.message}; trying again at the next poll")
                    group.close(timeout_s=5)
                    group, outcomes = None, []
                finally:
                    store.discard_partial(c.key for c in plan.cells)
                for o in outcomes:
                    name = o.checkpoint.rstrip("/").rsplit("/", 1)[-1]
                    if o.ok:
                        state.known.add(o.key)
                        state.evaluated += 1
                        values = ", ".join(f"{k} {v:.4f}" for k, v in o.values
                                           if isinstance(v, float))
                        say(f"[rayeval] {name} (step {o.step}) on {o.evaluation}: {values}")
                    else:
                        state.failed.add(o.key)
                        say(f"[rayeval] failed: {o.error}")
                if any(o.ok for o in outcomes):
                    publisher.board()
            if stop.wait(interval_s):
                return state
    finally:
        with signals.held():
            if group is not None:
                group.close()
            if started:
                import ray

                ray.shutdown()
            publisher.close()
