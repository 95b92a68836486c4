"""The public Python API: ``rayeval.run``, ``load_sweep``, ``results`` and ``leaderboard``.
Stores are written cell by cell with the store API; one test runs a real sweep on an embedded
Ray (marked ``ray``)."""

import csv
import io
import importlib
import json
import os
import signal
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
import torch
from rich.console import Console

import rayeval
from rayeval.ui import cli
from rayeval.errors import DataError, RayevalError, SpecError, StoreError
from rayeval.ranking import latest_rows
from rayeval.io.store import SCHEMA, ResultStore
from support import (build_model, make_data, ray_starts, reference_metrics, write_model_module,
                     write_parquet, write_sweep)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
HIGHER = {"accuracy": True, "nll": False}
B = 200
KEY = f"seed=0;buckets=1024;replicates={B};confidence=0.95"


def row(checkpoint, evaluation, metric, value, *, sweep="s", step=None, created_at=T0,
        replicates=None, matrix=None):
    """One stored row (``write_cell`` adds the cell key)."""
    ci = (None, None) if replicates is None else \
        tuple(np.quantile(replicates, [0.025, 0.975]).tolist())
    return {"sweep": sweep, "checkpoint": checkpoint, "step": step, "evaluation": evaluation,
            "metric": metric, "value": value, "ci_low": ci[0], "ci_high": ci[1],
            "num_samples": 500, "world_size": 2, "created_at": created_at,
            "higher_is_better": HIGHER.get(metric, True),
            "bootstrap": KEY if replicates is not None else None,
            "replicates": None if replicates is None else list(replicates), "matrix": matrix}


# --- import cost and the public names -----------------------------------------------------------

def test_import_rayeval_and_its_cli_import_neither_torch_nor_ray():
    code = ("import json, sys, rayeval, rayeval.ui.cli; "
            "rayeval.run, rayeval.results, rayeval.leaderboard, rayeval.load_sweep; "
            "print(json.dumps({m: m in sys.modules for m in ('torch', 'ray')}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"torch": False, "ray": False}


def test_every_public_name_resolves_and_the_errors_form_one_tree():
    assert rayeval.__version__ == "0.1.0"
    for name in rayeval.__all__:
        assert getattr(rayeval, name) is not None, name
    assert {"run", "load_sweep", "results", "leaderboard", "RunReport", "Sweep",
            "RayevalError"} <= set(rayeval.__all__)
    from rayeval.execution.driver import RunReport
    from rayeval.ranking import Board

    assert rayeval.RunReport is RunReport and rayeval.Board is Board
    errors = {n for n, v in vars(importlib.import_module("rayeval.errors")).items()
              if isinstance(v, type) and issubclass(v, rayeval.RayevalError)}
    assert errors <= set(rayeval.__all__), errors - set(rayeval.__all__)   # every one public
    for name in ("SpecError", "DataError", "ModelError", "MetricError", "CheckpointError",
                 "StoreError", "RunError", "GroupError", "RegistryError", "VersionError"):
        assert issubclass(getattr(rayeval, name), rayeval.RayevalError), name
    # Importing a subpackage binds its name on rayeval: none may shadow a public function.
    importlib.import_module("rayeval.ranking.board")
    importlib.import_module("rayeval.io.store")
    for name in ("run", "results", "leaderboard", "load_sweep"):
        assert callable(getattr(rayeval, name)), name
        assert getattr(rayeval, name).__module__ == "rayeval.api", name
    import pkgutil

    packages = {m.name for m in pkgutil.iter_modules(rayeval.__path__)}
    assert not packages & set(rayeval.__all__), packages & set(rayeval.__all__)
    with pytest.raises(AttributeError):
        rayeval.no_such_name


def test_load_sweep_is_the_spec_loader(tmp_path):
    from pathlib import Path

    from rayeval.plan.loader import load_sweep

    path = write_sweep(str(tmp_path), workers=2)
    sweep = rayeval.load_sweep(Path(path))
    assert isinstance(sweep, rayeval.Sweep) and sweep == load_sweep(path)
    assert (sweep.name, sweep.workers, sweep.output) == ("t", 2, str(tmp_path / "out"))
    with pytest.raises(SpecError, match="sweep file not found"):
        rayeval.load_sweep(tmp_path / "none.yaml")


# --- results ---------------------------------------------------------------------------------

@pytest.fixture
def history(tmp_path):
    """A store where (s, ckpt_a, val, accuracy) was evaluated twice: the newer cell's file
    sorts first, so store order alone would pick the older row. Plus a second sweep and a
    second evaluation, and a confusion matrix."""
    location = str(tmp_path / "out")
    store = ResultStore(location)
    a, b = "/r/ckpts/step_10.pt", "/r/ckpts/step_20.pt"
    store.write_cell("c1-new", [row(a, "val", "accuracy", 0.75, step=10,
                                    created_at=T0 + timedelta(hours=1)),
                                row(a, "val", "nll", 0.9, step=10,
                                    created_at=T0 + timedelta(hours=1))])
    store.write_cell("c2-old", [row(a, "val", "accuracy", 0.5, step=10),
                                row(a, "val", "nll", 1.5, step=10)])
    store.write_cell("c3", [row(b, "val", "accuracy", 0.8, step=20),
                            row(b, "val", "confusion_matrix", None, step=20,
                                matrix=[[3, 1], [0, 4]])])
    store.write_cell("c4", [row(a, "ood", "accuracy", 0.6, step=10,
                                replicates=np.linspace(0.5, 0.7, B))])
    store.write_cell("c5", [row(a, "val", "accuracy", 0.3, sweep="other", step=10)])
    return location, store


def test_results_hold_the_newest_row_per_cell_with_the_stores_schema(history):
    location, store = history
    table = rayeval.results(location)
    assert table.schema == SCHEMA
    assert table.to_pylist() == latest_rows(store.read()), "the leaderboard's rows, as a table"
    got = {(r["sweep"], r["checkpoint"].rsplit("/", 1)[-1], r["evaluation"], r["metric"]):
           (r["value"], r["cell"]) for r in table.to_pylist()}
    assert got == {
        ("s", "step_10.pt", "val", "accuracy"): (0.75, "c1-new"),     # not 0.5 from c2-old
        ("s", "step_10.pt", "val", "nll"): (0.9, "c1-new"),
        ("s", "step_20.pt", "val", "accuracy"): (0.8, "c3"),
        ("s", "step_20.pt", "val", "confusion_matrix"): (None, "c3"),
        ("s", "step_10.pt", "ood", "accuracy"): (0.6, "c4"),
        ("other", "step_10.pt", "val", "accuracy"): (0.3, "c5"),
    }
    wide = {(r["cell"], r["metric"]): r for r in table.to_pylist()}
    assert wide[("c3", "confusion_matrix")]["matrix"] == [[3, 1], [0, 4]]
    assert wide[("c4", "accuracy")]["replicates"] == \
        pytest.approx(np.linspace(0.5, 0.7, B).tolist())


def test_results_filter_by_sweep_and_evaluation(history, tmp_path, monkeypatch):
    location, _ = history
    only = rayeval.results(location, sweep="other")
    assert only.column("value").to_pylist() == [0.3]
    val = rayeval.results(location, sweep="s", evaluation="val")
    assert set(val.column("evaluation").to_pylist()) == {"val"} and val.num_rows == 4
    assert set(rayeval.results(location, evaluation="ood").column("cell").to_pylist()) == {"c4"}
    none = rayeval.results(location, sweep="nope")
    assert none.num_rows == 0 and none.schema == SCHEMA
    monkeypatch.chdir(tmp_path)                     # relative to the current folder, or a Path
    assert rayeval.results("out").equals(rayeval.results(tmp_path / "out"))


def test_results_to_pandas(history):
    pd = pytest.importorskip("pandas")
    location, _ = history
    frame = rayeval.results(location, sweep="s", evaluation="val").to_pandas()
    assert isinstance(frame, pd.DataFrame) and list(frame.columns) == SCHEMA.names
    newest = frame[(frame.metric == "accuracy") & (frame.step == 10)]
    assert newest["value"].tolist() == [0.75]


def test_results_of_no_store_or_an_empty_one(tmp_path, capfd):
    with pytest.raises(StoreError, match=r"^store: no result store at '.*nothing'; give the "
                                         r"output folder of a sweep$"):
        rayeval.results(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    assert rayeval.results(tmp_path / "empty").num_rows == 0
    with pytest.raises(StoreError, match="holds no results yet"):
        rayeval.leaderboard(tmp_path / "empty")
    assert capfd.readouterr() == ("", ""), "the API raises, it never prints"


# --- leaderboard -------------------------------------------------------------------------------

@pytest.fixture
def suite_store(tmp_path):
    """3 checkpoints x 2 evaluations with paired replicates (replicate b shares its noise
    across checkpoints); ood's first metric is nll (lower is better)."""
    location = str(tmp_path / "out")
    store = ResultStore(location)
    rng = np.random.default_rng(0)
    shared = {k: rng.normal(0, 0.01, B) for k in ("val/accuracy", "ood/nll", "ood/accuracy")}
    quality = {"step_20.pt": (20, 0.40), "step_200.pt": (200, 0.70), "step_600.pt": (600, 0.66)}
    for name, (step, q) in quality.items():
        loc = str(tmp_path / "ckpts" / name)
        for evaluation, metrics in (("val", ["accuracy"]), ("ood", ["nll", "accuracy"])):
            rows = []
            for m in metrics:
                value = q if HIGHER[m] else 2.0 - 2 * q + (0.3 if name == "step_200.pt" else 0)
                reps = value + shared[f"{evaluation}/{m}"] + rng.normal(0, 0.002, B)
                rows.append(row(loc, evaluation, m, value, step=step, replicates=reps))
            store.write_cell(f"{name}-{evaluation}", rows)
    return location


def cli_out(capsys, *argv) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def test_leaderboard_ranks_like_the_cli(suite_store, capsys):
    # The default aggregate, the mean win rate: step_200 and step_600 each win one evaluation
    # of two against each other and both against step_20: a tie at 0.75 crowns nobody.
    board = rayeval.leaderboard(suite_store)
    assert {os.path.basename(e.checkpoint): e.value("aggregate") for e in board.entries} == \
        {"step_200.pt": 0.75, "step_600.pt": 0.75, "step_20.pt": 0.0}
    assert not any(e.best for e in board.entries)
    # The plain mean (--aggregate mean), ranked alike by the API and every format.
    board = rayeval.leaderboard(suite_store, aggregate="mean")
    assert isinstance(board, rayeval.Board)
    assert board.rank_by == "aggregate" and board.evaluations == ["ood", "val"]
    order = [os.path.basename(e.checkpoint) for e in board.entries]
    # JSON: the aggregate rows' values, highest first, give the same order and numbers.
    data = json.loads(cli_out(capsys, "leaderboard", suite_store, "--format", "json",
                              "--aggregate", "mean"))
    agg = sorted((r for r in data if r["metric"] == "aggregate"), key=lambda r: -r["value"])
    assert [os.path.basename(r["checkpoint"]) for r in agg] == order
    for e, r in zip(board.entries, agg):
        assert (e.value("aggregate"), e.rows["aggregate"]["ci_low"]) == \
            pytest.approx((r["value"], r["ci_low"]), rel=1e-12)
    stored = {(r["checkpoint"], f"{r['evaluation']}/{r['metric']}"): r["value"]
              for r in data if r["metric"] != "aggregate"}
    for e in board.entries:
        for c in board.columns[1:]:
            assert e.value(c.name) == stored[(e.checkpoint, c.name)]
    # The aggregate ranks step_600 first although step_200 has the best val/accuracy.
    assert order == ["step_600.pt", "step_200.pt", "step_20.pt"]
    # CSV: the same ranks and marks, here and with another ranking column.
    for metric in (None, "ood/nll", "val/accuracy"):
        board = rayeval.leaderboard(suite_store, metric=metric, aggregate="mean")
        argv = ["leaderboard", suite_store, "--format", "csv", "--aggregate", "mean"] + \
            (["--metric", metric] if metric else [])
        lines = list(csv.DictReader(io.StringIO(cli_out(capsys, *argv))))
        assert [(int(ln["rank"]), ln["checkpoint"]) for ln in lines] == \
            [(e.rank, e.checkpoint) for e in board.entries], metric
        assert [{c: ln[f"{c}_mark"] for c in board.metrics if ln[f"{c}_mark"]}
                for ln in lines] == [e.marks for e in board.entries], metric
    assert [os.path.basename(e.checkpoint) for e in
            rayeval.leaderboard(suite_store, metric="ood/nll").entries][0] == "step_600.pt"


def test_leaderboard_filters_and_bad_metrics(suite_store):
    board = rayeval.leaderboard(suite_store, evaluation="val")
    assert board.metrics == ["accuracy"] and board.evaluations == ["val"]
    assert [e.step for e in board.entries] == [200, 600, 20]
    assert rayeval.leaderboard(suite_store, sweep="s").metrics[0] == "aggregate"
    with pytest.raises(StoreError, match="holds no results yet"):
        rayeval.leaderboard(suite_store, sweep="nope")
    assert rayeval.leaderboard(suite_store, metric="nll").rank_by == "ood/nll"
    with pytest.raises(StoreError, match=r"'accuracy' is stored for several evaluations; "
                                         r"choose one of: ood/accuracy, val/accuracy, aggregate"):
        rayeval.leaderboard(suite_store, metric="accuracy")
    with pytest.raises(StoreError, match=r"no results for metric 'f1'; the store has: "
                                         r"aggregate, ood/nll, ood/accuracy, val/accuracy"):
        rayeval.leaderboard(suite_store, metric="f1")


# --- run -----------------------------------------------------------------------------------

@pytest.fixture
def project(tmp_path, monkeypatch):
    write_model_module(str(tmp_path))
    x, y = make_data(61)
    write_parquet(str(tmp_path / "data.parquet"), x, y)
    (tmp_path / "ckpts").mkdir()
    for seed in (1, 2):
        torch.save(build_model(seed=seed).state_dict(), tmp_path / "ckpts" / f"step_{seed}.pt")
    monkeypatch.setattr(sys, "path", list(sys.path))        # the factory's folder is added
    sys.modules.pop("tiny_models", None)
    return tmp_path, (x, y)


def test_bad_input_raises_and_prints_nothing(project, capfd):
    folder, _ = project
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with ray_starts() as started:
        with pytest.raises(SpecError, match=r"wokers: unknown key; did you mean 'workers'"):
            rayeval.run(write_sweep(str(folder), wokers=2))
        with pytest.raises(SpecError, match=r"workers: must be at least 1, got 0"):
            rayeval.run(write_sweep(str(folder)), workers=0)
        with pytest.raises(DataError, match=r"dataset.inputs: no column 'pixels'"):
            rayeval.run(write_sweep(str(folder), dataset={"path": "data.parquet",
                                                          "inputs": "pixels", "target": "y"}))
        with pytest.raises(StoreError, match="output: cannot write to the result store"):
            (folder / "taken").write_text("a file")
            rayeval.run(rayeval.load_sweep(write_sweep(str(folder))), output=folder / "taken")
        with pytest.raises(TypeError, match="expected a rayeval.Sweep or the path"):
            rayeval.run(42)
        try:
            rayeval.run(write_sweep(str(folder), batch_size=0))
        except SystemExit:                                              # pragma: no cover
            pytest.fail("the API must raise, not exit")
        except RayevalError:
            pass
    assert capfd.readouterr() == ("", ""), "nothing printed"
    assert not started, "all found before Ray starts"
    assert not (folder / "out").exists(), "nothing written"
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.ray
def test_run_a_tiny_sweep_end_to_end(project, no_ray):
    import ray

    folder, (x, y) = project
    path = write_sweep(str(folder), bootstrap={"replicates": 50})
    store = str(folder / "elsewhere")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    report = rayeval.run(path, output=store, workers=2)
    assert isinstance(report, rayeval.RunReport)
    assert not ray.is_initialized(), "the Ray it started is shut down"
    assert {s: signal.getsignal(s) for s in before} == before, "signal handlers restored"
    assert report.failures == [] and report.plan.sweep.output == store
    assert [(os.path.basename(o.checkpoint), o.evaluation, o.ok) for o in report.outcomes] == \
        [("step_1.pt", "data", True), ("step_2.pt", "data", True)]

    table = rayeval.results(store)
    assert table.num_rows == 2 * 3 and set(table.column("cell").to_pylist()) == \
        {o.key for o in report.outcomes}
    stored = {(os.path.basename(r["checkpoint"]), r["metric"]): r for r in table.to_pylist()}
    for seed in (1, 2):
        ref = reference_metrics(build_model(seed=seed), x, y)
        for metric, value in ref.items():
            got = stored[(f"step_{seed}.pt", metric)]
            assert got["num_samples"] == len(y) and got["world_size"] == 2
            assert got["value"] == pytest.approx(value, rel=0 if metric == "accuracy" else 1e-6)
            assert len(got["replicates"]) == 50
    board = rayeval.leaderboard(store)
    best = max((1, 2), key=lambda s: stored[(f"step_{s}.pt", "accuracy")]["value"])
    assert board.rank_by == "accuracy" and board.entries[0].step == best
    # the run's own board: what `rayeval run` prints and the trackers log (issue 57)
    own = report.board()
    assert [(e.step, e.rank, e.rows["accuracy"]["value"]) for e in own.entries] == \
        [(e.step, e.rank, e.rows["accuracy"]["value"]) for e in board.entries]

    # Again: everything is in the store, so Ray is not even started; the plan line goes to
    # the console given as progress.
    # Nor is the model probed: the cells' keys read the data and the checkpoints' bytes only.
    from rayeval.plan import preflight

    shown, probed = io.StringIO(), []
    real = preflight.inspect_evaluations
    preflight.inspect_evaluations = lambda *a, **k: probed.append(a) or real(*a, **k)
    try:
        again = rayeval.run(path, output=store, progress=Console(file=shown, width=200))
    finally:
        preflight.inspect_evaluations = real
    assert probed == []
    assert again.outcomes == [] and len(again.plan.cached) == 2 and not again.plan.cells
    assert [e.step for e in again.board().entries] == [e.step for e in own.entries]
    assert shown.getvalue() == ("[rayeval] t: 2 checkpoint(s) x 1 evaluation(s) [data (61 "
                                "rows)]: 2 cell(s), 2 already in the store, 0 to evaluate\n")
