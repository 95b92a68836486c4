"""Tier 1: the run callbacks' order and contract, and the Ray lifecycle's teardown, without Ray
(a fake run ledger and a fake fit stand in for the actor and the trainer's thread)."""

import io
import signal
import threading
import types

import pytest

from rayeval.execution import lifecycle
from rayeval.execution.callbacks import Callbacks, RunCallback
from rayeval.reporting.trackers import PublishToTrackers
from rayeval.execution.ledger import DriverLedger
from rayeval.execution.lifecycle import RayLifecycle, follow
from rayeval.plan.cells import CellOutcome
from rayeval.reporting.display import DisplayCallback, LineDisplay


def outcome(key, error=None):
    return CellOutcome(key=key, checkpoint=f"/ckpts/{key}.pt", evaluation="e", step=1,
                       error=error)


class Recorder(RunCallback):
    def __init__(self, log, name="rec", cells=True):
        self.log, self.name, self.cells = log, name, cells

    @property
    def wants_cells(self):
        return self.cells

    def on_plan(self, plan):
        self.log.append((self.name, "plan"))

    def on_fit_start(self):
        self.log.append((self.name, "fit_start"))

    def on_progress(self, snapshot, elapsed, final):
        self.log.append((self.name, "progress", snapshot["done"], final))

    def on_cell(self, outcome):
        self.log.append((self.name, "cell", outcome.key))

    def on_fit_end(self):
        self.log.append((self.name, "fit_end"))

    def on_outcomes(self, outcomes):
        self.log.append((self.name, "outcomes", len(outcomes)))

    def on_end(self, error):
        self.log.append((self.name, "end", type(error).__name__ if error else None))


class FakeLedger(DriverLedger):
    """The run ledger as the driver sees it: one more cell done at each snapshot."""

    def __init__(self, keys, fit=None):
        super().__init__(handle=None)
        self.keys, self.done, self.fit, self.stopped = list(keys), 0, fit, False

    def snapshot(self, since=0):
        assert since == 0, "a plain run's progress counts every cell"
        self.done = min(self.done + 1, len(self.keys))
        if self.fit is not None and self.done == len(self.keys):
            self.fit.finish()
        return {"total": len(self.keys), "done": self.done, "failed": 0, "rows_done": self.done,
                "rows_in_flight": 0, "rows_total": len(self.keys), "current": None,
                "attempts": 1, "problems": []}

    def results(self):
        return {k: outcome(k) for k in self.keys[:self.done]}

    def stop(self, timeout):
        self.stopped = True
        if self.fit is not None:
            self.fit.finish()


class FakeFit:
    """``driver.Fit``'s shape: a thread the loop joins, alive until ``finish``."""

    def __init__(self):
        self.ended = threading.Event()
        self.thread = types.SimpleNamespace(join=lambda timeout=None: self.ended.wait(0.01),
                                            is_alive=lambda: not self.ended.is_set())

    def finish(self):
        self.ended.set()

    @property
    def alive(self):
        return not self.ended.is_set()


def test_follow_calls_the_hooks_in_order_and_hands_each_cell_once():
    log = []
    fit = FakeFit()
    ledger = FakeLedger(["a", "b", "c"], fit)
    follow(ledger, fit, Callbacks([Recorder(log), Recorder(log, "quiet", cells=False)]))
    mine = [e for e in log if e[0] == "rec"]
    assert mine[0] == ("rec", "fit_start") and mine[-1] == ("rec", "fit_end")
    assert [e[2] for e in mine if e[1] == "cell"] == ["a", "b", "c"], "each cell once, in order"
    finals = [e[3] for e in mine if e[1] == "progress"]
    assert finals[-1] is True and not any(finals[:-1]), "only the last progress is final"
    assert not any(e[1] == "cell" for e in log if e[0] == "quiet"), \
        "on_cell goes only to callbacks that want cells"
    assert log.index(("rec", "fit_end")) < log.index(("quiet", "fit_end"))


def test_follow_takes_a_plain_on_cell_function_and_filters_by_keys():
    fit = FakeFit()
    got = []
    follow(FakeLedger(["a", "b", "c"], fit), fit, None, on_cell=lambda o: got.append(o.key),
           keys={"a", "c"})
    assert got == ["a", "c"]


def test_a_signal_while_following_ends_the_display_and_winds_the_group_down():
    log = []

    class Interrupting(Recorder):
        def on_progress(self, snapshot, elapsed, final):
            super().on_progress(snapshot, elapsed, final)
            raise KeyboardInterrupt

    fit = FakeFit()
    ledger = FakeLedger(["a", "b"], fit)
    with pytest.raises(KeyboardInterrupt) as caught:
        follow(ledger, fit, Interrupting(log))
    assert ledger.stopped, "the workers are asked to stop"
    assert caught.value.group_stopped is True, "and the fit ended within the grace period"
    assert log[-1] == ("rec", "fit_end"), "on_fit_end comes even after an interrupt"


def test_every_on_fit_end_runs_even_when_one_raises():
    log = []

    class Broken(RunCallback):
        def on_fit_end(self):
            raise RuntimeError("display bug")

    with pytest.raises(RuntimeError, match="display bug"):
        Callbacks([Broken(), Recorder(log)]).on_fit_end()
    assert log == [("rec", "fit_end")]


def test_the_display_callback_makes_a_display_per_fit_and_ends_with_a_final_line():
    stream = io.StringIO()
    made = []

    def make():
        made.append(LineDisplay(stream, interval_s=1000))
        return made[-1]

    for _ in range(2):
        fit = FakeFit()
        follow(FakeLedger(["a", "b"], fit), fit, DisplayCallback(make))
    assert len(made) == 2, "a display for each fit"
    lines = stream.getvalue().splitlines()
    assert len([ln for ln in lines if ln.startswith("[rayeval] 2/2 cells")]) == 2, \
        "one final line per fit"


def test_the_publisher_boards_after_each_fit_or_only_when_cells_were_added():
    class Pub:
        live, boards, closed = True, 0, False

        def __init__(self):
            self.keys = set()

        def board(self):
            self.boards += 1

        def close(self):
            self.closed = True

    def plan(*keys):
        return types.SimpleNamespace(cells=tuple(types.SimpleNamespace(key=k) for k in keys),
                                     cached=(), failed=())

    every, added = Pub(), Pub()
    for pub, only in ((every, False), (added, True)):
        cb = PublishToTrackers(pub, only_when_added=only)
        cb.on_plan(plan("a"))
        cb.on_outcomes([outcome("a", error="bad")])
        cb.on_plan(plan("b"))                       # watch: the next poll's
        cb.on_outcomes([outcome("b")])
        cb.on_end(None)
    assert (every.boards, added.boards) == (2, 1)
    assert every.closed and added.closed
    assert every.keys == added.keys == {"a", "b"}    # the board: every poll's cells


def sweep_at(tmp_path):
    return types.SimpleNamespace(output=str(tmp_path), workers=1, use_gpu=False)


def test_the_lifecycle_ends_once_with_the_error_and_restores_the_signal_handlers(tmp_path):
    log = []
    before = signal.getsignal(signal.SIGINT)
    with RayLifecycle(sweep_at(tmp_path), callbacks=[Recorder(log)]):
        signal.signal(signal.SIGINT, signal.SIG_IGN)      # as start_ray's install() would
    assert log == [("rec", "end", None)]
    assert signal.getsignal(signal.SIGINT) is before
    log.clear()
    with pytest.raises(ValueError):
        with RayLifecycle(sweep_at(tmp_path), callbacks=[Recorder(log)]):
            raise ValueError("bad input")
    assert log == [("rec", "end", "ValueError")]


def test_partial_files_go_at_the_end_or_at_once_and_an_unstopped_group_keeps_ray_up(
        tmp_path, monkeypatch):
    shut = []
    monkeypatch.setattr(lifecycle, "start_ray", lambda sweep, address, verbose: True)
    monkeypatch.setitem(__import__("sys").modules, "ray",
                        types.SimpleNamespace(shutdown=lambda: shut.append(1)))
    (tmp_path / "results").mkdir()
    partial = tmp_path / "results" / ".tmp-1-k1.parquet"
    other = tmp_path / "results" / ".tmp-1-k2.parquet"

    partial.write_bytes(b"x")
    with RayLifecycle(sweep_at(tmp_path)) as life:
        life.ensure_ray()
        with life.following(["k1"], discard_now=True):
            pass
        assert not partial.exists(), "discard_now: as the fit ends"
        other.write_bytes(b"x")
        with life.following(["k2"]):
            pass
        assert other.exists(), "otherwise at the end of the run"
    assert not other.exists() and shut == [1], "Ray shut down: this process started it"

    with pytest.raises(KeyboardInterrupt):
        with RayLifecycle(sweep_at(tmp_path)) as life:
            life.ensure_ray()
            with life.following(["k3"]):
                raise KeyboardInterrupt   # no group_stopped: a thread may be inside Ray
    assert shut == [1], "Ray is left to go down with the process"
