"""A judge model's side of a judged evaluation (docs/judges.md), in plain Python and torch:

    Prompts      the ``judge.prompt`` Jinja template rendered over an item's columns, its
                 ``response`` and ``target``; checked before Ray starts (it must render, and
                 name only columns the data set has)
    chat_tokens  the rendered text as one user message through the judge tokenizer's chat
                 template with the generation prompt (as is, when it has none)
    Verdicts     the judge's new text read as a score: the first of the verdict's words
                 (any case, whole word), or a regular expression's one group; None when it
                 cannot be read (a failure: counted, never a score)
    Judge, JudgeFailed   the metrics ``judge`` (the mean score over the items with a verdict)
                 and ``judge_failed`` (items without one), as exact states like every metric

The stage that runs the judge over stored generations is ``execution.workers.judging``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from rayeval.core.metrics import register
from rayeval.core.metrics.base import Metric, _ratio
from rayeval.errors import SpecError
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)

JUDGE = "judge"                  # the metric a sweep lists
FAILED = "judge_failed"          # stored beside it: items whose verdict could not be read
STRENGTH = "judge_bt"            # pairwise: the Bradley-Terry strength against the baseline
PROMPT_NAMES = ("response", "target")     # what a template sees besides the item's columns
PAIR_NAMES = ("response_a", "response_b")   # and, pairwise, the two answers in their order


# --- the metrics -----------------------------------------------------------------------------

@register
class Judge(Metric):
    """Outputs (rows, 2): each item's score and 1 where the judge's verdict was read (0: a
    failure, whose score is not counted). The mean score over the items with a verdict."""
    name = JUDGE
    task = "generation"
    batched_compute = True

    def init_state(self, c):
        return {"score": torch.zeros((), dtype=torch.float64),
                "verdicts": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        ok = outputs[:, 1].round().to(torch.int64)
        return {"score": torch.where(ok > 0, outputs[:, 0], torch.zeros_like(outputs[:, 0])),
                "verdicts": ok}

    def compute(self, s):
        return _ratio(s["score"], s["verdicts"])


class JudgeFailed(Metric):
    """Items whose verdict could not be read (outputs as ``Judge``'s): a count, lower is
    better, stored without a bootstrap interval (a resampled count of failures says nothing
    a reader wants; the board shows it as "n of N (share)"). Stored with every judged cell;
    not a metric a sweep lists."""
    name = FAILED
    task = "generation"
    higher_is_better = False
    batched_compute = True
    resampled = False

    def init_state(self, c):
        return {"failed": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        return {"failed": 1 - outputs[:, 1].round().to(torch.int64)}

    def compute(self, s):
        return s["failed"].to(torch.float64)


class Strength(Judge):
    """Pairwise against one baseline: the Bradley-Terry strength on the Elo scale, 400 *
    log10(w / (1 - w)) of the win rate w (ties half a win). Against a single opponent the
    Bradley-Terry maximum-likelihood strengths are exactly these log-odds (the baseline's is
    0), so it ranks the checkpoints as the win rate does, on the scale WildVision and Chatbot
    Arena report; an undefeated (or winless) checkpoint's is infinite. Not listable: stored
    with a pairwise judge's cells."""
    name = STRENGTH

    def compute(self, s):
        w = _ratio(s["score"], s["verdicts"])
        return 400.0 * torch.log10(w / (1.0 - w))


def judged_metrics(specs) -> tuple[list, list]:
    """A judged evaluation's metric specs split: (the generation's, the judge's in order)."""
    return ([s for s in specs if s.name != JUDGE], [s for s in specs if s.name == JUDGE])


# --- prompts ---------------------------------------------------------------------------------

class Prompts:
    """The ``judge.prompt`` template, compiled once; an undefined name is an error, never an
    empty string."""

    def __init__(self, source: str, where: str = "judge.prompt"):
        import jinja2
        import jinja2.meta

        self.where = where
        env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                 autoescape=False)
        try:
            parsed = env.parse(source)
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise SpecError(f"{where}: not a valid Jinja template (line {e.lineno}: "
                            f"{e.message})") from None
        self.names = sorted(jinja2.meta.find_undeclared_variables(parsed))

    def check(self, columns, pairwise: bool = False) -> None:
        """Every name the template uses is a column, ``response`` or ``target`` (pairwise:
        ``response_a`` and ``response_b`` too, and it must use both)."""
        names = PROMPT_NAMES + (PAIR_NAMES if pairwise else ())
        known = set(columns) | set(names)
        unknown = [n for n in self.names if n not in known]
        if unknown:
            raise SpecError(f"{self.where}: the template names {', '.join(map(repr, unknown))}"
                            f", which the data set lacks; it has columns "
                            f"{', '.join(columns)} (and {', '.join(names)})")
        if pairwise and not set(PAIR_NAMES) <= set(self.names):
            raise SpecError(f"{self.where}: a pairwise judge's template shows both answers: "
                            "use {{ response_a }} and {{ response_b }}")

    def render(self, item: dict[str, Any]) -> str:
        return self.template.render(**item)


def chat_tokens(tok, text: str) -> list[int]:
    """The judge's input tokens for a rendered prompt: one user message through the
    tokenizer's chat template with the generation prompt; the text as is (with the
    tokenizer's own special tokens) when it has no template."""
    inner = tok.tokenizer
    if getattr(inner, "chat_template", None):
        rendered = inner.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
        return inner.encode(rendered, add_special_tokens=False)
    return inner.encode(text)


# --- verdicts --------------------------------------------------------------------------------

class Verdicts:
    """How a judge's text becomes a score (``judge.verdict``): words to scores, or
    ``{pattern: REGEX}`` with one group."""

    def __init__(self, verdict: dict, where: str = "judge.verdict"):
        problem = verdict_problem(verdict)
        if problem:
            raise SpecError(f"{where}: {problem}")
        if set(verdict) == {"pattern"}:
            self.pattern = re.compile(verdict["pattern"])
            self.words = None
        else:
            self.pattern = None
            self.words = {str(k).lower(): float(v) for k, v in verdict.items()}
            # longest first: of two words that start at the same place, the longer one
            alternatives = sorted(self.words, key=lambda w: (-len(w), w))
            self.find = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, alternatives))
                                   + r")(?!\w)", re.IGNORECASE)

    def read(self, text: str) -> float | None:
        """The score of a judge's new text; None when no verdict can be read."""
        if self.pattern is not None:
            found = self.pattern.search(text)
            if found is None or found.group(1) is None:
                return None
            try:
                value = float(found.group(1))
            except ValueError:
                return None
            return value if math.isfinite(value) else None
        found = self.find.search(text)
        return None if found is None else self.words[found.group(1).lower()]


def verdict_problem(verdict: Any) -> str | None:
    """What is wrong with a ``judge.verdict`` mapping, in words; None when it is usable."""
    if not isinstance(verdict, dict) or not verdict:
        return ("expected a mapping of words to scores ({yes: 1, no: 0}) or "
                "{pattern: REGEX}, got an empty one" if isinstance(verdict, dict) else
                f"expected a mapping of words to scores, got {verdict!r}")
    if set(verdict) == {"pattern"}:
        source = verdict["pattern"]
        if not isinstance(source, str):
            return f"pattern must be a regular expression (a string), got {source!r}"
        try:
            compiled = re.compile(source)
        except re.error as e:
            return f"pattern {source!r} is not a regular expression: {e}"
        if compiled.groups != 1:
            return (f"pattern {source!r} has {compiled.groups} groups; give exactly one, "
                    "around the score (e.g. 'Rating: ([1-5])')")
        return None
    for word, score in verdict.items():
        if not isinstance(word, str) or not word.strip() or word != word.strip():
            return f"{word!r} is not a word (a non-empty string without outer spaces)"
        if isinstance(score, bool) or not isinstance(score, (int, float)) \
                or not math.isfinite(score):
            return f"the score of {word!r} must be a number, got {score!r}"
    lowered = [w.lower() for w in verdict]
    if len(set(lowered)) != len(lowered):
        return "two words differ only in case; verdicts are read in any case"
    return None


def outputs_of(scores: list[float | None]) -> torch.Tensor:
    """The (rows, 2) outputs ``Judge`` and ``JudgeFailed`` read: score, verdict read."""
    out = torch.zeros((len(scores), 2), dtype=torch.float64)
    for i, s in enumerate(scores):
        if s is not None:
            out[i, 0] = s
            out[i, 1] = 1.0
    return out
