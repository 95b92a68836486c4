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

from tests.vlm_support import build_tiny_vlm, easy_vqa_items, item_texts  # noqa: E402

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = build_tiny_vlm(tmp_path_factory.mktemp("vlm"),
                            item_texts(easy_vqa_items("train", n=500)))
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    proc = vision.load_processor(folder, what="checkpoint", model=model)
    items = easy_vqa_items("test", n=16, seed=1)
    requests = []
    for it in items:
        with open(it["image"], "rb") as f:
            pictures = [image_io.decode_bytes(f.read())]
        prompt = proc.render(it["question"], 1)
        requests.append(ImageRequest(prompt, tuple(pictures), proc.inputs(prompt, pictures)))
    return model, proc, requests


def _context(proc, batch):
    return Context(spec=DatasetSpec(path=""), task="generation", text=proc,
                   generation=Generation(until=(), max_new_tokens=NEW_TOKENS), batch=batch)


def _backend(model):
    backend = create("hf", Setup(device=torch.device("cpu")))
    backend.serve(model)
    return backend


def test_the_prompt_is_the_chat_template_with_the_image_before_the_question(tiny):
    _, proc, requests = tiny
    assert requests[0].prompt.startswith("User:<image>")
    assert requests[0].prompt.endswith("<end_of_utterance>\nAssistant:")
    ids = requests[0].inputs["input_ids"][0].tolist()
    image = proc.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image) == 16            # 64x64, patch 8, scale factor 2
    assert requests[0].images[0].shape == (64, 64, 3)
    assert requests[0].images[0].dtype == np.uint8


@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_tokens_equal_generate_on_each_item_alone(tiny, batch):
    model, proc, requests = tiny
    backend = _backend(model)
    ctx = _context(proc, batch)
    got = []
    for start in range(0, len(requests), batch):
        got += backend.image_tokens(requests[start:start + batch], ctx)
    for r, tokens in zip(requests, got):
        ref = model.generate(**r.inputs, do_sample=False, max_new_tokens=NEW_TOKENS,
                             pad_token_id=proc.tokenizer.pad_token_id,
                             eos_token_id=proc.eos_id)
        want = ref[0, r.inputs["input_ids"].shape[1]:].tolist()
        if proc.eos_id in want:                  # generate pads finished rows after EOS
            want = want[:want.index(proc.eos_id) + 1]
        if proc.eos_id in tokens:
            tokens = tokens[:tokens.index(proc.eos_id) + 1]
        assert tokens == want
    texts = backend.generate_images(requests, None, ctx)
    assert len(texts) == len(requests) and all(len(t) == 1 for t in texts)


def test_choice_loglikelihoods_equal_a_forward_pass_of_the_item_alone(tiny):
    model, proc, requests = tiny
    backend = _backend(model)
    ctx = dataclasses.replace(_context(proc, 4), task="multiple_choice")
    conts = [proc.encode_pair(requests[0].prompt, " " + c)[1] for c in ("circle", "red")]
    (got,) = backend.loglikelihood_images([(requests[0], conts)], ctx)
    for (ll, _), cont in zip(got, conts):
        ids = torch.cat([requests[0].inputs["input_ids"], torch.tensor([cont])], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                           pixel_values=requests[0].inputs["pixel_values"],
                           pixel_attention_mask=requests[0].inputs["pixel_attention_mask"]
                           ).logits
        n = requests[0].inputs["input_ids"].shape[1]
        logp = torch.log_softmax(logits[0, n - 1:n - 1 + len(cont)].double(), dim=-1)
        want = float(logp.gather(1, torch.tensor(cont).view(-1, 1)).sum())
        assert ll == pytest.approx(want, abs=1e-4)
