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


def states_below(folder) -> int:
    """The boundary of the one cell kept in progress under ``folder/out/states`` (0: none)."""
    import pyarrow.parquet as pq

    d = folder / "out" / "states"
    files = [p for p in d.iterdir() if not p.name.startswith(".")] if d.is_dir() else []
    if not files:
        return 0
    try:
        return int(pq.read_schema(files[0]).metadata[b"scored_below"])
    except (OSError, KeyError, ValueError):      # being replaced: read it again
        return 0


def rows_scored(count) -> int:
    return sum(int(n) for p in count.iterdir() for n in p.read_text().split())


def killed_after_a_save(folder, sweep, above: int, count, workers: int) -> str:
    """Run ``sweep`` on ``workers`` workers, SIGKILL the driver's process group once the cell
    in progress is kept beyond bucket ``above``, wait until every process of the run is gone;
    its output."""
    with open(sweep) as f:
        text = f.read()
    with open(sweep, "w") as f:
        f.write(text.replace("workers: 2", f"workers: {workers}")
                .replace("workers: 3", f"workers: {workers}")
                .replace("workers: 1", f"workers: {workers}"))
    log_path = folder / f"killed-{workers}.log"
    marker = f"resume-cell-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, RAYEVAL_TEST_MARKER=marker, TRAP_COUNT=str(count))
    with open(log_path, "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "rayeval", "run", sweep],
                               cwd=str(folder), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, env=env)
        try:
            deadline = time.monotonic() + 240
            while states_below(folder) <= above and run.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.02)
            assert states_below(folder) > above, log_path.read_text()
        finally:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(30)
    deadline = time.monotonic() + 180
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with(marker), "the killed run's processes are still alive"
    return log_path.read_text()


def test_a_cell_killed_mid_way_resumes_on_1_and_3_workers_bit_for_bit(tmp_path):
    """One long cell (about 14 s of batches on 2 workers), kept every second: the driver
    SIGKILLed after a save on 2 workers, again on 1, then finished on 3. Each run scores only
    the rows left, and the cell equals an uninterrupted run's: figures, intervals and
    per-item records, bit for bit. (The killed runs' workers outlive their driver by a
    second or two and may keep the cell once more: the boundaries are read once they are
    gone; the runs on 2 and 1 workers leave seconds of batches after the kill.)"""
    from rayeval.core.evaluate import ROWS
    from rayeval.io.store import states as store_states

    N = 6000      # rows: the first segments take about 49 times a segment's fixed cost
    write_model_module(str(tmp_path))
    x, y = make_data(6000, seed=7)
    write_parquet(str(tmp_path / "data.parquet"), x, y, row_group_size=500)
    (tmp_path / "ckpts").mkdir()
    torch.save(build_model(seed=3).state_dict(), tmp_path / "ckpts" / "step_3.pt")
    model = {"factory": "tiny_models:Trap",
             "kwargs": {"trap": str(tmp_path / "no-trap"), "delay": 0.3}}
    sweep = write_sweep(str(tmp_path), workers=2, model=model, resume={"every": 1})
    store = ResultStore(str(tmp_path / "out"))
    counts = [tmp_path / f"count-{i}" for i in range(3)]
    for c in counts:
        c.mkdir()

    killed_after_a_save(tmp_path, sweep, 0, counts[0], workers=2)
    first = states_below(tmp_path)
    (key,) = store_states.saved(store, [p.stem for p in (tmp_path / "out" / "states").iterdir()])
    kept = int(store_states.read(store, key)[0][ROWS])
    assert 0 < kept < N and not results(tmp_path)

    out = killed_after_a_save(tmp_path, sweep, first, counts[1], workers=1)
    assert f"1 cell resumed from {kept / N:.0%} of their rows" in out, out
    again = int(store_states.read(store, key)[0][ROWS])
    assert kept < again < N and not results(tmp_path)
    # the second run scored from the first one's boundary: no row below it again (the Trap
    # counts a batch's distinct rows; a few rows run padded, ``backends.torch.MIN_ROWS``)
    assert rows_scored(counts[1]) <= N - kept + 40

    with open(sweep) as f:
        text = f.read().replace("workers: 1", "workers: 3")
    with open(sweep, "w") as f:
        f.write(text)
    last = rayeval_cli("run", sweep, cwd=str(tmp_path),
                       env=dict(os.environ, TRAP_COUNT=str(counts[2])))
    assert last.returncode == 0, (last.stdout, last.stderr)
    assert f"1 cell resumed from {again / N:.0%} of their rows" in last.stderr
    assert N - again <= rows_scored(counts[2]) <= N - again + 40, \
        "only the rows left are scored"
    assert not (tmp_path / "out" / "states").exists() or \
        not list((tmp_path / "out" / "states").iterdir()), "kept states go once published"

    plain = write_sweep(str(tmp_path), name="plain.yaml", output="plain", resume={"every": 0},
                        model={"factory": "tiny_models:Trap",
                               "kwargs": {"trap": str(tmp_path / "no-trap")}})
    ref = rayeval_cli("run", plain, cwd=str(tmp_path))
    assert ref.returncode == 0, (ref.stdout, ref.stderr)

    def cell(location):
        s = ResultStore(location)
        rows = latest_rows(s.read())
        values = {r["metric"]: (r["value"], r["ci_low"], r["ci_high"], r["num_samples"])
                  for r in rows}
        records = s.read_samples(rows[0]["cell"], rows[0]["samples"]).sort_by("id")
        return values, records, rows[0]["samples"]

    got, got_records, tags = cell(str(tmp_path / "out"))
    want, want_records, _ = cell(str(tmp_path / "plain"))
    assert got == want                                     # exact: integer states
    assert got_records.num_rows == N and got_records.equals(want_records)
    assert len(set(got_records["id"].to_pylist())) == N
    assert len(tags.split("+")) > 3              # segments of three runs
    for metric, value in reference_metrics(build_model(seed=3), x, y).items():
        assert got[metric][0] == pytest.approx(value, rel=1e-9)
