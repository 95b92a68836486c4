"""What a backend is: the requests a task hands it, the context it scores them in, and the
interface every backend implements.

A backend turns requests into numbers for one kind of model. The interface is lm-eval's
``LM`` (``api/model.py``) over token requests, plus a forward pass for tensor models:

    forward                one batch of tensor inputs -> the model's output (a tensor)
    loglikelihood          (context, continuation) token pairs -> (log-probability of the
                           continuation, whether greedy decoding gives it) per pair
    loglikelihood_rolling  each document's rolling windows -> its summed log-likelihood
    generate               token contexts -> each context's generated texts
    generate_images        image+text items (``ImageRequest``) -> each item's generated texts
    loglikelihood_images   image+text items with token continuations -> their log-likelihoods

A task builds requests from its decoded batch and scores the responses; it never touches a
model or an engine. What a task and a backend need of the evaluation travels in a ``Context``
(frozen: the pass builds one per evaluation). Plain torch: no Ray, no collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

from rayeval.config.registry import Registry
from rayeval.config.schema import DatasetSpec, Generation
from rayeval.errors import ModelError
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

Inputs = Any            # a tensor, or a mapping of keyword name -> tensor
TokenPair = tuple[list[int], list[int]]      # (context tokens, continuation tokens)

# Every backend class, by the name ``model.backend`` gives it:
# ``@BACKENDS.register()`` on a Backend subclass with a ``name``.
BACKENDS: Registry[type["Backend"]] = Registry("backend")


@dataclass(frozen=True)
class Context:
    """What scoring one evaluation's batches reads besides the batch: the data set's spec
    (its key path names errors), the task's name and what it needs of the model (for the
    message when the model's output does not fit), the model's output size, the tokenizer
    (text tasks), the generation settings, sequences per forward pass, tokens per forward
    pass (``batch_tokens``), whether log-likelihoods share their prefixes
    (``share_prefixes``), the device, and a callback told how many requests of the batch
    under way are done (progress)."""
    spec: DatasetSpec
    task: str = "classification"
    needs: str = ""
    size: int = 0
    text: Any = None                   # io.hf.Tokenizer: text tasks only
    generation: Generation = Generation()
    batch: int = 256
    tokens: int = 8192
    share: bool = True
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    progress: Callable[[int, int], None] | None = None

    def partly(self, done: int, total: int) -> None:
        """Tell the pass how far the scoring of its batch is (progress counts scored rows)."""
        if self.progress is not None:
            self.progress(done, total)


@dataclass(frozen=True)
class ImageRequest:
    """One image+text item to generate from (``Backend.generate_images``): the full prompt
    (chat template applied, one image placeholder per image), its decoded RGB images (numpy
    uint8 arrays of shape (height, width, 3)) in prompt order, and the checkpoint processor's
    outputs for this item alone (input_ids, attention_mask, pixel_values, ...: tensors with a
    leading batch dimension of 1), made on a Ray Data CPU stage. The Hugging Face backend
    uses ``inputs``; an engine that runs its own processor (vLLM) uses ``prompt`` and
    ``images``."""
    prompt: str
    images: tuple
    inputs: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Setup:
    """What a worker knows when it builds its backend, once for the sweep: the sweep's
    ``model`` section (``ModelSpec``), the device, the ranks of one tensor-parallel engine,
    a name the same on every rank and new for each worker group, and the rank variables an
    engine's launcher reads (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE)."""
    model: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tensor: int = 1
    ident: str = ""
    ranks: Mapping[str, int] | None = None


class Backend:
    """Base class: a subclass sets ``name``, is registered in ``BACKENDS``, and implements the
    request types its models answer (the others raise NotImplementedError, so a task the
    backend cannot serve fails its cells with one line)."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""            # for messages ("the vLLM load of ..."); default: name
    # Whether ``serve`` is collective (every rank of a group must enter it together): the
    # worker then agrees on its outcome over the group, as it does for a load.
    collective_serve: ClassVar[bool] = False

    def __init__(self, setup: Setup | None = None):
        setup = Setup() if setup is None else setup
        self.setup = setup
        self.device = setup.device
        self.model: torch.nn.Module | None = None

    def serve(self, model: torch.nn.Module, folder: str = "", tokenizer: str | None = None,
              location: str = "", timer=None) -> None:
        """Answer requests with this checkpoint's model from now on (``folder``: where its
        files were fetched; ``tokenizer``: model.tokenizer; ``location``: for messages)."""
        self.model = model

    def release(self) -> None:
        """Let go of the checkpoint's model (the worker frees it before the next load)."""
        self.model = None

    # --- the request types -----------------------------------------------------------------

    def forward(self, x: Inputs, ctx: Context) -> Any:
        raise NotImplementedError(f"backend {self.name!r} has no forward pass for tensor "
                                  "models")

    def loglikelihood(self, requests: list[TokenPair], ctx: Context
                      ) -> list[tuple[float, bool]]:
        raise NotImplementedError(f"backend {self.name!r} does not score log-likelihoods")

    def loglikelihood_rolling(self, documents: list[list[TokenPair]], ctx: Context
                              ) -> list[float]:
        """Each document's log-likelihood: the exact sum (``math.fsum``) of its disjoint
        windows' (lm-eval's rolling windows, made by the task from the tokens)."""
        windows = [w for doc in documents for w in doc]
        lls = [ll for ll, _ in self.loglikelihood(windows, ctx)]
        out, k = [], 0
        for doc in documents:
            out.append(math.fsum(lls[k:k + len(doc)]) if doc else 0.0)
            k += len(doc)
        return out

    def generate(self, contexts: list[list[int]], ids: list[int] | None, ctx: Context
                 ) -> list[list[str]]:
        raise NotImplementedError(f"backend {self.name!r} does not generate")

    def generate_images(self, requests: list[ImageRequest], ids: list[int] | None,
                        ctx: Context) -> list[list[str]]:
        """Like ``generate`` for image+text items: per request, its generated texts (one per
        repeat), cut as ``texts_of`` cuts them."""
        raise NotImplementedError(f"backend {self.name!r} does not generate from images")

    def loglikelihood_images(self, requests: list[tuple[ImageRequest, list[list[int]]]],
                             ctx: Context) -> list[list[tuple[float, bool]]]:
        """Multiple choice on image+text items: per (request, continuations), each
        continuation's summed log-probability after the request's prompt and images, and
        whether greedy decoding gives it (as ``loglikelihood``)."""
        raise NotImplementedError(f"backend {self.name!r} does not score log-likelihoods "
                                  "of image items")

    def choice_losses(self, requests: list[tuple[ImageRequest, int]], ctx: Context
                      ) -> list[list[tuple[float, bool]]]:
        """lmms-eval's ``multiple_choice``: per (request, masked tokens), each choice's mean
        loss and whether greedy decoding gives it (``hf.HFBackend.choice_losses``)."""
        raise NotImplementedError(f"backend {self.name!r} does not score lmms-eval's "
                                  "multiple_choice tasks; use model.backend: hf")


def wrong_output(out: Any, task: str, needs: str) -> ModelError:
    """The one line for a model whose output does not fit the task."""
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    return ModelError(f"model.factory: the model returns {shape}; task {task} needs {needs}")


def texts_of(repeats: list[list[int]], ctx: Context) -> list[str]:
    """Generated token lists as texts: cut at the end-of-sequence token, decoded, then cut at
    the first stop string (what every backend's ``generate`` returns)."""
    tok, texts = ctx.text, []
    for t in repeats:
        if tok.eos_id is not None and tok.eos_id in t:
            t = t[:t.index(tok.eos_id)]
        texts.append(cut(tok.decode(t), ctx.generation.until))
    return texts


def item_seed(seed: int, row: int, repeat: int) -> int:
    """The sampling seed of one item's repeat: the same on any worker and in any batch."""
    import hashlib

    digest = hashlib.sha256(f"{seed}:{row}:{repeat}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Sampler:
    """Sampled decoding in rayeval's own backends (``hf``, ``torch``), one generator per
    sequence seeded by ``item_seed`` (generation.seed, row id, repeat): a sequence's draws are
    the same whatever batch, worker or padding it is decoded in. At each step the next token
    is drawn from softmax(logits / temperature) in float64, over the nucleus: the most likely
    tokens, in order (ties by token id), up to the first whose cumulative probability reaches
    ``top_p``; one uniform draw from the sequence's generator picks it by inverse CDF."""

    def __init__(self, seeds: list[int], generation: Generation):
        self.gens = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature, self.top_p = generation.temperature, generation.top_p

    def pick(self, row: int, logits: torch.Tensor) -> int:
        """The next token of sequence ``row`` from its logits over the vocabulary."""
        p = torch.softmax(logits.detach().to("cpu", torch.float64) / self.temperature, dim=-1)
        order = torch.argsort(-p, stable=True)
        ranked = p[order]
        cum = torch.cumsum(ranked, dim=0)
        if self.top_p < 1.0:
            keep = min(int((cum < self.top_p).sum()) + 1, cum.numel())
            cum = cum[:keep]
        u = float(torch.rand((), generator=self.gens[row], dtype=torch.float64)) * float(cum[-1])
        k = min(int(torch.searchsorted(cum, torch.tensor([u], dtype=torch.float64),
                                       right=True)), cum.numel() - 1)
        return int(order[k])

    def one_hot(self, scores: torch.Tensor) -> torch.Tensor:
        """Each row's drawn token as the only finite score (a logits processor of
        transformers' greedy ``generate``, which then takes it)."""
        out = torch.full_like(scores, float("-inf"))
        for j in range(scores.shape[0]):
            out[j, self.pick(j, scores[j])] = 0.0
        return out


def sampled_texts(contexts: list, ids: list[int] | None,
                  tokens_of: Callable[[list, list[int], Context], list[list[int]]],
                  ctx: Context) -> list[list[str]]:
    """Each context's ``generation.repeats`` sampled generations (``Sampler``), as
    ``texts_of`` cuts them: ``tokens_of(contexts, seeds, ctx)`` run on ``batch`` sequences at
    a time."""
    gen = ctx.generation
    if ids is None:
        raise ModelError("sampled generation needs each item's row id for its seed")
    jobs = [(c, item_seed(gen.seed, int(ids[i]), r))
            for i, c in enumerate(contexts) for r in range(gen.repeats)]
    tokens: list[list[int]] = []
    step = max(1, ctx.batch)
    for start in range(0, len(jobs), step):
        chunk = jobs[start:start + step]
        tokens.extend(tokens_of([c for c, _ in chunk], [s for _, s in chunk], ctx))
        ctx.partly(len(tokens) // gen.repeats, len(contexts))
    k = gen.repeats
    return [texts_of(tokens[i * k:(i + 1) * k], ctx) for i in range(len(contexts))]


def batched_texts(items: list, tokens_of: Callable[[list, Context], list[list[int]]],
                  ctx: Context) -> list[list[str]]:
    """Each item's one (greedy) generation as ``texts_of`` cuts it, ``tokens_of`` run on
    ``batch`` items at a time (the generated tokens of each), progress told after each."""
    out: list[list[str]] = []
    step = max(1, ctx.batch)
    for start in range(0, len(items), step):
        for tokens in tokens_of(items[start:start + step], ctx):
            out.append(texts_of([tokens], ctx))
        ctx.partly(len(out), len(items))
    return out


def cut(text: str, until) -> str:
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
