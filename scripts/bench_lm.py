"""Benchmark: `rayeval run` against lm-evaluation-harness's command line run once per checkpoint.

One `lm_eval run` per checkpoint is what users do today. Both evaluate the same language-model
checkpoints on the same data, on the same machine.

The example of scripts/make_lm_example.py is built once with N checkpoints (a tiny GPT-2 saved
at N training steps, so their numbers differ; the build is timed but is part of neither
measurement). Then, on the same three tasks (multiple choice, rolling perplexity, greedy
generation):

    rayeval   one `python -m rayeval run sweep.yaml --workers W --output <new store>`, timed from
              launch to exit: Ray's start-up, every checkpoint, the bootstrap and the writes
    harness   one `python -m lm_eval run ...` per checkpoint (tests/harness.py builds the
              command), one after another with the same batch size (8); the sum of their wall
              times, and each one's

Each run starts from nothing: a new result store for rayeval and new task files (with their
own datasets cache) for the harness. With --runs R > 1 the two alternate, which one goes first
changing every run, so a drift in the machine's load falls on both; each run and the medians
are printed.

The numbers must agree: for every checkpoint, acc, acc_norm and exact_match exactly, and
word_perplexity, byte_perplexity and bits_per_byte within 1e-4 relative (float32 kernels differ
with the batch's padding), read from rayeval's result store and from the harness's results
JSON. Any difference is printed as a table and the script exits 1.

Target: rayeval's wall time at most half the harness's (ratio <= 0.5, on the medians).

    python scripts/bench_lm.py --checkpoints 8 [--workers 2] [--runs 3] [--out DIR]
                               [--json figures.json] [--marginal]

--marginal also times rayeval on one checkpoint, for its cost per further checkpoint with Ray's
start-up and the other fixed costs taken out: (T(N) - T(1)) / (N - 1).

Needs lm_eval (0.4.13), transformers and ray installed; nothing is downloaded.
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

REPO = benchkit.REPO
BATCH_SIZE = 8
TARGET = 0.5
REL = 1e-4
EXACT = ("acc", "acc_norm", "exact_match")

# (rayeval evaluation, metric) -> (harness task key in harness.TASKS, harness metric key). The
# harness names a metric by its filter: "none" unless the task has one (generation: "strip").
# token_perplexity is rayeval's alone, so it is not compared.
COMPARED = {
    ("facts_mc", "acc"): ("mc", "acc,none"),
    ("facts_mc", "acc_norm"): ("mc", "acc_norm,none"),
    ("docs", "word_perplexity"): ("docs", "word_perplexity,none"),
    ("docs", "byte_perplexity"): ("docs", "byte_perplexity,none"),
    ("docs", "bits_per_byte"): ("docs", "bits_per_byte,none"),
    ("sums", "exact_match"): ("gen", "exact_match,{gen_filter}"),
}


def _load_harness():
    # tests/harness.py puts the hub, datasets and transformers offline at import (setdefault
    # on os.environ), so the rayeval subprocess inherits the same settings as the harness's:
    # neither side may reach the network, and tokenizer threading is the same for both.
    sys.path.insert(0, os.path.join(REPO, "tests"))
    import harness
    return harness


def run_rayeval(sweep: str, store: str, workers: int, log: str) -> float:
    # cwd=REPO so `-m rayeval` is this checkout's package even where it is not installed.
    return benchkit.run([sys.executable, "-m", "rayeval", "run", sweep, "--workers",
                         str(workers), "--output", store], log=log, cwd=REPO).seconds


def run_harness(harness, checkpoints: list[str], data_dir: str, run_dir: str) -> list[float]:
    """One harness command per checkpoint, serially; the wall time of each. Each checkpoint
    gets its own output folder, so its results JSON is found without guessing how the harness
    mangles the model's path into a folder name."""
    task_dir = os.path.join(run_dir, "tasks")
    harness.write_tasks(task_dir, data_dir)
    env = harness.offline_env()
    times = []
    for i, folder in enumerate(checkpoints):
        out = os.path.join(run_dir, f"ckpt{i}")
        os.makedirs(out, exist_ok=True)
        cmd = harness.harness_cli_command(folder, task_dir, out, batch_size=BATCH_SIZE)
        times.append(benchkit.run(cmd, log=os.path.join(run_dir, f"ckpt{i}.log"), env=env,
                                  cwd=run_dir).seconds)
    return times


def one_checkpoint_sweep(sweep: str, folder: str) -> str:
    """A copy of sweep next to it that names only folder: rayeval's fixed cost (Ray, the
    worker group, the data) plus one checkpoint. Results' timestamps cannot stand in for it:
    rayeval interleaves cells of different checkpoints, so their write times do not mark
    where one checkpoint ends."""
    import yaml

    with open(sweep) as f:
        doc = yaml.safe_load(f)
    doc["checkpoints"] = [os.path.relpath(folder, os.path.dirname(sweep))]
    path = os.path.join(os.path.dirname(sweep), "sweep-one.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return path


def rayeval_values(store: str) -> dict:
    """{(checkpoint realpath, evaluation, metric): value} from the store."""
    from rayeval.ranking import latest_rows
    from rayeval.io.store import ResultStore

    return {(os.path.realpath(r["checkpoint"]), r["evaluation"], r["metric"]): r["value"]
            for r in latest_rows(ResultStore(store).read())}


def results_json(run_dir: str, i: int) -> dict:
    """The ``results`` of checkpoint i's lm-eval run (its own folder ``ckpt{i}``)."""
    found = sorted(glob.glob(os.path.join(run_dir, f"ckpt{i}", "**", "results_*.json"),
                             recursive=True), key=os.path.getmtime)
    if not found:
        sys.exit(f"no lm-eval results JSON under {os.path.join(run_dir, f'ckpt{i}')}")
    with open(found[-1]) as f:
        return json.load(f)["results"]


def harness_values(harness, checkpoints: list[str], run_dir: str) -> dict:
    values = {}
    for i, folder in enumerate(checkpoints):
        results = results_json(run_dir, i)
        for (evaluation, metric), (task, key) in COMPARED.items():
            key = key.format(gen_filter=harness.GEN_FILTER)
            value = results.get(harness.TASKS[task], {}).get(key)
            values[(os.path.realpath(folder), evaluation, metric)] = (
                None if value is None else float(value))
    return values


def compare(ours: dict, theirs: dict, checkpoints: list[str]) -> tuple[int, list[tuple]]:
    """(comparisons made, mismatches as (checkpoint, evaluation, metric, rayeval, harness))."""
    checked, bad = 0, []
    for folder in checkpoints:
        ck = os.path.realpath(folder)
        for evaluation, metric in COMPARED:
            a, b = ours.get((ck, evaluation, metric)), theirs.get((ck, evaluation, metric))
            checked += 1
            if a is None or b is None or math.isnan(a) or math.isnan(b):
                ok = False
            elif metric in EXACT:
                ok = a == b
            else:
                ok = math.isclose(a, b, rel_tol=REL)
            if not ok:
                bad.append((os.path.basename(folder), evaluation, metric, a, b))
    return checked, bad


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=1, flag="--runs")
    p.add_argument("--checkpoints", type=int, default=8, metavar="N",
                   help="checkpoints to build and evaluate (default 8)")
    p.add_argument("--workers", type=int, default=2, metavar="W",
                   help="rayeval's Ray Train workers (default 2)")
    p.add_argument("--out", metavar="DIR",
                   help="working folder (default: a temporary one, removed when all agree)")
    p.add_argument("--marginal", action="store_true",
                   help="also time rayeval on one checkpoint, for its cost per further "
                        "checkpoint: (T(N) - T(1)) / (N - 1), start-up excluded")
    args = p.parse_args(argv)
    if args.checkpoints < 1 or args.workers < 1 or args.runs < 1:
        p.error("--checkpoints, --workers and --runs must be at least 1")

    temporary = args.out is None
    root = os.path.abspath(args.out or tempfile.mkdtemp(prefix="rayeval-bench-lm-"))
    os.makedirs(root, exist_ok=True)
    harness = _load_harness()
    info = benchkit.machine()
    load_before = benchkit.load()

    print(f"building {args.checkpoints} checkpoints under {root} ...", flush=True)
    import make_lm_example

    # The builder spaces its saves evenly from a tenth of training to the end; enough steps
    # keep N saves distinct for any N.
    with benchkit.Stopwatch() as took:
        built = make_lm_example.build(os.path.join(root, "example"),
                                      checkpoints=args.checkpoints,
                                      steps=max(300, 2 * args.checkpoints))
    build_s = took.s
    checkpoints, steps = built["checkpoints"], built["steps"]
    if len(checkpoints) != args.checkpoints:
        sys.exit(f"asked for {args.checkpoints} checkpoints, the builder wrote {len(checkpoints)}")
    data_dir = os.path.dirname(built["mc"])
    marginal = args.marginal and args.checkpoints > 1
    if marginal:
        # The middle checkpoint: early ones generate more tokens before the stop string, late
        # ones fewer, so neither end stands for the typical one.
        sweep_one = one_checkpoint_sweep(built["sweep"], checkpoints[len(checkpoints) // 2])
    print(f"built in {build_s:.1f}s (steps {steps}); not part of either measurement", flush=True)

    runs = []
    checked_total, mismatches = 0, []
    for r in range(args.runs):
        run_dir = os.path.join(root, f"run{r}")
        os.makedirs(run_dir)
        store = os.path.join(run_dir, "rayeval-store")
        harness_dir = os.path.join(run_dir, "harness")
        os.makedirs(harness_dir)
        result = {"run": r + 1}
        order = benchkit.rotated(("rayeval", "harness"), r)
        if marginal:
            order += ("rayeval-one",)
        for which in order:
            print(f"run {r + 1}/{args.runs}: {which} ...", flush=True)
            if which == "rayeval":
                result["rayeval_s"] = run_rayeval(built["sweep"], store, args.workers,
                                                  os.path.join(run_dir, "rayeval.log"))
                print(f"  rayeval {result['rayeval_s']:.1f}s", flush=True)
            elif which == "rayeval-one":
                one_s = run_rayeval(sweep_one, os.path.join(run_dir, "rayeval-one-store"),
                                    args.workers, os.path.join(run_dir, "rayeval-one.log"))
                result["rayeval_one_s"] = one_s
                print(f"  rayeval on 1 checkpoint {one_s:.1f}s", flush=True)
            else:
                per = run_harness(harness, checkpoints, data_dir, harness_dir)
                result["harness_per_checkpoint_s"] = per
                result["harness_s"] = sum(per)
                print(f"  harness {result['harness_s']:.1f}s  ("
                      + ", ".join(f"{t:.1f}" for t in per) + ")", flush=True)
        result["ratio"] = result["rayeval_s"] / result["harness_s"]
        result["rayeval_marginal_s"] = (
            (result["rayeval_s"] - result["rayeval_one_s"]) / (args.checkpoints - 1)
            if marginal else None)
        checked, bad = compare(rayeval_values(store),
                               harness_values(harness, checkpoints, harness_dir),
                               checkpoints)
        checked_total += checked
        mismatches += [(r + 1, *m) for m in bad]
        result["mismatches"] = len(bad)
        runs.append(result)

    med_ray = statistics.median(x["rayeval_s"] for x in runs)
    med_harness = statistics.median(x["harness_s"] for x in runs)
    med_one = statistics.median(x["rayeval_one_s"] for x in runs) if marginal else None
    # From the medians, as printed, rather than the median of the runs' marginals: the two
    # printed times then give the printed marginal.
    med_marginal = (med_ray - med_one) / (args.checkpoints - 1) if marginal else None
    ratio = med_ray / med_harness
    n = args.checkpoints

    print()
    print("=" * 72)
    print(f"machine     {info['platform']}, Python {info['python']}")
    print(f"            {info['usable_cores']} usable cores ({info['cpu_count']} CPUs), "
          f"torch {info['torch_threads']} threads; load avg before {load_before}, "
          f"after {benchkit.load()}")
    print("            " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print(f"sweep       {n} checkpoints (steps {steps[0]}..{steps[-1]}) x 3 tasks "
          f"(facts_mc, docs, sums); rayeval --workers {args.workers}, batch size "
          f"{BATCH_SIZE} in both")
    print(f"build       {build_s:.1f}s (excluded)")
    if args.runs > 1:
        print()
        benchkit.table([(x["run"], f"{x['rayeval_s']:.1f}", f"{x['harness_s']:.1f}",
                         f"{x['harness_s'] / n:.1f}", f"{x['ratio']:.3f}",
                         "-" if x["rayeval_marginal_s"] is None
                         else f"{x['rayeval_marginal_s']:.1f}") for x in runs],
                       ("run", "rayeval s", "harness s", "per ckpt s", "ratio", "marginal s"))
        print()
    label = "median " if args.runs > 1 else ""
    print(f"rayeval     {label}wall {med_ray:.1f}s for all {n} (one process, Ray start-up "
          f"included)")
    if med_marginal is not None:
        print(f"            {label}marginal {med_marginal:.1f}s per further checkpoint "
              f"(T({n}) - T(1) = {med_ray:.1f} - {med_one:.1f}, / {n - 1}); fixed cost "
              f"~{med_one - med_marginal:.1f}s")
    print(f"harness     {label}wall {med_harness:.1f}s total, {med_harness / n:.1f}s per "
          f"checkpoint (one `lm_eval run` each, serially)")
    met = ratio <= TARGET
    print(f"ratio       {label}rayeval / {label}harness = {ratio:.3f}   target <= {TARGET}: "
          f"{'MET' if met else 'NOT MET'}   (speed-up {1 / ratio:.2f}x)")
    print(f"agreement   {checked_total - len(mismatches)}/{checked_total} checkpoint-metric "
          f"values agree (acc, acc_norm, exact_match exact; perplexities, bits_per_byte "
          f"rel {REL:g})")
    if mismatches:
        print()
        benchkit.table([(run, ck, ev, metric, *("missing" if v is None else f"{v:.8g}"
                                                for v in (a, b)))
                        for run, ck, ev, metric, a, b in mismatches],
                       ("run", "checkpoint", "evaluation", "metric", "rayeval", "harness"))
    print("=" * 72)

    figures = {
        "machine": {**info, "load_before": load_before, "load_after": benchkit.load()},
        "checkpoints": n, "steps": steps, "workers": args.workers, "batch_size": BATCH_SIZE,
        "build_s": build_s, "runs": runs,
        "median": {"rayeval_s": med_ray, "harness_s": med_harness,
                   "harness_per_checkpoint_s": med_harness / n, "ratio": ratio,
                   "rayeval_marginal_s": med_marginal,
                   "rayeval_one_s": med_one},
        "target_ratio": TARGET, "target_met": met,
        "agreement": {"checked": checked_total,
                      "mismatches": [dict(zip(("run", "checkpoint", "evaluation", "metric",
                                                   "rayeval", "harness"), m))
                                     for m in mismatches]},
        "out": root,
    }
    benchkit.record(args.json, figures)
    if args.json:
        print(f"figures written to {args.json}")

    if mismatches:
        print(f"the numbers disagree; files kept under {root}")
        return 1
    if temporary:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
