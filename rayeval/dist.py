"""Collectives, in one place. Without a process group every function is the identity, so
the same evaluation code runs in one process (tests, the reference loop) and in a worker group.

Only this module imports torch.distributed for communication.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist


def is_distributed() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    return tdist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return tdist.get_world_size() if is_distributed() else 1


def _comm_device() -> torch.device:
    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
    if is_distributed() and tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(values: list[float]) -> list[float]:
    """Element-wise max over ranks (flags: any rank set one)."""
    t = torch.tensor(values, dtype=torch.float64)
    if is_distributed():
        t = t.to(_comm_device())
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.cpu().tolist()


def all_reduce_states(states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum every state over ranks in ONE all-reduce; returns new CPU tensors, dtypes kept.

    States are packed into one float64 vector. Integer states stay exact while their sums are
    below 2**53 (9e15), far beyond any evaluation's counts."""
    keys = sorted(states)
    flat = torch.cat([states[k].detach().reshape(-1).to("cpu", torch.float64) for k in keys])
    if is_distributed():
        flat = flat.to(_comm_device())
        tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
        flat = flat.cpu()
    out, offset = {}, 0
    for k in keys:
        t = states[k]
        n = t.numel()
        piece = flat[offset:offset + n].reshape(t.shape)
        if not t.dtype.is_floating_point:
            piece = piece.round()
        out[k] = piece.to(t.dtype)
        offset += n
    return out
