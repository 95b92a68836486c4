"""The units of a model sharded over several workers (``parallelism: {shard: N}``): which
submodules FSDP2 gathers one at a time (``units``), and a vision-language model's image encoder,
which stays with the root (``towers``). Plain torch, no process group: the plan checks
``parallelism.wrap`` against the model on the meta device with ``units`` before Ray starts, and
``execution.workers.sharding`` shards by it on the workers."""

from __future__ import annotations

from rayeval.errors import ModelError
from rayeval.io.loading import few
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


def units(model: torch.nn.Module, wrap: tuple[str, ...] = ()) -> list[torch.nn.Module]:
    """The submodules sharded as units (all-gathered one at a time in a forward pass): the
    classes ``wrap`` names, else a Hugging Face model's ``_no_split_modules`` (its decoder
    layers), else the entries of the model's ModuleLists (blocks); the outermost only.

    Never a module inside a vision-language model's image encoder (``towers``): it runs only
    in the forward passes of items with images, not in decoding steps nor idle forwards, and
    every forward pass of a replica's ranks must gather the same units in the same order
    (else gloo aborts: "collective mismatch"). The encoder stays with the root, whole
    during each forward pass, as the embeddings are."""
    names = set(wrap) or set(getattr(model, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if wrap and not found:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ModelError(f"parallelism.wrap: the model has no module of class "
                             f"{few(sorted(names))}; its classes: {few(classes, 12)}")
    else:
        found = [c for m in model.modules() if isinstance(m, torch.nn.ModuleList)
                 for c in m.children()]
    inner: set[int] = set()
    for m in found:
        inner.update(id(d) for d in m.modules() if d is not m)
    for tower in towers(model):
        inner.update(id(d) for d in tower.modules())
    kept = [m for m in found if id(m) not in inner]
    if wrap and not kept:
        raise ModelError(f"parallelism.wrap: {few(sorted(names))} only name modules of the "
                         f"model's image encoder, which runs only on items with images; name "
                         f"the text model's layers (or drop parallelism.wrap)")
    return kept


def towers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A Hugging Face multimodal model's encoders of other inputs than text (its vision
    tower): the outermost submodules whose config is of one of the root config's sub-configs
    other than ``text_config``. None for other models."""
    config = getattr(model, "config", None)
    keys = [k for k in (getattr(config, "sub_configs", None) or {}) if k != "text_config"]
    kinds = {getattr(getattr(config, k, None), "model_type", None) for k in keys} - {None}
    found: list[torch.nn.Module] = []
    inner: set[int] = set()
    for m in model.modules() if kinds else ():          # outermost first
        if m is not model and id(m) not in inner and \
                getattr(getattr(m, "config", None), "model_type", None) in kinds:
            found.append(m)
            inner.update(id(d) for d in m.modules())
    return found
