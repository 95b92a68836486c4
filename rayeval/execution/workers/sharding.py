"""Models sharded over several workers (``parallelism: {shard: N}``): FSDP2 on a device mesh.

The workers form a 2-D mesh: ``workers / N`` replicas x ``N`` ranks, consecutive ranks making
a replica. Each replica holds one copy of the model sharded over its N ranks with
``fully_shard``: each transformer block (or the classes ``parallelism.wrap`` names) is a unit,
and the root holds the rest (a vision-language model's image encoder included: ``units``).
The model is built on the meta device and every rank allocates and reads only its own rows
of each parameter (FSDP2 shards dim 0):

    dcp                    ``dcp.load`` into the sharded state dict: DCP reshards from any
                           world size and layout that wrote it
    safetensors (+ index)  each tensor's rows are read from the file (``safe_open`` slices)
    torch.save files       memory-mapped; a rank copies (and so touches) only its rows

No rank ever holds the whole model: a forward pass gathers one unit's parameters at a time.

Rows: FSDP only needs the N ranks of a replica to run their forward passes in step (every
forward gathers each unit's parameters over the replica); it does not need them to run on the
same inputs. So every rank still reads its own disjoint shard of the rows (each row is scored
once, by the rank that read it, and counted in that rank's states as before) and
``Lockstep`` keeps the replica's forwards in step: before each forward pass a rank says it has
one; a rank whose rows are done runs a one-row idle forward, whose output is dropped, while a
peer still has work. The replica's N ranks so evaluate N different batches per step, not one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from rayeval import compat
from rayeval.execution.workers import dist
from rayeval.io import layouts
from rayeval.config.schema import CheckpointSpec, Parallelism
from rayeval.errors import CheckpointError, ModelError
from rayeval.io.loading import LeanLoader, aliases, check_fit, few, match, satisfied_by_ties
from rayeval.io.units import towers, units  # noqa: F401 - in io: the plan checks them too


def shard(model: nn.Module, mesh, wrap: tuple[str, ...] = ()) -> nn.Module:
    """Apply FSDP2 to the units, then the root, over ``mesh`` (a replica's ranks). Every unit
    is resharded after its forward: only one is whole at a time."""
    from torch.distributed.fsdp import fully_shard

    for unit in units(model, wrap):
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def encode_images_in_forward(model: nn.Module) -> None:
    """Make Hugging Face's ``generate`` encode images inside the first forward pass.

    transformers 5 encodes them before it (``get_image_features`` called from ``generate``,
    when ``forward`` takes ``mm_encoder_outputs``): outside a forward pass FSDP has not
    gathered the root's parameters (the encoder's: "mixed torch.Tensor and DTensor"), and a
    collective there would be outside ``Lockstep``. Without that keyword ``generate`` hands
    the pixels to the prefill forward, which encodes them itself (the same tokens:
    tests/integration/test_vlm_sharded.py). Models without it are left as they are. The switch
    is transformers' private one: ``compat.no_mm_encoder_outputs``."""
    compat.no_mm_encoder_outputs(model)


def rows_of(length: int, parts: int, index: int) -> tuple[int, int]:
    """The rows [start, stop) of a dimension of ``length`` that shard ``index`` of ``parts``
    holds: FSDP2 cuts dim 0 as ``torch.chunk`` does (equal ceil-sized pieces, the last ones
    shorter or empty)."""
    size = -(-length // parts) if length else 0
    start = min(index * size, length)
    return start, min(start + size, length)


# --- memory --------------------------------------------------------------------------------

def give_back_gathered_memory() -> None:
    """Make the allocator return freed blocks of 1 MiB and more to the system at once.

    A sharded forward pass gathers each unit's parameters and frees them right after. glibc
    raises its mmap threshold to the size of the largest block freed (up to 32 MiB), so units
    under that size come from the heap, and freed heap memory is kept: measured on 24 units
    of 16 MiB over 2 ranks, the peak of a pass was 932 MiB instead of 281 MiB. A fixed
    threshold (``mallopt(M_MMAP_THRESHOLD)``) keeps it at the held shard plus a unit or two.
    glibc only; elsewhere nothing is changed."""
    import ctypes
    import sys

    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 20)           # M_MMAP_THRESHOLD: 1 MiB, fixed from now on
    except (OSError, AttributeError):       # not glibc (musl has no mallopt): leave it
        pass


@dataclass(frozen=True)
class Memory:
    """A worker's weight memory for one model copy over ``shard`` ranks, in bytes."""
    total: int            # the whole model
    shard: int            # N
    resident: int         # what a rank holds between forward passes: total / N
    root: int             # the root's own parameters: whole during a forward pass
    largest_unit: int     # the biggest unit: whole while it runs
    units: int

    @property
    def peak(self) -> int:
        """Weights at the peak of a forward pass: the held shard, the root's own parameters
        and the largest unit twice (its gathered parameters and the gather's output buffer).
        Activations and the process group's buffers come on top."""
        if self.shard == 1:
            return self.total
        return self.resident + self.root + 2 * self.largest_unit


def memory(model: nn.Module, shard_count: int, wrap: tuple[str, ...] = (),
           dtype: torch.dtype | None = None) -> Memory:
    """The weight memory of ``model`` (on the meta device is fine) over ``shard_count`` ranks."""
    def size(params) -> int:
        seen, n = set(), 0
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                width = torch.empty((), dtype=dtype if dtype is not None
                                    and p.is_floating_point() else p.dtype).element_size()
                n += p.numel() * width
        return n

    parts = units(model, wrap)
    inside = {id(p) for u in parts for p in u.parameters()}
    total = size(model.parameters())
    return Memory(total=total, shard=shard_count, resident=math.ceil(total / shard_count),
                  root=size(p for p in model.parameters() if id(p) not in inside),
                  largest_unit=max((size(u.parameters()) for u in parts), default=0),
                  units=len(parts))


# --- loading -------------------------------------------------------------------------------

@dataclass
class Staged:
    """A checkpoint checked against the model on the meta device, before any collective."""
    path: str
    raw: layouts.Raw
    model: nn.Module
    mapping: dict[str, str]        # checkpoint key -> model key
    tied: dict[str, str]


class ShardedLoader:
    """Loads checkpoints into a model sharded over a replica's ranks (see the module
    docstring). ``stage`` reads headers and checks the fit (no collective: a failure is
    agreed on before ``load``, which is collective for DCP)."""

    collective = True

    def __init__(self, base: LeanLoader, mesh, parallelism: Parallelism):
        self.base = base
        self.mesh = mesh
        self.wrap = parallelism.wrap
        self.index = mesh.get_local_rank()
        self.parts = mesh.size()

    @property
    def spec(self) -> CheckpointSpec:
        return self.base.spec

    def stage(self, path: str) -> Staged:
        raw = layouts.read(path, self.spec.trust_pickle, lazy=True)
        model = self.base.meta(path)
        if self.base.dtype is not None:
            _cast(model, self.base.dtype)
        tied = aliases(model)
        try:
            m = match(raw.shapes, model.state_dict(), self.spec)
        except CheckpointError as e:
            raise CheckpointError(f"{raw.path}: {e.message}") from None
        check_fit(raw.path, {mk: raw.shapes[ck][0] for ck, mk in m.mapping.items()}, model)
        units(model, self.wrap)                 # a wrap naming no class fails here, early
        return Staged(path, raw, model, dict(m.mapping), tied)

    def load(self, staged: Staged) -> tuple[nn.Module, layouts.Raw]:
        model, raw = staged.model, staged.raw
        device = self.base.device
        real = {n: b for n, b in model.named_buffers() if not b.is_meta}
        shard(model, self.mesh, self.wrap)
        model.to_empty(device=device)           # this rank's rows only
        for name, value in real.items():        # buffers built real (rotary tables...)
            _set_buffer(model, name, value.to(device))
        state = model.state_dict()
        if raw.layout == "dcp":
            self._load_dcp(raw, {ck: state[mk] for ck, mk in staged.mapping.items()})
        else:
            with torch.no_grad():
                for ck, mk in staged.mapping.items():
                    self._copy(raw, ck, state[mk])
        missing = set(state) - set(staged.mapping.values())
        if missing - satisfied_by_ties(missing, set(staged.mapping.values()), staged.tied):
            raise CheckpointError(f"{staged.path}: keys left unloaded: {few(sorted(missing))}")
        for name, value in self.base.extra_buffers.items():
            _set_buffer(model, name, value.to(device))
        encode_images_in_forward(model)
        return model.eval(), raw

    def _copy(self, raw: layouts.Raw, key: str, target: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(target, DTensor):
            local = target.to_local()
            start, stop = rows_of(target.shape[0], self.parts, self.index)
            if local.shape[0] != stop - start:   # FSDP2 changed how it cuts dim 0
                raise RuntimeError(f"{key}: rank holds {local.shape[0]} rows, expected "
                                   f"{stop - start}; please report this bug")
            part = layouts.read_rows(raw, key, start, stop, out=local)
            if part is not local:
                local.copy_(part)
            layouts.release(raw, key, start, stop)
        else:
            part = layouts.read_rows(raw, key, 0, target.shape[0] if target.dim() else 0,
                                     out=target)
            if part is not target:
                target.copy_(part)

    def _load_dcp(self, raw: layouts.Raw, state: dict[str, torch.Tensor]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.load(state, storage_reader=raw.reader)
        except (Exception, CheckpointException) as e:   # the latter is a BaseException
            raise CheckpointError(f"{raw.path}: cannot read torch.distributed.checkpoint "
                                  f"shards (missing or truncated .distcp file?): "
                                  f"{layouts.dcp_failure(e)}") from None


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters and persistent buffers to ``dtype`` (on the meta device), ties
    kept; buffers outside the state dict keep theirs, as lean loading does."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        params, buffers = compat.own_parameters(module), compat.own_buffers(module)
        for name, p in list(params.items()):
            if p is None or not p.is_floating_point():
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=False)
            params[name] = done[id(p)]
        for name, b in list(buffers.items()):
            if b is not None and b.is_floating_point() and \
                    name not in compat.non_persistent_buffers(module):
                buffers[name] = b.to(dtype)


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    module.register_buffer(attr, value.clone(), persistent=attr not in
                           compat.non_persistent_buffers(module))


# --- forward passes in step ----------------------------------------------------------------

class Lockstep:
    """Keeps the forward passes of a replica's ranks in step (see the module docstring).

    Attached to the root module as its first forward pre-hook, so it runs before FSDP's own:
    every forward pass starts with one small all-reduce over the replica that says how many
    of its ranks have a real batch. ``drain`` runs idle forwards until none has."""

    def __init__(self, mesh, timeout_s: float):
        self.group = mesh.get_group()
        self.timeout = timeout_s
        self.idle = False
        self.recorded = None              # the first real call of this pass: a last resort
        self.forwards = 0                 # real forward passes of this rank (tests)
        self.idle_forwards = 0

    def attach(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self._before, prepend=True, with_kwargs=True)

    def _before(self, module, args, kwargs):
        if self.idle:
            return None
        if self.recorded is None:
            self.recorded = (args, kwargs)
        self.forwards += 1
        dist.group_sum(1, self.group, "a forward pass of the sharded model", self.timeout)
        return None

    def drain(self, model: nn.Module, idle_input) -> None:
        """After this rank's last batch: idle forwards while a peer still runs real ones.
        ``idle_input``: the smallest input the model takes (None: replay the first real call
        of the pass)."""
        from rayeval.core import tasks

        while dist.group_sum(0, self.group, "the end of a pass of the sharded model",
                             self.timeout):
            self.idle = True
            try:
                with torch.inference_mode():
                    if idle_input is not None:
                        tasks.call_model(model, idle_input)
                    elif self.recorded is not None:
                        model(*self.recorded[0], **self.recorded[1])
                    else:
                        raise ModelError("parallelism.shard: a rank with no rows cannot keep "
                                         "the replica in step without an input; with "
                                         "dataset.transform, give every rank rows (fewer "
                                         "workers) or drop parallelism")
            finally:
                self.idle = False
            self.idle_forwards += 1
        self.recorded = None
