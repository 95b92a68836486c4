"""Language-modeling metrics: outputs (rows, positions, vocab) logits, targets (rows, positions)
next-token ids already aligned with the outputs, ``IGNORE`` where masked."""

from __future__ import annotations

from rayeval.core.metrics.base import IGNORE, Metric, _ratio
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


class _LanguageModel(Metric):
    task = "language_modeling"
    batched_compute = True

    def init_state(self, vocab):
        return {"nll": torch.zeros((), dtype=torch.float64),
                "tokens": torch.zeros((), dtype=torch.int64),
                "correct": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        mask = targets != IGNORE
        safe = torch.where(mask, targets, torch.zeros_like(targets))
        logp = torch.log_softmax(outputs.to(torch.float32), dim=-1)
        token_nll = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1).to(torch.float64)
        hit = (outputs.argmax(dim=-1) == targets) & mask
        return {"nll": (token_nll * mask).sum(dim=1), "tokens": mask.sum(dim=1),
                "correct": hit.sum(dim=1)}


class TokenNLL(_LanguageModel):
    """Mean next-token negative log-likelihood over every unmasked token of the corpus."""
    name = "nll"
    higher_is_better = False

    def compute(self, s):
        return _ratio(s["nll"], s["tokens"])


class Perplexity(_LanguageModel):
    """Corpus perplexity: exp(total nll / total tokens), not a mean of per-sequence values."""
    name = "perplexity"
    higher_is_better = False

    def compute(self, s):
        return _ratio(s["nll"], s["tokens"]).exp()


class TokenAccuracy(_LanguageModel):
    name = "token_accuracy"

    def compute(self, s):
        return _ratio(s["correct"], s["tokens"])


# Registered by the package, in this order (``names()`` lists them so).
BUILT_IN = (TokenNLL, Perplexity, TokenAccuracy)
