"""Leaderboards from stored results: one row per (sweep, data set, checkpoint), one column per
metric, ranked by one metric within each data set."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass

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
    rank: int = 0
    best: bool = False


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
    for r in rows:
        if r["metric"] not in higher:
            metrics.append(r["metric"])
            higher[r["metric"]] = r["higher_is_better"]
        key = (r["sweep"], r["dataset"], r["checkpoint"])
        entry = entries.setdefault(key, Entry(r["sweep"], r["dataset"], r["checkpoint"],
                                              r["step"], {}))
        entry.values[r["metric"]] = r["value"]
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
    return Board(metrics=metrics, rank_by=rank_by, higher_is_better=higher[rank_by],
                 entries=ranked)


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
    if v is None:
        return "-"
    return f"{v:.4f}"


def table_rows(board: Board) -> tuple[list[str], list[list[str]]]:
    names = _short_names(board.entries)
    header = ["rank", "sweep", "dataset", "checkpoint", "step"] + board.metrics
    rows = []
    for e in board.entries:
        rows.append([f"{e.rank}{' *' if e.best else ''}", e.sweep, e.dataset, names[e.checkpoint],
                     "-" if e.step is None else str(e.step)]
                    + [_fmt(e.values.get(m)) for m in board.metrics])
    return header, rows


def render_rich(board: Board, console, title: str | None = None) -> None:
    """A rich table; sweep and data set columns only when they vary."""
    from rich.table import Table

    arrow = "higher is better" if board.higher_is_better else "lower is better"
    header, rows = table_rows(board)
    keep = [i for i, h in enumerate(header)
            if h not in ("sweep", "dataset") or len({r[i] for r in rows}) > 1]
    if title is None:
        fixed = [f"{h} {rows[0][i]}" for i, h in enumerate(header)
                 if h in ("sweep", "dataset") and i not in keep]
        title = ", ".join(fixed) or None
    table = Table(title=title, caption=f"ranked by {board.rank_by} ({arrow}); * best per data set")
    for i in keep:
        h = header[i]
        numeric = h in ("rank", "step") or h in board.metrics
        table.add_column(h, justify="right" if numeric else "left", no_wrap=not numeric
                         or h == "rank", overflow="fold",
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
    w.writerow(["rank", "best", "sweep", "dataset", "checkpoint", "step"] + board.metrics)
    for e in board.entries:
        w.writerow([e.rank, int(e.best), e.sweep, e.dataset, e.checkpoint,
                    "" if e.step is None else e.step]
                   + ["" if e.values.get(m) is None else repr(e.values[m]) for m in board.metrics])
    return out.getvalue()


def to_json(rows: list[dict]) -> str:
    def clean(r: dict) -> dict:
        out = dict(r)
        out["created_at"] = r["created_at"].isoformat()
        for k in ("value", "ci_low", "ci_high"):
            if isinstance(out[k], float) and math.isnan(out[k]):
                out[k] = None
        return out

    return json.dumps([clean(r) for r in rows], indent=2) + "\n"
