"""One rank of the sharded-loading check, started by ``torchrun`` from tests/integration/test_sharded.py.

Every rank builds the same tiny models, rank 0 writes their checkpoints in each layout (and a
DCP checkpoint written by all ranks through FSDP2 over the whole world, so it is read back at
another sharding), then for N in (2, world) each rank loads them with ``ShardedLoader`` on
``world / N`` replicas of N ranks and runs its own, uneven batches through the model in
``Lockstep``. It writes what it saw to OUT/rank<r>.json: the largest difference from the
unsharded model's outputs, the parameter elements it holds, idle forwards.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as tdist
from torch import nn

from rayeval.execution.workers import dist
from rayeval.io.loading import LeanLoader
from rayeval.config.schema import Parallelism
from rayeval.execution.workers.sharding import Lockstep, ShardedLoader, shard


class TinyLM(nn.Module):
    """Embedding, a ModuleList of blocks (the units), a head tied to the embedding, a
    non-persistent buffer (rebuilt, not loaded) and a persistent one (loaded)."""

    def __init__(self, vocab=37, width=12, blocks=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width),
                                                  nn.GELU(), nn.Linear(2 * width, width))
                                    for _ in range(blocks))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5), persistent=True)
        self.register_buffer("offsets", torch.arange(width, dtype=torch.float32) / 100,
                             persistent=False)

    def forward(self, ids):
        h = self.embed(ids) + self.offsets
        for block in self.blocks:
            h = h + block(h) * self.scale
        return self.head(h)


def write_checkpoints(folder: str, model: nn.Module) -> dict[str, str]:
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k != "head.weight"}                       # tied: saved once, as HF does
    paths = {"torch": os.path.join(folder, "model.pt"),
             "safetensors": os.path.join(folder, "model.safetensors")}
    torch.save({"model": state}, paths["torch"])
    save_file(state, paths["safetensors"])
    sharded = os.path.join(folder, "hf-sharded")
    os.makedirs(sharded, exist_ok=True)
    keys = sorted(state)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, os.path.join(sharded, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    paths["safetensors-sharded"] = sharded
    return paths


def write_dcp(folder: str, reference: nn.Module) -> str:
    """A DCP checkpoint written by every rank of the world from an FSDP2 model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    with torch.device("meta"):
        model = TinyLM()
    shard(model, mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if hasattr(v, "to_local"):
                start, stop = _rows(v.shape[0], mesh.size(), mesh.get_local_rank())
                v.to_local().copy_(reference.state_dict()[k][start:stop])
            else:
                v.copy_(reference.state_dict()[k])
    path = os.path.join(folder, "dcp")
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    return path


def _rows(n, parts, index):
    from rayeval.execution.workers.sharding import rows_of

    return rows_of(n, parts, index)


def main(out: str) -> None:
    tdist.init_process_group("gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    torch.manual_seed(0)
    reference = TinyLM().eval()
    folder = os.path.join(out, "checkpoints")
    if rank == 0:
        os.makedirs(folder, exist_ok=True)
        paths = write_checkpoints(folder, reference)
    tdist.barrier()
    if rank != 0:
        paths = {"torch": os.path.join(folder, "model.pt"),
                 "safetensors": os.path.join(folder, "model.safetensors"),
                 "safetensors-sharded": os.path.join(folder, "hf-sharded")}
    paths["dcp"] = write_dcp(folder, reference)
    tdist.barrier()

    # Uneven work: rank r runs r + 1 batches of different lengths.
    g = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, 37, (2 + r, 3 + 2 * r), generator=g) for r in range(rank + 1)]
    with torch.inference_mode():
        expected = [reference(b) for b in batches]
    total = sum(p.numel() for p in reference.parameters())
    report = {"rank": rank, "world": world, "total_elements": total, "cases": []}
    for n in (2, world):
        base = LeanLoader(TinyLM, torch.device("cpu"))
        mesh = dist.replica_mesh(n)
        loader = ShardedLoader(base, mesh, Parallelism(shard=n))
        for layout, path in sorted(paths.items()):
            model, raw = loader.load(loader.stage(path))
            step = Lockstep(mesh, 60)
            step.attach(model)
            with torch.inference_mode():
                got = [model(b) for b in batches]
            step.drain(model, torch.zeros((1, 1), dtype=torch.int64))
            diff = max(float((a - b).abs().max()) for a, b in zip(got, expected))
            held = sum(p.to_local().numel() for p in model.parameters())
            report["cases"].append({"shard": n, "layout": layout, "read_as": raw.layout,
                                    "max_diff": diff, "held_elements": held,
                                    "forwards": step.forwards, "idle": step.idle_forwards})
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    _finish()


def _finish() -> None:
    """Leave the world cleanly. Without this a rank could tear its groups down (or simply exit)
    while a peer was still in a collective of a replica's group or the mesh's, and gloo's
    threads then met a closed pair at process exit: "terminate called without an active
    exception", SIGABRT, once in CI. Every rank waits for all the others here, then the
    default group and every sub-group (the meshes') are destroyed before the interpreter
    exits, so no gloo thread is left joinable at exit."""
    import gc

    tdist.barrier()
    gc.collect()                                   # the meshes' and loaders' last references
    tdist.destroy_process_group()                  # None: the default group and all others


if __name__ == "__main__":
    main(sys.argv[1])
