"""Benchmark: the digits example with and without a `rayeval serve`, side by side in one run.

For each mode (no service: `rayeval run --no-service`; service: `rayeval serve --workers 2`
started first, then plain `rayeval run`), N times: the whole run into a new store (seconds from
the command to its exit, and to the first cell file in the store: the first batch's cell
published), then the same command again with every cell stored (a cached run). Then the
lm-eval example (configs/lm_eval) filled once, and its cached run N times with and without the
service. Prints the medians and each figure; --json writes them.

    python scripts/bench_service.py [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402

REPO = benchkit.REPO


def timed(cmd, env, cwd, store=None) -> tuple[float, float | None]:
    """(seconds to exit, seconds to the first cell file under store/results)."""
    began = time.perf_counter()
    first = None
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    results = os.path.join(store, "results") if store else None
    while proc.poll() is None:
        if first is None and results and os.path.isdir(results) and os.listdir(results):
            first = time.perf_counter() - began
        time.sleep(0.02)
    took = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.read()}")
    if first is None and results and os.path.isdir(os.path.join(store, "parts")):
        first = took            # consolidated before a look saw the cell files
    return took, first


def series(label, cmd_for, env, cwd, root, repeat) -> dict:
    got = {"whole": [], "first_cell": [], "cached": []}
    for i in range(repeat):
        store = os.path.join(root, f"{label}-{i}")
        whole, first = timed(cmd_for(store), env, cwd, store)
        cached, _ = timed(cmd_for(store), env, cwd)
        got["whole"].append(round(whole, 2))
        got["first_cell"].append(round(first, 2) if first is not None else None)
        got["cached"].append(round(cached, 2))
        print(f"{label:>10}  run {i + 1}: whole {whole:6.2f} s, first cell {first or 0:6.2f} s, "
              f"cached {cached:5.2f} s", flush=True)
    return got


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=3, flag="--repeat")
    args = p.parse_args(argv)
    sweep = os.path.join(REPO, "configs", "digits", "sweep.yaml")
    figures = {}
    with tempfile.TemporaryDirectory(prefix="rayeval-service-") as root:
        env = {**os.environ, "RAYEVAL_SERVICE_FILE": os.path.join(root, "service.json")}
        run = [sys.executable, "-m", "rayeval", "run", sweep, "--quiet"]
        figures["no service"] = series("no service", lambda s: run + ["--no-service",
                                                                       "--output", s],
                                       env, REPO, root, args.repeat)
        log = open(os.path.join(root, "serve.log"), "w")
        began = time.perf_counter()
        serve = subprocess.Popen([sys.executable, "-m", "rayeval", "serve", "--workers", "2"],
                                 env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while "ready" not in open(log.name).read():
                if serve.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the service did not start:\n{open(log.name).read()}")
                time.sleep(0.1)
            figures["service start"] = round(time.perf_counter() - began, 2)
            print(f"service ready after {figures['service start']:.1f} s", flush=True)
            figures["service"] = series("service", lambda s: run + ["--output", s], env, REPO,
                                        root, args.repeat)
            # lm-eval entries (configs/lm_eval, rendering kept by content): filled once, then
            # the cached runs, on the service and without it
            lm = [sys.executable, "-m", "rayeval", "run",
                  os.path.join("configs", "lm_eval", "sweep.yaml"), "--quiet", "--output",
                  os.path.join(root, "lm_eval")]
            timed(lm, env, REPO)
            figures["lm_eval cached"] = {
                "service": [round(timed(lm, env, REPO)[0], 2) for _ in range(args.repeat)],
                "no service": [round(timed(lm + ["--no-service"], env, REPO)[0], 2)
                               for _ in range(args.repeat)]}
            print(f"lm_eval cached: {figures['lm_eval cached']}", flush=True)
        finally:
            os.killpg(serve.pid, signal.SIGINT)
            serve.wait(120)
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for label in ("no service", "service"):
        first = benchkit.median(figures[label]["first_cell"])
        rows.append((label, benchkit.median(figures[label]["whole"]),
                     "-" if first is None else first, benchkit.median(figures[label]["cached"])))
    print()
    benchkit.table(rows, ("medians (s)", "whole", "first cell", "cached"))
    benchkit.record(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
