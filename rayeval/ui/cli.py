"""The ``rayeval`` command. Bad input is one red line and exit status 2; a run where some
checkpoints failed prints their errors and exits 1; tracebacks are for bugs only.

This module holds the parser and the dispatch, with the one error handling every command
shares; the commands themselves are in ``commands_run`` (run, watch, submit, jobs),
``commands_store`` (leaderboard, compare, samples, confusion), ``commands_report`` (report,
view) and ``commands_inspect``."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from typing import TYPE_CHECKING

from rayeval import __version__
from rayeval.execution import signals
from rayeval.errors import RayevalError
from rayeval.ui.exit_codes import EXIT_BAD_INPUT, EXIT_CELLS_FAILED, EXIT_OK  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from rich.console import Console

# The commands' modules (and rich, pyarrow, pandas behind them) are imported when a command
# runs, not to parse the line: a run handed to a `rayeval serve` imports none of them
# (``integrations.service_client``; 1 s of a loaded 2-core machine's start, measured).


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
    run.add_argument("--checkpoint", action="append", metavar="PATH",
                     help="evaluate this checkpoint (repeatable; globs allowed) instead of the "
                          "sweep's checkpoints:")
    run.add_argument("--service", metavar="URL",
                     help="the `rayeval serve` to run on (default: the one started on this "
                          "machine, if any; docs/service.md)")
    run.add_argument("--no-service", action="store_true",
                     help="run in this process even when a `rayeval serve` is up")
    _tracker_flags(run)

    sv = sub.add_parser("serve", help="keep Ray and a worker group up and take sweeps: "
                                      "`rayeval run` on this machine then runs on it")
    sv.add_argument("--workers", type=int, default=2,
                    help="Ray Train workers of the standing group (default 2)")
    sv.add_argument("--address", metavar="ADDR",
                    help="an existing Ray cluster to serve on (default: start one in this "
                         "process)")
    sv.add_argument("--host", default="127.0.0.1",
                    help="where the HTTP API listens (default 127.0.0.1, this machine only)")
    sv.add_argument("--port", type=int, default=0,
                    help="the HTTP API's port (default: any free one; `rayeval run` finds it)")
    sv.add_argument("--use-gpu", action="store_true",
                    help="the standing group's workers take a GPU each (a sweep with "
                         "use_gpu: true runs on it)")
    sv.add_argument("--verbose", action="store_true", help="show Ray's and the workers' logs")
    sv.add_argument("--status", action="store_true",
                    help="say whether this environment's service is up, and what it runs; "
                         "exit 0 if it is, 1 if not")
    sv.add_argument("--stop", action="store_true",
                    help="stop this environment's service (as Ctrl-C on it would) and wait "
                         "until it is down")

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
    lb.add_argument("--samples-dir", metavar="DIR",
                    help="with --format html: write each cell's per-item records as a page "
                         "in DIR (rayeval samples --format html) and link the board's values "
                         "to them; put DIR beside the board's file")
    lb.add_argument("--metric", metavar="NAME",
                    help="rank by this column: EVAL/METRIC, a METRIC stored for one evaluation, "
                         "or aggregate (default: the aggregate with several evaluations, else "
                         "the first metric)")
    lb.add_argument("--sweep", metavar="NAME", help="only this sweep")
    lb.add_argument("--eval", "--dataset", dest="evaluation", metavar="NAME",
                    help="only this evaluation (--dataset: the same, its older name)")
    lb.add_argument("--checkpoint", metavar="GLOB", dest="checkpoint_glob",
                    help="only checkpoints whose location matches this pattern ('*' crosses "
                         "'/'): e.g. '*/run-3/*'")
    lb.add_argument("--members", action="store_true",
                    help="also each lm-eval group's tasks (NAME/TASK), not only its aggregate")
    lb.add_argument("--aggregate", metavar="HOW",
                    help="how the aggregate column combines the evaluations' first metrics: "
                         "win_rate (default: the mean over evaluations of the share of the "
                         "other checkpoints beaten, ties half), mean (lower-is-better ones "
                         "negated) or weights as EVAL=W,EVAL=W (e.g. val=2,ood=1)")
    lb.add_argument("--replicates", action="store_true",
                    help="with --format json: include each row's bootstrap replicate values")
    lb.add_argument("--plot", metavar="FILE",
                    help="also draw each column (or only --metric) against the training step, "
                         "one line per sweep with its interval band; FILE.png, .svg or .pdf "
                         "(rayeval report draws the same in a page you can explore)")
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

    st = sub.add_parser("store", help="maintain a result store")
    stsub = st.add_subparsers(dest="action", required=True, metavar="ACTION")
    sc = stsub.add_parser("compact", help="move one-cell files into parts and merge small "
                                          "parts (safe beside running sweeps)")
    sc.add_argument("store", metavar="STORE", help="a result store: folder or s3://bucket/prefix")

    q = sub.add_parser("query", help="SQL over a result store (DuckDB; views: results, "
                                     "latest, cells)")
    q.add_argument("store", metavar="STORE", help="a result store: folder or s3://bucket/prefix")
    q.add_argument("sql", metavar="SQL",
                   help="e.g. \"SELECT evaluation, avg(value) FROM latest WHERE metric = "
                        "'accuracy' GROUP BY evaluation\"")
    q.add_argument("--format", choices=("csv", "json"), default="csv")
    q.add_argument("--skip-damaged", action="store_true",
                   help="leave out files that cannot be read (named on stderr) instead of "
                        "refusing the query")

    cmp = sub.add_parser("compare", help="paired bootstrap difference of two checkpoints")
    cmp.add_argument("store", metavar="STORE")
    cmp.add_argument("a", metavar="A", help="checkpoint: its path, file name, unique suffix, "
                                            "file stem (step_000600) or step (600)")
    cmp.add_argument("b", metavar="B")
    cmp.add_argument("--metric", metavar="NAME",
                     help="only this: EVAL/METRIC, METRIC or aggregate (default: all)")
    cmp.add_argument("--eval", "--dataset", dest="evaluation", metavar="NAME",
                     help="only this evaluation (--dataset: the same, its older name)")
    cmp.add_argument("--sweep", metavar="NAME", help="only this sweep")
    cmp.add_argument("--aggregate", metavar="HOW",
                     help="the aggregate of A and B: win_rate (default: the share of the "
                          "evaluations each wins), mean, or weights as EVAL=W,EVAL=W")
    cmp.add_argument("--items", action="store_true",
                     help="list the items one gets right and the other wrong (text and "
                          "classification tasks' per-item records; --metric picks the "
                          "right-or-wrong metric)")

    sm = sub.add_parser("samples", help="each item's record of a checkpoint on a text or "
                                        "classification task")
    sm.add_argument("store", metavar="STORE")
    sm.add_argument("--checkpoint", metavar="C", required=True,
                    help="its path, file name, unique suffix, file stem or step")
    sm.add_argument("--eval", metavar="E", dest="evaluation",
                    help="the evaluation (default: the only one with records)")
    sm.add_argument("--sweep", metavar="NAME", help="only this sweep")
    sm.add_argument("--format", choices=("table", "json", "csv", "html"), default="table",
                    help="html: a self-contained page, each item's images beside its text, "
                         "wrong items first")
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

    from rayeval.ui.commands_report import add_parsers
    from rayeval.ui.commands_tasks import add_parser as add_tasks

    add_parsers(sub)
    add_tasks(sub)

    il = sub.add_parser("install", help="install what an entry kind needs: lmms-eval (the "
                                        "rayeval[lmms-eval] extra, then lmms-eval itself "
                                        "without its dependencies)")
    il.add_argument("what", choices=["lmms-eval"], help="what to install")
    il.add_argument("--dry-run", action="store_true",
                    help="resolve every requirement with pip's --dry-run; install nothing")
    cm = sub.add_parser("confusion", help="show a stored confusion matrix")
    cm.add_argument("store", metavar="STORE")
    cm.add_argument("checkpoint", metavar="CHECKPOINT",
                    help="its path, file name, unique suffix, file stem or step")
    cm.add_argument("--eval", "--dataset", dest="evaluation", metavar="NAME",
                    help="only this evaluation (--dataset: the same, its older name)")
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
    interpreter's teardown. A signal is never ignored until the exit status is decided
    (``execution.signals``): one that lands as ``main`` returns ends the command the same
    way; once decided, the process only exits, and later signals are ignored (no traceback
    from an exit hook)."""
    _CONSOLE.append(True)          # this process runs one command: its start is the command's
    code = None
    while True:
        try:
            if code is None:
                code = main()
            for s in (signal.SIGINT, signal.SIGTERM):
                signal.signal(s, signal.SIG_IGN)
            break
        except KeyboardInterrupt as e:      # landed between main's own handling and here
            if code is None or not _said:
                from rich.console import Console

                code = _interrupted(e, Console(stderr=True, highlight=False))
    # `view` too: Ctrl-C stops its server while a request's thread may be inside a pyarrow
    # scan, and an interpreter teardown then can abort with "terminate called without an
    # active exception" (Arrow's thread pool destroyed with a worker alive: apache/arrow
    # #39862, #34314; seen once in two tries, not in 20 here). It holds nothing an exit hook
    # must write: no Ray, no tracker.
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM) or _command == ["view"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


_said: list[str] = []      # the interrupted line, once printed (a second signal adds none)
_CONSOLE: list[bool] = []  # started as the console script (console_main), not called in Python
_command: list[str] = []   # the command being run (its interrupted line; `view` ends at once)


def _interrupted(error: KeyboardInterrupt, err: Console) -> int:
    """The one line after SIGINT or SIGTERM (printed once, whatever else arrives meanwhile),
    and the exit status, 128 + the signal. ``submit`` says what became of the job (``said``
    on the exception, ``commands_run._submit``)."""
    name = signals.name(error)
    if _command == ["watch"]:
        line = f"[rayeval] watch stopped ({name}); every result written so far is complete"
    else:
        said = getattr(error, "said", None) or (
            "stopped; every result written so far is complete, and running the same command "
            "again evaluates the rest")
        line = f"[rayeval] interrupted ({name}): {said}"
    with signals.held():                # unwinding: a signal meanwhile is dropped
        if not _said:
            _said.append(line)
            err.print(line, markup=False, highlight=False, soft_wrap=True)
    return signals.exit_code(error)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line parsed (a usage error exits 2, as argparse does)."""
    return _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    signals.install()
    args = parse(argv)
    if args.command == "serve" and (args.status or args.stop):
        from rayeval.integrations import service_client       # the standard library only

        return service_client.stop() if args.stop else service_client.status()
    if args.command == "install":
        from rayeval.ui.install import install               # the standard library only

        return install(args.what, args.dry_run)
    if args.command == "run" and not args.address and not args.no_service:
        from rayeval.integrations import service_client

        found = service_client.find(args.service)     # a `rayeval serve` here (docs/service.md)
        if found is not None:
            return service_client.run(found, sys.argv[1:] if argv is None else argv)
    from rich.console import Console

    # Not a terminal (CI, a pipe, Ray Job logs): wide enough that tables do not wrap.
    width = None if sys.stdout.isatty() else 200
    out = Console(highlight=False, width=width)
    err = Console(stderr=True, highlight=False, width=width)
    return dispatch(args, out, err)


def dispatch(args, out: Console, err: Console, standing=None, seen=None) -> int:
    """Run one parsed command with these consoles, and its exit status: bad input is one line
    and 2, a signal one line and 128 + its number. ``standing`` and ``seen``: ``rayeval serve``'s
    standing worker groups and what hears of a run's report (``ui.service``)."""
    _said.clear()
    _command.clear()
    _command.append(args.command)
    from rayeval.execution.profile import command_started

    command_started(whole_process=bool(_CONSOLE) and standing is None)
    from rich.markup import escape

    from rayeval.config.plugins import load_plugins
    from rayeval.ui.commands_inspect import _inspect
    from rayeval.ui.commands_report import _report, _view
    from rayeval.ui.commands_run import _jobs, _run, _submit, _watch
    from rayeval.ui.commands_store import (_compact, _compare, _compare_items, _confusion,
                                           _leaderboard, _query, _samples)

    try:
        if args.command in ("run", "watch", "submit", "k8s", "inspect", "serve", "tasks"):
            load_plugins()
        if args.command == "run":
            return _run(args, out, err, standing=standing, seen=seen)
        if args.command == "serve":
            from rayeval.ui.service import serve

            return serve(args, err, lambda argv, *consoles, **kw: dispatch(parse(argv), *consoles,
                                                                           **kw))
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
        if args.command == "tasks":
            from rayeval.ui.commands_tasks import _tasks

            return _tasks(args, out)
        if args.command == "store":
            return _compact(args, out)
        if args.command == "query":
            return _query(args, out)
        if args.command == "report":
            return _report(args, out)
        if args.command == "view":
            return _view(args, out)
        return _leaderboard(args, out)
    except RayevalError as e:
        err.print(f"[bold red]error:[/] {escape(e.message)}", markup=True, soft_wrap=True)
        if args.debug and e.detail:
            err.print(e.detail, markup=False, highlight=False, soft_wrap=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:
        return _interrupted(e, err)
