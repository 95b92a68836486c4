"""Image+text items on a real local Ray, 1 and 3 workers, against transformers itself.

An untrained tiny Idefics3 (tests/vlm_support.py) and 16 easy-vqa test items as parquet image
bytes. The reference is transformers run by hand, one item at a time: ``AutoProcessor`` (chat
template, images then text) and ``generate`` for generation, a forward pass for each choice's
log-likelihood. An untrained model never gives easy-vqa's answers, so exact match would be 0
everywhere and prove nothing: half of the targets are the model's own reference generation (the
other half the real answer), and exact match is then right only if every item's generation
equals transformers' item by item. Batch sizes 1 and 16 are two evaluations of the same items
(16 items: one full batch; the 1-worker run's shard is that batch, the 3 workers' are ragged).
The runs share the module's Ray (the command line's own Ray start is test_cli's business).
"""

import dataclasses

import os

import pytest
import yaml

pytest.importorskip("transformers")
pytest.importorskip("easy_vqa")

from vlm_support import (easy_vqa_items, mc_choices, transformers_reference,  # noqa: E402
                         write_vqa_parquet)

from rayeval.execution.driver import run_sweep  # noqa: E402
from rayeval.io.store import ResultStore  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402
from rayeval.ranking import latest_rows  # noqa: E402

N = 16
NEW_TOKENS = 4
CHOICES = 4


@pytest.fixture(scope="module")
def example(tmp_path_factory, tiny_vlm):
    out = tmp_path_factory.mktemp("vlm_ray")
    folder = tiny_vlm                     # the run's one build of it (tests/conftest.py)
    items = easy_vqa_items("test", n=N, seed=7)
    choices = mc_choices(items, CHOICES)
    texts, acc, acc_norm = transformers_reference(folder, items, choices, NEW_TOKENS)
    targets = write_vqa_parquet(out / "items.parquet", items, choices, texts)
    data = {"path": "items.parquet", "prompt": "question", "images": "image", "id": "id"}
    gen = {"task": "generation", "metrics": ["exact_match"],
           "generation": {"max_new_tokens": NEW_TOKENS, "until": ["\n"]},
           "dataset": {**data, "target": "target"}}
    ckpts = os.path.join(os.path.dirname(folder), "checkpoint-*")
    sweep = {"name": "vqa", "checkpoints": [ckpts], "output": "out",
             "recovery": {"max_restarts": 0}, "bootstrap": {"replicates": 200},
             "evals": [{"name": "gen_b1", "batch_size": 1, **gen},
                       {"name": "gen_b16", "batch_size": 16, **gen},
                       {"name": "mc", "task": "multiple_choice", "batch_size": 16,
                        "metrics": ["acc", "acc_norm"],
                        "dataset": {**data, "choices": "choices", "target": "label"}}]}
    (out / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    reference = {"folder": folder, "texts": texts,
                 "targets": dict(zip([it["id"] for it in items], targets)),
                 "acc": acc, "acc_norm": acc_norm,
                 "questions": {it["id"]: it["question"] for it in items}}
    return out, reference


@pytest.mark.ray
def test_1_and_3_workers_and_batch_sizes_1_and_16_equal_transformers_item_by_item(
        example, standing):
    import rayeval

    out, ref = example
    ckpt = ref["folder"]
    em = sum(float(ref["texts"][i].strip() == ref["targets"][i].strip())
             for i in ref["texts"]) / N
    assert em >= 0.5                    # the half whose target is the reference generation
    want = {"exact_match": em, "acc": sum(ref["acc"].values()) / N,
            "acc_norm": sum(ref["acc_norm"].values()) / N}
    runs = {}
    for workers in (1, 3):
        store = out / f"store{workers}"
        sweep = load_sweep(str(out / "sweep.yaml"))
        report = run_sweep(dataclasses.replace(sweep, workers=workers, output=str(store)),
                           standing=standing)
        assert all(o.ok for o in report.outcomes), [o.error for o in report.outcomes]
        rows = latest_rows(ResultStore(str(store)).read())
        assert len(rows) == 4
        runs[workers] = {(r["evaluation"], r["metric"]): r for r in rows}
        for r in rows:
            assert r["world_size"] == workers and r["num_samples"] == N
            assert r["value"] == want[r["metric"]], (workers, r["evaluation"], r["metric"])
        for name in ("gen_b1", "gen_b16"):
            records = rayeval.samples(str(store), checkpoint=ckpt, evaluation=name).to_pylist()
            assert sorted(r["id"] for r in records) == sorted(ref["texts"])     # each once
            for r in records:
                assert r["response"] == ref["texts"][r["id"]]
                assert r["target"] == ref["targets"][r["id"]]
                assert r["context"] == ref["questions"][r["id"]]
                assert len(r["images"]) == 1 and r["images"][0].endswith("bytes>")
        mc = rayeval.samples(str(store), checkpoint=ckpt, evaluation="mc").to_pylist()
        assert {r["id"]: r["acc"] for r in mc} == ref["acc"]
        assert {r["id"]: r["acc_norm"] for r in mc} == ref["acc_norm"]
    for key, r in runs[3].items():       # identical intervals on any worker count
        assert (r["value"], r["ci_low"], r["ci_high"]) == (
            runs[1][key]["value"], runs[1][key]["ci_low"], runs[1][key]["ci_high"])
    assert runs[1][("gen_b1", "exact_match")]["ci_low"] == runs[1][("gen_b16", "exact_match")][
        "ci_low"]
    assert os.path.isdir(out / "store3" / "samples")
