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

import dataclasses
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import fnmatch

from rayeval.execution import driver, signals
from rayeval.execution.callbacks import RunCallback
from rayeval.execution.lifecycle import RayLifecycle
from rayeval.io import paths
from rayeval.reporting import trackers
from rayeval.io.checkpoints import CheckpointRef, expand_checkpoints
from rayeval.config.schema import Sweep, WatchSpec
from rayeval.errors import RunError
from rayeval.plan import preflight
from rayeval.plan.cells import checkpoint_fingerprint
from rayeval.plan.outcome import failure_lines
from rayeval.reporting.display import DisplayCallback


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


class WatchMessages(RunCallback):
    """``watch``'s lines about each poll, as callbacks of its run: the cells that failed
    before any worker and the new checkpoints (each plan), a new worker group, and each
    evaluated cell's metrics or error (each poll's outcomes)."""

    def __init__(self, say: Callable[[str], None], workers: int):
        self.say = say
        self.workers = workers

    def on_plan(self, plan) -> None:
        for line, _detail in failure_lines(plan.failed):
            self.say(f"[rayeval] failed: {line}")
        if plan.cells:
            names = dict.fromkeys(c.checkpoint.name for c in plan.cells)
            self.say(f"[rayeval] {len(names)} new checkpoint(s): " + ", ".join(names))

    def on_group_start(self) -> None:
        # One worker group for every poll; a new one only after a failure.
        self.say(f"[rayeval] worker group started ({self.workers} worker(s)); it stays up for "
                 "the next checkpoints")

    def on_outcomes(self, outcomes) -> None:
        for o in outcomes:
            name = o.checkpoint.rstrip("/").rsplit("/", 1)[-1]
            if o.ok:
                values = ", ".join(f"{k} {v:.4f}" for k, v in o.values if isinstance(v, float))
                self.say(f"[rayeval] {name} (step {o.step}) on {o.evaluation}: {values}")
        for line, _detail in failure_lines(outcomes):
            self.say(f"[rayeval] failed: {line}")


def watch(sweep: Sweep, *, interval_s: float, settle_s: float, address: str | None = None,
          verbose: bool = False, display_for: Callable = lambda: None,
          say: Callable[[str], None] = print, stop: threading.Event | None = None) -> WatchState:
    """Poll until ``stop`` is set or Ctrl-C (KeyboardInterrupt; SIGTERM is treated alike).
    The sweep's trackers get each cell as it finishes, and the leaderboard after each poll
    that added to it. ``display_for()``: the progress display of each poll's fit."""
    trackers.require(sweep.trackers)
    evaluations, store = preflight.check_inputs(sweep)
    spec: WatchSpec = sweep.watch
    settling = Settling(settle_s)
    marked = Marked(spec.ready) if spec.ready else None
    state = WatchState()
    stop = stop or threading.Event()
    run_id = uuid.uuid4().hex[:12]         # the polls' (see below)
    with RayLifecycle(sweep, address=address, verbose=verbose) as life:
        signals.install()
        when = (f"ready once the trainer writes {spec.ready} "
                + ("beside it" if "*" in spec.ready else "inside it") if marked
                else f"ready when unchanged for {settle_s:g} s")
        say(f"[rayeval] watching {', '.join(sweep.checkpoints)} every {interval_s:g} s "
            f"({when}; {spec.order} first); Ctrl-C stops")
        run = life.callbacks
        run.add(WatchMessages(say, sweep.workers))
        run.add(DisplayCallback(display_for))
        run.add(trackers.PublishToTrackers(trackers.Publisher(sweep, say=say, warn=say),
                                  only_when_added=True))
        poll = driver.RunSequence(life, OnStandingGroup(life, state, say),
                                  discard_now=True)
        while True:
            refs = expand_checkpoints(sweep.checkpoints, allow_empty=True)
            if marked:
                refs = [r for r in refs if not marked.is_marker(r.location)]
                ready = marked.select(refs, say)
            else:
                ready = settling.ready(refs, time.monotonic())
            ready = ordered(ready, spec.order)
            plan = preflight.plan_cells(sweep, evaluations, store, ready=ready,
                                        skip=state.failed | state.known, strict=False)
            # one run id for the watch's polls: the standing group sets itself up for a plan
            # once (its token is the plan's digest), not again for every poll's
            plan = dataclasses.replace(plan, run_id=run_id)
            state.known.update(c.key for c in plan.cached)
            state.failed.update(o.key for o in plan.failed)
            # The run of this poll's plan: its cells on the standing group, then the groups
            # whose members are all stored (an earlier run's too) and this poll's cells in one
            # part, then its outcomes said.
            poll(plan)
            if stop.wait(interval_s):
                return state


class OnStandingGroup:
    """Each poll's fit (``driver.RunSequence``'s): the plan's cells on the standing worker
    group (``driver.StandingGroups``, as a service's: started if need be, held by the run's
    ``RayLifecycle`` and closed with it), their outcomes kept in the watch's state. A group
    lost beyond the restart budget is said and dropped, and ends the poll (None): the next
    poll tries again on a new group. The progress spans the polls."""

    def __init__(self, life: RayLifecycle, state: WatchState, say: Callable[[str], None]):
        self.life = life
        self.state = state
        self.say = say
        life.standing = driver.StandingGroups(own_progress=False)

    def __call__(self, plan):
        standing, run = self.life.standing, self.life.callbacks
        try:
            outcomes = standing.run(standing.group_for(plan, run), plan, run)
        except RunError as e:          # workers lost beyond the restart budget: next poll
            self.say(f"[rayeval] run failed: {e.message}; trying again at the next poll")
            return None
        for o in outcomes:
            if o.ok:
                self.state.known.add(o.key)
                self.state.evaluated += 1
            else:
                self.state.failed.add(o.key)
        return outcomes
