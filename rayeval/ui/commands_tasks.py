"""``rayeval tasks --check KIND``: every task of a library's registry, accepted or the first
reason a run refuses it (``harness.coverage``)."""

from __future__ import annotations

import os
import sys

from rich.console import Console

from rayeval.errors import SpecError
from rayeval.ui.exit_codes import EXIT_OK

FORMATS = ("table", "csv", "json")


def add_parser(sub) -> None:
    """The command's arguments (``ui.cli`` builds the parser)."""
    p = sub.add_parser("tasks", help="which tasks of lm-eval's or lmms-eval's registry run "
                                     "here, and why the others do not")
    p.add_argument("--check", metavar="KIND", required=True,
                   help="the entry kind whose library's registry to check: lm_eval or "
                        "lmms_eval (a plugin's kind too)")
    p.add_argument("--include-path", metavar="DIR",
                   help="a folder of your own task YAMLs, checked with the library's")
    p.add_argument("--task", metavar="GLOB",
                   help="only the tasks whose names match this pattern (e.g. 'mmlu_*'; "
                        "default: every leaf task)")
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="table: the counts and the reasons; csv and json: one row per leaf "
                        "task (task, status, reason)")


def _tasks(args, out: Console) -> int:
    from rayeval.config.entries import kinds
    from rayeval.harness import coverage

    kind, entries = args.check, kinds()
    if kind not in entries:
        raise SpecError(f"--check: no entry kind {kind!r}; choose one of: "
                        f"{', '.join(sorted(entries.names()))}")
    entry = entries.get(kind)
    if not hasattr(entry, "coverage"):
        raise SpecError(f"--check: entry kind {kind!r} has no task registry to check")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise SpecError(f"--include-path: no folder at {args.include_path}; give a folder of "
                        "task YAMLs")
    for key, value in coverage.OFFLINE.items():      # before the libraries are imported
        os.environ.setdefault(key, value)
    try:
        verdicts = entry.coverage(args.include_path and os.path.abspath(args.include_path),
                                  args.task)
    except ImportError as e:
        raise SpecError(f"--check: {entry.library} cannot be imported ({e}); pip install "
                        f"'rayeval[{kind.replace('_', '-')}]'") from None
    if args.task and not verdicts:
        raise SpecError(f"--task: no task of {entry.library} matches {args.task!r}")
    if args.format == "csv":
        import csv

        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(("task", "status", "reason"))
        w.writerows((v.task, v.status, v.reason) for v in verdicts)
        return EXIT_OK
    if args.format == "json":
        import json

        json.dump([{"task": v.task, "status": v.status, "reason": v.reason}
                   for v in verdicts], sys.stdout, indent=1)
        sys.stdout.write("\n")
        return EXIT_OK
    from rich.table import Table

    accepted, total, reasons = coverage.summary(verdicts)
    share = 100.0 * accepted / total if total else 0.0
    out.print(f"{entry.library}: {accepted:,} of {total:,} leaf tasks accepted ({share:.1f}%)")
    if reasons:
        table = Table(title="why the others are refused (the first reason of each; TASK: the "
                            "task's name)", title_justify="left")
        table.add_column("tasks", justify="right")
        table.add_column("reason")
        for reason, count in reasons:
            table.add_row(f"{count:,}", reason)
        out.print(table)
    out.print("one row per task: --format csv or --format json")
    return EXIT_OK
