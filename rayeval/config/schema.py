"""The sweep's types: frozen, validated values and nothing else.

A leaf module: it imports nothing of rayeval's but ``config`` (``declarations``, ``names``, and
``run_schema``, the sections that never change a cell's numbers) and neither torch
nor Ray, so every other module (and a user's tooling) can hold a sweep without pulling in
checkpoint readers or a cluster. ``plan.loader.load_sweep`` builds these from YAML with
``config.reader``; raw dicts go no further than that loader.

The single source: every field is declared with ``setting(doc, numbers=...)``
(``config.declarations``): what it means, whether it changes a cell's numbers (and so belongs
in the cell's cache key), the key the sweep file gives it (``yaml=None``: internal, not a
sweep-file key), and the checks a value the file gives must pass (bounds, choices, ...:
``declarations.CHECKS``). The reader, the loader's key sets, ``plan.cells.cell_key`` and the
README test all walk these declarations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rayeval.config import names
# The declarations (setting, CHECKS) and their walks (keys, numbers_of, ...), read through this
# module by the loader, the cache key and the README test.
from rayeval.config.declarations import (CHECKS, TEXT, keys, numbers_of, section,  # noqa: F401
                                         setting, sweep_fields, yaml_key)

DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")
DATA_FORMATS = ("parquet", "json", "csv", "hf", "images")   # dataset.format

@dataclass(frozen=True)
class Bootstrap:
    replicates: int = setting(
        "Bootstrap replicates for confidence intervals; 0 turns intervals off. Changes the "
        "stored intervals.", numbers=True, default=1000, minimum=0)
    confidence: float = setting(
        "The intervals' confidence level: a different level stores different ci_low/ci_high.",
        numbers=True, default=0.95, above=0, below=1,
        expected="a number between 0 and 1")
    seed: int = setting(
        "Seeds the row buckets and replicate weights: another seed, other resamples.",
        numbers=True, default=0, minimum=0)
    buckets: int = setting(
        "Hashed row buckets the replicate states hold: how rows are grouped for resampling.",
        numbers=True, default=1024, minimum=1)

    @property
    def enabled(self) -> bool:
        return self.replicates > 0

    @property
    def k(self) -> int:
        """Row buckets kept per state: 1 when the bootstrap is off."""
        return self.buckets if self.enabled else 1

    @property
    def key(self) -> str:
        """How replicates were drawn; cells pair when all but the confidence agree."""
        return (f"seed={self.seed};buckets={self.buckets};replicates={self.replicates};"
                f"confidence={self.confidence}")


OFF = Bootstrap(replicates=0)


@dataclass(frozen=True)
class CheckpointSpec:
    """The sweep's ``checkpoint:`` section."""
    key: str | None = setting(
        "Dotted path to the state dict inside the checkpoint: another key, other weights.",
        numbers=True, default=None)
    strip_prefix: str | None = setting(
        "A prefix removed from every key: decides which tensors fill which parameters.",
        numbers=True, default=None)
    trust_pickle: bool = setting(
        "Allow full pickles (runs their code), with a warning. Only decides whether such a "
        "file loads at all; a file that loads gives the same weights either way.",
        numbers=False, default=False)


@dataclass(frozen=True)
class MetricSpec:
    """A metric as the sweep names it: a registry name or a custom ``module:Class``, plus
    validated parameters. ``metrics.build`` turns it into a Metric. Not sweep-file keys: the
    ``metrics`` list's entries are parsed by ``core.metrics.parse_metric``."""
    name: str = setting("The registry name or custom 'module:Class'.", numbers=True,
                        yaml=None)
    task: str = setting("The evaluation's task the metric is built for.", numbers=True,
                        yaml=None)
    params: tuple[tuple[str, Any], ...] = setting(
        "Validated parameters (k, bins, ...): they change what is computed.", numbers=True,
        default=(), yaml=None)
    base_dir: str = setting(
        "Where a custom metric's module is found. Not in the key itself: the module's source "
        "digest is, so moving the same code elsewhere reuses its results.", numbers=False,
        default="", yaml=None)
    key: str = setting("The name results are stored under (top5_accuracy): rows carry it.",
                       numbers=True, default="", yaml=None)

    @property
    def custom(self) -> bool:
        return ":" in self.name


@dataclass(frozen=True)
class ModelSpec:
    """The sweep's ``model:`` section. Without a factory the checkpoints are Hugging Face
    folders: the model is built from each folder's config.json, its tokenizer read beside it."""
    factory: str | None = setting(
        "'module:callable' building the model; None: Hugging Face folders. The module's "
        "source digest is in the key too.", numbers=True, default=None, callable=True)
    kwargs: dict = setting("Keyword arguments for the factory: another model.", numbers=True,
                           default_factory=dict, expected="a mapping of keyword arguments")
    dtype: str | None = setting("Evaluation dtype; None: the model's own.", numbers=True,
                                default=None, choices=DTYPE_NAMES, noun="dtype")
    tokenizer: str | None = setting(
        "Resolved location of a tokenizer folder (text tasks); its files' fingerprint is in "
        "text cells' keys as well, since a folder at the same place may be rewritten.",
        numbers=TEXT, default=None, location=True)
    max_length: int | None = setting(
        "Text tasks: the context in tokens (rolling windows, truncation); None: from the "
        "config.", numbers=TEXT, default=None, minimum=2)
    backend: str = setting(
        "What generates: 'hf' (the model's own forward or Hugging Face generate) or 'vllm' "
        "(one vLLM engine per worker for the whole sweep, each checkpoint's weights loaded "
        "into it), or a plugin's backend (checked against core.backends.BACKENDS while "
        "planning). Greedy outputs agree but are not bit-equal: part of the key.",
        numbers=True, default="hf")
    vllm: dict = setting(
        "Engine arguments for backend vllm (gpu_memory_utilization, max_model_len, "
        "enforce_eager, ...): some change outputs (max_model_len, dtype), so all are keyed.",
        numbers=True, default_factory=dict, expected="a mapping of vLLM engine arguments")
    share_prefixes: bool = setting(
        "Log-likelihoods (backend hf, Hugging Face causal models): every shared token prefix "
        "(a few-shot block, an item's context across its choices) computed once per "
        "checkpoint, in padded shapes each segment decides alone, so a figure has the same "
        "bits at any batch size and on any number of workers. Equal to scoring each request "
        "alone (false: right-padded batches of whole requests, whose last bits move with the "
        "batch) within float tolerance, not bits: not in the key, so stored cells are not "
        "evaluated again.",
        numbers=False, default=True)
    batch_tokens: int = setting(
        "Log-likelihoods with shared prefixes: at most this many tokens per forward pass, "
        "rows x (cached + new), both padded to the batch's shape; the memory of the copied "
        "key-value rows. How fast, not what is counted.", numbers=False, default=8192,
        minimum=1)

    @property
    def hugging_face(self) -> bool:
        return self.factory is None


@dataclass(frozen=True)
class DatasetSpec:
    path: str = setting(
        "Resolved location: file, folder or glob. Not in the key itself: the data "
        "fingerprint is, and it names every file the location resolves to (with its size, "
        "modification time and the schema), so an equivalent spelling of the same files "
        "reuses results and any other files are a new cell.", numbers=False, location=True)
    format: str | None = setting(
        "How the files are read: parquet, json (JSON lines), csv, hf (a Hugging Face "
        "save_to_disk folder) or images (a folder of image files); None: from the path. Not in "
        "the key itself: the data fingerprint has the schema the files were read with.",
        numbers=False, default=None, choices=DATA_FORMATS, noun="format",
        hint="(or leave it out: the path's suffix says)")
    cpus: float | None = setting(
        "CPUs of each Ray Data task that reads and preprocesses this data set (runs the "
        "transform); giving it sends even local parquet through Ray Data, so the cluster's "
        "CPUs do that work instead of the evaluation workers. None: 1 CPU a task, and local "
        "parquet is read by the workers directly.", numbers=False, default=None, above=0,
        expected="a positive number of CPUs (e.g. 1 or 0.5)")
    concurrency: int | None = setting(
        "At most this many preprocessing tasks at once; None: as many as Ray Data's "
        "resources allow.", numbers=False, default=None, minimum=1)
    inputs: tuple[str, ...] = setting(
        "Columns fed to the model (several: as keywords).", numbers=True, default=(),
        nonempty=True, expected="a column name or a list of column names")
    target: str | None = setting("The column scored against.", numbers=True, default=None)
    id: str | None = setting("The row-id column that keys each row's bootstrap weights.",
                             numbers=True, default=None)
    transform: str | None = setting(
        "'module:callable': pyarrow batch -> model inputs; its module's source digest is in "
        "the key too.", numbers=True, default=None, callable=True)
    ignore_index: int = setting("Language modeling: target ids that are not scored.",
                                numbers=True, default=-100)
    pad_id: int = setting("Language modeling: fills short input sequences.", numbers=True,
                          default=0, minimum=0)
    prompt: str | None = setting("Text tasks: the column of prompts (strings).", numbers=True,
                                 default=None)
    choices: str | None = setting("Multiple choice: the column of lists of choices.",
                                  numbers=True, default=None)
    text: str | None = setting("Text perplexity: the column of documents.", numbers=True,
                               default=None)
    images: str | None = setting(
        "Vision-language models (generation, multiple_choice): the column of each item's "
        "image or list of images, as encoded bytes (PNG, JPEG, ...), a Hugging Face Image "
        "struct {bytes, path}, or a path (relative to the data file's folder); put before "
        "the prompt in the model's chat template, and run through the checkpoint's "
        "processor on a Ray Data CPU stage.", numbers=True, default=None)
    delimiter: str = setting("Multiple choice: put between prompt and choice.", numbers=True,
                             default=" ", blank=True,
                             expected='a string (" " by default, "" for none)')
    key_path: str = setting("Where it is in the sweep file, for messages.", numbers=False,
                            default="dataset", yaml=None)

    @property
    def columns(self) -> list[str] | None:
        """The columns a batch is read with, in a stable order; None (all of them) for a
        transform that names no inputs."""
        if self.transform and not self.inputs:
            return None
        return list(dict.fromkeys(c for c in (*self.inputs, self.prompt, self.choices,
                                              self.text, self.images, self.target, self.id)
                                  if c))


@dataclass(frozen=True)
class Generation:
    """How a generation task decodes: until a stop string or a token budget; greedily, or
    sampled with a seed per item and repeat (on every backend), so the same generations come on
    any number of workers."""
    until: tuple[str, ...] = setting(
        "Stop strings; the end-of-sequence token always stops.", numbers=True, default=(),
        blank=True, expected="a list of non-empty stop strings")
    max_new_tokens: int = setting("At most this many new tokens.", numbers=True, default=256,
                                  minimum=1)
    temperature: float = setting("0: greedy; above 0: sampled.", numbers=True,
                                 default=0.0, minimum=0.0)
    top_p: float = setting("Sampling: only the most likely tokens, up to this share of the "
                           "probability, are drawn from.", numbers=True, default=1.0,
                           minimum=0.0, above=0, maximum=1)
    repeats: int = setting(
        "Generations per item; its score is the mean over them (pass@1 estimated from k).",
        numbers=True, default=1, minimum=1)
    seed: int = setting(
        "Sampling: item i's repeat r is drawn with a seed made of (seed, row id, r).",
        numbers=True, default=0, minimum=0)

    @property
    def samples(self) -> bool:
        return self.temperature > 0


@dataclass(frozen=True)
class JudgeSpec:
    """A judge model that grades a generation evaluation's responses (docs/judges.md): each
    item's ``prompt`` rendered, sent to the judge as one user message through its chat
    template, decoded greedily, and its verdict read by ``verdict``. A judged figure's key
    is its generation's key plus these fields and the judge's weights' fingerprint."""
    model: str = setting(
        "Resolved location of the judge: a Hugging Face folder with its tokenizer. Not in "
        "the key itself: its files' fingerprint is, as a checkpoint's.", numbers=False,
        location=True)
    prompt: str | None = setting(
        "A Jinja template over the item's columns by name, ``response`` (the evaluated "
        "model's answer as scored) and ``target``. Required on a generation evaluation; an "
        "lmms-eval task's judge uses the task's own prompts (none here).", numbers=True,
        default=None)
    verdict: dict | None = setting(
        "Words to scores ({yes: 1, no: 0}: the first of them in the judge's text, any case, "
        "whole word), or {pattern: REGEX} whose one group is the score. Required with a "
        "prompt.", numbers=True, default=None,
        expected="a mapping of words to scores, or {pattern: REGEX}")
    baseline: str | None = setting(
        "Pairwise: the checkpoint (one of the sweep's) every checkpoint's answers are set "
        "against, in both orders; the template sees response_a and response_b, and a "
        "verdict's score is how much the first answer wins (1 first, 0 second, 0.5 a tie). "
        "Not in the key itself: the baseline's generations' key is.", numbers=False,
        default=None, location=True)
    max_new_tokens: int = setting("The judge's new tokens at most.", numbers=True,
                                  default=16, minimum=1)
    backend: str | None = setting(
        "What runs the judge: 'hf' or 'vllm'; None: the sweep's model.backend. Greedy "
        "outputs agree but are not bit-equal: part of the key.", numbers=True, default=None,
        choices=("hf", "vllm"))
    dtype: str | None = setting("The judge's dtype; None: its own.", numbers=True,
                                default=None, choices=DTYPE_NAMES, noun="dtype")
    batch_size: int = setting("Judge prompts per generate call: how fast, not what is "
                              "graded.", numbers=False, default=16, minimum=1)
    key_path: str = setting("Where it is in the sweep file, for messages.", numbers=False,
                            default="judge", yaml=None)

    @property
    def pattern(self) -> str | None:
        """The verdict's regular expression, if it is one."""
        return (self.verdict or {}).get("pattern") if set(self.verdict or {}) == {"pattern"} \
            else None

    @property
    def staged(self) -> bool:
        """Graded by rayeval's judge stage from its own prompt (a generation evaluation);
        else the judge serves a task that calls it itself (lmms-eval's judged tasks)."""
        return self.prompt is not None


@dataclass(frozen=True)
class LmEvalSpec:
    """An lm-evaluation-harness task or group, as lm-eval's own run would evaluate it: its
    documents, few-shot examples, templates, filters and metrics come from lm-eval; rayeval
    splits the documents over the workers and scores the requests."""
    task: str = setting("A task or group lm-eval knows (its registry or include_path's YAMLs).",
                        numbers=True)
    include_path: str | None = setting(
        "A folder of task YAMLs (relative to the sweep file); its tasks come first.",
        numbers=True, default=None, location=True)
    num_fewshot: int | None = setting(
        "Few-shot examples per document; None: the task's own (0 if it has none).",
        numbers=True, default=None, minimum=0)
    apply_chat_template: bool = setting(
        "Render each request with the tokenizer's chat template.", numbers=True, default=False)
    fewshot_as_multiturn: bool = setting(
        "With a chat template: each few-shot example as its own turn.", numbers=True,
        default=False)
    system_instruction: str | None = setting("A system message before every request.",
                                             numbers=True, default=None)
    gen_kwargs: dict = setting(
        "Overrides of the tasks' generation_kwargs (greedy only: until, max_gen_toks).",
        numbers=True, default_factory=dict, expected="a mapping (until, max_gen_toks)")
    limit: int | float | None = setting(
        "The first N documents of each task (a number below 1: that share of them), as lm-eval's "
        "--limit; for trying a task, not for figures to report.", numbers=True, default=None,
        above=0, expected="a positive number of documents (or a share below 1)")
    fewshot_seed: int = setting(
        "The seed of lm-eval's few-shot sampler (its fewshot_random_seed).", numbers=True,
        default=1234)


@dataclass(frozen=True)
class LmmsEvalSpec:
    """An lmms-eval task over images and text, as lmms-eval's own run with its generic
    ``huggingface`` chat model would evaluate it: documents, images, prompts, filters and
    metrics come from lmms-eval; rayeval splits the documents over the workers, decodes the
    images on CPU stages and generates (greedy)."""
    task: str = setting("A task, group or tag lmms-eval knows (its registry or include_path's "
                        "YAMLs); a group is evaluated as its tasks, NAME/TASK, and its "
                        "aggregate, NAME.", numbers=True)
    include_path: str | None = setting(
        "A folder of task YAMLs (relative to the sweep file); its tasks come first.",
        numbers=True, default=None, location=True)
    model_name: str = setting(
        "Which entry of a task's lmms_eval_specific_kwargs (per-model prompts) applies, as "
        "lmms-eval's --model picks it; tasks without that entry use their 'default'.",
        numbers=True, default="huggingface")
    gen_kwargs: dict = setting(
        "Overrides of the tasks' generation_kwargs (greedy only: max_new_tokens).",
        numbers=True, default_factory=dict, expected="a mapping (max_new_tokens)")
    limit: int | float | None = setting(
        "The first N documents of each task (a number below 1: that share of them), as "
        "lmms-eval's --limit; for trying a task, not for figures to report.", numbers=True,
        default=None, above=0, expected="a positive number of documents (or a share below 1)")


@dataclass(frozen=True)
class EvalSpec:
    """One evaluation of a suite: a data set, a task and its metrics."""
    name: str = setting("The evaluation's name: stored rows carry it (their evaluation column).",
                        numbers=True, single_form="dataset.name")
    task: str = setting("The kind of evaluation.", numbers=True)
    dataset: DatasetSpec = setting("The data set and how its columns are read.", numbers=True)
    metrics: tuple[MetricSpec, ...] = setting("What is computed, in order.", numbers=True)
    batch_size: int = setting(
        "Rows per forward pass: how fast, not what is counted (every row once).",
        numbers=False, default=256, sweep_default=True, minimum=1)
    bootstrap: Bootstrap = setting("Confidence intervals (keys left out: the sweep's).",
                                   numbers=True, default=Bootstrap(), sweep_default=True)
    generation: Generation = setting("Generation tasks: how to decode.", numbers=True,
                                     default=Generation())
    lm_eval: LmEvalSpec | None = setting(
        "An lm-evaluation-harness task or group instead of task/dataset/metrics.",
        numbers=True, default=None)
    lmms_eval: LmmsEvalSpec | None = setting(
        "An lmms-eval task (images and text) instead of task/dataset/metrics.",
        numbers=True, default=None)
    judge: JudgeSpec | None = setting(
        "A judge model grading the generations (the metric ``judge``): docs/judges.md.",
        numbers=True, default=None, keyed_if_set=True)
    samples: bool = setting(
        "Store each item's record (text tasks and classification; default true for them): "
        "which items a checkpoint got right, what it generated or chose, or the class it "
        "predicted with its probability. Not the numbers: cells already stored have what "
        "they were evaluated with.", numbers=False, default=False, sweep_default=True)
    key_path: str = setting("Where it is in the sweep file, for messages.", numbers=False,
                            default="evals[0]", yaml=None)


# The sections that never change a cell's numbers (watch, trackers, recovery, parallelism,
# select) live in ``config.run_schema``; named here too, where the loader, the cache key, the
# README test and every caller read the sweep's types.
from rayeval.config.run_schema import (RUN_ID, WANDB_MODES, WATCH_ORDERS,  # noqa: F401
                                       Aggregate, MlflowTracker, Parallelism, Recovery,
                                       Resume, Select, Trackers,
                                       WandbTracker, WatchSpec)


@dataclass(frozen=True)
class GroupMetric:
    """One metric of an lm-eval group's aggregate (not a cell's numbers: the aggregate's own
    cell is keyed by these and its members' cells): the mean of its members' values, each
    weighted by its number of documents (``weight_by_size``) or not (lm-eval's
    ``aggregate_subtask_metrics``)."""
    key: str = setting("The aggregate's metric name (acc; exact_match,strict).", numbers=False,
                       yaml=None)
    parts: tuple[tuple[str, str], ...] = setting(
        "(member evaluation, its metric key) of every member that has the metric.",
        numbers=False, yaml=None)
    weight_by_size: bool = setting("Weight each member by its documents.", numbers=False,
                                   default=True, yaml=None)
    higher_is_better: bool = setting("The direction of the members' metric.", numbers=False,
                                     default=True, yaml=None)


@dataclass(frozen=True)
class GroupSpec:
    """An lm-eval group of a sweep: stored as the evaluation ``name`` (its aggregate), its
    tasks as ``name/TASK`` (and a subgroup's aggregate as ``name/SUBGROUP``)."""
    name: str = setting("The aggregate's evaluation name.", numbers=False, yaml=None)
    members: tuple[str, ...] = setting("Its tasks' evaluation names.", numbers=False, yaml=None)
    metrics: tuple[GroupMetric, ...] = setting("What it aggregates.", numbers=False, yaml=None)
    key_path: str = setting("Where it is in the sweep file, for messages.", numbers=False,
                            default="evals[0]", yaml=None)


@dataclass(frozen=True)
class Sweep:
    name: str = setting("The sweep's name: stored rows carry it.", numbers=True)
    model: ModelSpec = setting("The model the checkpoints are loaded into.", numbers=True)
    checkpoints: tuple[str, ...] = setting(
        "Resolved locations or globs. Not in the key as written: each cell's own checkpoint "
        "location and fingerprint are.", numbers=False, location=True, nonempty=True,
        expected="a non-empty list of paths or globs", each="a path or glob")
    evals: tuple[EvalSpec, ...] = setting(
        "The suite: at least one. A cell's key walks its own evaluation only: adding or "
        "changing another evaluation leaves it cached.", numbers=False)
    workers: int = setting("Ray Train workers: every row is counted once on any number.",
                           numbers=False, minimum=1, file_default=1)
    use_gpu: bool = setting(
        "Workers on GPUs. Floating-point sums may differ in their last bits; that is not "
        "treated as another evaluation.", numbers=False, file_default=False)
    output: str = setting("Resolved location of the result store.", numbers=False,
                         location=True)
    base_dir: str = setting(
        "The sweep file's folder: model modules are found here (their source digests are in "
        "the key).", numbers=False, yaml=None)
    source: str = setting("The sweep file, for messages.", numbers=False, default="",
                          yaml=None)
    text: str = setting(
        "The sweep file's text as read (the result store stores a copy: ``io.store.sweeps``); "
        "empty for a sweep built in Python.", numbers=False, default="", yaml=None)
    checkpoint: CheckpointSpec = setting("How a checkpoint's state dict is found.",
                                         numbers=True, default=CheckpointSpec())
    recovery: Recovery = setting("Restarts after a worker fails or stalls.", numbers=False,
                                 default=Recovery())
    resume: Resume = setting("How a cell in progress is saved for a later run.",
                             numbers=False, default=Resume())
    resources_per_worker: tuple[tuple[str, float], ...] = setting(
        "Ray resources each worker holds.", numbers=False, default=(), minimum=0,
        expected="a mapping of resource names to amounts (e.g. {CPU: 4, GPU: 1})")
    watch: WatchSpec = setting("What `rayeval watch` waits for.", numbers=False,
                               default=WatchSpec())
    trackers: Trackers = setting("Experiment trackers that get a copy of every result.",
                                 numbers=False, default=Trackers())
    parallelism: Parallelism = setting("How each model copy is spread over the workers.",
                                       numbers=False, default=Parallelism())
    groups: tuple[GroupSpec, ...] = setting(
        "lm-eval groups: aggregates of their members' stored results.", numbers=False,
        default=(), yaml=None)
    select: Select | None = setting(
        "Race the checkpoints for the best few (docs/racing.md); none: score every item.",
        numbers=False, default=None)
    aggregate: Aggregate = setting(
        "How the board's aggregate column combines the evaluations: win_rate (default), mean "
        "or {weights: {EVALUATION: weight}} (``ranking.aggregate``).", numbers=False,
        default=Aggregate())

    def evaluation(self, name: str) -> EvalSpec:
        return next(e for e in self.evals if e.name == name)

    def suite_evaluations(self) -> list[str]:
        """The evaluations the leaderboard's aggregate averages: all but lm-eval group
        members (GROUP/TASK of a group of the sweep)."""
        left_out = names.members([e.name for e in self.evals] + [g.name for g in self.groups])
        return [e.name for e in self.evals if e.name not in left_out]

    def replace(self, **changes: Any) -> "Sweep":
        return dataclasses.replace(self, **changes)
