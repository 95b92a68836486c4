"""What a failed fit is said to be (``recovery.classify``), from Ray Train's own errors: the
losses that restart the group, those that do not, and the one-line error once the budget is
spent. The real kills are in tests/integration/test_recovery.py."""

import pytest
import ray.train
from ray.exceptions import ActorDiedError, RuntimeEnvSetupError
from ray.train.v2._internal.exceptions import (InsufficientClusterResourcesError,
                                               WorkerGroupStartupFailedError,
                                               WorkerHealthCheckFailedError)

from rayeval.execution import recovery
from rayeval.errors import CheckpointError, GroupError, RunError


def no_phase(rank):
    return None


@pytest.mark.parametrize("failure", [ActorDiedError(), WorkerGroupStartupFailedError("x")])
def test_a_worker_lost_while_the_group_starts_is_a_loss(failure):
    # The defect of issue 24: Ray Train gave up on a ControllerError wrapping a worker's death.
    loss = recovery.classify(ray.train.ControllerError(failure), no_phase, started=False)
    assert loss is not None and loss.when == recovery.STARTING
    message = recovery.final_error(loss, 3, 3).message
    assert message.startswith("a worker was lost while the worker group started after 3 "
                              "restart(s) (recovery.max_restarts: 3): "), message
    assert "\n" not in message


@pytest.mark.parametrize("failure", [InsufficientClusterResourcesError("too big"),
                                     RuntimeEnvSetupError("no"), ValueError("a bug")])
def test_controller_errors_that_are_no_loss_are_not_retried(failure):
    assert recovery.classify(ray.train.ControllerError(failure), no_phase, False) is None


def test_a_dead_rank_is_named_with_the_phase_it_last_reported():
    died = WorkerHealthCheckFailedError("health check failed", ActorDiedError())
    error = ray.train.WorkerGroupError("x", {0: GroupError("worker rank 0 lost a peer at the "
                                                           "load of a.pt: another worker "
                                                           "died"), 1: died})
    loss = recovery.classify(error, {1: "during the pass over a.pt on d"}.get, started=True,
                             workers=2)
    assert (loss.what, loss.when) == ("worker rank 1", "during the pass over a.pt on d")
    assert recovery.final_error(loss, 0, 0).message.startswith(
        "worker rank 1 was lost during the pass over a.pt on d (recovery.max_restarts is 0): ")


def test_a_peer_only_a_survivor_saw_die_is_the_rank_unaccounted_for():
    error = ray.train.WorkerGroupError("x", {0: GroupError("worker rank 0 lost a peer at the "
                                                           "load of a.pt: another worker died")})
    loss = recovery.classify(error, {1: "while loading a.pt"}.get, started=True, workers=2)
    assert (loss.what, loss.when) == ("worker rank 1", "while loading a.pt")


def test_a_stall_keeps_its_own_message_and_bad_input_is_not_retried():
    stall = GroupError("worker rank 1 did not reach x; the others waited 5 s (stalled; "
                       "recovery.stall_timeout_s sets the limit)")
    loss = recovery.classify(ray.train.WorkerGroupError("x", {0: stall}), no_phase, True, 2)
    error = recovery.final_error(loss, 1, 1)
    assert isinstance(error, GroupError)
    assert error.message == stall.message + " after 1 restart(s) (recovery.max_restarts: 1)"
    bad = ray.train.WorkerGroupError("x", {0: CheckpointError("a.pt: corrupt")})
    assert recovery.classify(bad, no_phase, True, 2) is None
    assert isinstance(recovery.worker_group_error(bad, 3), CheckpointError)


def test_the_test_hook_costs_nothing_unset_and_is_not_forwarded(monkeypatch):
    from rayeval.config import constants

    for name in (recovery.KILL_ENV, *constants.WORKER_ENVS):    # (tests/conftest.py sets one)
        monkeypatch.delenv(name, raising=False)
    assert recovery.worker_env() == {}
    monkeypatch.setattr(recovery, "_KILL", None)
    recovery.fault_point("reduce", 1, lambda: pytest.fail("asked the attempt"))
    assert isinstance(recovery.final_error(recovery.Loss("a", "b", "c"), 0, 0), RunError)


@pytest.mark.parametrize("bug", [TypeError("unsupported operand"), KeyError("logits"),
                                 AttributeError("'NoneType' object has no attribute 'x'")])
def test_a_bug_in_a_worker_ends_the_run_at_once_naming_the_rank(bug):
    # Restarting would meet it again: the run ends with the rank and the error, not "lost".
    error = ray.train.WorkerGroupError("rank 1 traceback ...", {1: bug})
    assert recovery.classify(error, no_phase, started=True, workers=2) is None
    said = recovery.worker_group_error(error, 3)
    assert said.message.startswith(f"worker rank 1 failed on a bug, not restarted: "
                                   f"{type(bug).__name__}: "), said.message
    assert said.cause == type(bug).__name__ and "rank 1 traceback" in said.detail


def test_a_bug_beside_a_dead_rank_is_still_a_loss():
    # A death says the most: the bug may be the survivor's reaction to it.
    died = WorkerHealthCheckFailedError("health check failed", ActorDiedError())
    error = ray.train.WorkerGroupError("x", {0: TypeError("half a batch"), 1: died})
    loss = recovery.classify(error, no_phase, started=True, workers=2)
    assert loss is not None and loss.what == "worker rank 1"


def test_other_worker_errors_are_losses():
    # A lost peer can surface as torch's RuntimeError in a survivor's collective.
    error = ray.train.WorkerGroupError("x", {0: RuntimeError("Connection closed by peer")})
    loss = recovery.classify(error, no_phase, started=True, workers=2)
    assert loss is not None and loss.what == "worker rank 0"


def test_a_bug_is_said_before_a_peer_s_word_and_arrow_s_errors_are_no_bug():
    import pyarrow as pa

    peer = GroupError("worker rank 1 did not reach the all-reduce of a.pt; it stopped or died")
    error = ray.train.WorkerGroupError("x", {0: peer, 1: TypeError("bad operand")})
    assert recovery.classify(error, no_phase, started=True, workers=2) is None
    assert recovery.worker_group_error(error, 3).message.startswith(
        "worker rank 1 failed on a bug, not restarted: TypeError: bad operand")
    data = ray.train.WorkerGroupError("x", {0: pa.ArrowTypeError("int64 vs string")})
    assert recovery.classify(data, no_phase, started=True, workers=1) is not None
