"""Backends: what turns a task's requests into numbers for one kind of model.

    base    the request types, the ``Context`` a pass scores in, the ``Backend`` interface
            and the ``BACKENDS`` registry
    torch   any torch module: forward, log-likelihoods, greedy decoding (no cache)
    hf      ``model.backend: hf``: torch's, with Hugging Face's cached ``generate`` and
            shared-prefix log-likelihoods (``prefix``: a token trie over the requests)
    vllm    ``model.backend: vllm``: a vLLM engine per worker generates

A new backend is one module holding a ``Backend`` subclass registered with
``@BACKENDS.register()`` (see docs/backends.md). Importing this package imports torch but
neither Ray nor vLLM nor transformers.
"""

from rayeval.core.backends.base import (BACKENDS, Backend, Context, ImageRequest, Inputs, Setup,
                                        TokenPair, wrong_output)
from rayeval.core.backends import hf, vllm  # noqa: F401  (registers hf, vllm)
from rayeval.core.backends.torch import TorchBackend


def get(name: str) -> type[Backend]:
    """The backend class called ``name``; a RegistryError listing the backends if none."""
    return BACKENDS.get(name)


def create(name: str, setup: Setup | None = None) -> Backend:
    """A worker's backend for the sweep (it serves each checkpoint's model in turn)."""
    return get(name)(setup)


def of_model(model, device=None) -> Backend:
    """A model as the default backend (hf), serving it now: the single-process paths."""
    import torch

    backend = create("hf", Setup(device=torch.device(device or "cpu")))
    backend.serve(model)
    return backend


__all__ = ["BACKENDS", "Backend", "Context", "ImageRequest", "Inputs", "Setup", "TokenPair", "TorchBackend",
           "create", "get", "of_model", "wrong_output"]
