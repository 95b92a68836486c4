"""Shared-prefix log-likelihoods (core/backends/prefix.py) request by request against one
forward pass per request, on a tiny Hugging Face Llama and GPT-2 with a tokenizer trained here:
few-shot blocks and an item's context shared, left truncation at the model's context, one- and
multi-token continuations, a context's trailing space moved into the continuation. The
fallbacks (a plain module, ``share=False``) score as before and say so once."""

import functools
import logging
import math

import pytest
import torch

from rayeval.config.schema import DatasetSpec
from rayeval.core import backends
from rayeval.core.backends import Context, prefix
from rayeval.io.hf import Tokenizer
from support import tiny_llama, tiny_tokenizer

SHOTS = "".join(f"Question: what is {a} plus {b}?\nAnswer: {a + b}\n\n"
                for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (2, 9)))
QUESTIONS = ["what colour is the sky?", "how many legs has a spider?", "which is larger?",
             "what is the capital of France? It is a city with a long history of art"]
CHOICES = ["A", "B", "C", "D"]
LONG_CHOICES = ["blue, like the sea", "eight", "the elephant by far", "Paris"]


@functools.lru_cache(maxsize=None)
def trained():
    return tiny_tokenizer([SHOTS, *QUESTIONS, *LONG_CHOICES, " A B C D"] * 3)


def tokenizer(max_length: int) -> Tokenizer:
    return Tokenizer(trained(), max_length, "tiny")


def requests(tok: Tokenizer) -> list:
    """A 5-shot block shared by every question, each question's context shared by its
    choices (one-token letters and multi-token answers), a context ending in a space (the
    space moves to the continuation), an empty context, and a repeated request."""
    out = []
    for q in QUESTIONS:
        ctx = f"{SHOTS}Question: {q}\nAnswer:"
        out += [tok.encode_pair(ctx, " " + c) for c in CHOICES]
        out += [tok.encode_pair(ctx, " " + c) for c in LONG_CHOICES]
        out += [tok.encode_pair(ctx + " ", c) for c in LONG_CHOICES[:2]]     # trailing space
    out.append(tok.encode_pair("", "Paris"))
    out.append(out[0])
    return out


def context(tok: Tokenizer, share: bool, batch: int = 4, tokens: int = 600) -> Context:
    return Context(spec=DatasetSpec(path=""), task="multiple_choice", size=tok.tokenizer.vocab_size,
                   text=tok, batch=batch, tokens=tokens, share=share)


def direct(model, pair, max_length):
    """lm-eval's score of one request from one forward pass over its whole window."""
    c, t = pair
    whole = (c + t)[-(max_length + 1):]
    with torch.no_grad():
        logits = model(torch.tensor([whole[:-1]])).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    at = range(len(whole) - 1 - len(t), len(whole) - 1)
    return (math.fsum(float(logp[i, x]) for i, x in zip(at, t)),
            all(int(logp[i].argmax()) == x for i, x in zip(at, t)))


@pytest.mark.parametrize("max_length", [512, 40])      # 40: every few-shot context cut
def test_shared_equals_unshared_request_by_request(max_length):
    tok = tokenizer(max_length)
    model = tiny_llama(len(tok.tokenizer))
    reqs = requests(tok)
    assert any(len(c) + len(t) > max_length + 1 for c, t in reqs) == (max_length == 40)
    lengths = {len(t) for _, t in reqs}
    assert 1 in lengths and max(lengths) >= 4              # one- and multi-token answers
    backend = backends.of_model(model)
    with torch.inference_mode():
        shared = backend.loglikelihood(reqs, context(tok, True))
        alone = backend.loglikelihood(reqs, context(tok, False))
    for pair, (ll, greedy), (ll0, greedy0) in zip(reqs, shared, alone):
        want, want_greedy = direct(model, pair, max_length)
        assert ll == pytest.approx(ll0, rel=1e-5, abs=1e-5)
        assert ll == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert (greedy, greedy0) == (want_greedy, want_greedy)


@pytest.mark.parametrize("max_length", [512, 40])
def test_each_requests_log_likelihood_has_the_same_bits_in_any_company(max_length):
    """Shared prefixes with invariant bits: a request scored alone, in any of three shards of
    the requests (three workers' share), in another order or at batch 1, 16 or 64 gets the
    very float it gets among all of them: its segments are cut by its own tokens and each runs
    in a shape of its own."""
    import random

    tok = tokenizer(max_length)
    model = tiny_llama(len(tok.tokenizer))
    reqs = requests(tok)
    backend = backends.of_model(model)
    with torch.inference_mode():
        whole = backend.loglikelihood(reqs, context(tok, True, batch=16))
        for batch in (1, 64):
            assert backend.loglikelihood(reqs, context(tok, True, batch=batch)) == whole
        order = list(range(len(reqs)))
        random.Random(0).shuffle(order)
        for shard in (order[0::3], order[1::3], order[2::3], order[::-1]):
            got = backend.loglikelihood([reqs[i] for i in shard], context(tok, True))
            assert got == [whole[i] for i in shard]
        for i in range(0, len(reqs), 5):
            assert backend.loglikelihood([reqs[i]], context(tok, True)) == [whole[i]]


def test_the_shared_runs_are_computed_once():
    """The trie holds the few-shot block once: the tokens run (not counting the padding of a
    batch's shape) are far fewer than the requests' inputs hold, and a batch never exceeds
    the token budget."""
    tok = tokenizer(512)
    model = tiny_llama(len(tok.tokenizer))
    reqs = requests(tok)
    seen = []
    model.register_forward_pre_hook(
        lambda m, args, kw: seen.append((kw["input_ids"].shape, kw["attention_mask"].shape,
                                         int(kw["attention_mask"][:, -kw["input_ids"].shape[1]:]
                                             .sum()))),
        with_kwargs=True)
    scorer = prefix.Scorer(model, reqs, 512, 4, 600, lambda ids, out: out)
    with torch.inference_mode():
        scorer.run()
    run = sum(real for _, _, real in seen)
    inputs = sum(len(inp) for inp in {tuple((c + t)[-513:][:-1]) for c, t in reqs})
    assert run < inputs / 4
    assert all(mask[0] * mask[1] <= 600 or ids[0] == 1 for ids, mask, _ in seen)
    assert scorer.forwards == len(seen)


def test_gpt2_shares_too():
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tokenizer(64)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64,
                                       vocab_size=len(tok.tokenizer))).eval()
    reqs = requests(tok)
    backend = backends.of_model(model)
    assert backend.why_not is None
    with torch.inference_mode():
        shared = backend.loglikelihood(reqs, context(tok, True))
    for pair, (ll, greedy) in zip(reqs, shared):
        want, want_greedy = direct(model, pair, 64)
        assert ll == pytest.approx(want, rel=1e-5, abs=1e-5)
        assert greedy == want_greedy


class Plain(torch.nn.Module):
    """A factory's plain causal model: ids -> logits, no cache, no config."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids):
        return self.hf(ids).logits


def test_a_plain_module_falls_back_once_with_the_same_numbers(caplog):
    tok = tokenizer(512)
    model = tiny_llama(len(tok.tokenizer))
    reqs = requests(tok)
    plain = backends.of_model(Plain(model))
    assert plain.why_not == "Plain is not a Hugging Face model (no config)"
    with caplog.at_level(logging.INFO, logger="rayeval.core.backends.hf"), \
            torch.inference_mode():
        got = plain.loglikelihood(reqs, context(tok, True))
        again = plain.loglikelihood(reqs[:3], context(tok, True))
        off = plain.loglikelihood(reqs[:3], context(tok, False))
    said = [r.getMessage() for r in caplog.records if "shared-prefix" in r.getMessage()]
    assert said == ["shared-prefix scoring is off for this model: Plain is not a Hugging Face "
                    "model (no config); each request is scored on its own"]
    assert [ll for ll, _ in again] == pytest.approx([ll for ll, _ in got[:3]], rel=1e-6)
    assert [ll for ll, _ in off] == pytest.approx([ll for ll, _ in got[:3]], rel=1e-6)
    for pair, (ll, _) in zip(reqs, got):
        assert ll == pytest.approx(direct(model, pair, 512)[0], rel=1e-5, abs=1e-5)


def test_sharing_off_is_silent_and_keeps_only_the_read_logits():
    """``share=False`` on a Hugging Face model: no log line, and the output layer still runs
    only on the continuations' positions (logits_to_keep)."""
    tok = tokenizer(512)
    model = tiny_llama(len(tok.tokenizer))
    kept = []
    model.register_forward_hook(lambda m, a, out: kept.append(out.logits.shape[1]))
    backend = backends.of_model(model)
    reqs = requests(tok)[:4]                    # one question's letters: one position each
    with torch.inference_mode():
        backend.loglikelihood(reqs, context(tok, False))
    assert kept == [1]
    assert not backend.said


def test_a_continuation_longer_than_the_context_is_one_line_naming_task_and_document():
    """lm-eval's window keeps the last L + 1 tokens: a longer continuation cannot be scored
    (torch used to fail with a size mismatch); the line names the task, the document and both
    lengths. The task here only lends its name, as the driver's rendered task would."""
    import types

    from rayeval.errors import DataError
    from rayeval.harness import store, task

    spec = DatasetSpec(path="requests/abc/docs.parquet", key_path="evals[0]")
    store._TASKS[spec.path] = types.SimpleNamespace(task_name="hellaswag")
    try:
        task._fits([([1, 2], [3, 4])], 2, spec, 7)              # exactly L: scored
        with pytest.raises(DataError, match=r"^evals\[0\]: lm-eval task hellaswag, document "
                           r"12: a continuation of 3 tokens is longer than the model's "
                           r"context of 2 tokens; "):
            task._fits([([1], [2]), ([1, 2], [3, 4, 5])], 2, spec, 12)
    finally:
        del store._TASKS[spec.path]
