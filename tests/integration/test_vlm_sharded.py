"""A vision-language model sharded with FSDP2 (``parallelism: {shard: 2}``) on a real local Ray,
against transformers itself, item by item.

The tiny untrained Idefics3 of tests/vlm_support.py and 11 easy-vqa test items as parquet image
bytes: one replica of 2 ranks, each rank scoring its own rows (6 and 5: uneven, so a rank runs
idle forwards while its peer finishes) of a generation and a multiple_choice evaluation. Every
forward pass of a replica must gather the same FSDP units: the image encoder runs only on
forwards with images (not on decoding steps nor idle forwards), so it is never a unit
(``sharding.towers``; with it as one, gloo aborts the workers on a collective mismatch), and
``generate`` encodes the images inside the prefill forward, not before it (where FSDP has not
gathered the encoder: ``sharding.encode_images_in_forward``). The reference is transformers
run by hand on the whole model, one item at a time; half of the generation targets are its own
generations, so exact match is right only if every generated text equals it (an untrained
model never gives easy-vqa's answers).
"""

import dataclasses

import pytest
import yaml

pytest.importorskip("transformers")
pytest.importorskip("easy_vqa")

from vlm_support import (easy_vqa_items, mc_choices,  # noqa: E402
                         transformers_reference, write_vqa_parquet)

from rayeval.errors import ModelError  # noqa: E402
from rayeval.execution.driver import run_sweep  # noqa: E402
from rayeval.execution.workers.sharding import memory, towers, units  # noqa: E402
from rayeval.io.store import ResultStore  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402
from rayeval.ranking import latest_rows  # noqa: E402

N = 11
NEW_TOKENS = 4
CHOICES = 3


@pytest.fixture(scope="module")
def example(tmp_path_factory, tiny_vlm):
    import shutil

    out = tmp_path_factory.mktemp("vlm_sharded")
    folder = str(out / "ckpts" / "checkpoint-1")     # the run's one tiny Idefics3 (conftest)
    shutil.copytree(tiny_vlm, folder)
    items = easy_vqa_items("test", n=N, seed=3)
    choices = mc_choices(items, CHOICES)
    texts, acc, acc_norm = transformers_reference(folder, items, choices, NEW_TOKENS)
    targets = write_vqa_parquet(out / "items.parquet", items, choices, texts)
    data = {"path": "items.parquet", "prompt": "question", "images": "image", "id": "id"}
    sweep = {"name": "vqa", "checkpoints": ["ckpts/checkpoint-*"], "output": "out",
             "workers": 2, "parallelism": {"shard": 2},
             "recovery": {"max_restarts": 0}, "bootstrap": {"replicates": 100},
             "evals": [{"name": "gen", "task": "generation", "batch_size": 4,
                        "metrics": ["exact_match"],
                        "generation": {"max_new_tokens": NEW_TOKENS, "until": ["\n"]},
                        "dataset": {**data, "target": "target"}},
                       {"name": "mc", "task": "multiple_choice", "batch_size": 4,
                        "metrics": ["acc", "acc_norm"],
                        "dataset": {**data, "choices": "choices", "target": "label"}}]}
    (out / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    ids = [it["id"] for it in items]
    return out, {"texts": texts, "targets": dict(zip(ids, targets)), "acc": acc,
                 "acc_norm": acc_norm}


def test_the_image_encoder_is_never_a_unit(example):
    from transformers import AutoModelForImageTextToText

    out, _ = example
    model = AutoModelForImageTextToText.from_pretrained(str(out / "ckpts" / "checkpoint-1"))
    assert towers(model) == [model.model.vision_model]
    # _no_split_modules names Idefics3VisionAttention too: only the text layers are kept
    assert units(model) == list(model.model.text_model.layers)
    assert units(model, ("LlamaDecoderLayer", "Idefics3EncoderLayer")) == list(
        model.model.text_model.layers)
    with pytest.raises(ModelError, match="parallelism.wrap: .*image encoder"):
        units(model, ("Idefics3EncoderLayer",))
    vision = sum(p.numel() * 4 for p in model.model.vision_model.parameters())
    assert memory(model, 2).root > vision          # whole in each forward, with the root


@pytest.mark.ray
def test_sharded_over_2_ranks_equals_transformers_item_by_item(example, standing):
    import rayeval

    out, ref = example
    ckpt = str(out / "ckpts" / "checkpoint-1")
    em = sum(float(ref["texts"][i].strip() == ref["targets"][i].strip())
             for i in ref["texts"]) / N
    assert em >= 0.5                    # the half whose target is the reference generation
    want = {"exact_match": em, "acc": sum(ref["acc"].values()) / N,
            "acc_norm": sum(ref["acc_norm"].values()) / N}
    sweep = load_sweep(str(out / "sweep.yaml"))
    assert sweep.parallelism.shard == 2 and sweep.workers == 2
    report = run_sweep(dataclasses.replace(sweep, output=str(out / "store")),
                       standing=standing)
    assert report.outcomes and all(o.ok for o in report.outcomes), [
        o.error for o in report.outcomes]
    rows = latest_rows(ResultStore(str(out / "store")).read())
    assert sorted((r["evaluation"], r["metric"]) for r in rows) == [
        ("gen", "exact_match"), ("mc", "acc"), ("mc", "acc_norm")]
    for r in rows:
        assert r["world_size"] == 2 and r["num_samples"] == N
        assert r["value"] == want[r["metric"]], (r["evaluation"], r["metric"])
    gen = rayeval.samples(str(out / "store"), checkpoint=ckpt, evaluation="gen").to_pylist()
    assert sorted(r["id"] for r in gen) == sorted(ref["texts"])         # each item once
    assert {r["id"]: r["response"] for r in gen} == ref["texts"]
    assert {r["id"]: r["target"] for r in gen} == ref["targets"]
    mc = rayeval.samples(str(out / "store"), checkpoint=ckpt, evaluation="mc").to_pylist()
    assert {r["id"]: r["acc"] for r in mc} == ref["acc"]
    assert {r["id"]: r["acc_norm"] for r in mc} == ref["acc_norm"]
