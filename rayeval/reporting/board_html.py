"""A board as a self-contained html page (``rayeval leaderboard --format html``): the rich
table's columns and legends (``reporting.render``), a sticky header and first columns, each
value's interval on hover, and links to each cell's per-item page where they were written
(``--samples-dir``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rayeval.io.store import confidence_of
from rayeval.ranking.columns import LIMITED, shown_interval
from rayeval.reporting.render import (EXACT, LIMIT_LEGEND, NAMES, aggregate_legend, any_limited,
                                      arrow, format_value, interval_legend, missing, table_rows)

if TYPE_CHECKING:
    from rayeval.ranking import Board, Column, Entry


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.5em; overflow-wrap: anywhere; }
.scroll { overflow: auto; max-height: 85vh; max-width: 100%; border: 1px solid #ddd; }
table { border-collapse: separate; border-spacing: 0; }
th, td { padding: .3em .7em; border-bottom: 1px solid #ddd; text-align: right;
         white-space: nowrap; background: #fff; }
th { background: #f4f4f4; position: sticky; top: 0; z-index: 1; vertical-align: bottom; }
.name { text-align: left; }
td.name { white-space: normal; overflow-wrap: anywhere; }
.frozen { position: sticky; box-sizing: border-box; z-index: 2; }
th.frozen { z-index: 3; }
.frozen.last { border-right: 2px solid #aaa; }
td.best { font-weight: 700; background: #c6e9c6; box-shadow: inset 4px 0 #1f7a1f; }
td.tied { background: #fbe3a1; }
.mark { font-weight: 700; padding-left: .15em; }
.mark.limited { color: #8a4b00; }
th.rank-by { text-decoration: underline; }
th .n { display: block; font-weight: normal; color: #555; font-size: 85%; }
.ci { color: #555; font-size: 90%; font-weight: normal; }
.ci.exact { color: #8a4b00; }
figure { margin: 0; }
figcaption { color: #444; padding-top: .6em; max-width: 60em; }
ul.notes { padding-left: 1.2em; max-width: 60em; }
li.warning { color: #8a4b00; }
@media print { .scroll { overflow: visible; max-height: none; border: 0; }
               th, .frozen { position: static; } }
"""

# The frozen columns' widths (em, padding included): sticky cells need fixed offsets, and
# these keep four of them to ~27em (380 px), leaving an 800 px window room for two values
# with their intervals. Longer names wrap inside them.
_FROZEN_EM = {"rank": 4.0, "sweep": 6.5, "evaluation": 6.5, "checkpoint": 11.0, "step": 5.5}


def to_html(board: Board, title: str = "rayeval leaderboard",
            samples: dict[tuple[str, str], str] | None = None) -> str:
    """A self-contained page (inline style, no scripts or links to fetch); ``samples``:
    (checkpoint, evaluation) -> the address of its per-item records' page, which that
    evaluation's values of the checkpoint link to. The board scrolls in its own box with the
    header row and the name columns (rank, sweep, checkpoint, step) frozen; each column's best
    cell is marked (bold, a green bar, ``*``), the ones not distinguishable from it shaded
    (``~``); the legend and the board's notes follow."""
    from html import escape

    header, rows = table_rows(board, intervals=False)
    fixed = header[:len(header) - len(board.columns)]
    title = _with_evaluation(board, title)
    body = "\n".join(_html_row(board, e, row, fixed, samples or {})
                     for e, row in zip(board.entries, rows))
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(title)}</title><style>{_CSS}{_frozen_css(fixed)}</style>"
            f"</head><body>\n<h1>{escape(title)}</h1>\n<figure>\n<div class=\"scroll\">"
            f"<table>\n<thead><tr>{_html_head(board, fixed)}</tr></thead>\n<tbody>\n{body}\n"
            f"</tbody></table></div>\n<figcaption>{_html_legend(board)}</figcaption>\n"
            f"</figure>\n{_html_notes(board)}</body></html>\n")


def _with_evaluation(board: Board, title: str) -> str:
    """The title naming the evaluation when the board holds one (``--eval NAME``), as the
    terminal's table does."""
    if len(board.evaluations) == 1 and not title.endswith(f" on {board.evaluations[0]}"):
        return f"{title} on {board.evaluations[0]}"
    return title


def _frozen_css(fixed: list[str]) -> str:
    """Each frozen column's offset from the left: the widths of those before it."""
    rules, left = [], 0.0
    for i, name in enumerate(fixed):
        width = _FROZEN_EM[name]
        rules.append(f".f{i} {{ left: {left:g}em; width: {width:g}em; min-width: {width:g}em; "
                     f"max-width: {width:g}em; }}")
        left += width
    return "\n".join(rules) + "\n"


def _frozen(i: int, fixed: list[str]) -> str:
    """The classes of frozen column i (a name column aligns left)."""
    return f"frozen f{i}" + (" name" if fixed[i] in NAMES else "") \
        + (" last" if i == len(fixed) - 1 else "")


def _html_head(board: Board, fixed: list[str]) -> str:
    from html import escape

    head = "".join(f'<th class="{_frozen(i, fixed)}">{h}</th>' for i, h in enumerate(fixed))
    for c in board.columns:
        cls = ' class="rank-by"' if c.name == board.rank_by else ""
        n = _column_n(board, c)
        head += f"<th{cls}>{escape(c.name)}" + (f'<span class="n">{n}</span>' if n else "") \
            + "</th>"
    return head


def _column_n(board: Board, column: Column) -> str:
    """The items behind a column's values: "n = 1,000", or its range when they differ (a
    raced checkpoint's partial cells); the aggregate's, summed over its evaluations."""
    found = sorted({row["num_samples"] for e in board.entries
                    for row in [e.rows.get(column.name)]
                    if row is not None and row.get("num_samples") is not None})
    if not found:
        return ""
    text = f"n = {found[0]:,}" if len(found) == 1 else f"n = {found[0]:,}\u2013{found[-1]:,}"
    return text + (" in all" if column.evaluation == "*" else "")


def _html_row(board: Board, e: Entry, row: list[str], fixed: list[str],
              samples: dict[tuple[str, str], str]) -> str:
    from html import escape

    cells = []
    for i, (h, text) in enumerate(zip(fixed, row)):
        where = f' title="{escape(e.checkpoint)}"' if h == "checkpoint" else ""
        cells.append(f'<td class="{_frozen(i, fixed)}"{where}>{escape(text)}</td>')
    cells += [_html_cell(e, c.name, samples) for c in board.columns]
    return "<tr>" + "".join(cells) + "</tr>"


_MARKED = {"*": ("best", "the best in its column"),
           "~": ("tied", "not distinguishable from the best in its column")}


def _html_cell(e: Entry, column: str, samples: dict[tuple[str, str], str]) -> str:
    """A value with its interval (``shown_interval``) and mark; the best cell bold with a
    green bar, a tied one shaded; its n, level and mark said on hover."""
    from html import escape

    row = e.rows.get(column)
    if row is None or missing(row["value"]):
        return "<td>-</td>"
    mark = e.marks.get(column, "")
    text = format_value(row["value"])
    page = samples.get((e.checkpoint, row.get("evaluation")))
    if page is not None:
        text = f'<a href="{escape(page)}" title="each item">{text}</a>'
    text += _interval_html(row)
    if mark:
        text += f'<span class="mark">{escape(mark)}</span>'
    limited = e.limited.get(column)
    if limited:
        text += f'<span class="mark limited">{LIMITED}</span>'
    cls, said = _MARKED.get(mark, ("", ""))
    attrs = f' class="{cls}"' if cls else ""
    said = "; ".join(x for x in (said, limited) if x)
    return f'<td{attrs} title="{escape(_hover(row, said))}">{text}</td>'


def _interval_html(row: dict) -> str:
    low, high, kind = shown_interval(row)
    if not kind:
        return ""
    exact = kind == EXACT
    return (f' <span class="ci{" exact" if exact else ""}">{"exact " if exact else ""}'
            f"[{format_value(low)}, {format_value(high)}]</span>")


def _hover(row: dict, said: str) -> str:
    """A cell's title: its n, its interval's level and kind, what its mark means."""
    kind = shown_interval(row)[2]
    parts = [f"n = {row['num_samples']:,}"] if row.get("num_samples") is not None else []
    if kind:
        parts.append(f"{100 * confidence_of(row):g}% " + (
            "Clopper-Pearson exact interval" if kind == EXACT else "bootstrap interval"))
    return "; ".join(parts + ([said] if said else []))


def _html_legend(board: Board) -> str:
    from html import escape

    lines = [f"ranked by {board.rank_by} ({arrow(board)})",
             interval_legend(board, board.columns),
             "* bold with a green bar: the best value of its column; ~ shaded amber: not "
             "distinguishable from the best (the paired interval of the difference contains 0)"]
    if any_limited(board):
        lines.append(LIMIT_LEGEND)
    if board.averaged:
        lines.append(aggregate_legend(board))
    return "<br>\n".join(escape(line) for line in lines)


def _html_notes(board: Board) -> str:
    """The board's notes (too little data, scales mixed, partial cells), as the terminal
    prints them under its table."""
    from html import escape

    if not board.notes:
        return ""
    items = "".join(f'<li class="warning">{escape(n)}</li>' if n.startswith("warning:")
                    else f"<li>{escape(n)}</li>" for n in board.notes)
    return f'<ul class="notes">{items}</ul>\n'
