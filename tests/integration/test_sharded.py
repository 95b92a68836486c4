"""Models sharded over workers (``parallelism: {shard: N}``): FSDP2 replicas, every layout read
in slices, the same numbers as one whole model.

Two tiers. ``torchrun`` with 4 gloo ranks on loopback (tests/sharded_ranks.py, ~20 s): every
layout, including a DCP checkpoint written by 4 FSDP ranks, loaded into replicas of 2 and of 4
ranks; each rank holds only its rows, outputs equal the unsharded model's exactly, uneven work
stays in step. Spec errors come before Ray starts (those tests run first). Then real Ray runs
on one local Ray (``rayeval.run``, what the CLI's ``run`` calls): the text tasks on a Hugging
Face folder with 2 replicas of 2 and 1 replica of 4 against rayeval's single-process scoring,
and a factory model from that DCP checkpoint on language modeling.
"""

import json
import math
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from support import ray_starts, rayeval_main, script, single_process_passes

import rayeval
from rayeval.ranking import latest_rows
from rayeval.config.schema import Parallelism
from rayeval.io.data import read_batches
from rayeval.core.evaluate import finalize
from rayeval.plan.loader import load_sweep
from rayeval.io.store import ResultStore

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/: sharded_ranks.py
REPO = os.path.dirname(HERE)
EXACT = ("acc", "acc_norm", "exact_match", "token_accuracy")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Runs tests/sharded_ranks.py on 4 gloo ranks; (its output folder, each rank's report)."""
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
         os.path.join(HERE, "sharded_ranks.py"), str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return out, reports


def test_every_layout_loads_only_each_ranks_rows_and_computes_exactly(ranks):
    _, reports = ranks
    total = reports[0]["total_elements"]
    cases = {}
    for report in reports:
        for c in report["cases"]:
            cases.setdefault((c["shard"], c["layout"]), []).append((report["rank"], c))
    assert {layout for _, layout in cases} == {"torch", "safetensors", "safetensors-sharded",
                                               "dcp"}
    assert {n for n, _ in cases} == {2, 4}
    for (n, layout), per_rank in cases.items():
        for rank, c in per_rank:
            assert c["read_as"] == layout
            # The same outputs as the whole model, to the last bit.
            assert c["max_diff"] == 0.0, (n, layout, rank)
            # A rank holds its share of the parameters: total / N, up to FSDP's rounding.
            assert c["held_elements"] <= math.ceil(total / n) * 1.05, (n, layout, rank)
        for replica in range(4 // n):
            members = [c for rank, c in per_rank if rank // n == replica]
            assert sum(c["held_elements"] for c in members) == total   # every element once
            # Rank r ran r + 1 real forwards; the others of its replica idled until the last.
            most = max(c["forwards"] for c in members)
            for c in members:
                assert c["forwards"] + c["idle"] == most


LM_MODULE = """
import torch
from sharded_ranks import TinyLM

def build():
    return TinyLM()
"""


# --- bad input, before Ray --------------------------------------------------------------------

def test_parallelism_errors_name_the_keys_before_ray(tmp_path):
    shutil.copy(os.path.join(HERE, "sharded_ranks.py"), tmp_path / "sharded_ranks.py")
    (tmp_path / "lm_model.py").write_text(LM_MODULE)
    pq.write_table(pa.table({"tokens": [[1, 2, 3]] * 4}), tmp_path / "tokens.parquet")
    torch.save(_tiny_state(), tmp_path / "step_1.pt")
    base = {"name": "bad", "model": {"factory": "lm_model:build"},
            "checkpoints": [str(tmp_path / "step_1.pt")], "workers": 3, "output": "results",
            "evals": [{"name": "tokens", "task": "language_modeling",
                       "dataset": {"path": "tokens.parquet", "inputs": "tokens"},
                       "metrics": ["nll"]}]}
    path = tmp_path / "sweep.yaml"
    cases = [
        ({"parallelism": {"shard": 2}}, {}, "parallelism.shard: 2 does not divide workers: 3"),
        ({"parallelism": {"shard": 0}}, {}, "parallelism.shard: must be at least 1"),
        ({"parallelism": {"shard": 2, "wrap": 5}}, {}, "parallelism.wrap: expected module"),
        ({"parallelism": {"shard": 2}, "workers": 2}, {"workers": 3},
         "--workers: 3 is not a multiple of parallelism.shard: 2"),
        ({"parallelism": {"shard": 2, "wrap": ["Block"]}, "workers": 2}, {},
         "parallelism.wrap: the model has no module of class Block"),
    ]
    for change, overrides, message in cases:
        path.write_text(yaml.safe_dump({**base, **change}))
        with pytest.raises(rayeval.RayevalError) as e:
            rayeval.run(path, **overrides)
        assert message in str(e.value)
        assert not (tmp_path / "results").exists()
    # The command line (its main(), in this process): the same, as its one line, before Ray.
    with ray_starts() as started:
        proc = rayeval_main("run", str(path))
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert not started
    assert "parallelism.wrap: the model has no module of class Block" in lines[0]
    assert "Traceback" not in proc.stderr


def _tiny_state():
    sys.path.insert(0, HERE)
    try:
        from sharded_ranks import TinyLM
    finally:
        sys.path.remove(HERE)
    return TinyLM().state_dict()


def test_units_and_the_memory_inspect_reports(tmp_path):
    """The units FSDP gathers one at a time and the memory per worker, from the meta model;
    `rayeval inspect --shard N` prints it."""
    from rayeval.execution.workers.sharding import memory, units

    sys.path.insert(0, HERE)
    try:
        from sharded_ranks import TinyLM
    finally:
        sys.path.remove(HERE)
    with torch.device("meta"):
        model = TinyLM()
    assert units(model) == list(model.blocks)                   # the ModuleList's entries
    assert units(model, ("Linear",)) == [m for b in model.blocks for m in b
                                         if isinstance(m, torch.nn.Linear)] + [model.head]
    block = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    total = sum(p.numel() for p in model.parameters()) * 4     # the tied head counted once
    need = memory(model, 4)
    assert (need.total, need.units, need.largest_unit) == (total, 3, block)
    assert need.root == model.embed.weight.numel() * 4          # embedding = tied head
    assert need.resident == math.ceil(total / 4)
    assert need.peak == need.resident + need.root + 2 * block
    assert memory(model, 1).peak == total
    assert memory(model, 2, dtype=torch.bfloat16).total == total // 2

    shutil.copy(os.path.join(HERE, "sharded_ranks.py"), tmp_path / "sharded_ranks.py")
    (tmp_path / "lm_model.py").write_text(LM_MODULE)
    torch.save(_tiny_state(), tmp_path / "step_1.pt")
    pq.write_table(pa.table({"tokens": [[1, 2, 3]] * 4}), tmp_path / "tokens.parquet")
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "m", "model": {"factory": "lm_model:build"}, "checkpoints": ["step_1.pt"],
        "workers": 2, "parallelism": {"shard": 2}, "output": "results",
        "evals": [{"name": "t", "task": "language_modeling",
                   "dataset": {"path": "tokens.parquet", "inputs": "tokens"},
                   "metrics": ["nll"]}]}))
    proc = rayeval_main("inspect", str(tmp_path / "step_1.pt"), "--sweep",
                        str(tmp_path / "sweep.yaml"), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["memory"] == {
        "shard": 2, "weights_bytes": total, "held_bytes": math.ceil(total / 2),
        "root_bytes": need.root, "largest_unit_bytes": block, "units": 3,
        "peak_weights_bytes": math.ceil(total / 2) + need.root + 2 * block}
    table = rayeval_main("inspect", str(tmp_path / "step_1.pt"), "--sweep",
                         str(tmp_path / "sweep.yaml"), "--shard", "4")
    # the table's words, whichever line the terminal width wraps them onto (the first column
    # is as wide as the temporary path, longer under pytest-xdist)
    words = " ".join(table.stdout.replace("\u2502", " ").split())
    assert "sharded over 4 workers" in words and "of 3 units" in words, table.stdout


# --- real Ray runs ---------------------------------------------------------------------------

def single_process(sweep_path: str) -> dict:
    """rayeval's scoring of every cell in one process, the model whole: {(checkpoint,
    evaluation, metric): MetricResult}."""
    sweep = load_sweep(sweep_path).replace(parallelism=Parallelism())
    out = {}
    for ref, ev, _, decode, p, metrics in single_process_passes(sweep):
        for table in read_batches(ev.data, ev.spec.dataset, ev.spec.batch_size):
            p.update(*decode(table))
        p.finish()
        for metric, r in finalize(metrics, p.states, ev.output_size, ev.spec.bootstrap).items():
            out[(ref.location, ev.name, metric)] = r
    return out


def _stored(out) -> dict:
    return {(r["checkpoint"], r["evaluation"], r["metric"]): r
            for r in latest_rows(ResultStore(str(out)).read())}


def _same(stored: dict, expected: dict, world: int) -> None:
    assert set(stored) == set(expected)
    for key, r in stored.items():
        e = expected[key]
        assert r["world_size"] == world
        for got, want in ((r["value"], e.value), (r["ci_low"], e.ci_low),
                          (r["ci_high"], e.ci_high)):
            if key[2] in EXACT:
                assert got == want, key
            else:
                assert got == pytest.approx(want, rel=1e-6), key


def _set(sweep_path, **changes) -> None:
    with open(sweep_path) as f:
        raw = yaml.safe_load(f)
    raw.update(changes)
    with open(sweep_path, "w") as f:
        yaml.safe_dump(raw, f)


@pytest.mark.ray
def test_text_tasks_sharded_over_2_and_4_ranks_equal_the_whole_model(tmp_path, standing):
    pytest.importorskip("transformers")
    script("make_lm_example").build(str(tmp_path), checkpoints=1, steps=40)
    for name in ("mc", "docs", "gen"):          # 12 items each: enough for uneven shards
        data = tmp_path / "data" / f"{name}.parquet"
        pq.write_table(pq.read_table(data).slice(0, 12), data)
    sweep = tmp_path / "sweep.yaml"
    expected = single_process(str(sweep))
    for shard in (2, 4):
        _set(sweep, workers=4, parallelism={"shard": shard})
        out = tmp_path / f"store{shard}"
        report = rayeval.run(str(sweep), output=str(out), standing=standing)
        assert report.outcomes and not report.failures, report.failures
        _same(_stored(out), expected, world=4)




@pytest.mark.ray
def test_a_dcp_checkpoint_from_4_fsdp_ranks_evaluates_on_2_sharded_workers(ranks, tmp_path,
                                                                         standing):
    """A factory model (tied head, non-persistent buffer) from the DCP folder that 4 FSDP
    ranks wrote, on 2 workers sharing one copy: the numbers of the whole model."""
    folder, _ = ranks
    shutil.copy(os.path.join(HERE, "sharded_ranks.py"), tmp_path / "sharded_ranks.py")
    (tmp_path / "lm_model.py").write_text(LM_MODULE)
    shutil.copytree(folder / "checkpoints" / "dcp", tmp_path / "step_100")
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 37, size=int(rng.integers(2, 12))).tolist() for _ in range(61)]
    pq.write_table(pa.table({"tokens": seqs, "id": list(range(61))}), tmp_path / "tokens.parquet")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "sharded-lm", "model": {"factory": "lm_model:build"},
        "checkpoints": [str(tmp_path / "step_100")], "workers": 2, "output": "results",
        "parallelism": {"shard": 2}, "batch_size": 8, "bootstrap": {"replicates": 50},
        "evals": [{"name": "tokens", "task": "language_modeling",
                   "dataset": {"path": "tokens.parquet", "inputs": "tokens", "id": "id"},
                   "metrics": ["nll", "perplexity", "token_accuracy"]}]}))
    expected = single_process(str(sweep))
    report = rayeval.run(str(sweep), standing=standing)
    assert report.outcomes and not report.failures, report.failures
    _same(_stored(tmp_path / "results"), expected, world=2)
