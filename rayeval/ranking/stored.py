"""The rows a board or a comparison reads from a store: the figures of every newest row, and
replicates only where a number shown needs them.

Measured on a 10,000-cell store (30,000 rows, 1,000 replicates each): the figures are ~2% of
its bytes. A JSON board needs replicates only for the suite aggregate's interval (each
evaluation's headline metric); a table's marks (paired differences to the best) need them for
every ranked row. Replicates come back as float64 arrays (views of one buffer), not lists.
"""

from __future__ import annotations

import os
import re

from rayeval.errors import StoreError
from rayeval.io import paths
from rayeval.io.store import SCHEMA, ResultStore, newest
from rayeval.io.store.layout import figures
from rayeval.ranking.aggregate import averaged
from rayeval.ranking.columns import ranked_rows

NONE, HEADLINE, ALL = "none", "headline", "all"


def stored_rows(store: str | os.PathLike, *, sweep: str | None = None,
                evaluation: str | None = None, metric: str | None = None,
                checkpoint: str | None = None, replicates: str = ALL,
                what: str = "STORE") -> list[dict]:
    """The newest rows (``rayeval.results``) as dicts, filtered in the files' scan (sweep,
    evaluation, metric; ``checkpoint``: a glob on the checkpoint's location), with
    ``replicates`` for no row, the headline rows or every row."""
    rows = newest(store, sweep=sweep, evaluation=evaluation, what=what, metric=metric,
                  columns=figures(SCHEMA),
                  checkpoint=checkpoint_pattern(checkpoint)).to_pylist()
    if replicates == NONE or not rows:
        return rows
    wanted = _headline(rows) if replicates == HEADLINE else None
    return with_replicates(store, rows, sweep, wanted)


def with_replicates(store: str | os.PathLike, rows: list[dict], sweep: str | None = None,
                    wanted: set | None = None) -> list[dict]:
    """``rows`` with their replicates (``wanted`` keys only; default every ranked row's), read
    from only the row groups that hold them: ``compare`` reads two checkpoints' replicates,
    not the store's."""
    if wanted is None:
        wanted = {(r["cell"], r["evaluation"], r["metric"]) for r in ranked_rows(rows)}
    opened = ResultStore(paths.resolve(os.fspath(store), os.getcwd()))
    sweeps = {r["sweep"] for r in rows}
    if sweep is None and len(sweeps) == 1:            # that sweep's parts only
        sweep = next(iter(sweeps))
    found = opened.replicates(wanted, sweep)
    for r in rows:
        r["replicates"] = found.get((r["cell"], r["evaluation"], r["metric"]))
    return rows


def _headline(rows: list[dict]) -> set[tuple[str, str, str]]:
    """The rows a suite aggregate averages (``aggregate.averaged``)."""
    heads = averaged(rows)
    return {(r["cell"], r["evaluation"], r["metric"]) for r in ranked_rows(rows)
            if heads.get(r["evaluation"]) == r["metric"]}


def checkpoint_pattern(pattern: str | None) -> str | None:
    """``--checkpoint``: a glob (``*step_1?00*``) as a regular expression for the scan."""
    if pattern is None:
        return None
    if not pattern.strip():
        raise StoreError("--checkpoint: expected a pattern, e.g. '*/run-3/*'")
    out, i = [], 0                    # Arrow's regular expressions (RE2): no \\Z, no (?s:)
    while i < len(pattern):
        c = pattern[i]
        end = pattern.find("]", i + 1) if c == "[" else -1
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif end > i + 1:
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "^" + "".join(out) + "$"
