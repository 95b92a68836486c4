"""model.backend: vllm on image+text items (the tiny Idefics3 of tests/vlm_support.py, easy-vqa
items): one engine kept across checkpoints with the weights loaded in place, greedy token ids
equal to transformers' own ``generate`` item by item (token ids, not text: an untrained
model's bytes are not always whole UTF-8 characters), and the same through a whole run; a
family vLLM cannot serve here is one line before Ray starts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

from support import need_vllm, rayeval_cli
from vlm_support import build_tiny_vlm, easy_vqa_items, item_texts

import rayeval
from rayeval.errors import SpecError

pytestmark = pytest.mark.vllm

need_vllm()

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_vlm):
    """Two untrained tiny Idefics3 checkpoints (seeds 0 and 1) sharing one tokenizer: A is the
    run's one build of it (``tiny_vlm``, tests/conftest.py; the model lmms-eval's references
    ran on), B the same recipe with seed 1."""
    out = tmp_path_factory.mktemp("vlm")
    texts = item_texts(easy_vqa_items("train", n=500))          # tiny_vlm's tokenizer texts
    return {"A": tiny_vlm,
            "B": build_tiny_vlm(out / "ckpts" / "checkpoint-2", texts, seed=1)}


def test_vllm_image_generations_equal_transformers_token_ids_through_swaps(folders, tmp_path):
    """One engine (started once) serves A, B, then A again, weights loaded in place."""
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE),
                                                        "vllm_images_run.py"), str(out),
                           folders["A"], folders["B"], folders["A"]],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b, again = json.loads(out.read_text())
    for run in (a, b, again):
        assert len(run["vllm"]) == 6
        differ = [i for i, (ours, theirs) in enumerate(zip(run["vllm"], run["hf"]))
                  if ours != theirs]
        assert not differ, [(run["vllm"][i], run["hf"][i]) for i in differ]
        assert len(run["texts"]) == 6 and all(isinstance(t, str) for t in run["texts"])
    assert len({a["engine"], b["engine"], again["engine"]}) == 1      # one engine throughout
    assert a["vllm"] != b["vllm"] and again["vllm"] == a["vllm"]      # B served, then A again
    assert len({tuple(t) for t in b["vllm"]}) > 1     # the items' images make a difference


@pytest.mark.ray
def test_an_image_sweep_on_vllm_generates_what_transformers_does(folders, tmp_path, request):
    """The whole path (a Ray Data stage renders and decodes, the worker's engine generates):
    the records' responses are transformers' greedy generations, decoded by the checkpoint's
    tokenizer; the records carry each item's thumbnail, and the page shows them. With
    lmms-eval installed, an ``lmms_eval:`` entry on the same items and engine too: its
    records equal lmms-eval's own run (``--model huggingface``) item by item (the run's
    lmms-eval references, ``lmms_suite``: the task over these items, on A)."""
    from lmms_reference import IMAGES_ITEMS

    items = easy_vqa_items(**IMAGES_ITEMS)
    lmms = importlib.util.find_spec("lmms_eval") is not None
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({k: [it[k] for it in items] for k in items[0]}),
                   tmp_path / "vqa.parquet")
    sweep = {"name": "vqa", "checkpoints": [folders["A"], folders["B"]], "workers": 1,
             "output": "store", "bootstrap": {"replicates": 0},
             "model": {"backend": "vllm", "vllm": {"max_model_len": 128,
                                                    "enforce_eager": True}},
             "evals": [{"name": "vqa", "task": "generation", "samples": True,
                        "dataset": {"path": "vqa.parquet", "prompt": "question",
                                    "images": "image", "target": "answer", "id": "id"},
                        "generation": {"max_new_tokens": 6}, "metrics": ["exact_match"]}]}
    if lmms:
        from lmms_reference import IMAGES_TASK

        suite = request.getfixturevalue("lmms_suite")
        assert suite["model"] == folders["A"]
        sweep["evals"].append({"name": "lmms", "samples": True,
                               "lmms_eval": {"task": IMAGES_TASK,
                                             "include_path": suite["tasks"]["images"]}})
    (tmp_path / "vqa.yaml").write_text(yaml.safe_dump(sweep))
    proc = rayeval_cli("run", str(tmp_path / "vqa.yaml"), timeout=900,
                       env={**os.environ, "RAYEVAL_PROGRESS_INTERVAL_S": "0.5"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    store = str(tmp_path / "store")
    for name in ("A", "B"):
        records = rayeval.samples(store, checkpoint=os.path.basename(folders[name]),
                                  evaluation="vqa").to_pylist()
        expected = _transformers_texts(folders[name], items, 6)
        assert {r["id"]: r["response"] for r in records} == expected
        assert all(len(r["thumbnails"]) == 1 and r["thumbnails"][0][:4] == b"\x89PNG"
                   for r in records)
    # while no row moves, every progress line says what the workers are doing (the images
    # are decoded while the engine starts, so it is the engine's steps that show)
    idle = [ln for ln in proc.stderr.splitlines() if "cells, 0% of rows" in ln]
    assert idle and all(" for 0:" in ln for ln in idle), proc.stderr[-3000:]
    assert "starting the vLLM engine" in proc.stderr
    if lmms:
        _equal_lmms_eval(store, folders["A"], suite["reference"]["images"]["samples"],
                         len(items))
    page = rayeval_cli("samples", store, "--checkpoint", "2", "--eval", "vqa", "--format",
                       "html")
    assert page.returncode == 0 and page.stdout.count('<img src="data:image/png') == 6


def _equal_lmms_eval(store: str, folder: str, theirs: dict, n: int) -> None:
    """The ``lmms`` evaluation's records on vLLM equal lmms-eval's own run (``theirs``: its
    logged samples by filter, on ``folder``), document by document: the generated text and
    each filter's metric values."""
    from lmms_reference import FILTERS

    records = rayeval.samples(store, checkpoint=os.path.basename(folder),
                              evaluation="lmms").to_pylist()
    assert sorted(r["id"] for r in records) == list(range(n))
    for r in records:
        assert r["response"] == theirs["none"][r["id"]]["filtered_resps"], r["id"]
        for f in FILTERS:
            for metric in ("exact_match", "answer_chars", "upper_chars"):
                assert r[f"{metric},{f}"] == theirs[f][r["id"]][metric], (r["id"], metric, f)


def _transformers_texts(folder: str, items: list[dict], new: int) -> dict:
    """Each item's greedy generation by transformers, cut at the end of utterance and decoded
    without special tokens (as rayeval decodes every backend's tokens)."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(folder)
    tok = processor.tokenizer
    out = {}
    for it in items:
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"},
                                          {"type": "text", "text": it["question"]}]}],
            add_generation_prompt=True)
        inputs = processor(text=prompt, images=[Image.open(it["image"]).convert("RGB")],
                           return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, do_sample=False, max_new_tokens=new)
        ids = ids[0, inputs["input_ids"].shape[1]:].tolist()
        ids = ids[:ids.index(tok.eos_token_id)] if tok.eos_token_id in ids else ids
        out[it["id"]] = tok.decode(ids, skip_special_tokens=True)
    return out


def test_a_family_vllm_cannot_serve_here_is_one_line_before_ray(tmp_path):
    """LLaVA: its vLLM module imports torchvision, which has no CPU build on the package
    index (the planner reads config.json; the engine never starts)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: vLLM can import its LLaVA module")
    folder = tmp_path / "llava"
    config = LlavaConfig(vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1,
                                                        num_attention_heads=2),
                         text_config=LlamaConfig(hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=1, num_attention_heads=2))
    config.architectures = ["LlavaForConditionalGeneration"]   # as a saved model's config has
    config.save_pretrained(folder)
    sweep = {"name": "llava", "checkpoints": [str(folder)], "output": str(tmp_path / "out"),
             "model": {"backend": "vllm"},
             "evals": [{"name": "vqa", "task": "generation",
                        "dataset": {"path": str(tmp_path / "none.parquet"),
                                    "prompt": "question", "images": "image",
                                    "target": "answer"},
                        "metrics": ["exact_match"]}]}
    (tmp_path / "llava.yaml").write_text(yaml.safe_dump(sweep))
    from rayeval.plan.preflight import prepare

    with pytest.raises(SpecError) as info:
        prepare(rayeval.load_sweep(str(tmp_path / "llava.yaml")))
    message = str(info.value)
    assert ": model.backend: vLLM cannot serve LlavaForConditionalGeneration" in message
    assert "torchvision" in message and "model.backend: hf" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_the_families_said_unservable_are_those_vllm_cannot_import_here():
    """vllm_preflight.NEEDS_TORCHVISION against the installed vLLM: each listed module fails to import
    without torchvision, and the Idefics3 family's imports (one process, one vLLM import)."""
    from rayeval.io import vllm_preflight

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: every family imports")
    modules = sorted(set(vllm_preflight.NEEDS_TORCHVISION.values())) + ["idefics3", "smolvlm"]
    code = ("import importlib, json, sys\nout = {}\n"
            f"for m in {modules!r}:\n"
            "    try:\n"
            "        importlib.import_module('vllm.model_executor.models.' + m)\n"
            "        out[m] = None\n"
            "    except ModuleNotFoundError as e:\n"
            "        out[m] = e.name\n"
            "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    missing = json.loads(proc.stdout.strip().splitlines()[-1])
    assert missing == {m: (None if m in ("idefics3", "smolvlm") else "torchvision")
                       for m in modules}
    assert vllm_preflight.serves({"model_type": "idefics3"}) is None
    assert "torchvision" in vllm_preflight.serves({"model_type": "qwen2_vl"})
