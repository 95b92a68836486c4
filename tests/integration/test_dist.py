"""Tier 2: the one all-reduce of states, in a real 2- and 3-process gloo group; a DCP checkpoint
written by two gloo ranks (replicated and FSDP2) loads as the model it was saved from."""


import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from rayeval.io.loading import load_into
from support import build_model


def _worker(rank: int, world: int, rendezvous: str, out: str) -> None:
    import torch.distributed as tdist

    from rayeval.execution.workers import dist

    tdist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                             world_size=world)
    try:
        states = {
            "counts": torch.arange(4, dtype=torch.int64) * (rank + 1),
            "sum": torch.tensor(0.25 * (rank + 1), dtype=torch.float64),
            "big": torch.tensor(2**52 + rank, dtype=torch.int64),
            "matrix": torch.full((2, 3), rank, dtype=torch.int64),
            "negative": torch.tensor([-(2**40) - rank, -3], dtype=torch.int64),
        }
        merged = dist.all_reduce_states(states)
        flags = dist.all_reduce_max([float(rank == 1), 0.0])
        if rank == 0:
            torch.save({"merged": merged, "flags": flags, "world": dist.world_size()}, out)
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_all_reduce_states_sums_and_keeps_dtypes(tmp_path, world):
    out = str(tmp_path / "out.pt")
    mp.start_processes(_worker, args=(world, str(tmp_path / "rdzv"), out), nprocs=world,
                       join=True, start_method="spawn")
    got = torch.load(out)
    m = got["merged"]
    total = sum(r + 1 for r in range(world))
    assert torch.equal(m["counts"], torch.arange(4) * total)
    assert m["counts"].dtype == torch.int64 and m["sum"].dtype == torch.float64
    assert m["sum"].item() == 0.25 * total
    assert m["big"].item() == world * 2**52 + sum(range(world))   # exact beyond 2**53
    assert torch.equal(m["matrix"], torch.full((2, 3), sum(range(world))))
    assert m["negative"].tolist() == [-world * 2**40 - sum(range(world)), -3 * world]
    assert got["flags"] == [1.0, 0.0] and got["world"] == world


def test_without_a_process_group_it_is_the_identity():
    from rayeval.execution.workers import dist

    states = {"a": torch.tensor([1, 2]), "b": torch.tensor(0.5, dtype=torch.float64)}
    merged = dist.all_reduce_states(states)
    assert torch.equal(merged["a"], states["a"]) and merged["b"].item() == 0.5
    assert dist.all_reduce_max([0.0, 1.0]) == [0.0, 1.0]
    assert (dist.rank(), dist.world_size()) == (0, 1)


def test_a_failed_sync_says_who_and_how_long_and_never_blames_the_waiter():
    from rayeval.execution.workers.dist import explain

    barrier = "Ranks 1 failed to pass monitoredBarrier in 5000 ms"
    text = explain(barrier, "the load of a.pt", 5, me=0, waited_s=5.2)
    assert text.startswith("worker rank 1 did not reach the load of a.pt; the others waited 5 s")
    assert "stalled; recovery.stall_timeout_s" in text
    early = explain("[gloo] Connection closed by peer from rank 0", "the load of a.pt", 600,
                    me=1, waited_s=2.0)
    assert "waited 2 s" in early and "600" not in early and "stopped or died" in early
    self_named = explain("... from rank 0 ...", "the load of a.pt", 600, me=0, waited_s=1.0)
    assert "worker rank 0 did not reach" not in self_named


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _dcp_writer(rank: int, world: int, rendezvous: str, path: str, fsdp: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    try:
        model = build_model(seed=1)
        if fsdp:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            state = get_model_state_dict(model)
        else:
            state = model.state_dict()
        dcp.save({"model": state}, checkpoint_id=path)
        dist.barrier()          # let both ranks finish writing before gloo is torn down
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "replicated"])
def test_dcp_written_by_two_gloo_ranks(tmp_path, fsdp):
    import torch.multiprocessing as mp

    path = str(tmp_path / "step_20")
    mp.start_processes(_dcp_writer, args=(2, str(tmp_path / "rdzv"), path, fsdp), nprocs=2,
                       join=True,
                       start_method="spawn")
    assert sorted(f for f in os.listdir(path) if f.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    target = build_model(seed=2)
    load_into(target, path)
    assert same_weights(build_model(seed=1), target)
