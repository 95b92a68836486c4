"""A judged evaluation's bad input (docs/judges.md): one line naming the key and the fix, exit
code 2, before Ray starts, nothing written — on the tiny checkpoints and hand-built judge of
tests/judge_support.py (models are built, no Ray)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml

pytest.importorskip("transformers")

import judge_support  # noqa: E402
from support import rayeval_main  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return judge_support.build(str(tmp_path_factory.mktemp("judge_inputs")), items=6,
                               checkpoints=1)


def _fails(built, change) -> str:
    import ray

    path = judge_support.sweep(built, name="bad.yaml", output="never")
    raw = yaml.safe_load(open(path))
    change(raw)
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    proc = rayeval_main("run", path)
    assert not ray.is_initialized(), "failed before Ray starts"
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not os.path.exists(os.path.join(built["folder"], "never"))
    return lines[0]


def _judge(raw) -> dict:
    return raw["evals"][0]["judge"]


def test_a_template_naming_a_missing_column_lists_the_columns(built):
    line = _fails(built, lambda r: _judge(r).update(prompt="{{ questoin }} {{ response }}"))
    assert "evals[0].judge.prompt: the template names 'questoin', which the data set lacks; " \
           "it has columns id, question, prompt, answer (and response, target)" in line


def test_a_template_that_does_not_render(built):
    line = _fails(built, lambda r: _judge(r).update(prompt="{{ question.nope.deeper }}"))
    assert "evals[0].judge.prompt: does not render on the first item: UndefinedError" in line


def test_a_judge_that_is_not_a_folder(built):
    line = _fails(built, lambda r: _judge(r).update(model="no/such/judge"))
    assert "evals[0].judge.model: " in line and "not a Hugging Face folder" in line


def test_a_judge_whose_config_does_not_load(built, tmp_path):
    broken = tmp_path / "broken-judge"
    shutil.copytree(built["judge"], broken)
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    line = _fails(built, lambda r: _judge(r).update(model=str(broken)))
    assert "evals[0].judge.model: " in line and "transformers cannot read it" in line


def test_a_judge_without_a_tokenizer(built, tmp_path):
    bare = tmp_path / "bare-judge"
    bare.mkdir()
    shutil.copy(os.path.join(built["judge"], "config.json"), bare / "config.json")
    line = _fails(built, lambda r: _judge(r).update(model=str(bare)))
    assert "evals[0].judge.model: the judge's tokenizer: " in line
    assert "no tokenizer files" in line


def test_a_pairwise_baseline_that_is_not_a_checkpoint(built):
    line = _fails(built, lambda r: _judge(r).update(
        baseline="ckpts/step-999", prompt="{{ response_a }} {{ response_b }}"))
    assert "evals[0].judge.baseline: " in line
    assert "is not one of the sweep's checkpoints" in line


def test_a_pairwise_template_must_show_both_answers(built):
    line = _fails(built, lambda r: _judge(r).update(baseline=built["checkpoints"][0]))
    assert "evals[0].judge.prompt: a pairwise judge's template shows both answers" in line


def test_a_pairwise_verdict_outside_0_to_1(built):
    line = _fails(built, lambda r: _judge(r).update(
        baseline=built["checkpoints"][0], prompt="{{ response_a }} {{ response_b }}",
        verdict={"A": 1, "B": -1}))
    assert "evals[0].judge.verdict: a pairwise verdict's score says how much the first " \
           "answer wins, from 0 to 1; 'B' has -1" in line
