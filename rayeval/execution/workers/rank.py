"""What one rank of the worker group is: its place in the group, its device, its deadline for
a sync point, the run ledger's client, its timer, and what it says of a cell that failed.

The worker's parts (``checkpoints.CheckpointLoop``, ``scorer.CellScorer``, the sinks of
``sinks``) each hold this context and nothing of each other's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
import ray.train
import ray.train.torch
import torch

from rayeval.execution import recovery
from rayeval.execution.ledger import WorkerLedger
from rayeval.execution.profile import Timer
from rayeval.plan.cells import Cell, CellOutcome


@dataclass
class RankContext:
    rank: int
    world: int
    local_rank: int
    local_world: int
    tensor: int                   # consecutive ranks that serve one engine (see the same rows)
    device: torch.device
    timeout: float                # recovery.stall_timeout_s: a sync point's deadline
    attempt: int                  # the worker group's attempt (a restart opens the next)
    ledger: WorkerLedger
    timer: Timer
    baseline: int                 # peak resident memory before anything was loaded
    details: dict[str, str | None] = field(default_factory=dict)   # cell -> user traceback

    @classmethod
    def of_ray_train(cls, ledger: WorkerLedger, attempt: int, timer: Timer, tensor: int,
                     timeout: float) -> "RankContext":
        ctx = ray.train.get_context()
        return cls(rank=ctx.get_world_rank(), world=ctx.get_world_size(),
                   local_rank=ctx.get_local_rank(), local_world=ctx.get_local_world_size(),
                   tensor=tensor, device=ray.train.torch.get_device(), timeout=timeout,
                   attempt=attempt, ledger=ledger, timer=timer, baseline=peak_rss())

    @property
    def replica(self) -> tuple[int, int]:
        """(this rank's replica, the replicas): an engine's ranks are one replica."""
        return self.rank // self.tensor, self.world // self.tensor

    def counted(self, rows: int) -> int:
        """Rows this rank reports: an engine's other ranks see its first rank's rows."""
        return 0 if self.rank % self.tensor else rows

    def mark(self, phase: str, where: str) -> None:
        """Tell the ledger where this rank is (an error after its loss says it), then the
        test hook's fault point (``recovery.fault_point``), which waits for that word."""
        said = self.ledger.phase(where)
        recovery.fault_point(phase, self.rank, self.ledger.attempt,
                             before=lambda: said is not None and ray.get(said, timeout=10))

    def failure(self, cell: Cell, step, message: str) -> CellOutcome:
        """A cell's failed outcome, with this rank's traceback of it for --debug."""
        return CellOutcome(key=cell.key, checkpoint=cell.checkpoint.location,
                           evaluation=cell.evaluation, step=step, error=message,
                           detail=self.details.get(cell.key), attempt=self.attempt)


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
