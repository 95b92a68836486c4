"""Backend hf (``model.backend: hf``, the default): the checkpoint's own model in this
process. Forward passes, log-likelihoods and greedy decoding as ``torch.TorchBackend`` does
for any module; a Hugging Face model (one with ``generate`` and a ``config``) generates with
its KV cache instead, batched and left-padded.
"""

from __future__ import annotations

import torch

from rayeval.core.backends.base import BACKENDS, Context
from rayeval.core.backends.torch import TorchBackend, stopped


@BACKENDS.register()
class HFBackend(TorchBackend):
    name = "hf"

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
