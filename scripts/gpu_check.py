"""GPU check: the same sweeps on the GPUs (one worker per GPU, NCCL) and on CPU workers (gloo);
the numbers must agree.

Runs the shipped digits example and a larger synthetic sweep (200,000 rows x 256 features, a
4-layer MLP, 6 checkpoints) with `use_gpu: true` and then on 2 CPU workers, compares every
stored value, and prints one JSON object: devices, world sizes, wall times, rows counted, and
the largest differences. The synthetic sweep runs a third time with the model sharded over the
GPUs (``parallelism.shard``: FSDP2 over NCCL, 2 or more GPUs; over 2 CPU workers with
--cpu-only). Exit status 1 when a difference is over its tolerance (accuracy-like
values: 2 rows' worth; float metrics: 1e-4 relative), 2 when no GPU is found.

Throughput (``--throughput``, on by default; ``--hidden`` sizes the model): one GPU worker's
rows per second against a bare single-GPU loop over the same data and checkpoints (read the
parquet, then per checkpoint ``torch.load``, ``load_state_dict`` and every batch through the
model from pinned memory, accuracy and NLL summed on the GPU). rayeval runs the same two
metrics; its time is the profile's ``workers`` phase (the worker's set-up, loads, passes,
reduces and publishes: everything but Ray's fixed start, measured by ``bench_run.py``) and,
separately, its loads and passes alone, and the steady state: a pass over the kept shard
(every checkpoint's but the first, which reads and decodes the rows and warms CUDA up)
against the bare loop's pass after its first. Each side runs --repeats times, interleaved; the
best of each is compared (the first bare loop also pays CUDA's start).

    python scripts/gpu_check.py              # on a machine with one or more GPUs
    python scripts/gpu_check.py --cpu-only   # checks the script itself: CPU against CPU
    python scripts/gpu_check.py --only-throughput --hidden 4096 --rows 400000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = '''
import torch

def build(features=256, hidden=HIDDEN, classes=16):
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(), torch.nn.Linear(hidden, hidden), torch.nn.GELU(),
        torch.nn.Linear(hidden, classes))
'''

SWEEP = """name: synthetic
model: {{factory: "gpu_model:build"}}
checkpoints: [ckpts/step_*.pt]
dataset: {{path: data.parquet, inputs: x, target: y, id: row}}
task: classification
metrics: [accuracy, macro_f1, nll, brier, ece]
batch_size: 4096
workers: 1
output: out
"""


def make_synthetic(root: str, rows: int, checkpoints: int, hidden: int = 512) -> str:
    sys.path.insert(0, root)
    with open(os.path.join(root, "gpu_model.py"), "w") as f:
        f.write(MODEL.replace("HIDDEN", str(hidden)))
    from gpu_model import build

    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 256)).astype(np.float32)
    teacher = build().eval()
    with torch.no_grad():
        y = teacher(torch.from_numpy(x)).argmax(1).numpy()
    flip = rng.random(rows) < 0.3
    y[flip] = rng.integers(0, 16, flip.sum())
    pq.write_table(pa.table({"row": np.arange(rows),
                             "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 256),
                             "y": y}), os.path.join(root, "data.parquet"), row_group_size=20_000)
    os.makedirs(os.path.join(root, "ckpts"))
    state = teacher.state_dict()
    for i in range(checkpoints):
        noisy = {k: v + (checkpoints - i) * 0.02 * torch.randn_like(v) for k, v in state.items()}
        torch.save(noisy, os.path.join(root, "ckpts", f"step_{(i + 1) * 1000}.pt"))
    path = os.path.join(root, "sweep.yaml")
    with open(path, "w") as f:
        f.write(SWEEP.format())
    return path


def run(sweep_path: str, *, use_gpu: bool, workers: int, output: str, shard: int = 1,
        metrics: tuple[str, ...] | None = None) -> dict:
    import dataclasses

    import ray

    from rayeval.config.schema import Parallelism

    from rayeval.execution.driver import run_sweep
    from rayeval.ranking import latest_rows
    from rayeval.plan.loader import load_sweep, with_overrides
    from rayeval.io.store import ResultStore

    sweep = with_overrides(load_sweep(sweep_path), workers=workers, output=output)
    sweep = dataclasses.replace(sweep, use_gpu=use_gpu)
    if metrics:
        sweep = sweep.replace(evals=tuple(
            dataclasses.replace(e, metrics=tuple(m for m in e.metrics if m.name in metrics))
            for e in sweep.evals))
    if shard > 1:      # each Linear a unit of FSDP2: the model sharded over `shard` workers
        sweep = sweep.replace(parallelism=Parallelism(shard=shard, wrap=("Linear",)))
    began = time.perf_counter()
    report = run_sweep(sweep, force=True)
    seconds = time.perf_counter() - began
    if ray.is_initialized():
        ray.shutdown()
    failures = [f.error for f in report.failures]
    rows = {(os.path.basename(r["checkpoint"]), r["evaluation"], r["metric"]): r
            for r in latest_rows(ResultStore(output).read())}
    ranks = report.worker_times or {}
    phases = ranks.get(0, next(iter(ranks.values()), {}))
    return {"seconds": round(seconds, 2), "failures": failures, "rows": rows,
            "world_size": workers, "use_gpu": use_gpu, "shard": shard,
            "workers_s": report.timer.seconds.get("workers"),
            "load_pass_s": sum(phases.get(k, (0.0, 0))[0] for k in ("load", "pass")),
            "kept_pass_s": kept_pass(phases)}


def kept_pass(phases: dict) -> float | None:
    """The mean pass over the kept (decoded, cached) shard: the steady state, once the
    first pass has read and decoded the rows and warmed CUDA up."""
    (total, n), (streamed, m) = phases.get("pass", (0.0, 0)), phases.get("streamed", (0.0, 0))
    return (total - streamed) / (n - m) if n > m else None


def bare_loop(root: str, device: str, batch_size: int) -> dict:
    """The single-GPU loop a user would write: everything in one process, no rayeval."""
    import glob

    sys.path.insert(0, root)
    from gpu_model import build

    began = time.perf_counter()
    table = pq.read_table(os.path.join(root, "data.parquet"), columns=["x", "y"])
    x = torch.from_numpy(np.array(table["x"].combine_chunks().flatten()).reshape(-1, 256))
    y = torch.from_numpy(table["y"].to_numpy().astype(np.int64))
    if device != "cpu":
        x, y = x.pin_memory(), y.pin_memory()
    model = build().to(device).eval()
    results, load_pass, passes = {}, 0.0, []
    for path in sorted(glob.glob(os.path.join(root, "ckpts", "*.pt"))):
        t = time.perf_counter()
        model.load_state_dict(torch.load(path, map_location=device, weights_only=True))
        loaded = time.perf_counter()
        correct = torch.zeros((), dtype=torch.int64, device=device)
        nll = torch.zeros((), dtype=torch.float64, device=device)
        with torch.inference_mode():
            for i in range(0, len(x), batch_size):
                xb = x[i:i + batch_size].to(device, non_blocking=True)
                yb = y[i:i + batch_size].to(device, non_blocking=True)
                out = model(xb)
                correct += (out.argmax(1) == yb).sum()
                nll += torch.nn.functional.cross_entropy(out.double(), yb, reduction="sum")
        results[os.path.basename(path)] = (correct.item() / len(x), nll.item() / len(x))
        passes.append(time.perf_counter() - loaded)
        load_pass += time.perf_counter() - t
    return {"seconds": time.perf_counter() - began, "load_pass_s": load_pass,
            "kept_pass_s": sum(passes[1:]) / len(passes[1:]) if len(passes) > 1 else None,
            "results": results}


def throughput(path: str, root: str, *, use_gpu: bool, rows: int, repeats: int) -> dict:
    """rayeval's one-worker rows/s against the bare loop's, best of `repeats` each."""
    device = "cuda" if use_gpu else "cpu"
    checkpoints = len(os.listdir(os.path.join(root, "ckpts")))
    ours, bare = [], []
    for i in range(repeats):
        bare.append(bare_loop(root, device, batch_size=4096))
        ours.append(run(path, use_gpu=use_gpu, workers=1, metrics=("accuracy", "nll"),
                        output=os.path.join(root, f"throughput-{i}")))
    scored = rows * checkpoints
    best_ours = min(r["workers_s"] for r in ours)
    best_ours_lp = min(r["load_pass_s"] for r in ours)
    best_bare = min(b["seconds"] for b in bare)
    best_bare_lp = min(b["load_pass_s"] for b in bare)
    steady_ours = min((r["kept_pass_s"] for r in ours if r["kept_pass_s"]), default=None)
    steady_bare = min((b["kept_pass_s"] for b in bare if b["kept_pass_s"]), default=None)
    # The same numbers: rayeval's stored accuracy and NLL against the bare loop's.
    worst_rows, worst_nll = 0.0, 0.0
    for (ckpt, _, metric), row in ours[-1]["rows"].items():
        acc, nll = bare[-1]["results"][ckpt]
        if metric == "accuracy":
            worst_rows = max(worst_rows, abs(row["value"] - acc) * rows)
        else:
            worst_nll = max(worst_nll, abs(row["value"] - nll) / max(abs(nll), 1e-12))
    return {
        "rows_scored": scored, "repeats": repeats,
        "bare_rows_per_s": round(scored / best_bare), "bare_s": [round(b["seconds"], 3) for b in bare],
        "rayeval_rows_per_s": round(scored / best_ours),
        "rayeval_workers_s": [round(r["workers_s"], 3) for r in ours],
        "ratio": round(best_bare / best_ours, 3),
        "bare_load_pass_s": [round(b["load_pass_s"], 3) for b in bare],
        "rayeval_load_pass_s": [round(r["load_pass_s"], 3) for r in ours],
        "ratio_load_pass": round(best_bare_lp / best_ours_lp, 3),
        "bare_pass_s": steady_bare and round(steady_bare, 4),
        "rayeval_pass_s": steady_ours and round(steady_ours, 4),
        "ratio_pass": round(steady_bare / steady_ours, 3) if steady_ours and steady_bare else None,
        "rayeval_wall_s": [r["seconds"] for r in ours],
        "accuracy_diff_in_rows_vs_bare": worst_rows, "nll_rel_diff_vs_bare": worst_nll,
        "failures": sum((r["failures"] for r in ours), []),
    }


def compare(a: dict, b: dict, num_rows: int) -> dict:
    worst_count, worst_float = 0.0, 0.0
    missing = sorted(set(a["rows"]) ^ set(b["rows"]))
    for key in set(a["rows"]) & set(b["rows"]):
        va, vb = a["rows"][key]["value"], b["rows"][key]["value"]
        if va is None or vb is None:
            continue
        if key[2] in ("accuracy", "macro_f1", "ece"):
            worst_count = max(worst_count, abs(va - vb) * num_rows)
        else:
            worst_float = max(worst_float, abs(va - vb) / max(abs(vb), 1e-12))
    ok = not missing and worst_count <= 2 and worst_float <= 1e-4
    return {"ok": ok, "missing": missing, "max_diff_in_rows": worst_count,
            "max_rel_diff_float": worst_float}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-only", action="store_true", help="CPU against CPU (no GPU needed)")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--checkpoints", type=int, default=6)
    p.add_argument("--hidden", type=int, default=512, help="the MLP's width")
    p.add_argument("--repeats", type=int, default=3, help="throughput runs of each side")
    p.add_argument("--no-throughput", dest="throughput", action="store_false")
    p.add_argument("--only-throughput", action="store_true", help="skip the agreement checks")
    p.add_argument("--json", metavar="FILE", help="also write the figures here")
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count()
    if not args.cpu_only and gpus == 0:
        print("error: no GPU found (torch.cuda.device_count() is 0); run on a GPU machine, or "
              "with --cpu-only to check the script", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    figures = {"torch": torch.__version__, "gpus": gpus,
               "devices": [torch.cuda.get_device_name(i) for i in range(gpus)], "sweeps": {}}
    ok = True
    with tempfile.TemporaryDirectory(prefix="rayeval-gpu-") as root:
        digits = shutil.copytree(os.path.join(REPO, "configs", "digits"),
                                 os.path.join(root, "digits"), ignore=shutil.ignore_patterns("out"))
        synthetic = os.path.join(root, "synthetic")
        os.makedirs(synthetic)
        sweeps = {"digits": (os.path.join(digits, "sweep.yaml"), 2003),
                  "synthetic": (make_synthetic(synthetic, args.rows, args.checkpoints,
                                               args.hidden), args.rows)}
        if args.throughput:
            path, num_rows = sweeps["synthetic"]
            t = throughput(path, synthetic, use_gpu=not args.cpu_only, rows=num_rows,
                           repeats=args.repeats)
            t["ok"] = (not t["failures"] and t["accuracy_diff_in_rows_vs_bare"] <= 2
                       and t["nll_rel_diff_vs_bare"] <= 1e-4)
            ok = ok and t["ok"]
            figures["throughput"] = {"hidden": args.hidden, **t}
        if args.only_throughput:
            sweeps = {}
        for name, (path, num_rows) in sweeps.items():
            accel = run(path, use_gpu=not args.cpu_only, workers=gpus or 1,
                        output=os.path.join(root, f"{name}-accel"))
            cpu = run(path, use_gpu=False, workers=2, output=os.path.join(root, f"{name}-cpu"))
            verdict = compare(accel, cpu, num_rows)
            verdict["failures"] = accel["failures"] + cpu["failures"]
            verdict["ok"] = verdict["ok"] and not verdict["failures"]
            ok = ok and verdict["ok"]
            figures["sweeps"][name] = {
                "rows": num_rows, "checkpoints": len({k[0] for k in cpu["rows"]}),
                "accelerated": {k: accel[k] for k in ("seconds", "world_size", "use_gpu")},
                "cpu": {k: cpu[k] for k in ("seconds", "world_size", "use_gpu")},
                "samples_counted": sorted({r["num_samples"] for r in accel["rows"].values()}),
                **verdict}
        # The synthetic sweep again with the model sharded over every GPU (FSDP2, NCCL; two
        # ranks cannot share a GPU, so this needs 2 or more), against the CPU run.
        shard = 2 if args.cpu_only else gpus
        if sweeps and shard >= 2:
            path, num_rows = sweeps["synthetic"]
            sharded = run(path, use_gpu=not args.cpu_only, workers=shard, shard=shard,
                          output=os.path.join(root, "synthetic-sharded"))
            verdict = compare(sharded, cpu, num_rows)
            verdict["failures"] = sharded["failures"]
            verdict["ok"] = verdict["ok"] and not verdict["failures"]
            ok = ok and verdict["ok"]
            figures["sweeps"]["synthetic-sharded"] = {
                "rows": num_rows, "sharded": {k: sharded[k] for k in
                                              ("seconds", "world_size", "use_gpu", "shard")},
                **verdict}
        elif sweeps:
            figures["sweeps"]["synthetic-sharded"] = "not run: sharding over GPUs needs 2 or more"
    figures["ok"] = ok
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
