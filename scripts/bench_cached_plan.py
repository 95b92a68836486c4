"""Benchmark: a fully cached ``rayeval run`` (every cell already in the store), with and
without lm-eval entries.

Builds the tiny language-model example once (scripts/make_lm_example.py, 2 checkpoints) and
beside it a folder of lm-eval task YAMLs over its items (a multiple-choice task whose
``process_docs`` is a ``utils.py`` function, a generation task with two filters, and a group of
two tasks), then two sweeps over the same checkpoints:

    plain    the example's own sweep.yaml (three built-in evaluations)
    lm_eval  the same three plus four lm-eval entries (a task, a generation task, a group,
             a task with limit:)

Each sweep is run once to fill the store (not timed), then ``python -m rayeval run SWEEP``
again N times: every cell is in the store, so a run only plans. The median wall time of each
is printed (and the spread), with ``--profile``'s phase lines of the last run.

    python scripts/bench_cached_plan.py [--out DIR] [--runs 5] [--sweeps plain,lm_eval]
        [--trees OLD_CHECKOUT,NEW_CHECKOUT] [--json FILE]

Wall time on a shared 2-core machine moves with the other processes' load (printed at the
end); the CPU time of each run (user + system, its children's included) moves less and is
printed beside it. --trees alternates runs between rayeval checkouts (a before/after).

--out reuses a folder an earlier call built (the example is built only when it is missing).
Target (issue 47): a fully cached run <= 1.5 s, with or without lm-eval entries.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}

UTILS = ("def add_question(dataset):\n"
         "    return dataset.map(lambda d: {'question': 'Q: ' + d['prompt']})\n\n\n"
         "def even_ids(dataset):\n"
         "    return dataset.filter(lambda d: d['id'] % 2 == 0)\n")


def _task(name: str, data: str, output_type: str, body: dict) -> dict:
    return {"task": name, "dataset_path": "parquet",
            "dataset_kwargs": {"data_files": {"train": data, "test": data}},
            "test_split": "test", "fewshot_split": "train", "output_type": output_type,
            "metadata": {"version": 1.0}, **body}


def write_tasks(folder: str, data: str) -> None:
    """lm-eval task YAMLs over the example's items (data: its data/ folder)."""
    import yaml

    os.makedirs(folder, exist_ok=True)
    mc_metrics = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                  {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]
    mc = _task("arith_mc", f"{data}/mc.parquet", "multiple_choice", {
        "num_fewshot": 2, "doc_to_text": "{{question}} A:", "doc_to_choice": "choices",
        "doc_to_target": "label", "metric_list": mc_metrics})
    half = _task("arith_half", f"{data}/mc.parquet", "multiple_choice", {
        "doc_to_text": "Question: {{prompt}}\nAnswer:", "doc_to_choice": "choices",
        "doc_to_target": "label", "metric_list": mc_metrics})
    gen = _task("arith_gen", f"{data}/gen.parquet", "generate_until", {
        "num_fewshot": 1, "doc_to_text": "{{prompt}}", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False},
        "filter_list": [
            {"name": "strict", "filter": [{"function": "regex", "regex_pattern": r"^\s*(\d)"},
                                          {"function": "take_first"}]},
            {"name": "loose", "filter": [{"function": "remove_whitespace"},
                                         {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                         "higher_is_better": True, "ignore_case": True}]})
    group = {"group": "arith_group", "task": ["arith_mc", "arith_half"],
             "aggregate_metric_list": [
                 {"metric": "acc", "aggregation": "mean", "weight_by_size": True}],
             "metadata": {"version": 1.0}}
    with open(os.path.join(folder, "utils.py"), "w") as f:
        f.write(UTILS)
    for name, body, tail in (("arith_mc", mc, "process_docs: !function utils.add_question\n"),
                             ("arith_half", half, "process_docs: !function utils.even_ids\n"),
                             ("arith_gen", gen, ""), ("arith_group", group, "")):
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            f.write(yaml.safe_dump(body, sort_keys=False) + tail)


def build(out: str) -> dict[str, str]:
    """The example and both sweeps under ``out`` (built only when missing)."""
    import yaml

    if not os.path.isdir(os.path.join(out, "ckpts")):
        sys.path.insert(0, HERE)
        import make_lm_example

        make_lm_example.build(out, checkpoints=2)
    write_tasks(os.path.join(out, "tasks"), os.path.join(out, "data"))
    with open(os.path.join(out, "sweep.yaml")) as f:
        sweep = yaml.safe_load(f)
    sweep["output"] = "results"
    evals = list(sweep["evals"]) + [
        {"name": "arith_mc", "lm_eval": {"task": "arith_mc", "include_path": "tasks"}},
        {"name": "arith_gen", "lm_eval": {"task": "arith_gen", "include_path": "tasks"}},
        {"name": "grp", "lm_eval": {"task": "arith_group", "include_path": "tasks",
                                    "num_fewshot": 3}},
        {"name": "arith_mc_limited", "lm_eval": {"task": "arith_mc", "include_path": "tasks",
                                                 "limit": 0.25}}]
    with open(os.path.join(out, "sweep_lm_eval.yaml"), "w") as f:
        yaml.safe_dump({**sweep, "evals": evals}, f, sort_keys=False)
    return {"plain": os.path.join(out, "sweep.yaml"),
            "lm_eval": os.path.join(out, "sweep_lm_eval.yaml")}


def _run(sweep: str, *extra: str, tree: str | None = None) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, output) of one ``rayeval run``; ``tree``: a rayeval
    checkout to run instead of the installed one (put first on PYTHONPATH)."""
    env = {**os.environ, **OFFLINE}
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rayeval", "run", sweep, *extra],
                          cwd=os.path.dirname(sweep), env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        sys.exit(f"rayeval run {sweep} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, cpu, done.stdout + done.stderr


def _median(values) -> float:
    return round(statistics.median(values), 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the folder to build in (kept); default: a temporary one")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sweeps", default="plain,lm_eval")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--trees", help="rayeval checkouts to compare, comma-separated (each put "
                                    "first on PYTHONPATH; runs alternate between them); "
                                    "default: the installed rayeval")
    args = ap.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="rayeval-cached-plan-")
    trees = args.trees.split(",") if args.trees else [None]
    try:
        sweeps = build(out)
        figures = {}
        for name in args.sweeps.split(","):
            for tree in trees:
                _run(sweeps[name], tree=tree)           # fills the store, keeps renderings
            runs: dict = {tree: [] for tree in trees}
            last = {}
            for _ in range(args.runs):
                for tree in trees:                      # alternating: a load drift hits all
                    seconds, cpu, last[tree] = _run(sweeps[name], "--profile", tree=tree)
                    runs[tree].append((seconds, cpu))
            for tree in trees:
                if not re.search(r"^0 cell\(s\) evaluated", last[tree], re.M):
                    sys.exit(f"{name}: the re-run evaluated cells:\n{last[tree][-2000:]}")
                wall = [w for w, _ in runs[tree]]
                cpu = [c for _, c in runs[tree]]
                label = f"{name}" + (f" [{tree}]" if tree else "")
                figures[label] = {"median_s": _median(wall), "min_s": round(min(wall), 2),
                                  "max_s": round(max(wall), 2), "cpu_median_s": _median(cpu),
                                  "runs": len(wall)}
                print(f"{label}: cached re-run median {_median(wall):.2f} s wall (min "
                      f"{min(wall):.2f}, max {max(wall):.2f}), {_median(cpu):.2f} s CPU; "
                      f"{len(wall)} runs", flush=True)
                print("   " + "\n   ".join(
                    line for line in last[tree].splitlines()
                    if line.startswith("profile") or re.match(r"^ +\d+\.\d+ s  ", line)),
                    flush=True)
        print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=1)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
