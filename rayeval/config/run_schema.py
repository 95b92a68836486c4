"""The sweep's sections that decide how a run goes and what watches it, never a cell's numbers:
``watch:``, ``trackers:``, ``recovery:``, ``parallelism:``, ``select:``, ``aggregate:``. Each
field is declared with ``numbers=False``: none of it is in a cell's key.

Split from ``config.schema`` (which re-exports every name here, so ``schema.WatchSpec`` and the
rest keep working) along that line: schema keeps what an evaluation is and computes (model,
data, metrics, generation, the lm-eval and lmms-eval entries, groups) and the ``Sweep`` that
holds both. A leaf module like schema: ``config.declarations`` only, no torch, no Ray.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from rayeval.config.declarations import setting


WATCH_ORDERS = ("oldest", "newest", "bisect")


@dataclass(frozen=True)
class WatchSpec:
    """The sweep's ``watch:`` section, read by ``rayeval watch``: when and in which order
    checkpoints are evaluated, not how."""
    ready: str | None = setting(
        "A marker: 'COMPLETE' inside a folder, '*.done' beside.", numbers=False, default=None,
        blank=True,
        expected="a file name (COMPLETE: inside a checkpoint folder) or a pattern with one * "
                 "for the checkpoint's name (*.done: beside it)")
    order: str = setting("Which ready checkpoints go first: see WATCH_ORDERS.", numbers=False,
                         default="oldest", choices=WATCH_ORDERS)


WANDB_MODES = ("online", "offline")
# A tracker's run_id: YAML reads an unquoted id of digits as a number.
RUN_ID = {"expected": "a run id string",
          "fix": 'quote it (run_id: "..."): YAML reads some ids as numbers'}


@dataclass(frozen=True)
class MlflowTracker:
    """``trackers.mlflow``: where each finished cell's metrics are logged (a copy; the store
    keeps the results)."""
    uri: str | None = setting("Tracking URI; None: MLFLOW_TRACKING_URI.", numbers=False,
                              default=None)
    experiment: str | None = setting("For the sweep's own run; None: 'rayeval'.",
                                     numbers=False, default=None)
    run_id: str | None = setting("A training run to log into (at the checkpoints' steps).",
                                 numbers=False, default=None, **RUN_ID)
    key_path: str = setting("Where it was set (or the CLI flag), for messages.",
                            numbers=False, default="trackers.mlflow", yaml=None)


@dataclass(frozen=True)
class WandbTracker:
    """``trackers.wandb``."""
    project: str = setting("The W&B project that gets every result too.", numbers=False)
    entity: str | None = setting("The W&B team or user.", numbers=False, default=None)
    run_id: str | None = setting("A training run to resume and log into.", numbers=False,
                                 default=None, **RUN_ID)
    mode: str | None = setting("'online' or 'offline'; None: W&B's own (WANDB_MODE).",
                               numbers=False, default=None, choices=WANDB_MODES)
    key_path: str = setting("Where it was set (or the CLI flag), for messages.",
                            numbers=False, default="trackers.wandb", yaml=None)


@dataclass(frozen=True)
class Trackers:
    """The sweep's ``trackers:`` section: experiment trackers that get every result too."""
    mlflow: MlflowTracker | None = setting("MLflow, if set.", numbers=False, default=None)
    wandb: WandbTracker | None = setting("Weights & Biases, if set.", numbers=False,
                                         default=None)

    @property
    def any(self) -> bool:
        return self.mlflow is not None or self.wandb is not None


@dataclass(frozen=True)
class Recovery:
    max_restarts: int = setting(
        "Worker-group restarts after a worker dies or stalls.", numbers=False, default=3,
        minimum=0)
    stall_timeout_s: int = setting(
        "A rank this late to a sync point fails the group.", numbers=False, default=600,
        minimum=1)


@dataclass(frozen=True)
class Resume:
    """The sweep's ``resume:`` section: a cell in progress saves its merged states in the store
    (``states/``) as it goes, so that a later run, or a restarted worker group, scores only the
    rows left (docs/cluster.md, "What survives what")."""
    every: float = setting(
        "Seconds between two saves of a cell in progress (at most one save per this many "
        "seconds); 0: no saves, a cell is stored only once complete.", numbers=False, default=60,
        minimum=0)


@dataclass(frozen=True)
class Parallelism:
    """How each model copy is spread over the workers: ``shard`` ranks hold one copy between
    them (FSDP2), so ``workers / shard`` copies (replicas) run side by side."""
    shard: int = setting(
        "Ranks holding one copy; 1: every worker holds the whole model. Where the weights "
        "live, not what they compute (the states are integer or float64 sums).",
        numbers=False, default=1, minimum=1)
    wrap: tuple[str, ...] = setting(
        "Module class names sharded as units; () = automatic.", numbers=False, default=(),
        blank=True,
        expected="module class names (e.g. [DecoderLayer])")
    tensor: int = setting(
        "Backend vllm: consecutive workers serving one engine with tensor parallelism "
        "(vLLM's external launcher over the group's ranks); rows are split over the "
        "workers / tensor engines.", numbers=False, default=1, minimum=1)

    @property
    def sharded(self) -> bool:
        return self.shard > 1


@dataclass(frozen=True)
class Select:
    """The sweep's ``select:`` section: race the checkpoints (docs/racing.md) and stop scoring
    those that cannot be among the ``top`` best on ``metric``. Which cells are complete
    changes, not a complete cell's numbers: none of it is in a cell's key."""
    metric: str | None = setting(
        "What is raced: EVALUATION (its first metric), EVALUATION/METRIC, or aggregate (the "
        "mean over the evaluations' first metrics, direction-adjusted: a race's guarantee is "
        "on means, so it races that mean whatever the board's aggregate: is); means of "
        "per-item values in a known range (accuracy, acc, acc_norm, exact_match). Left out: "
        "what the board ranks by, the one evaluation's first metric, or aggregate with "
        "several (``for_suite``).",
        numbers=False, default=None, expected="an evaluation's name, or EVALUATION/METRIC")
    top: int = setting("How many best checkpoints to find.", numbers=False, default=1,
                       minimum=1)
    confidence: float = setting(
        "The chance that no checkpoint of the true top is eliminated, over the whole race.",
        numbers=False, default=0.95, above=0, below=1, expected="a number between 0 and 1")
    min_items: int = setting(
        "Items of the raced evaluation scored before the first decision (at least 32).",
        numbers=False, default=32, minimum=1)

    @property
    def suite(self) -> bool:
        """Racing the leaderboard's aggregate: the mean of every evaluation's first metric."""
        return self.metric == "aggregate"

    def for_suite(self, suite: list[str]) -> "Select":
        """This section with ``metric`` given: as written, else what the board ranks by (the
        one evaluation of ``suite``, the aggregate's evaluations, or ``aggregate``)."""
        if self.metric is not None:
            return self
        return dataclasses.replace(self, metric=suite[0] if len(suite) == 1 else "aggregate")

    def target(self, evaluations: list[str]) -> tuple[str, str | None] | None:
        """(evaluation, metric key or None: its first) that ``metric`` names among these
        evaluation names (the longest that fits: a group member's is GROUP/TASK); None when
        it names none. ``metric`` left out (a Select built in Python; a sweep file's is
        given by ``for_suite``): the one evaluation's first metric."""
        if self.metric is None:
            return (evaluations[0], None) if len(evaluations) == 1 else None
        if self.metric in evaluations:
            return self.metric, None
        fits = [e for e in evaluations if self.metric.startswith(e + "/")]
        if not fits:
            return None
        name = max(fits, key=len)
        return name, self.metric[len(name) + 1:]


# --- aggregate: ------------------------------------------------------------------------------

WIN_RATE, MEAN, WEIGHTS = "win_rate", "mean", "weights"
AGGREGATES = (WIN_RATE, MEAN)            # and {weights: {EVAL: w, ...}}
AGGREGATE_FORMS = "win_rate, mean or {weights: {EVALUATION: weight, ...}}"


@dataclass(frozen=True)
class Aggregate:
    """The sweep's ``aggregate:`` (``ranking.aggregate`` computes it): how the board's
    aggregate column combines the evaluations' headline metrics (their first). How a board is
    read, never a cell's numbers. ``win_rate`` (default), ``mean``, or
    ``{weights: {EVALUATION: weight, ...}}``."""
    how: str = setting(
        "win_rate: per evaluation, the share of the board's other checkpoints beaten on its "
        "headline (ties half), averaged over evaluations: no scale dominates; mean: the mean "
        "of the headlines, lower-is-better ones negated; weights: their weighted mean.",
        numbers=False, default=WIN_RATE, yaml=None)
    weights: tuple[tuple[str, float], ...] = setting(
        "With weights: each evaluation of the suite (but a group's members) and its weight "
        "(0 leaves it out).", numbers=False, default=(), minimum=0,
        expected="a mapping of evaluation names to weights of 0 or more (e.g. {val: 2, ood: 1})")

    @property
    def name(self) -> str:
        return self.how if self.how != WEIGHTS else \
            "weights " + ", ".join(f"{e}={w:g}" for e, w in self.weights)


def aggregate_of(r: Any, raw: Any, path: str = "aggregate") -> Aggregate:
    """The ``aggregate:`` a sweep file gives (``r``: its ``config.reader.Reader``): a name, or a
    mapping with ``weights``; left out or null, the default (win_rate)."""
    if raw is None:
        return Aggregate()
    if isinstance(raw, str):
        if raw in AGGREGATES:
            return Aggregate(how=raw)
        hint = difflib.get_close_matches(raw, AGGREGATES + (WEIGHTS,), n=1, cutoff=0.6)
        r.fail(path, f"unknown aggregate {raw!r}"
               + (f"; did you mean {hint[0]!r}?" if hint and hint[0] != WEIGHTS else "")
               + f"; choose one of: {AGGREGATE_FORMS}")
    if not isinstance(raw, dict):
        r.fail(path, f"expected {AGGREGATE_FORMS}, got {raw!r} ({type(raw).__name__})")
    given = r.section(Aggregate, raw, path, skip={"how"}, required={"weights"})
    return Aggregate(how=WEIGHTS, **given)


def check_weights(r: Any, spec: Aggregate, suite: list[str], path: str = "aggregate") -> None:
    """``aggregate.weights`` names every evaluation of ``suite`` (the aggregate's: all but a
    group's members) and no other, with a positive total."""
    if spec.how != WEIGHTS:
        return
    given = dict(spec.weights)
    for name in given:
        if name not in suite:
            hint = difflib.get_close_matches(name, suite, n=1, cutoff=0.6)
            r.fail(f"{path}.weights.{name}", "no such evaluation in the aggregate"
                   + (f"; did you mean {hint[0]!r}?" if hint else "")
                   + f" (it averages: {', '.join(suite)})")
    missing = [e for e in suite if e not in given]
    if missing:
        r.fail(f"{path}.weights", f"no weight for {', '.join(missing)}; give every evaluation "
                                  "of the aggregate a weight (0 leaves one out)")
    if not sum(given.values()) > 0:
        r.fail(f"{path}.weights", "the weights sum to 0; give some evaluation a weight above 0")
