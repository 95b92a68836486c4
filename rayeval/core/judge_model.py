"""A judge model loaded and served (docs/judges.md): by the judge stage of a generation
evaluation (``execution.workers.judging``) and by the judge an lmms-eval task asks for
(``lmms.judge_server``). Below both, so that neither reaches up to the other.

    load(js, backend, device, model_spec) -> JudgeModel   its backend and its tokenizer
    release(backend)                                      a model let go, an engine shut down
"""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from rayeval.core import backends
from rayeval.core.backends.base import Setup
from rayeval.errors import CheckpointError
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


@dataclass
class JudgeModel:
    """A served judge: its backend (hf, or a vLLM engine of its own) and its tokenizer
    (``io.hf.Tokenizer``)."""
    backend: Any
    tokenizer: Any

    def close(self) -> None:
        release(self.backend)


def load(js, backend_name: str, device: torch.device, model_spec) -> JudgeModel:
    """The judge of ``js`` (``JudgeSpec``) served by ``backend_name`` on ``device``; an
    object-store folder is fetched first. A judge transformers cannot load is a
    CheckpointError naming ``judge.model``."""
    from rayeval import errors
    from rayeval.io import hf
    from rayeval.io.checkpoints import fetch
    from rayeval.io.loading import dtypes

    transformers = hf.require()
    folder = fetch(js.model, os.path.join(tempfile.gettempdir(), "rayeval-judges"))
    try:
        kwargs = {"dtype": dtypes()[js.dtype]} if js.dtype else {}
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except Exception as e:          # noqa: BLE001 - files transformers cannot read
        raise CheckpointError(f"{js.key_path}.model: {js.model}: transformers cannot load the "
                              f"judge: {errors.reason(e, typed=True)}") from None
    model = model.eval().to(device)
    tok = hf.load_tokenizer(folder, what=f"{js.key_path}.model", model=model)
    # model.vllm's engine arguments serve the judge's engine too, but for max_model_len: the
    # judge's context is its own config's, as the stage's fit test (tok.max_length) reads it
    engine = {k: v for k, v in model_spec.vllm.items() if k != "max_model_len"}
    spec = dataclasses.replace(model_spec, backend=backend_name, factory=None, tokenizer=None,
                               vllm=engine)
    # An engine (vllm) serves each worker's own items (tensor 1); the rank variables are
    # the worker group's own (Ray Train's); the name makes its shared memory this process's.
    backend = backends.create(backend_name, Setup(model=spec, device=device,
                                                  ident=f"judge-{os.getpid()}"))
    backend.serve(model, folder, None, js.model)
    if callable(getattr(backend, "close", None)):
        # the engine holds the judge's weights and generates: transformers' copy goes now
        backend.release()
    return JudgeModel(backend, tok)


def release(backend) -> None:
    """Let go of a backend's model, and shut its engine down (its memory freed): the
    evaluated model before a judge loads, a judge once it has graded."""
    backend.release()
    closing = getattr(backend, "close", None)
    if callable(closing):
        closing()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
