"""Backend vllm (``model.backend: vllm``): one vLLM engine per worker for the whole sweep
generates; log-likelihoods and forward passes stay on the checkpoint's own model (``hf``).

The engine starts once, at the first checkpoint, from that folder's config and tokenizer
with placeholder weights; every checkpoint (the first too) is then loaded into it in place
from the model rayeval's own loader built (any layout, local or remote), the way RLHF
systems refresh a running engine. A checkpoint whose architecture differs from the engine's
fails its own cells; an engine that cannot start is one line naming the key to change.

The engine runs in the worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with vLLM's
external launcher over the Ray Train group, so ``parallelism.tensor`` consecutive ranks
serve one engine and the group's process group is vLLM's world (its "external data
parallel" dimension is rayeval's replicas). What the planner checks first (vLLM installed,
its engine arguments) is ``io.vllm_preflight``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os

from rayeval import compat
from rayeval.core.backends.base import BACKENDS, Context, Setup, item_seed, texts_of
from rayeval.core.backends.hf import HFBackend
from rayeval.errors import CheckpointError, EngineError, SpecError
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

CPU_KV_CACHE_BYTES = 1 << 30      # on CPU, vLLM's memory fraction is of the whole host's RAM
IMAGES_PER_PROMPT = 1             # a vision-language engine's default limit_mm_per_prompt
# Config fields that shape a model's weights: a checkpoint that differs in one cannot be
# loaded into the engine (a missing layer would keep the previous checkpoint's weights).
SHAPE_FIELDS = ("model_type", "architectures", "vocab_size", "hidden_size", "n_embd",
                "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
                "num_key_value_heads", "intermediate_size", "n_inner", "head_dim",
                "tie_word_embeddings")
VISION_SHAPE_FIELDS = ("image_size", "patch_size", "hidden_size", "num_hidden_layers",
                       "num_attention_heads", "intermediate_size")


class Engine:
    """A worker's vLLM engine: started at the first checkpoint, then given each one's
    weights in place."""

    def __init__(self, spec, tensor: int, device: torch.device, ident: str,
                 ranks: dict[str, int]):
        self.spec = spec
        self.ranks = ranks        # RANK, LOCAL_RANK, ...: what the external launcher reads
        self.tensor = tensor
        self.device = device
        self.ident = ident                    # the same on every rank, new for each group
        self.llm = None
        self.shape: dict | None = None        # the engine's architecture (SHAPE_FIELDS)
        self.loaded: str | None = None        # the checkpoint whose weights it holds
        self._default_images: int | None = None   # images per prompt rayeval chose
        self._group_before = False    # whether the process group existed before the engine

    def serve(self, model: torch.nn.Module, folder: str, tokenizer: str | None,
              location: str, timer=None) -> None:
        """Hold ``model``'s weights (the checkpoint at ``location``, read from ``folder``);
        the profile's ``engine start`` and ``engine load`` spans time the two steps."""
        span = timer.span if timer is not None else \
            (lambda name, doing=None: contextlib.nullcontext())
        say = getattr(timer, "doing", None)
        shape = _shape(model)
        if self.llm is None:
            with span("engine start", doing="starting the vLLM engine"):
                self._start(folder, tokenizer or folder, model, say)
            self.shape = shape
        differs = [k for k in shape if shape.get(k) != self.shape.get(k)]
        if differs:
            k = differs[0]
            raise CheckpointError(
                f"{location}: its {k} {shape.get(k)!r} differs from the vLLM engine's "
                f"{self.shape.get(k)!r} (started from the sweep's first checkpoint); "
                "evaluate it in a sweep of its own")
        self.loaded = None
        with span("engine load", doing="loading the weights into the vLLM engine"):
            weights = model.state_dict()
            try:
                self.llm.collective_rpc("reload_weights",
                                        kwargs={"weights_iterator": iter(weights.items())})
            except Exception as e:
                raise CheckpointError(f"{location}: vLLM could not load its weights: "
                                      f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                                      ) from None
            self.llm.apply_model(_refresh_cpu_kernels)
            self.llm.reset_prefix_cache()
            _reset_encoder_cache(self.llm)
        self.loaded = location

    def _start(self, folder: str, tokenizer: str, model: torch.nn.Module, say=None) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"    # the engine in this process
        for name, value in self.ranks.items():
            os.environ[name] = str(value)
        try:
            import vllm
        except Exception as e:
            raise EngineError(f"model.backend: vllm cannot be imported on this worker: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
        _name_shared_memory(self.ident)
        self._group_before = torch.distributed.is_available() and \
            torch.distributed.is_initialized()
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                     torch.float32)
        args = {"load_format": "dummy", "dtype": str(dtype).removeprefix("torch."),
                "tensor_parallel_size": self.tensor, "seed": 0,
                "distributed_executor_backend": "external_launcher"}
        if self.device.type == "cpu" and not {"gpu_memory_utilization",
                                                "kv_cache_memory_bytes"} & set(self.spec.vllm):
            args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        if _vision(model) and "limit_mm_per_prompt" not in self.spec.vllm:
            # vLLM's default is 999 images per prompt, which its start-up profile plans
            # memory for (and which does not fit a short max_model_len): one, unless set
            args["limit_mm_per_prompt"] = {"image": IMAGES_PER_PROMPT}
            self._default_images = IMAGES_PER_PROMPT
        args.update(self.spec.vllm)
        try:
            with _steps_said(say):
                self.llm = vllm.LLM(model=folder, tokenizer=tokenizer, **args)
        except Exception as e:
            raise EngineError(_start_failure(e)) from None
        _live.add(id(self))

    def close(self) -> None:
        """Shut the engine down and free its memory (weights, KV cache, and vLLM's groups
        unless another engine of this process serves on them); a later ``serve`` starts a
        new one. The process group the engine joined (the worker group's) is kept, which
        vLLM's own shutdown would destroy (``compat.vllm_groups_kept``)."""
        llm, self.llm = self.llm, None
        self.shape = self.loaded = None
        if llm is None:
            return
        _live.discard(id(self))
        with compat.vllm_groups_kept(self._group_before, bool(_live)):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()

    def generate(self, contexts: list[list[int]], ids: list[int] | None, gen
                 ) -> list[list[list[int]]]:
        """Each context's ``gen.repeats`` continuations as token ids: greedy, or sampled
        with the seed of (generation.seed, row id, repeat)."""
        from vllm.inputs import TokensPrompt

        return self._generate([TokensPrompt(prompt_token_ids=list(c)) for c in contexts],
                              ids, gen)

    def generate_images(self, requests, ids: list[int] | None, gen
                        ) -> list[list[list[int]]]:
        """Like ``generate`` for image+text items (``ImageRequest``): vLLM runs the model's
        own processor on each prompt and its images (PIL, in prompt order)."""
        from PIL import Image

        limit = self.images_per_prompt
        prompts = []
        for i, request in enumerate(requests):
            if limit is not None and len(request.images) > limit:
                raise SpecError(
                    f"model.vllm.limit_mm_per_prompt: item {ids[i] if ids else i} has "
                    f"{len(request.images)} images, more than the engine's {limit} per "
                    f"prompt; set limit_mm_per_prompt: {{image: {len(request.images)}}}")
            images = [Image.fromarray(a) for a in request.images]
            prompts.append({"prompt": request.prompt, "multi_modal_data": {"image": images}}
                           if images else {"prompt": request.prompt})
        return self._generate(prompts, ids, gen)

    def _generate(self, prompts: list, ids: list[int] | None, gen) -> list[list[list[int]]]:
        """Each prompt's ``gen.repeats`` continuations, in one call (vLLM batches them)."""
        from vllm import SamplingParams

        every, params = [], []
        for i, prompt in enumerate(prompts):
            for r in range(gen.repeats):
                every.append(prompt)
                params.append(SamplingParams(
                    temperature=gen.temperature, top_p=gen.top_p,
                    max_tokens=gen.max_new_tokens, stop=list(gen.until) or None,
                    seed=item_seed(gen.seed, ids[i], r) if gen.samples else None,
                    detokenize=bool(gen.until)))
        outs = self.llm.generate(every, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        k = gen.repeats
        return [tokens[i * k:(i + 1) * k] for i in range(len(prompts))]

    @property
    def images_per_prompt(self) -> int | None:
        """The engine's limit of images per prompt (None: vLLM's own, unlimited)."""
        limit = (self.spec.vllm.get("limit_mm_per_prompt") or {}).get("image")
        if isinstance(limit, dict):            # vLLM's richer form: {image: {count: N}}
            limit = limit.get("count")
        return self._default_images if limit is None else int(limit)


@BACKENDS.register()
class VllmBackend(HFBackend):
    """Generation on the worker's vLLM engine; the rest on the checkpoint's model."""

    name = "vllm"
    title = "vLLM"
    collective_serve = True          # the engine's start is collective over its ranks

    def __init__(self, setup: Setup | None = None):
        super().__init__(setup)
        setup = self.setup
        self.engine = Engine(setup.model, setup.tensor, setup.device, setup.ident,
                             dict(setup.ranks or {}))

    def serve(self, model, folder="", tokenizer=None, location="", timer=None) -> None:
        super().serve(model)
        self.engine.serve(model, folder, tokenizer, location, timer)

    def close(self) -> None:
        """Let go of the model and shut the engine down, freeing its memory (before a judge
        loads, ``execution.workers.judging``); a later ``serve`` starts a new engine."""
        super().release()          # not self.release: a judge's is this method
        self.engine.close()

    def generate(self, contexts: list[list[int]], ids: list[int] | None, ctx: Context
                 ) -> list[list[str]]:
        """Every context in one call (the engine batches and schedules them itself), each
        with ``generation.repeats`` continuations, sampling seeded by row id."""
        if not contexts:
            return []
        tokens = self.engine.generate(contexts, ids, ctx.generation)
        out = [texts_of(repeats, ctx) for repeats in tokens]
        ctx.partly(len(out), len(contexts))
        return out

    def generate_images(self, requests, ids: list[int] | None, ctx: Context
                        ) -> list[list[str]]:
        """Image+text items on the engine (its own processor, from each request's prompt
        and images), all in one call, like ``generate``."""
        if not requests:
            return []
        tokens = self.engine.generate_images(requests, ids, ctx.generation)
        out = [texts_of(repeats, ctx) for repeats in tokens]
        ctx.partly(len(out), len(requests))
        return out


def _name_shared_memory(ident: str) -> None:
    """vLLM's CPU tensor-parallel communicator names its shared-memory segments after the
    engine's init method, which the external launcher fixes as ``env://``: two engines on one
    host (two sweeps, or a restarted group beside a crashed one's leftovers) would open the
    same segments (``create shm in SHMManager failed. errno: 17``). The group's process group
    already exists, so that method only names things: make it this group's own (the hook is
    ``compat.name_vllm_init_method``)."""
    os.environ["RAYEVAL_VLLM_IDENT"] = ident
    compat.name_vllm_init_method(lambda: f"file://rayeval-{os.environ['RAYEVAL_VLLM_IDENT']}")


_live: set[int] = set()      # the engines started in this process and not closed (ids)


# The steps of an engine's start, told by the first words of vLLM's own INFO log lines
# (0.32.0; a start took 5.6 s here on CPU, 22-76 s with its engine in a process of its own,
# minutes on a GPU with torch.compile and CUDA graphs). A line that matches none leaves the
# step said before; a vLLM that words them otherwise leaves "starting the vLLM engine".
ENGINE_STEPS = (
    ("init engine", "starting the vLLM engine: finishing"),   # "... (profile, kv cache) took"
    ("initializing a v1 llm engine", "starting the vLLM engine: setting it up"),
    ("starting to load model", "starting the vLLM engine: building the model"),
    ("kv cache", "starting the vLLM engine: allocating its KV cache"),
    ("warming up", "starting the vLLM engine: compiling and warming up"),
    ("compiling a graph", "starting the vLLM engine: compiling and warming up"),
    ("dynamo bytecode", "starting the vLLM engine: compiling and warming up"),
    ("capturing cuda graphs", "starting the vLLM engine: capturing CUDA graphs"),
)


def engine_step(message: str) -> str | None:
    """The step of an engine's start that one of vLLM's log lines begins, or None."""
    low = message.lower()
    return next((step for words, step in ENGINE_STEPS if words in low), None)


_listeners: list = []          # the ``say`` of the engine start under way in this process
_hearing = False               # whether this process's log record factory tells them


@contextlib.contextmanager
def _steps_said(say):
    """While vLLM starts its engine, tell ``say`` each step its log lines begin.

    The lines are heard where log records are made (the record factory, wrapped once per
    process): vLLM configures its loggers inside ``LLM()`` (``dictConfig``), which drops any
    handler added to them before."""
    global _hearing
    if say is None:
        yield
        return
    if not _hearing:
        logging.setLogRecordFactory(_hear(logging.getLogRecordFactory()))
        _hearing = True
    _listeners.append(say)
    try:
        yield
    finally:
        _listeners.remove(say)


def _hear(previous):
    def make(*args, **kwargs):
        record = previous(*args, **kwargs)
        if _listeners and record.name.startswith("vllm"):
            try:
                step = engine_step(record.getMessage())
            except Exception:        # noqa: BLE001 - a log line must never fail the start
                step = None
            if step:
                _listeners[-1](step)
        return record

    return make


def _reset_encoder_cache(llm) -> None:
    """Forget the vision encoder's outputs of the previous weights: vLLM keeps them by image
    hash, so the next checkpoint would reuse them for the same images (stale answers), or,
    as measured here with the scheduler's record and the worker's store out of step, fail
    with "Encoder cache miss" on the first image it had seen before."""
    reset = getattr(getattr(llm, "llm_engine", None), "reset_encoder_cache", None)
    if reset is not None:
        reset()


def _vision(model: torch.nn.Module) -> bool:
    """Whether the model takes images (its config has a vision tower's)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def _shape(model: torch.nn.Module) -> dict:
    """The config fields that shape the weights; a vision-language model's from its text
    model's config (where they are), and its vision tower's prefixed ``vision.``."""
    config = getattr(model, "config", None)
    values = config.to_dict() if config is not None else {}
    text = config.get_text_config().to_dict() if hasattr(config, "get_text_config") else {}
    shape = {k: values.get(k) if values.get(k) is not None else text.get(k)
             for k in SHAPE_FIELDS}
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        vision = vision.to_dict() if hasattr(vision, "to_dict") else dict(vision)
        shape.update({f"vision.{k}": vision.get(k) for k in VISION_SHAPE_FIELDS})
    return shape


def _refresh_cpu_kernels(model: torch.nn.Module) -> int:
    """vLLM's CPU backend packs some linear layers' weights into kernel handles when it
    loads (``cpu_linear``); an in-place reload leaves a tied output layer's handle on the old
    weights (stale generations, found by the swap-and-back test). Pack them again (vLLM's
    packing function: ``compat.vllm_cpu_gemm_dispatch``)."""
    dispatch_cpu_unquantized_gemm = compat.vllm_cpu_gemm_dispatch()
    if dispatch_cpu_unquantized_gemm is None:
        return 0
    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) \
                and weight.numel() and weight.device.type == "cpu":
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


def _start_failure(e: Exception) -> str:
    """One line for an engine that cannot start, naming the key to change."""
    message = str(e).strip()
    try:                             # pydantic's first line only counts errors: take the first
        message = e.errors()[0]["msg"]          # error's own message
    except Exception:
        pass
    message = " ".join(message.split())[:300]
    text = f"{type(e).__name__}: {message}" if message else type(e).__name__
    low = text.lower()
    if "memory" in low or "kv cache" in low or "out of memory" in low:
        key = "model.vllm.gpu_memory_utilization (or kv_cache_memory_bytes)"
    elif "max_model_len" in low or "max model len" in low:
        key = "model.vllm.max_model_len"
    elif "architecture" in low or "not supported" in low:
        key = "model.backend (hf serves any model)"
    elif "tensor" in low and "parallel" in low or "divisible" in low:
        key = "parallelism.tensor"
    else:
        key = "model.vllm"
    return f"model.backend: the vLLM engine could not start: {text}; change {key}"
