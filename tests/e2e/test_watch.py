"""Tier 4: ``rayeval watch`` picks up a checkpoint that a "training run" writes during the test,
only once it is complete, ignores temporary names, and stops on Ctrl-C with every result whole."""

import io
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rayeval.ranking import latest_rows
from rayeval.io.store import ResultStore
from support import (build_model, make_data, reference_metrics, wait_for, write_model_module,
                     write_parquet, write_sweep)

pytestmark = pytest.mark.ray


def test_watch_evaluates_checkpoints_as_they_are_written(tmp_path):
    write_model_module(str(tmp_path))
    x, y = make_data(300, seed=3)
    write_parquet(str(tmp_path / "data.parquet"), x, y)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    torch.save(build_model(seed=1).state_dict(), ckpts / "step_1.pt")
    sweep = write_sweep(str(tmp_path), workers=2)
    store = ResultStore(str(tmp_path / "out"))

    def stored():
        return {(os.path.basename(r["checkpoint"]), r["metric"]): r["value"]
                for r in latest_rows(store.read())}

    log = tmp_path / "watch.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rayeval", "watch", sweep, "--interval",
                                 "0.5", "--settle", "2"], cwd=str(tmp_path), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: len(stored()) == 3, 240, "the first checkpoint", log)

        # A file under a temporary name is never looked at; the real one is written slowly,
        # in pieces, as a training run would, and must be evaluated only once complete.
        (ckpts / "step_2.pt.tmp").write_bytes(b"half a checkpoint")
        buf = io.BytesIO()
        torch.save(build_model(seed=3).state_dict(), buf)
        data = buf.getvalue()
        with open(ckpts / "step_3.pt", "wb") as f:
            for i in range(0, len(data), len(data) // 6 + 1):
                f.write(data[i:i + len(data) // 6 + 1])
                f.flush()
                time.sleep(0.4)
        wait_for(lambda: len(stored()) == 6, 240, "the checkpoint written during the test", log)
        time.sleep(1.5)
    finally:
        os.killpg(proc.pid, signal.SIGINT)       # Ctrl-C reaches the terminal's whole group
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    text = log.read_text()
    assert proc.returncode == 130, text
    assert "watch stopped (SIGINT); every result written so far is complete" in text
    assert "failed" not in text and "Traceback" not in text, text
    assert "1 new checkpoint(s): step_3.pt" in text
    # One worker group served both polls: the second checkpoint cost no new group.
    assert text.count("worker group started") == 1, text
    got = stored()
    for seed, name in ((1, "step_1.pt"), (3, "step_3.pt")):
        for metric, value in reference_metrics(build_model(seed=seed), x, y).items():
            assert got[(name, metric)] == pytest.approx(value, rel=1e-9)
    assert not [n for n in os.listdir(tmp_path / "out" / "results") if n.startswith(".")]
