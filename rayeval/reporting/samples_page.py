"""One cell's per-item records as a page a person reads (``rayeval samples --format html``):
each item's images beside its question, the model's answer (an empty one shown as empty) and
the target, a multiple-choice item's choices with the target, both picks and their
log-likelihoods; the items it got wrong first, or without a right-or-wrong metric (a
document's perplexity) the worst first. Self-contained (inline style, images as data URIs, no
scripts, nothing fetched); every text from the records is escaped.
"""

from __future__ import annotations

import base64
import math
from html import escape

import pyarrow as pa

from rayeval.reporting.render import format_value

_CSS = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 2em; color: #222; }
h1 { font-size: 1.4em; overflow-wrap: anywhere; }
.item { display: flex; gap: 1em; align-items: flex-start; padding: .6em; margin: .4em 0;
        border-left: 4px solid #bbb; background: #fafafa; }
.item.wrong { border-left-color: #c33; } .item.right { border-left-color: #3a3; }
.images img { width: 128px; image-rendering: pixelated; border: 1px solid #ddd; }
.text { flex: 1; min-width: 0; }
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
            font-size: 14px; white-space: pre-wrap; overflow-wrap: anywhere; }
code { background: #eee; padding: 0 .2em; }
.context { margin: 0 0 .4em 0; }
.field { margin: .15em 0; display: flex; gap: .3em; align-items: baseline; }
.label { color: #666; flex: none; min-width: 6em; } .value { flex: 1; min-width: 0; }
.empty { color: #8a4b00; font-style: italic; background: #fdf1dc; }
.sep { color: #999; }
.values { color: #555; font-size: 90%; }
ol.choices { margin: .2em 0; } li.chosen { font-weight: 600; }
li.target { background: #dcf1dc; }
.tag { font-size: 80%; font-weight: 600; border-radius: .3em; padding: 0 .35em;
       margin-left: .4em; background: #ddd; color: #333; }
.tag.target { background: #1f7a1f; color: #fff; } .tag.norm { background: #8a4b00; color: #fff; }
.ll { color: #555; font-size: 85%; font-weight: normal; margin-left: .5em; }
.judge { margin: .3em 0; } .judge pre { margin: .2em 0; }
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


# Per-item values that are not right-or-wrong are a document's perplexity (text_perplexity,
# lm-eval's loglikelihood_rolling tasks: lower is better) or a graded score (a judge's, f1,
# bleu: higher is better). The page is given the records alone, so a name says which.
_LOWER = ("perplexity", "bits_per_byte", "nll", "loss", "error")


def lower_is_better(metric: str) -> bool:
    """Whether a per-item metric named so is better low (by name; see ``_LOWER``)."""
    return any(word in metric.lower() for word in _LOWER)


def order_worst_first(table: pa.Table, metric: str, higher: bool) -> list[dict]:
    """The records by ``metric``, the worst first (ties by id); those without a value
    last."""
    def key(r):
        v = r.get(metric)
        missing = v is None or math.isnan(v)
        return (missing, 0.0 if missing else (v if higher else -v))
    return sorted(table.to_pylist(), key=key)


def samples_page(table: pa.Table, title: str, metrics: list[str], metric: str | None,
                 higher_is_better: dict[str, bool] | None = None) -> str:
    """The page: ``metrics``, the records' metric columns (shown with each item); ``metric``,
    the right-or-wrong one that orders them, wrong first. None: none is, and the items are
    ordered by the first of ``metrics`` (a document's perplexity), worst first, its direction
    from ``higher_is_better`` (metric -> bool) where given, else from its name."""
    rows, summary = _ordered(table, metrics, metric, higher_is_better or {})
    body = "\n".join(_item(r, metrics, metric) for r in rows)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>\n"
            f"<h1>{escape(title)}</h1>\n<p>{escape(summary)}</p>\n{body}\n</body></html>\n")


def _ordered(table: pa.Table, metrics: list[str], metric: str | None,
             higher_is_better: dict[str, bool]) -> tuple[list[dict], str]:
    """The records in the page's order, and the summary line that says which order."""
    if metric is not None:
        rows = order_wrong_first(table, metric)
        wrong = sum(1 for r in rows if r.get(metric) == 0.0)
        return rows, f"{len(rows)} items, {wrong} wrong by {metric} (shown first)"
    if not metrics:
        return table.to_pylist(), f"{table.num_rows} items, by id"
    by = metrics[0]
    higher = higher_is_better.get(by, not lower_is_better(by))
    return (order_worst_first(table, by, higher),
            f"{table.num_rows} items, sorted by {by}, worst "
            f"({'lowest' if higher else 'highest'}) first")


def _item(r: dict, metrics: list[str], metric: str | None) -> str:
    mark = "" if metric is None or r.get(metric) is None else \
        (" wrong" if r[metric] == 0.0 else " right")
    name = "row" if r.get("row") is not None else "id"      # a row: the id is a content hash
    parts = [f'<div class="field"><span class="label">{name}</span>{escape(str(r.get(name)))}'
             '</div>']
    if r.get("context") is not None:
        parts.append(f'<pre class="context">{escape(r["context"])}</pre>')
    if r.get("choices"):
        parts.append(choices_html(r))
    answers = r.get("responses") or ([r["response"]] if r.get("response") is not None else [])
    for label, values in (("answer", answers), ("target", [r.get("target")])):
        shown = [_text(v) for v in values if v is not None]
        if shown:
            parts.append(f'<div class="field"><span class="label">{label}</span>'
                         '<span class="value">'
                         + '<span class="sep"> | </span>'.join(shown) + "</span></div>")
    if r.get("judge_output") is not None or r.get("judge_failed") is not None:
        parts.append(_judged(r))
    values = ", ".join(f"{escape(m)} {format_value(r[m])}" for m in metrics
                       if r.get(m) is not None)
    if values:
        parts.append(f'<div class="values">{values}</div>')
    images = _images(r)
    side = f'<div class="images">{images}</div>' if images else ""
    return f'<div class="item{mark}">{side}<div class="text">{"".join(parts)}</div></div>'


def _text(v) -> str:
    """An answer or a target as code, escaped; an empty one said so (it is an answer: the
    model stopped at once), and one of whitespace only shown as its characters."""
    text = str(v)
    if text == "":
        return '<code class="empty" title="the empty string">(empty)</code>'
    if not text.strip():
        return (f'<code class="empty" title="whitespace only">(whitespace: '
                f"{escape(repr(text))})</code>")
    return f"<code>{escape(text)}</code>"


def _images(r: dict) -> str:
    sources = r.get("images") or []
    return "".join(
        f'<img src="{data_uri(png)}" alt="image {i + 1} of item {escape(str(r.get("id")))}"'
        + (f' title="{escape(sources[i])}"' if i < len(sources) else "") + ">"
        for i, png in enumerate(r.get("thumbnails") or []))


# --- a multiple-choice item ----------------------------------------------------------------

def choice_picks(r: dict) -> tuple[set[int], int | None, int | None]:
    """(the target's choices, acc's pick, acc_norm's pick) of a multiple-choice record, as
    indices into its choices.

    acc picks the highest log-likelihood, acc_norm the highest per character of the choice
    (``core.metrics.text``: ll / len(choice), the choice without the delimiter, as lm-eval's
    acc_norm), each the first of equal ones. Without one log-likelihood per choice (records of
    an older rayeval) both picks are the response's choice and acc_norm's is None. The
    target is held as its choice's text, so every choice with that text is the target; an
    lm-eval response is the continuation, with its target delimiter (" Paris"), hence the
    comparison without surrounding whitespace when no choice is the text exactly."""
    choices = r["choices"]
    lls = r.get("loglikelihoods")
    target = _matching(choices, r.get("target"))
    if not lls or len(lls) != len(choices) or any(v is None for v in lls):
        chosen = _matching(choices, r.get("response"))
        return target, min(chosen, default=None), None
    norm = [ll / len(c) if len(c) else -math.inf for ll, c in zip(lls, choices)]
    return target, _first_max(lls), _first_max(norm)


def _matching(choices: list[str], text) -> set[int]:
    if text is None:
        return set()
    exact = {i for i, c in enumerate(choices) if c == text}
    return exact or {i for i, c in enumerate(choices) if c.strip() == str(text).strip()}


def _first_max(values: list[float]) -> int:
    return max(range(len(values)), key=lambda j: (values[j], -j))


def choices_html(r: dict) -> str:
    """The choices: the target shaded and tagged, acc's pick bold, acc_norm's pick tagged
    where it differs, each choice's log-likelihood and its per-character score."""
    target, pick, norm = choice_picks(r)
    lls = r.get("loglikelihoods") if norm is not None else None
    items = []
    for i, c in enumerate(r["choices"]):
        classes = " ".join(k for k, on in (("chosen", i == pick), ("target", i in target)) if on)
        attrs = f' class="{classes}"' if classes else ""
        text = escape(c) if c.strip() else _text(c)
        items.append(f"<li{attrs}>{text}{_tags(i, target, pick, norm)}"
                     f"{'' if lls is None else _score(lls[i], c)}</li>")
    return '<ol class="choices">' + "".join(items) + "</ol>"


def _tags(i: int, target: set[int], pick: int | None, norm: int | None) -> str:
    """What choice i is: the target, acc's pick (the answer), acc_norm's where it differs."""
    tags = []
    if i in target:
        tags.append('<span class="tag target">target</span>')
    if i == pick:
        tags.append(f'<span class="tag">{"answer" if norm is None else "acc&#x27;s pick"}'
                    "</span>")
    if norm is not None and i == norm != pick:
        tags.append('<span class="tag norm">acc_norm&#x27;s pick</span>')
    return "".join(tags)


def _score(ll: float, choice: str) -> str:
    per_char = ll / len(choice) if choice else -math.inf
    return f'<span class="ll">log-likelihood {ll:.4f}, per character {per_char:.4f}</span>'


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
