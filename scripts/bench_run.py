"""Benchmark: `rayeval run` against a plain single-process torch loop on the same parquet file
and checkpoints.

Prints the wall time of each, and the marginal cost of one more checkpoint in rayeval
((T(K checkpoints) - T(1 checkpoint)) / (K - 1), start-up excluded; K is large because
start-up alone varies by a few seconds between runs) against the plain loop's
time per checkpoint. Target: within 1.3x. Then the same two sweeps with 1,000 bootstrap replicates: the time they add
(target: under 20% of the evaluation's own time).

    python scripts/bench_run.py [--rows 359401] [--checkpoints 31] [--workers 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

MODEL_SOURCE = '''
import torch

def build(features=64, hidden=256, classes=10):
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))
'''


def make_inputs(root: str, rows: int, checkpoints: int, features: int = 64) -> None:
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
    for i in range(checkpoints):
        torch.manual_seed(i)
        torch.save(build().state_dict(), os.path.join(root, "ckpts", f"step_{i:04d}.pt"))


def write_sweep(root: str, name: str, glob: str, workers: int, batch_size: int,
                replicates: int = 0) -> str:
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(f"""name: {name}
model: {{factory: "bench_model:build"}}
checkpoints: ["{glob}"]
dataset: {{path: eval.parquet, inputs: x, target: y}}
task: classification
metrics: [accuracy, macro_f1, nll]
batch_size: {batch_size}
workers: {workers}
output: out-{name}
bootstrap: {{replicates: {replicates}}}
""")
    return path


def time_rayeval(sweep: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rayeval", "run", sweep, "--force"],
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"rayeval run failed:\n{proc.stdout}\n{proc.stderr}")
    return elapsed


def plain_loop(root: str, checkpoints: list[str], batch_size: int) -> tuple[float, float]:
    """The same evaluation as a plain torch loop: read the parquet once, then per checkpoint
    load, forward every batch, and compute accuracy, macro F1 and NLL. Returns (read seconds,
    evaluation seconds for all checkpoints)."""
    from bench_model import build

    t0 = time.perf_counter()
    table = pq.read_table(os.path.join(root, "eval.parquet"))
    x = torch.from_numpy(table.column("x").combine_chunks().flatten().to_numpy()
                         .reshape(table.num_rows, -1).copy())
    y = torch.from_numpy(table.column("y").to_numpy().copy())
    t1 = time.perf_counter()
    model = build().eval()
    for path in checkpoints:
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
        _f1 = (2 * tp / (cm.sum(0) + cm.sum(1)).clamp(min=1)).mean()
    return t1 - t0, time.perf_counter() - t1


def bootstrap_pass_cost(root: str, checkpoint: str, batch_size: int, replicates: int
                        ) -> tuple[float, float]:
    """One checkpoint's pass and metrics in one process (rayeval's own evaluation code, no
    Ray), without and with the bootstrap: seconds each, best of three."""
    sys.path.insert(0, root)
    from bench_model import build

    from rayeval.data import inspect_dataset, read_all
    from rayeval.evaluate import OFF, Bootstrap, Pass, finalize
    from rayeval.metrics import parse_metric
    from rayeval.spec import DatasetSpec

    spec = DatasetSpec(path=os.path.join(root, "eval.parquet"), inputs="x", target="y")
    info = inspect_dataset(spec)
    model = build().eval()
    model.load_state_dict(torch.load(checkpoint, weights_only=True))
    metrics = [(m.key, m.build()) for m in (parse_metric(n, "classification")
                                            for n in ("accuracy", "macro_f1", "nll"))]
    configs = [(OFF, list(read_all(info, spec, batch_size))),
               (Bootstrap(replicates=replicates),
                list(read_all(info, spec, batch_size, bootstrap=Bootstrap(replicates=replicates))))]
    out = [float("inf"), float("inf")]
    for _ in range(4):                  # interleaved, fastest of four: the first warms up
        for i, (boot, batches) in enumerate(configs):
            start = time.perf_counter()
            p = Pass(model, metrics, 10, torch.device("cpu"), buckets=boot.k)
            for b in batches:
                p.update(*b)
            finalize(metrics, p.states, 10, boot)
            out[i] = min(out[i], time.perf_counter() - start)
    return out[0], out[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=359_401)
    p.add_argument("--checkpoints", type=int, default=31,
                   help="checkpoints of the long sweep (many, so start-up noise averages out)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each rayeval sweep; the fastest counts (start-up is noisy)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--replicates", type=int, default=1000,
                   help="bootstrap replicates of the runs that measure the bootstrap's cost")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    k = args.checkpoints
    with tempfile.TemporaryDirectory(prefix="rayeval-bench-") as root:
        make_inputs(root, args.rows, k)
        one = write_sweep(root, "one", "ckpts/step_0000.pt", args.workers, args.batch_size)
        many = write_sweep(root, "many", "ckpts/step_*.pt", args.workers, args.batch_size)
        many_b = write_sweep(root, "many_b", "ckpts/step_*.pt", args.workers, args.batch_size,
                             args.replicates)
        t_one = min(time_rayeval(one) for _ in range(args.repeats))
        t_many = min(time_rayeval(many) for _ in range(args.repeats))
        t_many_b = min(time_rayeval(many_b) for _ in range(args.repeats))
        ckpts = sorted(os.path.join(root, "ckpts", f) for f in os.listdir(os.path.join(root,
                                                                                      "ckpts")))
        t_read, t_plain = plain_loop(root, ckpts, args.batch_size)
        t_pass, t_pass_b = bootstrap_pass_cost(root, ckpts[0], args.batch_size, args.replicates)
    marginal = (t_many - t_one) / (k - 1)
    per_plain = t_plain / k
    figures = {
        "rows": args.rows, "checkpoints": k, "workers": args.workers,
        "batch_size": args.batch_size,
        "rayeval_1_checkpoint_s": round(t_one, 2), "rayeval_all_checkpoints_s": round(t_many, 2),
        "plain_read_s": round(t_read, 2), "plain_all_checkpoints_s": round(t_plain, 2),
        "rayeval_marginal_per_checkpoint_s": round(marginal, 3),
        "plain_per_checkpoint_s": round(per_plain, 3),
        "marginal_ratio": round(marginal / per_plain, 3),
        "replicates": args.replicates,
        "rayeval_bootstrap_all_checkpoints_s": round(t_many_b, 2),
        "bootstrap_overhead_whole_sweep": round((t_many_b - t_many) / t_many, 3),
        "in_process_pass_s": round(t_pass, 3), "in_process_pass_bootstrap_s": round(t_pass_b, 3),
        "bootstrap_overhead_per_checkpoint": round((t_pass_b - t_pass) / t_pass, 3),
    }
    print(f"rows {args.rows}, {k} checkpoints, {args.workers} workers, batch {args.batch_size}")
    print(f"rayeval run, 1 checkpoint:      {t_one:8.2f} s")
    print(f"rayeval run, {k} checkpoints:     {t_many:8.2f} s")
    print(f"plain loop, read parquet:       {t_read:8.2f} s")
    print(f"plain loop, {k} checkpoints:      {t_plain:8.2f} s")
    print(f"marginal per checkpoint: rayeval {marginal:.3f} s, plain {per_plain:.3f} s, "
          f"ratio {marginal / per_plain:.2f}x (target <= 1.3x)")
    print(f"whole sweep: rayeval {t_many:.2f} s vs plain {t_read + t_plain:.2f} s, "
          f"ratio {t_many / (t_read + t_plain):.2f}x")
    print(f"with {args.replicates} bootstrap replicates, {k} checkpoints: {t_many_b:.2f} s "
          f"({100 * (t_many_b - t_many) / t_many:+.1f}% on the whole sweep, target < 20%)")
    print(f"one checkpoint's pass over all rows in one process: {t_pass:.3f} s without, "
          f"{t_pass_b:.3f} s with {args.replicates} replicates "
          f"(+{100 * (t_pass_b - t_pass) / t_pass:.1f}%, target < 20%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
