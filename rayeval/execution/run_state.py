"""Where a run stands between its worker groups: one explicit state, with every transition here.

The ledger actor (``ledger.RunLedger``) holds the one ``RunState`` of a run, because it is the
one thing that outlives the worker groups and that every side reaches: rank 0 of each group
opens an attempt, any rank reports bad input (fatal), the driver's signal handling asks for a
stop, and the driver's ``recovery.Restarting`` tells it each lost group, to be answered whether
to restart. Each of those is one method below, and a move the table ``NEXT`` does not allow is
refused with ``IllegalTransition`` (a bug in rayeval, never a user's error): above all, no
restart after a stop or after bad input.

Plain Python, no Ray: the unit tests drive it directly (tests/unit/test_run_state.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RunPhase(enum.Enum):
    """The run's phases (not a rank's "during the pass over ...", which the ledger keeps per
    rank for the error of a loss)."""
    STARTING = "starting"        # the first worker group is being made; no attempt opened yet
    RUNNING = "running"          # rank 0 of the current group opened its attempt
    RESTARTING = "restarting"    # a group was lost within the budget; a new one is being made
    STOPPING = "stopping"        # the driver was interrupted (SIGINT/SIGTERM): wind down
    FAILED = "failed"            # bad input, a failure no restart helps, or the budget spent

    @property
    def terminal(self) -> bool:
        return self is RunPhase.FAILED


# Where each phase may go. RUNNING -> RUNNING: a group opened an attempt that the driver never
# saw end (one Ray Train would restart itself, were its FailureConfig to retry); STOPPING ->
# FAILED: bad input met while the group winds down still ends the run as bad input.
NEXT: dict[RunPhase, frozenset[RunPhase]] = {
    RunPhase.STARTING: frozenset({RunPhase.RUNNING, RunPhase.RESTARTING, RunPhase.STOPPING,
                                  RunPhase.FAILED}),
    RunPhase.RUNNING: frozenset({RunPhase.RUNNING, RunPhase.RESTARTING, RunPhase.STOPPING,
                                 RunPhase.FAILED}),
    RunPhase.RESTARTING: frozenset({RunPhase.RUNNING, RunPhase.RESTARTING, RunPhase.STOPPING,
                                    RunPhase.FAILED}),
    RunPhase.STOPPING: frozenset({RunPhase.FAILED}),
    RunPhase.FAILED: frozenset(),
}


class Verdict(enum.Enum):
    """The answer to a lost group (``RunState.lost``)."""
    RESTART = "restart"      # make a new group: it goes on from the first unfinished cell
    SPENT = "spent"          # a loss, but recovery.max_restarts restarts are spent
    GIVE_UP = "give up"      # no loss a restart helps, bad input met, or a stop asked for


class IllegalTransition(RuntimeError):
    """A move ``NEXT`` does not allow: a bug in rayeval's run sequence."""


@dataclass
class RunState:
    """The run's phase and what decides its restarts. ``attempts``: groups that opened an
    attempt (rank 0 reached its loop); ``restarts``: new groups the driver made after a loss;
    ``last_loss``: the last loss in words; ``fatal``: the first bad input a worker met (a
    restart would meet it again); ``stopping``: the driver asked the workers to stop (kept
    when bad input ends the run during the wind-down: the workers must still stop)."""
    phase: RunPhase = RunPhase.STARTING
    attempts: int = 0
    restarts: int = 0
    last_loss: str | None = None
    fatal: Exception | None = None
    stopping: bool = False

    def _move(self, to: RunPhase) -> None:
        if to not in NEXT[self.phase]:
            raise IllegalTransition(f"the run cannot go from {self.phase.value} to {to.value}"
                                    f" (attempt {self.attempts}, {self.restarts} restart(s))")
        self.phase = to

    def open_attempt(self) -> int:
        """Rank 0 of a group reached its loop: the attempt's number. A group that comes up
        after a stop or bad input is counted and stays there (it winds down at once)."""
        self.attempts += 1
        if self.phase not in (RunPhase.STOPPING, RunPhase.FAILED):
            self._move(RunPhase.RUNNING)
        return self.attempts

    def stop(self) -> None:
        """The driver was interrupted: the workers stop at their next sync point."""
        self.stopping = True
        if self.phase not in (RunPhase.STOPPING, RunPhase.FAILED):
            self._move(RunPhase.STOPPING)

    def fail(self, error: Exception) -> None:
        """A worker met bad input; the first error is the one the run ends with."""
        if self.fatal is None:
            self.fatal = error
        if not self.phase.terminal:
            self._move(RunPhase.FAILED)

    def lost(self, loss: str | None, budget: int) -> Verdict:
        """The driver's word after a failed fit: ``loss`` (``recovery.Loss.text()``), or None
        when what failed is no loss a new group gets past. A restart is counted here."""
        if self.fatal is not None or self.stopping:
            return Verdict.GIVE_UP
        if loss is None:
            self._move(RunPhase.FAILED)
            return Verdict.GIVE_UP
        self.last_loss = loss
        if self.restarts >= budget:
            self._move(RunPhase.FAILED)
            return Verdict.SPENT
        self._move(RunPhase.RESTARTING)
        self.restarts += 1
        return Verdict.RESTART

    def restarting(self, budget: int) -> str:
        """What a restart is said to be, in the problems the display shows."""
        return (f"{self.last_loss}; restarting the worker group ({self.restarts} of {budget}, "
                "recovery.max_restarts)")
