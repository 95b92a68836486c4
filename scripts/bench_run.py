"""Benchmark: what `rayeval run` costs above Ray Train's own floor, and above a plain
single-process torch loop on the same parquet file and checkpoints.

Interleaved over --repeats (floor, digits, sweep, plain, one, many, many+bootstrap; then
again), so that a noisy machine slows every kind of run alike; each run is a fresh
subprocess, timed from the command to its exit:

  floor     a trivial Ray Train fit: `python -c` that imports torch and Ray, starts a local Ray
            as `rayeval run` does (lifecycle.start_ray's options), fits a TorchTrainer whose 2
            workers (CPU, gloo) do one all-reduce, and shuts Ray down. What any Ray Train
            program pays on this machine.
  digits    `rayeval run configs/digits/sweep.yaml --force --quiet --profile` (4 checkpoints x
            2 evaluations). Target: digits - floor <= 5 s.
  sweep     `rayeval run` of --checkpoints (6) checkpoints of a 3-layer MLP on a --rows
            (359,401) row parquet file. Target: sweep - floor <= 1.2 x plain.
  plain     the same 6 checkpoints in a plain torch loop (read the parquet, then per checkpoint
            load and score every batch); its read + evaluation time, imports excluded (the
            floor holds those).
  one/many  `rayeval run` with 1 and with K = --marginal-checkpoints (31) checkpoints: the
            marginal cost of one more checkpoint, (T(K) - T(1)) / (K - 1), start-up excluded,
            against the plain loop's time per checkpoint taken the same way (its first
            checkpoint, which warms torch up, left out). Target: <= 1.05x. Also given: the
            same difference over the profile's `workers` phase alone (start-up noise left out).
  bootstrap many again with --replicates (1,000) bootstrap replicates; and one checkpoint's
            pass in one process (rayeval's evaluation code, no Ray) without and with them,
            fastest of four. Target: the bootstrap adds < 20% to a pass.

Prints one JSON object: every run's figures, medians, min and max, each target with "met",
and the `--profile` phases of the median digits and sweep runs. --json FILE writes it too.

    python scripts/bench_run.py [--rows 359401] [--checkpoints 6] [--marginal-checkpoints 31]
        [--repeats 3] [--workers 2] [--replicates 1000] [--plain-threads N]
        [--skip digits,marginal,bootstrap] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

REPO = benchkit.REPO
RUN_TIMEOUT_S = 1800        # a run past it counts as failed (benchkit.RunFailed)

MODEL_SOURCE = '''
import torch

def build(features=64, hidden=256, classes=10):
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))
'''

# The floor: the least a Ray Train program does. Ray is started with lifecycle.start_ray's
# options for a local Ray; prints its own phases as one JSON line.
FLOOR_SOURCE = '''
import time
T0, t0 = time.time(), time.perf_counter()
import json, logging, os, sys
import torch
import ray, ray.train
from ray.train.torch import TorchTrainer
t1 = time.perf_counter()
workers = int(sys.argv[1])

def loop(config):
    import torch
    import torch.distributed as dist
    t = torch.ones(8)
    dist.all_reduce(t)
    assert int(t[0]) == dist.get_world_size()

num_cpus = max(os.cpu_count() or 1, workers + 2)
ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
         logging_level=logging.ERROR, configure_logging=True,
         _system_config={"worker_maximum_startup_concurrency": max(8, num_cpus)})
t2 = time.perf_counter()
TorchTrainer(loop, scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=False),
             run_config=ray.train.RunConfig(name=f"bench-floor-{os.getpid()}")).fit()
t3 = time.perf_counter()
ray.shutdown()
t4 = time.perf_counter()
try:
    import psutil
    start = max(0.0, T0 - psutil.Process().create_time())
except Exception:
    start = 0.0
print("FLOOR " + json.dumps({"python start": start, "imports": t1 - t0, "ray start": t2 - t1,
                             "fit": t3 - t2, "ray shutdown": t4 - t3}))
'''


# ---------------------------------------------------------------------------------------------
# inputs

def make_inputs(root: str, rows: int, checkpoints: int, features: int = 64) -> list[str]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    w = rng.normal(size=(features, 10)).astype(np.float32)
    y = (x @ w + rng.normal(scale=2.0, size=(rows, 10))).argmax(axis=1).astype(np.int64)
    table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), features),
                      "y": pa.array(y)})
    pq.write_table(table, os.path.join(root, "eval.parquet"), row_group_size=32768)
    with open(os.path.join(root, "bench_model.py"), "w") as f:
        f.write(MODEL_SOURCE)
    sys.path.insert(0, root)
    from bench_model import build

    os.makedirs(os.path.join(root, "ckpts"), exist_ok=True)
    out = []
    for i in range(checkpoints):
        torch.manual_seed(i)
        out.append(os.path.join(root, "ckpts", f"step_{i:04d}.pt"))
        torch.save(build().state_dict(), out[-1])
    return out


def write_sweep(root: str, name: str, checkpoints: list[str], workers: int, batch_size: int,
                replicates: int = 0) -> str:
    path = os.path.join(root, f"{name}.yaml")
    listed = ", ".join(f'"{os.path.relpath(c, root)}"' for c in checkpoints)
    with open(path, "w") as f:
        f.write(f"""name: {name}
model: {{factory: "bench_model:build"}}
checkpoints: [{listed}]
dataset: {{path: eval.parquet, inputs: x, target: y}}
task: classification
metrics: [accuracy, macro_f1, nll]
batch_size: {batch_size}
workers: {workers}
output: out-{name}
bootstrap: {{replicates: {replicates}}}
""")
    return path


# ---------------------------------------------------------------------------------------------
# runs

def timed(cmd: list[str], what: str) -> benchkit.Ran:
    """A command of this benchmark, from this checkout, on a local Ray of its own."""
    return benchkit.run(cmd, cwd=REPO, env=benchkit.env(REPO), timeout=RUN_TIMEOUT_S,
                        what=what)


def run_floor(workers: int) -> dict:
    ran = timed([sys.executable, "-c", FLOOR_SOURCE, str(workers)], "the floor")
    line = next(ln for ln in ran.stdout.splitlines() if ln.startswith("FLOOR "))
    phases = json.loads(line[len("FLOOR "):])
    return {"wall_s": round(ran.seconds, 3),
            "phases_s": {k: round(v, 3) for k, v in phases.items()}}


def parse_profile(text: str) -> dict:
    """The lines `rayeval run --profile` prints (rayeval/profile.py's render) as numbers:
    {"total_s", "driver": {phase: s}, "workers": {phase: {"rank0_s", "slowest_s", "count"}},
    "driver_unaccounted_s": total less the driver's phases}."""
    from rayeval.execution.profile import DRIVER_PHASES, WORKER_PHASES

    out: dict = {"total_s": None, "driver": {}, "workers": {}}
    for line in text.splitlines():
        m = re.match(r"profile: ([\d.]+) s from python start", line.strip())
        if m:
            out["total_s"] = float(m.group(1))
            continue
        for name, _ in WORKER_PHASES:
            m = re.match(rf"\s*([\d.]+) s \|\s*([\d.]+) s  {re.escape(name)}\s+x(\d+)", line)
            if m:
                out["workers"][name] = {"rank0_s": float(m.group(1)),
                                        "slowest_s": float(m.group(2)),
                                        "count": int(m.group(3))}
                break
        else:
            for name, _ in DRIVER_PHASES:
                m = re.match(rf"\s*([\d.]+) s  {re.escape(name)}\s", line + " ")
                if m:
                    out["driver"][name] = float(m.group(1))
                    break
    if out["total_s"] is not None:
        # In no phase: e.g. imports after the command is reached, building the trainer,
        # reading the results and drawing the board after Ray is down.
        out["driver_unaccounted_s"] = round(out["total_s"] - sum(out["driver"].values()), 2)
    return out


def run_rayeval(sweep: str, output: str) -> dict:
    ran = timed([sys.executable, "-m", "rayeval", "run", sweep, "--force", "--quiet",
                 "--profile", "--output", output], f"rayeval run {sweep}")
    shutil.rmtree(output, ignore_errors=True)
    profile = parse_profile(ran.stderr)
    if profile["total_s"] is None:
        sys.exit(f"no profile in the output of rayeval run {sweep}:\n{ran.stderr[-4000:]}")
    # What the profile cannot see: the process's start before python runs, and its exit.
    return {"wall_s": round(ran.seconds, 3),
            "outside_profile_s": round(ran.seconds - profile["total_s"], 3), "profile": profile}


def run_plain(root: str, checkpoints: list[str], batch_size: int, threads: int | None) -> dict:
    ran = timed([sys.executable, os.path.abspath(__file__), "--plain-loop", root,
                 "--batch-size", str(batch_size),
                 *(["--plain-threads", str(threads)] if threads else []), *checkpoints],
                "the plain loop")
    figures = json.loads(ran.stdout.strip().splitlines()[-1])
    figures["wall_s"] = round(ran.seconds, 3)
    return figures


def plain_loop(root: str, checkpoints: list[str], batch_size: int,
               threads: int | None = None) -> dict:
    """The same evaluation as a plain torch loop: read the parquet once, then per checkpoint
    load, forward every batch, and compute accuracy, macro F1 and NLL. Returns the read time
    and each checkpoint's load + evaluation time (seconds), and torch's thread count."""
    if threads:
        torch.set_num_threads(threads)
    sys.path.insert(0, root)
    from bench_model import build

    t0 = time.perf_counter()
    table = pq.read_table(os.path.join(root, "eval.parquet"))
    x = torch.from_numpy(table.column("x").combine_chunks().flatten().to_numpy()
                         .reshape(table.num_rows, -1).copy())
    y = torch.from_numpy(table.column("y").to_numpy().copy())
    read = time.perf_counter() - t0
    model = build().eval()
    per = []
    for path in checkpoints:
        t = time.perf_counter()
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        correct, nll, cm = 0, 0.0, torch.zeros(10, 10, dtype=torch.int64)
        with torch.inference_mode():
            for i in range(0, len(y), batch_size):
                xb, yb = x[i:i + batch_size], y[i:i + batch_size]
                out = model(xb)
                pred = out.argmax(1)
                correct += int((pred == yb).sum())
                nll += float(-torch.log_softmax(out, 1).gather(1, yb[:, None]).double().sum())
                cm += torch.bincount(yb * 10 + pred, minlength=100).reshape(10, 10)
        tp = cm.diag().double()
        (2 * tp / (cm.sum(0) + cm.sum(1)).clamp(min=1)).mean()     # macro F1, as rayeval's
        per.append(time.perf_counter() - t)
    return {"read_s": round(read, 4), "per_checkpoint_s": [round(s, 4) for s in per],
            "torch_threads": torch.get_num_threads()}


def bootstrap_pass_cost(root: str, sweeps: tuple[str, str]) -> tuple[float, float]:
    """One checkpoint's pass and metrics in one process (rayeval's own evaluation code, no
    Ray), for the 1-checkpoint sweep without and with the bootstrap: seconds each, best of
    four (interleaved; the first warms up)."""
    sys.path.insert(0, root)
    from bench_model import build

    from rayeval.core import tasks
    from rayeval.io.data import inspect_dataset
    from rayeval.core.evaluate import Pass, decoded_batches, finalize
    from rayeval.core.metrics import build_all
    from rayeval.plan.loader import load_sweep

    configs = []
    for path in sweeps:
        sweep = load_sweep(path)
        ev = sweep.evals[0]
        info = inspect_dataset(ev.dataset, tasks.get(ev.task))
        model = build().eval()
        model.load_state_dict(torch.load(sweep.checkpoints[0], weights_only=True))
        configs.append((model, build_all(ev.metrics), ev.bootstrap,
                        list(decoded_batches(ev, info, sweep.base_dir))))
    def one_pass(model, metrics, boot, batches):
        p = Pass(model, metrics, 10, torch.device("cpu"), buckets=boot.k)
        for b in batches:
            p.update(*b)
        p.finish()
        finalize(metrics, p.states, 10, boot)

    times, _ = benchkit.interleaved({i: lambda c=c: one_pass(*c) for i, c in enumerate(configs)},
                                    4, rotate=False)
    return min(times[0]), min(times[1])


# ---------------------------------------------------------------------------------------------
# figures

def median_run(runs: list[dict]) -> dict:
    """The run whose wall time is the median (the lower of the two middle ones)."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    return ordered[(len(ordered) - 1) // 2]


def workers_phase(run: dict) -> float:
    return run["profile"]["driver"].get("workers", float("nan"))


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=3)
    p.add_argument("--rows", type=int, default=359_401)
    p.add_argument("--checkpoints", type=int, default=6,
                   help="checkpoints of the sweep compared with the plain loop")
    p.add_argument("--marginal-checkpoints", type=int, default=31, metavar="K",
                   help="K of the marginal cost (T(K) - T(1)) / (K - 1): many, so start-up "
                        "noise averages out")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--replicates", type=int, default=1000,
                   help="bootstrap replicates of the runs that measure the bootstrap's cost")
    p.add_argument("--plain-threads", type=int, default=None, metavar="N",
                   help="torch threads of the plain loop (default: torch's own, one per core). "
                        "On a busy machine, threads that wait on each other make the loop "
                        "erratic; 1 is steadier there (rayeval's workers run 1 each)")
    p.add_argument("--skip", default="",
                   help="comma-separated parts to leave out: digits, marginal, bootstrap")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 20,000 rows, 3 and 4 checkpoints, 1 repeat, 100 replicates")
    p.add_argument("--plain-loop", metavar="ROOT", help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.plain_loop:              # the plain loop's own subprocess
        print(json.dumps(plain_loop(args.plain_loop, args.paths, args.batch_size,
                                    args.plain_threads)))
        return 0
    if args.quick:
        args.rows, args.checkpoints, args.marginal_checkpoints = 20_000, 3, 4
        args.repeats, args.replicates = 1, 100
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = skip - {"digits", "marginal", "bootstrap"}
    if unknown:
        p.error(f"--skip: unknown part(s) {sorted(unknown)}")
    marginal = "marginal" not in skip and args.marginal_checkpoints > 1
    bootstrap = "bootstrap" not in skip and args.replicates > 0 and marginal
    n, k = args.checkpoints, args.marginal_checkpoints

    runs: dict[str, list] = {"floor": [], "digits": [], "sweep": [], "plain": [], "one": [],
                             "many": [], "many_bootstrap": []}
    t_begin = time.time()
    load_start = benchkit.load()           # 1, 5 and 15 minutes: how busy the machine was
    with tempfile.TemporaryDirectory(prefix="rayeval-bench-") as root:
        ckpts = make_inputs(root, args.rows, max(n, k if marginal else 1))
        sweep = write_sweep(root, "sweep", ckpts[:n], args.workers, args.batch_size)
        one = write_sweep(root, "one", ckpts[:1], args.workers, args.batch_size)
        many = write_sweep(root, "many", ckpts[:k], args.workers, args.batch_size)
        many_b = write_sweep(root, "many_b", ckpts[:k], args.workers, args.batch_size,
                             args.replicates)
        one_b = write_sweep(root, "one_b", ckpts[:1], args.workers, args.batch_size,
                            args.replicates)
        digits = os.path.join(REPO, "configs", "digits", "sweep.yaml")
        # First, as it is quick: the bootstrap's cost in one process.
        in_process = bootstrap_pass_cost(root, (one, one_b)) \
            if "bootstrap" not in skip and args.replicates > 0 else None
        plain_ckpts = ckpts[:max(n, k if marginal else 0)]
        for i in range(args.repeats):
            def log(what, run):
                print(f"[bench] repeat {i + 1}/{args.repeats}: {what} {run['wall_s']:.2f} s",
                      file=sys.stderr, flush=True)
                return run

            runs["floor"].append(log("floor", benchkit.retrying(run_floor, args.workers)))
            if "digits" not in skip:
                runs["digits"].append(log("digits", benchkit.retrying(
                    run_rayeval, digits, os.path.join(root, f"out-digits-{i}"))))
            runs["sweep"].append(log(f"sweep ({n})", benchkit.retrying(
                run_rayeval, sweep, os.path.join(root, f"out-sweep-{i}"))))
            runs["plain"].append(log("plain", benchkit.retrying(run_plain, root, plain_ckpts,
                                                           args.batch_size, args.plain_threads)))
            if marginal:
                runs["one"].append(log("one", benchkit.retrying(
                    run_rayeval, one, os.path.join(root, f"out-one-{i}"))))
                runs["many"].append(log(f"many ({k})", benchkit.retrying(
                    run_rayeval, many, os.path.join(root, f"out-many-{i}"))))
            if bootstrap:
                runs["many_bootstrap"].append(log(f"many+bootstrap ({k})", benchkit.retrying(
                    run_rayeval, many_b, os.path.join(root, f"out-many_b-{i}"))))

    # Per repeat: the plain loop's times over the same checkpoints.
    plain_n = [r["read_s"] + sum(r["per_checkpoint_s"][:n]) for r in runs["plain"]]
    # Per checkpoint as rayeval's marginal is taken: the first (which warms torch up) left out.
    plain_per = [(sum(c) - c[0]) / (len(c) - 1) if len(c) > 1 else c[0]
                 for c in (r["per_checkpoint_s"] for r in runs["plain"])]
    floor = [r["wall_s"] for r in runs["floor"]]
    warnings = []
    for r in runs["plain"]:
        later = r["per_checkpoint_s"][1:]
        if len(later) > 1 and max(later) > 3 * min(later):
            warnings.append(f"the plain loop's checkpoints took {min(later):.2f} to "
                            f"{max(later):.2f} s each with {r['torch_threads']} torch threads: "
                            "the machine is busy (try --plain-threads 1)")
    for w in dict.fromkeys(warnings):
        print(f"[bench] warning: {w}", file=sys.stderr)
    result: dict = {
        "machine": {"cpus": os.cpu_count()},
        "config": {"rows": args.rows, "checkpoints": n, "marginal_checkpoints": k if marginal
                   else None, "repeats": args.repeats, "workers": args.workers,
                   "batch_size": args.batch_size, "replicates": args.replicates,
                   "plain_threads": args.plain_threads,
                   "skip": sorted(skip), "quick": args.quick},
        "runs": runs, "failed_attempts": benchkit.FAILED_ATTEMPTS, "warnings": warnings,
        "summary": {}, "targets": {},
        "profiles": {},
    }
    s, t = result["summary"], result["targets"]
    s["floor_s"] = benchkit.spread(floor)
    s["floor_phases_s"] = median_run(runs["floor"])["phases_s"]

    if runs["digits"]:
        digits_w = [r["wall_s"] for r in runs["digits"]]
        over = [d - f for d, f in zip(digits_w, floor)]           # paired, same repeat
        s["digits_s"] = benchkit.spread(digits_w)
        s["digits_minus_floor_s"] = benchkit.spread(over)
        value = statistics.median(digits_w) - statistics.median(floor)
        t["digits_over_floor"] = {"value_s": round(value, 3), "target": "<= 5 s",
                                  "met": value <= 5.0}
        result["profiles"]["digits"] = median_run(runs["digits"])["profile"]

    sweep_w = [r["wall_s"] for r in runs["sweep"]]
    s["sweep_s"] = benchkit.spread(sweep_w)
    s["sweep_minus_floor_s"] = benchkit.spread([a - f for a, f in zip(sweep_w, floor)])
    s["plain_s"] = benchkit.spread(plain_n)
    s["plain_read_s"] = benchkit.spread([r["read_s"] for r in runs["plain"]])
    s["plain_process_wall_s"] = benchkit.spread([r["wall_s"] for r in runs["plain"]])
    ratio = (statistics.median(sweep_w) - statistics.median(floor)) / statistics.median(plain_n)
    t["sweep_over_plain"] = {"value": round(ratio, 3), "target": "(sweep - floor) <= 1.2 x plain",
                             "met": ratio <= 1.2}
    result["profiles"]["sweep"] = median_run(runs["sweep"])["profile"]

    if marginal:
        one_w = [r["wall_s"] for r in runs["one"]]
        many_w = [r["wall_s"] for r in runs["many"]]
        per = [(b - a) / (k - 1) for a, b in zip(one_w, many_w)]   # paired, same repeat
        # The same difference over the workers' phase alone: start-up noise left out.
        per_workers = [(workers_phase(b) - workers_phase(a)) / (k - 1)
                       for a, b in zip(runs["one"], runs["many"])]
        s["one_s"] = benchkit.spread(one_w)
        s["many_s"] = benchkit.spread(many_w)
        s["marginal_per_checkpoint_s"] = benchkit.spread(per)
        s["marginal_per_checkpoint_workers_phase_s"] = benchkit.spread(per_workers)
        s["plain_per_checkpoint_s"] = benchkit.spread(plain_per)
        value = statistics.median(per) / statistics.median(plain_per)
        t["marginal_per_checkpoint"] = {
            "value": round(value, 3), "target": "(T(K) - T(1)) / (K - 1) <= 1.05 x plain's",
            "met": 0 < value <= 1.05,     # below 0: T(K) < T(1), noise larger than K - 1 passes
            "workers_phase_only": round(statistics.median(per_workers)
                                        / statistics.median(plain_per), 3)}
    if bootstrap:
        many_b_w = [r["wall_s"] for r in runs["many_bootstrap"]]
        s["many_bootstrap_s"] = benchkit.spread(many_b_w)
        s["bootstrap_whole_sweep_overhead"] = benchkit.spread(
            [(b["wall_s"] - a["wall_s"]) / a["wall_s"]
             for a, b in zip(runs["many"], runs["many_bootstrap"])])
    if in_process is not None:
        plain_pass, boot_pass = in_process
        s["in_process_pass_s"] = round(plain_pass, 4)
        s["in_process_pass_bootstrap_s"] = round(boot_pass, 4)
        value = (boot_pass - plain_pass) / plain_pass
        t["bootstrap"] = {"value": round(value, 3),
                          "target": "one pass with the bootstrap < 1.2 x without (in process)",
                          "met": value < 0.2}
        if bootstrap:
            t["bootstrap"]["whole_sweep_median"] = s["bootstrap_whole_sweep_overhead"]["median"]
    result["machine"]["load_average_at_start_and_end"] = [load_start, benchkit.load()]
    result["seconds"] = round(time.time() - t_begin, 1)
    print(json.dumps(result, indent=2))
    for name, target in t.items():
        shown = target.get("value", target.get("value_s"))
        print(f"[bench] {name}: {shown} (target {target['target']}): "
              f"{'met' if target['met'] else 'NOT met'}", file=sys.stderr)
    benchkit.record(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
