"""``rayeval watch`` driven by the trainer: a ``watch.ready`` marker makes a checkpoint ready at
once (and only then), and ``watch.order`` picks which ready checkpoints go first."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from rayeval.io.checkpoints import CheckpointRef
from rayeval.errors import SpecError
from rayeval.plan.loader import load_sweep, watch_spec
from rayeval.integrations.watch import Marked, ordered
from support import (build_model, make_data, wait_for, write_model_module, write_parquet,
                     write_sweep)


def refs(n):
    return [(CheckpointRef(f"/c/step_{i}.pt", i, None), f"fp{i}") for i in range(n)]


def steps(pairs):
    return [ref.step for ref, _ in pairs]


def test_orders():
    assert steps(ordered(refs(5), "oldest")) == [0, 1, 2, 3, 4]
    assert steps(ordered(refs(5), "newest")) == [4, 3, 2, 1, 0]
    # coarse to fine: the ends, the middle, then the middles of each half, every one once
    assert steps(ordered(refs(9), "bisect")) == [0, 8, 4, 2, 6, 1, 3, 5, 7]
    for n in range(0, 40):
        assert sorted(steps(ordered(refs(n), "bisect"))) == list(range(n))


def test_markers(tmp_path):
    beside, inside = Marked("*.done"), Marked("COMPLETE")
    assert beside.marker("/c/step_1.pt") == "/c/step_1.pt.done"
    assert inside.marker("/c/checkpoint-5/") == "/c/checkpoint-5/COMPLETE"
    assert beside.is_marker("/c/step_1.pt.done") and not beside.is_marker("/c/step_1.pt")
    assert not inside.is_marker("/c/COMPLETE")          # a name inside folders: never globbed

    (tmp_path / "step_1.pt").write_bytes(b"x")
    (tmp_path / "step_2.pt").write_bytes(b"x")
    (tmp_path / "step_2.pt.done").write_bytes(b"")
    (tmp_path / "checkpoint-3").mkdir()
    said = []
    files = [CheckpointRef(str(tmp_path / n), i, None) for i, n in
             ((1, "step_1.pt"), (2, "step_2.pt"))]
    assert [r.step for r, _ in beside.select(files, said.append)] == [2]
    folder = CheckpointRef(str(tmp_path / "checkpoint-3"), 3, None)
    assert inside.select([folder], said.append) == []
    (tmp_path / "checkpoint-3" / "COMPLETE").write_bytes(b"")
    assert [r.step for r, _ in inside.select([folder], said.append)] == [3]
    # a plain name cannot mark a file checkpoint: said once, never ready
    assert inside.select(files, said.append) == [] and inside.select(files, said.append) == []
    assert len(said) == 2 and "for files use a pattern such as '*.done'" in said[0]


def test_watch_keys_name_the_key(tmp_path):
    assert watch_spec({"ready": "*.done", "order": "bisect"}).order == "bisect"
    for raw, where in (({"ready": "a/b"}, "watch.ready"), ({"ready": "*x*"}, "watch.ready"),
                       ({"order": "random"}, "watch.order"), ({"every": 3}, "watch.every")):
        with pytest.raises(SpecError, match=where.replace(".", r"\.")):
            watch_spec(raw)
    write_model_module(str(tmp_path))
    path = write_sweep(str(tmp_path), watch={"ready": "COMPLETE", "order": "newest"})
    assert load_sweep(path).watch == watch_spec({"ready": "COMPLETE", "order": "newest"})


@pytest.mark.ray
def test_watch_evaluates_marked_checkpoints_at_once_newest_first(tmp_path):
    write_model_module(str(tmp_path))
    x, y = make_data(200, seed=5)
    write_parquet(str(tmp_path / "data.parquet"), x, y)
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    for s in (1, 2):
        torch.save(build_model(seed=s).state_dict(), ckpts / f"step_{s}.pt")
    sweep = write_sweep(str(tmp_path), workers=2, watch={"ready": "*.done"})
    log = tmp_path / "watch.log"
    # --settle far beyond the test: only the markers can make these checkpoints ready
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rayeval", "watch", sweep, "--interval",
                                 "0.5", "--settle", "100000", "--order", "newest"],
                                cwd=str(tmp_path), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_for(lambda: "watching" in log.read_text(), 120, "the watch to start", log)
        assert "ready once the trainer writes *.done beside it; newest first" in log.read_text()
        time.sleep(3)                  # six polls without markers: nothing is evaluated
        assert "new checkpoint" not in log.read_text()
        for s in (1, 2):
            (ckpts / f"step_{s}.pt.done").write_bytes(b"")
        wait_for(lambda: log.read_text().count(" on data: ") == 2, 240, "both results", log)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    text = log.read_text()
    assert "2 new checkpoint(s): step_2.pt, step_1.pt" in text, text
    assert text.count(" on data: ") == 2 and "failed" not in text, text
    assert ".done" not in text.split("new checkpoint(s):", 1)[1].splitlines()[0]
    assert yaml.safe_load(open(sweep))["watch"] == {"ready": "*.done"}
