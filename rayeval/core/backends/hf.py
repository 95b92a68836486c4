"""Backend hf (``model.backend: hf``, the default): the checkpoint's own model in this
process. Forward passes, log-likelihoods and greedy decoding as ``torch.TorchBackend`` does
for any module; a Hugging Face causal model scores log-likelihoods with its shared prefixes
computed once (``prefix``; ``share_prefixes: true`` turns it on) and generates with its KV
cache, batched and left-padded. A vision-language model generates from image+text items
(``generate_images``) and scores their choices (``loglikelihood_images``; lmms-eval's
``multiple_choice`` as its ``llava_hf`` does: ``choice_losses``) from the processor outputs a
Ray Data stage made.
"""

from __future__ import annotations

import logging

from rayeval.core import stats
from rayeval.core.backends import prefix
from rayeval.core.backends.base import (BACKENDS, Context, ImageRequest, Sampler, TokenPair,
                                        batched_texts, sampled_texts)
from rayeval.core.backends.torch import (TorchBackend, checked_logits, continuation_score,
                                         logits_of, move, stopped)
from rayeval.errors import CheckpointError, ModelError
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

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
        if ctx.share and why not in self.said:      # the default: said, not warned
            self.said.add(why)
            log.info("shared-prefix scoring is off for this model: %s; each request is "
                     "scored on its own", why)
        return super().loglikelihood(requests, ctx)

    def generate_tokens(self, contexts: list[list[int]], ctx: Context) -> list[list[int]]:
        if hasattr(self.model, "generate") and hasattr(self.model, "config"):
            return self.hf_generate(contexts, ctx)
        return self.greedy(contexts, ctx)

    def sample_tokens(self, contexts: list[list[int]], seeds: list[int], ctx: Context
                      ) -> list[list[int]]:
        sampler = Sampler(seeds, ctx.generation)
        if hasattr(self.model, "generate") and hasattr(self.model, "config"):
            return self.hf_generate(contexts, ctx, sampler)
        return self.greedy(contexts, ctx, sampler)

    def hf_generate(self, contexts: list[list[int]], ctx: Context,
                    sampler: Sampler | None = None) -> list[list[int]]:
        """Batched, with the model's KV cache: left-padded contexts and an attention mask.
        Greedy; ``sampler``: each sequence's seeded draw, as a logits processor that leaves
        only the drawn token for transformers' greedy step to take (its own sampling draws
        from one generator for the whole batch)."""
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
            logits_processor=drawn(sampler),
            # transformers turns synced_gpus on for FSDP models: an all-reduce over the whole
            # world at every step, which other replicas never join. A sharded model's replica
            # is kept in step by sharding.Lockstep instead.
            synced_gpus=False)
        return [row[width:].tolist() for row in result.cpu()]

    # --- image+text items (vision-language models) -----------------------------------------

    def generate_images(self, requests: list[ImageRequest], ids: list[int] | None,
                        ctx: Context) -> list[list[str]]:
        """Generations of image+text items from their processor outputs, ``batch`` items at
        a time, left-padded (an item's tokens equal those of ``generate`` on the item alone:
        tests/models/test_vlm_backend.py): greedy, or each item's repeats sampled with their
        own seeds (``Sampler``), as text generations are."""
        if not hasattr(self.model, "generate"):
            raise ModelError("model: image items need a Hugging Face vision-language model "
                             "(one with generate); this model has none")
        if ctx.generation.samples:
            return sampled_texts(requests, ids, lambda items, seeds, c: self.image_tokens(
                items, c, Sampler(seeds, c.generation)), ctx)
        return batched_texts(requests, self.image_tokens, ctx)

    def image_tokens(self, requests: list[ImageRequest], ctx: Context,
                     sampler: Sampler | None = None) -> list[list[int]]:
        import transformers

        tok = ctx.text
        pad = pad_id(tok)
        batch = collate([r.inputs for r in requests], pad, left=True)
        width = batch["input_ids"].shape[1]

        class Until(transformers.StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.tensor([stopped(row[width:].tolist(), ctx) for row in input_ids],
                                    dtype=torch.bool, device=input_ids.device)

        result = self.model.generate(
            **move(batch, self.device, self.dtype), do_sample=False,
            max_new_tokens=ctx.generation.max_new_tokens, pad_token_id=pad,
            eos_token_id=tok.eos_id, use_cache=True, synced_gpus=False,
            stopping_criteria=transformers.StoppingCriteriaList([Until()]),
            logits_processor=drawn(sampler))
        return [row[width:].tolist() for row in result.cpu()]

    def loglikelihood_images(self, requests: list[tuple[ImageRequest, list[list[int]]]],
                             ctx: Context) -> list[list[tuple[float, bool]]]:
        """Each item's continuations scored after its prompt and images: one forward pass per
        item over its continuations (right-padded, the item's processor outputs repeated), so
        an item's numbers never depend on the batch it came in."""
        out = []
        for done, (request, conts) in enumerate(requests, 1):
            prompt = [int(t) for t in request.inputs["input_ids"].reshape(-1).tolist()]
            seqs = [(prompt + c)[:-1] for c in conts]
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), pad_id(ctx.text), dtype=torch.int64)
            mask = torch.zeros((len(seqs), width), dtype=torch.int64)
            for j, s in enumerate(seqs):
                ids[j, :len(s)] = torch.tensor(s, dtype=torch.int64)
                mask[j, :len(s)] = 1
            rest = {k: torch.cat([v] * len(seqs)) for k, v in request.inputs.items()
                    if k not in TEXT_KEYS and not is_text_like(k, v, request.inputs)}
            batch = {"input_ids": ids, "attention_mask": mask, **rest,
                     **token_types(request.inputs, len(seqs), width)}
            logits = logits_of(self.model(**move(batch, self.device, self.dtype)))
            if not stats.all_finite(logits):
                raise CheckpointError("the model produced NaN or infinite logits with this "
                                      "checkpoint")
            item = []
            for j, c in enumerate(conts):
                start = len(prompt) - 1
                logp = torch.log_softmax(logits[j, start:start + len(c)].float(), dim=-1)
                item.append(continuation_score(logp, c))
            out.append(item)
            ctx.partly(done, len(requests))
        return out


    def choice_losses(self, requests: list[tuple[ImageRequest, int]], ctx: Context
                      ) -> list[list[tuple[float, bool]]]:
        """lmms-eval's ``multiple_choice`` as its ``llava_hf`` model scores it: per (request,
        masked), each choice's text (a row of the request's ``input_ids``, its own length in
        ``attention_mask``) run alone with the request's images, labels masked over its first
        ``masked`` tokens; (the model's own mean loss over the rest, whether the greedy token
        at each of those positions is the token there). One forward pass per choice, as
        there: a choice's numbers never depend on its neighbours."""
        out = []
        for done, (request, masked) in enumerate(requests, 1):
            inputs = request.inputs
            rest = {k: v for k, v in inputs.items() if k not in TEXT_KEYS}
            item = []
            for j, length in enumerate(inputs["attention_mask"].sum(dim=1).tolist()):
                ids = inputs["input_ids"][j:j + 1, :int(length)]
                labels = ids.clone()
                labels[:, :masked] = -100
                batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **rest}
                with torch.inference_mode():
                    result = self.model(**move(batch, self.device, self.dtype),
                                        labels=labels.to(self.device))
                logits = logits_of(result)
                if not stats.all_finite(logits):
                    raise CheckpointError("the model produced NaN or infinite logits with this "
                                          "checkpoint")
                greedy = logits.argmax(dim=-1)[:, masked:].cpu()
                item.append((float(result.loss.item()), bool((greedy == ids[:, masked:]).all())))
            out.append(item)
            ctx.partly(done, len(requests))
        return out


TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def token_types(inputs: dict, rows: int, width: int) -> dict:
    """The prompt's per-token type inputs (``mm_token_type_ids``: Qwen2-VL's multimodal
    positions need them) widened over continuations: their tokens are text, type 0."""
    out = {}
    for key in ("token_type_ids", "mm_token_type_ids"):
        if key in inputs:
            prompt = inputs[key].reshape(-1)
            wide = torch.zeros((rows, width), dtype=prompt.dtype)
            wide[:, :min(width, len(prompt))] = prompt[:width]
            out[key] = wide
    return out


def pad_id(tok) -> int:
    pad = tok.tokenizer.pad_token_id
    return pad if pad is not None else (tok.eos_id if tok.eos_id is not None else 0)


def is_text_like(key: str, value, inputs) -> bool:
    """A per-token input (ids, masks, token types): padded along the sequence."""
    ids = inputs.get("input_ids")
    return key in TEXT_KEYS or (ids is not None and value.dim() == 2
                                and tuple(value.shape) == tuple(ids.shape))


def collate(inputs: list, pad: int, left: bool) -> dict:
    """Several items' processor outputs as one batch: per-token inputs padded to the longest
    (``pad`` for ids, 0 for masks) on the left or right; the others (pixel values, image
    masks, grids) concatenated along their first dimension, zero-padded to a common shape
    where items differ (Idefics3 pads missing images with zeros and masks them out)."""
    out = {}
    for key in inputs[0]:
        values = [x[key] for x in inputs]
        if is_text_like(key, values[0], inputs[0]):
            width = max(v.shape[1] for v in values)
            fill = pad if key == "input_ids" else 0
            batch = torch.full((len(values), width), fill, dtype=values[0].dtype)
            for j, v in enumerate(values):
                n = v.shape[1]
                if left:
                    batch[j, width - n:] = v[0]
                else:
                    batch[j, :n] = v[0]
            out[key] = batch
            continue
        shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
        padded = []
        for v in values:
            if list(v.shape[1:]) != shape:
                grown = torch.zeros((v.shape[0], *shape), dtype=v.dtype)
                grown[tuple(slice(0, s) for s in v.shape)] = v
                v = grown
            padded.append(v)
        out[key] = torch.cat(padded)
    return out


def drawn(sampler: Sampler | None):
    """transformers' logits processors for a greedy ``generate`` that takes ``sampler``'s
    draws: each sequence's drawn token left as its only finite score (transformers' own
    sampling draws from one generator for the whole batch); none without a sampler."""
    import transformers

    class Draw(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            return sampler.one_hot(scores)

    return transformers.LogitsProcessorList([Draw()] if sampler is not None else [])
