"""Leaderboards as text: a rich table, markdown, csv, json (a self-contained html page:
``reporting.board_html``, from the same rows and legends).

Every format takes a :class:`rayeval.ranking.board.Board` (json: the stored rows and the aggregate
rows). The rich table never crops or folds a number: when the columns do not fit the console it
drops the intervals first, then whole metric columns from the right, and names those in its
caption.
"""

from __future__ import annotations

import csv
import io
import json
import math
from typing import TYPE_CHECKING

from rayeval.io.store import confidence_of
from rayeval.ranking.columns import LIMITED, count_text, shown_interval

if TYPE_CHECKING:
    from rayeval.ranking import Board, Column, Entry

EXACT = "exact"          # ``shown_interval``'s kind for an all-0 or all-1 cell

NAMES = ("sweep", "evaluation", "checkpoint")           # left-aligned text; may fold if need be
_NAME_WIDTH = 32
_LEGEND = "*: best; ~: not distinguishable from the best"
LIMIT_LEGEND = f"{LIMITED}: scored on the first items of its task only (limit:; see the notes)"


def missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def format_value(v: float | None) -> str:
    """Four decimals, or "-" for a missing number."""
    return "-" if missing(v) else f"{v:.4f}"


def _short_names(entries: list[Entry]) -> dict[str, str]:
    """Checkpoint locations without their common folder, for display."""
    locs = sorted({e.checkpoint for e in entries})
    if len(locs) < 2:
        return {loc: loc.rstrip("/").rsplit("/", 1)[-1] for loc in locs}
    prefix = locs[0]
    for loc in locs[1:]:
        while not loc.startswith(prefix):
            prefix = prefix[:-1]
    cut = prefix.rfind("/") + 1
    return {loc: loc[cut:] for loc in locs}


def _cell(e: Entry, column: str, intervals: bool = True, unmarked: str = "") -> str:
    """A value, its interval and its mark; ``unmarked``: the mark of a column whose marks are
    not set yet (a one-character stand-in measures as wide as any mark)."""
    row = e.rows.get(column)
    if row is None or missing(row["value"]):
        return "-"
    text = count_text(row) or format_value(row["value"])
    if intervals:
        text += _interval_text(row)
    return text + e.marks.get(column, unmarked) + (LIMITED if column in e.limited else "")


def _interval_text(row: dict) -> str:
    """" [low, high]", " exact [low, high]" (``shown_interval``: all items scored alike), or
    "" without an interval."""
    low, high, kind = shown_interval(row)
    if not kind:
        return ""
    return f" {'exact ' if kind == EXACT else ''}[{format_value(low)}, {format_value(high)}]"


def _levels(board: Board, columns: list[Column]) -> str:
    """The confidence levels of the intervals these columns show: "95%", "90% or 95%"."""
    found = sorted({confidence_of(row) for e in board.entries for c in columns
                    for row in [e.rows.get(c.name)]
                    if row is not None and shown_interval(row)[2]})
    return " or ".join(f"{100 * c:g}%" for c in found)


def _any_exact(board: Board, columns: list[Column]) -> bool:
    return any(shown_interval(e.rows.get(c.name))[2] == EXACT
               for e in board.entries for c in columns)


def interval_legend(board: Board, columns: list[Column]) -> str:
    """What the intervals shown are: their level, and the exact ones where there are some."""
    level = _levels(board, columns)
    text = f"[low, high]: {level + ' ' if level else ''}bootstrap interval"
    if _any_exact(board, columns):
        text += ("; exact [low, high]: every item scored the same (0 or 1), which no resample "
                 "can vary, so the Clopper-Pearson exact binomial interval instead")
    return text


def any_limited(board: Board) -> bool:
    return any(e.limited for e in board.entries)


def arrow(board: Board) -> str:
    return "higher is better" if board.higher_is_better else "lower is better"


def aggregate_legend(board: Board) -> str:
    """What the aggregate column is (``ranking.aggregate.legend``: the mean win rate, a mean
    or a weighted mean of the columns it combines, lower-is-better ones negated)."""
    return board.legend


def table_rows(board: Board, intervals: bool = True, columns: list[Column] | None = None,
               unmarked: str = "") -> tuple[list[str], list[list[str]]]:
    """Header and cells; an ``evaluation`` column only when the board holds one evaluation (with
    several, the column names carry it)."""
    columns = board.columns if columns is None else columns
    single = len(board.evaluations) == 1
    names = _short_names(board.entries)
    header = ["rank", "sweep"] + (["evaluation"] if single else []) + ["checkpoint", "step"] \
        + [c.name for c in columns]
    rows = []
    for e in board.entries:
        rank = "-" if e.stopped else f"{e.rank}{' *' if e.best else ''}"   # partial: unranked
        rows.append([rank, e.sweep]
                    + ([board.evaluations[0]] if single else [])
                    + [names[e.checkpoint], "-" if e.step is None else str(e.step)]
                    + [_cell(e, c.name, intervals,
                             "" if c.name in board.marked else unmarked) for c in columns])
    return header, rows


# --- rich ----------------------------------------------------------------------------------

def render_rich(board: Board, console, title: str | None = None, mark=None) -> None:
    """A rich table that fits ``console.width`` without cropping a number: with intervals if
    everything fits, else without, else without whole metric columns from the right (never
    the ranking column), which the caption names. Sweep and data set columns only when they
    vary (else in the title). The board's notes (too little data) follow it. ``mark``: sets
    the marks of the columns it is given (``boards.mark`` after reading their replicates),
    called only for the columns a table may show; None: the board's marks are set."""
    from rich.text import Text

    if mark is None:
        mark = lambda columns: None                        # noqa: E731 - every one is set
    table = None
    # without the marks not yet set, a table is at most as wide as with them: when even that
    # does not fit, no column's marks are needed to know that
    if any(_fits(console, _rich_table(board, list(board.columns), [], intervals, title))
           for intervals in (True, False)):
        mark(board.columns)
        for intervals in (True, False):
            candidate = _rich_table(board, list(board.columns), [], intervals, title)
            if _fits(console, candidate):
                table = candidate
                break
    console.print(table if table is not None else _fewest_dropped(board, console, title, mark))
    for note in board.notes:
        console.print(Text(note, style="yellow" if note.startswith("warning:") else "dim"))


def _fewest_dropped(board: Board, console, title: str | None, mark):
    """The table without the fewest metric columns, dropped from the right (never the
    ranking column), that fits; all of them dropped when none fits. A narrower set of columns
    never measures wider, so a binary search finds it (a 100-checkpoint x 300-column board
    measured one drop at a time took 295 measurements and 310 s), first with a stand-in for
    the marks not set (as wide as a mark: what fits so fits with them), then setting the marks
    of the columns shown and putting back dropped ones while the table still fits."""
    droppable = [c for c in reversed(board.columns) if c.name != board.rank_by]

    def without(k: int, unmarked: str = ""):
        gone = set(id(c) for c in droppable[:k])
        shown = [c for c in board.columns if id(c) not in gone]
        return shown, _rich_table(board, shown, list(reversed(droppable[:k])), False, title,
                                  unmarked)

    low, high = 1, len(droppable)          # zero dropped did not fit
    while low < high:
        mid = (low + high) // 2
        if _fits(console, without(mid, "~")[1]):
            high = mid
        else:
            low = mid + 1
    mark(without(low)[0])
    while low > 1:
        mark(without(low - 1)[0])
        if not _fits(console, without(low - 1)[1]):
            break
        low -= 1
    return without(low)[1]


def _fits(console, table) -> bool:
    from rich.measure import Measurement

    if getattr(table, "rayeval_floor", 0) > console.width:    # surely too wide: no measuring
        return False

    unbounded = console.options.update(max_width=1 << 20)     # measure, do not clamp
    return Measurement.get(console, unbounded, table).maximum <= console.width


def _rich_table(board: Board, columns: list[Column], hidden: list[Column], intervals: bool,
                title: str | None, unmarked: str = ""):
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    header, rows = table_rows(board, intervals, columns, unmarked)
    keep = [i for i, h in enumerate(header)
            if h not in ("sweep", "evaluation") or len({r[i] for r in rows}) > 1]
    if title is None:
        constant = [f"{h} {rows[0][i]}" for i, h in enumerate(header)
                    if h in ("sweep", "evaluation") and i not in keep]
        title = ", ".join(constant) or None
    elif len(board.evaluations) == 1 and not title.endswith(f" on {board.evaluations[0]}"):
        title += f" on {board.evaluations[0]}"           # the data set, named somewhere
    table = Table(title=None if title is None else Text(title, style="table.title"),
                  caption=Text(_caption(board, intervals, hidden), style="table.caption"))
    fixed = len(header) - len(columns)
    # A floor under the width rich measures: each number column's widest cell, every
    # column's padding (1 each side) and the rules between and around them. Measuring a
    # 300-column table of 100 checkpoints took ~5 s; most tables a search tries are far wider.
    table.rayeval_floor = len(keep) + 1
    for i in keep:
        h = header[i]
        table.rayeval_floor += 2
        if i < fixed and h in NAMES:
            # Names may fold (numbers may not): measured at most this wide, so a long path
            # never pushes a number column off the table.
            table.add_column(h, justify="left", overflow="fold", max_width=_NAME_WIDTH)
        else:   # a number: never shrunk below its widest cell, never wrapped
            width = max([cell_len(h)] + [cell_len(r[i]) for r in rows])
            table.rayeval_floor += width
            table.add_column(h, justify="right", no_wrap=True, min_width=width,
                             style="bold" if h == board.rank_by else None)
    for e, row in zip(board.entries, rows):
        table.add_row(*(Text(row[i]) for i in keep), style="green" if e.best else None)
    return table


def _caption(board: Board, intervals: bool, hidden: list[Column]) -> str:
    parts = [f"ranked by {board.rank_by} ({arrow(board)})"]
    if intervals:
        parts.append(interval_legend(board, board.columns))
    lines = ["; ".join(parts + [_LEGEND] + ([LIMIT_LEGEND] if any_limited(board) else []))]
    if board.averaged:
        lines.append(aggregate_legend(board))
    if hidden:
        where = "" if len(board.evaluations) == 1 else ", one evaluation with --eval NAME"
        lines.append(f"{len(hidden)} more column(s) not shown (too wide): "
                     f"{', '.join(c.name for c in hidden)}; see them with --metric NAME"
                     f"{where} or --format csv")
    return "\n".join(lines)


# --- markdown, csv (html: reporting.board_html) ---------------------------------------------

def to_markdown(board: Board) -> str:
    header, rows = table_rows(board)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_csv(board: Board) -> str:
    """One line per entry: full checkpoint locations, values as ``repr`` (every digit), then
    ``<column>_ci_low``, ``<column>_ci_high`` and ``<column>_mark`` for every column; where
    some cell was scored on a ``limit:``, ``<column>_limit`` too ("limit: 30 of 2,376
    items", or empty)."""
    single = len(board.evaluations) == 1
    names = board.metrics
    limits = names if any_limited(board) else []
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["rank", "best", "sweep"] + (["evaluation"] if single else [])
               + ["checkpoint", "step"] + names
               + [f"{m}_{part}" for m in names for part in ("ci_low", "ci_high", "mark")]
               + [f"{m}_limit" for m in limits])

    def num(v):
        return "" if missing(v) else repr(v)

    for e in board.entries:
        got = {m: e.rows.get(m) or {} for m in names}
        w.writerow([e.rank, int(e.best), e.sweep] + ([board.evaluations[0]] if single else [])
                   + [e.checkpoint, "" if e.step is None else e.step]
                   + [num(got[m].get("value")) for m in names]
                   + [x for m in names for x in (num(got[m].get("ci_low")),
                                                 num(got[m].get("ci_high")),
                                                 e.marks.get(m, ""))]
                   + [e.limited.get(m, "") for m in limits])
    return out.getvalue()


# --- json ----------------------------------------------------------------------------------

_AGGREGATE_FIELDS = ("sweep", "checkpoint", "step", "evaluation", "metric", "value", "ci_low",
                     "ci_high", "higher_is_better", "num_samples", "created_at", "bootstrap",
                     "confidence", "aggregate", "evaluations", "metrics")


def to_json(rows: list[dict], replicates: bool = False, aggregates: list[dict] = ()) -> str:
    """A JSON list: the stored rows as they are (``replicates`` only when asked), then one row
    per (sweep, checkpoint) for the aggregate over a suite's evaluations (see
    ``leaderboard.aggregate_row``)::

        {"sweep": ..., "checkpoint": ..., "step": ..., "evaluation": "*", "metric": "aggregate",
         "value": ..., "ci_low": ..., "ci_high": ..., "higher_is_better": true,
         "num_samples": <sum over the evaluations>, "created_at": <newest part>,
         "bootstrap": <the parts' key when they share one, else null>, "confidence": ...,
         "aggregate": "win_rate", "evaluations": ["val", "ood"], "metrics": ["accuracy", "nll"]}

    ``aggregate`` says how it combines them (``ranking.aggregate``): ``win_rate`` (the mean
    over the evaluations of the share of the board's other checkpoints beaten), ``mean`` (also
    a win rate's board of one checkpoint) or ``weights``. ``metrics[i]`` is the metric of
    ``evaluations[i]`` that is combined (negated when lower is better; null where the
    checkpoint lacks it). Missing numbers (NaN) are null.
    """
    def clean(r: dict, keys) -> dict:
        out = {k: r.get(k) for k in keys}
        if replicates:
            reps = r.get("replicates")
            out["replicates"] = reps.tolist() if hasattr(reps, "tolist") else reps
        if out.get("created_at") is not None:
            out["created_at"] = out["created_at"].isoformat()
        for k in ("value", "ci_low", "ci_high"):
            if missing(out.get(k)):
                out[k] = None
        return out

    stored = [clean(r, [k for k in r if k != "replicates"]) for r in rows]
    return dumps_indented(stored + [clean(a, _AGGREGATE_FIELDS) for a in aggregates]) + "\n"


def dumps_indented(items: list[dict]) -> str:
    """``json.dumps(items, indent=2)``, the same text, ~10x faster for flat rows: Python 3.11's
    JSON encoder is pure Python with ``indent`` (300,000 rows: ~12 s), its C encoder is not.
    Runs of rows with no list or dict value go through the C encoder with a NUL in the item
    separator (a string's NUL is always escaped, so only separators hold one), then are broken
    into lines there. Other rows: ``json.dumps(indent=2)``."""
    if not items:
        return "[]"
    blocks: list[str] = []
    run: list[dict] = []

    def flush():
        if run:
            # a raw NUL is always escaped inside strings: only separators hold one
            text = json.dumps(run, separators=(",\0", ": "))[2:-2]     # '[{' ... '}]'
            text = text.replace("},\0{", "\n  },\n  {\n    ").replace(",\0", ",\n    ")
            blocks.append("  {\n    " + text + "\n  }")
            run.clear()

    for item in items:
        if item and not any(isinstance(v, (list, dict, tuple)) for v in item.values()):
            run.append(item)
        else:
            flush()
            blocks.append("  " + json.dumps(item, indent=2).replace("\n", "\n  "))
    flush()
    return "[\n" + ",\n".join(blocks) + "\n]"
