"""Backend hf (``model.backend: hf``, the default): the checkpoint's own model in this
process. Forward passes, log-likelihoods and greedy decoding as ``torch.TorchBackend`` does
for any module; a Hugging Face causal model scores log-likelihoods with its shared prefixes
computed once (``prefix``; ``share_prefixes: false`` turns it off) and generates with its KV
cache, batched and left-padded.
"""

from __future__ import annotations

import logging

import torch

from rayeval.core.backends import prefix
from rayeval.core.backends.base import BACKENDS, Context, TokenPair
from rayeval.core.backends.torch import TorchBackend, checked_logits, stopped

log = logging.getLogger(__name__)


@BACKENDS.register()
class HFBackend(TorchBackend):
    name = "hf"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.why_not: str | None = "no model served"
        self.timer = None
        self.said: set[str] = set()          # fallbacks already logged (once each)

    def serve(self, model, folder="", tokenizer=None, location="", timer=None) -> None:
        super().serve(model, folder, tokenizer, location, timer)
        self.why_not = prefix.cannot_share(model)
        self.timer = timer                   # the worker's profile: prefix and continuation work

    def loglikelihood(self, requests: list[TokenPair], ctx: Context
                      ) -> list[tuple[float, bool]]:
        """As ``TorchBackend.loglikelihood``, with every shared prefix computed once where
        the model can score from its cache; otherwise (said once in the log) one forward
        pass per distinct input."""
        why = self.why_not
        if ctx.share and why is None and requests and all(
                len((c + t)[-(ctx.text.max_length + 1):]) > 1 for c, t in requests):
            scorer = prefix.Scorer(self.model, requests, ctx.text.max_length, ctx.batch,
                                   ctx.tokens, lambda ids, out: checked_logits(ids, out, ctx),
                                   self.device, self.timer)
            try:
                return scorer.run(ctx.partly)
            except prefix.CannotShare as e:
                self.why_not = why = str(e)
        if ctx.share and why not in self.said:
            self.said.add(why)
            log.warning("shared-prefix scoring is off for this model: %s; each request is "
                        "scored on its own", why)
        return super().loglikelihood(requests, ctx)

    def generate_tokens(self, contexts: list[list[int]], ctx: Context) -> list[list[int]]:
        if hasattr(self.model, "generate") and hasattr(self.model, "config"):
            return self.hf_generate(contexts, ctx)
        return self.greedy(contexts, ctx)

    def hf_generate(self, contexts: list[list[int]], ctx: Context) -> list[list[int]]:
        """Batched, with the model's KV cache: left-padded contexts and an attention mask."""
        import transformers

        tok = ctx.text
        pad = tok.tokenizer.pad_token_id
        pad = pad if pad is not None else (tok.eos_id if tok.eos_id is not None else 0)
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), pad, dtype=torch.int64)
        mask = torch.zeros((len(contexts), width), dtype=torch.int64)
        for j, c in enumerate(contexts):
            ids[j, width - len(c):] = torch.tensor(c, dtype=torch.int64)
            mask[j, width - len(c):] = 1

        class Until(transformers.StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.tensor([stopped(row[width:].tolist(), ctx) for row in input_ids],
                                    dtype=torch.bool, device=input_ids.device)

        result = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            do_sample=False, max_new_tokens=ctx.generation.max_new_tokens, pad_token_id=pad,
            eos_token_id=tok.eos_id,
            stopping_criteria=transformers.StoppingCriteriaList([Until()]), use_cache=True,
            # transformers turns synced_gpus on for FSDP models: an all-reduce over the whole
            # world at every step, which other replicas never join. A sharded model's replica
            # is kept in step by sharding.Lockstep instead.
            synced_gpus=False)
        return [row[width:].tolist() for row in result.cpu()]
