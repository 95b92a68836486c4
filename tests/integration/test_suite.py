"""Tier 3 (local Ray): suites. Several evaluations in one run, each checkpoint loaded once per
worker, every evaluation's rows counted once for any worker count, a data problem failing only
its own evaluation's cells, and the leaderboard's aggregate against a direct computation."""

import json
import os

import numpy as np
import pytest
import torch
import yaml

from rayeval.ui.cli import main
from rayeval.execution.driver import run_sweep
from rayeval.ranking import latest_rows
from rayeval.plan.loader import load_sweep
from rayeval.io.store import ResultStore
from support import build_model, make_data, reference_metrics, write_model_module, write_parquet

pytestmark = pytest.mark.ray

SEEDS = (1, 2)
ROWS = {"a": 1001, "b": 503, "c": 211}          # no worker count divides them all

TRANSFORM = '''
import torch


def flat(table):
    """The x column as a float tensor, decoded by hand: what a user's transform does."""
    values = table.column("x").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return torch.tensor(values, dtype=torch.float32).reshape(table.num_rows, -1)


def flaky(table):
    """Fails on the batch holding row 150: bad data that only a worker meets (the driver
    probes the first rows)."""
    if 150 in table.column("row").to_pylist():
        raise ValueError("cannot decode row 150")
    return flat(table)
'''


def make_suite(folder, workers, output, transform="shapes:flat"):
    write_model_module(str(folder))
    (folder / "shapes.py").write_text(TRANSFORM)
    data = {}
    for i, (name, n) in enumerate(ROWS.items()):
        x, y = make_data(n, seed=10 + i)
        write_parquet(str(folder / f"{name}.parquet"), x, y, row_group_size=97)
        data[name] = (x, y)
    (folder / "ckpts").mkdir(exist_ok=True)
    for s in SEEDS:
        torch.save(build_model(seed=s).state_dict(), folder / "ckpts" / f"step_{s}.pt")
    metrics = ["accuracy", "macro_f1", "nll"]
    spec = {
        "name": "suite", "model": {"factory": "tiny_models:build"}, "checkpoints": ["ckpts/*"],
        "workers": workers, "output": output, "batch_size": 64,
        "bootstrap": {"replicates": 200},
        "evals": [
            {"name": "a", "task": "classification", "metrics": metrics,
             "dataset": {"path": "a.parquet", "inputs": "x", "target": "y", "id": "row"}},
            {"name": "b", "task": "classification", "metrics": metrics, "batch_size": 7,
             "bootstrap": {"seed": 5},
             "dataset": {"path": "b.parquet", "inputs": "x", "target": "y"}},
            {"name": "c", "task": "classification", "metrics": ["nll", "accuracy"],
             "dataset": {"path": "c.parquet", "transform": transform, "target": "y",
                         "id": "row"}},
        ],
    }
    (folder / "sweep.yaml").write_text(yaml.safe_dump(spec))
    return load_sweep(str(folder / "sweep.yaml")), data


def stored(sweep):
    return {(os.path.basename(r["checkpoint"]), r["evaluation"], r["metric"]): r
            for r in latest_rows(ResultStore(sweep.output).read())}


def test_three_evaluations_on_1_2_3_workers_equal_references_and_each_other(ray_cluster,
                                                                           tmp_path):
    runs = {}
    for workers in (1, 2, 3):
        sweep, data = make_suite(tmp_path, workers, f"out{workers}")
        report = run_sweep(sweep)
        assert [o.ok for o in report.outcomes] == [True] * 6, report.failures
        # One load per (worker, checkpoint), counted by the workers, for all three evaluations.
        assert report.loads == {(rank, str(tmp_path / "ckpts" / f"step_{s}.pt")): 1
                                for rank in range(workers) for s in SEEDS}
        runs[workers] = stored(sweep)

    for s in SEEDS:
        model = build_model(seed=s)
        for name, (x, y) in data.items():
            ref = reference_metrics(model, x, y)
            for metric in (("nll", "accuracy") if name == "c" else ref):
                row = runs[2][(f"step_{s}.pt", name, metric)]
                assert row["num_samples"] == len(y), "every row counted exactly once"
                exact = metric == "accuracy"
                assert row["value"] == pytest.approx(ref[metric], rel=0 if exact else 1e-6), \
                    (s, name, metric)
    for key, row in runs[2].items():          # the same numbers and intervals for any world size
        for workers in (1, 3):
            other = runs[workers][key]
            assert other["world_size"] == workers and row["world_size"] == 2
            # Counts are exact whatever the sharding; float32 logits may differ in the last
            # bits between batch compositions on some CPUs, so float metrics agree to 1e-6.
            tol = dict(rel=0, abs=0) if key[2] == "accuracy" else dict(rel=1e-6, abs=1e-12)
            assert other["replicates"] == pytest.approx(row["replicates"], **tol), key
            assert (other["ci_low"], other["ci_high"]) == \
                pytest.approx((row["ci_low"], row["ci_high"]), **tol), key
            assert other["value"] == pytest.approx(row["value"], **tol), key
    b = runs[2][("step_1.pt", "b", "accuracy")]
    assert "seed=5" in b["bootstrap"] and "replicates=200" in b["bootstrap"], \
        "an evaluation's bootstrap keys override the sweep's"

    # The leaderboard's aggregate as a plain mean (--aggregate mean; the default win rate:
    # tests/unit/test_win_rate.py), against a direct computation from the stored replicates:
    # the mean over evaluations of each one's first metric (nll enters negated).
    args = ["leaderboard", str(tmp_path / "out2"), "--format", "json", "--aggregate", "mean"]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    aggregates = {os.path.basename(r["checkpoint"]): r for r in json.loads(buf.getvalue())
                  if r["metric"] == "aggregate"}
    for s in SEEDS:
        parts = [(runs[2][(f"step_{s}.pt", "a", "accuracy")], 1.0),
                 (runs[2][(f"step_{s}.pt", "b", "accuracy")], 1.0),
                 (runs[2][(f"step_{s}.pt", "c", "nll")], -1.0)]
        value = np.mean([sign * p["value"] for p, sign in parts])
        reps = np.mean([sign * np.asarray(p["replicates"]) for p, sign in parts], axis=0)
        lo, hi = np.quantile(reps, [0.025, 0.975])
        got = aggregates[f"step_{s}.pt"]
        assert got["value"] == pytest.approx(value, rel=1e-12)
        assert (got["ci_low"], got["ci_high"]) == pytest.approx((lo, hi), rel=1e-12)


def test_bad_data_in_one_evaluation_fails_only_its_cells(standing, tmp_path):
    sweep, _ = make_suite(tmp_path, 2, "out", transform="shapes:flaky")
    report = run_sweep(sweep, standing=standing)
    by_eval = {}
    for o in report.outcomes:
        by_eval.setdefault(o.evaluation, []).append(o)
    assert all(o.ok for o in by_eval["a"] + by_eval["b"]), report.failures
    assert [o.ok for o in by_eval["c"]] == [False, False]
    for o in by_eval["c"]:
        assert "c: evals[2].dataset.transform: shapes:flaky raised ValueError: cannot decode " \
               "row 150" in o.error, o.error
        assert "raise ValueError" in o.detail, "the traceback, for --debug"
    got = stored(sweep)
    assert {k[1] for k in got} == {"a", "b"}, "nothing published for the failed evaluation"
    again = run_sweep(sweep, standing=standing)     # the good cells cached, the failed retried
    assert len(again.plan.cached) == 4 and len(again.plan.cells) == 2
