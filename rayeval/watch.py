"""``rayeval watch``: evaluate checkpoints as a training run writes them.

Every ``interval`` seconds the sweep's globs are expanded again. A checkpoint is ready once its
fingerprint (sizes and modification times of its files) has not changed for ``settle`` seconds;
names still being written (hidden, ``.tmp``, ``.partial``, ...) are not even looked at. The cells
of ready checkpoints (x every evaluation) the store does not hold are evaluated in one
``TorchTrainer.fit()`` per poll, on a Ray that stays up between polls. A checkpoint that fails is not tried again until it changes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from . import driver, signals
from .checkpoints import CheckpointRef, expand_checkpoints
from .config import Sweep
from .errors import RunError
from .plan import checkpoint_fingerprint


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


@dataclass
class WatchState:
    evaluated: int = 0
    failed: set[str] = field(default_factory=set)     # cell keys: not retried until changed
    known: set[str] = field(default_factory=set)      # cell keys the store holds


def watch(sweep: Sweep, *, interval_s: float, settle_s: float, address: str | None = None,
          verbose: bool = False, display_for: Callable = lambda: None,
          say: Callable[[str], None] = print, stop: threading.Event | None = None) -> WatchState:
    """Poll until ``stop`` is set or Ctrl-C (KeyboardInterrupt; SIGTERM is treated alike)."""
    evaluations, store = driver.check_inputs(sweep)
    settling = Settling(settle_s)
    state = WatchState()
    stop = stop or threading.Event()
    started = False
    signals.install()
    say(f"[rayeval] watching {', '.join(sweep.checkpoints)} every {interval_s:g} s "
        f"(ready when unchanged for {settle_s:g} s); Ctrl-C stops")
    try:
        while True:
            refs = expand_checkpoints(sweep.checkpoints, allow_empty=True)
            ready = settling.ready(refs, time.monotonic())
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
                try:
                    outcomes = driver.evaluate(plan, display_for()).outcomes
                except KeyboardInterrupt as e:
                    # Ray is shut down only when no thread is left inside it (see run_sweep).
                    started = started and getattr(e, "group_stopped", False)
                    raise
                except RunError as e:      # workers lost beyond the restart budget: next poll
                    say(f"[rayeval] run failed: {e.message}; trying again at the next poll")
                    outcomes = []
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
            if stop.wait(interval_s):
                return state
    finally:
        with signals.held():
            if started:
                import ray

                ray.shutdown()
