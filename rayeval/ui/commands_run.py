"""``rayeval run``, ``watch``, ``submit`` and ``jobs``: the commands that evaluate, here or on a
cluster. Ray, the driver and the integrations are imported inside each command, so that the
``rayeval`` command itself starts without them (and ``--profile`` counts them as imports)."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.markup import escape

from rayeval.execution import signals
from rayeval.execution.profile import (render as render_profile, since_command_start,
                                       since_process_start)
from rayeval.errors import SpecError
from rayeval.reporting.render import render_rich
from rayeval.reporting.display import make_display
from rayeval.ui.exit_codes import EXIT_CELLS_FAILED, EXIT_OK


_STARTED: dict[str, float] = {}     # python start to the run's modules imported (--profile)


def _run(args, out: Console, err: Console, standing=None, seen=None) -> int:
    from rayeval import api  # noqa: F401 - imported here so --profile counts it as imports
    from rayeval.execution import driver

    # On a service (``standing``), the run starts here: its imports were the service's.
    _STARTED["began"] = since_process_start() if standing is not None else 0.0
    _STARTED["imports"] = since_process_start() - _STARTED["began"]
    from rayeval.ranking import latest_rows
    from rayeval.plan.loader import load_sweep, with_trackers
    from rayeval.io.store import ResultStore

    sweep = args.sweep
    if args.mlflow is not None or args.wandb is not None or args.checkpoint:
        sweep = with_trackers(load_sweep(args.sweep, output=args.output), mlflow=args.mlflow,
                              wandb=args.wandb)
        if args.checkpoint:          # from this folder, as --output is
            sweep = sweep.replace(checkpoints=tuple(
                c if "://" in c else os.path.abspath(c) for c in args.checkpoint))
    report = api.run(sweep, workers=args.workers, output=args.output,
                     address=args.address, force=args.force, verbose=args.verbose,
                     progress=False if args.quiet else err, standing=standing)
    plan = report.plan
    sweep = plan.sweep                      # with --workers / --output applied
    keys = report.cell_keys
    stored = latest_rows(ResultStore(sweep.output).read())     # read once, for all three
    if seen is not None:
        seen(report, stored)
    # The board and the summary are written whole or not at all: a signal while they are
    # written takes effect after them (the interrupted line, 130; docs/cluster.md, Signals).
    board = report.board(stored)
    from rayeval.reporting.samples import judge_warnings

    warnings = judge_warnings(sweep, [r for r in stored if r["cell"] in keys], sweep.output)
    with signals.held():
        _print_run(args, report, board, out, err)
        for line in warnings:
            err.print(line, markup=False, highlight=False, soft_wrap=True)
    return EXIT_CELLS_FAILED if report.failures else EXIT_OK


def _print_run(args, report, board, out: Console, err: Console) -> None:
    """``rayeval run``'s output after the run: the board, the summary, failures, --profile."""
    plan = report.plan
    sweep = plan.sweep
    if board is not None:
        render_rich(board, out, title=sweep.name)
    done = sum(1 for o in report.outcomes if o.ok)
    # The time the user waited, from the command's start (on a service, the run's): imports
    # and reading the sweep too, which a fully cached run spends most of (issue 56: it said
    # 3.4 s of a 13 s wait).
    waited = since_command_start()
    seconds = max(waited or 0.0, report.seconds)
    if plan.cells:
        ran = (f"{sweep.workers} worker(s)" + (f" on {report.nodes} node(s)" if report.nodes
                                                else "") + f", {seconds:.1f} s")
    else:
        ran = f"nothing to run, {seconds:.1f} s"
    reused = sum(1 for c in plan.cells if c.generated)
    out.print(f"{done} cell(s) evaluated, {len(plan.cached)} already in the store, "
              f"{len(report.failures)} failed; {ran}"
              + (f"; {reused} judged from stored generations (their checkpoints not "
                 "loaded)" if reused else "")
              + (f"; results in {sweep.output}" if board is not None else ""))
    if report.raced is not None and report.outcomes:
        scored, full = report.raced
        partial = sum(1 for o in report.outcomes if o.ok and o.partial)
        out.print(f"race on {sweep.select.metric}: {partial} cell(s) stopped early; "
                  f"{scored:,} of {full:,} item evaluations scored, "
                  f"{1 - scored / max(full, 1):.0%} saved")
    from rayeval.plan.outcome import failure_lines

    for line, detail in failure_lines(report.failures):     # a checkpoint's error once
        err.print(f"[bold red]failed:[/] {escape(line)}", soft_wrap=True)
        if args.debug and detail:
            err.print(detail, markup=False, highlight=False, soft_wrap=True)
    if args.profile:

        report.timer.add("imports", _STARTED.get("imports", 0.0))
        for line in render_profile(report.timer, report.worker_times,
                                   since_process_start() - _STARTED.get("began", 0.0)):
            err.print(line, markup=False, highlight=False, soft_wrap=True)


def _watch(args, out: Console, err: Console) -> int:
    from rayeval.plan.loader import load_sweep, watch_spec, with_overrides, with_trackers
    from rayeval.integrations.watch import watch

    if args.interval <= 0 or (args.settle is not None and args.settle < 0):
        raise SpecError("--interval must be above 0 and --settle at least 0 seconds")
    sweep = with_overrides(load_sweep(args.sweep, output=args.output), workers=args.workers,
                           output=args.output)
    sweep = with_trackers(sweep, mlflow=args.mlflow, wandb=args.wandb)
    given = {k: v for k, v in (("ready", args.ready), ("order", args.order)) if v is not None}
    if given:
        sweep = sweep.replace(watch=watch_spec(given, source="rayeval watch", base=sweep.watch,
                                               prefix="--"))
    mode = "quiet" if args.quiet else "auto"

    def say(text: str) -> None:
        err.print(text, markup=False, highlight=False, soft_wrap=True)

    # Ctrl-C (or SIGTERM) is how a watch ends: cli.main says "watch stopped (SIGINT)".
    state = watch(sweep, interval_s=args.interval,
                  settle_s=args.interval if args.settle is None else args.settle,
                  address=args.address, verbose=args.verbose,
                  display_for=lambda: make_display(mode, err), say=say)
    return EXIT_OK if not state.failed else EXIT_CELLS_FAILED


def _submit(args, err: Console) -> int:
    from rayeval.integrations import jobs

    client, job_id, pkg = jobs.submit(args.sweep, args.address, workers=args.workers,
                                      output=args.output, force=args.force,
                                      mlflow=args.mlflow, wandb=args.wandb)
    if args.no_wait:
        print(job_id, flush=True)
        return EXIT_OK
    err.print(f"[rayeval] submitted job {job_id} ({pkg.bytes / (1 << 20):.1f} MiB of "
              f"{pkg.folder}); following its log (Ctrl-C stops the job; --no-wait leaves it "
              "running)", markup=False, highlight=False, soft_wrap=True)
    try:
        status = jobs.follow(client, job_id)
    except KeyboardInterrupt as e:
        # Ctrl-C stops the run, wherever it runs: the job gets SIGTERM from its supervisor
        # and stops as a local run does (cli.main prints the line: 130, or 143).
        with signals.held():            # unwinding: a second signal does not cut the stop
            e.said = jobs.stop(client, job_id)
        raise
    code = jobs.exit_code(client, job_id)
    err.print(f"[rayeval] job {job_id}: {status.rsplit('.', 1)[-1]}"
              + (f" (exit status {code})" if code else ""), markup=False, highlight=False)
    return code


def _jobs(args, out: Console, err: Console) -> int:
    from rayeval.integrations import jobs

    client = jobs.client(args.address)
    if args.action == "list":
        for info in jobs.call("list", client.list_jobs):
            sid = info.submission_id or info.job_id
            print(f"{sid}\t{str(info.status).rsplit('.', 1)[-1]}\t{info.entrypoint}")
        return EXIT_OK
    what = f"job {args.job}"
    if args.action == "stop":
        stopped = jobs.call(what, client.stop_job, args.job)
        print(f"{args.job}: {'stop requested' if stopped else 'not running'}")
        return EXIT_OK
    if args.action == "logs":
        if args.follow:
            jobs.follow(client, args.job)
        else:
            sys.stdout.write(jobs.call(what, client.get_job_logs, args.job))
        return EXIT_OK
    info = jobs.call(what, client.get_job_info, args.job)
    status = str(info.status).rsplit(".", 1)[-1]
    print(f"{args.job}: {status}" + (f" - {info.message}" if info.message else ""))
    if status == "SUCCEEDED":
        return EXIT_OK
    return 3 if status in ("PENDING", "RUNNING") else EXIT_CELLS_FAILED
