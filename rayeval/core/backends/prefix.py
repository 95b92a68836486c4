"""Shared-prefix log-likelihoods (``share_prefixes``, on by default) for Hugging Face causal
models: every shared token prefix of a scoring's requests is computed once, with the same bits
whatever else is scored beside it.

The requests' model inputs (``(context + continuation)[-(L + 1):][:-1]``, lm-eval's window,
left truncation included) are cut into segments at places each input's own tokens decide
(``cuts``: a content-defined cut, a function of the tokens up to it, never of the other
requests), and the segments make a trie: a node is a segment that the inputs below it share
after the same segments (the few-shot block of an MMLU subject; an item's context across its
choices). Each node runs alone, as one forward pass of batch 1 over its tokens on its parent's
key-value cache, its shape its own: so every log-probability is computed from the same
tensors in the same shapes whichever requests share its worker, its batch or its node — the
same bits at any batch size and on any number of workers, which a batch of padded siblings
cannot give (a float32 matmul's bits depend on the shape the kernel sees). The logits come
for every position of a segment that some request reads, none elsewhere; a node's cache lives
until its children are done.

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
# at most (a read segment's logits are MAX_SEGMENT x vocabulary). A cut depends on the tokens
# before it only, so inputs that share a prefix share its cuts, and a divergence costs the
# segment it falls in. On the tests' 5-shot items (tests/models/test_prefix.py, 17 inputs of
# 1,381 tokens): one cut in 16 ran 28% of the tokens in 23 forward passes, one in 8 over
# bigrams 18% in 29 (one in 4: 16% in 39).
MIN_SEGMENT = 2
MAX_SEGMENT = 64
CUT_ODDS = 8
WINDOW = 2
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


def trie(inputs: list[tuple], users: list[list[tuple[int, list]]]) -> list[Node]:
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
    return list(top.values())


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


class Scorer:
    """One scoring's requests through the trie (see the module docstring)."""

    def __init__(self, model, requests, max_length: int, check,
                 device: torch.device | None = None, timer=None):
        self.model = model
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
        for node in trie(self.inputs, self.users):
            self._run(node, None)
        out = []
        for r, got in enumerate(self.picked):
            got.sort()
            out.append((float(torch.tensor([v for _, v in got], dtype=torch.float64).sum()),
                        self.greedy[r]))
        return out

    def _run(self, node: Node, parent: list | None) -> None:
        """``node``'s forward pass on its parent's cache (``parent``: keys and values per
        layer), then its children's on its own; the cache is let go after the last child."""
        kv = self._forward(node, parent)
        del parent
        children = list(node.children.values())
        for i, child in enumerate(children):
            if i == len(children) - 1:
                mine, kv = kv, None
                self._run(child, mine)
            else:
                self._run(child, kv)

    def _forward(self, node: Node, parent: list | None) -> list | None:
        from transformers import DynamicCache

        width, cached = len(node.tokens), node.start
        ids = torch.tensor([node.tokens], dtype=torch.int64)
        cache = None
        if parent is not None:
            cache = DynamicCache()
            for layer, (k, v) in enumerate(parent):
                cache.update(k, v, layer)
        device = self.device
        started = time.perf_counter()
        # every position's logits where the segment is read (its own shape), else the last's
        out = self.model(input_ids=ids.to(device),
                         attention_mask=torch.ones((1, cached + width), dtype=torch.int64,
                                                   device=device),
                         position_ids=torch.arange(cached, cached + width,
                                                   device=device)[None, :],
                         past_key_values=cache, use_cache=True,
                         logits_to_keep=0 if node.reads else 1)
        self.forwards += 1
        logits = self.check(ids, getattr(out, "logits", None))
        if node.reads:
            self._read(node, logits)
        if self.timer is not None:
            self.timer.add("prefixes" if node.children else "suffixes",
                           time.perf_counter() - started)
        self.done += node.ends
        if self.progress is not None and node.ends:
            self.progress(self.done, self.total)
        return _layers(out.past_key_values, self.model) if node.children else None

    def _read(self, node: Node, logits: torch.Tensor) -> None:
        """Each read's log-probability into its request: one log-softmax over the segment's
        read positions and two copies to the host (on a GPU, a sync per read made
        HellaSwag's scoring 1.4x lm-eval's time on an H200; see docs/benchmarks.md)."""
        spots = sorted(node.reads.items())
        cols = torch.tensor([p for p, _ in spots], device=logits.device)
        logp = torch.log_softmax(logits[0, cols].float(), dim=-1)
        which = [i for i, (_, reads) in enumerate(spots) for _ in reads]
        targets = [target for _, reads in spots for _, target in reads]
        values = logp[torch.tensor(which, device=logp.device),
                      torch.tensor(targets, device=logp.device)].tolist()
        best = logp.argmax(-1).tolist()
        k = 0
        for i, (p, reads) in enumerate(spots):
            for r, target in reads:
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

