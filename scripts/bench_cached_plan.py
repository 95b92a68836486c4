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

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

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


def _run(sweep: str, *extra: str, tree: str | None = None) -> benchkit.Ran:
    """One ``rayeval run`` (wall and CPU seconds, output); ``tree``: a rayeval checkout to run
    instead of the installed one (put first on PYTHONPATH)."""
    return benchkit.run([sys.executable, "-m", "rayeval", "run", sweep, *extra],
                        cwd=os.path.dirname(sweep), env=benchkit.env(tree, **benchkit.OFFLINE),
                        what=f"rayeval run {sweep}")


def main(argv=None) -> int:
    ap = benchkit.parser(__doc__, repeats=5, flag="--runs")
    ap.add_argument("--out", help="the folder to build in (kept); default: a temporary one")
    ap.add_argument("--sweeps", default="plain,lm_eval")
    ap.add_argument("--trees", help="rayeval checkouts to compare, comma-separated (each put "
                                    "first on PYTHONPATH; runs alternate between them); "
                                    "default: the installed rayeval")
    args = ap.parse_args(argv)
    trees = args.trees.split(",") if args.trees else [None]
    with benchkit.workdir("rayeval-cached-plan-", args.out) as out:
        sweeps = build(out)
        figures = {}
        for name in args.sweeps.split(","):
            for tree in trees:
                _run(sweeps[name], tree=tree)           # fills the store, keeps renderings
            runs: dict = {tree: [] for tree in trees}
            last = {}
            for _ in range(args.runs):
                for tree in trees:                      # alternating: a load drift hits all
                    ran = _run(sweeps[name], "--profile", tree=tree)
                    runs[tree].append((ran.seconds, ran.cpu_s))
                    last[tree] = ran.stdout + ran.stderr
            for tree in trees:
                if not re.search(r"^0 cell\(s\) evaluated", last[tree], re.M):
                    sys.exit(f"{name}: the re-run evaluated cells:\n{last[tree][-2000:]}")
                wall = benchkit.spread([w for w, _ in runs[tree]], 2)
                cpu = benchkit.spread([c for _, c in runs[tree]], 2)
                label = f"{name}" + (f" [{tree}]" if tree else "")
                figures[label] = {"median_s": wall["median"], "min_s": wall["min"],
                                  "max_s": wall["max"], "cpu_median_s": cpu["median"],
                                  "runs": len(runs[tree])}
                print(f"{label}: cached re-run median {wall['median']:.2f} s wall (min "
                      f"{wall['min']:.2f}, max {wall['max']:.2f}), {cpu['median']:.2f} s CPU; "
                      f"{len(runs[tree])} runs", flush=True)
                print("   " + "\n   ".join(
                    line for line in last[tree].splitlines()
                    if line.startswith("profile") or re.match(r"^ +\d+\.\d+ s  ", line)),
                    flush=True)
        print(f"load average: {benchkit.load()[0]:.1f} on {os.cpu_count()} cores", flush=True)
        benchkit.record(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
