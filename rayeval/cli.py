"""The ``rayeval`` command. Bad input is one red line and exit status 2; a run where some
checkpoints failed prints their errors and exits 1; tracebacks are for bugs only."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from . import __version__
from .errors import RayevalError

EXIT_OK, EXIT_CELLS_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayeval", description="Evaluate PyTorch checkpoints on a "
                                "Ray cluster and rank them.")
    p.add_argument("--version", action="version", version=f"rayeval {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="evaluate a sweep on an embedded (or given) Ray cluster")
    run.add_argument("sweep", metavar="SWEEP", help="the sweep file (YAML)")
    run.add_argument("--workers", type=int, help="Ray Train workers (overrides the sweep)")
    run.add_argument("--output", metavar="URI", help="result store (overrides the sweep)")
    run.add_argument("--address", metavar="ADDR",
                     help="an existing Ray cluster (e.g. auto or HOST:6379); default: start one "
                          "in this process")
    run.add_argument("--force", action="store_true",
                     help="evaluate again cells the store already holds")
    run.add_argument("--verbose", action="store_true", help="show Ray's and the workers' logs")

    lb = sub.add_parser("leaderboard", help="rank the checkpoints in a result store")
    lb.add_argument("store", metavar="STORE", help="a result store: folder or s3://bucket/prefix")
    lb.add_argument("--format", choices=("table", "json", "csv", "markdown"), default="table")
    lb.add_argument("--metric", metavar="NAME", help="rank by this metric (default: the first)")
    lb.add_argument("--sweep", metavar="NAME", help="only this sweep")
    lb.add_argument("--dataset", metavar="NAME", help="only this data set")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Not a terminal (CI, a pipe, Ray Job logs): wide enough that tables do not wrap.
    width = None if sys.stdout.isatty() else 200
    out = Console(highlight=False, width=width)
    err = Console(stderr=True, highlight=False, width=width)
    try:
        if args.command == "run":
            return _run(args, out, err)
        return _leaderboard(args, out)
    except RayevalError as e:
        err.print(f"[bold red]error:[/] {e.message}", markup=True, soft_wrap=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        err.print("[red]interrupted[/]")
        return 130


def _run(args, out: Console, err: Console) -> int:
    from .driver import run_sweep
    from .leaderboard import build_board, latest_rows, render_rich
    from .spec import load_sweep
    from .store import ResultStore

    sweep = load_sweep(args.sweep).with_overrides(workers=args.workers, output=args.output)
    report = run_sweep(sweep, address=args.address, force=args.force, verbose=args.verbose)
    plan = report.plan
    keys = report.cell_keys
    rows = [r for r in latest_rows(ResultStore(sweep.output).read()) if r["cell"] in keys]
    if rows:
        render_rich(build_board(rows), out, title=f"{sweep.name} on {sweep.dataset.name}")
    done = len(plan.cells) - len(report.failures)
    out.print(f"{done} checkpoint(s) evaluated, {len(plan.cached)} already in the store, "
              f"{len(report.failures)} failed; {plan.dataset.num_rows} rows, "
              f"{sweep.workers} worker(s), {report.seconds:.1f} s; results in {sweep.output}")
    for f in report.failures:
        err.print(f"[bold red]failed:[/] {f['error']}", soft_wrap=True)
    return EXIT_CELLS_FAILED if report.failures else EXIT_OK


def _leaderboard(args, out: Console) -> int:
    import os

    from . import paths
    from .errors import StoreError
    from .leaderboard import build_board, latest_rows, render_rich, to_csv, to_json, to_markdown
    from .store import ResultStore

    location = paths.resolve(args.store, os.getcwd())
    store = ResultStore(location)
    if not paths.is_uri(location) and not os.path.isdir(location):
        raise StoreError(f"STORE: no result store at {args.store!r}; give the output folder of "
                         "a sweep")
    rows = latest_rows(store.read())
    if args.sweep:
        rows = [r for r in rows if r["sweep"] == args.sweep]
    if args.dataset:
        rows = [r for r in rows if r["dataset"] == args.dataset]
    if args.format == "json":
        if args.metric:
            rows = [r for r in rows if r["metric"] == args.metric]
        sys.stdout.write(to_json(rows))
        return EXIT_OK
    board = build_board(rows, args.metric)
    if args.format == "table":
        render_rich(board, out)
    elif args.format == "markdown":
        sys.stdout.write(to_markdown(board))
    else:
        sys.stdout.write(to_csv(board))
    return EXIT_OK
