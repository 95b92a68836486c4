"""The lanes of ``pytest -n 2`` (tests/lanes.py) replayed without pytest-xdist's processes: the
scheduler is driven as xdist's controller drives it, by workers that behave as xdist's do (a
worker runs a test only once it has the next one or is told to shut down), over collections
shaped like the suite's, with random test times. Every test must run exactly once, the
integration tier alone on one worker, the timed files never two at once."""
import collections
import random
import types

import pytest

from lanes import Lanes, kind

SHUTDOWN = object()


class Worker:
    """What the scheduler sees of an xdist worker, and what the worker does with it."""

    def __init__(self, name: str):
        self.gateway = types.SimpleNamespace(id=name)
        self.shutting_down = False
        self.queue: collections.deque = collections.deque()

    def send_runtest_some(self, indices):
        self.queue.extend(indices)

    def shutdown(self):
        if not self.shutting_down:
            self.shutting_down = True
            self.queue.append(SHUTDOWN)

    def can_start(self) -> bool:
        # xdist's WorkerInteractor: the next index (or the end) must be there first
        return len(self.queue) >= 2 and self.queue[0] is not SHUTDOWN

    def __repr__(self):
        return self.gateway.id


def suite_shape(rng: random.Random, light_files: int) -> list[str]:
    ids = []
    for name in ("test_signals", "test_signals_paths", "test_service"):
        ids += [f"tests/e2e/{name}.py::test_{i}" for i in range(rng.randint(1, 8))]
    for f in range(12):
        ids += [f"tests/e2e/test_e{f}.py::test_{i}" for i in range(rng.randint(1, 10))]
    for f in range(15):
        ids += [f"tests/integration/test_i{f}.py::test_{i}" for i in range(rng.randint(1, 12))]
    for f in range(light_files):
        tier = rng.choice(("unit", "models", "browser"))
        ids += [f"tests/{tier}/test_l{f}.py::test_{i}" for i in range(rng.randint(1, 30))]
    return ids


def replay(ids: list[str], seconds: dict[str, float], workers: int = 2):
    """Run the schedule to its end in simulated time: ``(worker, test, start, end)`` per test."""
    config = types.SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"],
                                   option=types.SimpleNamespace(loadscopereorder=False))
    sched = Lanes(config)
    nodes = [Worker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, ids)
    sched.schedule()
    now, running, done = 0.0, {}, []
    for _ in range(10 * len(ids)):              # each step ends a test: bounded
        for node in nodes:
            if node not in running and node.can_start():
                index = node.queue.popleft()
                running[node] = (index, now, now + seconds[ids[index]])
        if not running:
            if sched.tests_finished and not any(n.queue and n.queue[0] is not SHUTDOWN
                                                for n in nodes):
                return done
            if sched.tests_finished:             # xdist's controller: the end, to every worker
                for node in nodes:
                    node.shutdown()
                continue
            held = {n: list(n.queue) for n in nodes}
            pytest.fail(f"no worker can run, {len(sched.workqueue)} unit(s) queued, "
                        f"the workers hold {held}")
        node = min(running, key=lambda n: running[n][2])
        index, start, now = running.pop(node)
        done.append((node, ids[index], start, now))
        sched.mark_test_complete(node, index)
    pytest.fail("the schedule did not end")


@pytest.mark.parametrize("seed", range(40))
def test_every_test_runs_once_and_the_integration_tier_alone(seed):
    rng = random.Random(seed)
    # some shapes run out of light files while end-to-end ones are still running
    ids = suite_shape(rng, light_files=rng.choice((0, 2, 30)))
    seconds = {i: rng.expovariate(1 / {"integration": 9, "timed": 20, "ray": 15,
                                       "light": 0.5}[kind(scope(i))]) for i in ids}
    done = replay(ids, seconds)

    assert sorted(test for _, test, _, _ in done) == sorted(ids)
    integration = [d for d in done if kind(scope(d[1])) == "integration"]
    assert len({worker for worker, *_ in integration}) == 1
    first, last = min(d[2] for d in integration), max(d[3] for d in integration)
    beside = [d for d in done if kind(scope(d[1])) != "integration"
              and d[2] < last and d[3] > first]
    # at most the test the other worker held when the tier began: the last of its file, run
    # when that worker is told to shut down
    assert len(beside) <= 1, beside
    timed = [d for d in done if kind(scope(d[1])) == "timed"]
    for a in timed:
        for b in timed:
            if a[0] is not b[0]:
                assert a[3] <= b[2] or b[3] <= a[2], (a, b)


def test_the_integration_tier_starts_when_both_workers_hold_a_last_test():
    """The schedule that stopped CI: light files end on both workers at once, each holding the
    last test of its file, and only the integration tier is left."""
    ids = ([f"tests/unit/test_a.py::test_{i}" for i in range(3)]
           + [f"tests/unit/test_b.py::test_{i}" for i in range(3)]
           + [f"tests/integration/test_x.py::test_{i}" for i in range(5)])
    done = replay(ids, {i: 1.0 for i in ids})
    assert sorted(test for _, test, _, _ in done) == sorted(ids)


def test_the_state_line_names_each_worker_and_the_queue():
    config = types.SimpleNamespace(getvalue=lambda name: ["2*popen"],
                                   option=types.SimpleNamespace(loadscopereorder=False))
    sched = Lanes(config)
    a, b = Worker("gw0"), Worker("gw1")
    ids = [f"tests/unit/test_a.py::test_{i}" for i in range(3)] + \
        [f"tests/integration/test_x.py::test_{i}" for i in range(2)]
    for node in (a, b):
        sched.add_node(node)
    for node in (a, b):
        sched.add_node_collection(node, ids)
    sched.schedule()
    # the integration tier waits for gw0's file to end
    assert sched.describe() == ("gw0: 3 test(s) of ['tests/unit/test_a.py']; "
                                "gw1: 0 test(s) of [], waiting; 1 unit(s) queued")


def scope(nodeid: str) -> str:
    return "tests/integration" if nodeid.startswith("tests/integration/") else \
        nodeid.split("::")[0]
