"""Tier 2: the one all-reduce of states, in a real 2- and 3-process gloo group."""


import pytest
import torch
import torch.multiprocessing as mp


def _worker(rank: int, world: int, rendezvous: str, out: str) -> None:
    import torch.distributed as tdist

    from rayeval.execution import dist

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
    from rayeval.execution import dist

    states = {"a": torch.tensor([1, 2]), "b": torch.tensor(0.5, dtype=torch.float64)}
    merged = dist.all_reduce_states(states)
    assert torch.equal(merged["a"], states["a"]) and merged["b"].item() == 0.5
    assert dist.all_reduce_max([0.0, 1.0]) == [0.0, 1.0]
    assert (dist.rank(), dist.world_size()) == (0, 1)


def test_a_failed_sync_says_who_and_how_long_and_never_blames_the_waiter():
    from rayeval.execution.dist import explain

    barrier = "Ranks 1 failed to pass monitoredBarrier in 5000 ms"
    text = explain(barrier, "the load of a.pt", 5, me=0, waited_s=5.2)
    assert text.startswith("worker rank 1 did not reach the load of a.pt; the others waited 5 s")
    assert "stalled; recovery.stall_timeout_s" in text
    early = explain("[gloo] Connection closed by peer from rank 0", "the load of a.pt", 600,
                    me=1, waited_s=2.0)
    assert "waited 2 s" in early and "600" not in early and "stopped or died" in early
    self_named = explain("... from rank 0 ...", "the load of a.pt", 600, me=0, waited_s=1.0)
    assert "worker rank 0 did not reach" not in self_named
