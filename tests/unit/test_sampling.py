"""Seeded sampling in rayeval's own backends (``core.backends.base.Sampler``): the draws follow
the softmax of the logits over the ``top_p`` nucleus, and a sequence's draws depend on its seed
alone, never on the batch it is decoded in."""

import math

import pytest
import torch

from rayeval.config.schema import Generation
from rayeval.core.backends.base import Sampler, item_seed

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def _probabilities(logits, temperature):
    """softmax(logits / T), written out (numpy-free, float64)."""
    e = [math.exp(float(v) / temperature) for v in logits]
    return [x / sum(e) for x in e]


@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_draws_follow_the_softmax(temperature):
    n = 2000
    sampler = Sampler([item_seed(0, i, 0) for i in range(n)], Generation(temperature=temperature))
    counts = [0] * len(LOGITS)
    for row in range(n):
        counts[sampler.pick(row, LOGITS)] += 1
    for p, c in zip(_probabilities(LOGITS, temperature), counts):
        sd = math.sqrt(n * p * (1 - p))
        assert abs(c - n * p) < 5 * sd + 1, (p, c / n)       # 5 standard deviations


def test_top_p_keeps_the_smallest_set_reaching_it():
    p = _probabilities(LOGITS, 1.0)          # about .57, .21, .13, .08, .03, .004
    assert p[0] < 0.7 < p[0] + p[1]
    sampler = Sampler([item_seed(1, i, 0) for i in range(1000)], Generation(temperature=1.0,
                                                                             top_p=0.7))
    drawn = [sampler.pick(row, LOGITS) for row in range(1000)]
    assert set(drawn) == {0, 1}                               # the nucleus: two tokens
    share = drawn.count(0) / len(drawn)
    assert abs(share - p[0] / (p[0] + p[1])) < 0.05          # renormalised within it


def test_a_sequence_s_draws_depend_on_its_seed_not_its_batch():
    gen = Generation(temperature=1.0, repeats=2)
    seeds = [item_seed(7, row, r) for row in (3, 11, 42) for r in range(2)]
    scores = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    together = [Sampler(seeds, gen).one_hot(scores).argmax(dim=1).tolist() for _ in range(2)]
    assert together[0] == together[1]                         # the same seeds: the same draws
    alone = [Sampler([s], gen).one_hot(scores[j:j + 1]).argmax(dim=1).item()
             for j, s in enumerate(seeds)]
    reordered = Sampler(seeds[::-1], gen).one_hot(scores.flip(0)).argmax(dim=1).tolist()[::-1]
    assert together[0] == alone == reordered
    # across steps each sequence advances its own generator
    sampler = Sampler(seeds, gen)
    steps = [sampler.one_hot(scores).argmax(dim=1).tolist() for _ in range(20)]
    assert len({tuple(s) for s in steps}) > 1
    assert item_seed(7, 3, 0) != item_seed(7, 3, 1) != item_seed(8, 3, 1)
