"""Metrics of the text tasks of language models (see tasks/text.py for the outputs' layout):
multiple choice, text perplexity, generation."""

from __future__ import annotations

import math

from rayeval.core.metrics.base import Metric, _Hits, _ratio
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


class _MultipleChoice(_Hits):
    """Outputs (rows, choices, 2): each choice's summed log-likelihood and its length in
    characters (padding choices: -inf); targets: the right choice's index."""
    task = "multiple_choice"

    def hits(self, outputs, targets):
        # argmax takes the first of equal values, as numpy's does in the harness
        return self.scores(outputs).argmax(dim=1) == targets


class ChoiceAccuracy(_MultipleChoice):
    """The choice with the highest log-likelihood is the right one."""
    name = "acc"

    @staticmethod
    def scores(outputs):
        return outputs[..., 0]


class ChoiceAccuracyNorm(_MultipleChoice):
    """The choice with the highest log-likelihood per character is the right one."""
    name = "acc_norm"

    @staticmethod
    def scores(outputs):
        return outputs[..., 0] / outputs[..., 1]


class _TextPerplexity(Metric):
    """Outputs (rows, 4): a document's log-likelihood, scored tokens, words and UTF-8 bytes.
    Corpus-level: total log-likelihood over total units, as the harness aggregates."""
    task = "text_perplexity"
    batched_compute = True
    higher_is_better = False
    unit = 0                       # the column of outputs counted

    def init_state(self, c):
        return {"ll": torch.zeros((), dtype=torch.float64),
                "units": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        return {"ll": outputs[:, 0], "units": outputs[:, self.unit].round().to(torch.int64)}

    def compute(self, s):
        return (-_ratio(s["ll"], s["units"])).exp()


class TokenPerplexity(_TextPerplexity):
    name = "token_perplexity"
    unit = 1


class WordPerplexity(_TextPerplexity):
    name = "word_perplexity"
    unit = 2


class BytePerplexity(_TextPerplexity):
    name = "byte_perplexity"
    unit = 3


class BitsPerByte(_TextPerplexity):
    name = "bits_per_byte"
    unit = 3

    def compute(self, s):
        return -_ratio(s["ll"], s["units"]) / math.log(2)


class ExactMatch(_Hits):
    """Outputs (rows,): 1 where the generation, cut at the first stop string and stripped,
    equals the stripped target."""
    name = "exact_match"
    task = "generation"

    @staticmethod
    def hits(outputs, targets):
        return outputs.round() == 1


# Registered by the package, in this order (``names()`` lists them so).
BUILT_IN = (ChoiceAccuracy, ChoiceAccuracyNorm, TokenPerplexity, WordPerplexity, BytePerplexity,
            BitsPerByte, ExactMatch)
