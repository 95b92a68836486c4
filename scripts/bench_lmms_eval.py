"""Benchmark and bigger comparison: `rayeval run` on an lmms-eval task against lmms-eval's own
command line run once per checkpoint (what its users do), on the same folders and items.

The checkpoints are the tiny untrained Idefics3 of tests/vlm_support.py built with N seeds
(so their generations differ), the items N_ITEMS easy-vqa test questions (real 64x64 images
inside the easy-vqa wheel), the task the local lmms-eval YAML of tests/lmms_reference.py
(json data files, image paths, model-specific prompts, two filters, process_results with three
mean metrics). Then, alternating which goes first each run (--runs R):

    rayeval   one `python -m rayeval run sweep.yaml --workers W --output <new store>` (batch 16),
              timed from launch to exit: Ray's start-up, every checkpoint, the writes
    lmms-eval one `python -m lmms_eval --model huggingface` per checkpoint, batch 1, float32
              (its two transformers-5 bugs fixed in its own process: tests/lmms_reference.py),
              one after another; the sum of their wall times

Every figure must agree exactly (the three metrics under both filters, every checkpoint):
any difference is printed and the script exits 1. --batch16 also runs lmms-eval at batch size
16 on the first checkpoint and prints how its figures differ from its batch-1 figures (rayeval's
do not depend on its batch size: tests/integration/test_lmms_eval_tasks.py).

Target (issue 32): rayeval's wall time at most half of lmms-eval's on 8 checkpoints.

    python scripts/bench_lmms_eval.py [--checkpoints 8] [--items 64] [--workers 2] [--runs 1]
                                      [--out DIR] [--batch16] [--json FILE]

Needs lmms-eval 0.7.3 (--no-deps) with rayeval[lmms-eval], transformers, ray, easy-vqa;
nothing is downloaded. Report the machine's load (uptime) with the figures.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

REPO = benchkit.REPO
TARGET = 0.5
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

import lmms_reference as ref  # noqa: E402
import vlm_support  # noqa: E402


def build(out: str, checkpoints: int, items: int) -> tuple[list[str], str]:
    """The checkpoints, the task folder and the sweep (batch 16); (folders, sweep path)."""
    import yaml

    chosen = vlm_support.easy_vqa_items(n=items, seed=0)
    texts = vlm_support.item_texts(vlm_support.easy_vqa_items("train", n=500))
    folders = [vlm_support.build_tiny_vlm(os.path.join(out, "ckpts", f"checkpoint-{s}"),
                                          texts, seed=s) for s in range(1, checkpoints + 1)]
    ref.write_task(os.path.join(out, "tasks"), chosen)
    sweep = os.path.join(out, "sweep.yaml")
    with open(sweep, "w") as f:
        yaml.safe_dump({"name": "vqa", "checkpoints": ["ckpts/checkpoint-*"],
                        "output": "results", "workers": 1,
                        "evals": [{"name": "vqa", "batch_size": 16, "lmms_eval": {
                            "task": ref.TASK, "include_path": "tasks"}}]}, f)
    return folders, sweep


def run_rayeval(sweep: str, store: str, workers: int, log: str) -> float:
    return benchkit.run([sys.executable, "-m", "rayeval", "run", sweep, "--workers",
                         str(workers), "--output", store], log=log, cwd=os.path.dirname(sweep),
                        env={**os.environ, **ref.OFFLINE_ENV, "PYTHONPATH": REPO}).seconds


def run_lmms(folders: list[str], task_dir: str, run_dir: str, batch_size: int = 1
             ) -> tuple[float, dict]:
    """lmms-eval once per checkpoint; (wall seconds in all, {checkpoint: results})."""
    total, results = 0.0, {}
    for folder in folders:
        with benchkit.Stopwatch() as took:
            found = ref.run_lmms_eval(folder, task_dir, batch_size=batch_size, timeout=3600,
                                      output=os.path.join(run_dir, os.path.basename(folder)))
        total += took.s
        results[os.path.basename(folder)] = found["results"]
    return total, results


def rayeval_values(store: str) -> dict:
    from rayeval.io.store import ResultStore
    from rayeval.ranking import latest_rows

    return {(os.path.basename(r["checkpoint"].rstrip("/")), r["metric"]): r["value"]
            for r in latest_rows(ResultStore(store).read())}


def compare(ours: dict, theirs: dict) -> tuple[int, list]:
    checked, bad = 0, []
    for ckpt, results in sorted(theirs.items()):
        for metric in ("exact_match", "answer_chars", "upper_chars"):
            for f in ref.FILTERS:
                key = f"{metric},{f}"
                checked += 1
                if ours.get((ckpt, key)) != results[key]:
                    bad.append((ckpt, key, ours.get((ckpt, key)), results[key]))
    return checked, bad


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=1, flag="--runs")
    p.add_argument("--checkpoints", type=int, default=8)
    p.add_argument("--items", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--batch16", action="store_true")
    args = p.parse_args(argv)
    for key, value in ref.OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    out = args.out or tempfile.mkdtemp(prefix="bench_lmms_")
    folders, sweep = build(out, args.checkpoints, args.items)
    task_dir = os.path.join(out, "tasks")
    print(f"{args.checkpoints} checkpoints, {args.items} items, rayeval on {args.workers} "
          f"workers, lmms-eval once per checkpoint; load {benchkit.load()[0]:.1f} "
          f"on {os.cpu_count()} cores; {out}", flush=True)
    ours_t, theirs_t, failures = [], [], 0
    for run in range(args.runs):
        for who in benchkit.rotated(("rayeval", "lmms-eval"), run):
            if who == "rayeval":
                store = os.path.join(out, f"store{run}")
                ours_t.append(run_rayeval(sweep, store, args.workers,
                                          os.path.join(out, f"rayeval{run}.log")))
                ours = rayeval_values(store)
            else:
                seconds, theirs = run_lmms(folders, task_dir, os.path.join(out, f"lmms{run}"))
                theirs_t.append(seconds)
        checked, bad = compare(ours, theirs)
        failures += len(bad)
        print(f"run {run + 1}: rayeval {ours_t[-1]:.1f} s, lmms-eval {theirs_t[-1]:.1f} s, "
              f"ratio {ours_t[-1] / theirs_t[-1]:.3f}; {checked} figures compared, "
              f"{len(bad)} differ; load {benchkit.load()[0]:.1f}", flush=True)
        for row in bad:
            print("  differs:", *row)
    ratio = statistics.median(ours_t) / statistics.median(theirs_t)
    print(f"median: rayeval {statistics.median(ours_t):.1f} s, lmms-eval "
          f"{statistics.median(theirs_t):.1f} s, ratio {ratio:.3f} (target <= {TARGET})")
    figures = {"checkpoints": args.checkpoints, "items": args.items, "workers": args.workers,
               "rayeval_s": ours_t, "lmms_eval_s": theirs_t, "ratio": round(ratio, 3),
               "target": TARGET, "differing": failures, "out": out}
    if args.batch16:
        _, b1 = run_lmms(folders[:1], task_dir, os.path.join(out, "lmms-b1"), 1)
        _, b16 = run_lmms(folders[:1], task_dir, os.path.join(out, "lmms-b16"), 16)
        name = os.path.basename(folders[0])
        print(f"lmms-eval on {name}, batch 1 vs 16:")
        for key in sorted(k for k in b1[name] if "stderr" not in k and k != "alias"):
            print(f"  {key}: {b1[name][key]} vs {b16[name][key]}")
        figures["lmms_eval_batch_1_vs_16"] = {name: {"1": b1[name], "16": b16[name]}}
    benchkit.record(args.json, figures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
