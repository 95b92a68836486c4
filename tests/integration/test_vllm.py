"""model.backend: vllm on a real local Ray: one engine per worker for the sweep, weights
swapped in place (and back: a stale engine would show), tensor-parallel engines over the
group's ranks, sampling seeded per item so that 1 and 2 workers generate the same, and the
engine's failures. The reference is the Hugging Face backend on the same checkpoints (itself
checked against lm-evaluation-harness in test_text_tasks)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil

import pytest
import yaml

from harness import write_tasks
from support import local_ray, need_vllm, rayeval_cli

import rayeval
from rayeval.errors import SpecError

pytestmark = pytest.mark.vllm

need_vllm()


@pytest.fixture(scope="module")
def example(tmp_path_factory, lm_example):
    """Steps 30 and 300 of the tiny GPT-2, step 400 a copy of step 30 (evaluated after 300:
    the engine goes A, B, then A again), and step 500 a model of one layer fewer. The GPT-2
    is the run's one training of it (``lm_example``, tests/conftest.py), copied here."""
    out = tmp_path_factory.mktemp("vllm")
    built = lm_example(out)
    ckpts = out / "ckpts"
    first, second = sorted(built["checkpoints"], key=lambda p: int(p.rsplit("-", 1)[1]))
    shutil.copytree(first, ckpts / "checkpoint-400")
    _one_layer(first, str(ckpts / "checkpoint-500"))
    write_tasks(str(out / "tasks"), str(out / "data"), until=("\n",), max_new_tokens=6)
    _sampled_task(out / "tasks")
    return {"root": out, "A": first, "B": second,
            "A again": str(ckpts / "checkpoint-400"), "other": str(ckpts / "checkpoint-500")}


def _sampled_task(tasks) -> None:
    """rayeval_gen sampled 3 times per document, scored by majority vote (maj@3), as
    lm-eval's self-consistency tasks do."""
    text = (tasks / "rayeval_gen.yaml").read_text()
    text = text.replace("task: rayeval_gen\n", "task: rayeval_gen_maj\nrepeats: 3\n")
    text = text.replace("  do_sample: false\n", "  do_sample: true\n  temperature: 1.0\n")
    text = text.replace("      - function: remove_whitespace\n",
                        "      - function: remove_whitespace\n"
                        "      - function: majority_vote\n")
    assert "majority_vote" in text and "repeats: 3" in text
    (tasks / "rayeval_gen_maj.yaml").write_text(text)


def _one_layer(source: str, target: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source)
    model.config.n_layer = 1
    smaller = type(model)(model.config)
    smaller.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)


def _sweep(example, name: str, *, checkpoints, workers: int, backend: str = "vllm",
           generation=None, tensor: int = 1, vllm=None, lm_eval: str | None = "rayeval_gen"
           ) -> str:
    root = example["root"]
    evals = [{"name": "sums", "task": "generation", "samples": True,
              "dataset": {"path": "data/gen.parquet", "prompt": "prompt", "target": "answer",
                          "id": "id"},
              "generation": generation or {"until": ["\n"], "max_new_tokens": 6},
              "metrics": ["exact_match"]}]
    if lm_eval:
        evals.append({"name": "lm_sums", "samples": True,
                      "lm_eval": {"task": lm_eval, "include_path": "tasks"}})
    sweep = {"name": name, "checkpoints": checkpoints, "workers": workers,
             "output": f"store_{name}", "bootstrap": {"replicates": 0}, "evals": evals,
             "model": {"backend": backend}}
    if backend == "vllm":
        sweep["model"]["vllm"] = {"max_model_len": 64, "enforce_eager": True, **(vllm or {})}
    if tensor > 1:
        sweep["parallelism"] = {"tensor": tensor}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return str(path)


def _run(path: str, *extra: str, env: dict | None = None):
    proc = rayeval_cli("run", path, *extra, timeout=900,
                       env={**os.environ, **env} if env else None)
    return proc


def _records(store: str, checkpoint: str, evaluation: str, column: str = "response") -> dict:
    table = rayeval.samples(store, checkpoint=os.path.basename(checkpoint),
                            evaluation=evaluation)
    return {r["id"]: r[column] for r in table.to_pylist()}


def _values(store: str) -> dict:
    return {(os.path.basename(r["checkpoint"]), r["evaluation"], r["metric"]): r["value"]
            for r in rayeval.results(store).to_pylist()}


@pytest.fixture(scope="module")
def runs(example):
    """Every successful-or-partly-failed run of the module on one local Ray (rayeval.run, what
    `rayeval run` calls; a Ray start per run as a subprocess cost 10-20 s more each): the
    Hugging Face backend (1 worker) and vLLM with one tensor-parallel engine over 2 workers
    on A, B, A again and the one-layer checkpoint; sampled generation on B with 1 and 2
    workers. {name: (store, report)}."""
    ckpts = [example["A"], example["B"], example["A again"], example["other"]]
    gen = {"until": ["\n"], "max_new_tokens": 6, "temperature": 1.0, "repeats": 3, "seed": 7}
    sweeps = {name: _sweep(example, name, checkpoints=ckpts, **kw) for name, kw in (
        ("hf", {"backend": "hf", "workers": 1}), ("tp", {"workers": 2, "tensor": 2}))}
    for workers in (1, 2):
        sweeps[f"sampled{workers}"] = _sweep(example, f"sampled{workers}",
                                             checkpoints=[example["B"]], workers=workers,
                                             generation=gen, lm_eval="rayeval_gen_maj")
    out = {}
    with local_ray():
        for name, path in sweeps.items():
            store = str(example["root"] / f"store_{name}")
            if name != "tp":
                out[name] = (store, rayeval.run(path))
                continue
            # the progress lines as `rayeval run` prints them, a line every half second:
            # the engine's start (~3 s) is seen in them
            lines, before = io.StringIO(), os.environ.get("RAYEVAL_PROGRESS_INTERVAL_S")
            os.environ["RAYEVAL_PROGRESS_INTERVAL_S"] = "0.5"
            try:
                with contextlib.redirect_stderr(lines):
                    out[name] = (store, rayeval.run(path, progress=True))
            finally:
                if before is None:
                    os.environ.pop("RAYEVAL_PROGRESS_INTERVAL_S")
                else:
                    os.environ["RAYEVAL_PROGRESS_INTERVAL_S"] = before
            out["tp progress"] = lines.getvalue()
    return out


@pytest.fixture(scope="module")
def greedy(runs):
    return {name: runs[name] for name in ("hf", "tp", "tp progress")}


@pytest.mark.ray
def test_vllm_greedy_generations_equal_the_hf_backend_through_swaps_and_back(example, greedy):
    (hf, hf_report), (tp, _) = greedy["hf"], greedy["tp"]
    assert hf_report.outcomes and not hf_report.failures, hf_report.failures  # any config
    for evaluation in ("sums", "lm_sums"):
        for which in ("A", "B", "A again"):
            ours = _records(tp, example[which], evaluation)
            theirs = _records(hf, example[which], evaluation)
            assert len(ours) == len(theirs) == 40
            differ = [i for i in ours if ours[i] != theirs[i]]
            assert not differ, (evaluation, which, [(ours[i], theirs[i]) for i in differ][:3])
        # A again after B: the engine serves A's weights again, not B's
        assert _records(tp, example["A again"], evaluation) == \
            _records(tp, example["A"], evaluation)
        assert _records(tp, example["A"], evaluation) != \
            _records(tp, example["B"], evaluation)
    ours, theirs = _values(tp), _values(hf)
    for key, value in theirs.items():
        if key[0] != "checkpoint-500":
            assert ours[key] == value, key
    # while no row moved, the progress line said what the workers were doing
    progress = greedy["tp progress"]
    said = [ln for ln in progress.splitlines() if "starting the vLLM engine" in ln]
    assert said and "of rows, starting the vLLM engine" in said[0], progress[-3000:]


@pytest.mark.ray
def test_a_checkpoint_the_engine_cannot_hold_fails_its_own_cells(example, greedy):
    tp, report = greedy["tp"]
    failed = {(os.path.basename(o.checkpoint), o.evaluation) for o in report.failures}
    assert failed and {c for c, _ in failed} == {"checkpoint-500"}, report.failures
    rows = {(os.path.basename(r["checkpoint"]), r["evaluation"])
            for r in rayeval.results(tp).to_pylist()}
    assert ("checkpoint-500", "sums") not in rows
    assert {(os.path.basename(example[c]), e) for c in ("A", "B", "A again")
            for e in ("sums", "lm_sums")} <= rows
    text = "\n".join(f"{o.checkpoint}: {o.error}" for o in report.failures)
    assert "checkpoint-500" in text and "n_layer 1" in text, text
    assert "differs from the vLLM engine's" in text


@pytest.mark.ray
def test_sampled_generations_are_the_same_on_1_and_2_workers(example, runs):
    stores = {}
    for workers in (1, 2):
        store, report = runs[f"sampled{workers}"]
        assert report.outcomes and not report.failures, report.failures
        stores[workers] = store
    one, two = (_records(stores[w], example["B"], "sums", "responses") for w in (1, 2))
    assert len(one) == 40 and one == two
    assert all(isinstance(r, list) and len(r) == 3 for r in one.values())
    assert any(len(set(r)) > 1 for r in one.values())      # they really are sampled
    assert _records(stores[1], example["B"], "sums") == {i: r[0] for i, r in one.items()}
    # lm-eval's maj@3: three seeded samples per document, voted by lm-eval's own filter
    one, two = (_records(stores[w], example["B"], "lm_sums", "responses") for w in (1, 2))
    assert len(one) == 40 and one == two and all(len(r) == 3 for r in one.values())
    assert _records(stores[1], example["B"], "lm_sums") == \
        _records(stores[2], example["B"], "lm_sums")
    values = _values(stores[1])
    assert values == _values(stores[2])
    assert ("checkpoint-300", "lm_sums", "exact_match") in values


@pytest.mark.ray
def test_an_engine_that_cannot_start_is_one_line_naming_the_key(example):
    path = _sweep(example, "nostart", checkpoints=[example["A"]], workers=1,
                  vllm={"max_model_len": 4096}, lm_eval=None)
    proc = _run(path)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and proc.stderr.strip().endswith(errors[0]), proc.stderr
    assert "model.vllm.max_model_len" in errors[0] and "4096" in errors[0], errors[0]
    assert "failed:" not in proc.stdout + proc.stderr       # no checkpoint marked failed
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not os.path.exists(example["root"] / "store_nostart") or \
        rayeval.results(str(example["root"] / "store_nostart")).num_rows == 0


@pytest.mark.parametrize("model, extra, where, says", [
    ({"backend": "tgi"}, {}, "model.backend", "choose one of: hf, vllm"),
    ({"backend": "vllm", "factory": "m:f"}, {}, "model.backend", "remove model.factory"),
    ({"backend": "vllm", "vllm": {"max_model_lenn": 64}}, {}, "model.vllm.max_model_lenn",
     "did you mean 'max_model_len'"),
    ({"backend": "vllm", "vllm": {"tensor_parallel_size": 2}}, {},
     "model.vllm.tensor_parallel_size", "use parallelism.tensor"),
    ({"vllm": {"enforce_eager": True}}, {}, "model.vllm", "set it, or remove model.vllm"),
    ({"backend": "vllm"}, {"generation": {"repeats": 4}}, "evals[0].generation.repeats",
     "set generation.temperature"),
    ({}, {"parallelism": {"tensor": 2}, "workers": 2}, "parallelism.tensor", "vLLM's"),
    ({"backend": "vllm"}, {"parallelism": {"tensor": 2}, "workers": 3}, "parallelism.tensor",
     "does not divide workers"),
])
def test_bad_backend_settings_are_one_line_before_ray(example, tmp_path, model, extra, where,
                                                      says):
    sweep = {"name": "bad", "checkpoints": [example["A"]], "output": str(tmp_path / "out"),
             "model": model,
             "evals": [{"name": "sums", "task": "generation",
                        "dataset": {"path": str(example["root"] / "data/gen.parquet"),
                                    "prompt": "prompt", "target": "answer",
                                    **extra.pop("dataset", {})},
                        "generation": {"until": ["\n"], **extra.pop("generation", {})},
                        "metrics": ["exact_match"]}], **extra}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(sweep))
    with pytest.raises(SpecError) as info:
        rayeval.load_sweep(str(path))
    message = str(info.value)
    assert f": {where}:" in message and says in message, message
    assert "\n" not in message
    assert not (tmp_path / "out").exists()


def test_a_tensor_parallel_engine_refuses_rows_from_ray_data_before_ray(example, tmp_path):
    """An engine's ranks must generate the same prompts: Ray Data splits per rank."""
    from rayeval.plan.preflight import prepare

    sweep = {"name": "tp-data", "checkpoints": [example["A"]], "output": str(tmp_path / "out"),
             "workers": 2, "model": {"backend": "vllm"}, "parallelism": {"tensor": 2},
             "evals": [{"name": "sums", "task": "generation",
                        "dataset": {"path": str(example["root"] / "data/gen.parquet"),
                                    "prompt": "prompt", "target": "answer", "cpus": 1},
                        "generation": {"max_new_tokens": 6}, "metrics": ["exact_match"]}]}
    path = tmp_path / "tp.yaml"
    path.write_text(yaml.safe_dump(sweep))
    with pytest.raises(SpecError) as info:
        prepare(rayeval.load_sweep(str(path)))
    assert "parallelism.tensor" in str(info.value) and "evals[0].dataset" in str(info.value)
    assert "\n" not in str(info.value)
