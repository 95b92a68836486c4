"""Collectives, in one place. Without a process group every function is the identity, so
the same evaluation code runs in one process (tests, the reference loop) and in a worker group.

Only this module imports torch.distributed for communication.
"""

from __future__ import annotations

import contextlib
import re
import time
from datetime import timedelta

import torch
import torch.distributed as tdist

from rayeval.errors import WorkerGroupError


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


_monitor = {}   # the gloo group that monitored barriers use when the main group is NCCL


def _monitor_group():
    if tdist.get_backend() == "gloo":
        return None
    if "group" not in _monitor:        # collective: every rank gets here at its first sync
        _monitor["group"] = tdist.new_group(backend="gloo")
    return _monitor["group"]


def sync(what: str, timeout_s: float) -> None:
    """Wait until every rank reaches ``what``, at most ``timeout_s`` seconds.

    A rank that died or stalls fails every rank with a WorkerGroupError naming it, instead of
    leaving the others blocked in the next collective."""
    if not is_distributed():
        return
    with _named(what, timeout_s):
        tdist.monitored_barrier(group=_monitor_group(), timeout=timedelta(seconds=timeout_s),
                                wait_all_ranks=True)


@contextlib.contextmanager
def _named(what: str, timeout_s: float):
    """Turn a failed collective into a WorkerGroupError that says which rank, where, and how long
    this rank really waited."""
    began = time.monotonic()
    try:
        yield
    except RuntimeError as e:          # DistBackendError and gloo's errors are RuntimeErrors
        raise WorkerGroupError(explain(str(e), what, timeout_s, rank(),
                                 time.monotonic() - began)) from None


def explain(message: str, what: str, timeout_s: float, me: int,
            waited_s: float | None = None) -> str:
    """A one-line account of a failed barrier or collective, from torch's message. It says the
    time waited, which is the limit only when the peer stalled (a dead peer fails it sooner),
    and never names this rank as the one it waited for."""
    waited = timeout_s if waited_s is None else waited_s
    stalled = waited >= 0.9 * timeout_s
    why = ("stalled; recovery.stall_timeout_s sets the limit" if stalled
           else "it stopped or died before getting there; see the worker logs")
    late = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    if late:
        ranks = [r.strip() for r in late.group(1).split(",") if r.strip() and r.strip() != str(me)]
        if ranks:
            return (f"worker rank {', '.join(ranks)} did not reach {what}; the others waited "
                    f"{waited:.0f} s ({why})")
    if "from rank 0" in message and me != 0:
        return (f"worker rank 0 did not reach {what}; worker rank {me} waited {waited:.0f} s "
                f"({why})")
    if "closed by peer" in message or "Connection reset" in message:
        return f"worker rank {me} lost a peer at {what}: another worker died"
    first = next((ln.strip() for ln in message.splitlines() if ln.strip()), message)
    return f"worker rank {me} failed a collective at {what}: {first[:300]}"


def all_reduce_max(values: list[float], what: str = "a sync point",
                   timeout_s: float = 1800) -> list[float]:
    """Element-wise max over ranks (flags: any rank set one)."""
    t = torch.tensor(values, dtype=torch.float64)
    if is_distributed():
        t = t.to(_comm_device())
        with _named(what, timeout_s):
            tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.cpu().tolist()


_SPLIT = 26   # integer states travel as two float64 halves: x = hi * 2**26 + lo


def all_reduce_states(states: dict[str, torch.Tensor], what: str = "a sync point",
                      timeout_s: float = 1800) -> dict[str, torch.Tensor]:
    """Sum every state over ranks in ONE all-reduce; returns new CPU tensors, dtypes kept.

    All states travel in one float64 vector. An integer state is sent as two halves
    (``x >> 26`` and ``x & (2**26 - 1)``), each summed exactly in float64, so integer sums are
    exact for any int64 values and any world size, whatever order the reduction takes."""
    keys = sorted(states)
    parts = []
    for k in keys:
        t = states[k].detach().reshape(-1).cpu()
        if t.dtype.is_floating_point:
            parts.append(t.to(torch.float64))
        else:
            t = t.to(torch.int64)
            parts += [(t >> _SPLIT).to(torch.float64),
                      (t & ((1 << _SPLIT) - 1)).to(torch.float64)]
    flat = torch.cat(parts)
    if is_distributed():
        flat = flat.to(_comm_device())
        with _named(what, timeout_s):
            tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
        flat = flat.cpu()
    out, offset = {}, 0
    for k in keys:
        t = states[k]
        n = t.numel()
        if t.dtype.is_floating_point:
            piece = flat[offset:offset + n]
            offset += n
        else:
            hi = flat[offset:offset + n].to(torch.int64)
            lo = flat[offset + n:offset + 2 * n].to(torch.int64)
            piece = (hi << _SPLIT) + lo
            offset += 2 * n
        out[k] = piece.reshape(t.shape).to(t.dtype)
    return out


def replica_mesh(shard: int):
    """The 2-D device mesh of a sharded run: ``world / shard`` replicas x ``shard`` ranks,
    consecutive ranks forming a replica (they are most often on one node). Collective: every
    rank calls it once. Returns the 1-D ``shard`` sub-mesh of this rank's replica."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(_comm_device().type, (world_size() // shard, shard),
                            mesh_dim_names=("replicate", "shard"))
    return mesh["shard"]


def group_sum(value: int, group, what: str, timeout_s: float) -> int:
    """The sum of one integer over the ranks of ``group`` (a replica's lockstep flag)."""
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    with _named(what, timeout_s):
        tdist.all_reduce(t, op=tdist.ReduceOp.SUM, group=group)
    return int(t.item())


def broadcast(value, what: str, timeout_s: float):
    """Rank 0's ``value`` (any picklable object) on every rank."""
    if not is_distributed():
        return value
    box = [value]
    with _named(what, timeout_s):
        tdist.broadcast_object_list(box, src=0, device=_comm_device())
    return box[0]
