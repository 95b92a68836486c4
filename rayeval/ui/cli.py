"""The ``rayeval`` command. Bad input is one red line and exit status 2; a run where some
checkpoints failed prints their errors and exits 1; tracebacks are for bugs only."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from rich.console import Console
from rich.markup import escape

from rayeval import __version__
from rayeval.execution import signals
from rayeval.execution.profile import render as render_profile, since_process_start
from rayeval.config.plugins import load_plugins
from rayeval.config.schema import MlflowTracker, Trackers, WandbTracker
from rayeval.errors import CheckpointError, RayevalError, SpecError, StoreError
from rayeval.reporting.render import (format_value, render_rich, to_csv, to_html, to_json,
                                      to_markdown)
from rayeval.reporting.display import make_display

EXIT_OK, EXIT_CELLS_FAILED, EXIT_BAD_INPUT = 0, 1, 2


_STARTED: dict[str, float] = {}     # python start to the run's modules imported (--profile)


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
    run.add_argument("--profile", action="store_true",
                     help="print where the wall time went: start-up, Ray, workers, shutdown")
    run.add_argument("--quiet", action="store_true",
                     help="no progress display (only the results and errors)")
    _tracker_flags(run)

    w = sub.add_parser("watch", help="evaluate checkpoints as a training run writes them, "
                                     "until stopped")
    w.add_argument("sweep", metavar="SWEEP", help="the sweep file (YAML)")
    w.add_argument("--interval", type=float, default=30.0, metavar="S",
                   help="seconds between looks at the checkpoint globs (default 30)")
    w.add_argument("--settle", type=float, metavar="S",
                   help="a checkpoint is ready once unchanged this long (default: --interval)")
    w.add_argument("--ready", metavar="NAME",
                   help="a checkpoint is ready once the trainer writes this marker: a name "
                        "(COMPLETE) inside a checkpoint folder, or a pattern (*.done) beside "
                        "it; overrides the sweep's watch.ready")
    w.add_argument("--order", choices=("oldest", "newest", "bisect"),
                   help="which ready checkpoints go first (default: the sweep's watch.order, "
                        "else oldest); bisect: first, last, middle, then finer")
    w.add_argument("--workers", type=int, help="Ray Train workers (overrides the sweep)")
    w.add_argument("--output", metavar="URI", help="result store (overrides the sweep)")
    w.add_argument("--address", metavar="ADDR", help="an existing Ray cluster")
    w.add_argument("--verbose", action="store_true", help="show Ray's and the workers' logs")
    w.add_argument("--quiet", action="store_true", help="no progress display")
    _tracker_flags(w)

    sb = sub.add_parser("submit", help="run a sweep as a Ray Job on a cluster (Ray Jobs API)")
    sb.add_argument("sweep", metavar="SWEEP", help="the sweep file (YAML)")
    sb.add_argument("--address", metavar="URL",
                    help="the cluster's dashboard, e.g. http://HEAD:8265 (default: RAY_ADDRESS)")
    sb.add_argument("--no-wait", action="store_true",
                    help="print the job id and return instead of streaming the job's log")
    sb.add_argument("--workers", type=int, help="Ray Train workers (overrides the sweep)")
    sb.add_argument("--output", metavar="URI",
                    help="result store: s3://... or an absolute path the cluster shares")
    sb.add_argument("--force", action="store_true",
                    help="evaluate again cells the store already holds")
    _tracker_flags(sb)

    jb = sub.add_parser("jobs", help="the Ray Jobs of a cluster: status, logs, stop, list")
    jsub = jb.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, text in (("status", "a job's state"), ("logs", "a job's log"),
                         ("stop", "stop a job")):
        a = jsub.add_parser(action, help=text)
        a.add_argument("job", metavar="ID", help="the job id `rayeval submit` printed")
        a.add_argument("--address", metavar="URL", help="the cluster's dashboard")
        if action == "logs":
            a.add_argument("--follow", action="store_true", help="stream until the job ends")
    jl = jsub.add_parser("list", help="every job on the cluster")
    jl.add_argument("--address", metavar="URL", help="the cluster's dashboard")

    kb = sub.add_parser("k8s", help="Kubernetes manifests (KubeRay)")
    ksub = kb.add_subparsers(dest="action", required=True, metavar="ACTION")
    kr = ksub.add_parser("render", help="print a ConfigMap and a RayJob that run a sweep")
    kr.add_argument("sweep", metavar="SWEEP")
    kr.add_argument("--image", required=True, help="the rayeval image (see k8s/Dockerfile)")
    kr.add_argument("--workers", type=int, default=1, help="worker pods (default 1)")
    kr.add_argument("--gpus-per-worker", type=int, default=1, metavar="G",
                    help="GPUs per worker pod, one Ray Train worker each (default 1; 0: CPU)")
    kr.add_argument("--cpus-per-worker", type=int, default=8, metavar="C")
    kr.add_argument("--memory-per-worker", default="32Gi", metavar="M")
    kr.add_argument("--namespace", metavar="NS")
    kr.add_argument("--ttl", type=int, default=3600, metavar="S",
                    help="seconds the finished job's cluster is kept (default 3600)")

    lb = sub.add_parser("leaderboard", help="rank the checkpoints in a result store")
    lb.add_argument("store", metavar="STORE", help="a result store: folder or s3://bucket/prefix")
    lb.add_argument("--format", choices=("table", "json", "csv", "markdown", "html"),
                    default="table", help="html: a self-contained page")
    lb.add_argument("--metric", metavar="NAME",
                    help="rank by this column: EVAL/METRIC, a METRIC stored for one evaluation, "
                         "or aggregate (default: the aggregate with several evaluations, else "
                         "the first metric)")
    lb.add_argument("--sweep", metavar="NAME", help="only this sweep")
    lb.add_argument("--dataset", metavar="NAME", help="only this evaluation (data set)")
    lb.add_argument("--members", action="store_true",
                    help="also each lm-eval group's tasks (NAME/TASK), not only its aggregate")
    lb.add_argument("--replicates", action="store_true",
                    help="with --format json: include each row's bootstrap replicate values")
    lb.add_argument("--plot", metavar="FILE.png",
                    help="also draw each column (or only --metric) against the training step, "
                         "one line per sweep with its interval band")
    lb.add_argument("--to-mlflow", metavar="URI",
                    help="also log the rows to this MLflow tracking server: each sweep into "
                         "its own run (found again by its rayeval.sweep tag), or --run-id")
    lb.add_argument("--experiment", metavar="NAME",
                    help="with --to-mlflow: the experiment of the sweeps' runs (default rayeval)")
    lb.add_argument("--to-wandb", metavar="PROJECT",
                    help="also log the rows to this W&B project (WANDB_MODE=offline works)")
    lb.add_argument("--run-id", metavar="ID",
                    help="with --to-mlflow or --to-wandb: log into this run (a training run), "
                         "at the checkpoints' steps; the rows must hold one sweep (--sweep)")

    cmp = sub.add_parser("compare", help="paired bootstrap difference of two checkpoints")
    cmp.add_argument("store", metavar="STORE")
    cmp.add_argument("a", metavar="A", help="checkpoint: its path, file name, unique suffix, "
                                            "file stem (step_000600) or step (600)")
    cmp.add_argument("b", metavar="B")
    cmp.add_argument("--metric", metavar="NAME",
                     help="only this: EVAL/METRIC, METRIC or aggregate (default: all)")
    cmp.add_argument("--dataset", metavar="NAME", help="only this evaluation (data set)")
    cmp.add_argument("--sweep", metavar="NAME", help="only this sweep")
    cmp.add_argument("--items", action="store_true",
                     help="list the items one gets right and the other wrong (text tasks' "
                          "per-item records; --metric picks the right-or-wrong metric)")

    sm = sub.add_parser("samples", help="each item's record of a checkpoint on a text task")
    sm.add_argument("store", metavar="STORE")
    sm.add_argument("--checkpoint", metavar="C", required=True,
                    help="its path, file name, unique suffix, file stem or step")
    sm.add_argument("--eval", metavar="E", dest="evaluation",
                    help="the evaluation (default: the only one with records)")
    sm.add_argument("--sweep", metavar="NAME", help="only this sweep")
    sm.add_argument("--format", choices=("table", "json", "csv"), default="table")
    sm.add_argument("--wrong", action="store_true",
                    help="only the items the checkpoint got wrong (the first right-or-wrong "
                         "metric is 0)")

    ins = sub.add_parser("inspect", help="what a checkpoint holds, and whether it fits a sweep")
    ins.add_argument("path", metavar="PATH", help="a checkpoint file or folder")
    ins.add_argument("--sweep", metavar="SWEEP", help="check it against this sweep's model")
    ins.add_argument("--format", choices=("table", "json"), default="table")
    ins.add_argument("--shard", type=int, metavar="N",
                     help="the memory a worker needs with the model sharded over N workers "
                          "(default: the sweep's parallelism.shard)")

    cm = sub.add_parser("confusion", help="show a stored confusion matrix")
    cm.add_argument("store", metavar="STORE")
    cm.add_argument("checkpoint", metavar="CHECKPOINT",
                    help="its path, file name, unique suffix, file stem or step")
    cm.add_argument("--dataset", metavar="NAME", help="only this evaluation (data set)")
    cm.add_argument("--sweep", metavar="NAME", help="only this sweep")
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="on an error, also show the full traceback of the user code "
                                  "behind it (factory, forward, transform, custom metric)")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return p


def _tracker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mlflow", metavar="URI",
                   help="log each result to this MLflow tracking server too (overrides the "
                        "sweep's trackers.mlflow.uri; keeps its experiment and run_id)")
    p.add_argument("--wandb", metavar="PROJECT",
                   help="log each result to this W&B project too (overrides the sweep's "
                        "trackers.wandb.project; keeps its run_id, mode and entity)")


def console_main() -> None:
    """The ``rayeval`` command. After SIGINT or SIGTERM, Ray is already shut down; the
    process then ends at once, so no thread still inside Ray's client can crash the
    interpreter's teardown."""
    code = main()
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    signals.install()
    args = _parser().parse_args(argv)
    # Not a terminal (CI, a pipe, Ray Job logs): wide enough that tables do not wrap.
    width = None if sys.stdout.isatty() else 200
    out = Console(highlight=False, width=width)
    err = Console(stderr=True, highlight=False, width=width)
    try:
        if args.command in ("run", "watch", "submit", "k8s", "inspect"):  # sweeps, checkpoints
            load_plugins()
        if args.command == "run":
            return _run(args, out, err)
        if args.command == "watch":
            return _watch(args, out, err)
        if args.command == "submit":
            return _submit(args, err)
        if args.command == "jobs":
            return _jobs(args, out, err)
        if args.command == "k8s":
            from rayeval.integrations.k8s import render

            sys.stdout.write(render(args.sweep, image=args.image, workers=args.workers,
                                    gpus_per_worker=args.gpus_per_worker,
                                    cpus_per_worker=args.cpus_per_worker,
                                    memory_per_worker=args.memory_per_worker,
                                    namespace=args.namespace, ttl_seconds=args.ttl))
            return EXIT_OK
        if args.command == "compare":
            return _compare_items(args, out) if args.items else _compare(args, out)
        if args.command == "samples":
            return _samples(args, out)
        if args.command == "confusion":
            return _confusion(args, out)
        if args.command == "inspect":
            return _inspect(args, out)
        return _leaderboard(args, out)
    except RayevalError as e:
        err.print(f"[bold red]error:[/] {escape(e.message)}", markup=True, soft_wrap=True)
        if args.debug and e.detail:
            err.print(e.detail, markup=False, highlight=False, soft_wrap=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:
        stopped = "stopped following the job; it goes on" if args.command == "submit" else \
            "stopped; every result written so far is complete, and running the same command " \
            "again evaluates the rest"
        name = getattr(e, "name", "SIGINT")
        err.print(f"[rayeval] interrupted ({name}): {stopped}", markup=False, highlight=False,
                  soft_wrap=True)
        return signals.exit_code(e)


def _run(args, out: Console, err: Console) -> int:
    from rayeval import api  # noqa: F401 - imported here so --profile counts it as imports
    from rayeval.execution import driver

    _STARTED["imports"] = since_process_start()
    from rayeval.reporting.boards import build_board, latest_rows, without_members
    from rayeval.plan.loader import load_sweep, with_trackers
    from rayeval.io.store import ResultStore

    sweep = args.sweep
    if args.mlflow is not None or args.wandb is not None:
        sweep = with_trackers(load_sweep(args.sweep), mlflow=args.mlflow, wandb=args.wandb)
    report = api.run(sweep, workers=args.workers, output=args.output,
                     address=args.address, force=args.force, verbose=args.verbose,
                     progress=False if args.quiet else err)
    plan = report.plan
    sweep = plan.sweep                      # with --workers / --output applied
    keys = report.cell_keys
    groups = {g.name for g in sweep.groups}
    rows = without_members([r for r in latest_rows(ResultStore(sweep.output).read())
                            if r["cell"] in keys or (r["sweep"] == sweep.name
                                                     and r["dataset"] in groups)])
    if rows:
        render_rich(build_board(rows), out, title=sweep.name)
    done = sum(1 for o in report.outcomes if o.ok)
    if plan.cells:
        ran = (f"{sweep.workers} worker(s)" + (f" on {report.nodes} node(s)" if report.nodes
                                                else "") + f", {report.seconds:.1f} s")
    else:
        ran = f"nothing to run, {report.seconds:.1f} s"
    out.print(f"{done} cell(s) evaluated, {len(plan.cached)} already in the store, "
              f"{len(report.failures)} failed; {ran}"
              + (f"; results in {sweep.output}" if rows else ""))
    for f in report.failures:
        err.print(f"[bold red]failed:[/] {escape(f.error)}", soft_wrap=True)
        if args.debug and f.detail:
            err.print(f.detail, markup=False, highlight=False, soft_wrap=True)
    if args.profile:

        report.timer.add("imports", _STARTED.get("imports", 0.0))
        for line in render_profile(report.timer, report.worker_times, since_process_start()):
            err.print(line, markup=False, highlight=False, soft_wrap=True)
    return EXIT_CELLS_FAILED if report.failures else EXIT_OK


def _watch(args, out: Console, err: Console) -> int:
    from rayeval.plan.loader import load_sweep, watch_spec, with_overrides, with_trackers
    from rayeval.integrations.watch import watch

    if args.interval <= 0 or (args.settle is not None and args.settle < 0):
        raise SpecError("--interval must be above 0 and --settle at least 0 seconds")
    sweep = with_overrides(load_sweep(args.sweep), workers=args.workers, output=args.output)
    sweep = with_trackers(sweep, mlflow=args.mlflow, wandb=args.wandb)
    given = {k: v for k, v in (("ready", args.ready), ("order", args.order)) if v is not None}
    if given:
        sweep = sweep.replace(watch=watch_spec(given, source="rayeval watch", base=sweep.watch,
                                               prefix="--"))
    mode = "quiet" if args.quiet else "auto"

    def say(text: str) -> None:
        err.print(text, markup=False, highlight=False, soft_wrap=True)

    try:
        state = watch(sweep, interval_s=args.interval,
                      settle_s=args.interval if args.settle is None else args.settle,
                      address=args.address, verbose=args.verbose,
                      display_for=lambda: make_display(mode, err), say=say)
    except KeyboardInterrupt as e:
        say(f"[rayeval] watch stopped ({getattr(e, 'name', 'SIGINT')}); every result written "
            "so far is complete")
        return signals.exit_code(e)
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
              f"{pkg.folder}); following its log (Ctrl-C stops following, not the job)",
              markup=False, highlight=False, soft_wrap=True)
    try:
        status = jobs.follow(client, job_id)
    except KeyboardInterrupt as e:
        err.print(f"[rayeval] stopped following; job {job_id} goes on: `rayeval jobs status "
                  f"{job_id}` or `rayeval jobs stop {job_id}`", markup=False, highlight=False,
                  soft_wrap=True)
        return signals.exit_code(e)
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


def _stored_rows(args) -> list[dict]:
    """The newest stored rows of a STORE argument, filtered by --sweep / --dataset
    (``rayeval.results``, as dicts)."""
    from rayeval.io.store import newest

    return newest(args.store, sweep=getattr(args, "sweep", None) or None,
                  evaluation=getattr(args, "dataset", None) or None, what="STORE").to_pylist()


def _leaderboard(args, out: Console) -> int:
    from rayeval.reporting.boards import (AGGREGATE, aggregates, build_board, columns_of,
                                          resolve_metric, without_members)

    rows = _stored_rows(args)
    code = EXIT_OK if _push(args, rows) else EXIT_CELLS_FAILED
    if not args.members:
        rows = without_members(rows)
    # json lists what is stored, even nothing; every other output needs a board.
    board = None if args.format == "json" and not args.plot else build_board(rows, args.metric)
    if args.plot:
        from rayeval.reporting.plot import plot

        columns = [board.column(args.metric)] if args.metric else board.columns
        plot(board, columns, args.plot, title=f"rayeval: {args.store}")
        print(f"plot written to {args.plot}", file=sys.stderr, flush=True)
    if args.format == "json":
        summary = aggregates(rows)
        matrices = [r for r in rows if r["metric"] == args.metric and r["matrix"]]
        if matrices:                                  # --metric confusion_matrix
            rows, summary = matrices, []
        elif args.metric and rows:
            column = resolve_metric(args.metric, columns_of(rows))
            rows = [r for r in rows
                    if (r["dataset"], r["metric"]) == (column.evaluation, column.metric)]
            summary = summary if column.name == AGGREGATE else []
        sys.stdout.write(to_json(rows, replicates=args.replicates, aggregates=summary))
        return code
    if args.format == "table":
        render_rich(board, out)
    elif args.format == "markdown":
        sys.stdout.write(to_markdown(board))
    elif args.format == "html":
        sys.stdout.write(to_html(board))
    else:
        sys.stdout.write(to_csv(board))
    return code


def _push(args, rows: list[dict]) -> bool:
    """``--to-mlflow`` / ``--to-wandb``: the rows shown, to the trackers; whether all went."""
    from rayeval.reporting.trackers import push

    if args.experiment is not None and args.to_mlflow is None:
        raise SpecError("--experiment: only with --to-mlflow URI")
    if args.run_id is not None and (args.to_mlflow is None) == (args.to_wandb is None):
        raise SpecError("--run-id: give it with one of --to-mlflow or --to-wandb (a run id "
                        "belongs to one tracker)")
    if args.to_mlflow is None and args.to_wandb is None:
        return True
    for flag, value in (("--to-mlflow", args.to_mlflow), ("--to-wandb", args.to_wandb),
                        ("--experiment", args.experiment), ("--run-id", args.run_id)):
        if value is not None and not value.strip():
            raise SpecError(f"{flag}: expected a non-empty value")
    trackers = Trackers(
        mlflow=None if args.to_mlflow is None else MlflowTracker(
            uri=args.to_mlflow, experiment=args.experiment, run_id=args.run_id,
            key_path="--to-mlflow"),
        wandb=None if args.to_wandb is None else WandbTracker(
            project=args.to_wandb, run_id=args.run_id, key_path="--to-wandb"))
    return push(rows, trackers)


def _compare(args, out: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    from rayeval.reporting.boards import AGGREGATE, compare, find_checkpoint

    rows = _stored_rows(args)
    a_rows = find_checkpoint(rows, args.a, "A")
    b_rows = find_checkpoint(rows, args.b, "B")
    found = compare(a_rows, b_rows, args.metric)
    if all(c.paired is None for c in found):
        raise StoreError("no bootstrap replicates to pair for these checkpoints; evaluate them "
                         "with bootstrap replicates on, with the same seed and buckets")
    caption = "paired bootstrap over the same resampled rows"
    aggregate = next((c.a for c in found if c.name == AGGREGATE), None)
    if aggregate is not None:
        terms = [f"{e}/{m}" for e, m in zip(aggregate["evaluations"], aggregate["metrics"])]
        caption += ("; aggregate: mean over evaluations of " + ", ".join(terms)
                    + " (lower-is-better ones negated)")
    table = Table(title=Text(f"A = {a_rows[0]['checkpoint']}\nB = {b_rows[0]['checkpoint']}"),
                  caption=Text(caption))
    for h in ("metric", "A", "B", "A - B", "interval", "P(A better)"):
        table.add_column(h, justify="left" if h == "metric" else "right", no_wrap=True)
    for c in found:
        p = c.paired
        cells = [format_value(c.a["value"]), format_value(c.b["value"])] + (
            ["-", "-", "-"] if p is None else
            [f"{p.difference:+.4f}", f"[{p.ci_low:+.4f}, {p.ci_high:+.4f}]", f"{p.a_better:.3f}"])
        table.add_row(Text(c.name), *cells)
    out.print(table)
    return EXIT_OK


def _samples(args, out: Console) -> int:
    import pyarrow.compute as pc

    from rayeval.reporting.samples import (checkpoint_rows, read_cell_samples,
                                           right_or_wrong_metric)

    rows = checkpoint_rows(args.store, args.checkpoint, args.sweep)
    evaluation, table = read_cell_samples(args.store, rows, args.evaluation)
    if args.wrong:
        metric = right_or_wrong_metric(table, None, evaluation)
        table = table.filter(pc.equal(table[metric], 0.0))
    if args.format == "json":
        sys.stdout.write(json.dumps(table.to_pylist(), indent=1, default=str) + "\n")
    elif args.format == "csv":
        sys.stdout.write(_csv(table))
    else:
        _samples_table(out, f"{rows[0]['checkpoint']} on {evaluation}: {table.num_rows} items",
                       table)
    return EXIT_OK


def _csv(table) -> str:
    """CSV of records; list columns (choices, log-likelihoods) as JSON."""
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.column_names)
    for r in table.to_pylist():
        writer.writerow([json.dumps(v) if isinstance(v, list) else ("" if v is None else v)
                         for v in r.values()])
    return buf.getvalue()


def _samples_table(out: Console, title: str, table, width: int = 60) -> None:
    from rich.table import Table
    from rich.text import Text

    from rayeval.reporting.samples import RECORD_COLUMNS

    # multiple choice: the choices and their log-likelihoods stay in json and csv
    many = "choices" in table.column_names
    shown = [c for c in table.column_names
             if not (many and c in ("choices", "loglikelihoods"))]
    out.print(title, markup=False, highlight=False, soft_wrap=True)
    view = Table()
    for c in shown:
        view.add_column(c, justify="right" if c not in RECORD_COLUMNS else "left",
                        overflow="fold", max_width=width if c == "context" else None)
    for r in table.to_pylist():
        view.add_row(*[Text(_short(r[c], width)) for c in shown])
    out.print(view)


def _short(value, width: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format_value(value)
    if isinstance(value, list):
        value = ", ".join(format_value(v) if isinstance(v, float) else str(v) for v in value)
    text = str(value).replace("\n", "\\n")
    return text if len(text) <= width else "..." + text[-(width - 3):]


def _compare_items(args, out: Console) -> int:
    from rayeval.reporting.samples import (checkpoint_rows, evaluations_with_samples,
                                           item_differences, read_cell_samples)

    a_rows = checkpoint_rows(args.store, args.a, args.sweep, what="A")
    b_rows = checkpoint_rows(args.store, args.b, args.sweep, what="B")
    evaluations = [args.dataset] if args.dataset else [
        e for e in evaluations_with_samples(a_rows) if e in evaluations_with_samples(b_rows)]
    if not evaluations:
        raise StoreError("--items: A and B have no evaluation with per-item records in common "
                         "(text tasks keep them; samples: true)")
    metric = args.metric
    for evaluation in evaluations:
        _, a = read_cell_samples(args.store, a_rows, evaluation, what="--dataset")
        _, b = read_cell_samples(args.store, b_rows, evaluation, what="--dataset")
        if metric and "/" in metric and not metric.startswith(f"{evaluation}/"):
            continue
        d = item_differences(a, b, evaluation, metric)
        out.print(f"{evaluation} ({d.metric}, {d.items} items): A = {a_rows[0]['checkpoint']}, "
                  f"B = {b_rows[0]['checkpoint']}", markup=False, highlight=False)
        for label, part in (("right in A, wrong in B", d.a_only),
                            ("right in B, wrong in A", d.b_only)):
            _samples_table(out, f"{label}: {part.num_rows}", part)
    return EXIT_OK


def _confusion(args, out: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    from rayeval.reporting.boards import find_checkpoint

    rows = [r for r in find_checkpoint(_stored_rows(args), args.checkpoint, "CHECKPOINT")
            if r["matrix"]]
    if not rows:
        raise StoreError("no confusion matrix stored for that checkpoint; add confusion_matrix "
                         "to the sweep's metrics")
    for r in rows:
        m = r["matrix"]
        out.print(Text(f"{r['checkpoint']} on {r['dataset']} (rows: target, columns: "
                       "prediction)"), soft_wrap=True)     # a heading: a path is not folded
        table = Table()
        table.add_column("target")
        for j in range(len(m)):
            table.add_column(str(j), justify="right")
        for i, line in enumerate(m):
            table.add_row(str(i), *(str(v) for v in line))
        out.print(table)
    return EXIT_OK


def _inspect(args, out: Console) -> int:
    import json
    import os

    from rich.table import Table

    from rayeval.io.loading import CheckpointSpec, describe, prefix_label

    path = os.path.abspath(args.path)
    if not os.path.exists(path):
        raise CheckpointError(f"PATH: no checkpoint at {args.path!r}")
    from rayeval.io import hf
    from rayeval.io.model import ModelSource

    model, spec, against = None, CheckpointSpec(), args.sweep
    shard, dtype = args.shard, None
    if shard is not None and shard < 1:
        raise SpecError(f"--shard: must be at least 1, got {shard}")
    folder = hf.describe(path) if os.path.isdir(path) and hf.is_folder(path) else None
    if args.sweep:
        from rayeval.plan.loader import load_sweep

        sweep = load_sweep(args.sweep)
        model = ModelSource(sweep.model, sweep.base_dir).meta(path)
        spec = sweep.checkpoint
        shard = shard or sweep.parallelism.shard
        from rayeval.io.loading import DTYPES

        dtype = DTYPES.get(sweep.model.dtype)
    elif folder is not None and hf.available():
        model, against = hf.Builder().meta(path), "its config.json"   # the model it describes
    info = describe(path, model, spec)
    if folder is not None:
        info["hugging_face"] = folder
    if model is not None:
        from rayeval.execution.sharding import memory

        need = memory(model, shard or 1, args.sweep and sweep.parallelism.wrap or (), dtype)
        info["memory"] = {"shard": need.shard, "weights_bytes": need.total,
                          "held_bytes": need.resident, "root_bytes": need.root,
                          "largest_unit_bytes": need.largest_unit, "units": need.units,
                          "peak_weights_bytes": need.peak}
    if args.format == "json":
        sys.stdout.write(json.dumps(info, indent=2) + "\n")
        return EXIT_OK if info.get("fits", True) else EXIT_CELLS_FAILED
    table = Table(show_header=False)       # the path on its own line: a title would fold it
    table.add_column("", style="bold")
    table.add_column("")
    step = "-" if info["step"] is None else f"{info['step']} (from the {info['step_from']})"
    # a file's own name (its path relative to itself would be "."); a folder's files inside it
    files = [os.path.relpath(f, path) if os.path.isdir(path) else os.path.basename(f)
             for f in info["files"]]
    rows = [("layout", info["layout"]),
            ("files", "\n".join(files) or "-"),
            ("tensors", f"{info['tensors']:,}"),
            ("parameters", f"{info['parameters']:,} ({info['bytes'] / 2**20:.1f} MiB)"),
            ("dtypes", ", ".join(f"{k}: {v:,}" for k, v in info["dtypes"].items())),
            ("step", step)]
    if info["epoch"] is not None:
        rows.append(("epoch", f"{info['epoch']} (from the name)"))
    # the same rows with and without --sweep: with it, what was stripped to fit the model;
    # without, what the fixed rules (DDP, torch.compile) would strip to reach plain keys
    rows += [("state dict under", info["wrapper"] or "(top level)"),
             ("key groups", ", ".join(f"{k} ({v})" for k, v in info["key_groups"].items())),
             ("prefixes", ", ".join(prefix_label(p, spec) for p in info["prefixes_stripped"])
              or "none")]
    if folder is not None:
        rows += [("model", f"{folder['model_type']} ({', '.join(folder['architectures'])})"),
                 ("vocabulary", f"{folder['vocab_size']:,}" if folder["vocab_size"] else "-"),
                 ("context", f"{folder['context']:,} tokens" if folder["context"] else "-"),
                 ("tokenizer", ", ".join(folder["tokenizer_files"]) or
                  "[red]none[/]: text tasks need model.tokenizer")]
    if model is not None:
        fits = "[green]yes[/]" if info["fits"] else "[red]no[/]: " + "; ".join(info["problems"])
        rows.append((f"fits {against}", fits))
        m = info["memory"]
        mib = 2 ** 20
        if m["shard"] == 1:
            need = f"{m['weights_bytes'] / mib:,.1f} MiB of weights, whole on every worker"
        else:
            need = (f"{m['peak_weights_bytes'] / mib:,.1f} MiB of weights at the peak, sharded "
                    f"over {m['shard']} workers: {m['held_bytes'] / mib:,.1f} MiB held + "
                    f"2 x {m['largest_unit_bytes'] / mib:,.1f} MiB for the largest of "
                    f"{m['units']} units while it is gathered + {m['root_bytes'] / mib:,.1f} "
                    f"MiB outside the units (whole during a forward pass)")
        rows.append(("memory per worker", need + "; activations come on top"))
    for k, v in rows:
        table.add_row(k, v)
    out.print(path, markup=False, highlight=False, soft_wrap=True)
    out.print(table)
    return EXIT_OK if info.get("fits", True) else EXIT_CELLS_FAILED
