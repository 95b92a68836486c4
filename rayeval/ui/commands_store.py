"""The commands that read a result store: ``leaderboard`` (and its push to the trackers),
``compare`` (paired bootstrap, or item by item), ``samples`` and ``confusion``."""

from __future__ import annotations

import json
import os
import sys

from rich.console import Console

from rayeval.config.schema import MlflowTracker, Trackers, WandbTracker
from rayeval.errors import SpecError, StoreError
from rayeval.reporting.board_html import to_html
from rayeval.reporting.render import format_value, render_rich, to_csv, to_json, to_markdown
from rayeval.ui.exit_codes import EXIT_CELLS_FAILED, EXIT_OK


def _stored_rows(args, replicates: str = "all", metric: str | None = None) -> list[dict]:
    """The newest stored rows of a STORE argument, filtered by --sweep / --eval /
    --checkpoint in the files' scan (``rayeval.results``, as dicts), with the replicates
    ``replicates`` asks for (``ranking.stored``)."""
    from rayeval.ranking.stored import stored_rows

    return stored_rows(args.store, sweep=getattr(args, "sweep", None) or None,
                       evaluation=getattr(args, "evaluation", None) or None, metric=metric,
                       checkpoint=getattr(args, "checkpoint_glob", None),
                       replicates=replicates)


def _board(args, **options):
    """The board of the command's STORE and filters (``rayeval.leaderboard``: every format
    is the one board the API makes)."""
    from rayeval.api import leaderboard

    return leaderboard(args.store, sweep=args.sweep or None, evaluation=args.evaluation or None,
                       checkpoint=args.checkpoint_glob, members=args.members, _what="STORE",
                       aggregate=getattr(args, "aggregate", None), **options)


def _json_board(args):
    """``leaderboard --format json``: the rows the board shows as stored (all but their
    replicates, unless --replicates) and its aggregate rows, or with --metric that column's
    rows alone (``confusion_matrix``: the matrices)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from rayeval.ranking.aggregate import ranked_of
    from rayeval.reporting import json_board as jb
    from rayeval.ranking.board import AGGREGATE, resolve_metric

    board = _board(args, rank=False)
    table, summary = board.table, board.aggregate_rows
    if args.metric and table.num_rows:
        matrices = table.filter(pc.and_(pc.equal(table["metric"], args.metric),
                                        pa.array(~ranked_of(table))))
        if matrices.num_rows:                      # --metric confusion_matrix
            table, summary = matrices, []
        else:
            column = resolve_metric(args.metric, board.columns)
            table = table.filter(pc.and_(pc.equal(table["evaluation"], column.evaluation),
                                         pc.equal(table["metric"], column.metric)))
            summary = summary if column.name == AGGREGATE else []
    if not args.replicates:
        return jb.board_json(table, summary)
    from rayeval.ranking.stored import with_replicates

    rows = with_replicates(args.store, table.to_pylist(), args.sweep or None,
                           {(r["cell"], r["evaluation"], r["metric"]) for r in
                            table.select(["cell", "evaluation", "metric"]).to_pylist()})
    return [to_json(rows, replicates=True, aggregates=summary)]


def _leaderboard(args, out: Console) -> int:
    if args.samples_dir is not None and args.format != "html":
        raise SpecError("--samples-dir: only with --format html (the pages the board links to)")
    _check_push_flags(args)
    # the board with pages is made first: a store without records is refused before anything
    # is pushed or written (an empty folder of pages said nothing of why)
    paged = _board_with_records(args) if args.samples_dir else None
    code = EXIT_OK if _push(args) else EXIT_CELLS_FAILED
    if args.plot:
        from rayeval.reporting.plot import plot

        board = _board(args, metric=args.metric)
        columns = [board.column(args.metric)] if args.metric else board.columns
        plot(board, columns, args.plot, title=f"rayeval: {args.store}")
        print(f"plot written to {args.plot}", file=sys.stderr, flush=True)
    if args.format == "json":
        for text in _json_board(args):
            sys.stdout.write(text)
        return code
    board = paged if paged is not None else _board(args, metric=args.metric,
                                                   marks=args.format != "table")
    if args.format == "table":
        from rayeval.ranking.board import mark

        render_rich(board, out, mark=lambda columns: mark(board, columns))
    elif args.format == "markdown":
        sys.stdout.write(to_markdown(board))
    elif args.format == "html":
        pages = _samples_pages(args.store, [r for e in board.entries for r in e.rows.values()
                                            if r.get("cell")], args.samples_dir) \
            if args.samples_dir else None
        sys.stdout.write(to_html(board, samples=pages))
    else:
        sys.stdout.write(to_csv(board))
    return code


def _board_with_records(args):
    """``leaderboard --format html --samples-dir DIR``'s board; a StoreError naming the fix
    when none of its cells stored per-item records (there would be no page to write)."""
    from rayeval.reporting.samples import HOW_TO_KEEP

    board = _board(args, metric=args.metric, marks=True)
    rows = [r for e in board.entries for r in e.rows.values() if r.get("cell")]
    if not any(r.get("samples") for r in rows):
        shown = ", ".join(dict.fromkeys(r["evaluation"] for r in rows)) or "none"
        raise StoreError(f"--samples-dir: no cell of this board stored per-item records (its "
                         f"evaluations: {shown}); {HOW_TO_KEEP}, or leave out --samples-dir")
    return board


def _samples_pages(store: str, rows: list[dict], folder: str) -> dict[tuple[str, str], str]:
    """``leaderboard --format html --samples-dir DIR``: the page of every (checkpoint,
    evaluation) of the board that stored per-item records, written to DIR/<cell>.html; the
    board links to each as DIR/<cell>.html (DIR as given: relative to where the board is
    opened, so put DIR beside it)."""
    import os

    from rayeval.reporting.samples import read_cell_samples

    os.makedirs(folder, exist_ok=True)
    pages = {}
    for row in rows:
        key = (row["checkpoint"], row["evaluation"])
        if not row.get("samples") or key in pages:
            continue
        evaluation, table = read_cell_samples(store, [row], row["evaluation"])
        name = f"{row['cell']}.html"
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(samples_html(table, row["checkpoint"], evaluation))
        pages[key] = f"{folder.rstrip('/')}/{name}"
    return pages


def _check_push_flags(args) -> None:
    """--experiment and --run-id only with the tracker they belong to (checked before any
    board is read, whatever the format)."""
    if args.experiment is not None and args.to_mlflow is None:
        raise SpecError("--experiment: only with --to-mlflow URI")
    if args.run_id is not None and (args.to_mlflow is None) == (args.to_wandb is None):
        raise SpecError("--run-id: give it with one of --to-mlflow or --to-wandb (a run id "
                        "belongs to one tracker)")


def _push(args) -> bool:
    """``--to-mlflow`` / ``--to-wandb``: the stored rows, to the trackers; whether all went."""
    from rayeval.reporting.trackers import push

    _check_push_flags(args)
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
    return push(_stored_rows(args), trackers)


def _compare(args, out: Console) -> int:
    from rich.table import Table
    from rich.text import Text

    from rayeval.ranking.columns import LIMITED
    from rayeval.ranking.compare import AGGREGATE, compare, find_checkpoint
    from rayeval.ranking.stored import with_replicates

    rows = _stored_rows(args, "none")
    a_rows = find_checkpoint(rows, args.a, "A")
    b_rows = find_checkpoint(rows, args.b, "B")
    with_replicates(args.store, a_rows + b_rows, getattr(args, "sweep", None) or None)
    found = compare(a_rows, b_rows, args.metric, getattr(args, "aggregate", None))
    partial = [(what, r) for what, rows_ in (("A", a_rows), ("B", b_rows)) for r in rows_
               if r.get("items_total") is not None]
    if all(c.paired is None for c in found) and partial:
        what, r = partial[0]
        raise StoreError(f"{what} ({r['checkpoint']}) has partial cells from a race "
                         f"({r['stopped'] or 'stopped early'}), which pair only with cells of the "
                         "same items: run the sweep again without select: to complete them")
    limited = _limited_cells(found)
    if all(c.paired is None for c in found) and limited:
        (what, name), text = next(iter(limited.items()))
        checkpoint = (a_rows if what == "A" else b_rows)[0]["checkpoint"]
        raise StoreError(f"{what} ({checkpoint}) has cells scored on a limit: ({name}: {text}), "
                         "which pair only with cells of the same items: evaluate both "
                         "checkpoints with the same limit:, or both without one")
    if all(c.paired is None for c in found):
        raise StoreError("no bootstrap replicates to pair for these checkpoints; evaluate them "
                         "with bootstrap replicates on, with the same seed and buckets")
    caption = "paired bootstrap over the same resampled rows"
    if partial:
        caption += ("; partial (a race's, stopped early): "
                    + ", ".join(sorted({w for w, _ in partial})) + ", over the items scored")
    if limited:
        caption += (f"; {LIMITED}: scored on the first items of the task only: "
                    + ", ".join(f"{w} {name} ({text})" for (w, name), text in limited.items()))
    aggregate = next((c.a for c in found if c.name == AGGREGATE), None)
    if aggregate is not None:
        terms = ", ".join(f"{e}/{m}" for e, m in zip(aggregate["evaluations"],
                                                     aggregate["metrics"]))
        caption += ("; aggregate: share of the evaluations won (ties half) of " + terms
                    if aggregate["aggregate"] == "win_rate" else
                    f"; aggregate: {'weighted ' if aggregate.get('weights') else ''}mean over "
                    f"evaluations of {terms} (lower-is-better ones negated)")
    table = Table(title=Text(f"A = {a_rows[0]['checkpoint']}\nB = {b_rows[0]['checkpoint']}"),
                  caption=Text(caption))
    for h in ("metric", "A", "B", "A - B", "interval", "P(A better)"):
        table.add_column(h, justify="left" if h == "metric" else "right", no_wrap=True)
    for c in found:
        p = c.paired
        marks = [LIMITED if (w, _evaluation_of(c, row)) in limited else ""
                 for w, row in (("A", c.a), ("B", c.b))]
        cells = [format_value(c.a["value"]) + marks[0], format_value(c.b["value"]) + marks[1]] + (
            ["-", "-", "-"] if p is None else
            [f"{p.difference:+.4f}", f"[{p.ci_low:+.4f}, {p.ci_high:+.4f}]", f"{p.a_better:.3f}"])
        table.add_row(Text(c.name), *cells)
    out.print(table)
    return EXIT_OK


def _evaluation_of(c, row: dict) -> str:
    """The evaluation a compared row belongs to: its own, or the aggregate's name."""
    return c.name if row.get("evaluation") == "*" else row["evaluation"]


def _limited_cells(found) -> dict[tuple[str, str], str]:
    """(A or B, evaluation or the aggregate) -> "limit: 30 of 2,376 items" for the compared
    rows scored on an entry's ``limit:`` (``ranking.columns.limit_text``), in table order."""
    from rayeval.ranking.columns import limit_text

    out: dict[tuple[str, str], str] = {}
    for c in found:
        for what, row in (("A", c.a), ("B", c.b)):
            text = limit_text(row)
            if text is not None:
                out.setdefault((what, _evaluation_of(c, row)), text)
    return out


def _samples(args, out: Console) -> int:
    import pyarrow.compute as pc

    from rayeval.reporting.samples import (checkpoint_rows, read_cell_samples,
                                           right_or_wrong_metric)

    rows = checkpoint_rows(args.store, args.checkpoint, args.sweep)
    evaluation, table = read_cell_samples(args.store, rows, args.evaluation)
    if args.wrong:
        metric = right_or_wrong_metric(table, None, evaluation)
        table = table.filter(pc.equal(table[metric], 0.0))
    if args.format == "html":
        sys.stdout.write(samples_html(table, rows[0]["checkpoint"], evaluation))
    elif args.format == "json":
        sys.stdout.write(json.dumps(_with_data_uris(table.to_pylist()), indent=1, default=str)
                         + "\n")
    elif args.format == "csv":
        sys.stdout.write(_csv(table))
    else:
        _samples_table(out, f"{rows[0]['checkpoint']} on {evaluation}: {table.num_rows} items",
                       table)
    return EXIT_OK


def samples_html(table, checkpoint: str, evaluation: str) -> str:
    """One cell's records as a page (``reporting.samples_page``), wrong items first by the
    first right-or-wrong metric, if the records have one."""
    from rayeval.reporting.samples import metric_columns, right_or_wrong_metric
    from rayeval.reporting.samples_page import samples_page

    try:
        metric = right_or_wrong_metric(table, None, evaluation)
    except StoreError:              # no right-or-wrong metric (perplexity): items by id
        metric = None
    return samples_page(table, f"{checkpoint} on {evaluation}", metric_columns(table), metric)


def _with_data_uris(records: list[dict]) -> list[dict]:
    """Records with their image thumbnails as data URIs (json and csv)."""
    from rayeval.reporting.samples_page import data_uri

    for r in records:
        if r.get("thumbnails") is not None:
            r["thumbnails"] = [data_uri(png) for png in r["thumbnails"]]
    return records


def _csv(table) -> str:
    """CSV of records; list columns (choices, log-likelihoods, images as data URIs) as JSON."""
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.column_names)
    for r in _with_data_uris(table.to_pylist()):
        writer.writerow([json.dumps(v) if isinstance(v, list) else ("" if v is None else v)
                         for v in r.values()])
    return buf.getvalue()


def _samples_table(out: Console, title: str, table, width: int = 60) -> None:
    from rich.table import Table
    from rich.text import Text

    from rayeval.reporting.samples import RECORD_COLUMNS

    # multiple choice: the choices and their log-likelihoods stay in json and csv; image
    # thumbnails in json, csv and html
    many = "choices" in table.column_names
    # a judged item's prompt (long) stays in json, csv and html too
    # an item's row (its position in the data) where it has one: its id is then a hash
    shown = [c for c in table.column_names
             if not (many and c in ("choices", "loglikelihoods"))
             and c not in ("thumbnails", "judge_prompt", "judge_prompt_swapped")
             and not (c == "id" and "row" in table.column_names)]
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
    evaluations = [args.evaluation] if args.evaluation else [
        e for e in evaluations_with_samples(a_rows) if e in evaluations_with_samples(b_rows)]
    if not evaluations:
        raise StoreError("--items: A and B have no evaluation with per-item records in common "
                         "(text and classification tasks store them; samples: true)")
    metric = args.metric
    for evaluation in evaluations:
        _, a = read_cell_samples(args.store, a_rows, evaluation, what="--eval")
        _, b = read_cell_samples(args.store, b_rows, evaluation, what="--eval")
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

    from rayeval.ranking.compare import find_checkpoint

    rows = [r for r in find_checkpoint(_stored_rows(args), args.checkpoint, "CHECKPOINT")
            if r["matrix"]]
    if not rows:
        raise StoreError("no confusion matrix stored for that checkpoint; add confusion_matrix "
                         "to the sweep's metrics")
    for r in rows:
        m = r["matrix"]
        out.print(Text(f"{r['checkpoint']} on {r['evaluation']} (rows: target, columns: "
                       "prediction)"), soft_wrap=True)     # a heading: a path is not folded
        table = Table()
        table.add_column("target")
        for j in range(len(m)):
            table.add_column(str(j), justify="right")
        for i, line in enumerate(m):
            table.add_row(str(i), *(str(v) for v in line))
        out.print(table)
    return EXIT_OK


def _compact(args, out: Console) -> int:
    from rayeval.ranking.suite import summaries
    from rayeval.io import paths
    from rayeval.io.store import ResultStore

    location = paths.resolve(args.store, os.getcwd())
    if not paths.is_uri(location) and not os.path.isdir(location):
        raise StoreError(f"STORE: no result store at {args.store!r}; give the output folder "
                         "of a sweep")
    moved = ResultStore(location).compact(summarize=summaries)
    print(f"{moved.cells} cell file(s) moved into {moved.parts_written} part(s); "
          f"{moved.parts_merged} small part(s) merged", file=sys.stderr, flush=True)
    for path in moved.damaged:
        print(f"warning: damaged file left where it is: {path}; move it away (its cell is "
              "evaluated again on the next run)", file=sys.stderr, flush=True)
    for path in moved.kept:
        print(f"note: {path} was written again while compacting; kept (the next compaction "
              "moves it)", file=sys.stderr, flush=True)
    return EXIT_OK


def _query(args, out: Console) -> int:
    from rayeval.io.store.query import query

    table = query(args.store, args.sql, damaged="skip" if args.skip_damaged else "refuse")
    if args.format == "json":
        sys.stdout.write(json.dumps(table.to_pylist(), indent=1, default=str) + "\n")
    else:
        sys.stdout.write(_csv(table))
    return EXIT_OK
