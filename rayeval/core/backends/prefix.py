"""Shared-prefix log-likelihoods (``share_prefixes``, on by default) for Hugging Face causal
models: every shared token prefix of a scoring's requests is computed once, with the same bits
whatever else is scored beside it.

The requests' model inputs (``(context + continuation)[-(L + 1):][:-1]``, lm-eval's window,
left truncation included) are cut into segments at places each input's own tokens decide
(``cuts``: a content-defined cut, a function of the tokens up to it, never of the other
requests), and the segments make a trie: a node is a segment that the inputs below it share
after the same segments (the few-shot block of an MMLU subject; an item's context across its
choices). Nodes run top-down, siblings in batches on their parents' key-value rows, each batch
in one shape that its nodes decide alone (``bucket``: a node's tokens padded to a multiple of
WIDTH, its cache to one of CACHE; the output layer's rows a multiple of WIDTH): rows of one
padded shape get the same bits at any row count, so every log-probability has the same bits
whichever requests share its worker, batch or node. (A float32 matmul's bits depend on the
shape the kernel sees: padding to the longest neighbour, as this scorer did until 2026-12-02
and the unshared path still does, moved a figure's last bits with the batch.) A batch's cache
lives until its children are done, so memory is one chain of batches, each within the token
budget (``batch_tokens``: rows x (cached + new), padded).

Equality with one forward pass per request is to float tolerance, not bits (attention over a
cache sums in another order): figures agree with lm-eval's within the 1e-4 relative tolerance
of the text tasks; counts are exact unless two choices tie to 1e-6. Plain torch and
transformers' cache classes; no Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

# Where a segment ends: after at least MIN_SEGMENT tokens, where the hash of the last WINDOW
# tokens is 0 modulo CUT_ODDS (about one cut per CUT_ODDS tokens), and at MAX_SEGMENT tokens
# at most. A cut depends on the tokens before it only, so inputs that share a prefix share its
# cuts, and a divergence costs the segment it falls in. On the tests' 5-shot items
# (tests/models/test_prefix.py, 17 inputs of 1,381 tokens), with WIDTH 8: one cut in 16 ran
# 18% of the tokens (25% with the padding) in 15 forward passes; one in 32, 31% (padded) in 13.
MIN_SEGMENT = 4
MAX_SEGMENT = 128
CUT_ODDS = 16
WINDOW = 2
# A batch's shape (``bucket``): its segments padded to a multiple of WIDTH tokens, their
# caches to one of CACHE positions.
WIDTH = 8
CACHE = 64
_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def cuts(tokens: tuple) -> list[int]:
    """Where an input's segments end (the last: its length), each from the tokens before it."""
    out, start = [], 0
    for i in range(len(tokens)):
        n = i + 1 - start
        if n >= MAX_SEGMENT or (n >= MIN_SEGMENT and _hash(tokens, i) % CUT_ODDS == 0):
            out.append(i + 1)
            start = i + 1
    if start < len(tokens):
        out.append(len(tokens))
    return out


def _hash(tokens: tuple, i: int) -> int:
    h = 0
    for t in tokens[max(0, i + 1 - WINDOW):i + 1]:
        h = ((h ^ (int(t) + 1)) * _MIX) & _MASK
    return h >> 32


class CannotShare(Exception):
    """The model cannot score from a cache (its class and why): the backend falls back."""


@dataclass(eq=False)
class Node:
    """Tokens [start, end) of every input below it; ``reads``: position in the segment ->
    the (request, target token) pairs that read its log-probabilities."""
    start: int
    tokens: tuple
    children: dict = field(default_factory=dict)     # the next segment's tokens -> its node
    reads: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    ends: int = 0                                     # inputs that end with this segment

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def trie(inputs: list[tuple], users: list[list[tuple[int, list]]]) -> list[tuple[Node, int]]:
    """The inputs (distinct token tuples) as a trie of their segments, each node with its
    reads: the positions in it that predict a token of some request's continuation.
    ``users[u]``: (request, continuation tokens) of input u."""
    top: dict = {}
    for inp, used in zip(inputs, users):
        level, node, start = top, None, 0
        for end in cuts(inp):
            piece = inp[start:end]
            node = level.setdefault(piece, Node(start, piece))
            level, start = node.children, end
        node.ends += 1
        n = len(inp)
        path, at = _path(top, inp), 0
        for p in range(n - max(len(c) for _, c in used), n):
            while path[at].end <= p:
                at += 1
            for r, cont in used:
                if p >= n - len(cont):
                    target = inp[p + 1] if p + 1 < n else cont[-1]
                    path[at].reads.setdefault(p - path[at].start, []).append((r, target))
    return [(node, -1) for node in top.values()]


def _path(top: dict, inp: tuple) -> list[Node]:
    out, level, start = [], top, 0
    for end in cuts(inp):
        node = level[inp[start:end]]
        out.append(node)
        level, start = node.children, end
    return out


def cannot_share(model) -> str | None:
    """Why this model cannot score from a cache (None: it can): a Hugging Face causal model,
    unsharded, without sliding-window or recurrent layers."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        return f"{name} is not a Hugging Face model (no config)"
    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model"
    if not getattr(model, "_supports_cache_class", True) or \
            getattr(model, "_is_stateful", False):
        return f"{name} does not keep a key-value cache"
    kinds = set(getattr(config, "layer_types", None) or ())
    if getattr(config, "sliding_window", None) or kinds - {"full_attention"}:
        return f"{name} has sliding-window or other non-full attention layers"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return f"{name} is sharded (FSDP2)"
    return None


@dataclass
class Batch:
    """A forward pass's rows, each one node's keys and values (per layer: (rows, heads, T,
    dim), its real positions first, ``length`` of them; the rest padding)."""
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    length: torch.Tensor


def bucket(node: Node) -> tuple[int, int]:
    """The shape a node runs in: its tokens padded to a multiple of WIDTH, its cache to one
    of CACHE. A function of the node alone, so its rows' bits are the same in any batch:
    rows of one padded shape give each row the same bits at any row count (measured on
    torch's CPU kernels: tests/models/test_prefix.py); a padded width that moved with the
    longest neighbour, as before, moved them."""
    width = -(-len(node.tokens) // WIDTH) * WIDTH
    return width, -(-node.start // CACHE) * CACHE


class Scorer:
    """One scoring's requests through the trie (see the module docstring)."""

    def __init__(self, model, requests, max_length: int, rows: int, tokens: int, check,
                 device: torch.device | None = None, timer=None):
        self.model, self.rows, self.tokens = model, max(1, rows), max(1, tokens)
        self.check = check                           # check(ids, logits) -> logits, or raises
        self.device = torch.device("cpu") if device is None else device
        self.timer = timer                           # the worker's profile (--profile), or None
        self.inputs: list[tuple] = []
        index: dict[tuple, int] = {}
        self.users: list[list[tuple[int, list]]] = []
        for r, (c, t) in enumerate(requests):
            inp = tuple((c + t)[-(max_length + 1):][:-1])
            if inp not in index:
                index[inp] = len(self.inputs)
                self.inputs.append(inp)
                self.users.append([])
            self.users[index[inp]].append((r, list(t)))
        self.picked: list[list[tuple[int, float]]] = [[] for _ in requests]
        self.greedy = [True] * len(requests)
        self.forwards = 0

    def run(self, progress=None) -> list[tuple[float, bool]]:
        self.total, self.done, self.progress = len(self.inputs), 0, progress
        self._level(None, trie(self.inputs, self.users))
        out = []
        for r, got in enumerate(self.picked):
            got.sort()
            out.append((float(torch.tensor([v for _, v in got], dtype=torch.float64).sum()),
                        self.greedy[r]))
        return out

    def _level(self, parent: Batch | None, nodes: list[tuple[Node, int]]) -> None:
        """Sibling nodes (each with its parent's row in ``parent``) in batches of one shape
        (``bucket``), each batch's children right after it: memory is one chain of batches."""
        nodes = sorted(nodes, key=lambda n: bucket(n[0]))
        i = 0
        while i < len(nodes):
            shape = bucket(nodes[i][0])
            fit = max(1, min(self.rows, self.tokens // (shape[0] + shape[1])))
            chunk = [n for n in nodes[i:i + fit] if bucket(n[0]) == shape]
            i += len(chunk)
            batch = self._forward(parent, chunk, shape)
            children = [(child, row) for row, (node, _) in enumerate(chunk)
                        for child in node.children.values()]
            if children:
                self._level(batch, children)
            del batch

    def _forward(self, parent: Batch | None, chunk: list[tuple[Node, int]],
                 shape: tuple[int, int]) -> Batch | None:
        from transformers import DynamicCache

        width, cached = shape
        rows = len(chunk)
        ids = torch.zeros((rows, width), dtype=torch.int64)
        new = torch.zeros((rows, width), dtype=torch.int64)
        start = torch.tensor([node.start for node, _ in chunk], dtype=torch.int64)
        for j, (node, _) in enumerate(chunk):
            ids[j, :len(node.tokens)] = torch.tensor(node.tokens, dtype=torch.int64)
            new[j, :len(node.tokens)] = 1
        before = (torch.arange(cached)[None, :] < start[:, None]).to(torch.int64)
        cache = None
        if parent is not None:           # each row its parent's keys, padded to ``cached``
            idx = torch.tensor([row for _, row in chunk], dtype=torch.int64)
            held = min(cached, parent.kv[0][0].shape[2])
            keep = before[:, None, :held, None].to(parent.kv[0][0].dtype)
            cache = DynamicCache()
            for layer, (k, v) in enumerate(parent.kv):
                pad = (rows, k.shape[1], cached, k.shape[3])
                ks, vs = k.new_zeros(pad), v.new_zeros(pad)
                ks[:, :, :held] = k[idx, :, :held] * keep
                vs[:, :, :held] = v[idx, :, :held] * keep
                cache.update(ks, vs, layer)
        reads = sorted({p for node, _ in chunk for p in node.reads})
        # the output layer's rows a multiple of WIDTH too (rows x kept positions): an odd
        # count gave a row other bits (tests/models/test_prefix.py)
        kept = reads + [p for p in range(width) if p not in reads][:-len(reads) % WIDTH] \
            if reads else [width - 1]
        device = self.device
        started = time.perf_counter()
        out = self.model(input_ids=ids.to(device),
                         attention_mask=torch.cat([before, new], 1).to(device),
                         position_ids=((start[:, None] + torch.arange(width)[None, :])
                                       * new).to(device),
                         past_key_values=cache, use_cache=True,
                         logits_to_keep=torch.tensor(kept, dtype=torch.int64, device=device))
        self.forwards += 1
        logits = self.check(ids, getattr(out, "logits", None))
        self._read(chunk, logits, reads)
        inner = any(node.children for node, _ in chunk)
        if self.timer is not None:
            self.timer.add("prefixes" if inner else "suffixes", time.perf_counter() - started)
        self.done += sum(node.ends for node, _ in chunk)
        if self.progress is not None:
            self.progress(self.done, self.total)
        if not inner:
            return None
        # each row's real positions (its cache's, then its own tokens) first, for its children
        lengths = torch.tensor([len(node.tokens) for node, _ in chunk], dtype=torch.int64)
        end = start + lengths
        span = int(end.max())
        at = torch.arange(span)[None, :]
        where = torch.where(at < start[:, None], at, cached + at - start[:, None])
        where = torch.where(at < end[:, None], where, 0).to(device)
        kv = []
        for k, v in _layers(out.past_key_values, self.model):
            pick = where[:, None, :, None].expand(rows, k.shape[1], span, k.shape[3])
            kv.append((k.gather(2, pick), v.gather(2, pick)))
        return Batch(kv, end)

    def _read(self, chunk: list[tuple[Node, int]], logits: torch.Tensor,
              reads: list[int]) -> None:
        """Each read's log-probability into its request: one log-softmax over the read
        positions of the batch and two copies to the host (on a GPU, a sync per read made
        HellaSwag's scoring 1.4x lm-eval's time on an H200; see docs/benchmarks.md)."""
        at = {p: i for i, p in enumerate(reads)}
        spots = [(row, node, p, got) for row, (node, _) in enumerate(chunk)
                 for p, got in sorted(node.reads.items())]
        if not spots:
            return
        rows = torch.tensor([row for row, _, _, _ in spots], device=logits.device)
        cols = torch.tensor([at[p] for _, _, p, _ in spots], device=logits.device)
        logp = torch.log_softmax(logits[rows, cols].float(), dim=-1)
        which = [i for i, (_, _, _, got) in enumerate(spots) for _ in got]
        targets = [target for _, _, _, got in spots for _, target in got]
        values = logp[torch.tensor(which, device=logp.device),
                      torch.tensor(targets, device=logp.device)].tolist()
        best = logp.argmax(-1).tolist()
        k = 0
        for i, (_, node, p, got) in enumerate(spots):
            for r, target in got:
                self.picked[r].append((node.start + p, values[k]))
                if best[i] != target:
                    self.greedy[r] = False
                k += 1


def _layers(cache, model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A cache's (keys, values) per layer; CannotShare unless it is a plain full-attention
    DynamicCache."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        raise CannotShare(f"{type(model).__name__} returns a {type(cache).__name__} that is "
                          "not a plain full-attention cache")
    return [(layer.keys, layer.values) for layer in layers]

