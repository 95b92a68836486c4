"""Benchmark: the data plane. Rows per second from every source through to 2 workers, and what
the Ray Data pipelines cost at start-up.

Two parts, each interleaved over --repeats (a noisy machine slows every kind of run alike), every
run a fresh `rayeval run ... --force --quiet --profile` subprocess:

  sources   The digits example's rows, tiled to --rows (20,000) with their own row ids, written
            in every form rayeval reads (scripts/make_data_forms.py: parquet, JSON lines, CSV, a
            Hugging Face save_to_disk folder, a folder of PNGs) plus parquet forced through Ray
            Data (RAYEVAL_DATA_PLANE=ray). One evaluation, one checkpoint, --workers (2),
            RAYEVAL_SHARD_CACHE_BYTES=0. Per source: the slowest worker's pass (reading through
            the pipeline, preprocessing, scoring) and rows/s over it; the wait for the
            pipeline's first batch, and rows/s after it (the steady rate); the whole `workers`
            phase and the wall time. Every source's
            values are checked equal to the direct parquet read's, bit for bit.
  startup   `rayeval run configs/digits/sweep.yaml` at --before (the last revision without Ray
            Data, checked out in a temporary worktree) and at this tree; and this tree with the
            example's parquet forced through Ray Data. The `--profile` phases of the median run
            of each.

Prints one JSON object (medians, min and max, every run's figures); --json FILE writes it too.

    python scripts/bench_data.py [--rows 20000] [--workers 2] [--repeats 3]
        [--before a4399ea] [--skip sources,startup] [--quick] [--json FILE]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_run  # noqa: E402  (parse_profile, RUN_TIMEOUT_S: one way to run and read)
import benchkit  # noqa: E402
import make_data_forms  # noqa: E402

REPO = benchkit.REPO
DIGITS = os.path.join(REPO, "configs", "digits")
CHECKPOINT = "step_000020.pt"
SOURCES = ("parquet", "parquet_ray_data", "jsonl", "csv", "hf", "images")


def tiled_digits(root: str, rows: int) -> str:
    """The digits example's clean rows repeated to ``rows`` rows, each with its own row id."""
    table = pq.read_table(os.path.join(DIGITS, "data", "clean.parquet"))
    reps = -(-rows // table.num_rows)
    big = pa.concat_tables([table] * reps).slice(0, rows)
    big = big.set_column(big.schema.get_field_index("row"), "row",
                         pa.array(np.arange(rows, dtype=np.int64)))
    path = os.path.join(root, "tiled.parquet")
    pq.write_table(big, path)
    return path


def source_sweeps(root: str, rows: int, workers: int) -> dict[str, str]:
    """One sweep file per source (one evaluation each), all on one checkpoint."""
    import yaml

    full = make_data_forms.write(os.path.join(root, "forms"), tiled_digits(root, rows), None,
                                 os.path.join(DIGITS, "ckpts"))
    base = yaml.safe_load(open(full))
    by_form = {ev["name"]: ev for ev in base["evals"]}
    out = {}
    for source in SOURCES:
        ev = dict(by_form["parquet" if source == "parquet_ray_data" else source], name=source)
        sweep = dict(base, name=f"bench-{source}", evals=[ev], workers=workers,
                     checkpoints=[os.path.join(DIGITS, "ckpts", CHECKPOINT)],
                     output=f"out-{source}")
        out[source] = os.path.join(root, "forms", f"{source}.yaml")
        with open(out[source], "w") as f:
            yaml.safe_dump(sweep, f, sort_keys=False)
    return out


def run(sweep: str, output: str, env: dict, cwd: str) -> tuple[dict, list]:
    """One `rayeval run`: its wall time and profile, and the store's values (metric, value,
    interval) sorted, read before the output folder is removed."""
    import rayeval

    ran = benchkit.run([sys.executable, "-m", "rayeval", "run", sweep, "--force", "--quiet",
                        "--profile", "--output", output], cwd=cwd, env=env,
                       timeout=bench_run.RUN_TIMEOUT_S, what=f"rayeval run {sweep}")
    profile = bench_run.parse_profile(ran.stderr)
    if profile["total_s"] is None:
        sys.exit(f"no profile in the output of rayeval run {sweep}:\n{ran.stderr[-4000:]}")
    values = []
    if os.path.isdir(output):
        table = rayeval.results(output).to_pylist()
        values = sorted((r["checkpoint"], r["metric"], r["value"], r.get("ci_low"),
                         r.get("ci_high")) for r in table)
    shutil.rmtree(output, ignore_errors=True)
    return {"wall_s": round(ran.seconds, 3), "profile": profile}, values


def source_figures(one: dict, rows: int) -> dict:
    w = one["profile"]["workers"]
    passed = w.get("pass", {}).get("slowest_s")
    return {"wall_s": one["wall_s"],
            "workers_phase_s": one["profile"]["driver"].get("workers"),
            "pass_s": passed,
            "rows_per_s": round(rows / passed) if passed else None,
            "first_batch_s": w.get("first batch", {}).get("slowest_s"),
            # once the first batch is in: the pipeline's steady rate, its start left out
            "after_first_batch_rows_per_s": round(rows / max(1e-3, passed - first))
            if passed and (first := w.get("first batch", {}).get("slowest_s")) is not None
            else None,
            "ray_data_first_batch_s": w.get("ray data", {}).get("slowest_s")}


def bench_sources(root: str, rows: int, workers: int, repeats: int) -> dict:
    sweeps = source_sweeps(root, rows, workers)
    env = benchkit.env(REPO, RAYEVAL_SHARD_CACHE_BYTES="0")
    runs: dict[str, list] = {s: [] for s in SOURCES}
    reference = None
    for r in range(repeats):
        for source in SOURCES:
            e = dict(env, **({"RAYEVAL_DATA_PLANE": "ray"} if source == "parquet_ray_data"
                             else {}))
            one, values = benchkit.retrying(
                run, sweeps[source], os.path.join(root, "forms", f"out-{source}"), e,
                os.path.join(root, "forms"))
            if not values:
                sys.exit(f"{source}: the run wrote no results")
            reference = reference if reference is not None else values
            if values != reference:
                sys.exit(f"{source}: values differ from parquet's:\n{values}\n{reference}")
            runs[source].append(source_figures(one, rows))
            print(f"[bench] repeat {r + 1} {source}: {runs[source][-1]}", file=sys.stderr,
                  flush=True)
    out = {"rows": rows, "workers": workers, "checkpoint": CHECKPOINT,
           "values_equal_to_parquet": True, "per_source": {}}
    for source, figures in runs.items():
        out["per_source"][source] = {
            key: benchkit.spread([f[key] for f in figures])
            for key in ("rows_per_s", "after_first_batch_rows_per_s", "pass_s",
                        "ray_data_first_batch_s", "workers_phase_s", "wall_s")}
        out["per_source"][source]["runs"] = figures
    return out


def bench_startup(root: str, before: str, repeats: int) -> dict:
    """The digits example at ``before`` and here, and here through Ray Data."""
    tree = os.path.join(root, "before")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tree, before],
                   check=True, capture_output=True)
    try:
        kinds = {"before": (tree, {}), "after": (REPO, {}),
                 "after_ray_data": (REPO, {"RAYEVAL_DATA_PLANE": "ray"})}
        runs: dict[str, list] = {k: [] for k in kinds}
        for r in range(repeats):
            for kind, (code, extra) in kinds.items():
                env = benchkit.env(code, REPO, **extra)
                one, _ = benchkit.retrying(
                    run, os.path.join(code, "configs", "digits", "sweep.yaml"),
                    os.path.join(root, f"out-digits-{kind}"), env, code)
                runs[kind].append(one)
                print(f"[bench] repeat {r + 1} digits {kind}: {one['wall_s']} s", file=sys.stderr,
                      flush=True)
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree],
                       capture_output=True)
    out = {"before": before}
    for kind, figures in runs.items():
        walls = [f["wall_s"] for f in figures]
        median = sorted(figures, key=lambda f: f["wall_s"])[len(figures) // 2]
        out[kind] = {"wall_s": benchkit.spread(walls), "median_profile": median["profile"],
                     "runs_wall_s": walls}
    return out


def main() -> None:
    ap = benchkit.parser(__doc__, repeats=3)
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--before", default="a4399ea",
                    help="the revision to compare start-up with (default: the last without "
                         "Ray Data)")
    ap.add_argument("--skip", default="", help="comma-separated: sources, startup")
    ap.add_argument("--quick", action="store_true", help="2,000 rows, one repeat")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.repeats = 2000, 1
    skip = set(filter(None, args.skip.split(",")))
    out = {"machine": {"cpus": os.cpu_count()}, "repeats": args.repeats}
    with benchkit.workdir("rayeval-bench-data-") as root:
        if "sources" not in skip:
            out["sources"] = bench_sources(root, args.rows, args.workers, args.repeats)
        if "startup" not in skip:
            out["startup"] = bench_startup(root, args.before, args.repeats)
        out["failed_attempts"] = benchkit.FAILED_ATTEMPTS
    print(json.dumps(out, indent=2))
    benchkit.record(args.json, out)


if __name__ == "__main__":
    main()
