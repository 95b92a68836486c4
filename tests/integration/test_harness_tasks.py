"""lm-evaluation-harness task definitions as rayeval evaluations, against lm-eval's own run.

The tasks are lm-eval YAMLs over local parquet (nothing downloaded), written here to cover what
a team's benchmarks use: ``process_docs`` from a ``utils.py`` beside the YAML, Jinja templates,
a few-shot split, two filter pipelines (regex and whitespace), the loglikelihood output type
(greedy accuracy and perplexity), rolling log-likelihoods (weighted perplexities, bits per
byte) and a chat-formatted generation task with multi-turn few-shot and a system instruction.
lm-eval's ``simple_evaluate`` on the same Hugging Face folders is the reference: every metric
and every document's record, in one process and on a real local Ray with 1, 2 and 3 workers
(records: the 3-worker run's), and a 5-shot group of two tasks of different sizes; with shared
prefixes (model.share_prefixes) on and off (one process: both; Ray: on for 2 workers). One more
entry has ``limit:`` (a share of the documents): lm-eval's --limit run, stored as n of N.
"""

import dataclasses
import math
import os
import pathlib
import pickle
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import rayeval

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from harness import offline_env  # noqa: E402
from support import (record_sets, local_ray, ray_starts, rayeval_cli, rayeval_main,  # noqa: E402
                     single_process_passes)

from rayeval.core.evaluate import finalize  # noqa: E402
from rayeval.io.data import read_batches  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402
from rayeval.ranking import latest_rows  # noqa: E402
from rayeval.io.store import ResultStore  # noqa: E402

for _k, _v in offline_env({}).items():
    os.environ.setdefault(_k, _v)

REL = 1e-4           # as test_text_tasks: float32 kernels differ with padding and CPU
PLAIN = ("arith_mc", "arith_gen", "arith_ll", "docs_ppl")
CHAT = "arith_chat"
GROUP = "grp"                      # the group arith_group: grp/arith_mc, grp/arith_half, grp
LIMITED, LIMIT = "arith_mc_limited", 0.25     # arith_mc with limit: 0.25 (15 of its 60 docs)
MEMBERS = ("arith_mc", "arith_half")
KINDS = {"acc": "lm_mean", "acc_norm": "lm_mean", "exact_match": "lm_mean",
         "perplexity": "lm_perplexity", "word_perplexity": "lm_weighted_perplexity",
         "byte_perplexity": "lm_weighted_perplexity", "bits_per_byte": "lm_bits_per_byte"}
CHAT_OPTIONS = {"apply_chat_template": True, "fewshot_as_multiturn": True,
                "system_instruction": "Answer with a number."}
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _task(name, file, output_type, body, *, fewshot_split=True):
    files = {"test": file} if not fewshot_split else {"train": file, "test": file}
    head = {"task": name, "dataset_path": "parquet",
            "dataset_kwargs": {"data_files": files}, "test_split": "test",
            "output_type": output_type, "metadata": {"version": 1.0}}
    if fewshot_split:
        head["fewshot_split"] = "train"
    return yaml.safe_dump({**head, **body}, sort_keys=False)


def write_tasks(folder, data):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "utils.py").write_text(
        "def add_question(dataset):\n"
        "    return dataset.map(lambda d: {'question': 'Q: ' + d['prompt']})\n")
    mc = _task("arith_mc", str(data / "mc.parquet"), "multiple_choice", {
        "num_fewshot": 2, "doc_to_text": "{{question}} A:", "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean",
                         "higher_is_better": True}]})
    # process_docs is a YAML tag lm-eval resolves to utils.py's function
    (folder / "arith_mc.yaml").write_text(
        mc + "process_docs: !function utils.add_question\n")
    gen_body = {
        "num_fewshot": 1, "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
        "filter_list": [
            {"name": "strict", "filter": [{"function": "regex", "regex_pattern": r"^\s*(\d)"},
                                          {"function": "take_first"}]},
            {"name": "loose", "filter": [{"function": "remove_whitespace"},
                                         {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                         "higher_is_better": True, "ignore_case": True}]}
    (folder / "arith_gen.yaml").write_text(
        _task("arith_gen", str(data / "gen.parquet"), "generate_until", gen_body))
    (folder / f"{CHAT}.yaml").write_text(
        _task(CHAT, str(data / "gen.parquet"), "generate_until",
              {**gen_body, "num_fewshot": 2}))
    (folder / "arith_ll.yaml").write_text(
        _task("arith_ll", str(data / "gen.parquet"), "loglikelihood", {
            "doc_to_text": "{{prompt}}", "doc_to_target": " {{answer}}",
            "metric_list": [{"metric": "perplexity", "aggregation": "perplexity",
                             "higher_is_better": False},
                            {"metric": "acc", "aggregation": "mean",
                             "higher_is_better": True}]}, fewshot_split=False))
    # A 5-shot group of two multiple-choice tasks of different sizes (the half keeps the even
    # ids): acc weighted by size, acc_norm not, as lm-eval's group aggregates
    (folder / "utils.py").write_text((folder / "utils.py").read_text() + (
        "def even_ids(dataset):\n"
        "    return dataset.filter(lambda d: d['id'] % 2 == 0)\n"))
    half = _task("arith_half", str(data / "mc.parquet"), "multiple_choice", {
        "doc_to_text": "Question: {{prompt}}\nAnswer:", "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean",
                         "higher_is_better": True}]})
    (folder / "arith_half.yaml").write_text(half + "process_docs: !function utils.even_ids\n")
    (folder / "arith_group.yaml").write_text(yaml.safe_dump({
        "group": "arith_group", "task": ["arith_mc", "arith_half"],
        "aggregate_metric_list": [
            {"metric": "acc", "aggregation": "mean", "weight_by_size": True},
            {"metric": "acc_norm", "aggregation": "mean", "weight_by_size": False}],
        "metadata": {"version": 1.0}}, sort_keys=False))
    (folder / "docs_ppl.yaml").write_text(
        _task("docs_ppl", str(data / "docs.parquet"), "loglikelihood_rolling", {
            "doc_to_text": "", "doc_to_target": "text",
            "metric_list": [
                {"metric": "word_perplexity", "aggregation": "weighted_perplexity",
                 "higher_is_better": False},
                {"metric": "byte_perplexity", "aggregation": "weighted_perplexity",
                 "higher_is_better": False},
                {"metric": "bits_per_byte", "aggregation": "bits_per_byte",
                 "higher_is_better": False}]}, fewshot_split=False))
    return folder


@pytest.fixture(scope="module")
def example(tmp_path_factory, lm_example):
    out = tmp_path_factory.mktemp("lm_harness")
    lm_example(out)           # the run's one training of the tiny GPT-2 (tests/conftest.py)
    from transformers import AutoTokenizer

    for folder in (out / "ckpts").iterdir():              # a chat template for arith_chat
        tok = AutoTokenizer.from_pretrained(folder)
        tok.chat_template = TEMPLATE
        tok.save_pretrained(folder)
    write_tasks(out / "tasks", out / "data")
    evals = [{"name": t, "lm_eval": {"task": t, "include_path": "tasks"}} for t in PLAIN]
    evals.append({"name": CHAT, "lm_eval": {"task": CHAT, "include_path": "tasks",
                                             **CHAT_OPTIONS}})
    evals.append({"name": GROUP, "lm_eval": {"task": "arith_group", "include_path": "tasks",
                                              "num_fewshot": 5}})
    evals.append({"name": LIMITED, "lm_eval": {"task": "arith_mc", "include_path": "tasks",
                                                "limit": LIMIT}})
    sweep = {"name": "harness-tasks", "checkpoints": ["ckpts/checkpoint-*"], "workers": 1,
             "output": "results", "bootstrap": {"replicates": 200}, "batch_size": 8,
             "evals": evals}
    (out / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def checkpoints(example):
    return sorted(str(p) for p in (example / "ckpts").iterdir())


def _lm_eval(folder, tasks_dir, tasks, names=None, **options):
    """{rayeval's evaluation name: {"metrics", "samples"}} of one simple_evaluate call;
    ``names`` maps lm-eval's task and group names to rayeval's evaluations."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={folder},dtype=float32", tasks=list(tasks),
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        device="cpu", batch_size=8, log_samples=True, bootstrap_iters=0, **options)
    out = {}
    for task, res in results["results"].items():
        metrics = {k: v for k, v in res.items() if "," in k and "stderr" not in k}
        out[(names or {}).get(task, task)] = {"metrics": metrics,
                                               "samples": results["samples"].get(task, [])}
    return out


@pytest.fixture(scope="module")
def reference(example, checkpoints):
    """lm-eval's own run: {checkpoint: {task: {"metrics": {"acc,none": ...}, "samples": [...]}}}."""
    ref = {}
    for c in checkpoints:
        ref[c] = _lm_eval(c, example / "tasks", PLAIN)
        ref[c].update(_lm_eval(c, example / "tasks", [CHAT], **CHAT_OPTIONS))
        names = {"arith_group": GROUP, **{t: f"{GROUP}/{t}" for t in MEMBERS}}
        ref[c].update(_lm_eval(c, example / "tasks", ["arith_group"], names, num_fewshot=5))
        ref[c].update(_lm_eval(c, example / "tasks", ["arith_mc"], {"arith_mc": LIMITED},
                               limit=LIMIT))
    return ref


def _theirs(metrics: dict, key: str) -> float:
    """lm-eval's figure for a rayeval key: "acc" is "acc,none"; "exact_match,strict" as is."""
    return metrics[key if "," in key else f"{key},none"]


def _check(key: str, ours: float, theirs: float) -> None:
    if key.split(",")[0] in ("acc", "acc_norm", "exact_match"):
        assert ours == theirs, key                         # counts: exactly
    else:
        assert ours == pytest.approx(theirs, rel=REL), key


@pytest.mark.parametrize("share", [True, False], ids=["shared", "unshared"])
def test_one_process_equals_lm_eval(example, checkpoints, reference, share):
    seen = set()
    sweep = load_sweep(str(example / "sweep.yaml"))
    sweep = sweep.replace(model=dataclasses.replace(sweep.model, share_prefixes=share))
    for ref, ev, model, decode, p, metrics in single_process_passes(sweep):
        for table in read_batches(ev.data, ev.spec.dataset, 5):
            x, y, buckets = decode(table)
            p.update(x, y, buckets)
        p.finish()
        results = finalize(metrics, p.states, ev.output_size, ev.spec.bootstrap)
        theirs = reference[ref.location][ev.name]["metrics"]
        assert len(results) == len(theirs)
        # each lm-eval aggregation became the exact-state metric of the same formula
        assert {m.key: m.name for m in ev.spec.metrics} == {k: KINDS[k.split(",")[0]]
                                                             for k in results}
        for key, r in results.items():
            _check(key, float(r.value), _theirs(theirs, key))
        seen.add((ref.location, ev.name))
    assert len(seen) == len(checkpoints) * (len(PLAIN) + 1 + len(MEMBERS) + 1)


def test_the_filters_and_the_chat_template_changed_something(reference, checkpoints):
    """The reference is not degenerate: the two filters disagree somewhere, the chat task's
    prompts are chat-formatted, and the last checkpoint answers some items right."""
    last = reference[checkpoints[-1]]
    strict = [s["filtered_resps"] for s in last["arith_gen"]["samples"]
              if s["filter"] == "strict"]
    loose = [s["filtered_resps"] for s in last["arith_gen"]["samples"]
             if s["filter"] == "loose"]
    assert strict != loose
    assert last[CHAT]["samples"][0]["arguments"][0][0].startswith("<|system|>")
    assert last["arith_mc"]["metrics"]["acc,none"] > 0
    assert last["arith_gen"]["metrics"]["exact_match,loose"] > 0


@pytest.fixture(scope="module")
def ray_stores(example, tmp_path_factory, standing):
    """1, 2 and 3 workers; the 1- and 3-worker runs share prefixes (the default), at batch
    1 and 64; the 2-worker run scores each request on its own (``model.share_prefixes:
    false``), at the sweep's batch of 8."""
    root = tmp_path_factory.mktemp("harness_stores")
    sweep = yaml.safe_load((example / "sweep.yaml").read_text())
    for name, changes in (("sweep-1.yaml", {"batch_size": 1}),
                          ("sweep-2.yaml", {"model": {"share_prefixes": False}}),
                          ("sweep-3.yaml", {"batch_size": 64})):
        (example / name).write_text(yaml.safe_dump({**sweep, **changes}, sort_keys=False))
    stores = {}
    with local_ray():     # one Ray start for the three runs (rayeval.run is what `run` calls)
        for workers in (1, 2, 3):
            out = root / f"store{workers}"
            report = rayeval.run(str(example / f"sweep-{workers}.yaml"), workers=workers,
                                 output=str(out), standing=standing)
            assert report.outcomes and not report.failures, report.failures
            stores[workers] = out
    return stores


@pytest.mark.ray
def test_ray_runs_with_1_2_and_3_workers_equal_lm_eval(checkpoints, reference, ray_stores):
    runs = {}
    for workers, out in ray_stores.items():
        rows = latest_rows(ResultStore(str(out)).read())
        expected = sum(len(reference[checkpoints[0]][t]["metrics"]) for t in reference[
            checkpoints[0]])
        assert len(rows) == len(checkpoints) * expected
        for r in rows:
            theirs = reference[r["checkpoint"]][r["evaluation"]]
            assert r["world_size"] == workers
            parts = [f"{GROUP}/{m}" for m in MEMBERS] if r["evaluation"] == GROUP else [
                r["evaluation"]]
            assert r["num_samples"] == sum(len({s["doc_id"] for s in reference[r[
                "checkpoint"]][p]["samples"]}) for p in parts)
            assert r["ci_low"] <= r["value"] <= r["ci_high"]
            _check(r["metric"], r["value"], _theirs(theirs["metrics"], r["metric"]))
        runs[workers] = {(r["checkpoint"], r["evaluation"], r["metric"]): r for r in rows}
    # The intervals do not depend on the world size: with shared prefixes (1 and 3 workers,
    # batch 1 and 64) to the bit; without them exactly for counts, to float rounding for sums
    # of log-likelihoods (the batches' padding differs).
    for workers in (2, 3):
        for key, r in runs[workers].items():
            for k in ("value", "ci_low", "ci_high"):
                if workers == 3 or key[2].split(",")[0] in ("acc", "acc_norm", "exact_match"):
                    assert r[k] == runs[1][key][k], key
                else:
                    assert r[k] == pytest.approx(runs[1][key][k], rel=1e-6), key


@pytest.mark.ray
def test_shared_prefixes_give_every_items_log_likelihoods_the_same_bits_on_1_and_3_workers(
        checkpoints, ray_stores):
    """Per item: the 1-worker run at batch 1 and the 3-worker run at batch 64 (shared
    prefixes, the default) hold the same log-likelihoods, to the bit."""
    import rayeval

    for c in checkpoints:
        for task in ("arith_mc", "arith_ll", "docs_ppl"):          # the scored ones
            one, three = (sorted(rayeval.samples(ray_stores[w], checkpoint=c,
                                                 evaluation=task).to_pylist(),
                                 key=lambda r: r["id"]) for w in (1, 3))
            assert len(one) == len(three) > 0
            lls = [r["loglikelihoods"] for r in one]
            assert lls == [r["loglikelihoods"] for r in three], (c, task)
            assert all(x is not None for x in lls), task


@pytest.mark.ray
def test_per_item_records_equal_lm_eval_samples(checkpoints, reference, ray_stores):
    import rayeval

    out = ray_stores[3]
    for c in checkpoints:
        for task in (*PLAIN, CHAT):
            theirs = reference[c][task]["samples"]
            first_filter = theirs[0]["filter"]
            by_doc = {s["doc_id"]: s for s in theirs if s["filter"] == first_filter}
            records = rayeval.samples(out, checkpoint=c, evaluation=task).to_pylist()
            assert sorted(r["id"] for r in records) == sorted(by_doc)       # each once
            for r in records:
                s = by_doc[r["id"]]
                assert r["context"] == s["arguments"][0][0]
                if task in ("arith_gen", CHAT):
                    assert r["response"] == s["filtered_resps"][0]
                    strict = [t for t in theirs if t["doc_id"] == r["id"]
                              and t["filter"] == "strict"][0]
                    assert r["exact_match,strict"] == strict["exact_match"]
                elif task == "docs_ppl":
                    assert r["loglikelihoods"][0] == pytest.approx(s["resps"][0][0], rel=REL)
                else:
                    lls = [float(resp[0][0]) for resp in s["resps"]]
                    assert r["loglikelihoods"] == pytest.approx(lls, rel=REL, abs=1e-5)
                    assert r["acc"] == s["acc"]
    # every worker wrote its own items' file for every cell (for each segment of it)
    cells = list((out / "samples").iterdir())
    assert len(cells) == len(checkpoints) * (len(PLAIN) + 1 + len(MEMBERS) + 1)
    assert all(v == ["0/3", "1/3", "2/3"] for cell in cells for v in record_sets(cell).values())


@pytest.mark.ray
def test_a_limited_entry_is_stored_as_n_of_n_and_marked(example, reference, ray_stores):
    """limit: 0.25 of arith_mc's documents (its values equal lm-eval's --limit run's, checked
    with the others above): each cell is stored as the documents scored of the task's, not as
    a race's partial cell, and the board ranks it, marked, with a warning under it. The
    2-worker run: rank 0 has the task as the driver sent it."""
    docs = pq.read_metadata(example / "data" / "mc.parquet").num_rows
    scored = math.ceil(docs * LIMIT)
    out = str(ray_stores[2])
    rows = [r for r in latest_rows(ResultStore(out).read()) if r["evaluation"] == LIMITED]
    assert len(rows) == len(reference) * 2                             # acc, acc_norm
    for r in rows:
        assert (r["num_samples"], r["limited_from"]) == (scored, docs), r
        assert len(reference[r["checkpoint"]][LIMITED]["samples"]) == scored
        assert r["items_total"] is None and r["stopped"] is None
    others = [r for r in latest_rows(ResultStore(out).read()) if r["evaluation"] != LIMITED]
    assert all(r["limited_from"] is None for r in others)
    board = rayeval.leaderboard(out, evaluation=LIMITED)
    assert all(e.rank for e in board.entries) and not any(e.stopped for e in board.entries)
    assert [e.limited for e in board.entries] == [
        {"acc": f"limit: {scored} of {docs} items", "acc_norm": f"limit: {scored} of {docs} "
         "items"}] * len(reference)
    assert f"warning: \u2020 {LIMITED}: limit: {scored} of {docs} items scored, not the whole " \
           "task" in " ".join(board.notes)


@pytest.mark.ray
def test_the_leaderboard_shows_the_group_and_its_tasks_on_request(ray_stores):
    out = str(ray_stores[3])
    plain = rayeval_main("leaderboard", out, "--format", "csv")
    assert plain.returncode == 0, plain.stderr
    header = plain.stdout.splitlines()[0].split(",")
    assert f"{GROUP}/acc" in header and not any(h.startswith(f"{GROUP}/arith") for h in header)
    full = rayeval_main("leaderboard", out, "--format", "csv", "--members")
    assert full.returncode == 0, full.stderr
    header = full.stdout.splitlines()[0].split(",")
    assert {f"{GROUP}/acc", f"{GROUP}/arith_mc/acc", f"{GROUP}/arith_half/acc"} <= set(header)


def _copy(example, tmp_path):
    ex = tmp_path / "ex"
    shutil.copytree(example, ex, ignore=shutil.ignore_patterns("results", "ckpts"))
    os.symlink(example / "ckpts", ex / "ckpts")
    return ex


def _fails(ex, evals):
    sweep = yaml.safe_load((ex / "sweep.yaml").read_text())
    sweep["evals"] = evals
    (ex / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    with ray_starts() as started:
        proc = rayeval_main("run", str(ex / "sweep.yaml"), env=offline_env({}))  # in process
    assert proc.returncode != 0 and not started                     # before Ray
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (ex / "results").exists()                  # nothing written
    return lines[0]


def _spec_error(ex, evals):
    """The loader's one line for these evaluations (what the command prints after "error:")."""
    from rayeval.errors import SpecError

    sweep = yaml.safe_load((ex / "sweep.yaml").read_text())
    sweep["evals"] = evals
    (ex / "bad.yaml").write_text(yaml.safe_dump(sweep))
    with pytest.raises(SpecError) as caught:
        load_sweep(str(ex / "bad.yaml"))
    assert "\n" not in caught.value.message and not (ex / "results").exists()
    return caught.value.message


def test_bad_lm_eval_entries_are_one_line_before_ray(example, tmp_path):
    ex = _copy(example, tmp_path)
    tasks = {"include_path": "tasks"}
    # through the command line: one line on stderr, exit 2, nothing written
    line = _fails(ex, [{"name": "x", "lm_eval": {"task": "arith_mcq", **tasks}}])
    assert "evals[0].lm_eval.task" in line and "'arith_mc'" in line       # did you mean
    line = _fails(ex, [{"name": "x", "lm_eval": {"task": "arith_gen", **tasks,
                                                 "gen_kwargs": {"num_beams": 4}}}])
    assert "evals[0].lm_eval.gen_kwargs" in line and "searches 4 beams (num_beams)" in line
    # the loader's other lines (the command prints them the same way)
    line = _spec_error(ex, [{"name": "x", "lm_eval": {"task": "arith_mc",
                                                      "include_path": "nope"}}])
    assert "evals[0].lm_eval.include_path" in line
    line = _spec_error(ex, [{"name": "x", "lm_eval": {"task": "arith_mc", "shots": 3, **tasks}}])
    assert "evals[0].lm_eval.shots" in line and "num_fewshot" in line
    line = _spec_error(ex, [{"name": "x", "task": "generation",
                             "lm_eval": {"task": "arith_mc", **tasks}}])
    assert "evals[0].task" in line
    # a second token budget that disagrees with max_gen_toks (lm-eval's HF model would cut the
    # prompt for one and generate the other)
    line = _spec_error(ex, [{"name": "x", "lm_eval": {"task": "arith_gen", **tasks,
                                                      "gen_kwargs": {"max_new_tokens": 5}}}])
    assert line.endswith("evals[0].lm_eval.gen_kwargs: lm-eval task 'arith_gen' sets "
                         "max_new_tokens 5 beside max_gen_toks 8: lm-eval's Hugging Face model "
                         "generates the first and cuts the prompt for the second, and rayeval "
                         "has one budget; give gen_kwargs: {max_gen_toks: 5}"), line
    # a judge grades generated answers: a log-likelihood task has none
    judge = {"model": "judge", "prompt": "{{ context }} {{ response }}",
             "verdict": {"yes": 1, "no": 0}}
    line = _spec_error(ex, [{"name": "x", "lm_eval": {"task": "arith_ll", **tasks},
                             "judge": judge}])
    assert line.endswith("evals[0].judge: lm-eval task 'arith_ll' is loglikelihood, not "
                         "generate_until: a judge grades generated answers; remove judge:")
    # and a generation task's judge is checked as a generation evaluation's
    line = _spec_error(ex, [{"name": "x", "lm_eval": {"task": "arith_gen", **tasks},
                             "judge": {**judge, "verdict": {"yes": 2, "no": 0},
                                       "baseline": "b"}}])
    assert "evals[0].judge.verdict" in line and "from 0 to 1" in line


class _Touch:
    """What a planted pickle can do when loaded: here, create the file ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


@pytest.mark.ray
def test_a_pickle_planted_in_the_store_never_runs(example, tmp_path):
    """Anyone who can write to a shared store plants, under the digest a colleague's sweep
    computes, the files an older rayeval unpickled (task.pkl, a request table of pickled
    requests): the run says the stored rendering is not trusted, --force renders it again,
    and the planted code never runs."""
    ex = _copy(example, tmp_path)
    sweep = yaml.safe_load((ex / "sweep.yaml").read_text())
    sweep["checkpoints"] = [f"ckpts/{sorted(os.listdir(ex / 'ckpts'))[0]}"]
    sweep["evals"] = [{"name": "arith_mc", "lm_eval": {"task": "arith_mc", **{
        "include_path": "tasks"}}}]
    (ex / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    probe, marker = tmp_path / "probe", tmp_path / "planted-pickle-ran"
    pickle.loads(pickle.dumps(_Touch(str(probe))))
    assert probe.exists()                                 # the payload works when loaded
    payload = pickle.dumps(_Touch(str(marker)), protocol=5)
    # the folder the sweep renders to (the run writes its table there unless one is there)
    data = load_sweep(str(ex / "sweep.yaml")).evals[0].dataset.path
    folder = pathlib.Path(data).parent
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"doc_id": [0], "context": ["x"], "target": ["x"],
                             "choices": pa.array([["x"]]), "instances": [payload]}), data)
    (folder / "task.pkl").write_bytes(payload)

    with ray_starts() as started:
        proc = rayeval_main("run", str(ex / "sweep.yaml"), env=offline_env({}))  # in process
    assert proc.returncode != 0 and not started                     # before Ray
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert data in lines[0] and "not trusted" in lines[0] and "--force" in lines[0]
    assert not marker.exists()

    proc = rayeval_cli("run", str(ex / "sweep.yaml"), "--force", timeout=600,
                       env=offline_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists()                            # task.pkl is still there, unread
    rows = latest_rows(ResultStore(str(ex / "results")).read())
    assert {r["metric"] for r in rows} == {"acc", "acc_norm"}
    assert pa.types.is_string(pq.read_schema(data).field("instances").type)
