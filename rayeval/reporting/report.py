"""The results report's data: what ``rayeval report`` writes into one page and ``rayeval view``
serves, as plain JSON-able dicts (``reporting.report_page`` is the page, ``reporting.
report_server`` the server; one app reads both).

A report is made of *views*, each one JSON document the page asks for by name:

    meta                    provenance: store, sweeps, evaluations (rows, tokens), level, dates
    board                   the board: entries, columns (values, intervals, marks) and notes
    marks?columns=[...]     the marks of some columns, a JSON list of their names (a big
                            store's board comes without them)
    paired?ref=I            every entry's paired bootstrap difference to entry I, per column
                            (``&columns=["A","B"]``: of these only, as the served page asks)
    items?evaluation=E      an evaluation's items (id, context, choices, target, images) and
                            which entries stored records of it
    cell?evaluation=E&entry=I  one entry's records of it, aligned with ``items``

The page never computes an interval itself: every figure it shows comes from ``ranking``
(``paired``, ``shown_interval``, the board's marks). It counts items (A only, B only, ...) and
the McNemar exact test of those counts, which are not in the store.

Columns are arrays, one value per entry or per item (not a dict per row): a 1,000-checkpoint x
10-evaluation board is ~1.5 MB of JSON this way, and the page sorts arrays of numbers.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone

from rayeval.config import constants
from rayeval.errors import StoreError

# Record columns that describe the item (the same for every checkpoint), and those that say what
# one checkpoint did with it.
ITEM_FIELDS = ("context", "choices", "target", "images", "thumbnails")
CELL_FIELDS = ("response", "responses", "loglikelihoods", "tokens", "probability",
               "judge_prompt", "judge_output", "judge_failed", "baseline_response",
               "judge_prompt_swapped", "judge_output_swapped", "raw_response")
_KIND_CODES = {"bootstrap": "b", "exact": "e", "": "."}
# Reports embed every reference's paired differences up to this many entries (n refs x n
# entries x columns figures); beyond it, the best and each sweep's last checkpoint.
ALL_REFERENCES = 40


class Report:
    """The views of one store, filtered as ``rayeval leaderboard`` filters (sweep, evaluation,
    checkpoint glob). The board is made once; views read records only when asked for."""

    def __init__(self, store: str, *, sweep: str | None = None, evaluation: str | None = None,
                 checkpoint: str | None = None, marks: bool = True, aggregate=None):
        from rayeval.io import paths
        from rayeval.ranking import board

        self.store = paths.resolve(os.fspath(store), os.getcwd())
        self.filters = {"sweep": sweep, "evaluation": evaluation, "checkpoint": checkpoint}
        self.board = board(self.store, sweep=sweep, evaluation=evaluation,
                           checkpoint=checkpoint, marks=marks, aggregate=aggregate)
        self._records: dict[tuple[str, int], object] = {}
        self._holders: dict[str, list[int]] | None = None

    # --- meta -------------------------------------------------------------------------------

    def meta(self) -> dict:
        """Where the figures come from: enough to reproduce or cite them."""
        from rayeval.io.store import confidence_of

        rows = [r for e in self.board.entries for r in e.rows.values()]
        stored = [r for r in rows if r.get("cell")]
        by_evaluation: dict[str, list[dict]] = {}     # one pass, not one per evaluation
        for r in stored:
            by_evaluation.setdefault(r["evaluation"], []).append(r)
        evaluations = []
        for name in self.board.evaluations:
            mine = by_evaluation.get(name, [])
            evaluations.append({
                "name": name,
                "rows": max((r["num_samples"] for r in mine), default=None),
                "tokens": max((r["num_tokens"] for r in mine
                               if r.get("num_tokens") is not None), default=None),
                "bootstrap": next((r["bootstrap"] for r in mine if r.get("bootstrap")), None),
                "records": any(r.get("samples") for r in mine),
            })
        created = [r["created_at"] for r in stored if r.get("created_at") is not None]
        sweeps = sorted({e.sweep for e in self.board.entries})
        from rayeval.io.store import ResultStore

        kept = ResultStore(self.store).sweep_texts()
        return {
            "store": self.store,
            "filters": {k: v for k, v in self.filters.items() if v},
            "sweeps": sweeps,
            "sweep_files": {name: kept[name] for name in sweeps if name in kept},
            "checkpoints": len(self.board.entries),
            "cells": len({r["cell"] for r in stored}),
            "evaluations": evaluations,
            "level": confidence_of(stored[0]) if stored else None,
            "evaluated": [min(created).isoformat(), max(created).isoformat()] if created
            else None,
            "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "version": constants.installed_version(),
        }

    # --- the board --------------------------------------------------------------------------

    def board_view(self) -> dict:
        """Entries (rank order), columns with one value per entry, the board's notes."""
        from rayeval.ranking.aggregate import AGGREGATE
        from rayeval.reporting.render import _short_names

        b = self.board
        names = _short_names(b.entries)
        averaged = {c.name for c in b.averaged}
        chance = self._chance_lines()
        columns = []
        for c in b.columns:
            view = {"name": c.name, "evaluation": c.evaluation, "metric": c.metric,
                    "higher": c.higher_is_better, "averaged": c.name in averaged,
                    "chance": chance.get(c.name)}
            view.update(self._column_values(c.name))
            columns.append(view)
        return {
            "rank_by": b.rank_by,
            "higher": b.higher_is_better,
            "entries": [{"sweep": e.sweep, "checkpoint": e.checkpoint,
                         "name": names[e.checkpoint], "step": e.step,
                         "epoch": _epoch(e), "rank": e.rank, "stopped": e.stopped,
                         "cells": {r["evaluation"]: r["cell"] for r in e.rows.values()
                                   if r.get("cell")}}
                        for e in b.entries],
            "columns": columns,
            "marked": sorted(b.marked),
            "notes": list(b.notes),
            "aggregate": AGGREGATE if any(c.name == AGGREGATE for c in b.columns) else None,
            "aggregate_legend": b.legend,           # how the aggregate combines (ranking)
        }

    def _column_values(self, name: str) -> dict:
        from rayeval.ranking.columns import shown_interval

        values, lows, highs, kinds, ns, marks = [], [], [], [], [], []
        for e in self.board.entries:
            row = e.rows.get(name)
            v = e.value(name)
            values.append(v)
            low, high, kind = shown_interval(row) if v is not None else (None, None, "")
            lows.append(_number(low))
            highs.append(_number(high))
            kinds.append(kind)
            ns.append(None if row is None else row.get("num_samples"))
            marks.append(e.marks.get(name, ""))
        # one character per entry (b: bootstrap, e: exact, '.': none), as the marks: a
        # 1,000 x 300 board's kinds as words were 3.9 MB of its JSON
        return {"values": values, "low": lows, "high": highs,
                "kind": "".join(_KIND_CODES[k] for k in kinds), "n": ns,
                "marks": "".join(m or "." for m in marks)}

    def marks(self, columns: list[str]) -> dict[str, str]:
        """The marks of these columns, one character per entry ('*', '~' or '.')."""
        from rayeval.ranking import mark

        wanted = [self.board.column(c) for c in columns]
        mark(self.board, wanted)
        return {c.name: "".join(e.marks.get(c.name, "") or "." for e in self.board.entries)
                for c in wanted}

    def _chance_lines(self) -> dict[str, float]:
        """Where a metric's chance level is known from the items: a multiple-choice
        accuracy's mean 1/choices; a classification accuracy's majority-answer share."""
        found: dict[str, float] = {}
        for c in self.board.columns:
            if c.metric not in ("acc", "acc_norm", "accuracy") or c.evaluation == "*":
                continue
            items = self._any_records(c.evaluation)
            if items is None:
                continue
            if "choices" in items.column_names:
                counts = [len(x) for x in items["choices"].to_pylist() if x]
                if counts:
                    found[c.name] = sum(1 / k for k in counts) / len(counts)
            elif "target" in items.column_names and items.num_rows:
                targets = items["target"].value_counts().to_pylist()
                found[c.name] = max(t["counts"] for t in targets) / items.num_rows
        return found

    # --- paired differences -----------------------------------------------------------------

    def references(self) -> list[int]:
        """The entries a page may compare everything to: all of them on a small board; else
        the best and each sweep's last checkpoint (``rayeval view`` computes any on demand)."""
        entries = self.board.entries
        if len(entries) <= ALL_REFERENCES:
            return list(range(len(entries)))
        last: dict[str, int] = {}
        for i, e in enumerate(entries):
            if e.sweep not in last or (e.step or 0) > (entries[last[e.sweep]].step or 0):
                last[e.sweep] = i
        return sorted({0, *last.values()})

    def paired(self, ref: int, columns: list[str] | None = None) -> dict:
        """Entry - reference on the same bootstrap replicates, per column (``columns``: these
        names only; default every column): [difference, low, high] per entry, or None where
        they do not pair (``ranking.compare.paired_rows``). The served page asks for the
        columns it shows: all 300 of a 100,000-cell store took 16 s, most of it reading 2.4 GB
        of replicates."""
        from rayeval.io.store import confidence_of
        from rayeval.ranking.board import with_replicates
        from rayeval.ranking.compare import paired_rows

        entries = self.board.entries
        if not 0 <= ref < len(entries):
            raise StoreError(f"ref: no entry {ref} (the board has {len(entries)})")
        shown = self.board.columns if columns is None else \
            [self.board.column(name) for name in columns]
        with_replicates(self.board, shown)
        base = entries[ref]
        out = {}
        for c in shown:
            b = base.rows.get(c.name)
            diffs: list = [None] * len(entries)
            held = [i for i, e in enumerate(entries) if c.name in e.rows]
            if b is not None:
                found = paired_rows([entries[i].rows[c.name] for i in held], b,
                                    confidence_of(b))
                for i, p in zip(held, found):
                    if p is not None:
                        diffs[i] = [_number(p.difference), _number(p.ci_low),
                                    _number(p.ci_high)]
            out[c.name] = diffs
        return {"ref": ref, "columns": out}

    # --- items ------------------------------------------------------------------------------

    def evaluations_with_records(self) -> list[str]:
        return [name for name in self.board.evaluations if self.items_entries(name)]

    def items(self, evaluation: str) -> dict:
        """An evaluation's items, by id in one order, and the entries that stored records of
        it; what describes an item is read from the first of them."""
        from rayeval.reporting.samples_page import data_uri

        holders = self.items_entries(evaluation)
        if not holders:
            raise StoreError(f"evaluation: {evaluation!r} stored no per-item records in this "
                             "store")
        table = self._cell_table(evaluation, holders[0])
        shown = [f for f in ITEM_FIELDS if f in table.column_names]
        # An item is shown by its row (its position in the data set) where its data has no id
        # column: its id is then a 64-bit hash of its content. Ids travel as text: a JSON
        # number loses such a hash in JavaScript (-9219662817155844128 showed as ...844000,
        # and two items could share one).
        name = "row" if "row" in table.column_names else "id"
        out = {"evaluation": evaluation, "entries": holders, "named": name,
               "id": [str(i) for i in (table[name].to_pylist() if name in table.column_names
                                       else range(table.num_rows))]}
        for f in shown:
            values = table[f].to_pylist()
            out[f] = [[data_uri(p) for p in v] if v else v for v in values] \
                if f == "thumbnails" else values
        out["metrics"] = self._item_metrics(table)
        out["right_or_wrong"] = _right_or_wrong(table, evaluation)
        return out

    def cell(self, evaluation: str, entry: int) -> dict:
        """One entry's records of an evaluation, aligned with ``items``' order (None for an
        item it has no record of)."""
        import pyarrow as pa

        first = self.items_order(evaluation)
        table = self._cell_table(evaluation, entry)
        ids = table["id"].to_pylist() if "id" in table.column_names \
            else list(range(table.num_rows))
        where = {i: k for k, i in enumerate(ids)}
        take = [where.get(i) for i in first]
        aligned = table.take(pa.array(take, pa.int64()))
        row = _cell_row(self.board.entries[entry], evaluation)
        out = {"evaluation": evaluation, "entry": entry, "cell": row["cell"]}
        for f in CELL_FIELDS + tuple(self._item_metrics(table)):
            if f in aligned.column_names:
                out[f] = aligned[f].to_pylist()
        if "context" in table.column_names:      # another sweep's template: its own context
            shared = self._cell_table(evaluation, self.items_entries(evaluation)[0])
            if not _same_column(aligned, shared, "context"):
                out["context"] = aligned["context"].to_pylist()
        return out

    def items_order(self, evaluation: str) -> list:
        holder = self.items_entries(evaluation)[0]
        table = self._cell_table(evaluation, holder)
        return table["id"].to_pylist() if "id" in table.column_names \
            else list(range(table.num_rows))

    def items_entries(self, evaluation: str) -> list[int]:
        """The entries (in board order) whose rows of ``evaluation`` name per-item records;
        found for every evaluation in one pass over the board's rows (a 1,000 x 100 board
        has 300,000: one pass per evaluation asked for took seconds)."""
        if self._holders is None:
            holders: dict[str, list[int]] = {}
            for i, e in enumerate(self.board.entries):
                for name in {r.get("evaluation") for r in e.rows.values() if r.get("samples")}:
                    holders.setdefault(name, []).append(i)
            self._holders = holders
        return list(self._holders.get(evaluation, []))

    def _item_metrics(self, table) -> list[str]:
        from rayeval.reporting.samples import metric_columns

        return [m for m in metric_columns(table) if m not in CELL_FIELDS]

    def _cell_table(self, evaluation: str, entry: int):
        key = (evaluation, entry)
        if key not in self._records:
            from rayeval.io.store import ResultStore
            from rayeval.reporting.samples import in_item_order

            row = _cell_row(self.board.entries[entry], evaluation)
            if row is None:
                raise StoreError(f"entry {entry} stored no records of {evaluation!r}")
            table = ResultStore(self.store).read_samples(row["cell"], row["samples"])
            self._records[key] = in_item_order(table)
        return self._records[key]

    def _any_records(self, evaluation: str):
        holders = self.items_entries(evaluation)
        return self._cell_table(evaluation, holders[0]) if holders else None

    # --- everything, for one file -----------------------------------------------------------

    def views(self, items: bool = True) -> dict[str, object]:
        """Every view a page without a server may ask for, by its address."""
        out: dict[str, object] = {"meta": self.meta(), "board": self.board_view()}
        for ref in self.references():
            out[f"paired?ref={ref}"] = self.paired(ref)
        if items:
            for evaluation in self.evaluations_with_records():
                out[f"items?evaluation={evaluation}"] = self.items(evaluation)
                for entry in self.items_entries(evaluation):
                    out[f"cell?evaluation={evaluation}&entry={entry}"] = \
                        self.cell(evaluation, entry)
        return out

    def view(self, name: str, query: dict[str, str]) -> object:
        """One view by name and its query (``rayeval view``'s API)."""
        if name == "meta":
            return self.meta()
        if name == "board":
            return self.board_view()
        if name == "marks":
            return self.marks(_columns(query))
        if name == "references":
            return self.references()
        if name == "paired":
            return self.paired(_index(query, "ref"), _columns(query) or None)
        if name == "items":
            return self.items(_required(query, "evaluation"))
        if name == "cell":
            return self.cell(_required(query, "evaluation"), _index(query, "entry"))
        raise StoreError(f"no view {name!r}")


def _right_or_wrong(table, evaluation: str) -> str | None:
    """The per-item metric that says right or wrong, as ``rayeval samples`` picks it."""
    from rayeval.reporting.samples import right_or_wrong_metric

    try:
        return right_or_wrong_metric(table, None, evaluation)
    except StoreError:          # none (perplexity): items are not counted right or wrong
        return None


def _cell_row(entry, evaluation: str) -> dict | None:
    """The entry's stored row of an evaluation that names its records, if any."""
    return next((r for r in entry.rows.values()
                 if r.get("evaluation") == evaluation and r.get("samples")), None)


def _same_column(a, b, name: str) -> bool:
    return a[name].to_pylist() == b[name].to_pylist() if a.num_rows == b.num_rows else False


def _epoch(entry) -> int | None:
    return next((r["epoch"] for r in entry.rows.values() if r.get("epoch") is not None), None)


def _number(v):
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v



def _columns(query: dict[str, str]) -> list[str]:
    """The ``columns`` of a query: a JSON list of column names. Not a comma-separated text: an
    lm-eval metric with several filters is named ``exact_match,strict-match``, and such a
    column's marks were asked for as two columns that do not exist (HTTP 400)."""
    if not query.get("columns"):
        return []
    try:
        names = json.loads(query["columns"])
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise StoreError(f"columns: {query['columns']!r} is not a JSON list of column names")
    return names


def _required(query: dict[str, str], key: str) -> str:
    if not query.get(key):
        raise StoreError(f"{key}: missing")
    return query[key]


def _index(query: dict[str, str], key: str) -> int:
    value = _required(query, key)
    if not value.isdigit():
        raise StoreError(f"{key}: {value!r} is not an entry number")
    return int(value)
