"""Benchmark: what keeping a cell in progress costs (``resume:``, docs/cluster.md "What survives
what"), and what resuming one saves.

One long cell: a classification of ``--rows`` rows by an MLP of two ``--hidden``-wide layers
(real matrix products, no sleeping), 2 workers on a local Ray, batches of 256.

- **Cost of saving.** The same cell evaluated with ``resume: {every: 0}`` (one pass, never kept
  mid-way: what rayeval did before ``resume``) and with ``resume: {every: E}`` (``--every``, 5:
  scored in bucket ranges of about E seconds, kept after each), alternately, ``--repeats``
  times each, each into a fresh store on the same Ray. The cell's own seconds (load to publish,
  the outcome's ``seconds``) are compared: target at most 2% more with saving. The first pass of
  each run reads the shard from its file; later ranges read the worker's kept copy.
- **Time to resume.** ``rayeval run`` of the sweep (``every: E``) in a subprocess, SIGKILLed
  with its process group once the kept states pass half the buckets and 0.8 E seconds more
  (so that the kill falls between two saves); then the same sweep run again here: its cell's
  seconds and the rows it scored against an uninterrupted cell's. **What the kill lost**: the
  seconds from the last save the states file showed (polled every 50 ms) to the kill, and the
  saves seen: target at most E seconds plus one batch's.

    python scripts/bench_resume.py [--json FILE]   # ~10 minutes on 2 cores
    python scripts/bench_resume.py --rows 40000 --hidden 512 --repeats 2   # quicker

The machine's load (``uptime``) is printed with the figures; run it on a quiet machine.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

MODEL = textwrap.dedent('''
    import torch

    def build(features=64, hidden=1024, classes=10):
        return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(hidden, classes))
''')


def write_inputs(folder: str, rows: int, hidden: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    with open(os.path.join(folder, "bench_models.py"), "w") as f:
        f.write(MODEL)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 64), dtype=np.float32)
    y = rng.integers(0, 10, rows)
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(x.reshape(-1), 64),
                             "y": y, "id": np.arange(rows)}),
                   os.path.join(folder, "data.parquet"), row_group_size=8192)
    os.makedirs(os.path.join(folder, "ckpts"), exist_ok=True)
    sys.path.insert(0, folder)
    import bench_models

    torch.manual_seed(1)
    torch.save(bench_models.build(hidden=hidden).state_dict(),
               os.path.join(folder, "ckpts", "step_1.pt"))


def write_sweep(folder: str, name: str, every: float, output: str, hidden: int) -> str:
    import yaml

    path = os.path.join(folder, name)
    with open(path, "w") as f:
        yaml.safe_dump({
            "name": "bench-resume", "model": {"factory": "bench_models:build",
                                              "kwargs": {"hidden": hidden}},
            "checkpoints": ["ckpts/*"], "task": "classification",
            "dataset": {"path": "data.parquet", "inputs": "x", "target": "y", "id": "id"},
            "metrics": ["accuracy", "nll"], "batch_size": 256, "workers": 2,
            "samples": False, "output": output, "resume": {"every": every}}, f)
    return path


def buckets_kept(output: str) -> int:
    import pyarrow.parquet as pq

    d = os.path.join(output, "states")
    files = [n for n in os.listdir(d) if not n.startswith(".")] if os.path.isdir(d) else []
    if not files:
        return 0
    try:
        return int(pq.read_schema(os.path.join(d, files[0])).metadata[b"scored_below"])
    except (OSError, KeyError, ValueError):
        return 0


def main() -> None:
    ap = benchkit.parser(__doc__, repeats=3)
    ap.add_argument("--rows", type=int, default=120_000)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--every", type=float, default=5.0)
    args = ap.parse_args()

    import ray

    from rayeval.execution.driver import run_sweep
    from rayeval.execution.lifecycle import start_local_ray
    from rayeval.plan.loader import load_sweep

    work = tempfile.mkdtemp(prefix="rayeval-bench-resume-")
    write_inputs(work, args.rows, args.hidden)
    os.chdir(work)
    print(f"[bench_resume] {args.rows:,} rows, MLP hidden {args.hidden}, 2 workers, "
          f"every {args.every:g} s; {benchkit.uptime()}")

    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False,
                    logging_level="ERROR")
    seconds: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for i in range(args.repeats):
            for mode, every in (("off", 0.0), ("on", args.every)):
                out = os.path.join(work, f"out-{mode}-{i}")
                report = run_sweep(load_sweep(write_sweep(work, f"{mode}.yaml", every, out,
                                                          args.hidden)))
                (outcome,) = report.outcomes
                assert outcome.ok, outcome
                seconds[mode].append(outcome.seconds)
                print(f"  {mode:>3} #{i + 1}: cell {outcome.seconds:.2f} s "
                      f"(run {report.seconds:.1f} s)", flush=True)
    finally:
        ray.shutdown()
    off, on = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    pairs = statistics.median(b / a - 1 for a, b in zip(seconds["off"], seconds["on"]))
    print(f"[bench_resume] saving: cell {off:.2f} s without, {on:.2f} s with saving every "
          f"{args.every:g} s (medians of {args.repeats}): {on / off - 1:+.1%}; pair by pair "
          f"(median) {pairs:+.1%} (target <= +2%)")
    figures = {"cell_s": seconds, "median_off_s": off, "median_on_s": on,
               "saving_cost": on / off - 1, "saving_cost_pair_by_pair": pairs}
    figures.update(kill_and_resume(work, args, off))
    benchkit.record(args.json, figures)


def kill_and_resume(work: str, args, off: float) -> dict:
    """Time to resume: a run killed past half of the cell, then the same command again (``off``:
    an uninterrupted cell's seconds, for comparison). Its figures, as far as they went."""
    from rayeval.execution.driver import run_sweep
    from rayeval.plan.loader import load_sweep

    out = os.path.join(work, "out-killed")
    sweep = write_sweep(work, "killed.yaml", args.every, out, args.hidden)
    with open(os.path.join(work, "killed.log"), "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "rayeval", "run", sweep], stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 900
        saves, last, seen, kill_at = [], None, 0, None
        while run.poll() is None and time.monotonic() < deadline:
            now, kept = time.monotonic(), buckets_kept(out)
            if kept > seen:                   # a save (the file goes once the cell is done)
                saves.append(kept)
                seen, last = kept, now
            if kill_at is None and kept >= 512:
                kill_at = now + 0.8 * args.every
            if kill_at is not None and now >= kill_at:
                break
            time.sleep(0.05)
        killed = time.monotonic()
        try:
            os.killpg(run.pid, signal.SIGKILL)
        except ProcessLookupError:           # it ended first: the cell is too short
            pass
        run.wait(30)
    time.sleep(5)          # the killed run's Ray processes notice that their cluster is gone
    kept = buckets_kept(out)
    gaps = [b - a for a, b in zip([0] + saves, saves)]
    print(f"[bench_resume] saves seen at buckets {saves} (ranges of {min(gaps, default=0)}-"
          f"{max(gaps, default=0)} buckets)", end="")
    figures = {"saves_at_buckets": saves, "killed": kill_at is not None}
    if kill_at is None:
        print("; the run ended before a save passed half of the cell: not killed")
        return figures
    figures["lost_s"] = killed - last
    print(f"; the kill came {killed - last:.2f} s after the last save (lost: at most that, "
          f"target <= {args.every:g} s + one batch)")
    report = run_sweep(load_sweep(sweep))
    if not report.outcomes:          # the cell was published between the last poll and the kill
        print("[bench_resume] the killed run had published its cell before the kill landed: "
              "nothing to resume (run again, or with more --rows)")
        return figures
    (outcome,) = report.outcomes
    assert outcome.ok, outcome
    print(f"[bench_resume] killed with {kept} of 1024 buckets kept ({outcome.resumed:,} of "
          f"{outcome.rows:,} rows); the resumed cell: {outcome.seconds:.2f} s for the "
          f"{outcome.rows - outcome.resumed:,} rows left (an uninterrupted cell: {off:.2f} s; "
          f"run {report.seconds:.1f} s)")
    return {**figures, "buckets_kept": kept, "rows_resumed": outcome.resumed,
            "rows": outcome.rows, "resumed_cell_s": outcome.seconds}


if __name__ == "__main__":
    main()
