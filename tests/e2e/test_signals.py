"""End to end: SIGTERM to rayeval, and SIGINT to its whole process group (a terminal's Ctrl-C),
stop a real run cleanly: one line, exit 128 + signal, complete cells kept, nothing
half-written, and no Ray process of the run left behind."""

import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch

from support import build_model, make_data, write_model_module, write_source, write_sweep

pytestmark = pytest.mark.ray


def ray_processes(session: int) -> set[int]:
    """Pids of Ray's own daemons and workers in the session ``session``: the run's, which it
    starts in a session of its own that Ray's processes inherit (orphans keep it), not those
    of another Ray on the machine (a second test run beside this one failed the check)."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True,
                         text=True).stdout
    pids = set()
    for line in out.splitlines():
        pid, sid, args = (line.strip().split(None, 2) + ["", ""])[:3]
        if int(sid) == session and ("gcs_server" in args or "/raylet" in args or
                                    args.startswith("ray::") or "default_worker.py" in args):
            pids.add(int(pid))
    return pids


def results(folder) -> list:
    d = folder / "out" / "results"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# Under CI=true this used to end about one run in two with SIGSEGV (exit -11) or a SIGINT
# nobody sent, while the run read its data through a Ray Data pipeline (72d15b4 still does so,
# 1 case in 8 here). With the direct reads that replaced it, 30 cases in a row passed here,
# idle and with both cores loaded, so the test is strict again: a recurrence must fail CI.
# Each source: local parquet read directly, and every Ray Data pipeline (a transform stage on
# parquet, JSON lines, CSV with a transform stage, a Hugging Face folder), whose teardown is
# where the SIGSEGV used to come from.
@pytest.mark.parametrize("source,signum,group", [
    ("parquet", signal.SIGTERM, False), ("parquet", signal.SIGINT, True),
    ("parquet_ray_data", signal.SIGTERM, False), ("jsonl", signal.SIGINT, True),
    ("csv", signal.SIGTERM, False), ("hf", signal.SIGINT, True)])
def test_a_signal_stops_the_run_cleanly(tmp_path, source, signum, group):
    write_model_module(str(tmp_path))
    x, y = make_data(3000, seed=1)
    dataset = write_source(str(tmp_path), source, x, y)
    (tmp_path / "ckpts").mkdir()
    for s in range(1, 7):
        torch.save(build_model(seed=s).state_dict(), tmp_path / "ckpts" / f"step_{s}.pt")
    model = {"factory": "tiny_models:Trap",        # a slow model: the run is still going
             "kwargs": {"trap": str(tmp_path / "never"), "delay": 0.15}}
    sweep = write_sweep(str(tmp_path), model=model, workers=2, batch_size=100, dataset=dataset)
    proc = subprocess.Popen([sys.executable, "-m", "rayeval", "run", sweep], cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not [n for n in results(tmp_path) if not n.startswith(".")]:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no cell was finished in time"
            time.sleep(0.2)
        assert ray_processes(proc.pid), "the run's own Ray is seen (so its absence means one)"
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signum, (proc.returncode, stderr[-2000:])
    name = signal.Signals(signum).name
    assert stderr.rstrip().splitlines()[-1].startswith(f"[rayeval] interrupted ({name}): "
                                                       "stopped; every result written so far")
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr[-2000:]
    assert "Segmentation fault" not in stderr
    kept = results(tmp_path)
    assert 1 <= len(kept) < 6, "interrupted mid-sweep"
    assert not [n for n in kept if n.startswith(".")], "no temporary file left"
    for n in kept:                                   # every kept cell is complete
        assert pq.read_table(tmp_path / "out" / "results" / n).num_rows == 3
    deadline = time.monotonic() + 30                 # Ray's daemons exit a moment after
    while ray_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_processes(proc.pid), "no Ray process of the run is left"
