"""Racing on a real Ray cluster (``select:``, docs/racing.md): 16 checkpoints spread as a
training run's, raced for the best on 1 and 3 workers, against the full run of the same sweep.

Integer-valued inputs and weights make the model's own arithmetic exact (as in test_ray_run's
world-size test), so a row's outputs do not depend on which rows share its batch: every
difference from the full run would be rayeval's (which rows a round takes, how states add up).
The checkpoints are the teacher that labels the data with a shrinking share of its weights
replaced: accuracy from near chance to 1.
"""

import numpy as np
import pytest
import torch

from rayeval.execution.driver import run_sweep
from rayeval.io.store import ResultStore
from rayeval.plan.loader import load_sweep
from support import write_model_module, write_parquet, write_sweep

pytestmark = pytest.mark.ray

ROWS = 3000
CHECKPOINTS = 16
FIELDS = ("value", "ci_low", "ci_high", "replicates", "num_samples", "matrix")


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("race")
    write_model_module(str(folder))
    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, size=(ROWS, 8)).astype(np.float32)
    torch.manual_seed(0)
    shape = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    teacher = {k: torch.randint(-2, 3, v.shape).float() for k, v in shape.state_dict().items()}
    shape.load_state_dict(teacher)
    with torch.no_grad():
        y = shape(torch.from_numpy(x)).argmax(1).numpy()
    write_parquet(str(folder / "data.parquet"), x, y, row_group_size=500)
    (folder / "ckpts").mkdir()
    for i in range(CHECKPOINTS):
        # replaced weights, shrinking; the last checkpoint is the teacher (accuracy 1)
        share = 0.0 if i == CHECKPOINTS - 1 else 0.03 + 0.6 * ((CHECKPOINTS - 2 - i) / 14) ** 2
        sd = {}
        for k, v in teacher.items():
            noise = torch.randint(-2, 3, v.shape, generator=torch.Generator().manual_seed(i))
            swap = torch.rand(v.shape, generator=torch.Generator().manual_seed(100 + i)) < share
            sd[k] = torch.where(swap, noise.float(), v)
        torch.save(sd, folder / "ckpts" / f"step_{(i + 1) * 100:05d}.pt")
    return folder


def _sweep(folder, name, workers, select):
    common = dict(workers=workers, metrics=["accuracy", "nll", "confusion_matrix"],
                  model={"factory": "tiny_models:build_relu"}, batch_size=64,
                  dataset={"path": "data.parquet", "inputs": "x", "target": "y", "id": "row"},
                  bootstrap={"replicates": 200, "buckets": 512})
    return load_sweep(write_sweep(str(folder), f"{name}.yaml", output=f"out_{name}",
                                  select=select, **common))


def _same(a, b) -> bool:
    """Equal, bit for bit (a matrix's value is NaN in both)."""
    return a == b or (isinstance(a, float) and isinstance(b, float) and np.isnan(a)
                      and np.isnan(b))


def _cells(sweep) -> dict:
    rows = ResultStore(sweep.output).read().to_pylist()
    return {(r["checkpoint"], r["metric"]): r for r in rows}


@pytest.fixture(scope="module")
def runs(ray_cluster, sweep_dir):
    full = _sweep(sweep_dir, "full", 2, None)
    report = run_sweep(full)
    assert all(o.ok and not o.partial for o in report.outcomes)
    raced = {}
    for workers in (1, 3):
        sweep = _sweep(sweep_dir, f"race{workers}", workers, {"metric": "data/accuracy"})
        raced[workers] = (run_sweep(sweep), _cells(sweep))
    return _cells(full), raced


def test_race_finds_the_full_runs_best_with_its_exact_cells(runs):
    full, raced = runs
    accuracy = {c: r["value"] for (c, m), r in full.items() if m == "accuracy"}
    best = max(accuracy, key=accuracy.get)
    assert sorted(accuracy.values())[-2] < accuracy[best], sorted(accuracy.values())
    for workers, (report, cells) in raced.items():
        complete = {c for (c, m), r in cells.items() if r["items_total"] is None}
        assert best in complete, workers
        survivors = [c for c in complete if (c, "accuracy") in cells]
        assert max(survivors, key=lambda c: cells[(c, "accuracy")]["value"]) == best
        for (c, metric), row in cells.items():
            if row["items_total"] is None:        # survivors: the full run's cell, bit for bit
                for field in FIELDS:
                    assert _same(row[field], full[(c, metric)][field]), (workers, c, metric,
                                                                          field)
                assert row["num_samples"] == ROWS and row["cell"] == full[(c, metric)]["cell"]


def test_eliminated_checkpoints_are_stored_partial_and_items_are_saved(runs):
    full, raced = runs
    for workers, (report, cells) in raced.items():
        partial = {c: r for (c, m), r in cells.items()
                   if m == "accuracy" and r["items_total"] is not None}
        assert len(partial) >= CHECKPOINTS // 2, (workers, len(partial))
        for c, r in partial.items():
            assert r["items_total"] == ROWS and 0 < r["num_samples"] < ROWS
            assert r["cell"].endswith("-partial") and r["cell"] != full[(c, "accuracy")]["cell"]
            assert f"stopped after {r['num_samples']} of {ROWS} items: below #1" in r["stopped"]
            assert r["ci_low"] <= r["value"] <= r["ci_high"]
            assert r["value"] < max(v["value"] for (_, m), v in full.items() if m == "accuracy")
        scored, every = report.raced
        assert every == CHECKPOINTS * ROWS and scored < every * 0.6, (workers, scored)
        assert scored == sum(r["num_samples"] for (_, m), r in cells.items() if m == "accuracy")


def test_the_race_is_the_same_on_1_and_3_workers(runs):
    _, raced = runs
    one, three = raced[1][1], raced[3][1]
    assert one.keys() == three.keys()
    for key, row in one.items():
        for field in FIELDS + ("items_total", "stopped", "cell"):
            assert _same(three[key][field], row[field]), (key, field)


def test_a_later_run_without_select_completes_the_partial_cells(runs, sweep_dir):
    """The race's partial cells keep their states (io.store_states): a run of the same sweep
    without ``select:`` scores only their remaining rows, and the completed cells equal the
    full run's bit for bit; the boards then take the complete cells."""
    from rayeval.reporting.boards import latest_rows

    full, raced = runs
    partial = {c: r["num_samples"] for (c, m), r in raced[1][1].items()
               if m == "accuracy" and r["items_total"] is not None}
    sweep = _sweep(sweep_dir, "race1", 2, None)        # the race's output, no select
    report = run_sweep(sweep)
    resumed = {o.checkpoint: o.resumed for o in report.outcomes}
    assert resumed == partial and all(o.ok and o.rows == ROWS for o in report.outcomes)
    assert not report.plan.cached or len(report.plan.cached) == CHECKPOINTS - len(partial)
    rows = {(r["checkpoint"], r["metric"]): r
            for r in latest_rows(ResultStore(sweep.output).read())}
    assert rows.keys() == full.keys()
    for key, row in rows.items():
        assert row["items_total"] is None, key
        for field in FIELDS:
            assert _same(row[field], full[key][field]), (key, field)
