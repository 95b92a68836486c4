"""Shared-prefix log-likelihoods (``share_prefixes``, off by default) for Hugging Face causal
models: every shared token prefix of a scoring's requests is computed once, and the output
layer runs only on the positions whose log-probabilities are read.

The requests' model inputs (``(context + continuation)[-(L + 1):][:-1]``, lm-eval's window,
left truncation included) become a token trie: a node is a run of tokens that every input
below it shares (the few-shot block of an MMLU subject; an item's context across its
choices); a leaf is the rest of one input. Nodes are computed top-down, breadth-first per
parent batch: a batch of sibling segments runs on the rows of its parents' key-value cache
(selected, so each row carries its own parent's keys), with an attention mask that hides the
padding inside the parents' rows and position ids that continue each parent's own positions.
The logits come only at the positions some request reads (``logits_to_keep`` as a 1-D tensor
of positions), and each read is summed into its request at once: no vocabulary-sized vector
is kept. A parent batch's cache lives until its children are done (depth-first), so memory is
one chain of batches, each within the token budget (``batch_tokens``: rows x (cached + new)
tokens).

Equality with one forward pass per request is to float tolerance, not bits (a masked
attention over a cache sums in another order): figures agree with lm-eval's within the 1e-4
relative tolerance of the text tasks; counts are exact unless two choices tie to 1e-6.
Plain torch and transformers' cache classes; no Ray.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

# A shared run shorter than this is recomputed by each child instead: a level of forward
# passes and a copy of the parents' cache rows cost more than a few tokens (MMLU's shared
# "Question:" heads would otherwise be a level of their own).
MIN_SEGMENT = 4


class CannotShare(Exception):
    """The model cannot score from a cache (its class and why): the backend falls back."""


@dataclass(eq=False)
class Node:
    """Tokens [start, end) of every input below it; ``reads``: position in the segment ->
    the (request, target token) pairs that read its log-probabilities."""
    start: int
    tokens: tuple
    members: list[int]                   # unique inputs below (indices)
    children: list["Node"] = field(default_factory=list)
    reads: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    parent_row: int = -1                 # its parent's row in the parent's batch
    row: int = -1                        # its own row in its batch

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class Batch:
    """A forward pass's key-value rows: per layer (keys, values) of shape (rows, heads, T,
    dim), which of the T slots are real (``mask``), each row's real length (its next
    position id) and the index after its last slot (``extent``)."""
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    length: torch.Tensor
    extent: torch.Tensor


def trie(inputs: list[tuple]) -> list[Node]:
    """The inputs (distinct token tuples) as a trie of shared runs: the top nodes."""
    order = sorted(range(len(inputs)), key=lambda u: inputs[u])
    lcp = [0] + [_common(inputs[order[i - 1]], inputs[order[i]]) for i in range(1, len(order))]
    top: list[Node] = []
    stack = [(0, len(order), 0, top)]        # (lo, hi, shared start, list to fill)
    while stack:
        lo, hi, start, out = stack.pop()
        i = lo
        while i < hi:
            j = i + 1
            while j < hi and lcp[j] > start:
                j += 1
            seqs = [order[t] for t in range(i, j)]
            if j - i == 1:
                u = seqs[0]
                out.append(Node(start, inputs[u][start:], seqs))
            else:
                end = min(lcp[i + 1:j])
                node = Node(start, inputs[seqs[0]][start:end], seqs)
                out.append(node)
                ends = [u for u in seqs if len(inputs[u]) == end]   # sorted first
                for u in ends:                 # an input that is this run exactly
                    node.children.append(Node(end, (), [u]))
                stack.append((i + len(ends), j, end, node.children))
            i = j
    return _merge_short(top)


def _merge_short(nodes: list[Node]) -> list[Node]:
    """Runs shorter than MIN_SEGMENT pushed down into their children; an input that ends on
    such a run becomes a leaf of the run's tokens."""
    out: list[Node] = []
    work = list(nodes)
    while work:
        node = work.pop()
        if node.children and len(node.tokens) < MIN_SEGMENT:
            for child in node.children:
                work.append(Node(node.start, node.tokens + child.tokens, child.members,
                                 child.children))
            continue
        if node.children:
            node.children = _merge_short(node.children)
        out.append(node)
    out.reverse()
    return out


def _common(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def attach_reads(nodes: list[Node], inputs: list[tuple], users: list[list[tuple[int, list]]]
                 ) -> None:
    """Each node's reads: the positions in its segment that predict a token of some request's
    continuation. ``users[u]``: (request, continuation tokens) of input u."""
    work = list(nodes)
    while work:
        node = work.pop()
        work.extend(node.children)
        for u in node.members:
            inp = inputs[u]
            n = len(inp)
            deepest = max(len(cont) for _, cont in users[u])
            lo, hi = max(node.start, n - deepest), min(node.end, n)
            for p in range(lo, hi):
                for r, cont in users[u]:
                    if p >= n - len(cont):
                        target = inp[p + 1] if p + 1 < n else cont[-1]
                        node.reads.setdefault(p - node.start, []).append((r, target))


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

    def __init__(self, model, requests, max_length: int, rows: int, tokens: int, check,
                 device: torch.device | None = None, timer=None):
        device = torch.device("cpu") if device is None else device
        self.model, self.rows, self.tokens = model, max(1, rows), max(1, tokens)
        self.check, self.device = check, device     # check(ids, logits) -> logits, or raises
        self.timer = timer                          # the worker's profile (--profile), or None
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
        top = trie(self.inputs)
        attach_reads(top, self.inputs, self.users)
        self.total, self.done = len(self.inputs), 0
        self.progress = progress
        self._level(None, top)
        out = []
        for r, got in enumerate(self.picked):
            got.sort()
            out.append((float(torch.tensor([v for _, v in got], dtype=torch.float64).sum()),
                        self.greedy[r]))
        return out

    def _level(self, parent: Batch | None, nodes: list[Node]) -> None:
        """Sibling nodes (their parents' rows in ``parent``) in batches, each batch's
        children right after it."""
        # an input that is exactly its parent's run was read there: nothing left to run
        empty = [n for n in nodes if not n.tokens and not n.children]
        self.done += len(empty)
        nodes = sorted((n for n in nodes if n.tokens or n.children),
                       key=lambda n: -len(n.tokens))
        i = 0
        while i < len(nodes):
            chunk = self._chunk(parent, nodes, i)
            i += len(chunk)
            batch = self._forward(parent, chunk)
            children = []
            for node in chunk:
                for child in node.children:
                    child.parent_row = node.row
                    children.append(child)
            if children:
                self._level(batch, children)
            del batch

    def _chunk(self, parent: Batch | None, nodes: list[Node], i: int) -> list[Node]:
        """As many nodes as fit the row and token budgets (the first is the longest)."""
        cached = 0 if parent is None else int(parent.extent.max())
        width = max(1, len(nodes[i].tokens))
        fit = max(1, min(self.rows, self.tokens // (cached + width)))
        return nodes[i:i + fit]

    def _forward(self, parent: Batch | None, chunk: list[Node]) -> Batch:
        from transformers import DynamicCache

        rows, width = len(chunk), max(1, max(len(n.tokens) for n in chunk))
        ids = torch.zeros((rows, width), dtype=torch.int64)
        new = torch.zeros((rows, width), dtype=torch.int64)
        for j, node in enumerate(chunk):
            node.row = j
            ids[j, :len(node.tokens)] = torch.tensor(node.tokens, dtype=torch.int64)
            new[j, :len(node.tokens)] = 1
        if parent is None:
            before, start, cache, cached = new[:, :0], torch.zeros(rows, dtype=torch.int64), None, 0
        else:
            idx = torch.tensor([n.parent_row for n in chunk], dtype=torch.int64)
            cached = int(parent.extent[idx].max())
            before, start = parent.mask[idx, :cached], parent.length[idx]
            cache = DynamicCache()
            for layer, (k, v) in enumerate(parent.kv):
                cache.update(k[idx, :, :cached], v[idx, :, :cached], layer)
        positions = (start[:, None] + torch.arange(width)[None, :]) * new
        keep = sorted({p for n in chunk for p in n.reads}) or [width - 1]
        device = self.device
        started = time.perf_counter()
        out = self.model(input_ids=ids.to(device),
                         attention_mask=torch.cat([before, new], 1).to(device),
                         position_ids=positions.to(device), past_key_values=cache,
                         use_cache=True,
                         logits_to_keep=torch.tensor(keep, dtype=torch.int64, device=device))
        self.forwards += 1
        logits = self.check(ids, getattr(out, "logits", None))
        self._read(chunk, logits, keep)
        if self.timer is not None:
            inner = any(n.children for n in chunk)
            self.timer.add("prefixes" if inner else "suffixes",
                           time.perf_counter() - started)
        kv = _layers(out.past_key_values, self.model) if any(n.children for n in chunk) else []
        self.done += sum(1 for n in chunk if not n.children)
        if self.progress is not None:
            self.progress(self.done, self.total)
        lengths = torch.tensor([len(n.tokens) for n in chunk], dtype=torch.int64)
        return Batch(kv, torch.cat([before, new], 1), start + lengths, cached + lengths)

    def _read(self, chunk: list[Node], logits: torch.Tensor, keep: list[int]) -> None:
        """Each read's log-probability into its request: one log-softmax over the read
        positions of the batch and two copies to the host (on a GPU, a sync per read made
        HellaSwag's scoring 1.4x lm-eval's time on an H200; see docs/benchmarks.md)."""
        at = {p: i for i, p in enumerate(keep)}
        spots = [(node, p, reads) for node in chunk for p, reads in node.reads.items()]
        if not spots:
            return
        rows = torch.tensor([node.row for node, _, _ in spots], device=logits.device)
        cols = torch.tensor([at[p] for _, p, _ in spots], device=logits.device)
        logp = torch.log_softmax(logits[rows, cols].float(), dim=-1)
        which = [i for i, (_, _, reads) in enumerate(spots) for _ in reads]
        targets = [target for _, _, reads in spots for _, target in reads]
        values = logp[torch.tensor(which, device=logp.device),
                      torch.tensor(targets, device=logp.device)].tolist()
        best = logp.argmax(-1).tolist()
        k = 0
        for i, (node, p, reads) in enumerate(spots):
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

