"""Vision-language checkpoints in the layouts rayeval reads besides one safetensors folder, each
checked against transformers' own load: torch.distributed.checkpoint folders with config.json
and the processor beside them (the state dict alone, under ``model`` beside an optimizer's, or
in a ``model`` sub-folder; against ``from_pretrained`` of the safetensors folder they were saved
from), a training run's ``checkpoint-N`` folders of sharded safetensors (against
``from_pretrained`` of each), and these in S3 (moto's server on loopback) read by the driver and
fetched and loaded as a worker does. Same tensors, the same processor, and the same greedy
tokens from the Hugging Face backend as transformers' ``generate``. An untrained tiny Idefics3."""

import functools
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("easy_vqa")

from rayeval.config.schema import CheckpointSpec, DatasetSpec, Generation, ModelSpec  # noqa: E402
from rayeval.core.backends import ImageRequest, Setup, create  # noqa: E402
from rayeval.core.backends.base import Context  # noqa: E402
from rayeval.io import hf, images as image_io, paths, vision  # noqa: E402
from rayeval.io.checkpoints import expand_checkpoints, fetch  # noqa: E402
from rayeval.io.loading import fit_error  # noqa: E402
from rayeval.io.model import ModelSource  # noqa: E402

from tests.vlm_support import easy_vqa_items  # noqa: E402

NEW_TOKENS = 6
ITEMS = 6
STEPS = (100, 200)


def _auto(folder):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder).eval()


def _trained(model, step: int):
    """The model after "training" to ``step``: every tensor moved by seeded noise, so each
    checkpoint's weights are its own."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _beside(src, dest):
    """The folder's files other than its weights: config, generation config, processor,
    tokenizer."""
    for name in os.listdir(src):
        if not name.endswith(hf.WEIGHT_SUFFIXES):
            shutil.copy(os.path.join(src, name), dest)


def _with_optimizer(model):
    """What a training loop saves with DCP (torchtitan, FSDP recipes): the model's state dict
    under ``model`` beside the optimizer's under ``optim``, after one step (Adam's moments are
    tensors of the parameters' shapes: only the model's may be read)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _trainer_files(folder):
    """What transformers' Trainer writes beside the model in a checkpoint-N folder."""
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"):
        torch.save({"state": {}}, os.path.join(folder, name))
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        f.write('{"global_step": 0}')


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_vlm):
    """{"safetensors": the built folder, "dcp": DCP of its state dict with config.json and
    the processor beside it, "dcp-model-optim": the same with the state dict under "model"
    beside an optimizer's, "dcp-in-folder": a folder with config.json and the processor
    beside a DCP sub-folder ``model`` (a Ray Train checkpoint), "checkpoint-N": a training
    run's sharded safetensors folders}."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoProcessor

    root = tmp_path_factory.mktemp("vlm")
    st = tiny_vlm               # the run's one tiny Idefics3 (tests/conftest.py): read only
    out = {"safetensors": st, "dcp": str(root / "dcp"), "dcp-model-optim": str(root / "fsdp"),
           "dcp-in-folder": str(root / "ray")}
    dcp.save(_auto(st).state_dict(), checkpoint_id=out["dcp"], no_dist=True)
    dcp.save(_with_optimizer(_auto(st)), checkpoint_id=out["dcp-model-optim"], no_dist=True)
    dcp.save(_auto(st).state_dict(), checkpoint_id=os.path.join(out["dcp-in-folder"], "model"),
             no_dist=True)
    for name in ("dcp", "dcp-model-optim", "dcp-in-folder"):
        _beside(st, out[name])
    processor = AutoProcessor.from_pretrained(st)
    for step in STEPS:
        ck = str(root / "run" / f"checkpoint-{step}")
        _trained(_auto(st), step).save_pretrained(ck, max_shard_size="500KB")
        processor.save_pretrained(ck)
        _trainer_files(ck)
        out[f"checkpoint-{step}"] = ck
    return out


def _reference(folders, name):
    """The folder transformers loads the same weights from: the DCP ones' safetensors origin."""
    return folders["safetensors" if name.startswith("dcp") else name]


def _rayeval(folder):
    """The model and processor as a worker loads a local checkpoint."""
    source = ModelSource(ModelSpec(), "")
    model, raw = source.loader(torch.device("cpu"), CheckpointSpec()).load(folder)
    return model, source.tokenizer(folder, model), raw.layout


def _assert_same_weights(model, theirs):
    mine, ref = model.state_dict(), theirs.state_dict()
    assert set(mine) == set(ref)
    for k, v in ref.items():
        assert torch.equal(mine[k], v), k


@functools.lru_cache(maxsize=None)
def _item(i=0):
    """(question, decoded RGB image) of the i-th of 8 easy-vqa test items."""
    it = easy_vqa_items("test", n=8, seed=1)[i]
    with open(it["image"], "rb") as f:
        return it["question"], image_io.decode_bytes(f.read())


def _assert_same_processor(proc, reference):
    """``proc`` (rayeval's) renders and processes an item as transformers' AutoProcessor of
    ``reference`` does."""
    from PIL import Image
    from transformers import AutoProcessor

    assert isinstance(proc, vision.Processor)
    theirs = AutoProcessor.from_pretrained(reference)
    question, image = _item()
    prompt = theirs.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        add_generation_prompt=True)
    assert proc.render(question, 1) == prompt
    want = theirs(text=[prompt], images=[[Image.fromarray(image)]], return_tensors="pt")
    got = proc.inputs(prompt, [image])
    assert set(got) == {k for k, v in want.items() if hasattr(v, "shape")}
    for k, v in got.items():
        assert torch.equal(v, want[k]), k


@pytest.mark.parametrize("name", ["dcp", "dcp-model-optim", "dcp-in-folder", "checkpoint-100"])
def test_weights_and_processor_equal_transformers_own_load(folders, name):
    """The driver's check of a local checkpoint (keys and shapes from its headers against the
    model its config.json builds), then the worker's load."""
    source = ModelSource(ModelSpec(), "")
    assert fit_error(folders[name], source.meta(folders[name])) is None
    model, proc, layout = _rayeval(folders[name])
    assert layout == ("dcp" if name.startswith("dcp") else "safetensors-sharded")
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    _assert_same_weights(model, _auto(_reference(folders, name)))
    _assert_same_processor(proc, _reference(folders, name))


def test_the_checkpoints_of_a_run_are_each_their_own(folders):
    """checkpoint-N folders: their steps, and each one's tensors (not the first one's, not the
    untrained model's)."""
    run = os.path.dirname(folders["checkpoint-100"])
    refs = expand_checkpoints((os.path.join(run, "checkpoint-*"),))
    assert [r.step for r in refs] == list(STEPS)
    assert len([n for n in os.listdir(refs[0].location) if n.endswith(".safetensors")]) > 1
    untrained = _auto(folders["safetensors"]).state_dict()
    for ref in refs:
        model = _rayeval(ref.location)[0]
        _assert_same_weights(model, _auto(ref.location))
        assert not torch.equal(model.state_dict()["lm_head.weight"], untrained["lm_head.weight"])


def _requests(proc, n):
    out = []
    for i in range(n):
        question, image = _item(i)
        prompt = proc.render(question, 1)
        out.append(ImageRequest(prompt, (image,), proc.inputs(prompt, [image])))
    return out


def _through_eos(tokens, eos):
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def _transformers_tokens(reference, n):
    """Greedy new tokens of transformers alone: its model and processor of ``reference``, one
    item at a time."""
    from PIL import Image
    from transformers import AutoProcessor

    model, processor = _auto(reference), AutoProcessor.from_pretrained(reference)
    eos, pad = processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id
    out = []
    for i in range(n):
        question, image = _item(i)
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"},
                                          {"type": "text", "text": question}]}],
            add_generation_prompt=True)
        inputs = processor(text=[prompt], images=[[Image.fromarray(image)]], return_tensors="pt")
        ids = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS,
                             pad_token_id=pad, eos_token_id=eos)
        out.append(_through_eos(ids[0, inputs["input_ids"].shape[1]:].tolist(), eos))
    return out


@pytest.mark.parametrize("name", ["dcp", "checkpoint-200"])
def test_greedy_tokens_equal_transformers_generate(folders, name):
    model, proc, _ = _rayeval(folders[name])
    backend = create("hf", Setup(device=torch.device("cpu")))
    backend.serve(model)
    ctx = Context(spec=DatasetSpec(path=""), task="generation", text=proc,
                  generation=Generation(until=(), max_new_tokens=NEW_TOKENS), batch=3)
    got = [_through_eos(t, proc.eos_id) for t in backend.image_tokens(_requests(proc, ITEMS), ctx)]
    want = _transformers_tokens(_reference(folders, name), ITEMS)
    assert got == want
    assert len({tuple(t) for t in want}) > ITEMS // 2      # the items differ: a real check


@pytest.fixture(scope="module")
def bucket(folders):
    """Every folder of ``folders`` in S3 (moto's server on loopback, the environment a user
    sets for an S3 endpoint): s3://vlm/{safetensors,dcp,...}, s3://vlm/run/checkpoint-N."""
    import pyarrow.fs as pafs

    from tests.s3server import CREDENTIALS, MotoServer

    server = MotoServer()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**CREDENTIALS, "AWS_ENDPOINT_URL": server.url}.items():
            mp.setenv(k, v)
        paths.clear_cache()
        try:
            s3 = pafs.S3FileSystem(endpoint_override=server.url, allow_bucket_creation=True)
            s3.create_dir("vlm")
            for name, folder in folders.items():
                where = f"vlm/run/{name}" if name.startswith("checkpoint-") else f"vlm/{name}"
                pafs.copy_files(folder, where, source_filesystem=pafs.LocalFileSystem(),
                                destination_filesystem=s3)
            yield "s3://vlm"
        finally:
            server.stop()
            paths.clear_cache()


@pytest.mark.parametrize("name", ["safetensors", "dcp", "dcp-in-folder", "checkpoint-200"])
def test_s3_checkpoints_load_as_their_local_copies(folders, bucket, name, tmp_path):
    """What the driver reads of an s3:// folder (config and processor, no weights) and what a
    worker loads from it once fetched: transformers' weights, the same processor (the same key:
    checkpoints sharing it share one decoding of the data)."""
    from rayeval.plan.cells import checkpoint_fingerprint

    location = f"{bucket}/run/{name}" if name.startswith("checkpoint-") else f"{bucket}/{name}"
    assert hf.is_folder(location)
    small = hf.small_files(location, str(tmp_path / "driver"))
    assert not any(n.endswith(hf.WEIGHT_SUFFIXES) for n in os.listdir(small))
    source = ModelSource(ModelSpec(), "")
    meta = source.meta(small)
    driver = source.tokenizer(small, meta)
    vision.check_image_model(driver, meta, small, "evals[0].dataset")

    local = fetch(location, str(tmp_path / "worker"), checkpoint_fingerprint(location))
    assert local != folders[name] and os.path.isdir(local)
    model, proc, layout = _rayeval(local)
    _assert_same_weights(model, _auto(_reference(folders, name)))
    _assert_same_processor(proc, _reference(folders, name))
    here = _rayeval(folders[name])
    assert layout == here[2]
    # the driver's processor (a Ray Data stage's) is the worker's: rows processed once
    assert proc.key == driver.key == here[1].key


def test_s3_run_folders_are_found_with_their_steps(bucket):
    refs = expand_checkpoints((f"{bucket}/run/checkpoint-*",))
    assert [(r.location, r.step) for r in refs] == [
        (f"{bucket}/run/checkpoint-{s}", s) for s in STEPS]
