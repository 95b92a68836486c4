"""The sweep's types: frozen, validated values and nothing else.

A leaf module: it imports nothing of rayeval's and neither torch nor Ray, so every other module
(and a user's tooling) can hold a sweep without pulling in checkpoint readers or a cluster.
``spec.load_sweep`` builds these from YAML; raw dicts go no further than that loader.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class Bootstrap:
    replicates: int = 1000
    confidence: float = 0.95
    seed: int = 0
    buckets: int = 1024

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
    key: str | None = None            # dotted path to the state dict inside the checkpoint
    strip_prefix: str | None = None   # a prefix to remove from every key
    trust_pickle: bool = False        # allow full pickles (runs their code), with a warning


@dataclass(frozen=True)
class MetricSpec:
    """A metric as the sweep names it: a registry name or a custom ``module:Class``, plus
    validated parameters. ``metrics.build`` turns it into a Metric."""
    name: str
    task: str
    params: tuple[tuple[str, Any], ...] = ()
    base_dir: str = ""                      # where a custom metric's module is found
    key: str = ""                           # the name results are stored under

    @property
    def custom(self) -> bool:
        return ":" in self.name


@dataclass(frozen=True)
class ModelSpec:
    """The sweep's ``model:`` section. Without a factory the checkpoints are Hugging Face
    folders: the model is built from each folder's config.json, its tokenizer read beside it."""
    factory: str | None = None           # "module:callable"; None: Hugging Face folders
    kwargs: dict = field(default_factory=dict)
    dtype: str | None = None             # evaluation dtype; None: the model's own
    tokenizer: str | None = None         # resolved location of a tokenizer folder (text tasks)
    max_length: int | None = None        # text tasks: the context; None: from the config

    @property
    def hugging_face(self) -> bool:
        return self.factory is None


@dataclass(frozen=True)
class DatasetSpec:
    path: str                            # resolved location: file, folder or glob
    inputs: tuple[str, ...] = ()         # columns fed to the model (several: as keywords)
    target: str | None = None
    id: str | None = None
    transform: str | None = None         # "module:callable": pyarrow batch -> model inputs
    ignore_index: int = -100             # language modeling: target ids that are not scored
    pad_id: int = 0                      # language modeling: fills short input sequences
    prompt: str | None = None            # text tasks: the column of prompts (strings)
    choices: str | None = None           # multiple choice: the column of lists of choices
    text: str | None = None              # text perplexity: the column of documents
    delimiter: str = " "                 # multiple choice: put between prompt and choice
    key_path: str = "dataset"            # where it is in the sweep file, for messages

    @property
    def columns(self) -> list[str] | None:
        """The columns a batch is read with, in a stable order; None (all of them) for a
        transform that names no inputs."""
        if self.transform and not self.inputs:
            return None
        return list(dict.fromkeys(c for c in (*self.inputs, self.prompt, self.choices,
                                              self.text, self.target, self.id) if c))


@dataclass(frozen=True)
class Generation:
    """How a generation task decodes: greedily, until a stop string or a token budget."""
    until: tuple[str, ...] = ()          # stop strings; the end-of-sequence token always stops
    max_new_tokens: int = 256


@dataclass(frozen=True)
class EvalSpec:
    """One evaluation of a suite: a data set, a task and its metrics."""
    name: str
    task: str
    dataset: DatasetSpec
    metrics: tuple[MetricSpec, ...]
    batch_size: int = 256
    bootstrap: Bootstrap = Bootstrap()
    generation: Generation = Generation()
    key_path: str = "evals[0]"


WATCH_ORDERS = ("oldest", "newest", "bisect")


@dataclass(frozen=True)
class WatchSpec:
    """The sweep's ``watch:`` section, read by ``rayeval watch``."""
    ready: str | None = None             # a marker: "COMPLETE" inside a folder, "*.done" beside
    order: str = "oldest"                # which ready checkpoints go first: see WATCH_ORDERS


WANDB_MODES = ("online", "offline")


@dataclass(frozen=True)
class MlflowTracker:
    """``trackers.mlflow``: where each finished cell's metrics are logged."""
    uri: str | None = None               # tracking URI; None: MLFLOW_TRACKING_URI
    experiment: str | None = None        # for the sweep's own run; None: "rayeval"
    run_id: str | None = None            # a training run to log into (at the checkpoints' steps)
    key_path: str = "trackers.mlflow"    # or the CLI flag that set it, for messages


@dataclass(frozen=True)
class WandbTracker:
    """``trackers.wandb``."""
    project: str
    entity: str | None = None
    run_id: str | None = None            # a training run to resume and log into
    mode: str | None = None              # "online" or "offline"; None: W&B's own (WANDB_MODE)
    key_path: str = "trackers.wandb"


@dataclass(frozen=True)
class Trackers:
    """The sweep's ``trackers:`` section: experiment trackers that get every result too."""
    mlflow: MlflowTracker | None = None
    wandb: WandbTracker | None = None

    @property
    def any(self) -> bool:
        return self.mlflow is not None or self.wandb is not None


@dataclass(frozen=True)
class Recovery:
    max_restarts: int = 3                # worker-group restarts after a worker dies or stalls
    stall_timeout_s: int = 600           # a rank this late to a sync point fails the group


@dataclass(frozen=True)
class Parallelism:
    """How each model copy is spread over the workers: ``shard`` ranks hold one copy between
    them (FSDP2), so ``workers / shard`` copies (replicas) run side by side."""
    shard: int = 1                       # 1: every worker holds the whole model
    wrap: tuple[str, ...] = ()           # module class names sharded as units; () = automatic

    @property
    def sharded(self) -> bool:
        return self.shard > 1


@dataclass(frozen=True)
class Sweep:
    name: str
    model: ModelSpec
    checkpoints: tuple[str, ...]         # resolved locations or globs
    evals: tuple[EvalSpec, ...]          # the suite: at least one
    workers: int
    use_gpu: bool
    output: str                          # resolved location of the result store
    base_dir: str                        # the sweep file's folder: model modules are found here
    source: str = ""                     # the sweep file, for messages
    checkpoint: CheckpointSpec = CheckpointSpec()
    recovery: Recovery = Recovery()
    resources_per_worker: tuple[tuple[str, float], ...] = ()   # Ray resources each worker holds
    watch: WatchSpec = WatchSpec()
    trackers: Trackers = Trackers()
    parallelism: Parallelism = Parallelism()

    def evaluation(self, name: str) -> EvalSpec:
        return next(e for e in self.evals if e.name == name)

    def replace(self, **changes: Any) -> "Sweep":
        return dataclasses.replace(self, **changes)
