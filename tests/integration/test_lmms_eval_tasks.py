"""lmms-eval task definitions as rayeval evaluations, against lmms-eval's own run.

The task is what a team writes for local data (``tests/lmms_reference.py``): a YAML over a
JSON-lines file of easy-vqa items (real 64x64 images inside the easy-vqa wheel), its
``doc_to_visual`` opening each image, ``lmms_eval_specific_kwargs`` prompts, two filters and a
``process_results`` with three mean metrics. The model is the tiny untrained Idefics3 of
``tests/vlm_support.py`` (its generations differ item by item, so equal texts mean something).
The reference is ``python -m lmms_eval --model huggingface`` at batch size 1, float32, its two
transformers-5 bugs fixed in the reference's own process. rayeval must give the same figures
and the same generated text and values for every document: in one process at batch sizes 1
and 16, and on one real local Ray with 1, 2 and 3 workers (records: each document once).
8 items keep this small; scripts/bench_vlm.py compares more.
"""

import dataclasses
import os

import pytest
import yaml

pytest.importorskip("transformers")
pytest.importorskip("lmms_eval")
pytest.importorskip("easy_vqa")

from lmms_reference import (FILTERS, OFFLINE_ENV, OWN_METRICS, OWN_TASK,  # noqa: E402
                            SINGLE_ITEMS, TASK)
from support import single_process_passes  # noqa: E402

from rayeval.core.evaluate import finalize  # noqa: E402
from rayeval.io.data import read_batches  # noqa: E402
from rayeval.io.store import ResultStore  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402
from rayeval.ranking import latest_rows  # noqa: E402

for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)

N = SINGLE_ITEMS          # easy-vqa test items, seed 0
METRICS = ("exact_match", "answer_chars", "upper_chars")


@pytest.fixture(scope="module")
def example(tmp_path_factory, lmms_suite):
    """The sweep over the model and the task folder of the run's lmms-eval references
    (``lmms_suite``: made once, with test_lmms_eval_groups' group); its stores go here."""
    root = tmp_path_factory.mktemp("lmms_example")
    ckpts = os.path.join(os.path.dirname(lmms_suite["model"]), "checkpoint-*")
    (root / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "vqa", "checkpoints": [ckpts], "output": "results",
        "workers": 1, "evals": [{"name": "vqa", "batch_size": 16,
                                 "lmms_eval": {"task": TASK,
                                               "include_path": lmms_suite["tasks"]["single"]}}]}))
    # the task's own aggregations (of MME's and MMMU's kinds: tests/lmms_reference.py)
    (root / "sweep-own.yaml").write_text(yaml.safe_dump({
        "name": "vqa-own", "checkpoints": [ckpts], "output": "results", "workers": 1,
        "bootstrap": {"replicates": 300},
        "evals": [{"name": "own", "batch_size": 16,
                   "lmms_eval": {"task": OWN_TASK, "include_path": lmms_suite["tasks"]["own"]}}]}))
    return root


@pytest.fixture(scope="module")
def reference(lmms_suite):
    """lmms-eval's own run at batch size 1 (``python -m lmms_eval``, tests/lmms_reference.py)."""
    return lmms_suite["reference"]["single"]


def _theirs(reference, key: str) -> float:
    return reference["results"][key]


def test_the_reference_is_not_degenerate(reference):
    """Different texts per document, and the filters change a metric."""
    texts = [s["filtered_resps"] for s in reference["samples"]["none"]]
    assert reference["n"] == N and len(set(texts)) > N // 2
    assert _theirs(reference, "upper_chars,none") != _theirs(reference, "upper_chars,lower")


@pytest.mark.parametrize("batch_size", [1, 16])
def test_one_process_equals_lmms_eval(example, reference, batch_size):
    sweep = load_sweep(str(example / "sweep.yaml"))
    for _, ev, _, decode, p, metrics in single_process_passes(sweep):
        for table in read_batches(ev.data, ev.spec.dataset, batch_size):
            x, y, buckets = decode(table)
            p.update(x, y, buckets)
        p.finish()
        results = finalize(metrics, p.states, ev.output_size, ev.spec.bootstrap)
        assert sorted(results) == sorted(f"{m},{f}" for m in METRICS for f in FILTERS)
        for key, r in results.items():
            assert float(r.value) == pytest.approx(_theirs(reference, key), abs=1e-12), key


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """A tiny untrained LLaVA, the task over the same items, and lmms-eval's own LLaVA model
    (``--model llava_hf``, float32, batch 1) run on them."""
    import lmms_reference as ref
    from vlm_support import build_tiny_llava, easy_vqa_items, item_texts

    root = tmp_path_factory.mktemp("lmms_llava")
    folder = build_tiny_llava(root / "ckpts" / "checkpoint-1",
                              item_texts(easy_vqa_items("train", n=500)))
    tasks_dir = str(root / "tasks")
    ref.write_task(tasks_dir, easy_vqa_items("test", n=N, seed=0))
    theirs = ref.run_lmms_eval(folder, tasks_dir, model="llava_hf",
                               output=str(root / "reference"))
    (root / "sweep.yaml").write_text(yaml.safe_dump({
        "name": "vqa-llava", "checkpoints": ["ckpts/checkpoint-*"], "output": "results",
        "workers": 1, "evals": [{"name": "vqa", "batch_size": 16, "lmms_eval": {
            "task": TASK, "include_path": tasks_dir, "model_name": "llava_hf"}}]}))
    return root, theirs


@pytest.mark.parametrize("batch_size", [1, 16])
def test_llava_in_one_process_equals_lmms_evals_llava_hf(llava, batch_size):
    """LLaVA against lmms-eval's own LLaVA model (``llava_hf``), not its generic one."""
    root, theirs = llava
    texts = [s["filtered_resps"] for s in theirs["samples"]["none"]]
    assert theirs["n"] == N and len(set(texts)) > N // 2          # the texts differ
    sweep = load_sweep(str(root / "sweep.yaml"))
    for _, ev, model, decode, p, metrics in single_process_passes(sweep):
        assert type(model).__name__ == "LlavaForConditionalGeneration"
        for table in read_batches(ev.data, ev.spec.dataset, batch_size):
            p.update(*decode(table))
        p.finish()
        results = finalize(metrics, p.states, ev.output_size, ev.spec.bootstrap)
        assert sorted(results) == sorted(f"{m},{f}" for m in METRICS for f in FILTERS)
        for key, r in results.items():
            assert float(r.value) == pytest.approx(theirs["results"][key], abs=1e-12), key


@pytest.fixture(scope="module")
def ray_stores(example, standing):
    from rayeval.execution.driver import run_sweep

    """{workers: the store of sweep.yaml's run}; sweep-own.yaml's run beside it in
    ``own{workers}``."""
    stores = {}
    for workers in (1, 2, 3):
        for name, out in (("sweep.yaml", f"store{workers}"), ("sweep-own.yaml", f"own{workers}")):
            sweep = load_sweep(str(example / name))
            report = run_sweep(dataclasses.replace(sweep, workers=workers,
                                                   output=str(example / out)), standing=standing)
            assert all(o.ok for o in report.outcomes), report.outcomes
        stores[workers] = example / f"store{workers}"
    return stores


@pytest.mark.ray
def test_ray_runs_with_1_2_and_3_workers_equal_lmms_eval(reference, ray_stores):
    runs = {}
    for workers, out in ray_stores.items():
        rows = latest_rows(ResultStore(str(out)).read())
        assert sorted(r["metric"] for r in rows) == sorted(
            f"{m},{f}" for m in METRICS for f in FILTERS)
        for r in rows:
            assert r["world_size"] == workers and r["num_samples"] == N
            assert r["value"] == pytest.approx(_theirs(reference, r["metric"]), abs=1e-12)
            assert r["ci_low"] <= r["value"] <= r["ci_high"]
        runs[workers] = {r["metric"]: r for r in rows}
    for workers in (2, 3):                     # the intervals do not depend on the workers
        for key, r in runs[workers].items():
            for k in ("value", "ci_low", "ci_high"):
                assert r[k] == runs[1][key][k], (workers, key, k)


@pytest.mark.ray
def test_own_aggregations_equal_lmms_eval_on_1_2_and_3_workers(lmms_suite, ray_stores):
    """lmms-eval's ``*_aggregate_results`` kinds (MME's pairs, MMMU's per-subject mean), run
    by rayeval over every worker's records in document order: lmms-eval's figures, and the
    same intervals for any worker count."""
    theirs = lmms_suite["reference"]["own"]
    assert theirs["n"] == N
    values = {m: theirs["results"][f"{m},none"] for m in OWN_METRICS}
    assert 0 < values["subjects"] < 1 and 0 < values["pairs"] < 200    # not degenerate
    runs = {}
    for workers, out in ray_stores.items():
        rows = latest_rows(ResultStore(str(out.parent / f"own{workers}")).read())
        assert sorted(r["metric"] for r in rows) == sorted(OWN_METRICS)
        for r in rows:
            assert r["num_samples"] == N and r["world_size"] == workers
            assert r["value"] == pytest.approx(values[r["metric"]], rel=1e-12)
            assert r["ci_low"] <= r["value"] <= r["ci_high"] and r["ci_low"] < r["ci_high"]
        runs[workers] = {r["metric"]: (r["value"], r["ci_low"], r["ci_high"],
                                       list(r["replicates"])) for r in rows}
    assert runs[1] == runs[2] == runs[3]


@pytest.mark.ray
def test_per_item_records_equal_lmms_eval_samples(example, reference, ray_stores):
    import rayeval

    for workers, out in ray_stores.items():
        records = rayeval.samples(str(out), checkpoint="checkpoint-1", evaluation="vqa").to_pylist()
        assert sorted(r["id"] for r in records) == list(range(N))       # each once
        for r in records:
            theirs = {f: reference["samples"][f][r["id"]] for f in FILTERS}
            assert theirs["none"]["doc_id"] == r["id"]
            assert r["context"] == theirs["none"]["input"]
            assert r["target"] == theirs["none"]["target"]
            assert r["response"] == theirs["none"]["filtered_resps"]     # the generated text
            for f in FILTERS:
                for m in METRICS:
                    assert r[f"{m},{f}"] == theirs[f][m], (workers, r["id"], m, f)


# --- multiple_choice: lmms-eval's llava_hf losses, its process_results ---------------------

@pytest.fixture(scope="module")
def choices(llava):
    """Two ``multiple_choice`` tasks over the same items (tests/lmms_reference.py: an image
    task, and a text task without doc_to_visual) and lmms-eval's own run of them on the tiny
    LLaVA (``--model llava_hf --force_simple``, the form lmms-eval scores choices with; its
    0.7.3 choice path fixed in the reference's process: ``_patch_choice_scoring``)."""
    import lmms_reference as ref
    from vlm_support import easy_vqa_items

    root, _ = llava
    tasks_dir = str(root / "choice_tasks")
    ref.write_choice_tasks(tasks_dir, easy_vqa_items("test", n=N, seed=0))
    output = str(root / "choice_reference")
    ref.run_cli(str(root / "ckpts" / "checkpoint-1"), tasks_dir,
                [ref.CHOICE_TASK, ref.TEXT_CHOICE_TASK], output, model="llava_hf", simple=True)
    theirs = {t: ref.read_output(output, t, filters=("none",))
              for t in (ref.CHOICE_TASK, ref.TEXT_CHOICE_TASK)}
    (root / "sweep-choices.yaml").write_text(yaml.safe_dump({      # an evaluation per task
        "name": "choices", "checkpoints": ["ckpts/checkpoint-*"], "output": "results",
        "workers": 1, "evals": [{"name": task, "batch_size": 16,
                                 "lmms_eval": {"task": task, "include_path": tasks_dir}}
                                for task in theirs]}))
    return root, theirs


def _picked(sample) -> int:
    """The choice lmms-eval's process_results picks for a logged sample: its lowest loss (the
    log holds each (loss, is_greedy) as text)."""
    losses = [float(str(r[0]).strip("[]'\"")) for r in sample["filtered_resps"]]
    return min(range(len(losses)), key=lambda j: (losses[j], j))


def test_the_choice_references_are_not_degenerate(choices):
    """lmms-eval scored every document, its picks differ from document to document, and the
    two normalisations disagree somewhere (acc against acc_norm)."""
    _, theirs = choices
    for ref in theirs.values():
        assert ref["n"] == N
        picks = [_picked(s) for s in ref["samples"]["none"]]
        assert len(set(picks)) > 1
    assert any(ref["results"]["acc,none"] != ref["results"]["acc_norm,none"]
               for ref in theirs.values())


@pytest.mark.parametrize("batch_size", [1, 16])
def test_choice_tasks_in_one_process_equal_lmms_evals_llava_hf(choices, batch_size):
    root, theirs = choices
    sweep = load_sweep(str(root / "sweep-choices.yaml"))
    done = []
    for _, ev, model, decode, p, metrics in single_process_passes(sweep):
        ref = theirs[ev.spec.name]
        done.append(ev.spec.name)
        assert type(model).__name__ == "LlavaForConditionalGeneration"
        for table in read_batches(ev.data, ev.spec.dataset, batch_size):
            p.update(*decode(table))
        p.finish()
        results = finalize(metrics, p.states, ev.output_size, ev.spec.bootstrap)
        assert sorted(results) == ["acc", "acc_norm"]
        for key, r in results.items():
            assert float(r.value) == pytest.approx(ref["results"][f"{key},none"],
                                                   abs=1e-12), (ev.spec.name, key)
    assert sorted(done) == sorted(theirs)


@pytest.mark.ray
def test_choice_tasks_on_1_and_3_workers_equal_lmms_eval_item_by_item(choices, standing):
    """On one real local Ray, 1 and 3 workers: lmms-eval's figures, the same intervals for
    both, and each document once, its record's metric values lmms-eval's and its response the
    choice lmms-eval picked."""
    import runpy

    import rayeval
    from rayeval.execution.driver import run_sweep
    from vlm_support import easy_vqa_items

    root, theirs = choices
    items = easy_vqa_items("test", n=N, seed=0)
    doc_to_choice = runpy.run_path(str(root / "choice_tasks" / "choice_utils.py"))["doc_to_choice"]
    sweep = load_sweep(str(root / "sweep-choices.yaml"))
    stores = {}
    for workers in (1, 3):
        stores[workers] = out = root / f"choices-{workers}"
        report = run_sweep(dataclasses.replace(sweep, workers=workers, output=str(out)),
                           standing=standing)
        assert all(o.ok for o in report.outcomes), report.outcomes
    for task, ref in theirs.items():
        runs = {}
        for workers, out in stores.items():
            rows = [r for r in latest_rows(ResultStore(str(out)).read()) if r["evaluation"] == task]
            assert sorted(r["metric"] for r in rows) == ["acc", "acc_norm"]
            for r in rows:
                assert r["world_size"] == workers and r["num_samples"] == N
                assert r["value"] == pytest.approx(ref["results"][f"{r['metric']},none"],
                                                   abs=1e-12)
            runs[workers] = {r["metric"]: (r["value"], r["ci_low"], r["ci_high"]) for r in rows}
            records = rayeval.samples(str(out), checkpoint="checkpoint-1",
                                      evaluation=task).to_pylist()
            assert sorted(r["id"] for r in records) == list(range(N))     # each once
            for r in records:
                sample = ref["samples"]["none"][r["id"]]
                assert sample["doc_id"] == r["id"]
                assert r["context"] == sample["input"]
                options = doc_to_choice(items[r["id"]])           # the task's own choices
                assert r["response"] == options[_picked(sample)]
                assert r["acc"] == sample["acc"] and r["acc_norm"] == sample["acc_norm"]
        assert runs[1] == runs[3], task
