"""The Hugging Face backend's log-likelihoods are the model's own: a tiny GPT-2 computed here
directly, one forward pass per request as lm-eval scores it (moved from tests/unit/test_backends.py,
since it builds a model)."""

import math

import pytest
import torch

from rayeval.core import backends
from rayeval.config.schema import DatasetSpec
from rayeval.core.backends import Context
from rayeval.io.hf import Tokenizer


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=50)
    return GPT2LMHeadModel(config).eval()


def direct(model, context, continuation, max_length):
    """The continuation's summed log-probability and whether it is greedy, from one forward
    pass of the model over (context + continuation)[-(L + 1):][:-1], as lm-eval scores it."""
    whole = (context + continuation)[-(max_length + 1):]
    with torch.no_grad():
        logits = model(torch.tensor([whole[:-1]])).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    at = range(len(whole) - 1 - len(continuation), len(whole) - 1)
    ll = math.fsum(float(logp[i, t]) for i, t in zip(at, continuation))
    greedy = all(int(logp[i].argmax()) == t for i, t in zip(at, continuation))
    return ll, greedy


def test_hf_log_likelihoods_equal_the_model_computed_directly():
    model = tiny_gpt2()
    backend = backends.of_model(model)
    assert backend.name == "hf"
    max_length = 12
    ctx = Context(spec=DatasetSpec(path=""), task="multiple_choice",
                  size=50, text=Tokenizer(None, max_length, "tiny"), batch=2)
    requests = [([1, 2, 3], [4]), ([1, 2, 3], [5, 6]), ([7], [8, 9, 10]), ([11, 12], [4]),
                (list(range(20, 40)), [41, 42])]          # the last one cut from the left
    with torch.inference_mode():              # as a pass scores
        got = backend.loglikelihood(requests, ctx)
    for (context, cont), (ll, greedy) in zip(requests, got):
        want, want_greedy = direct(model, context, cont, max_length)
        assert ll == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert greedy == want_greedy
    # a document's rolling windows: the exact sum of each window's log-likelihood
    windows = [requests[:2], [], requests[2:]]
    with torch.inference_mode():
        rolled = backend.loglikelihood_rolling(windows, ctx)
    assert rolled[1] == 0.0
    assert rolled[0] == math.fsum(ll for ll, _ in got[:2])
    assert rolled[2] == math.fsum(ll for ll, _ in got[2:])
