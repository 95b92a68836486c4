"""Tier 1: the run's one state (``run_state.RunState``): the legal moves, the restart budget,
and the moves it refuses; and the ledger that holds it, without Ray."""

import pickle

import pytest

from rayeval.errors import SpecError
from rayeval.execution.ledger import RunLedger
from rayeval.execution.run_state import (NEXT, IllegalTransition, RunPhase, RunState,
                                         Verdict)


def test_a_run_that_loses_groups_restarts_within_its_budget_then_is_spent():
    s = RunState()
    assert (s.phase, s.attempts, s.restarts) == (RunPhase.STARTING, 0, 0)
    assert s.open_attempt() == 1 and s.phase is RunPhase.RUNNING
    assert s.lost("worker rank 1 was lost while loading a.pt (killed)", 3) is Verdict.RESTART
    assert (s.phase, s.restarts) == (RunPhase.RESTARTING, 1)
    assert s.restarting(3) == ("worker rank 1 was lost while loading a.pt (killed); "
                               "restarting the worker group (1 of 3, recovery.max_restarts)")
    assert s.open_attempt() == 2 and s.phase is RunPhase.RUNNING
    assert s.lost("a worker was lost while the worker group started (x)", 3) is Verdict.RESTART
    assert s.lost("again, before the group opened", 3) is Verdict.RESTART, \
        "a group lost while it starts never opened its attempt: RESTARTING -> RESTARTING"
    assert s.restarts == 3
    assert s.lost("the last one", 3) is Verdict.SPENT
    assert (s.phase, s.restarts, s.last_loss) == (RunPhase.FAILED, 3, "the last one")
    assert s.phase.terminal


def test_no_budget_a_failure_that_is_no_loss_and_a_first_group_lost_while_starting():
    s = RunState()
    assert s.lost("lost at once", 0) is Verdict.SPENT and s.phase is RunPhase.FAILED
    s = RunState()
    assert s.lost("the first group never opened", 1) is Verdict.RESTART
    s = RunState()
    s.open_attempt()
    assert s.lost(None, 3) is Verdict.GIVE_UP and s.phase is RunPhase.FAILED
    assert s.restarts == 0


def test_bad_input_and_a_stop_end_the_run_and_refuse_a_restart():
    s = RunState()
    s.open_attempt()
    first, second = SpecError("a: bad"), SpecError("b: bad")
    s.fail(first)
    s.fail(second)
    assert s.phase is RunPhase.FAILED and s.fatal is first, "the first bad input is kept"
    assert s.lost("a worker was lost", 3) is Verdict.GIVE_UP and s.restarts == 0
    s = RunState()
    s.open_attempt()
    s.stop()
    s.stop()                                       # a second signal changes nothing
    assert s.phase is RunPhase.STOPPING and s.stopping
    assert s.lost("a worker was lost", 3) is Verdict.GIVE_UP
    assert s.open_attempt() == 2 and s.phase is RunPhase.STOPPING, \
        "a group already on its way is counted and winds down"
    s.fail(first)
    assert s.phase is RunPhase.FAILED and s.stopping, "the workers must still stop"


@pytest.mark.parametrize("phase", [RunPhase.STOPPING, RunPhase.FAILED])
def test_a_restart_after_a_stop_or_a_failure_is_refused(phase):
    s = RunState(phase=phase)                     # as if the verdict had been skipped
    with pytest.raises(IllegalTransition, match=f"from {phase.value} to restarting"):
        s._move(RunPhase.RESTARTING)
    assert s.phase is phase
    assert NEXT[RunPhase.FAILED] == frozenset(), "failed is terminal"
    assert all(RunPhase.STARTING not in to for to in NEXT.values()), "nothing goes back"


def test_the_ledger_holds_the_state_and_says_a_restart_among_the_problems():
    ledger = RunLedger([("k0", "/c/a.pt", 10)])
    assert ledger.start_attempt() == 1 and ledger.get_attempts() == 1
    assert ledger.lost("worker rank 1 was lost (x)", 1) == (Verdict.RESTART, 1)
    assert ledger.snapshot()["problems"] == [
        "worker rank 1 was lost (x); restarting the worker group (1 of 1, "
        "recovery.max_restarts)"]
    assert ledger.start_attempt() == 2
    assert ledger.lost("worker rank 0 was lost (y)", 1) == (Verdict.SPENT, 1)
    assert ledger.state.phase is RunPhase.FAILED
    verdict, _ = pickle.loads(pickle.dumps((Verdict.SPENT, 1)))     # through Ray
    assert verdict is Verdict.SPENT
    ledger = RunLedger([])
    ledger.stop()
    assert ledger.rows(0, 0, 5) is True and ledger.take() is None and ledger.stopping()
    ledger.fatal(SpecError("bad"))
    assert ledger.get_fatal().message == "bad"
