"""The local Ray start-up: its retry (Ray gives a new node's raylet a fixed 30 s to register, which a
machine under heavy load overruns; rayeval tries again, and only for that error) and its workers'
priority (Ray's default, 15 steps nicer, starves them on a busy machine)."""

import pytest
import ray

from rayeval.execution.lifecycle import start_local_ray


class Calls:
    def __init__(self, failures):
        self.failures = list(failures)
        self.inits, self.shutdowns = [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self):
        self.shutdowns += 1


def install(monkeypatch, failures):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)     # the user's choice is kept
    monkeypatch.delenv("RAY_prestart_worker_first_driver", raising=False)
    calls = Calls(failures)
    monkeypatch.setattr(ray, "init", calls.init)
    monkeypatch.setattr(ray, "shutdown", calls.shutdown)
    return calls


def timeout():
    return Exception("The current node timed out during startup. This could happen because "
                     "some of the raylet failed to startup or the GCS has become overloaded.")


def test_a_node_that_times_out_during_start_up_is_started_again(monkeypatch):
    calls = install(monkeypatch, [timeout()])
    start_local_ray(num_cpus=3)
    same = {"num_cpus": 3, "address": "local", "_system_config": {
        "worker_niceness": 0, "prestart_worker_first_driver": False}}
    assert calls.inits == [same, same]
    assert calls.shutdowns == 1            # the half-started node's processes first


def test_the_last_attempt_s_error_is_raised(monkeypatch):
    calls = install(monkeypatch, [timeout(), timeout(), timeout()])
    with pytest.raises(Exception, match="timed out during startup"):
        start_local_ray(num_cpus=3)
    assert len(calls.inits) == 3


def test_other_errors_are_not_retried(monkeypatch):
    calls = install(monkeypatch, [ValueError("bad num_cpus")])
    with pytest.raises(ValueError, match="bad num_cpus"):
        start_local_ray(num_cpus=-1)
    assert len(calls.inits) == 1 and calls.shutdowns == 0


def test_workers_run_at_the_caller_s_priority_none_prestarted_unless_the_user_chose(
        monkeypatch):
    calls = install(monkeypatch, [])
    start_local_ray(num_cpus=3, _system_config={"worker_maximum_startup_concurrency": 8})
    assert calls.inits[-1]["_system_config"] == {"worker_maximum_startup_concurrency": 8,
                                                 "worker_niceness": 0,
                                                 "prestart_worker_first_driver": False}
    monkeypatch.setenv("RAY_worker_niceness", "10")      # the user's choice is Ray's to read
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "1")
    start_local_ray(num_cpus=3)
    assert calls.inits[-1] == {"num_cpus": 3, "address": "local"}
