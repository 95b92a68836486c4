"""Time from command to error line for bad input that used to be found only by a worker.

Builds, in a temporary folder, a small model module, a data set and a checkpoint, then one
sweep per case below, and times ``python -m rayeval run SWEEP`` (a fresh process each, as a
user runs it) until it exits, printing the exit status and the first error line:

    output_is_a_file        the result store's location is a file
    label_outside_classes   a class index the model has no logit for
    inputs_of_wrong_shape   the model takes 5 features, the data has 8
    other_architecture      a checkpoint of a wider model
    wrong_kind_of_output    the model returns one flat vector per batch

    python scripts/bench_errors.py                      # this checkout
    git worktree add /tmp/old <commit>
    python scripts/bench_errors.py --src /tmp/old       # an older release, for "before"

``--src`` puts that folder first on PYTHONPATH, so its ``rayeval`` package is the one run.
Each case is bounded by ``--timeout`` seconds (a case still running then counts as a timeout).
"""

from __future__ import annotations

import os
import sys
import tempfile
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

MODELS = textwrap.dedent('''
    import torch

    def build(features=8, hidden=16, classes=4):
        return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.Tanh(),
                                   torch.nn.Linear(hidden, classes))

    def flat(features=8, hidden=16, classes=4):
        return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.Tanh(),
                                   torch.nn.Linear(hidden, classes), torch.nn.Flatten(0))
''')


def write_data(path: str, n: int, labels_up_to: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = rng.integers(0, labels_up_to, size=n).astype(np.int64)
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 8),
                             "y": y}), path)


def build_cases(root: str) -> dict[str, str]:
    with open(os.path.join(root, "tiny.py"), "w") as f:
        f.write(MODELS)
    write_data(os.path.join(root, "data.parquet"), 2000, 4)
    write_data(os.path.join(root, "labels.parquet"), 2000, 7)
    os.makedirs(os.path.join(root, "ckpts"))
    os.makedirs(os.path.join(root, "wide"))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    torch.save(net.state_dict(), os.path.join(root, "ckpts", "step_1.pt"))
    wide = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    torch.save(wide.state_dict(), os.path.join(root, "wide", "step_1.pt"))
    with open(os.path.join(root, "a_file"), "w") as f:
        f.write("not a folder\n")
    base = {"name": "errors", "model": {"factory": "tiny:build"}, "checkpoints": ["ckpts/*"],
            "dataset": {"path": "data.parquet", "inputs": "x", "target": "y"},
            "task": "classification", "metrics": ["accuracy"], "workers": 2, "output": "out",
            "recovery": {"max_restarts": 3, "stall_timeout_s": 600}}
    cases = {
        "output_is_a_file": {"output": "a_file"},
        "label_outside_classes": {"dataset": {**base["dataset"], "path": "labels.parquet"}},
        "inputs_of_wrong_shape": {"model": {"factory": "tiny:build", "kwargs": {"features": 5}}},
        "other_architecture": {"checkpoints": ["wide/*"]},
        "wrong_kind_of_output": {"model": {"factory": "tiny:flat"}},
    }
    out = {}
    for name, change in cases.items():
        path = os.path.join(root, f"{name}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump({**base, **change, "output": change.get("output", f"out_{name}")}, f)
        out[name] = path
    return out


def run_case(sweep: str, src: str | None, timeout: float) -> dict:
    ran = benchkit.run([sys.executable, "-m", "rayeval", "run", sweep, "--quiet"],
                       cwd=os.path.dirname(sweep), timeout=timeout, check=False,
                       env=benchkit.env(src, RAY_USAGE_STATS_ENABLED="0"))
    lines = [ln for ln in ran.stderr.splitlines() if ln.startswith(("error:", "failed:"))]
    last = (ran.stderr.strip().splitlines() or ["-"])[-1]
    return {"seconds": round(ran.seconds, 1), "exit": ran.code, "line": (lines or [last])[0][:160]}


def main() -> int:
    p = benchkit.parser(__doc__)
    p.add_argument("--src", help="a rayeval source folder to run instead of the installed one")
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="rayeval-errors-") as root:
        results = {name: run_case(path, args.src, args.timeout)
                   for name, path in build_cases(root).items()}
    for name, r in results.items():
        print(f"{name:24s} {r['seconds']:7.1f} s  exit {r['exit']}  {r['line']}")
    benchkit.record(args.json, {"cases": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
