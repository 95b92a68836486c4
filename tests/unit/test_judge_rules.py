"""A judge's rules without a model (docs/judges.md): how its text becomes a verdict, what its
template sees, the exact states of ``judge`` and ``judge_failed``, the sweep file's judge
section and the key it makes."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import yaml

from rayeval.config.schema import numbers_of
from rayeval.core import judge as judging
from rayeval.core.evaluate import Accumulator, finalize
from rayeval.config.schema import Bootstrap
from rayeval.core import stats
from rayeval.errors import SpecError
from rayeval.plan.loader import load_sweep

WORDS = judging.Verdicts({"yes": 1, "no": 0})


@pytest.mark.parametrize("text, score", [
    ("Yes.", 1.0), ("no", 0.0), ("  NO, it does not", 0.0), ("The answer: yes", 1.0),
    ("no... well, yes", 0.0),             # the first found, not the last
    ("yesterday nobody", None),           # whole words only
    ("", None), ("maybe", None), ("yes-no", 1.0),
])
def test_words_first_whole_word_any_case(text, score):
    assert WORDS.read(text) == score


def test_a_longer_word_wins_where_two_start_at_the_same_place():
    v = judging.Verdicts({"correct": 1, "correct but incomplete": 0.5})
    assert v.read("Correct but incomplete.") == 0.5
    assert v.read("correct") == 1.0


@pytest.mark.parametrize("text, score", [
    ("Rating: 4", 4.0), ("rating:5 and Rating: 2", 5.0), ("no rating", None),
    ("Rating: 9", None),
])
def test_pattern_group_is_the_score(text, score):
    v = judging.Verdicts({"pattern": r"(?i)rating:\s*([1-5])"})
    assert v.read(text) == score


def test_a_pattern_whose_group_is_not_a_number_is_a_failure():
    assert judging.Verdicts({"pattern": r"verdict: (\w+)"}).read("verdict: good") is None


@pytest.mark.parametrize("verdict, problem", [
    ({}, "got an empty one"),
    ({"pattern": "rating: [1-5]"}, "has 0 groups; give exactly one"),
    ({"pattern": "(a)(b)"}, "has 2 groups"),
    ({"pattern": "(unclosed"}, "is not a regular expression"),
    ({"yes": "1"}, "the score of 'yes' must be a number"),
    ({"yes": True}, "must be a number"),
    ({" yes": 1}, "is not a word"),
    ({"Yes": 1, "yes": 0}, "differ only in case"),
    (["yes"], "expected a mapping"),
])
def test_bad_verdicts_say_what_is_wrong(verdict, problem):
    assert problem in judging.verdict_problem(verdict)


def test_prompts_see_columns_response_and_target():
    p = judging.Prompts("Q: {{ question }} A: {{ response }} R: {{ target }}")
    assert p.names == ["question", "response", "target"]
    p.check(["question", "answer"])
    assert p.render({"question": "q", "response": "r", "target": "t"}) == "Q: q A: r R: t"
    with pytest.raises(SpecError, match=r"names 'question', which the data set lacks; it has "
                                        r"columns prompt, answer"):
        p.check(["prompt", "answer"])
    with pytest.raises(SpecError, match="not a valid Jinja template"):
        judging.Prompts("{{ broken ")


def test_an_undefined_name_is_an_error_not_an_empty_string():
    import jinja2

    with pytest.raises(jinja2.UndefinedError):
        judging.Prompts("{{ question }}").render({})


class _Tok:
    """A tokenizer's surface chat_tokens reads: one token per character."""

    def __init__(self, template):
        self.tokenizer = self
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt and len(messages) == 1
        return f"<user>{messages[0]['content']}<assistant>"

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def test_chat_template_one_user_message_with_the_generation_prompt():
    assert judging.chat_tokens(_Tok("x"), "hi") == [ord(c) for c in "<user>hi<assistant>"]
    # no template: the text as is, with the tokenizer's own special tokens
    assert judging.chat_tokens(_Tok(None), "hi") == [0, ord("h"), ord("i")]


def test_judge_states_are_exact_and_failures_stay_out_of_the_mean():
    scores = [1.0, None, 0.0, 0.5, None, 1.0]
    metrics = [("judge", judging.Judge()), ("judge_failed", judging.JudgeFailed())]
    boot = Bootstrap(replicates=50, buckets=8)
    ids = torch.arange(len(scores), dtype=torch.int64)
    buckets = stats.buckets_of(ids, boot.seed, boot.k)
    whole = Accumulator(metrics, 1, boot.k)
    whole.add(judging.outputs_of(scores), torch.zeros(6), buckets)
    parts = [Accumulator(metrics, 1, boot.k) for _ in range(2)]
    for acc, index in zip(parts, (torch.tensor([0, 3, 5]), torch.tensor([1, 2, 4]))):
        acc.add(judging.outputs_of([scores[i] for i in index]), torch.zeros(3),
                buckets[index])
    merged = {k: parts[0].states[k] + parts[1].states[k] for k in parts[0].states}
    one = finalize(metrics, whole.states, 1, boot)
    two = finalize(metrics, merged, 1, boot)
    assert one["judge"].value == pytest.approx(2.5 / 4)
    assert one["judge_failed"].value == 2
    # a count: no resampled interval
    assert one["judge_failed"].ci_low is None and one["judge_failed"].replicates is None
    assert one["judge"].replicates == two["judge"].replicates
    assert one["judge"].value == two["judge"].value


def test_judge_failed_shows_as_a_count_of_the_items_and_its_share():
    """rayeval's judge_failed (no interval) reads "n of N (share)"; an lmms-eval task's own
    judge_failed (a mean, with its interval) and other metrics keep the number."""
    from rayeval.ranking import Entry
    from rayeval.ranking.columns import count_text
    from rayeval.reporting.render import _cell

    row = {"metric": "judge_failed", "value": 3.0, "ci_low": None, "ci_high": None,
           "num_samples": 40}
    assert count_text(row) == "3 of 40 (7.5%)"
    assert count_text(dict(row, ci_low=0.0, ci_high=0.2, value=0.075)) is None
    assert count_text(dict(row, metric="judge")) is None
    entry = Entry("s", "/ck/step_1", 1, rows={"nq/judge_failed": row})
    assert _cell(entry, "nq/judge_failed") == "3 of 40 (7.5%)"


def _sweep(tmp_path, **judge) -> dict:
    return {"name": "s", "model": {}, "checkpoints": ["c"], "output": "out",
            "evals": [{"name": "nq", "task": "generation",
                       "dataset": {"path": "qa.parquet", "prompt": "prompt",
                                   "target": "answer"},
                       "judge": {"model": "judge", "prompt": "{{ response }}",
                                 "verdict": {"yes": 1, "no": 0}, **judge},
                       "metrics": ["exact_match", "judge"]}]}


def _load(tmp_path, raw):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_sweep(str(path))


def test_the_pinned_form_loads_and_keeps_records(tmp_path):
    sweep = _load(tmp_path, _sweep(tmp_path, max_new_tokens=3))
    ev = sweep.evals[0]
    assert ev.judge.model == str(tmp_path / "judge") and ev.judge.max_new_tokens == 3
    assert ev.judge.staged and ev.samples        # a judge reads the stored responses


@pytest.mark.parametrize("change, message", [
    (lambda r: r["evals"][0].update(task="multiple_choice", dataset={
        "path": "x.parquet", "prompt": "p", "choices": "c", "target": "t"},
        metrics=["acc"]), "evals[0].judge: task multiple_choice does not generate"),
    (lambda r: r["evals"][0].update(metrics=["exact_match"]),
     "evals[0].metrics: a judge: section is given but the metrics do not list 'judge'"),
    (lambda r: r["evals"][0].pop("judge"),
     "evals[0].metrics: metric 'judge' needs a judge: section"),
    (lambda r: r["evals"][0]["judge"].update(verdict={}), "evals[0].judge.verdict: "),
    (lambda r: r["evals"][0]["judge"].update(verdict={"pattern": "x"}),
     "evals[0].judge.verdict: pattern 'x' has 0 groups"),
    (lambda r: r["evals"][0]["judge"].pop("prompt"),
     "evals[0].judge.prompt: missing required key"),
    (lambda r: r["evals"][0]["judge"].update(prompt="{% if %}"),
     "evals[0].judge.prompt: not a valid Jinja template"),
    (lambda r: r["evals"][0]["judge"].update(temperature=0.7),
     "evals[0].judge"),
    (lambda r: r["evals"][0].update(generation={"repeats": 2, "temperature": 0.5}),
     "evals[0].judge: a judge grades one answer per item"),
    (lambda r: r.update(select={"metric": "nq/exact_match", "top": 1}),
     "evals[0].judge: a race cannot judge"),
])
def test_bad_judge_sections_fail_in_one_line(tmp_path, change, message):
    raw = _sweep(tmp_path)
    change(raw)
    with pytest.raises(SpecError) as e:
        _load(tmp_path, raw)
    assert message in e.value.message
    assert "\n" not in e.value.message


def test_the_judge_is_in_the_key_only_when_given(tmp_path):
    """A sweep without a judge keys as before the field existed; each judge setting that
    changes the figure is in the key, the batch size is not."""
    raw = _sweep(tmp_path)
    ev = _load(tmp_path, raw).evals[0]
    plain = dataclasses.replace(ev, judge=None)
    assert "judge" not in numbers_of(plain, True)
    walked = numbers_of(ev, True)["judge"]
    assert set(walked) == {"prompt", "verdict", "max_new_tokens", "backend", "dtype"}
    assert not re.search("batch_size|model", ",".join(walked))


def test_a_judged_items_page_shows_the_judges_text_failure_and_prompt():
    import pyarrow as pa

    from rayeval.reporting.samples import metric_columns
    from rayeval.reporting.samples_page import samples_page

    table = pa.table({"id": [1, 2], "context": ["Q1", "Q2"], "target": ["a", "b"],
                      "response": ["a", "<b>"], "exact_match": [1.0, 0.0],
                      "judge": pa.array([1.0, None], pa.float64()),
                      "judge_prompt": ["Is a right?", "Is <b> right?"],
                      "judge_output": [" yes", " maybe"],
                      "judge_failed": pa.array([None, "no verdict in the judge's text"],
                                               pa.string())})
    assert metric_columns(table) == ["exact_match", "judge"]
    page = samples_page(table, "c on nq", metric_columns(table), "exact_match")
    assert "<summary>judge prompt</summary><pre>Is &lt;b&gt; right?</pre>" in page
    assert "failed: no verdict in the judge&#x27;s text" in page
    assert page.count('class="failed"') == 1


def test_a_warning_only_when_most_verdicts_are_unread(tmp_path):
    """``reporting.samples.judge_warnings`` over a run's rows: at most half of an evaluation's
    judged items unread is no warning; more is one line with the count over every checkpoint
    and the rule (the line with a judge's text, read from a real store's records:
    tests/integration/test_judge.py)."""
    from types import SimpleNamespace

    from rayeval.reporting.samples import judge_warnings

    def sweep(verdict):
        judged = SimpleNamespace(name="nq", judge=SimpleNamespace(verdict=verdict))
        return SimpleNamespace(evals=[judged, SimpleNamespace(name="plain", judge=None)])

    def rows(*failed):
        return [{"evaluation": "nq", "metric": "judge_failed", "value": float(f),
                 "num_samples": 40, "cell": f"c{i}", "samples": None}
                for i, f in enumerate(failed)] + [
            {"evaluation": "plain", "metric": "judge_failed", "value": 40.0, "num_samples": 40,
             "cell": "p", "samples": None}]         # not a judged evaluation of this sweep

    words = sweep({"yes": 1, "no": 0})
    assert judge_warnings(words, rows(20, 20), str(tmp_path)) == []           # half: none
    assert judge_warnings(words, rows(), str(tmp_path)) == []
    (line,) = judge_warnings(words, rows(40, 1), str(tmp_path))
    assert line == ("warning: nq: the judge's verdict could not be read in 41 of 80 items, "
                    "which count in neither judge nor its interval; the rule: the first of "
                    "the words 'yes', 'no' (any case, whole word) (docs/judges.md: the verdict)")
    (line,) = judge_warnings(sweep({"pattern": r"score: (\d)"}), rows(40, 40), str(tmp_path))
    assert "80 of 80 items" in line and r"the rule: the pattern 'score: (\\d)''s group" in line
