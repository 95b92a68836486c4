"""Image+text items from every source rayeval reads (parquet with image bytes, a questions file
of JSON lines beside a folder of images, a Hugging Face save_to_disk folder with an Image
feature, several images per item), processed on the Ray Data stage as on the worker (typed
columns, the same tensors bit for bit), and bad input said in one line before Ray starts.
No Ray here: the stage object is called directly, as Ray Data calls it."""

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

pytest.importorskip("transformers")
pytest.importorskip("easy_vqa")

from rayeval.core import prepared, tasks  # noqa: E402
from rayeval.core.evaluate import Decoder  # noqa: E402
from rayeval.core.tasks.vision import ImageBatch  # noqa: E402
from rayeval.errors import CheckpointError, DataError, SpecError  # noqa: E402
from rayeval.plan import preflight  # noqa: E402
from rayeval.execution.pipeline import Tokenize  # noqa: E402
from rayeval.io import images as image_io, vision  # noqa: E402
from rayeval.io.data import inspect_dataset, read_batches  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402

from tests.vlm_support import easy_vqa_answers, easy_vqa_items  # noqa: E402

N = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_vlm):
    import shutil

    out = tmp_path_factory.mktemp("vlm_items")
    folder = str(out / "ckpts" / "checkpoint-1")     # the run's one tiny Idefics3 (conftest)
    shutil.copytree(tiny_vlm, folder)
    items = easy_vqa_items("test", n=N, seed=3)
    return out, folder, items


def _png(path):
    with open(path, "rb") as f:
        return f.read()


def _write_forms(out, items):
    """The same items as parquet bytes, JSON lines with relative paths, and an HF folder."""
    answers = easy_vqa_answers()
    cols = {"id": [it["id"] for it in items], "question": [it["question"] for it in items],
            "answer": [it["answer"] for it in items],
            "choices": [answers[:4] + [it["answer"]] for it in items],
            "label": [4] * len(items)}
    pq.write_table(pa.table({**cols, "image": [_png(it["image"]) for it in items]}),
                   out / "items.parquet")
    qdir = out / "folder"
    (qdir / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for it in items:
        name = os.path.basename(it["image"])
        shutil.copy(it["image"], qdir / "images" / name)
        rows.append({"id": it["id"], "question": it["question"], "answer": it["answer"],
                     "image": f"images/{name}"})
    (qdir / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    import datasets

    ds = datasets.Dataset.from_dict({**cols, "image": [it["image"] for it in items]})
    ds.cast_column("image", datasets.Image()).save_to_disk(str(out / "hf"))
    return {"parquet": "items.parquet", "json": "folder/questions.jsonl", "hf": "hf"}


def _sweep(out, path, task="generation", name="sweep.yaml", **dataset):
    spec = {"path": path, "prompt": "question", "images": "image", "id": "id",
            "target": "answer" if task == "generation" else "label"}
    if task == "multiple_choice":
        spec["choices"] = "choices"
    spec.update(dataset)
    sweep = {"name": "t", "checkpoints": ["ckpts/checkpoint-*"], "task": task,
             "metrics": ["exact_match"] if task == "generation" else ["acc", "acc_norm"],
             "dataset": spec, "batch_size": 4, "output": "out", "workers": 1}
    (out / name).write_text(yaml.safe_dump(sweep))
    return load_sweep(str(out / name))


def _direct(proc, item, n_images=1):
    pictures = [image_io.decode_bytes(_png(item["image"]))] * n_images
    prompt = proc.render(item["question"], n_images)
    return prompt, proc.inputs(prompt, pictures)


def _decode_all(sweep, proc, through_stage=False):
    ev = sweep.evals[0]
    info = inspect_dataset(ev.dataset, tasks.get(ev.task))
    decode = Decoder(ev, info, sweep.base_dir)
    decode.samples = True
    decode.use(proc)
    stage = Tokenize(ev, proc)
    out = []
    for table in read_batches(info, ev.dataset, 4):
        if through_stage:
            table = stage(table)
        x, y, _ = decode(table)
        out.append(x)
    return out


@pytest.mark.parametrize("form", ["parquet", "json", "hf"])
def test_every_source_gives_the_items_the_processor_gives(base, form):
    out, folder, items = base
    paths = _write_forms(out, items)
    proc = vision.load_processor(folder, what="checkpoint")
    sweep = _sweep(out, paths[form])
    batches = _decode_all(sweep, proc)
    assert all(isinstance(x, ImageBatch) for x in batches)
    got = [(p, inp) for x in batches for p, inp in zip(x.prompts, x.inputs)]
    assert len(got) == N
    for item, (prompt, inputs) in zip(items, got):
        want_prompt, want = _direct(proc, item)
        assert prompt == want_prompt and item["question"] in prompt
        assert set(inputs) == set(want)
        for k in want:
            assert torch.equal(inputs[k], want[k]), k
    records = batches[0].items
    assert records["id"] == [it["id"] for it in items[:4]]
    if form == "json":           # a reference to the image, not its bytes
        assert records["images"][0] == [f"images/{os.path.basename(items[0]['image'])}"]


def test_the_stage_carries_typed_columns_equal_to_the_workers_own_processing(base):
    out, folder, items = base
    paths = _write_forms(out, items)
    proc = vision.load_processor(folder, what="checkpoint")
    sweep = _sweep(out, paths["parquet"], task="multiple_choice")
    ev = sweep.evals[0]
    info = inspect_dataset(ev.dataset, tasks.get(ev.task))
    table = next(iter(read_batches(info, ev.dataset, 4)))
    staged = Tokenize(ev, proc)(table)
    carried = [f for f in staged.schema if f.name.startswith(prepared.VISION)]
    assert carried and all(pa.types.is_list(f.type) or pa.types.is_string(f.type)
                           for f in carried)
    assert prepared.array_rows(staged, "another processor") is None
    mine, theirs = _decode_all(sweep, proc)[0], _decode_all(sweep, proc, through_stage=True)[0]
    assert mine.prompts == theirs.prompts and mine.extra == theirs.extra
    for a, b in zip(mine.inputs, theirs.inputs):
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert a["pixel_values"].dtype == torch.float32
    for a, b in zip(mine.images, theirs.images):
        assert all(np.array_equal(p, q) and q.dtype == np.uint8 for p, q in zip(a, b))


def test_for_the_hf_backend_the_stage_keeps_the_pixels_and_ships_thumbnails(base):
    """The Hugging Face backend scores from the processor's outputs: the stage ships them
    and, for per-item records, the thumbnails the worker would have made; vLLM (which
    processes images itself) still gets the decoded pixels."""
    from rayeval.execution import pipeline

    out, folder, items = base
    paths = _write_forms(out, items)
    proc = vision.load_processor(folder, what="checkpoint")
    sweep = _sweep(out, paths["parquet"])
    ev = sweep.evals[0]
    info = inspect_dataset(ev.dataset, tasks.get(ev.task))
    table = next(iter(read_batches(info, ev.dataset, 4)))
    full, lean = Tokenize(ev, proc)(table), Tokenize(ev, proc, pixels=False)(table)
    assert lean.nbytes < full.nbytes
    decode = Decoder(ev, info, sweep.base_dir)
    decode.samples = True
    decode.use(proc)
    (mine, _, _), (theirs, _, _) = decode(full), decode(lean)
    assert [list(i) for i in theirs.images] == [[]] * 4 and theirs.thumbnails is not None
    assert theirs.items["thumbnails"] == mine.items["thumbnails"]
    assert all(len(t) == 1 and t[0].startswith(b"\x89PNG") for t in theirs.items["thumbnails"])
    for a, b in zip(mine.inputs, theirs.inputs):
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not pipeline.ships_pixels("hf") and pipeline.ships_pixels("vllm")


def test_image_items_are_scored_batch_by_batch_text_items_together(base):
    """A pass holds text items back to batch them by length; image items are scored as they
    come, so the stage decodes the next ones behind the scoring."""
    out, _, _ = base
    paths = _write_forms(out, base[2])
    ev = _sweep(out, paths["parquet"]).evals[0]
    task = tasks.get(ev.task)
    assert task.held_rows(ev.dataset) == 0
    text = _sweep(out, paths["parquet"], name="text.yaml", images=None).evals[0]
    assert text.dataset.images is None and task.held_rows(text.dataset) == 1024
    from types import SimpleNamespace

    from rayeval.execution.workers.scorer import first_rows

    # what the progress line says while a pass waits for its first batch
    assert first_rows(SimpleNamespace(name="vqa", spec=ev)) == "decoding the images of vqa"
    assert first_rows(SimpleNamespace(name="t", spec=text)) == "reading the rows of t"


def test_several_images_per_item(base):
    out, folder, items = base
    pq.write_table(pa.table({
        "id": [it["id"] for it in items], "question": [it["question"] for it in items],
        "answer": [it["answer"] for it in items],
        "image": [[_png(it["image"])] * (1 + i % 2) for i, it in enumerate(items)]}),
        out / "multi.parquet")
    proc = vision.load_processor(folder, what="checkpoint")
    batches = _decode_all(_sweep(out, "multi.parquet", name="multi.yaml"), proc)
    x = batches[0]
    assert [len(p) for p in x.images[:2]] == [1, 2]
    assert x.prompts[1].count("<image>") == 2
    _, want = _direct(proc, items[1], n_images=2)
    assert torch.equal(x.inputs[1]["pixel_values"], want["pixel_values"])


# --- bad input: one line, before Ray starts ------------------------------------------------

def test_an_item_without_an_image_is_named(base):
    out, folder, items = base
    pq.write_table(pa.table({
        "id": [it["id"] for it in items], "question": [it["question"] for it in items],
        "answer": [it["answer"] for it in items],
        "image": [_png(it["image"]) if i != 2 else None for i, it in enumerate(items)]}),
        out / "missing.parquet")
    with pytest.raises(DataError) as e:
        preflight.inspect_evaluations(_sweep(out, "missing.parquet", name="m.yaml"))
    assert "\n" not in e.value.message
    assert f"id = {items[2]['id']}" in e.value.message and "has no image" in e.value.message


@pytest.mark.parametrize("pil_lenient", [False, True], ids=["pil-default", "lmms-eval-imported"])
def test_a_truncated_image_is_named_by_its_row_id(base, pil_lenient, monkeypatch):
    """Also when PIL was told to load truncated images, as importing lmms-eval's task module
    tells it for the whole process."""
    from PIL import ImageFile

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", pil_lenient)
    out, folder, items = base
    pngs = [_png(it["image"]) for it in items]
    pngs[4] = pngs[4][:len(pngs[4]) // 2]
    pq.write_table(pa.table({
        "id": [it["id"] for it in items], "question": [it["question"] for it in items],
        "answer": [it["answer"] for it in items], "image": pngs}), out / "cut.parquet")
    with pytest.raises(DataError) as e:
        preflight.inspect_evaluations(_sweep(out, "cut.parquet", name="c.yaml"))
    assert "\n" not in e.value.message
    assert f"id = {items[4]['id']}" in e.value.message
    assert "not a readable image" in e.value.message
    with pytest.raises(DataError, match="not a readable image"):     # and when decoded
        image_io.decode_cell(pngs[4], None, "row", "dataset.images")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is pil_lenient               # and left as it was


def test_a_model_that_is_not_a_vision_language_model(base, tmp_path):
    out, folder, items = base
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt = tmp_path / "ckpts" / "checkpoint-1"
    proc = vision.load_processor(folder, what="checkpoint")
    LlamaForCausalLM(LlamaConfig(vocab_size=len(proc.tokenizer), hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(ckpt)
    proc.tokenizer.save_pretrained(ckpt)
    _write_forms(tmp_path, items)
    with pytest.raises(SpecError) as e:
        preflight.inspect_evaluations(_sweep(tmp_path, "items.parquet"))
    assert "\n" not in e.value.message
    assert "'llama' is not a vision-language model" in e.value.message


def test_a_processor_missing_from_the_folder(base, tmp_path):
    out, folder, items = base
    ckpt = tmp_path / "ckpts" / "checkpoint-1"
    shutil.copytree(folder, ckpt)
    os.remove(ckpt / "processor_config.json")
    _write_forms(tmp_path, items)
    with pytest.raises(CheckpointError) as e:
        preflight.inspect_evaluations(_sweep(tmp_path, "items.parquet"))
    assert "\n" not in e.value.message and "no processor files" in e.value.message


def test_images_on_a_task_that_takes_none(base):
    out, folder, items = base
    sweep = {"name": "t", "checkpoints": ["ckpts/checkpoint-*"], "task": "text_perplexity",
             "metrics": ["word_perplexity"],
             "dataset": {"path": "items.parquet", "text": "question", "images": "image"},
             "output": "out"}
    (out / "ppl.yaml").write_text(yaml.safe_dump(sweep))
    with pytest.raises(SpecError, match=r"dataset\.images: task text_perplexity takes no "
                                        "images column"):
        load_sweep(str(out / "ppl.yaml"))


def test_a_stage_batch_is_never_a_pickle():
    table = prepared.attach_arrays(pa.table({"a": [1]}), [{"x": [np.ones((2, 3), np.float32)]}],
                                   {"prompt": ["p"]}, "k")
    rows, texts = prepared.array_rows(table, "k")
    assert texts == {"prompt": ["p"]}
    assert rows[0]["x"][0].shape == (2, 3) and rows[0]["x"][0].dtype == np.float32
    assert np.array_equal(rows[0]["x"][0], np.ones((2, 3), np.float32))
    assert {f.type for f in table.schema} <= {pa.int64(), pa.string(), pa.list_(pa.binary()),
                                              pa.list_(pa.list_(pa.int64()))}
