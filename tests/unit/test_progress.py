"""Tier 1: the progress tracker and what the displays make of it, without Ray."""

import io

from rayeval.plan.cells import CellOutcome
from rayeval.execution.coordinator import Tracker
from rayeval.reporting.display import LineDisplay, Rate, fmt_duration, line, make_display


def cells(n, rows=100):
    return [(f"k{i}", f"/ckpts/step_{i}.pt", rows) for i in range(n)]


def outcome(key, error=None):
    return CellOutcome(key=key, checkpoint="/ckpts/x.pt", evaluation="e", step=None,
                       error=error)


def status(total, done=0, rows_in_flight=0, rows_per_cell=1000, **kw):
    """A snapshot as the tracker gives one, for cells of equal size."""
    return {"total": total, "done": done, "failed": 0, "rows_in_flight": rows_in_flight,
            "rows_done": done * rows_per_cell, "rows_total": total * rows_per_cell,
            "current": None, "attempts": 1, "problems": [], **kw}


def test_tracker_counts_finished_cells_and_rows_in_flight():
    t = Tracker(cells(3))
    assert t.start_attempt() == 1
    t.rows(0, 0, 30)
    t.rows(1, 0, 20)
    snap = t.snapshot()
    assert (snap["done"], snap["rows_in_flight"], snap["current"]) == (0, 50, "/ckpts/step_0.pt")
    t.finish("k0", outcome("k0"))
    t.rows(1, 1, 10)               # rank 1 moved on; rank 0's count for k0 is dropped
    snap = t.snapshot()
    assert (snap["done"], snap["rows_in_flight"], snap["current"]) == (1, 10, "/ckpts/step_1.pt")
    t.finish("k1", outcome("k1", "bad"))
    assert t.snapshot()["failed"] == 1 and sorted(t.done_keys()) == ["k0", "k1"]


def test_a_restart_keeps_finished_cells_and_forgets_rows_in_flight():
    t = Tracker(cells(2))
    t.start_attempt()
    t.finish("k0", outcome("k0"))
    t.rows(0, 1, 70)
    t.problem("rank 0: worker rank 1 did not reach the end of the pass")
    assert t.start_attempt() == 2
    snap = t.snapshot()
    assert snap["rows_in_flight"] == 0 and t.done_keys() == ["k0"]
    assert snap["problems"] == ["rank 0: worker rank 1 did not reach the end of the pass"]


def test_rate_and_time_left_from_snapshots():
    r = Rate()
    s = r.status(status(4, attempts=0), now=0.0)
    assert s.rows_per_s is None and s.eta_s is None and s.fraction == 0
    s = r.status(status(4), now=8.0)                      # workers up: the rate starts here
    assert s.rows_per_s is None and s.eta_s is None
    s = r.status(status(4, rows_in_flight=500), now=10.0)
    assert s.rows_per_s == 250.0, "one sample with rows: the average since the workers began"
    assert s.eta_s is None, "but no time left from it: it holds the start-up"
    s = r.status(status(4, done=1, rows_in_flight=500), now=11.0)
    assert s.rows_per_s == 1000.0, "then the rate over the window"
    assert s.eta_s == 2.5 and s.fraction == 1500 / 4000
    s = r.status(status(4, done=4), now=13.0)
    assert s.eta_s == 0 and s.fraction == 1.0


def test_plain_lines_are_periodic_and_report_restarts():
    stream = io.StringIO()
    d = LineDisplay(stream, interval_s=10)
    r = Rate()
    snap = status(2, rows_per_cell=100, attempts=0)
    d.update(r.status(snap, 0), 0)
    d.update(r.status({**snap, "attempts": 1, "rows_in_flight": 40, "current": "/c/a.pt"}, 1), 1)
    d.update(r.status({**snap, "attempts": 1, "done": 1, "rows_done": 100, "current": "/c/b.pt"}, 11), 11)
    d.update(r.status({**snap, "attempts": 2, "done": 1, "rows_done": 100, "problems": ["rank 0: lost rank 1"]},
                      12), 12)
    d.update(r.status({**snap, "attempts": 2, "done": 2, "rows_done": 200}, 13), 13, final=True)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[rayeval] starting the worker group, elapsed 0:00"
    assert lines[1].startswith("[rayeval] 1/2 cells, 50% of rows, ")
    assert lines[1].endswith("now b.pt")
    assert lines[2] == "[rayeval] worker failure: rank 0: lost rank 1"
    assert lines[3].startswith("[rayeval] worker group restarted (attempt 2)")
    assert lines[4].startswith("[rayeval] 2/2 cells, 100% of rows, ")
    assert len(lines) == 5, "no line between the periods"


def test_display_choice():
    from rich.console import Console

    piped = Console(file=io.StringIO(), force_terminal=False)
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert type(make_display("auto", piped)).__name__ == "LineDisplay"
    assert type(make_display("auto", terminal)).__name__ == "RichDisplay"
    assert type(make_display("quiet", terminal)).__name__ == "NullDisplay"
    assert fmt_duration(3725) == "1:02:05" and fmt_duration(None) == "?"
    assert "rows/s" in line(Rate().status(status(1, done=1, rows_per_cell=10), 0), 0)


def test_nodes_are_counted_whichever_rank_says_hello_first():
    t = Tracker(cells(1, rows=10))
    t.hello(1, "node-b")             # rank 1 may reach the tracker before rank 0 opens the attempt
    t.start_attempt()
    t.hello(0, "node-a")
    assert t.node_count() == 2
    t.start_attempt()                # a restart on one node: each rank says where it is now
    t.hello(0, "node-a")
    t.hello(1, "node-a")
    assert t.node_count() == 1
