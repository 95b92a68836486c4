"""Tier 3: failures in a real local Ray run. A worker killed by SIGKILL mid-sweep is replaced
and the sweep goes on from the first unfinished checkpoint with the numbers of an undisturbed
run; a worker that hangs fails the run within the stall timeout, naming the worker and the
checkpoint."""

import os
import re
import threading
import time

import pytest

from rayeval._internal.execution.driver import run_sweep
from rayeval.errors import GroupError
from rayeval.reporting.store import ResultStore
from support import build_model, reference_metrics
from test_ray_run import setup_sweep, stored

pytestmark = pytest.mark.ray

SEEDS = (1, 2, 3, 4)


def arm_after_first_result(tmp_path, sweep) -> threading.Thread:
    """Arm the model's trap once the first checkpoint is published: mid-sweep by design."""
    results = os.path.join(sweep.output, "results")

    def arm():
        # Bounded, and long enough for a loaded machine's start-up (which alone has taken
        # over 100 s here); the thread is a daemon and ends with the test in any case.
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if os.path.isdir(results) and any(n.endswith(".parquet") and not n.startswith(".")
                                              for n in os.listdir(results)):
                (tmp_path / "trap").write_text("armed")
                return
            time.sleep(0.02)

    thread = threading.Thread(target=arm, daemon=True)
    thread.start()
    return thread


def trap_model(tmp_path, action):
    # 4,000 rows, batches of 64, 20 ms a batch: about 1.3 s of batches per checkpoint, so the
    # trap armed after the first result fires while later checkpoints are still to come.
    return {"factory": "tiny_models:Trap",
            "kwargs": {"trap": str(tmp_path / "trap"), "action": action, "delay": 0.02}}


def test_a_worker_killed_mid_sweep_is_replaced_and_nothing_is_counted_twice(ray_cluster,
                                                                             tmp_path):
    sweep, x, y = setup_sweep(tmp_path, 4000, seeds=SEEDS, workers=2,
                              model=trap_model(tmp_path, "kill"),
                              recovery={"max_restarts": 2, "stall_timeout_s": 60})
    armer = arm_after_first_result(tmp_path, sweep)
    report = run_sweep(sweep)
    armer.join(1)

    assert (tmp_path / "trap.fired").exists(), "the trap fired: a worker was killed"
    assert [o.ok for o in report.outcomes] == [True] * 4, report.outcomes
    attempts = [o.attempt for o in report.outcomes]
    assert attempts[0] == 1 and attempts[-1] == 2 and attempts == sorted(attempts), \
        "finished checkpoints were kept; the restarted group evaluated the rest"
    got = stored(sweep)
    for s in SEEDS:
        for metric, value in reference_metrics(build_model(seed=s), x, y).items():
            row = got[(f"step_{s}.pt", metric)]
            assert row["num_samples"] == len(y)
            assert row["value"] == pytest.approx(value, rel=1e-9), (s, metric)
    assert ResultStore(sweep.output).read().num_rows == 4 * 3, "one result per cell and metric"


def test_a_hung_worker_fails_the_run_in_bounded_time_naming_it(ray_cluster, tmp_path):
    sweep, x, y = setup_sweep(tmp_path, 4000, seeds=SEEDS, workers=2,
                              model=trap_model(tmp_path, "hang"),
                              recovery={"max_restarts": 0, "stall_timeout_s": 5})
    armer = arm_after_first_result(tmp_path, sweep)
    with pytest.raises(GroupError) as e:
        run_sweep(sweep)
    failed_at = time.time()
    armer.join(1)
    # Bounded from the moment the worker hung, not from the start: start-up time depends on
    # the machine's load, the stall limit (5 s) and shutdown do not much.
    fired_at = os.path.getmtime(tmp_path / "trap.fired")
    assert failed_at - fired_at < 60, failed_at - fired_at
    hung = (tmp_path / "trap.fired").read_text()
    found = re.search(r"worker rank (\d) did not reach the end of the pass over \S+/step_(\d)\.pt "
                      r"on \S+; (?:the others|worker rank \d) waited [5-9] s \(stalled;",
                      e.value.message)
    assert found, e.value.message
    assert found.group(1) == hung, "the message names the worker that hung"
    assert "recovery.max_restarts is 0" in e.value.message
    published = {k[0] for k in stored(sweep)}
    assert f"step_{found.group(2)}.pt" not in published and "step_1.pt" in published
