"""The run's ledger: where a run stands, written by the workers and read by the driver.

One small ``RunLedger`` actor, owned by the driver, outlives worker-group restarts. (A ledger,
not a "tracker" or "coordinator": it records and answers, it decides nothing, and the experiment
trackers of ``rayeval.reporting.trackers`` and Ray Data's split coordinator keep their words.)
The workers tell it how many rows they have done in the checkpoint in flight (throttled,
fire-and-forget) and rank 0 tells it each finished cell with its outcome. The driver reads it
to follow the run (the display is ``rayeval.reporting.display``), and a restarted group reads it
to go on from the first unfinished checkpoint. It holds the run's one ``run_state.RunState``:
attempts, restarts, the last loss, bad input, a stop.

Each side has a typed client, and no other module calls the actor's ``.remote`` methods:
``WorkerLedger`` for the workers, ``DriverLedger`` for the driver (its follow loop and
``recovery.Restarting``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rayeval.execution.run_state import RunState, Verdict

if TYPE_CHECKING:
    from rayeval.plan.cells import Cell, CellOutcome, Plan

SETTING_UP = "setting up the workers"     # what the workers do from the attempt's opening


class RunLedger:
    """Plain Python state; the driver runs it as a Ray actor with ``ray.remote``."""

    def __init__(self, cells: list[tuple[str, str, int]]):
        self.cells = list(cells)                  # (key, checkpoint location, rows), plan order
        self.outcomes: dict = {}                  # key -> CellOutcome of a finished cell
        self.errors: dict[str, tuple] = {}        # key -> the first rank's (error, traceback)
        self.loads: dict[tuple[int, str], int] = {}   # (rank, checkpoint) -> loads
        self.in_flight: dict[int, tuple[int, int]] = {}   # rank -> (cell index, rows done)
        self.state = RunState()                   # attempts, restarts, bad input, a stop
        self.problems: list[str] = []             # what failed the earlier attempts
        self.nodes: dict[int, str] = {}           # rank -> node id, the latest attempt's
        self.times: dict[int, dict] = {}          # rank -> its loop's timing (--profile)
        self.queue: list = []                     # standing group: (index, key, Cell, base)
        self.bases: dict[str, bytes] = {}         # standing group: base token -> its plan
        self.taken: list = []                     # handed to the group, maybe unfinished
        self.closed = False                       # standing group: no more cells will come
        self.phases: dict[int, str] = {}          # rank -> where it is, this attempt (a loss
                                                  # says it: ``recovery``)
        self.activities: dict[int, tuple[str, float]] = {}   # rank -> (what it is doing, in
                                                  # words; since when, on this actor's clock)

    def start_attempt(self) -> int:
        attempt = self.state.open_attempt()
        self.in_flight.clear()      # the nodes are not cleared: another rank may have said hello
        self.phases.clear()
        # Rank 0 opens the attempt as its loop begins: the workers are setting up from here (a
        # snapshot before any rank says so would show "? rows/s" with nothing moving)
        self.activities = {0: (SETTING_UP, time.monotonic())}
        # A standing group (watch) that restarts takes again the cells it had not finished.
        self.queue = [c for c in self.taken if c[1] not in self.outcomes] + self.queue
        self.taken = []
        return attempt

    # --- a standing worker group (``rayeval watch``): cells are fed while it runs ----------

    def add_cells(self, cells: list[tuple[str, str, int]], pending: list[bytes],
                  base: tuple[str, bytes] | None = None) -> int:
        """More cells for the standing group: (key, location, rows) for progress, and the
        plan's ``Cell`` objects pickled (this actor never unpickles them: that would import
        the plan's modules, torch among them), queued in order. ``base``: (token, pickled
        plan without cells, or None once sent): the group sets itself up for that plan
        before its cells when it has not yet. The index of the first of them
        (``snapshot(since=)``)."""
        token = None
        if base is not None:
            token = base[0]
            if base[1] is not None:       # None: sent with earlier cells (kept since)
                self.bases[token] = base[1]
        first = len(self.cells)
        for meta, blob in zip(cells, pending):
            self.queue.append((len(self.cells), meta[0], blob, token))
            self.cells.append(meta)
        return first

    def base(self, token: str) -> bytes:
        """A plan's pickle that cells were queued with (``add_cells``)."""
        return self.bases[token]

    def take(self):
        """The queued cells as (index, pickled Cell, base token) (rank 0 of the
        standing group asks), [] when none is queued, or None when the group is to stop (the
        feed closed, or a signal)."""
        if self.state.stopping or (self.closed and not self.queue):
            return None
        batch, self.queue = self.queue, []
        self.taken += batch
        return [(index, blob, token) for index, _, blob, token in batch]

    def close(self) -> None:
        """No more cells: the standing group ends once the queue is empty."""
        self.closed = True

    def finished(self, keys: list[str]) -> bool:
        return all(k in self.outcomes for k in keys)

    def hello(self, rank: int, node: str) -> None:
        self.nodes[rank] = node

    def node_count(self) -> int:
        return len(set(self.nodes.values()))

    def node_ids(self) -> list[str]:
        """Each rank's node id, in rank order (each said it at its attempt's start)."""
        return [self.nodes[r] for r in sorted(self.nodes)]

    def ranks_up(self) -> int:
        """How many ranks said hello (a standing group is up once all have)."""
        return len(self.nodes)

    def get_attempts(self) -> int:
        return self.state.attempts

    def done_keys(self) -> list[str]:
        return list(self.outcomes)

    def rows(self, rank: int, index: int, rows: int) -> bool:
        """Rows done by a rank in the cell in flight; answers whether to stop."""
        self.in_flight[rank] = (index, rows)
        return self.state.stopping

    def stop(self) -> None:
        self.state.stop()

    def stopping(self) -> bool:
        return self.state.stopping

    def phase(self, rank: int, where: str) -> None:
        self.phases[rank] = where

    def phase_of(self, rank: int) -> str | None:
        return self.phases.get(rank)

    def doing(self, rank: int, what: str) -> None:
        """What a rank is doing now ("starting the vLLM engine"), timed from when it began."""
        if self.activities.get(rank, ("",))[0] != what:
            self.activities[rank] = (what, time.monotonic())

    def activity(self) -> tuple[str, float] | None:
        """The activity that has lasted longest over the ranks (what the run waits on), and
        for how many seconds; None before any rank said."""
        if not self.activities:
            return None
        what, since = min(self.activities.values(), key=lambda a: a[1])
        return what, time.monotonic() - since

    def cell_error(self, key: str, message: str, detail: str | None = None) -> None:
        if key not in self.errors:
            self.errors[key] = (message, detail)

    def error_of(self, key: str) -> tuple[str, str | None] | None:
        """The first rank's (message, user traceback) for a cell, or None."""
        return self.errors.get(key)

    def loaded(self, rank: int, location: str) -> None:
        self.loads[(rank, location)] = self.loads.get((rank, location), 0) + 1

    def load_counts(self) -> dict[tuple[int, str], int]:
        return dict(self.loads)

    def finish(self, key: str, outcome) -> None:
        self.outcomes[key] = outcome
        for rank, (index, _) in list(self.in_flight.items()):
            if self.cells[index][0] == key:
                del self.in_flight[rank]

    def problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)

    def fatal(self, error: Exception) -> None:
        self.state.fail(error)

    def get_fatal(self) -> Exception | None:
        return self.state.fatal

    def lost(self, loss: str | None, budget: int) -> tuple[Verdict, int]:
        """The driver lost a group (``RunState.lost``): the verdict and the restarts so far;
        a restart is said among the problems."""
        verdict = self.state.lost(loss, budget)
        if verdict is Verdict.RESTART:
            self.problem(self.state.restarting(budget))
        return verdict, self.state.restarts

    def results(self) -> dict:
        return dict(self.outcomes)

    def timing(self, rank: int, entered: float, left: float, phases: dict) -> None:
        """A rank's wall-clock entry to and exit from its loop, and its phases (--profile)."""
        self.times[rank] = {"entered": entered, "left": left, "phases": phases}

    def timings(self) -> dict:
        return dict(self.times)

    def snapshot(self, since: int = 0) -> dict:
        """The progress of the cells from the ``since``-th on (a service's run: its own, added
        at that index, not those of the runs before it on the same group)."""
        cells = self.cells[since:]
        mine = {key for key, _, _ in cells}
        outcomes = {k: o for k, o in self.outcomes.items() if not since or k in mine}
        flying = [(i, r) for i, r in self.in_flight.values()
                  if i >= since and self.cells[i][0] not in self.outcomes]
        current = [i for i, _ in flying]
        return {
            "total": len(cells),
            "done": len(outcomes),
            "failed": sum(1 for o in outcomes.values() if not o.ok),
            "rows_done": sum(rows for key, _, rows in cells if key in outcomes),
            "rows_in_flight": sum(r for _, r in flying),
            "rows_total": sum(rows for _, _, rows in cells),
            "current": self.cells[min(current)][1] if current else None,
            "attempts": self.state.attempts,
            "problems": list(self.problems),
            "activity": self.activity(),
        }


class WorkerLedger:
    """A worker's side of the ledger; every call is a no-op without one."""

    INTERVAL_S = 0.5

    def __init__(self, ledger, rank: int):
        self.ledger = ledger
        self.rank = rank
        self._last = 0.0
        self._answer = None          # the ledger's reply to the last rows report
        self._stop = False
        self._doing: str | None = None   # the activity last said (``doing``)

    def _get(self, ref, timeout: float = 30.0):
        import ray

        return ray.get(ref, timeout=timeout)

    def start(self) -> tuple[int, set[str], Exception | None]:
        """(this attempt's number, keys of cells already finished, an earlier attempt's fatal
        error). Rank 0 opens the attempt; the others only read."""
        if self.ledger is None:
            return 1, set(), None
        if self.rank == 0:
            attempt = self._get(self.ledger.start_attempt.remote())
        else:
            attempt = self._get(self.ledger.get_attempts.remote())
        import ray

        self._get(self.ledger.hello.remote(self.rank, ray.get_runtime_context().get_node_id()))
        return (attempt, set(self._get(self.ledger.done_keys.remote())),
                self._get(self.ledger.get_fatal.remote()))

    def rows(self, index: int, rows: int, force: bool = False) -> None:
        """Report rows done (throttled); the answer of the previous report says whether the
        driver asked the group to stop (read by ``stopping``)."""
        now = time.monotonic()
        if self.ledger is not None and (force or now - self._last >= self.INTERVAL_S):
            self._last = now
            if self._answer is not None:
                self._take_answer()
            self._answer = self.ledger.rows.remote(self.rank, index, rows)

    def _take_answer(self) -> None:
        import ray

        ready, _ = ray.wait([self._answer], timeout=0)
        if ready:
            self._stop = self._stop or bool(ray.get(ready[0]))
            self._answer = None

    def stopping(self) -> bool:
        """Whether the driver asked the group to stop (SIGINT/SIGTERM): never blocks."""
        if self.ledger is not None and self._answer is not None:
            self._take_answer()
        return self._stop

    def finish(self, key: str, outcome) -> None:
        if self.ledger is not None:
            self._get(self.ledger.finish.remote(key, outcome))

    def attempt(self) -> int:
        """The attempt the ledger has open now (1 without one)."""
        return self._get(self.ledger.get_attempts.remote()) if self.ledger is not None else 1

    def phase(self, where: str):
        """Where this rank is (``during the pass over ...``), for the error if it is lost:
        fire-and-forget; the reference is returned for the one caller that must wait."""
        if self.ledger is not None:
            return self.ledger.phase.remote(self.rank, where)
        return None

    def doing(self, what: str) -> None:
        """What this rank is doing now, in words, for the driver's progress line while no row
        moves: fire-and-forget, and only when it changes."""
        if self.ledger is not None and what != self._doing:
            self._doing = what
            self.ledger.doing.remote(self.rank, what)

    def take(self):
        """Rank 0 of a standing group: the next cells (see ``RunLedger.take``)."""
        return self._get(self.ledger.take.remote())

    def base(self, token: str) -> bytes:
        """Rank 0 of a standing group: the plan its next cells belong to (``RunLedger.base``)."""
        return self._get(self.ledger.base.remote(token))

    def nodes(self) -> list[str]:
        """Every rank's node id, in rank order (``RunLedger.node_ids``); none without a
        ledger."""
        return [] if self.ledger is None else self._get(self.ledger.node_ids.remote())

    def timing(self, entered: float, left: float, phases: dict) -> None:
        if self.ledger is not None:
            self._get(self.ledger.timing.remote(self.rank, entered, left, phases), 5.0)

    def loaded(self, location: str) -> None:
        if self.ledger is not None:
            self.ledger.loaded.remote(self.rank, location)

    def cell_error(self, key: str, message: str, detail: str | None = None) -> None:
        """This rank's error in a cell (and the user's traceback behind it, for --debug), for
        rank 0 to publish (before the cell's reduce)."""
        if self.ledger is not None:
            self._get(self.ledger.cell_error.remote(key, message, detail))

    def error_of(self, key: str) -> tuple[str, str | None]:
        """The (message, traceback) another rank recorded for a cell; (None, None) if none."""
        found = self._get(self.ledger.error_of.remote(key)) if self.ledger is not None \
            else None
        return found or (None, None)

    def problem(self, message: str) -> None:
        """Say why this attempt is failing, before the error takes the group down."""
        if self.ledger is not None:
            try:
                self._get(self.ledger.problem.remote(f"rank {self.rank}: {message}"), 5.0)
            except Exception:   # noqa: BLE001 - the original error matters more
                pass

    def fatal(self, error: Exception) -> None:
        if self.ledger is not None:
            try:
                self._get(self.ledger.fatal.remote(error), 5.0)
            except Exception:   # noqa: BLE001
                pass


class DriverLedger:
    """The driver's side of the ledger: one method per call the driver makes, each waiting
    for the answer (``timeout`` in seconds where a call must not hang on a Ray going down)."""

    def __init__(self, handle):
        self.handle = handle          # the actor; the workers get it in their loop's config

    @classmethod
    def start(cls, cells: list[tuple[str, str, int]]) -> DriverLedger:
        """A new ledger actor for these cells ((key, location, rows), plan order). It holds
        no CPU: it must never wait for the workers' resources. It lives on the driver's node,
        as Ray Train's controller does: on any other node, the loss of that node would end a
        run that the worker group survives (tests/e2e/test_lost_node.py: about one run in
        three, before it was pinned)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return cls(ray.remote(RunLedger).options(num_cpus=0, scheduling_strategy=here)
                   .remote(cells))

    @classmethod
    def of(cls, ledger) -> DriverLedger:
        """A client for a ledger actor, or the client itself."""
        return ledger if isinstance(ledger, DriverLedger) else cls(ledger)

    @staticmethod
    def cells_of(plan: Plan, cells: tuple[Cell, ...] | None = None) -> list[tuple[str, str, int]]:
        """What the ledger holds of each cell: (key, checkpoint location, rows)."""
        return [(c.key, c.checkpoint.location, plan.evaluation(c.evaluation).data.num_rows)
                for c in (plan.cells if cells is None else cells)]

    def _get(self, ref, timeout: float | None = None):
        import ray

        return ray.get(ref, timeout=timeout)

    def snapshot(self, since: int = 0) -> dict:
        return self._get(self.handle.snapshot.remote(since))

    def results(self) -> dict[str, CellOutcome]:
        return self._get(self.handle.results.remote())

    def timings(self) -> dict:
        return self._get(self.handle.timings.remote())

    def node_count(self) -> int:
        return self._get(self.handle.node_count.remote())

    def load_counts(self) -> dict[tuple[int, str], int]:
        return self._get(self.handle.load_counts.remote())

    def get_fatal(self) -> Exception | None:
        return self._get(self.handle.get_fatal.remote())

    def attempts(self) -> int:
        """The attempts opened so far (rank 0 of each group opens one)."""
        return self._get(self.handle.get_attempts.remote())

    def phase_of(self, rank: int) -> str | None:
        """Where a rank last said it was (``WorkerLedger.phase``), for a loss's error."""
        return self._get(self.handle.phase_of.remote(rank))

    def lost(self, loss: str | None, budget: int) -> tuple[Verdict, int]:
        """A failed fit's loss in words (None: no loss a restart helps): whether to restart
        (``RunState.lost``), and the restarts so far."""
        return self._get(self.handle.lost.remote(loss, budget))

    def ranks_up(self) -> int:
        return self._get(self.handle.ranks_up.remote())

    def add_cells(self, plan: Plan, base: tuple[str, bytes] | None = None) -> int:
        """The plan's cells for the standing group, pickled here (see ``RunLedger.add_cells``);
        the index of the first."""
        import pickle

        return self._get(self.handle.add_cells.remote(
            self.cells_of(plan), [pickle.dumps(c) for c in plan.cells], base))

    def finished(self, keys: list[str]) -> bool:
        return self._get(self.handle.finished.remote(keys))

    def stop(self, timeout: float) -> None:
        """Ask the workers to stop at their next sync point (SIGINT/SIGTERM)."""
        self._get(self.handle.stop.remote(), timeout)

    def close(self, timeout: float) -> None:
        """No more cells for the standing group."""
        self._get(self.handle.close.remote(), timeout)

    def kill(self) -> None:
        import ray

        ray.kill(self.handle)
