"""Benchmark: one suite sweep (several evaluations in one `rayeval run`) against the same
evaluations as single-evaluation sweeps run one after another.

Builds, in a temporary folder, a small MLP module (64 -> 256 -> 10), N checkpoints of it
(`torch.save` state dicts) and E parquet evaluation sets (64 float features, 10 classes, each
from its own seed and label noise). Then, interleaved over --repeats:
  (a) one `rayeval run` of a sweep whose `evals:` lists all E evaluations: every
      (checkpoint, evaluation) cell inside one TorchTrainer.fit(), each checkpoint loaded once
      per worker;
  (b) E `rayeval run`s, one per evaluation, in the single top-level dataset/task/metrics form
      (`dataset: {name: ...}` set to the suite's evaluation name), one after another.
Each `rayeval run` is its own subprocess with --quiet and a fresh output folder, so nothing is
cached. Reports each run's wall time, the median of (a) and of (b), their ratio (b)/(a), and
checks that both stores hold the same numbers for every (checkpoint, evaluation, metric):
accuracy exactly, other metrics to 1e-9 relative.

    python scripts/bench_suite.py [--checkpoints 4] [--rows 20000] [--evals 3] [--workers 2]
                                  [--repeats 3] [--batch-size 1024] [--json FILE] [--keep]
"""

from __future__ import annotations

import math
import os
import statistics
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

MODEL_SOURCE = '''
import torch

def build(features=64, hidden=256, classes=10):
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))
'''
EVAL_NAMES = ("clean", "noisy", "shifted", "heavy", "extra")
METRICS = ("accuracy", "macro_f1", "nll")


def make_inputs(root: str, checkpoints: int, rows: int, names: list[str],
                features: int = 64) -> None:
    with open(os.path.join(root, "bench_model.py"), "w") as f:
        f.write(MODEL_SOURCE)
    w = np.random.default_rng(0).normal(size=(features, 10)).astype(np.float32)
    os.makedirs(os.path.join(root, "data"))
    for i, name in enumerate(names):           # same labelling rule, own rows, own noise
        rng = np.random.default_rng(100 + i)
        x = rng.normal(loc=0.2 * i, size=(rows, features)).astype(np.float32)
        y = (x @ w + rng.normal(scale=1.0 + i, size=(rows, 10))).argmax(1).astype(np.int64)
        pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()),
                                                                        features),
                                 "y": pa.array(y)}),
                       os.path.join(root, "data", f"{name}.parquet"), row_group_size=8192)
    sys.path.insert(0, root)
    from bench_model import build

    os.makedirs(os.path.join(root, "ckpts"))
    for i in range(checkpoints):
        torch.manual_seed(i)
        torch.save(build().state_dict(), os.path.join(root, "ckpts", f"step_{i:04d}.pt"))


def write_sweeps(root: str, names: list[str], args) -> tuple[str, list[str]]:
    common = (f'model: {{factory: "bench_model:build"}}\ncheckpoints: ["ckpts/step_*.pt"]\n'
              f"batch_size: {args.batch_size}\nworkers: {args.workers}\n"
              f"bootstrap: {{replicates: {args.replicates}}}\noutput: out-unused\n")
    metrics = "[" + ", ".join(METRICS) + "]"
    suite = os.path.join(root, "suite.yaml")
    with open(suite, "w") as f:
        f.write("name: suite\n" + common + "evals:\n" + "".join(
            f"  - {{name: {n}, task: classification, metrics: {metrics},\n"
            f"     dataset: {{path: data/{n}.parquet, inputs: x, target: y}}}}\n"
            for n in names))
    singles = []
    for n in names:
        singles.append(os.path.join(root, f"single-{n}.yaml"))
        with open(singles[-1], "w") as f:
            f.write(f"name: single-{n}\n" + common + "task: classification\n"
                    f"metrics: {metrics}\n"
                    f"dataset: {{name: {n}, path: data/{n}.parquet, inputs: x, target: y}}\n")
    return suite, singles


def rayeval_run(sweep: str, output: str) -> float:
    return benchkit.run([sys.executable, "-m", "rayeval", "run", sweep, "--quiet", "--output",
                         output]).seconds


def stored(outputs: list[str]) -> dict:
    """(checkpoint, evaluation, metric) -> (value, num_samples) over these stores."""
    from rayeval.io.store import ResultStore

    out = {}
    for location in outputs:
        for r in ResultStore(location).read().to_pylist():
            key = (os.path.basename(r["checkpoint"]), r["evaluation"], r["metric"])
            assert key not in out, f"{key} stored twice"
            out[key] = (r["value"], r["num_samples"])
    return out


def compare(suite: dict, singles: dict, expected: int, rows: int) -> int:
    assert suite.keys() == singles.keys(), (
        f"cells differ: only in the suite {sorted(suite.keys() - singles.keys())}, only in "
        f"the single sweeps {sorted(singles.keys() - suite.keys())}")
    assert len(suite) == expected, f"{len(suite)} stored values, expected {expected}"
    for key, (a, n_a) in suite.items():
        b, n_b = singles[key]
        assert n_a == n_b == rows, f"{key}: num_samples {n_a} (suite) / {n_b} (single)"
        ok = a == b if key[2] == "accuracy" else math.isclose(a, b, rel_tol=1e-9, abs_tol=0)
        assert ok, f"{key}: suite {a!r} != single {b!r} (diff {a - b:.3g})"
    return len(suite)


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=3)
    p.add_argument("--checkpoints", type=int, default=4)
    p.add_argument("--rows", type=int, default=20_000, help="rows of each evaluation set")
    p.add_argument("--evals", type=int, default=3, choices=range(1, len(EVAL_NAMES) + 1))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--replicates", type=int, default=0, help="bootstrap replicates (0: off)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = p.parse_args(argv)
    names = list(EVAL_NAMES[:args.evals])
    with benchkit.workdir("rayeval-bench-suite-", keep=args.keep) as root:
        make_inputs(root, args.checkpoints, args.rows, names)
        suite, singles = write_sweeps(root, names, args)
        t_suite, t_singles, checked = [], [], 0
        for r in range(args.repeats):
            out_suite = os.path.join(root, f"out-suite-{r}")
            t_suite.append(rayeval_run(suite, out_suite))
            outs = [os.path.join(root, f"out-single-{n}-{r}") for n in names]
            t_singles.append([rayeval_run(s, o) for s, o in zip(singles, outs)])
            print(f"repeat {r}: suite {t_suite[-1]:.2f} s, singles "
                  f"{' + '.join(f'{t:.2f}' for t in t_singles[-1])} s", flush=True)
            checked = compare(stored([out_suite]), stored(outs),
                              args.checkpoints * len(names) * len(METRICS), args.rows)
    totals = [sum(ts) for ts in t_singles]
    med_a, med_b = statistics.median(t_suite), statistics.median(totals)
    print(f"\n{args.checkpoints} checkpoints x {len(names)} evaluations ({args.rows} rows each), "
          f"{args.workers} workers, batch {args.batch_size}, bootstrap replicates "
          f"{args.replicates}")
    benchkit.table([(r, f"{a:.2f} s", f"{sum(ts):.2f} s",
                     " / ".join(f"{n} {t:.2f}" for n, t in zip(names, ts)))
                    for r, (a, ts) in enumerate(zip(t_suite, t_singles))]
                   + [("median", f"{med_a:.2f} s", f"{med_b:.2f} s", "")],
                   ("repeat", "(a) suite", "(b) singles", "(b) per evaluation"))
    print(f"ratio (b)/(a): {med_b / med_a:.2f}x (medians)")
    print(f"stored values agree: {checked} (checkpoint, evaluation, metric) values per repeat, "
          f"all {args.repeats} repeats")
    benchkit.record(args.json, {
        "checkpoints": args.checkpoints, "evaluations": names,
        "rows_per_evaluation": args.rows, "workers": args.workers,
        "batch_size": args.batch_size, "replicates": args.replicates,
        "suite_s": [round(t, 3) for t in t_suite],
        "singles_s": [[round(t, 3) for t in ts] for ts in t_singles],
        "singles_total_s": [round(t, 3) for t in totals],
        "median_suite_s": round(med_a, 3), "median_singles_s": round(med_b, 3),
        "ratio_singles_over_suite": round(med_b / med_a, 3),
        "values_checked_per_repeat": checked})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
