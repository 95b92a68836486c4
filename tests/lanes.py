"""The lanes of ``python -m pytest -n 2`` (the README's test command): which file runs on which
pytest-xdist worker, and beside what.

Each file goes whole to one worker (its module fixtures built once) and the integration tier
whole to one worker, so two of its runs never share the cores (two integration tests at once
each ran ~2.5x slower: their sum 3,332 s against 1,304 s in one process). The end-to-end files,
which wait on their own subprocesses' Ray much of the time (~1.2 cores busy), run two at once
first, the timed ones one at a time (their Ctrl-C exits: 1.9-2.9 s beside another end-to-end
file, against a 10 s bound), light files filling in; then the integration tier alone (the whole
suite with the integration tier beside the end-to-end files ran at a load of 10-50 and a Ctrl-C
case missed its bound; beside light files, a worker-loss case of test_judge failed once). The
tiers before the integration tier: 797 s on two lanes, 1,319 s in one process.

A worker runs a test only once it has the next one (pytest's ``nextitem``, for teardown), so the
last test it was sent waits, unrun, until more work or the end comes: a worker with one test
left is waiting, not running (``Lanes._waiting``). The first form of the lanes counted that test
as running: at the integration tier both workers held the last test of a file, each barred the
tier for the other, and CI stopped at its 90-minute limit with the tier unstarted
(tests/unit/test_lanes.py replays the schedule).
"""
from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

# Test files that time a run's exit after a signal against a fixed bound (10 s after Ctrl-C,
# measured ~2 s idle): they run one at a time, never beside the integration tier.
TIMED_FILES = ("tests/e2e/test_signals.py", "tests/e2e/test_signals_paths.py",
               "tests/e2e/test_service.py")

# the order in which the kinds are handed out
ORDER = ("timed", "ray", "light", "integration")
# what may run on one worker while another runs a unit of the key's kind (symmetric: a kind
# listed under another lists it back)
BESIDE = {"ray": {"ray", "timed", "light"}, "timed": {"ray", "light"},
          "integration": set(), "light": {"ray", "timed", "light"}}


def tier(nodeid: str) -> str:
    """The tier of a test: the folder under tests/ its file sits in (unit, models, ...), from
    its node id (relative to the project, whatever folder a test has moved into)."""
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else "tests"


def kind(scope: str) -> str:
    """What a unit of work is to ``Lanes``: the integration tier (one unit, CPU-bound: its
    runs keep both cores busy, at a load of 3-10), a file timed against a bound, a file that
    starts Ray or a server of its own (end-to-end), or a light one (unit, models, browser: one
    core, no Ray)."""
    if scope == "tests/integration":
        return "integration"
    if scope in TIMED_FILES:
        return "timed"
    return "ray" if tier(scope) == "e2e" else "light"


class Lanes(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return "tests/integration" if tier(nodeid) == "integration" else nodeid.split("::")[0]

    def _waiting(self, node) -> bool:
        """The node runs nothing: it has no test left, or only the one it holds until it is
        sent more work or told to shut down."""
        return not node.shutting_down and self._pending_of(self.assigned_work[node]) <= 1

    def _kinds(self, node) -> set[str]:
        """The kinds of the units a node has tests of still to run (a held one included: it
        runs as soon as the node is sent anything)."""
        return {kind(scope) for scope, unit in self.assigned_work[node].items()
                if not all(unit.values())}

    def _next_scope(self, node) -> str | None:
        """The first waiting unit, in ``ORDER``, that may run beside what the other workers
        have; None when every one must wait for them. When no worker runs anything and none
        may, the first unit goes regardless: the others' held tests, the last of their files,
        would otherwise wait for ever (one of them then runs beside the unit)."""
        others = [self._kinds(n) for n in self.nodes if n is not node]
        for k in ORDER:
            for scope in self.workqueue:
                if kind(scope) == k and all(have <= BESIDE[k] for have in others):
                    return scope
        if all(self._waiting(n) for n in self.nodes):
            return min(self.workqueue, key=lambda scope: ORDER.index(kind(scope)))
        return None

    def _assign_work_unit(self, node) -> None:
        scope = self._next_scope(node)
        if scope is None:
            return
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)

    def _reschedule(self, node) -> None:
        # every worker, not only the one whose test ended: one left waiting (nothing could run
        # beside the other's unit) is given work now, or told to shut down (which runs the test
        # it holds) once nothing is queued
        for each in [node] + [n for n in self.nodes if n is not node]:
            super()._reschedule(each)

    def describe(self) -> str:
        """One line of where the schedule stands: each worker's unfinished units and whether it
        waits, and how many units are queued."""
        nodes = "; ".join(
            f"{n.gateway.id}: {self._pending_of(self.assigned_work[n])} test(s) of "
            f"{sorted(s for s, u in self.assigned_work[n].items() if not all(u.values()))}"
            f"{', waiting' if self._waiting(n) else ''}"
            f"{', shutting down' if n.shutting_down else ''}" for n in self.nodes)
        return f"{nodes}; {len(self.workqueue)} unit(s) queued"


def watch(lanes: Lanes, last_report: list[float], quiet_s: float = 1200) -> None:
    """Under ``-n``, in the controller: every ``quiet_s`` without a test ending, the schedule's
    state on stderr (a CI run stopped at its limit then says whether a test or the schedule
    waited; each test's own stacks come from ``faulthandler_timeout``). A daemon thread: it
    ends with the run."""
    import sys
    import threading
    import time

    def loop():
        while True:
            time.sleep(60)
            quiet = time.monotonic() - last_report[0]
            if quiet >= quiet_s:
                try:
                    state = lanes.describe()
                except (RuntimeError, KeyError):     # the controller changed it meanwhile
                    continue
                print(f"\n[lanes] no test has ended for {quiet / 60:.0f} min: {state}",
                      file=sys.__stderr__, flush=True)
                last_report[0] = time.monotonic()

    threading.Thread(target=loop, name="lanes-watch", daemon=True).start()
