"""Benchmark: checkpoints on a slow object store, loaded one after another or fetched ahead
while the current one is evaluated (the worker's prefetch thread; RAYEVAL_PREFETCH=0 turns
it off).

Starts moto's S3 server on loopback behind a proxy that delays every GET of an object's bytes
by --delay seconds (tests/s3server.py: MotoServer, FlakyProxy(every=0, delay_s=...)), uploads
--checkpoints (6) checkpoints of an MLP (64 -> --hidden -> --hidden -> 10; big enough that a
checkpoint's evaluation takes about as long as its fetch) and a --rows row parquet data set,
and runs `rayeval run --profile` on `s3://.../ckpts/step_*.pt` with AWS_ENDPOINT_URL at the
proxy: with RAYEVAL_PREFETCH=0 and with prefetching on, interleaved over --repeats (2). Each
run has a fresh output folder and a fresh TMPDIR (so an empty node checkpoint cache,
$TMPDIR/rayeval-checkpoints: every run fetches every checkpoint); Ray's own folder stays where
it was (RAY_TMPDIR).

Reports per run the wall time, the `workers` phase (the workers' loop, first start to last
end) and rank 0's `load` and `pass` per checkpoint (from the profile); and L, a checkpoint's
fetch + read through the proxy measured alone in this process (inside a run a rank's `load`
also holds its wait for the other ranks, and a rank that comes late finds the file another
fetched), and E, a pass's scoring time without prefetching (`pass` less the wait for its
first batch: the first pass reads the rows from the store). Expectation: the workers phase
goes from about K x (L + E) towards K x max(L, E); the first load cannot be hidden, so at most
(K - 1) x min(L, E) can be saved. Check: prefetching saves at least 75% of that, measured on
the workers phase less rank 0's scoring time (the rest: loads, waits, the first pass's reads,
reduces, publishes), so that passes run faster or slower in one run do not count.

    python scripts/bench_prefetch.py [--checkpoints 6] [--delay 1.5] [--rows 120000]
        [--hidden 1024] [--workers 2] [--repeats 2] [--quick] [--json FILE] [--keep]
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402
from bench_run import RUN_TIMEOUT_S, parse_profile  # noqa: E402

REPO = benchkit.REPO


def _load_s3server():
    """tests/s3server.py, by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "rayeval_bench_s3server", os.path.join(REPO, "tests", "s3server.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MODEL_SOURCE = '''
import torch

def build(features=64, hidden={hidden}, classes=10):
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, classes))
'''
BUCKET = "rayeval-bench"


def make_inputs(root: str, rows: int, checkpoints: int, hidden: int, features: int = 64) -> None:
    """The model module, the data set and the checkpoints, in ``root/upload``."""
    up = os.path.join(root, "upload")
    os.makedirs(os.path.join(up, "ckpts"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, features)).astype(np.float32)
    w = rng.normal(size=(features, 10)).astype(np.float32)
    y = (x @ w + rng.normal(scale=2.0, size=(rows, 10))).argmax(axis=1).astype(np.int64)
    # Big row groups: few requests through the slow proxy when the rows are read.
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)),
                                                                    features),
                             "y": pa.array(y)}),
                   os.path.join(up, "eval.parquet"), row_group_size=max(1, rows // 2))
    with open(os.path.join(root, "prefetch_model.py"), "w") as f:
        f.write(MODEL_SOURCE.replace("{hidden}", str(hidden)))
    sys.path.insert(0, root)
    from prefetch_model import build

    for i in range(checkpoints):
        torch.manual_seed(i)
        torch.save(build().state_dict(), os.path.join(up, "ckpts", f"step_{i:04d}.pt"))


def upload(root: str, endpoint: str, credentials: dict) -> None:
    """Straight to moto's server (not through the slow proxy)."""
    fs = pafs.S3FileSystem(endpoint_override=endpoint, allow_bucket_creation=True,
                           access_key=credentials["AWS_ACCESS_KEY_ID"],
                           secret_key=credentials["AWS_SECRET_ACCESS_KEY"],
                           region=credentials["AWS_DEFAULT_REGION"])
    fs.create_dir(BUCKET)
    pafs.copy_files(os.path.join(root, "upload"), BUCKET, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)


def write_sweep(root: str, workers: int, batch_size: int) -> str:
    path = os.path.join(root, "prefetch.yaml")
    with open(path, "w") as f:
        f.write(f"""name: prefetch
model: {{factory: "prefetch_model:build"}}
checkpoints: ["s3://{BUCKET}/ckpts/step_*.pt"]
dataset: {{path: "s3://{BUCKET}/eval.parquet", inputs: x, target: y}}
task: classification
metrics: [accuracy, macro_f1, nll]
batch_size: {batch_size}
workers: {workers}
output: out
""")
    return path


def fetch_and_read(root: str, checkpoints: int, endpoint: str, credentials: dict) -> list[float]:
    """Each checkpoint fetched through the slow proxy into an empty cache and read, in this
    process, as a worker does (rayeval.io.checkpoints.fetch, rayeval.io.layouts.read): seconds each.
    This is L, measured alone: inside a run, a rank's `load` also holds its wait for the
    other ranks, and a rank that arrives later finds the file another rank fetched."""
    os.environ.update(credentials, AWS_ENDPOINT_URL=endpoint)
    from rayeval.io import layouts, paths
    from rayeval.io.checkpoints import fetch

    paths.clear_cache()
    cache = os.path.join(root, "cache-probe")
    out = []
    for i in range(checkpoints):
        with benchkit.Stopwatch() as took:
            local = fetch(f"s3://{BUCKET}/ckpts/step_{i:04d}.pt", cache, "probe")
            layouts.read(local, False)
        out.append(took.s)
    shutil.rmtree(cache, ignore_errors=True)
    return out


def run_once(root: str, sweep: str, proxy, env: dict, prefetch: bool, tag: str) -> dict:
    """One `rayeval run --profile` with its own output and TMPDIR (an empty checkpoint cache)."""
    tmp = os.path.join(root, f"tmp-{tag}")
    out = os.path.join(root, f"out-{tag}")
    os.makedirs(tmp)
    env = dict(env, TMPDIR=tmp, RAYEVAL_PREFETCH="1" if prefetch else "0")
    requests = proxy.count
    try:
        ran = benchkit.run([sys.executable, "-m", "rayeval", "run", sweep, "--quiet",
                            "--profile", "--output", out], cwd=REPO, env=env,
                           timeout=RUN_TIMEOUT_S, what=f"rayeval run ({tag})")
        cache = os.path.join(tmp, "rayeval-checkpoints")
        downloads = sum(len(open(os.path.join(d, ".fetched")).read().split())
                        for d, _, files in os.walk(cache) if ".fetched" in files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    profile = parse_profile(ran.stderr)
    if profile["total_s"] is None:
        sys.exit(f"no profile in the output of rayeval run ({tag}):\n{ran.stderr[-4000:]}")
    w = profile["workers"]

    def each(phase: str, who: str = "rank0_s") -> float | None:
        if phase not in w or not w[phase]["count"]:
            return None
        return round(w[phase][who] / w[phase]["count"], 3)

    first = w.get("first batch", {}).get("rank0_s", 0.0)
    scoring = None if "pass" not in w else round((w["pass"]["rank0_s"] - first)
                                                  / w["pass"]["count"], 3)
    workers = profile["driver"].get("workers")
    return {"prefetch": prefetch, "wall_s": round(ran.seconds, 3),
            "workers_s": workers,
            # The workers phase less rank 0's scoring: loads, waits, the first pass's reads,
            # reduces, publishes. Prefetching can only shrink this part.
            "workers_less_scoring_s": None if scoring is None or workers is None else
            round(workers - scoring * w["pass"]["count"], 3),
            "load_per_checkpoint_s": each("load"), "pass_per_checkpoint_s": each("pass"),
            "scoring_per_checkpoint_s": scoring,
            "load_per_checkpoint_slowest_rank_s": each("load", "slowest_s"),
            "pass_per_checkpoint_slowest_rank_s": each("pass", "slowest_s"),
            "downloads": downloads, "proxy_requests": proxy.count - requests,
            "profile": profile}


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=2)
    p.add_argument("--checkpoints", type=int, default=6)
    p.add_argument("--delay", type=float, default=1.5,
                   help="seconds the proxy waits before each GET of an object's bytes")
    p.add_argument("--rows", type=int, default=120_000)
    p.add_argument("--hidden", type=int, default=1024, help="the MLP's width")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 3 checkpoints, 0.5 s delay, 20,000 rows, width 512, "
                        "1 repeat")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = p.parse_args(argv)
    if args.quick:
        args.checkpoints, args.delay, args.rows, args.hidden, args.repeats = 3, 0.5, 20_000, \
            512, 1
    k = args.checkpoints
    if k < 2:
        p.error("--checkpoints: at least 2 (the first load is never prefetched)")
    s3server = _load_s3server()
    server = proxy = None
    load_start = benchkit.load()
    began = time.time()
    runs, alone = [], []
    # Short: the runs' TMPDIR lives here (Ray's sockets do not: RAY_TMPDIR keeps them put).
    with benchkit.workdir("rvpf-", keep=args.keep, parent="/tmp") as root:
        try:
            make_inputs(root, args.rows, k, args.hidden)
            server = s3server.MotoServer()
            proxy = s3server.FlakyProxy(server.port, every=0, delay_s=args.delay)
            upload(root, server.url, s3server.CREDENTIALS)
            sweep = write_sweep(root, args.workers, args.batch_size)
            env = benchkit.env(root, REPO, **s3server.CREDENTIALS, AWS_ENDPOINT_URL=proxy.url,
                               AWS_EC2_METADATA_DISABLED="true",
                               RAY_TMPDIR=os.environ.get("RAY_TMPDIR", "/tmp"))
            for i in range(args.repeats):
                alone += fetch_and_read(root, k, proxy.url, s3server.CREDENTIALS)
                for prefetch in (False, True):
                    tag = f"{'on' if prefetch else 'off'}-{i}"
                    run = benchkit.retrying(run_once, root, sweep, proxy, env, prefetch, tag)
                    runs.append(run)
                    print(f"[bench] repeat {i + 1}/{args.repeats}, prefetch "
                          f"{'on ' if prefetch else 'off'}: {run['wall_s']:.2f} s, workers "
                          f"{run['workers_s']:.2f} s; rank 0 per checkpoint: load "
                          f"{run['load_per_checkpoint_s']:.2f} s, pass "
                          f"{run['pass_per_checkpoint_s']:.2f} s (scoring "
                          f"{run['scoring_per_checkpoint_s']:.2f} s)", file=sys.stderr,
                          flush=True)
        finally:
            if proxy is not None:
                proxy.stop()
            if server is not None:
                server.stop()

    off = [r for r in runs if not r["prefetch"]]
    on = [r for r in runs if r["prefetch"]]
    med = statistics.median
    load = med(alone)                                           # L: fetch + read, alone
    evaluate = med(r["scoring_per_checkpoint_s"] for r in off)  # E: a pass, data in memory
    serial = k * (load + evaluate)
    overlapped = k * max(load, evaluate)
    workers_off = med(r["workers_s"] for r in off)
    workers_on = med(r["workers_s"] for r in on)
    hideable = (k - 1) * min(load, evaluate)
    saved = workers_off - workers_on
    # Measured on the workers phase less scoring, so that a pass that ran faster or slower in
    # one run (a busy machine) is not counted as loading hidden or not.
    rest_off = med(r["workers_less_scoring_s"] for r in off)
    rest_on = med(r["workers_less_scoring_s"] for r in on)
    share = (rest_off - rest_on) / hideable if hideable > 0 else float("nan")
    summary = {
        "fetch_and_read_alone_s": benchkit.spread(alone),
        "workers_off_s": benchkit.spread([r["workers_s"] for r in off]),
        "workers_on_s": benchkit.spread([r["workers_s"] for r in on]),
        "workers_less_scoring_off_s": benchkit.spread([r["workers_less_scoring_s"] for r in off]),
        "workers_less_scoring_on_s": benchkit.spread([r["workers_less_scoring_s"] for r in on]),
        "wall_off_s": benchkit.spread([r["wall_s"] for r in off]),
        "wall_on_s": benchkit.spread([r["wall_s"] for r in on]),
    }
    for name in ("load", "pass", "scoring"):
        for mode, group in (("off", off), ("on", on)):
            summary[f"{name}_per_checkpoint_{mode}_s"] = benchkit.spread(
                [r[f"{name}_per_checkpoint_s"] for r in group])
    expectation = {
        "K": k, "L_fetch_and_read_s": round(load, 3), "E_scoring_per_checkpoint_s":
            round(evaluate, 3),
        "K_x_(L+E)_s": round(serial, 2), "K_x_max(L,E)_s": round(overlapped, 2),
        "workers_off_s": round(workers_off, 2), "workers_on_s": round(workers_on, 2),
        "saved_s": round(saved, 2), "hideable_(K-1)_x_min(L,E)_s": round(hideable, 2),
        "workers_less_scoring_off_s": round(rest_off, 2),
        "workers_less_scoring_on_s": round(rest_on, 2),
        "share_hidden": round(share, 3),
        "target": "prefetching takes >= 75% of (K - 1) x min(L, E) off the workers phase "
                  "less scoring",
        "met": bool(share >= 0.75),
    }
    result = {
        "machine": {"cpus": os.cpu_count(),
                    "load_average_at_start_and_end": [load_start, benchkit.load()]},
        "config": {"checkpoints": k, "delay_s": args.delay, "rows": args.rows,
                   "hidden": args.hidden, "workers": args.workers,
                   "batch_size": args.batch_size, "repeats": args.repeats,
                   "quick": args.quick},
        "runs": runs, "failed_attempts": benchkit.FAILED_ATTEMPTS, "summary": summary,
        "expectation": expectation,
        "seconds": round(time.time() - began, 1),
    }
    print(json.dumps(result, indent=2))
    print(f"K={k}: L={load:.2f} s (fetch + read), E={evaluate:.2f} s (scoring) per checkpoint;"
          f" workers phase {workers_off:.2f} s without prefetching, {workers_on:.2f} s with "
          f"(K(L+E) = {serial:.2f} s, K max(L,E) = {overlapped:.2f} s); less scoring "
          f"{rest_off:.2f} s and {rest_on:.2f} s: {rest_off - rest_on:.2f} s saved of the "
          f"{hideable:.2f} s that can be hidden ({100 * share:.0f}%, target >= 75%: "
          f"{'met' if expectation['met'] else 'not met'})", file=sys.stderr)
    benchkit.record(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
