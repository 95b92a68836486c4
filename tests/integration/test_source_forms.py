"""Tier 3: every data source through a real run. The digits example's data as parquet (read
directly), JSON lines, CSV (a transform stage), a Hugging Face save_to_disk folder and a folder
of PNGs (a decoding stage) gives the same values, intervals and bootstrap replicates, bit for
bit, as parquet; so does parquet sent through Ray Data, for 2 and 3 workers, on a row count
(1,009, a prime) that no worker count divides: the exact split drops nothing. The first runs
on a standing group (``rayeval serve``'s), the others have fits of their own."""

import os
import sys
import time

import pytest

from rayeval.execution.driver import run_sweep
from rayeval.plan.loader import load_sweep
from rayeval.ranking import latest_rows
from rayeval.io.store import ResultStore

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import make_data_forms  # noqa: E402

pytestmark = pytest.mark.ray


def plan_line_to(lines):
    from rayeval.execution.callbacks import RunCallback
    from rayeval.reporting.display import plan_line

    class Keep(RunCallback):
        def on_plan(self, plan):
            lines.append(plan_line(plan))

    return [Keep()]

ROWS = 1009


def stored(output) -> dict:
    """{(evaluation, checkpoint basename, metric): (value, ci_low, ci_high, replicates, rows)}"""
    return {(r["evaluation"], os.path.basename(r["checkpoint"]), r["metric"]):
            (r["value"], r["ci_low"], r["ci_high"], tuple(r["replicates"]), r["num_samples"],
             r["world_size"])
            for r in latest_rows(ResultStore(output).read())}


def by_form(rows: dict, form: str) -> dict:
    return {k[1:]: v for k, v in rows.items() if k[0] == form}


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    folder = tmp_path_factory.mktemp("forms")
    sweep = make_data_forms.write(str(folder), make_data_forms.os.path.join(
        make_data_forms.EXAMPLE, "data", "clean.parquet"), ROWS,
        make_data_forms.os.path.join(make_data_forms.EXAMPLE, "ckpts"))
    return folder, sweep


def split_coordinators() -> set:
    """The live SplitCoordinator actors of the session's Ray (its GCS table: the public state
    API needs the dashboard this Ray lacks)."""
    import ray._private.state as ray_state

    return {k for k, a in ray_state.actors().items()
            if a["ActorClassName"] == "SplitCoordinator" and a["State"] != "DEAD"}


def test_every_source_gives_the_numbers_of_parquet(standing, forms):
    """On a standing group (a service's: its fit has no data sets, so rank 0 splits the four
    Ray Data pipelines when the run arrives), whose splits end with the run."""
    folder, path = forms
    sweep = load_sweep(path)
    lines = []
    before = split_coordinators()
    report = run_sweep(sweep, callbacks=plan_line_to(lines), standing=standing)
    assert all(o.ok for o in report.outcomes), [o.error for o in report.outcomes if not o.ok]
    deadline = time.monotonic() + 20           # ray.kill is asynchronous: bounded wait
    while split_coordinators() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not split_coordinators() - before, "a split's coordinator outlived its run"
    assert (f"[parquet ({ROWS} rows), jsonl ({ROWS} rows, json through Ray Data), "
            f"csv ({ROWS} rows, csv through Ray Data), hf ({ROWS} rows, hf through Ray Data), "
            f"images ({ROWS} rows, images through Ray Data)]") in lines[0]
    rows = stored(sweep.output)
    reference = by_form(rows, "parquet")
    assert len(reference) == 4 * 3                     # 4 checkpoints x 3 metrics
    assert all(v[4] == ROWS and v[5] == 2 for v in reference.values())
    assert len(reference[("step_000600", "accuracy")][3]) == 1000    # replicates kept
    for form in ("jsonl", "csv", "hf", "images"):
        assert by_form(rows, form) == reference, form


def test_records_name_each_item_by_its_row_where_the_data_has_no_id(standing, forms,
                                                                    tmp_path):
    """Without an id column an item's id is a hash of its content (the bootstrap's), which no
    user can look up: its records carry its row, the position in the data set as it is read
    (files in order, rows in file order), from every reader: parquet read directly, JSON lines
    and CSV (a transform stage) and a folder of PNGs through Ray Data, split over 2 workers.
    Checked against the data itself: every row once, each record's target the label at its
    row, and the same item (its content id) at the same row in every form."""
    import pyarrow.parquet as pq
    import yaml

    folder, path = forms
    spec = yaml.safe_load(open(path))
    spec["evals"] = [{**e, "dataset": {k: v for k, v in e["dataset"].items() if k != "id"}}
                     for e in spec["evals"] if e["name"] in ("parquet", "jsonl", "csv", "images")]
    spec["checkpoints"] = [spec["checkpoints"][0].replace("step_*", "step_000600*")]
    spec["output"] = str(tmp_path / "out")
    variant = folder / "no_ids.yaml"
    variant.write_text(yaml.safe_dump(spec, sort_keys=False))
    report = run_sweep(load_sweep(str(variant)), standing=standing)
    assert len(report.outcomes) == 4 and all(o.ok for o in report.outcomes), \
        [o.error for o in report.outcomes]
    data = pq.read_table(folder / "digits.parquet")
    labels = [str(v) for v in data["label"].to_pylist()]
    # the folder of PNGs is read in the sorted order of its files' paths ("LABEL/ROW.png")
    files = sorted(data["path"].to_pylist())
    image_labels = [str(labels[int(p.split("/")[1].split(".")[0])]) for p in files]
    store = ResultStore(spec["output"])
    items = {}
    for r in latest_rows(store.read()):
        if r["metric"] != "accuracy":
            continue
        records = store.read_samples(r["cell"], r["samples"]).to_pylist()
        rows = [x["row"] for x in records]
        assert sorted(rows) == list(range(ROWS)), r["evaluation"]
        expected = image_labels if r["evaluation"] == "images" else labels
        assert all(x["target"] == expected[x["row"]] for x in records), r["evaluation"]
        items[r["evaluation"]] = {x["row"]: x["id"] for x in records}
    assert set(items) == {"parquet", "jsonl", "csv", "images"}
    assert items["jsonl"] == items["parquet"] and items["csv"] == items["parquet"]


@pytest.mark.parametrize("workers", [2, 3])
def test_parquet_through_ray_data_equals_the_direct_read(ray_cluster, forms, tmp_path,
                                                         monkeypatch, workers):
    """The direct read of local parquet is the fast path: bit-identical to the pipeline."""
    _, path = forms
    direct = load_sweep(path).replace(workers=workers, output=str(tmp_path / "direct"))
    direct = direct.replace(evals=tuple(e for e in direct.evals if e.name in ("parquet",
                                                                               "jsonl")))
    first = run_sweep(direct)
    assert all(o.ok for o in first.outcomes)
    # one evaluation read directly, one through Ray Data, on every rank
    assert all(t["first batch"][1] == 2 * t["ray data"][1]
               for t in first.worker_times.values()), first.worker_times
    monkeypatch.setenv("RAYEVAL_DATA_PLANE", "ray")
    piped = direct.replace(output=str(tmp_path / "piped"))
    second = run_sweep(piped)
    assert all(o.ok for o in second.outcomes)
    assert all(t["first batch"][1] == t["ray data"][1] > 0
               for t in second.worker_times.values()), second.worker_times
    a, b = stored(direct.output), stored(piped.output)
    assert len(a) == 2 * 4 * 3 and a == b
    assert {v[4] for v in b.values()} == {ROWS} and {v[5] for v in b.values()} == {workers}
    assert by_form(b, "parquet") == by_form(b, "jsonl")


def test_a_shard_over_the_memory_budget_streams_on_every_pass(ray_cluster, forms, tmp_path,
                                                             monkeypatch):
    """Kept after the first pass when it fits; with no memory budget every checkpoint's pass
    is a new epoch of the split, and the numbers are the same."""
    _, path = forms
    base = load_sweep(path)
    base = base.replace(evals=tuple(e for e in base.evals if e.name == "jsonl"))
    kept = run_sweep(base.replace(output=str(tmp_path / "kept")))
    monkeypatch.setenv("RAYEVAL_SHARD_CACHE_BYTES", "0")      # handed to the workers
    streamed = run_sweep(base.replace(output=str(tmp_path / "streamed")))
    assert all(o.ok for o in kept.outcomes + streamed.outcomes)
    # 4 cells, the first in two passes (1/32 of its buckets first: resume)
    assert all(t["streamed"][1] == 1 and t["pass"][1] == 5 for t in kept.worker_times.values())
    assert all(t["streamed"][1] == 5 for t in streamed.worker_times.values())
    assert stored(str(tmp_path / "kept")) == stored(str(tmp_path / "streamed"))


def test_text_tasks_tokenized_on_a_stage_give_the_numbers_of_parquet(ray_cluster, tmp_path):
    """The language-model example's three text tasks from JSON lines (tokenized on a Ray
    Data stage) and from parquet (on the workers): the same values and intervals."""
    import json

    import pyarrow.parquet as pq
    import yaml

    lm = os.path.join(make_data_forms.EXAMPLE, "..", "lm")
    raw = yaml.safe_load(open(os.path.join(lm, "sweep.yaml")))
    raw["checkpoints"] = [os.path.abspath(os.path.join(lm, c)) for c in raw["checkpoints"]]
    evals = []
    for ev in raw["evals"]:
        source = os.path.join(lm, ev["dataset"]["path"])
        lines = tmp_path / (ev["name"] + ".jsonl")
        lines.write_text("".join(json.dumps(r) + "\n" for r in pq.read_table(source).to_pylist()))
        evals.append({**ev, "dataset": {**ev["dataset"], "path": os.path.abspath(source)}})
        evals.append({**ev, "name": ev["name"] + "_jsonl",
                      "dataset": {**ev["dataset"], "path": str(lines)}})
    raw.update(evals=evals, output=str(tmp_path / "out"))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(raw))
    sweep = load_sweep(str(tmp_path / "sweep.yaml"))
    report = run_sweep(sweep)
    assert all(o.ok for o in report.outcomes), [o.error for o in report.outcomes if not o.ok]
    rows = stored(sweep.output)
    for ev in ("facts_mc", "docs", "sums"):
        want = by_form(rows, ev)
        assert want and by_form(rows, ev + "_jsonl") == want, ev
