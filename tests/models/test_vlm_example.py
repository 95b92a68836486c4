"""scripts/make_vlm_example.py in miniature (a few training steps) beside a copy of
configs/vlm/sweep.yaml: the checkpoints it writes load with their processor, and the example
sweep passes every check `rayeval run` makes before Ray starts."""

import os
import shutil

import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("easy_vqa")

from support import script  # noqa: E402

from rayeval.plan.preflight import prepare  # noqa: E402
from rayeval.io import vision  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "configs", "vlm")


def test_the_script_builds_the_example_the_sweep_file_runs(tmp_path, monkeypatch):
    written = script("make_vlm_example").build(str(tmp_path), steps=4, checkpoints=2)
    assert [os.path.basename(p) for p in written] == ["checkpoint-1", "checkpoint-4"]
    from safetensors.torch import load_file

    first, last = (load_file(os.path.join(p, "model.safetensors")) for p in written)
    assert any(not torch.equal(first[k], last[k]) for k in first)      # training moved them
    for p in written:
        assert isinstance(vision.load_processor(p, what="checkpoint"), vision.Processor)
    table = pq.read_table(tmp_path / "data" / "vqa.parquet")
    assert table.num_rows == 200
    assert all(a in c for a, c in zip(table["answer"].to_pylist(), table["choices"].to_pylist()))
    shutil.copy(os.path.join(EXAMPLE, "sweep.yaml"), tmp_path / "sweep.yaml")
    sweep = load_sweep(str(tmp_path / "sweep.yaml"))
    assert [e.name for e in sweep.evals] == ["vqa", "vqa_mc"]
    assert all(e.dataset.images == "image" for e in sweep.evals)
    plan = prepare(sweep.replace(output=str(tmp_path / "out")))
    assert len(plan.cells) == 4 and not plan.failed
    # image items go through Ray Data: a bound on its stages that is no number fails here,
    # before Ray, naming the variable
    from rayeval.errors import SpecError

    monkeypatch.setenv("RAYEVAL_DATA_CONCURRENCY", "0")
    with pytest.raises(SpecError, match=r"^RAYEVAL_DATA_CONCURRENCY='0': expected a whole "):
        prepare(sweep.replace(output=str(tmp_path / "out2")))
    assert not os.path.exists(tmp_path / "out2")
