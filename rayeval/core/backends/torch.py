"""Any ``torch.nn.Module`` as a backend: its forward pass for tensor models, and for causal
language models (logits of shape (batch, positions, vocab)) log-likelihoods and greedy
decoding without a cache, scored as lm-evaluation-harness scores them.

What the harness's users' numbers depend on is reproduced here: the model sees
``(context + continuation)[-(L + 1):][:-1]``, inputs sorted by length and right-padded (a
causal model's positions do not see the padding after them), requests with the same input
sharing one forward pass, log-probabilities summed in float64.
"""

from __future__ import annotations

from typing import Any, Mapping

from rayeval.core import stats
from rayeval.core.backends.base import (Backend, Context, Inputs, Sampler, TokenPair,
                                        batched_texts, sampled_texts, wrong_output)
from rayeval.errors import CheckpointError, DataError
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

LOGITS_BUDGET_BYTES = 512 << 20     # float32 logits one forward pass may produce


class TorchBackend(Backend):
    """The model's own forward pass; ``hf.HFBackend`` adds Hugging Face's ``generate``."""

    name = "torch"
    served_dtype: torch.dtype | None = None  # the model's floating dtype, once served

    @property
    def dtype(self) -> torch.dtype:
        """The model's floating dtype (inputs are cast to it): float32 until one is served."""
        return torch.float32 if self.served_dtype is None else self.served_dtype

    def serve(self, model, folder="", tokenizer=None, location="", timer=None) -> None:
        self.model = model
        self.served_dtype = float_dtype(model)

    def forward(self, x: Inputs, ctx: Context) -> Any:
        """One batch on the backend's device (floating inputs in the model's dtype) through
        the model: a tensor, or whatever the model returned (the task says what it needed)."""
        x = move(x, self.device, self.dtype)
        n = rows_of(x)
        if n < MIN_ROWS:
            # A batch of a few rows takes other matrix kernels than a full one, whose rounding
            # differs: run it padded with copies of its rows so that a row's outputs do not
            # depend on where the shard or segment boundaries fell (and published numbers on
            # the world size or a resumption).
            return first_rows(call_model(self.model, repeat(x, MIN_ROWS)), n, MIN_ROWS)
        return call_model(self.model, x)

    def loglikelihood(self, requests: list[TokenPair], ctx: Context
                      ) -> list[tuple[float, bool]]:
        """Each (context, continuation)'s summed log-probability of the continuation, and
        whether greedy decoding would have produced it."""
        L = ctx.text.max_length
        inputs = [tuple((c + t)[-(L + 1):][:-1]) for c, t in requests]
        users: dict[tuple, list[int]] = {}
        for r, inp in enumerate(inputs):
            users.setdefault(inp, []).append(r)
        unique = sorted(users, key=lambda t: (-len(t), t))
        result: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        keeps = keeps_logits(self.model)
        i = 0
        while i < len(unique):
            chunk = unique[i:i + forward_rows(ctx, len(unique[i]))]
            i += len(chunk)
            deepest = [max(len(requests[r][1]) for r in users[inp]) for inp in chunk]
            # the output layer only on the positions read (a Hugging Face model's
            # logits_to_keep): each row's last k; a plain module computes them all
            keep = sorted({p for inp, k in zip(chunk, deepest)
                           for p in range(len(inp) - k, len(inp))}) if keeps else None
            logits = self.logits(right_padded(chunk).to(self.device), ctx, keep)
            at = {p: n for n, p in enumerate(keep)} if keeps else None
            for j, (inp, k) in enumerate(zip(chunk, deepest)):
                span = range(len(inp) - k, len(inp))
                rows = [at[p] for p in span] if keeps else list(span)
                logp = torch.log_softmax(logits[j, rows].float(), dim=-1)
                for r in users[inp]:
                    cont = requests[r][1]
                    result[r] = continuation_score(logp[k - len(cont):], cont)
            ctx.partly(i, len(unique))
        return result

    def logits(self, ids: torch.Tensor, ctx: Context, keep: list[int] | None = None
               ) -> torch.Tensor:
        """A causal model's logits for right-padded token ids (at the positions ``keep``
        only, for a model that takes ``logits_to_keep``), checked: the task's shape, ids
        within the vocabulary, finite values."""
        if keep is None:
            out = logits_of(self.model(ids))
        else:
            out = logits_of(self.model(ids, logits_to_keep=torch.tensor(
                keep, dtype=torch.int64, device=ids.device)))
        return checked_logits(ids, out, ctx)

    def generate(self, contexts: list[list[int]], ids: list[int] | None, ctx: Context
                 ) -> list[list[str]]:
        """Each context's continuations, cut at the first stop string; at most
        ``max_new_tokens`` each, so a generation that never stops still ends. Greedy: one per
        context, ``batch`` contexts at a time; sampled (``temperature`` above 0):
        ``repeats`` per context, each drawn with its own seed (``base.Sampler``)."""
        if ctx.generation.samples:
            return sampled_texts(contexts, ids, self.sample_tokens, ctx)
        return batched_texts(contexts, self.generate_tokens, ctx)

    def generate_tokens(self, contexts: list[list[int]], ctx: Context) -> list[list[int]]:
        return self.greedy(contexts, ctx)

    def sample_tokens(self, contexts: list[list[int]], seeds: list[int], ctx: Context
                      ) -> list[list[int]]:
        return self.greedy(contexts, ctx, Sampler(seeds, ctx.generation))

    def greedy(self, contexts: list[list[int]], ctx: Context, sampler: Sampler | None = None
               ) -> list[list[int]]:
        """Any causal model (no cache): each step runs the right-padded sequences so far and
        takes each one's most likely next token (``sampler``: its draw instead)."""
        seqs = [list(c) for c in contexts]
        new: list[list[int]] = [[] for _ in contexts]
        active = list(range(len(contexts)))
        for _ in range(ctx.generation.max_new_tokens):
            if not active:
                break
            logits = self.logits(right_padded([seqs[i] for i in active]).to(self.device), ctx)
            for j, i in enumerate(active):
                last = logits[j, len(seqs[i]) - 1]
                nxt = int(last.argmax()) if sampler is None else sampler.pick(i, last)
                seqs[i].append(nxt)
                new[i].append(nxt)
            active = [i for i in active if not stopped(new[i], ctx)]
        return new


def checked_logits(ids: torch.Tensor, out, ctx: Context) -> torch.Tensor:
    """Logits checked: the task's shape, ids within the vocabulary, finite values."""
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise wrong_output(out, ctx.task, ctx.needs)
    if int(ids.max()) >= out.shape[2]:
        raise DataError(f"{ctx.spec.key_path}: token id {int(ids.max())} is outside the "
                        f"model's vocabulary of {out.shape[2]}; the tokenizer does not "
                        "match the model")
    if not stats.all_finite(out):
        raise CheckpointError("the model produced NaN or infinite logits with this "
                              "checkpoint")
    return out


def keeps_logits(model) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (Hugging Face causal models)."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


def continuation_score(logp: torch.Tensor, cont: list[int]) -> tuple[float, bool]:
    """(summed log-probability of ``cont``, whether each of its tokens is the argmax) from
    the log-probabilities of the positions that predict it."""
    picked = logp.gather(1, torch.tensor(cont, device=logp.device).view(-1, 1))
    return float(picked.double().sum()), logp.argmax(dim=-1).tolist() == list(cont)


def right_padded(seqs) -> torch.Tensor:
    """Token sequences as one int64 batch, right-padded with 0."""
    batch = torch.zeros((len(seqs), max(len(s) for s in seqs)), dtype=torch.int64)
    for j, s in enumerate(seqs):
        batch[j, :len(s)] = torch.tensor(s, dtype=torch.int64)
    return batch


def forward_rows(ctx: Context, width: int) -> int:
    """Sequences per forward pass: the evaluation's batch size, within a logits budget."""
    per_row = max(1, width * max(1, ctx.size) * 4)
    return max(1, min(ctx.batch, LOGITS_BUDGET_BYTES // per_row))


def stopped(tokens: list[int], ctx: Context) -> bool:
    """Whether a generation so far has ended: the end token, or a stop string in its text."""
    tok = ctx.text
    if tok.eos_id is not None and tok.eos_id in tokens:
        return True
    text = tok.decode(tokens)
    return any(s in text for s in ctx.generation.until)


# --- plain torch helpers (the driver's probe and a sharded replica's idle forwards use them) ---

def logits_of(out: Any) -> Any:
    """A model's scores: a tensor as it is; ``.logits`` of a Hugging Face ``ModelOutput`` or a
    mapping; anything else unchanged (the task then says what it needed)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    return logits if isinstance(logits, torch.Tensor) else out


def call_model(model: torch.nn.Module, x: Inputs) -> Any:
    """Inputs as one positional tensor, or as keyword arguments."""
    if isinstance(x, Mapping):
        return logits_of(model(**x))
    return logits_of(model(x))


def move(x: Inputs, device: torch.device, float_dtype: torch.dtype) -> Inputs:
    """To the device; floating tensors to the model's dtype, integer ones (ids, masks) as
    they are."""
    def one(t):
        t = torch.as_tensor(t)
        if t.is_floating_point():
            return t.to(device, float_dtype, non_blocking=True)
        return t.to(device, non_blocking=True)

    if isinstance(x, Mapping):
        return {k: one(v) for k, v in x.items()}
    return one(x)


# The fewest rows a batch runs with (``TorchBackend.forward``). On an AMD EPYC with AVX-512
# (torch 2.13 CPU, one thread) a linear layer's rows came out with other bits in batches of 1, 2
# and 3 rows than in batches of 4 and more (566-578 of 594 rows differed; none from 4 to 11 rows
# on): a resumed cell's last segment, or a shard's last batch, then moved the published nll in
# its 11th digit. Where a machine's kernels switch elsewhere, more padding costs only
# microseconds: such batches are the last of a shard or a segment.
MIN_ROWS = 8


def repeat(x: Inputs, rows: int) -> Inputs:
    """Each tensor's batch repeated in turn up to ``rows`` rows (see ``TorchBackend.forward``)."""
    def pad(v: torch.Tensor) -> torch.Tensor:
        return v[torch.arange(rows, device=v.device) % v.shape[0]]

    if isinstance(x, Mapping):
        return {k: pad(v) for k, v in x.items()}
    return pad(x)


def first_rows(out: Any, n: int, rows: int) -> Any:
    """A model's output for a batch ``repeat`` padded to ``rows``, cut back to its first ``n``
    rows: a tensor, or the tensors of rows rows in a tuple, list or mapping (a Hugging Face
    ``ModelOutput``) of them; other values as they are."""
    if isinstance(out, torch.Tensor):
        return out[:n] if out.dim() and out.shape[0] == rows else out
    if isinstance(out, (tuple, list)) and not hasattr(out, "_fields"):
        return type(out)(first_rows(v, n, rows) for v in out)
    if isinstance(out, Mapping):
        cut = {k: first_rows(v, n, rows) for k, v in out.items()}
        try:
            return type(out)(**cut)
        except TypeError:
            return type(out)(cut)
    return out


def rows_of(x: Inputs) -> int:
    return int(next(iter(x.values())).shape[0]) if isinstance(x, Mapping) else int(x.shape[0])


def float_dtype(model: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
