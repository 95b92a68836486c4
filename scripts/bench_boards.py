"""Benchmark: boards of a big store by their readers' ways in (issue 58), each a fresh process.

Two synthetic stores, built as ``scripts/bench_store.py`` builds them (a real digits cell, its
three metric rows with 1,000 bootstrap replicates each, copied to 100 evaluations x N/100
checkpoints, values and replicates shifted per checkpoint): ``--cells`` (100,000) and a
100-cell one (one checkpoint x the same 100 evaluations). Timed, interleaved round by round,
the median of ``--repeats`` (wall seconds of ``python -m rayeval ...``, peak RSS by GNU time):

    json          leaderboard BIG --format json                (the default aggregate: win rate)
    json-mean     leaderboard BIG --format json --aggregate mean   (issue 34's suite files)
    table         leaderboard BIG                              (the terminal's, marks shown)
    table-mean    leaderboard BIG --aggregate mean
    shown-100     leaderboard BIG --checkpoint GLOB            (one checkpoint: 100 cells shown)
    small-json    leaderboard SMALL --format json
    small-table   leaderboard SMALL
    paired-12     rayeval view's paired?ref=0&columns=... on BIG for the first 12 columns (a
                  page's panels): the board made, then the view (in one process, both
                  printed; the target is the view's own time)
    paired-all    the same for every column (what a page asked before: 300 columns)

Targets (issue 58): json <= 8 s and <= 1.2x json-mean; small <= 0.6 s; shown-100 <= 3x small;
paired <= 2 s.

    python scripts/bench_boards.py [--cells 100000] [--repeats 3] [--work DIR --keep]
        [--cell CELL.parquet] [--only json,json-mean] [--json FILE]

With ``--work DIR``, stores already there (``big-N``, ``small``) are used again. The machine's
load (``uptime``) is printed before and after: a shared 2-core machine moves wall times.
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchkit  # noqa: E402
from bench_store import build, real_cell, timed  # noqa: E402

PAIRED = """
import sys, time
sys.path.insert(0, sys.argv[1])
began = time.perf_counter()
from rayeval.reporting.report import Report
report = Report(sys.argv[2], marks=False)
made = time.perf_counter()
count = int(sys.argv[3])
report.paired(0, [c.name for c in report.board.columns[:count]] if count else None)
done = time.perf_counter()
print(made - began, done - made)
"""


def commands(big: str, small: str) -> dict[str, list[str]]:
    rayeval = [sys.executable, "-m", "rayeval", "leaderboard"]
    return {
        "json": rayeval + [big, "--format", "json"],
        "json-mean": rayeval + [big, "--format", "json", "--aggregate", "mean"],
        "table": rayeval + [big],
        "table-mean": rayeval + [big, "--aggregate", "mean"],
        "shown-100": rayeval + [big, "--checkpoint", "*/step_000000.pt"],
        "small-json": rayeval + [small, "--format", "json"],
        "small-table": rayeval + [small],
    }


def store(cell, cells: int, folder: str) -> str:
    if not os.path.isdir(os.path.join(folder, "parts")):
        shutil.rmtree(folder, ignore_errors=True)
        seconds = build(cell, cells, None, folder)
        print(f"built {cells:,} cells in {seconds:.1f} s: {folder}", flush=True)
    return folder


def main(argv=None) -> int:
    p = benchkit.parser(__doc__, repeats=3)
    p.add_argument("--cells", type=int, default=100_000)
    p.add_argument("--cell", help="a stored cell's parquet file (default: run the example)")
    p.add_argument("--work", help="where the stores are built (default: a temporary folder)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--only", help="comma-separated names of the measures to take")
    args = p.parse_args(argv)
    env = benchkit.env(benchkit.REPO)
    figures: dict = {"uptime": [benchkit.uptime()], "cells": args.cells, "runs": {}}
    print(figures["uptime"][0], flush=True)
    with benchkit.workdir("rayeval-bench-boards-", args.work, args.keep) as work:
        cell = real_cell(args.cell, work)
        big = store(cell, args.cells, os.path.join(work, f"big-{args.cells}"))
        small = store(cell, 100, os.path.join(work, "small"))
        wanted = commands(big, small)
        names = list(wanted) + ["paired-12", "paired-all"]
        if args.only:
            names = [n for n in names if n in args.only.split(",")]
        runs: dict[str, list] = {n: [] for n in names}
        for _ in range(args.repeats):
            for name in names:
                if name.startswith("paired"):
                    count = "0" if name.endswith("all") else name.split("-")[1]
                    done = benchkit.run([sys.executable, "-c", PAIRED, benchkit.REPO, big, count],
                                        env=env, what=name)
                    made, seconds = map(float, done.stdout.split())
                    runs[name].append({"s": seconds, "board_s": made})
                else:
                    seconds, rss = timed(wanted[name], env)
                    runs[name].append({"s": seconds, "rss_mb": rss})
        for name, found in runs.items():
            med = {k: round(benchkit.median(r[k] for r in found), 2) for k in found[0]}
            figures["runs"][name] = {"median": med, "all": found}
            extra = f", the board first {med['board_s']:.2f} s" if "board_s" in med else \
                f", {med['rss_mb']:.0f} MB"
            print(f"{name:12s} {med['s']:7.2f} s{extra}  (runs: "
                  + ", ".join(f"{r['s']:.2f}" for r in found) + ")", flush=True)
        figures["uptime"].append(benchkit.uptime())
        print(figures["uptime"][-1], flush=True)
    benchkit.record(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
