"""Surviving the loss of a worker: the restart budget, and what a failed fit is said to be.

Ray Train 2.60 retries a worker group's errors (``FailureConfig.max_failures``) but only two
kinds of controller error (``WorkerGroupStartupFailedError``/``TimeoutError``, and those without
a limit by default); a worker killed while the group starts often surfaces as another one (a
``RayActorError`` or ``RayTaskError`` from the process group's set-up, raised through the
controller), which Ray gives up on at once. So rayeval counts every restart itself: Ray Train
is told to retry nothing (``failure_config``), and ``Restarting.fit`` runs a new fit on the same
run ledger after each loss, up to ``recovery.max_restarts`` restarts in all, whatever the
moment of the loss (the count and the verdict: ``run_state.RunState``). The new group asks the
ledger which cells are finished and goes on from the first unfinished one. A restart costs a
new Train controller beside the new worker group (a second or two here); in exchange the
budget is exact.

Not retried: bad input a worker met (the ledger's fatal error: it would fail again), a bug (an
exception of a type only wrong code raises, ``BUGS``: a new group would meet it again), a run the
driver was told to stop, and controller errors that are no loss (a resource request the cluster
can never meet, a runtime environment that cannot be set up, a bug).

Test hook: with ``RAYEVAL_TEST_KILL=phase:rank:attempt[:nth[:bug]]`` set in the driver's
environment (forwarded to the workers), rank ``rank`` of attempt ``attempt`` (``*``: of every
attempt) kills itself with SIGKILL at
the ``nth`` (default 1) time it enters ``phase`` (``load``, ``pass``, ``reduce``, ``publish``),
or with ``bug`` raises a TypeError there, as a bug would: see ``fault_point``. Unset, it costs
one comparison with None per phase.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from rayeval.errors import WorkerGroupError, RayevalError, RunError, reason

KILL_ENV = "RAYEVAL_TEST_KILL"
_KILL = os.environ.get(KILL_ENV) or None       # read once, in each worker process
_entered: dict[str, int] = {}                   # phase -> times this process entered it

STARTING = "while the worker group started"
STALLED = "stalled; recovery.stall_timeout_s"      # in dist.explain's message of a stall


def fault_point(phase: str, rank: int, attempt, before=None) -> None:
    """The test hook (see the module's docstring): SIGKILL this process here if asked.
    ``attempt()``: this attempt's number (asked only when armed: a rank other than 0 may have
    read it before rank 0 opened the attempt). ``before`` runs first (the worker sends the
    ledger its phase, so the error can say it)."""
    if _KILL is None:
        return
    want = _KILL.split(":")
    nth = int(want[3]) if len(want) > 3 else 1
    if want[0] != phase or int(want[1]) != rank or want[2] not in ("*", str(attempt())):
        return
    _entered[phase] = _entered.get(phase, 0) + 1
    if _entered[phase] != nth:
        return
    import signal

    if before is not None:
        before()
    if want[4:] == ["bug"]:
        raise TypeError(f"a bug planted by {KILL_ENV} at {phase}")
    os.kill(os.getpid(), signal.SIGKILL)


def worker_env() -> dict:
    """The workers' runtime environment: rayeval's worker knobs (``constants.WORKER_ENVS``)
    and the test hook's variable, as the driver has them. Ray's worker processes do not
    inherit a variable set after Ray started, nor one set on another machine than theirs."""
    from rayeval.config import constants

    given = {k: os.environ[k] for k in (*constants.WORKER_ENVS, KILL_ENV) if os.environ.get(k)}
    return {"env_vars": given} if given else {}


def failure_config():
    """Ray Train retries nothing: every restart is ``Restarting``'s, so it is counted once."""
    import ray.train

    return ray.train.FailureConfig(max_failures=0, controller_failure_limit=0)


@dataclass(frozen=True)
class Loss:
    """A failed attempt that a new worker group may get past: what was lost, and when."""
    what: str            # "worker rank 1", "a worker"
    when: str            # "during the all-reduce of ...", STARTING
    why: str             # the error's own first line
    stalled: WorkerGroupError | None = None     # a rank stalled (our own message says it all)

    def text(self) -> str:
        if self.stalled is not None:
            return self.stalled.message
        return f"{self.what} was lost {self.when} ({self.why})"


# What only wrong code raises, never a lost peer, node or connection (those come as Ray's errors,
# rayeval's WorkerGroupError, or torch's RuntimeError/DistError, OSError): a worker failing with one
# ends the run at once instead of being restarted into the same failure.
BUGS = (TypeError, AttributeError, NameError, KeyError, IndexError, ZeroDivisionError,
        NotImplementedError, ImportError)


def _is_bug(failure: BaseException) -> bool:
    """One of ``BUGS``, and not pyarrow's subclasses of them (ArrowTypeError, ArrowKeyError,
    ...: about the data read, which keeps the old way: restarted, then said as a loss)."""
    import pyarrow as pa

    return isinstance(failure, BUGS) and not isinstance(failure, pa.ArrowException)


def _is_loss(failure: BaseException) -> bool:
    """Whether a controller's own error is a worker (or its node) lost: Ray's errors about
    actors, tasks and objects, and the worker group's start-up failures. A request the
    cluster can never meet or a runtime environment that cannot be set up is no loss."""
    from ray import exceptions as rex
    from rayeval.compat import train_exceptions    # ray.train.v2._internal's, ray 2.60
    tex = train_exceptions()

    if isinstance(failure, (rex.RuntimeEnvSetupError, rex.ActorUnschedulableError,
                            rex.TaskUnschedulableError)):
        return False
    return isinstance(failure, (rex.RayError, tex.WorkerGroupStartupFailedError,
                                tex.WorkerGroupStartupTimeoutError,
                                tex.WorkerHealthCheckFailedError,
                                tex.WorkerHealthCheckTimeoutError))


def _ours(error: BaseException) -> RayevalError | None:
    """A rayeval error at the root of a worker's failure (Ray wraps it), if any."""
    while error is not None:
        if isinstance(error, RayevalError):
            return error
        error = error.__cause__ or getattr(error, "cause", None)
    return None


def classify(error: BaseException, phase_of, started: bool, workers: int = 0
             ) -> Loss | None:
    """The loss a failed fit came to, or None when a restart would not help (see the
    module's docstring). ``phase_of(rank)``: where that rank was (the ledger's last word);
    ``started``: whether this attempt's workers reached their loop; ``workers``: the group's
    size (a survivor that lost an unnamed peer names it when only one rank is unaccounted)."""
    import ray.train
    from ray.exceptions import RayActorError

    if isinstance(error, ray.train.ControllerError):
        failure = error.controller_failure
        if not _is_loss(failure):
            return None
        return Loss("a worker", STARTING, reason(failure, typed=True))
    if not isinstance(error, ray.train.WorkerGroupError):
        return None
    failures = getattr(error, "worker_failures", {}) or {}

    def when(rank):
        return (phase_of(rank) or "before its first checkpoint") if started else STARTING

    for rank in sorted(failures):               # a worker that died says the most
        died = getattr(failures[rank], "health_check_failure", failures[rank])  # Ray wraps
        if isinstance(died, RayActorError):
            return Loss(f"worker rank {rank}", when(rank), reason(died, typed=True))
    if any(_is_bug(f) for f in failures.values()):
        return None
    for rank in sorted(failures):
        ours = _ours(failures[rank])
        if isinstance(ours, WorkerGroupError):
            if STALLED in ours.message:
                return Loss(f"worker rank {rank}", when(rank), ours.message, stalled=ours)
            # A survivor saw its peer go (often before Ray's health check saw the death):
            # the peer is the loss, at the phase it last reported.
            named = re.search(r"worker rank (\d+) did not reach", ours.message)
            silent = set(range(workers)) - set(failures)   # the dead raise nothing themselves
            peer = int(named.group(1)) if named else \
                (silent.pop() if len(silent) == 1 else None)
            if peer is None:
                return Loss(f"a peer of worker rank {rank}", when(rank), ours.message)
            return Loss(f"worker rank {peer}", when(peer), f"rank {rank}: {ours.message}")
        if ours is not None:
            return None        # bad input: the ledger has it, a restart would meet it again
    for rank in sorted(failures):
        return Loss(f"worker rank {rank}", when(rank), reason(failures[rank], typed=True))
    return None


def spent(restarts: int, budget: int) -> str:
    return (f" after {restarts} restart(s) (recovery.max_restarts: {budget})" if budget else
            " (recovery.max_restarts is 0)")


def final_error(loss: Loss, restarts: int, budget: int) -> RunError:
    """The one-line error of a run whose last loss spent the budget."""
    if loss.stalled is not None:
        return WorkerGroupError(f"{loss.stalled.message}{spent(restarts, budget)}")
    return RunError(f"{loss.what} was lost {loss.when}{spent(restarts, budget)}: {loss.why}; "
                    "see the worker logs (--verbose) for why: killed, out of memory, a lost "
                    "node, or a crash")


def worker_group_error(error, budget: int) -> RayevalError:
    """A worker group's failure as rayeval says it, where no ledger knows the phases."""
    loss = classify(error, lambda rank: None, started=True)
    if loss is not None:
        return final_error(loss, budget, budget)
    failures = sorted((getattr(error, "worker_failures", {}) or {}).items())
    ours = [o for o in (_ours(f) for _, f in failures) if o is not None]
    for said in ours:
        if not isinstance(said, WorkerGroupError):      # bad input says the most
            return said
    for rank, failure in failures:
        if _is_bug(failure):                      # before a peer's "rank N stopped"
            return RunError(f"worker rank {rank} failed on a bug, not restarted: "
                            f"{reason(failure, typed=True)}; --debug shows the worker's "
                            "traceback", str(error), cause=type(failure).__name__,
                            reason=reason(failure))
    if ours:
        return ours[0]
    return RunError(f"the evaluation run failed: {reason(error, typed=True)}")


class Restarting:
    """What ``driver.Fit`` runs: fits of ``make_trainer()`` on one run ``ledger``
    (``ledger.DriverLedger``), a new one after each loss, at most ``budget`` restarts. Whether
    to restart is the run's state's to say (``run_state.RunState.lost``: it counts the
    restarts, and refuses one after a stop or bad input). The last loss's error is rayeval's
    own one-line error (what was lost, when, the restarts); an error that is no loss is raised
    as it came."""

    def __init__(self, make_trainer, ledger, budget: int):
        self.make_trainer = make_trainer
        self.ledger = ledger
        self.budget = budget

    def fit(self):
        import ray.train

        from rayeval.execution.run_state import Verdict

        while True:
            attempts = self.ledger.attempts()
            trainer = self.make_trainer()
            try:
                return trainer.fit()
            except ray.train.TrainingFailedError as e:
                error = e
            started = self.ledger.attempts() > attempts
            loss = classify(error, self.ledger.phase_of, started,
                            trainer.scaling_config.num_workers)
            verdict, restarts = self.ledger.lost(None if loss is None else loss.text(),
                                                 self.budget)
            if verdict is Verdict.GIVE_UP:
                raise error
            if verdict is Verdict.SPENT:
                raise final_error(loss, restarts, self.budget) from None
