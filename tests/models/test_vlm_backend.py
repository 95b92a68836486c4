"""The Hugging Face backend on image+text items: greedy token ids equal, item by item, to
transformers' own ``generate`` run on each item alone, for batch sizes 1 and 16; choices'
log-likelihoods equal to a forward pass of the item alone (an untrained tiny Idefics3 built from
configs; 16 easy-vqa test items)."""

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("easy_vqa")

from rayeval.config.schema import DatasetSpec, Generation  # noqa: E402
from rayeval.core.backends import ImageRequest, Setup, create  # noqa: E402
from rayeval.core.backends.base import Context  # noqa: E402
from rayeval.io import images as image_io, vision  # noqa: E402

from tests.vlm_support import (build_tiny_llava, build_tiny_qwen2vl,  # noqa: E402
                               build_tiny_vlm, easy_vqa_items, item_texts)

NEW_TOKENS = 6


def _requests(proc, items, images=lambda i: 1):
    out = []
    for i, it in enumerate(items):
        with open(it["image"], "rb") as f:
            pictures = [image_io.decode_bytes(f.read())] * images(i)
        prompt = proc.render(it["question"], len(pictures))
        out.append(ImageRequest(prompt, tuple(pictures), proc.inputs(prompt, pictures)))
    return out


BUILDERS = {"idefics3": build_tiny_vlm, "llava": build_tiny_llava,
            "qwen2_vl": build_tiny_qwen2vl}


@pytest.fixture(scope="module", params=list(BUILDERS))
def tiny(request, tmp_path_factory):
    """The model as rayeval loads it (built from config.json on the meta device, the
    safetensors loaded lean: ``ModelSource.loader``), its processor, 16 items. Qwen2-VL's
    processor needs torchvision (not on the CI machine; run where it is installed)."""
    from rayeval.config.schema import CheckpointSpec, ModelSpec
    from rayeval.io.model import ModelSource

    if request.param == "qwen2_vl":
        pytest.importorskip("torchvision", reason="Qwen2-VL's processor needs torchvision")
    if request.param == "idefics3":     # the run's one tiny Idefics3 (conftest): read only
        folder = request.getfixturevalue("tiny_vlm")
    else:
        build = BUILDERS[request.param]
        folder = build(tmp_path_factory.mktemp(request.param) / "checkpoint-3",
                       item_texts(easy_vqa_items("train", n=500)))
    source = ModelSource(ModelSpec(), "")
    model, _ = source.loader(torch.device("cpu"), CheckpointSpec()).load(folder)
    proc = source.tokenizer(folder, model)
    assert isinstance(proc, vision.Processor)
    return model.eval(), proc, _requests(proc, easy_vqa_items("test", n=16, seed=1)), folder


def test_rayeval_loads_the_weights_transformers_loads(tiny):
    from transformers import AutoModelForImageTextToText

    model, proc, _, folder = tiny
    assert type(model).__name__ in ("Idefics3ForConditionalGeneration",
                                    "LlavaForConditionalGeneration",
                                    "Qwen2VLForConditionalGeneration")
    theirs = AutoModelForImageTextToText.from_pretrained(folder)
    mine = model.state_dict()
    for k, v in theirs.state_dict().items():
        assert torch.equal(mine[k], v), k


def _context(proc, batch):
    return Context(spec=DatasetSpec(path=""), task="generation", text=proc,
                   generation=Generation(until=(), max_new_tokens=NEW_TOKENS), batch=batch)


def _backend(model):
    backend = create("hf", Setup(device=torch.device("cpu")))
    backend.serve(model)
    return backend


def test_the_prompt_is_the_chat_template_with_the_image_before_the_question(tiny):
    from transformers import AutoProcessor

    _, proc, requests, folder = tiny
    question = easy_vqa_items("test", n=16, seed=1)[0]["question"]
    theirs = AutoProcessor.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
        add_generation_prompt=True)
    assert requests[0].prompt == theirs == vision.chat_prompt(proc.processor, question, 1)
    qwen = proc.processor.image_token == "<|image_pad|>"
    opening = "<|vision_start|><|image_pad|><|vision_end|>" if qwen else "<image>"
    assert requests[0].prompt.startswith("User:" + opening)
    assert requests[0].prompt.endswith("<end_of_utterance>\nAssistant:")
    ids = requests[0].inputs["input_ids"][0].tolist()
    image = proc.tokenizer.convert_tokens_to_ids(proc.processor.image_token)
    # Idefics3: 64/8 squared over 2x2; LLaVA: 32/8 squared; Qwen2-VL: 64/8 squared over 2x2
    assert ids.count(image) == 16
    assert requests[0].images[0].shape == (64, 64, 3)
    assert requests[0].images[0].dtype == np.uint8


@pytest.fixture(scope="module")
def alone(tiny):
    """transformers' own ``generate`` on each item alone: its new tokens, through EOS."""
    model, proc, requests, _ = tiny
    out = []
    for r in requests:
        ref = model.generate(**r.inputs, do_sample=False, max_new_tokens=NEW_TOKENS,
                             pad_token_id=proc.tokenizer.pad_token_id, eos_token_id=proc.eos_id)
        out.append(_through_eos(ref[0, r.inputs["input_ids"].shape[1]:].tolist(), proc))
    return out


def _through_eos(tokens, proc):
    """Up to the first EOS: batched generate pads finished rows after it."""
    return tokens[:tokens.index(proc.eos_id) + 1] if proc.eos_id in tokens else tokens


@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_tokens_equal_generate_on_each_item_alone(tiny, alone, batch):
    model, proc, requests, _ = tiny
    backend = _backend(model)
    ctx = _context(proc, batch)
    got = []
    for start in range(0, len(requests), batch):
        got += backend.image_tokens(requests[start:start + batch], ctx)
    assert [_through_eos(t, proc) for t in got] == alone
    assert len({tuple(t) for t in alone}) > len(alone) // 2      # items differ: a real check
    if batch == 16:
        texts = backend.generate_images(requests, None, ctx)
        assert [t[0] for t in texts] == [
            proc.decode(t[:-1] if t and t[-1] == proc.eos_id else t) for t in alone]


def test_choice_loglikelihoods_equal_a_forward_pass_of_the_item_alone(tiny):
    model, proc, requests, _ = tiny
    backend = _backend(model)
    ctx = dataclasses.replace(_context(proc, 4), task="multiple_choice")
    conts = [proc.encode_pair(requests[0].prompt, " " + c)[1] for c in ("circle", "red")]
    (got,) = backend.loglikelihood_images([(requests[0], conts)], ctx)
    for (ll, _), cont in zip(got, conts):
        ids = torch.cat([requests[0].inputs["input_ids"], torch.tensor([cont])], dim=1)
        rest = {k: v for k, v in requests[0].inputs.items()
                if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        if "mm_token_type_ids" in requests[0].inputs:      # Qwen2-VL: continuations are text
            types = requests[0].inputs["mm_token_type_ids"]
            rest["mm_token_type_ids"] = torch.cat(
                [types, torch.zeros((1, len(cont)), dtype=types.dtype)], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **rest).logits
        n = requests[0].inputs["input_ids"].shape[1]
        logp = torch.log_softmax(logits[0, n - 1:n - 1 + len(cont)].double(), dim=-1)
        want = float(logp.gather(1, torch.tensor(cont).view(-1, 1)).sum())
        assert ll == pytest.approx(want, abs=1e-4)


def test_items_with_one_and_two_images_in_one_batch(tiny):
    """Idefics3 pads an item's missing images with zeros (masked out); Qwen2-VL's patches
    and grids are concatenated. Each item's tokens are still those of ``generate`` on it
    alone."""
    model, proc, _, _ = tiny
    if type(model).__name__ == "LlavaForConditionalGeneration":
        pytest.skip("LLaVA takes one image per item here")
    requests = _requests(proc, easy_vqa_items("test", n=4, seed=2), images=lambda i: 1 + i % 2)
    got = _backend(model).image_tokens(requests, _context(proc, 4))
    for r, tokens in zip(requests, got):
        ref = model.generate(**r.inputs, do_sample=False, max_new_tokens=NEW_TOKENS,
                             pad_token_id=proc.tokenizer.pad_token_id, eos_token_id=proc.eos_id)
        assert tokens[:NEW_TOKENS] == ref[0, r.inputs["input_ids"].shape[1]:].tolist()


def test_sampled_image_generations_are_each_items_own_draws_at_any_batch(tiny):
    """Sampling from images (temperature 1, top_p 0.9, 3 repeats): each item's repeat r is
    drawn with its own seed (``item_seed(seed, row id, r)``), so batches of 1 and 16 give the
    same texts, and each equals a token-by-token loop on the item alone that draws from
    softmax(logits / temperature) over the nucleus with that seed (``Sampler.pick``, whose
    draws tests/unit/test_sampling.py checks against the distribution)."""
    from rayeval.core.backends.base import Sampler, item_seed

    model, proc, requests, _ = tiny
    backend = _backend(model)
    gen = Generation(until=(), max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.9,
                     repeats=3, seed=7)
    ids = list(range(100, 100 + len(requests)))
    texts = {}
    for batch in (1, 16):
        ctx = dataclasses.replace(_context(proc, batch), generation=gen)
        texts[batch] = backend.generate_images(requests, ids, ctx)
    assert texts[1] == texts[16]
    assert all(len(t) == 3 for t in texts[1])
    assert sum(len(set(t)) > 1 for t in texts[1]) > len(requests) // 2    # the repeats differ
    for i in (0, 5):                           # two items, every repeat, drawn alone
        for r in range(3):
            sampler = Sampler([item_seed(7, ids[i], r)], gen)
            inputs = dict(requests[i].inputs)
            tokens = []
            for _ in range(NEW_TOKENS):
                with torch.no_grad():
                    logits = model(**inputs).logits[0, -1]
                tokens.append(sampler.pick(0, logits))
                if tokens[-1] == proc.eos_id:
                    break
                step = torch.tensor([[tokens[-1]]])
                inputs["input_ids"] = torch.cat([inputs["input_ids"], step], dim=1)
                inputs["attention_mask"] = torch.cat(
                    [inputs["attention_mask"], torch.ones_like(step)], dim=1)
                if "mm_token_type_ids" in inputs:
                    inputs["mm_token_type_ids"] = torch.cat(
                        [inputs["mm_token_type_ids"], torch.zeros_like(step)], dim=1)
            want = proc.decode(tokens[:-1] if tokens[-1] == proc.eos_id else tokens)
            assert texts[1][i][r] == want, (i, r)
