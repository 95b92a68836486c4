"""Tier 1: what the result store keeps of a rendered lm-eval task is plain data, checked
against the driver's own bytes before a run reads it; the naming grammar of lm-eval results."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayeval.errors import StoreError
from rayeval.config import names
from rayeval.harness import requests, store
from rayeval.harness.groups import Group, group_metrics
from rayeval.harness.render import Rendered


def _rendered(digest="d" * 24, contexts=("1+1=", "2+2=")):
    instances = [json.dumps({"type": "loglikelihood", "requests": [
        {"args": [c, " 2"], "idx": 0, "repeats": 1}]}) for c in contexts]
    table = pa.table({"doc_id": list(range(len(contexts))), "context": list(contexts),
                      "target": ["2"] * len(contexts), "choices": [None] * len(contexts),
                      "instances": instances}, schema=requests.table_schema())
    return Rendered("t", "loglikelihood", table, b"", [("acc", "lm_mean", 0, True)], (), 0,
                    digest, {"acc,none": "acc"})


def test_the_request_table_has_no_binary_column():
    assert not any(pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)
                   for f in requests.table_schema())


def test_a_stored_table_that_is_not_the_rendered_one_is_one_line(tmp_path):
    output = str(tmp_path / "results")
    rendered = _rendered()
    data = store.write(output, rendered)
    assert data == f"{store.location(output, rendered.digest)}/{store.DOCS_FILE}"
    store.check_stored([data])                              # the driver's own bytes: fine
    # a table planted under the digest: the same schema, other requests
    pq.write_table(_rendered(contexts=("1+1=", "import os")).table, data)
    with pytest.raises(StoreError) as caught:
        store.check_stored([data])
    message = caught.value.message
    assert "\n" not in message and message.startswith(f"{data}: ")
    assert "not trusted" in message and "--force" in message
    assert f"delete {os.path.dirname(data)}" in message
    # --force writes the driver's bytes over it
    store.check_stored([data], force=True)
    store.check_stored([data])
    assert pq.read_table(data).column("context").to_pylist() == ["1+1=", "2+2="]


def test_a_table_already_stored_is_not_written_again(tmp_path):
    output = str(tmp_path / "results")
    data = store.write(output, _rendered())
    before = os.stat(data).st_mtime_ns
    store.write(output, _rendered())
    assert os.stat(data).st_mtime_ns == before


def test_a_documents_requests_as_json_and_back():
    from lm_eval.api.instance import Instance

    doc = {"q": "1+1", "a": 2}
    made = [Instance("multiple_choice", doc, ("1+1=", f" {c}"), i, ("t", 7, 1))
            for i, c in enumerate("123")]
    encoded = requests.encode("multiple_choice", made)
    assert requests.kind_of(encoded) == "multiple_choice"
    assert requests.arguments(encoded) == [i.args for i in made]
    again = requests.instances(encoded, doc, 7, "t")
    assert [(i.request_type, i.doc, i.args, i.idx, i.doc_id, i.repeats, i.task_name)
            for i in again] == [(i.request_type, i.doc, i.args, i.idx, i.doc_id, i.repeats,
                                 i.task_name) for i in made]


def test_the_naming_grammar():
    assert names.metric_key("exact_match", "strict") == "exact_match,strict"
    assert names.result_key("acc", "none", 1) == "acc"
    assert names.result_key("acc", "strict", 2) == "acc,strict"
    assert names.split_key("exact_match,strict") == ("exact_match", "strict")
    assert names.split_key("acc") == ("acc", None)
    assert names.metric_of("exact_match,strict") == "exact_match"
    assert names.member("mmlu", "mmlu_anatomy") == "mmlu/mmlu_anatomy"
    assert names.split_member("mmlu/stem/x") == ("mmlu", "stem/x")
    assert names.group_of("mmlu/mmlu_anatomy") == "mmlu" and names.group_of("mmlu") is None
    assert names.is_member("mmlu/x", "mmlu") and not names.is_member("mmlux/y", "mmlu")


def test_group_metrics_as_lm_eval_aggregates():
    a, b = _rendered(), _rendered()
    b.lm_keys = {"acc,none": "acc", "acc,strict": "acc,strict"}
    b.metrics = [("acc", "lm_mean", 0, True), ("acc,strict", "lm_mean", 1, True)]
    group = Group("g", ["a", "b"], [("acc", None, True)])
    assert group_metrics(group, {"a": a, "b": b}) == [
        ("acc,none", [("a", "acc"), ("b", "acc")], True, True),
        ("acc,strict", [("b", "acc,strict")], True, True)]
    only = Group("g", ["a", "b"], [("acc", ["none"], False)])
    assert group_metrics(only, {"a": a, "b": b}) == [
        ("acc", [("a", "acc"), ("b", "acc")], False, True)]


def test_core_finds_the_lm_eval_task_by_name_without_importing_it():
    import subprocess
    import sys

    import rayeval

    root = os.path.dirname(os.path.dirname(rayeval.__file__))
    code = ("import sys\n"
            "from rayeval.core import metrics, tasks\n"
            "assert 'rayeval.harness.task' not in sys.modules\n"
            "assert 'rayeval.lmms.task' not in sys.modules\n"
            "assert list(tasks.TASKS)[-2:] == ['lm_eval', 'lmms_eval']\n"
            "assert 'lm_mean' in metrics.for_task('lm_eval')\n"
            "assert type(tasks.get('lm_eval')).__module__ == 'rayeval.harness.task'\n"
            "assert metrics.for_task('lm_eval').get('lm_bits_per_byte').name == "
            "'lm_bits_per_byte'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr


def test_a_function_in_a_tasks_config_is_named_the_same_in_every_process():
    from rayeval.harness.render import config_value as _plain

    def add_question(dataset):
        return dataset

    def edited():
        def add_question(dataset):
            return dataset.map(str)
        return add_question

    named = _plain(add_question)
    assert "0x" not in named and named.startswith(f"{__name__}.")
    assert named.split(":")[0].endswith(".add_question")
    assert _plain(add_question) == named                   # the source, not the object
    assert _plain(edited()).split(":")[1] != named.split(":")[1]     # an edit: a new digest
    assert _plain(object()) == "<object object>"
