"""Leaderboards from stored results: one row per (sweep, data set, checkpoint), one column per
metric, ranked by one metric within each data set."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field

import pyarrow as pa

from .errors import StoreError


def latest_rows(table: pa.Table) -> list[dict]:
    """The newest row for every (sweep, checkpoint, dataset, metric), in store order."""
    newest: dict[tuple, dict] = {}
    for row in table.to_pylist():
        key = (row["sweep"], row["checkpoint"], row["dataset"], row["metric"])
        if key not in newest or row["created_at"] >= newest[key]["created_at"]:
            newest[key] = row
    return list(newest.values())


@dataclass
class Entry:
    sweep: str
    dataset: str
    checkpoint: str
    step: int | None
    values: dict[str, float]
    rows: dict[str, dict] = field(default_factory=dict)   # metric -> stored row
    rank: int = 0
    best: bool = False
    marks: dict[str, str] = field(default_factory=dict)   # metric -> "*" best, "~" tied with it


def bootstrap_params(key: str | None) -> dict[str, str]:
    return dict(part.split("=", 1) for part in key.split(";")) if key else {}


@dataclass
class Paired:
    """A - B on the same bootstrap replicates."""
    difference: float
    ci_low: float
    ci_high: float
    a_better: float          # share of replicates in which A is better (ties count half)


def paired(a: dict, b: dict, confidence: float = 0.95) -> Paired | None:
    """The paired bootstrap difference of two stored rows of one metric, or None when they do
    not share replicates (bootstrap off, other data, other seed or bucket count)."""
    ka, kb = bootstrap_params(a.get("bootstrap")), bootstrap_params(b.get("bootstrap"))
    ka.pop("confidence", None)
    kb.pop("confidence", None)
    if not a.get("replicates") or not b.get("replicates") or ka != kb \
            or a["dataset"] != b["dataset"] or a["num_samples"] != b["num_samples"]:
        return None
    import torch

    from .stats import percentile_interval

    d = torch.tensor(a["replicates"], dtype=torch.float64) - \
        torch.tensor(b["replicates"], dtype=torch.float64)
    lo, hi = percentile_interval(d, confidence)
    d = d[~torch.isnan(d)]
    sign = 1.0 if a["higher_is_better"] else -1.0
    better = float(((sign * d > 0).double() + 0.5 * (d == 0).double()).mean()) if d.numel() \
        else float("nan")
    return Paired(a["value"] - b["value"], lo, hi, better)


@dataclass
class Board:
    metrics: list[str]            # columns, in the order results were written
    rank_by: str
    higher_is_better: bool
    entries: list[Entry]          # sorted: data set, then rank


def build_board(rows: list[dict], metric: str | None = None) -> Board:
    if not rows:
        raise StoreError("the result store holds no results yet; run a sweep first")
    metrics: list[str] = []
    higher: dict[str, bool] = {}
    entries: dict[tuple, Entry] = {}
    rows = [r for r in rows if not r.get("matrix")]        # matrices are shown, not ranked
    if not rows:
        raise StoreError("the result store holds no ranked metrics yet; run a sweep first")
    for r in rows:
        if r["metric"] not in higher:
            metrics.append(r["metric"])
            higher[r["metric"]] = r["higher_is_better"]
        key = (r["sweep"], r["dataset"], r["checkpoint"])
        entry = entries.setdefault(key, Entry(r["sweep"], r["dataset"], r["checkpoint"],
                                              r["step"], {}))
        entry.values[r["metric"]] = r["value"]
        entry.rows[r["metric"]] = r
    rank_by = metric or metrics[0]
    if rank_by not in higher:
        raise StoreError(f"--metric: no results for metric {rank_by!r}; the store has: "
                         f"{', '.join(metrics)}")
    sign = -1.0 if higher[rank_by] else 1.0

    def order(e: Entry):
        v = e.values.get(rank_by)
        missing = v is None or (isinstance(v, float) and math.isnan(v))
        return (e.dataset, missing, sign * v if not missing else 0.0, e.step or 0, e.checkpoint)

    ranked = sorted(entries.values(), key=order)
    per_dataset: dict[str, int] = {}
    for e in ranked:
        per_dataset[e.dataset] = per_dataset.get(e.dataset, 0) + 1
        e.rank = per_dataset[e.dataset]
        e.best = e.rank == 1 and e.values.get(rank_by) is not None
    for m in metrics:
        _mark(ranked, m, higher[m])
    return Board(metrics=metrics, rank_by=rank_by, higher_is_better=higher[rank_by],
                 entries=ranked)


def _mark(entries: list[Entry], metric: str, higher: bool) -> None:
    """Per data set: '*' on the best value of a metric, '~' on those whose paired interval of
    the difference to the best contains zero (not distinguishable from it)."""
    by_dataset: dict[str, list[Entry]] = {}
    for e in entries:
        v = e.values.get(metric)
        if v is not None and not math.isnan(v):
            by_dataset.setdefault(e.dataset, []).append(e)
    for group in by_dataset.values():
        best = max(group, key=lambda e: e.values[metric] if higher else -e.values[metric])
        best.marks[metric] = "*"
        for e in group:
            if e is best:
                continue
            p = paired(best.rows[metric], e.rows[metric], confidence_of(best.rows[metric]))
            if p is not None and p.ci_low <= 0 <= p.ci_high:
                e.marks[metric] = "~"


def confidence_of(row: dict) -> float:
    return float(bootstrap_params(row.get("bootstrap")).get("confidence", 0.95))


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


def _fmt(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.4f}"


def _cell(e: Entry, metric: str, intervals: bool = True) -> str:
    row = e.rows.get(metric)
    if row is None:
        return "-"
    text = _fmt(row["value"])
    if intervals and row.get("ci_low") is not None:
        text += f" [{_fmt(row['ci_low'])}, {_fmt(row['ci_high'])}]"
    return text + e.marks.get(metric, "")


def table_rows(board: Board, intervals: bool = True) -> tuple[list[str], list[list[str]]]:
    names = _short_names(board.entries)
    header = ["rank", "sweep", "dataset", "checkpoint", "step"] + board.metrics
    rows = []
    for e in board.entries:
        rows.append([f"{e.rank}{' *' if e.best else ''}", e.sweep, e.dataset, names[e.checkpoint],
                     "-" if e.step is None else str(e.step)]
                    + [_cell(e, m, intervals) for m in board.metrics])
    return header, rows


def render_rich(board: Board, console, title: str | None = None) -> None:
    """A rich table; sweep and data set columns only when they vary."""
    from rich.table import Table

    arrow = "higher is better" if board.higher_is_better else "lower is better"
    # Intervals only when every column fits: a folded number is worse than none.
    intervals = 45 + 28 * len(board.metrics) <= console.width
    header, rows = table_rows(board, intervals)
    keep = [i for i, h in enumerate(header)
            if h not in ("sweep", "dataset") or len({r[i] for r in rows}) > 1]
    if title is None:
        fixed = [f"{h} {rows[0][i]}" for i, h in enumerate(header)
                 if h in ("sweep", "dataset") and i not in keep]
        title = ", ".join(fixed) or None
    legend = "\\[low, high]: bootstrap interval; " if intervals else ""
    table = Table(title=title, caption=f"ranked by {board.rank_by} ({arrow}); {legend}"
                  "*: best; ~: not distinguishable from the best")
    for i in keep:
        h = header[i]
        numeric = h in ("rank", "step") or h in board.metrics
        table.add_column(h, justify="right" if numeric else "left", no_wrap=True,
                         overflow="fold",
                         style="bold" if h == board.rank_by else None)
    for e, row in zip(board.entries, rows):
        table.add_row(*(row[i] for i in keep), style="green" if e.best else None)
    console.print(table)


def to_markdown(board: Board) -> str:
    header, rows = table_rows(board)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def to_csv(board: Board) -> str:
    out = io.StringIO()
    w = csv.writer(out)
    extra = [f"{m}_{part}" for m in board.metrics for part in ("ci_low", "ci_high", "mark")]
    w.writerow(["rank", "best", "sweep", "dataset", "checkpoint", "step"] + board.metrics + extra)
    for e in board.entries:
        def num(v):
            return "" if v is None or (isinstance(v, float) and math.isnan(v)) else repr(v)

        w.writerow([e.rank, int(e.best), e.sweep, e.dataset, e.checkpoint,
                    "" if e.step is None else e.step]
                   + [num(e.values.get(m)) for m in board.metrics]
                   + [x for m in board.metrics for x in (
                       num(e.rows.get(m, {}).get("ci_low")), num(e.rows.get(m, {}).get("ci_high")),
                       e.marks.get(m, ""))])
    return out.getvalue()


_CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; }
th, td { padding: .3em .7em; border-bottom: 1px solid #ddd; text-align: right;
         white-space: nowrap; }
th { background: #f4f4f4; position: sticky; top: 0; }
td.name, th.name { text-align: left; }
tr.best td { background: #e8f6e8; font-weight: 600; }
td.tied { background: #f3f9f3; }
th.rank-by { text-decoration: underline; }
.ci { color: #777; font-size: 90%; }
caption { caption-side: bottom; color: #555; padding-top: .6em; text-align: left; }
"""


def to_html(board: Board, title: str = "rayeval leaderboard") -> str:
    """A self-contained page (inline style, no scripts or links to fetch)."""
    from html import escape

    names = _short_names(board.entries)
    arrow = "higher is better" if board.higher_is_better else "lower is better"
    head = "".join(f'<th class="name">{h}</th>' if h in ("sweep", "dataset", "checkpoint")
                   else f"<th>{h}</th>" for h in ("rank", "sweep", "dataset", "checkpoint", "step"))
    head += "".join(f'<th class="{"rank-by" if m == board.rank_by else ""}">{escape(m)}</th>'
                    for m in board.metrics)
    body = []
    for e in board.entries:
        cells = [f"<td>{e.rank}{' *' if e.best else ''}</td>",
                 f'<td class="name">{escape(e.sweep)}</td>',
                 f'<td class="name">{escape(e.dataset)}</td>',
                 f'<td class="name" title="{escape(e.checkpoint)}">'
                 f"{escape(names[e.checkpoint])}</td>",
                 f"<td>{'-' if e.step is None else e.step}</td>"]
        for m in board.metrics:
            row = e.rows.get(m)
            mark = e.marks.get(m, "")
            text = "-" if row is None else _fmt(row["value"])
            if row is not None and row.get("ci_low") is not None:
                text += f' <span class="ci">[{_fmt(row["ci_low"])}, {_fmt(row["ci_high"])}]</span>'
            cls = ' class="tied"' if mark == "~" else ""
            cells.append(f"<td{cls}>{text}{mark}</td>")
        tr = '<tr class="best">' if e.best else "<tr>"
        body.append(tr + "".join(cells) + "</tr>")
    caption = (f"ranked by {escape(board.rank_by)} ({arrow}) within each data set; "
               "[low, high]: bootstrap interval; *: best; ~: not distinguishable from the best "
               "(the paired interval of the difference contains 0)")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>\n"
            f"<h1>{escape(title)}</h1>\n<table><caption>{caption}</caption>\n"
            f"<thead><tr>{head}</tr></thead>\n<tbody>\n" + "\n".join(body)
            + "\n</tbody></table>\n</body></html>\n")


def to_json(rows: list[dict], replicates: bool = False) -> str:
    def clean(r: dict) -> dict:
        out = dict(r)
        if not replicates:
            out.pop("replicates", None)
        out["created_at"] = r["created_at"].isoformat()
        for k in ("value", "ci_low", "ci_high"):
            if isinstance(out[k], float) and math.isnan(out[k]):
                out[k] = None
        return out

    return json.dumps([clean(r) for r in rows], indent=2) + "\n"


def find_checkpoint(rows: list[dict], name: str, what: str) -> list[dict]:
    """The rows of the one checkpoint a user named by path, file name or unique suffix."""
    import os

    full = os.path.abspath(name)
    exact = [r for r in rows if r["checkpoint"] in (name, full)]
    if exact:
        return exact
    found = sorted({r["checkpoint"] for r in rows
                    if r["checkpoint"].rstrip("/").endswith("/" + name.strip("/"))
                    or r["checkpoint"].rstrip("/").rsplit("/", 1)[-1] == name})
    if not found:
        raise StoreError(f"{what}: no checkpoint {name!r} in the store; "
                         "`rayeval leaderboard STORE` lists them")
    if len(found) > 1:
        raise StoreError(f"{what}: {name!r} matches several checkpoints ({', '.join(found[:4])});"
                         " give more of the path")
    return [r for r in rows if r["checkpoint"] == found[0]]
