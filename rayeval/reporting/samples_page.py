"""One cell's per-item records as a page a person reads (``rayeval samples --format html``):
each item's images beside its question, the model's answer and the target, the items it got
wrong first. Self-contained (inline style, images as data URIs, no scripts, nothing fetched);
every text from the records is escaped.
"""

from __future__ import annotations

import base64
from html import escape

import pyarrow as pa

from rayeval.reporting.render import format_value

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
.item { display: flex; gap: 1em; align-items: flex-start; padding: .6em; margin: .4em 0;
        border-left: 4px solid #bbb; background: #fafafa; }
.item.wrong { border-left-color: #c33; } .item.right { border-left-color: #3a3; }
.images img { width: 128px; image-rendering: pixelated; border: 1px solid #ddd; }
.text { flex: 1; min-width: 0; }
.context { white-space: pre-wrap; margin: 0 0 .4em 0; font-family: ui-monospace, monospace; }
.field { margin: .15em 0; } .label { color: #666; display: inline-block; min-width: 6em; }
.values { color: #555; font-size: 90%; }
ol.choices { margin: .2em 0; } li.chosen { font-weight: 600; }
.judge { margin: .3em 0; } .judge pre { white-space: pre-wrap; margin: .2em 0; }
.failed { color: #c33; }
"""


def data_uri(png: bytes) -> str:
    """A PNG thumbnail as a data URI (for html and json)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def order_wrong_first(table: pa.Table, metric: str | None) -> list[dict]:
    """The records, those whose right-or-wrong ``metric`` is 0 first (each part in the
    table's order, which is by id); all in order without a metric."""
    rows = table.to_pylist()
    if metric is None:
        return rows
    return sorted(rows, key=lambda r: r.get(metric) != 0.0)     # stable: ids stay in order


def samples_page(table: pa.Table, title: str, metrics: list[str], metric: str | None
                 ) -> str:
    """The page: ``metrics``, the records' metric columns (shown with each item); ``metric``,
    the right-or-wrong one that orders them (None: none is)."""
    rows = order_wrong_first(table, metric)
    wrong = sum(1 for r in rows if metric is not None and r.get(metric) == 0.0)
    summary = f"{len(rows)} items" + (f", {wrong} wrong by {metric} (shown first)"
                                      if metric is not None else "")
    body = "\n".join(_item(r, metrics, metric) for r in rows)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>\n"
            f"<h1>{escape(title)}</h1>\n<p>{escape(summary)}</p>\n{body}\n</body></html>\n")


def _item(r: dict, metrics: list[str], metric: str | None) -> str:
    mark = "" if metric is None or r.get(metric) is None else \
        (" wrong" if r[metric] == 0.0 else " right")
    sources = r.get("images") or []
    images = "".join(
        f'<img src="{data_uri(png)}" alt="image {i + 1} of item {escape(str(r.get("id")))}"'
        + (f' title="{escape(sources[i])}"' if i < len(sources) else "") + ">"
        for i, png in enumerate(r.get("thumbnails") or []))
    parts = [f'<div class="field"><span class="label">id</span>{escape(str(r.get("id")))}'
             '</div>']
    if r.get("context") is not None:
        parts.append(f'<pre class="context">{escape(r["context"])}</pre>')
    if r.get("choices"):
        chosen = r.get("response")
        parts.append('<ol class="choices">' + "".join(
            f'<li class="chosen">{escape(c)}</li>' if c == chosen else f"<li>{escape(c)}</li>"
            for c in r["choices"]) + "</ol>")
    answers = r.get("responses") or ([r["response"]] if r.get("response") is not None else [])
    for label, values in (("answer", answers), ("target", [r.get("target")])):
        shown = " | ".join(escape(str(v)) for v in values if v is not None)
        if shown:
            parts.append(f'<div class="field"><span class="label">{label}</span>'
                         f"<code>{shown}</code></div>")
    if r.get("judge_output") is not None or r.get("judge_failed") is not None:
        parts.append(_judged(r))
    values = ", ".join(f"{escape(m)} {format_value(r[m])}" for m in metrics
                       if r.get(m) is not None)
    if values:
        parts.append(f'<div class="values">{values}</div>')
    side = f'<div class="images">{images}</div>' if images else ""
    return f'<div class="item{mark}">{side}<div class="text">{"".join(parts)}</div></div>'


def _judged(r: dict) -> str:
    """What a judge made of an item (docs/judges.md): its text, its score or why it failed,
    and the prompt it was given (folded)."""
    said = r.get("judge_output")
    parts = ['<div class="judge"><span class="label">judge</span>']
    parts.append("<code>(no text: the prompt did not fit)</code>" if said is None else
                 f"<code>{escape(said)}</code>")
    if r.get("judge_failed"):
        parts.append(f' <span class="failed">failed: {escape(r["judge_failed"])}</span>')
    if r.get("judge_prompt") is not None:
        parts.append(f"<details><summary>judge prompt</summary>"
                     f"<pre>{escape(r['judge_prompt'])}</pre></details>")
    return "".join(parts) + "</div>"
