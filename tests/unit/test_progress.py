"""Tier 1: the run ledger and what the displays make of it, without Ray."""

import io

from rayeval.plan.cells import CellOutcome
from rayeval.execution.ledger import RunLedger
from rayeval.reporting.display import LineDisplay, Rate, fmt_duration, line, make_display


def cells(n, rows=100):
    return [(f"k{i}", f"/ckpts/step_{i}.pt", rows) for i in range(n)]


def outcome(key, error=None):
    return CellOutcome(key=key, checkpoint="/ckpts/x.pt", evaluation="e", step=None,
                       error=error)


def status(total, done=0, rows_in_flight=0, rows_per_cell=1000, **kw):
    """A snapshot as the ledger gives one, for cells of equal size."""
    return {"total": total, "done": done, "failed": 0, "rows_in_flight": rows_in_flight,
            "rows_done": done * rows_per_cell, "rows_total": total * rows_per_cell,
            "current": None, "attempts": 1, "problems": [], **kw}


def test_ledger_counts_finished_cells_and_rows_in_flight():
    t = RunLedger(cells(3))
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
    t = RunLedger(cells(2))
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
    t = RunLedger(cells(1, rows=10))
    t.hello(1, "node-b")             # rank 1 may reach the ledger before rank 0 opens the attempt
    t.start_attempt()
    t.hello(0, "node-a")
    assert t.node_count() == 2
    t.start_attempt()                # a restart on one node: each rank says where it is now
    t.hello(0, "node-a")
    t.hello(1, "node-a")
    assert t.node_count() == 1


def test_the_ledger_says_the_longest_activity_and_forgets_it_on_a_restart():
    t = RunLedger(cells(1))
    assert t.snapshot()["activity"] is None, "no attempt yet: the line says the group starts"
    t.start_attempt()
    assert t.snapshot()["activity"][0] == "setting up the workers", \
        "from the attempt's opening, before any rank has said a word"
    t.doing(0, "starting the vLLM engine")
    t.doing(1, "loading step_0.pt")
    t.doing(0, "starting the vLLM engine")        # said again: still timed from the first
    what, seconds = t.snapshot()["activity"]
    assert what == "starting the vLLM engine" and seconds >= 0
    t.doing(0, "scoring e")                        # rank 0 moved on: rank 1 is the oldest now
    assert t.snapshot()["activity"][0] == "loading step_0.pt"
    t.start_attempt()
    assert t.snapshot()["activity"][0] == "setting up the workers", "the old activities forgotten"


def test_the_line_says_what_the_workers_do_while_no_row_moves():
    r = Rate(still_s=3)
    engine = ("starting the vLLM engine", 41.0)
    s = r.status(status(2, rows_per_cell=100, activity=engine), now=0.0)
    assert line(s, 45).split(", ")[2] == "starting the vLLM engine for 0:41", \
        "no row yet: the activity in place of '? rows/s'"
    s = r.status(status(2, rows_per_cell=100, rows_in_flight=10,
                        activity=("scoring e", 1.0)), now=1.0)
    assert "rows/s" in line(s, 46) and "scoring" not in line(s, 46), "rows move: the rate"
    s = r.status(status(2, rows_per_cell=100, rows_in_flight=10,
                        activity=("scoring e", 3.0)), now=3.0)
    assert "scoring" not in line(s, 48), "still for 2 s: not yet"
    s = r.status(status(2, rows_per_cell=100, rows_in_flight=10,
                        activity=("loading the weights into the vLLM engine", 4.0)), now=4.5)
    assert "loading the weights into the vLLM engine for 0:04" in line(s, 49)
    s = r.status(status(2, rows_per_cell=100, rows_in_flight=20, activity=engine), now=5.0)
    assert "vLLM" not in line(s, 50), "moving again"
    s = r.status(status(2, rows_per_cell=100, rows_in_flight=20), now=60.0)
    assert "rows/s" in line(s, 105), "no activity said (an older worker): the rate as before"


def test_the_terminal_bar_shows_the_activity_too():
    from rich.console import Console

    out = io.StringIO()
    d = make_display("auto", Console(file=out, force_terminal=True, width=160))
    with d:
        d.update(Rate().status(status(2, activity=("loading step_1.pt", 7.0)), 0), 1)
    assert "loading step_1.pt for 0:07" in out.getvalue()


def test_the_plain_line_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RAYEVAL_PROGRESS_INTERVAL_S", "0.5")
    assert make_display("lines").interval_s == 0.5
    monkeypatch.delenv("RAYEVAL_PROGRESS_INTERVAL_S")
    assert make_display("lines").interval_s == 10.0


def test_a_worker_timer_says_each_span_and_the_vllm_start_steps_from_its_log_lines():
    import logging
    import logging.config

    from rayeval.core.backends.vllm import _steps_said, engine_step
    from rayeval.execution.profile import Timer

    said = []
    timer = Timer(on_doing=said.append)
    with timer.span("load", doing="loading step_0.pt"):
        with timer.span("engine start", doing="starting the vLLM engine"):
            with _steps_said(timer.doing):
                # vLLM configures its loggers inside LLM(), as here (a handler added before
                # would be dropped); then its own lines (0.32.0's CPU worker)
                logging.config.dictConfig({"version": 1, "disable_existing_loggers": False,
                                           "loggers": {"vllm": {"propagate": False}}})
                log = logging.getLogger("vllm.v1.worker.cpu_model_runner")
                log.setLevel(logging.INFO)
                log.info("Starting to load model %s...", "/ckpts/step_0")
                log.info("Warming up model for the compilation...")
                log.info("Using max model len 64")          # no step: nothing said
    log.info("Starting to load model %s...", "/x")            # after the start: not heard
    assert said == ["loading step_0.pt", "starting the vLLM engine",
                    "starting the vLLM engine: building the model",
                    "starting the vLLM engine: compiling and warming up"]
    assert timer.counts == {"load": 1, "engine start": 1}
    assert engine_step("init engine (profile, create kv cache, warmup model) took 0.07 s") \
        == "starting the vLLM engine: finishing"


def test_a_standing_groups_plan_is_kept_when_its_next_cells_come_without_it():
    """A plan's pickle goes to the ledger with its first cells only (``driver.Standing``
    sends None after): a worker that sets itself up for it again (its Ray Data splits were
    released after a batch) still finds it. It used to be overwritten with None."""
    t = RunLedger([])
    assert t.add_cells(cells(1), [b"c0"], ("tok", b"plan")) == 0
    assert t.add_cells(cells(2)[1:], [b"c1"], ("tok", None)) == 1
    assert t.base("tok") == b"plan"
    assert [token for *_, token in t.take()] == ["tok", "tok"]


def test_a_process_knows_its_age_to_the_tick():
    """``since_process_start`` (the imports phase, the wait a run's summary says): a process
    that slept 0.5 s after its start says at least that, and no more than the parent saw it
    live. psutil's start time, a second off on Linux (whole-second boot time), said more."""
    import subprocess
    import sys
    import time

    began = time.monotonic()
    out = subprocess.run([sys.executable, "-c",
                          "import time; time.sleep(0.5); "
                          "from rayeval.execution.profile import since_process_start; "
                          "print(since_process_start())"],
                         capture_output=True, text=True, check=True).stdout
    lived = time.monotonic() - began
    assert 0.5 <= float(out) <= lived + 0.01, (out, lived)     # + one 10 ms tick
