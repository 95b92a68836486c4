"""Tier 1: an ``lm_eval:`` entry is rendered while the sweep file is read, but its request table
is written only when the run is planned (``write_requests``, called by the driver's
``check_inputs``): reading a sweep file writes nothing."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

pytest.importorskip("lm_eval")

from rayeval.plan.lm_eval_entries import write_requests  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402


@pytest.fixture
def sweep_file(tmp_path):
    """A sweep with one tiny multiple-choice lm-eval task over a two-row parquet."""
    pq.write_table(pa.table({"prompt": ["Q: one", "Q: two"], "choices": [["a", "b"], ["c", "d"]],
                             "answer": pa.array([0, 1], pa.int64())}), tmp_path / "text.parquet")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: parquet\n"
        f"dataset_kwargs: {{data_files: {{test: {tmp_path / 'text.parquet'}}}}}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{prompt}}'\n"
        "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list: [{metric: acc}]\n")
    (tmp_path / "hf" / "checkpoint-1").mkdir(parents=True)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "t", "checkpoints": ["hf/*"], "output": "out",
        "evals": [{"name": "mc", "lm_eval": {"task": "tiny_mc", "include_path": "tasks"}}]}))
    return path


def test_reading_writes_nothing_and_planning_writes_the_request_table(sweep_file, tmp_path):
    sweep = load_sweep(str(sweep_file))
    (ev,) = sweep.evals
    assert ev.task == "lm_eval" and ev.dataset.path.startswith(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists(), "the sweep parser writes nothing"
    write_requests(sweep)
    table = pq.read_table(ev.dataset.path)
    assert table.num_rows == 2 and {"context", "doc_id"} <= set(table.column_names)
    write_requests(sweep)                      # planned again: the table is kept as it is
    assert pq.read_table(ev.dataset.path).equals(table)
