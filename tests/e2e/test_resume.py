"""Tier 4: the driver killed mid-sweep (SIGKILL to its whole process group, as when a pod is
preempted) and the same command run again: finished cells are kept as they are, the rest are
evaluated, and the numbers are those of an undisturbed run."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rayeval.ranking import latest_rows
from rayeval.io.store import ResultStore
from support import (build_model, make_data, rayeval_cli, reference_metrics, write_model_module,
                     write_parquet, write_sweep)

pytestmark = pytest.mark.ray

SEEDS = tuple(range(1, 11))


def results(folder):
    d = folder / "out" / "results"
    if not d.is_dir():
        return {}
    return {p.name: p.stat().st_mtime_ns for p in d.iterdir() if not p.name.startswith(".")}


def processes_with(marker):
    """The ids of live processes whose environment holds the marker (Linux /proc)."""
    needle = f"RAYEVAL_TEST_MARKER={marker}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{pid}/stat") as stat:
                        if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                            found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_killed_driver_is_resumed_by_running_the_same_command(tmp_path):
    write_model_module(str(tmp_path))
    x, y = make_data(4000, seed=7)
    write_parquet(str(tmp_path / "data.parquet"), x, y, row_group_size=500)
    (tmp_path / "ckpts").mkdir()
    for s in SEEDS:
        torch.save(build_model(seed=s).state_dict(), tmp_path / "ckpts" / f"step_{s}.pt")
    # 20 ms a batch: about 1.3 s a checkpoint, so the kill lands mid-sweep.
    sweep = write_sweep(str(tmp_path), workers=2, model={
        "factory": "tiny_models:Trap",
        "kwargs": {"trap": str(tmp_path / "no-trap"), "delay": 0.02}})
    log = open(tmp_path / "first.log", "w")
    marker = f"resume-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, RAYEVAL_TEST_MARKER=marker)
    first = subprocess.Popen([sys.executable, "-m", "rayeval", "run", sweep], cwd=str(tmp_path),
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             env=env)
    try:
        deadline = time.monotonic() + 240
        while not results(tmp_path) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert results(tmp_path), (tmp_path / "first.log").read_text()
    finally:
        os.killpg(first.pid, signal.SIGKILL)       # the driver and the Ray it started
        first.wait(30)
        log.close()
    # Ray's worker processes live in their own process groups and may publish a cell or two
    # before they notice that the driver and its cluster are gone: wait until every process
    # that inherited the marker has ended (an event, not a quiet period a slow machine overruns).
    deadline = time.monotonic() + 180
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with(marker), "the killed run's processes are still alive"
    kept = results(tmp_path)
    assert 1 <= len(kept) < len(SEEDS), "killed mid-sweep"

    again = rayeval_cli("run", sweep, cwd=str(tmp_path))
    assert again.returncode == 0, (again.stdout, again.stderr)
    assert (f"{len(SEEDS)} cell(s), {len(kept)} already in the store, "
            f"{len(SEEDS) - len(kept)} to evaluate") in again.stderr
    # The killed run's cells are untouched; the second run moved its own into a part.
    assert results(tmp_path) == kept, "finished cells untouched"
    stored = {r["cell"] for r in ResultStore(str(tmp_path / "out")).read(["cell"]).to_pylist()}
    assert len(stored) == len(SEEDS)
    assert not [p for p in (tmp_path / "out" / "results").iterdir() if p.name.startswith(".")]
    got = {(os.path.basename(r["checkpoint"]), r["metric"]): r
           for r in latest_rows(ResultStore(str(tmp_path / "out")).read())}
    assert len(got) == len(SEEDS) * 3
    for s in SEEDS:
        for metric, value in reference_metrics(build_model(seed=s), x, y).items():
            assert got[(f"step_{s}.pt", metric)]["value"] == pytest.approx(value, rel=1e-9)
