"""``rayeval report`` (one self-contained page of a store) and ``rayeval view`` (the same app
served from the store on 127.0.0.1): docs/report.md."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from rayeval.errors import SpecError
from rayeval.ui.exit_codes import EXIT_OK

if TYPE_CHECKING:
    from rich.console import Console     # the parser (cli) imports this module: no rich


def _title(args) -> str:
    shown = args.evaluation or args.sweep
    return f"rayeval report: {shown}" if shown else "rayeval report"


def _report(args, out: Console) -> int:
    from rayeval.reporting.report import Report
    from rayeval.reporting.report_page import page

    target = os.path.abspath(args.output)
    if not os.path.isdir(os.path.dirname(target)):
        raise SpecError(f"--output: no folder {os.path.dirname(target)!r} to write "
                        f"{os.path.basename(target)!r} into; create it or give another path")
    if os.path.isdir(target):
        raise SpecError(f"--output: {args.output!r} is a folder; give a file name such as "
                        "report.html")
    report = Report(args.store, sweep=args.sweep, evaluation=args.evaluation,
                    checkpoint=args.checkpoint_glob)
    html = page(report.views(items=not args.no_items), _title(args))
    temporary = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.partial")
    with open(temporary, "w", encoding="utf-8") as f:     # renamed whole: never half a page
        f.write(html)
    os.replace(temporary, target)
    size = len(html.encode("utf-8")) / 1e6
    print(f"report written to {args.output} ({size:.1f} MB; {len(report.board.entries)} "
          f"checkpoint(s), {len(report.board.evaluations)} evaluation(s))", file=sys.stderr,
          flush=True)
    return EXIT_OK


def _view(args, out: Console) -> int:
    from rayeval.reporting.report import Report
    from rayeval.reporting.report_server import serve

    if not 0 <= args.port <= 65535:
        raise SpecError(f"--port: {args.port} is no port; give 0 to 65535 (0: any free one)")
    report = Report(args.store, sweep=args.sweep, evaluation=args.evaluation,
                    checkpoint=args.checkpoint_glob, marks=False)

    def ready(url: str) -> None:
        print(f"rayeval view: {url} (serving {args.store} on this machine only; Ctrl-C stops)",
              file=sys.stderr, flush=True)

    try:
        serve(report, args.port, _title(args), ready)
    except KeyboardInterrupt:           # the way a server is stopped: not an error
        print("rayeval view: stopped", file=sys.stderr, flush=True)
    except OSError as e:
        raise SpecError(f"--port: cannot listen on 127.0.0.1:{args.port} ({e.strerror}); "
                        "give another port, or 0 for any free one") from None
    return EXIT_OK


def add_parsers(sub) -> None:
    """The two commands' arguments (``ui.cli`` builds the parser)."""
    for name, text in (("report", "write one self-contained HTML report of a result store: "
                                  "a sortable board, curves, items, A against B"),
                       ("view", "serve the same report from the store on 127.0.0.1, "
                                "reading only what each view shows")):
        p = sub.add_parser(name, help=text)
        p.add_argument("store", metavar="STORE", help="a result store: folder or "
                                                      "s3://bucket/prefix")
        if name == "report":
            p.add_argument("--output", "-o", metavar="FILE.html", required=True,
                           help="the page to write (replaced whole)")
            p.add_argument("--no-items", action="store_true",
                           help="leave the per-item records out (a smaller file)")
        else:
            p.add_argument("--port", type=int, default=8765,
                           help="the port on 127.0.0.1 (default 8765; 0: any free one)")
        p.add_argument("--sweep", metavar="NAME", help="only this sweep")
        p.add_argument("--eval", "--dataset", dest="evaluation", metavar="NAME",
                       help="only this evaluation")
        p.add_argument("--checkpoint", metavar="GLOB", dest="checkpoint_glob",
                       help="only checkpoints whose location matches this pattern")
