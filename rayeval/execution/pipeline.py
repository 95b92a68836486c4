"""Ray Data as the data plane: every source other than local parquet reaches the workers as
a Ray Data pipeline, split over them with nothing dropped or repeated.

    read      ``RowsDatasource``: ``sources.read_file`` in Ray Data read tasks (parquet by row
              ranges, other formats by files), on any node's CPUs, with the types the driver
              checked
    prepare   ``dataset.transform`` as a ``map_batches`` stage (``dataset.cpus`` CPUs a task,
              at most ``dataset.concurrency`` at once): the worker gets the model's inputs
              ready (``core.prepared``); for a text task, its tokenization with the driver's
              tokenizer
    split     ``ExactSplit``: ``streaming_split(equal=False)``. The default DataConfig splits
              with ``equal=True``, which drops rows so that every shard is equally long
    consume   ``SplitRows`` in each worker: ``get_dataset_shard``, batches as pyarrow tables

Local parquet without ``dataset.cpus`` is read by each worker straight from its files
(``data.RowRange``): no pipeline, no coordinator, and the same numbers (``RAYEVAL_DATA_PLANE=
ray`` sends it through Ray Data too, for comparisons). Every row is counted once either way:
each pass is one epoch of the split, and a worker that keeps its shard after the first pass
keeps exactly the rows that epoch gave it (it is kept only if every worker keeps its own).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pyarrow as pa
from ray.data.datasource import Datasource    # loaded with ray.train anyway

from rayeval import compat
from rayeval.config import constants
from rayeval.config.plugins import load_plugins
from rayeval.core import prepared, samples
from rayeval.errors import DataError
from rayeval.io import sources

if TYPE_CHECKING:
    from rayeval.io.data import DatasetInfo
    from rayeval.plan.cells import Evaluation, Plan

MIN_TASK_ROWS = 1024           # a read task reads at least this many rows (parquet ranges)
TASKS_PER_WORKER = 4           # ... and there are about this many per worker, so the split can
                               # balance the shards (it hands out whole blocks)
MAX_BLOCK_BYTES = 64 << 20


def datasets(plan: Plan) -> dict:
    """The Ray Data pipeline of each evaluation that uses one, by evaluation name."""
    return {ev.name: pipeline(ev, plan.sweep.workers, plan.sweep.base_dir,
                              pixels=ships_pixels(plan.sweep.model.backend))
            for ev in _fed(plan)}


def fed(plan: Plan) -> bool:
    """Whether any of the plan's evaluations is fed by Ray Data (``datasets``), without
    building a pipeline."""
    return bool(_fed(plan))


def _fed(plan: Plan) -> list[Evaluation]:
    return [ev for ev in plan.evaluations if ev.data.via_ray_data(ev.spec.dataset)]


def ships_pixels(backend: str) -> bool:
    """Whether the workers need an image item's decoded pixels beside the processor's
    outputs: a backend that processes images itself (vLLM, a plugin's). The Hugging Face
    backend scores from the processor's outputs alone (per-item records get thumbnails made
    on the stage), and full-size pixels are most of what a stage would ship: 602 KB for a
    448x448 image against 49 KB of Idefics3's 64x64 inputs (scripts/bench_vlm.py)."""
    return backend != "hf"


def pipeline(ev: Evaluation, workers: int, base_dir: str, pixels: bool = True):
    import ray.data

    spec = ev.spec.dataset
    cpus = spec.cpus if spec.cpus is not None else 1.0
    from rayeval.io.data import ROW

    source = RowsDatasource(ev.data, _read_columns(ev), spec.key_path, workers,
                            positions=ev.row_positions)
    ds = ray.data.read_datasource(source, num_cpus=cpus)
    stage = None
    if spec.transform:
        stage = Prepare(spec, base_dir, [c for c in (spec.target, spec.id, ROW) if c],
                        records=ev.spec.samples)
    elif ev.tokenizer is not None:
        stage = Tokenize(ev.spec, ev.tokenizer, pixels)
    if stage is not None:
        concurrency = spec.concurrency if spec.concurrency is not None else \
            constants.data_concurrency()
        ds = ds.map_batches(stage, batch_format="pyarrow", batch_size=None, num_cpus=cpus,
                            concurrency=concurrency, zero_copy_batch=True)
    # Small blocks: the split hands out whole blocks, so a few large ones would leave a
    # worker idle (the default target is 128 MiB).
    size = sum(_file_size(f) for f in ev.data.files)
    ds.context.target_max_block_size = int(min(MAX_BLOCK_BYTES, max(
        1 << 20, size / max(1, workers * TASKS_PER_WORKER))))
    return ds


def _read_columns(ev: Evaluation) -> list[str] | None:
    return ev.spec.dataset.columns


def _file_size(location: str) -> int:
    from rayeval.io import paths

    fs, path = paths.filesystem(location)
    return fs.get_file_info(path).size or 0


class RowsDatasource(Datasource):
    """A Ray Data datasource over ``sources.read_file``: parquet split into row ranges (one
    file can feed every worker), other formats file by file (images in groups)."""

    def __init__(self, info: DatasetInfo, columns: list[str] | None, key: str, workers: int,
                 positions: bool = False):
        super().__init__()
        self.info = info
        self.columns = columns
        self.key = key
        self.workers = workers
        self.positions = positions          # each row's position comes with it (data.ROW)

    def get_name(self) -> str:
        return f"Read{self.info.format.capitalize()}"

    def estimate_inmemory_data_size(self) -> int | None:
        return sum(_file_size(f) for f in self.info.files) or None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None):
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        wanted = max(1, self.workers * TASKS_PER_WORKER)
        tasks = []
        for piece in self._pieces(wanted):
            meta = BlockMetadata(num_rows=piece[2], size_bytes=None, exec_stats=None,
                                 input_files=piece[0])
            tasks.append(ReadTask(_reader(self.info, self.columns, self.key, piece,
                                          self.positions), meta))
        return tasks

    def _pieces(self, wanted: int):
        """(files, (start, stop) of parquet rows or None, rows, the position of the files'
        first row or None) of each read task."""
        info = self.info
        if info.format == "parquet":
            n = info.num_rows
            count = max(1, min(wanted, n // MIN_TASK_ROWS))
            for i in range(count):
                start, stop = n * i // count, n * (i + 1) // count
                yield info.files, (start, stop), stop - start, start
            return
        files = list(info.files)
        rows = list(info.file_rows) or [None] * len(files)
        per = max(1, math.ceil(len(files) / wanted)) if info.format == "images" else 1
        first = 0                               # None once a file's rows are not counted
        for i in range(0, len(files), per):
            part = rows[i:i + per]
            counted = None not in part
            yield tuple(files[i:i + per]), None, (sum(part) if counted else None), first
            first = first + sum(part) if counted and first is not None else None


def _reader(info: DatasetInfo, columns, key: str, piece, positions: bool = False):
    from rayeval.io import data

    files, rows, _, first = piece
    if positions and first is None:
        raise RuntimeError(f"{key}: the rows of a file before {files[0]!r} are not counted; "
                           "a row's position is unknown (a bug: planning counts them)")

    def numbered(tables):
        if not positions:
            yield from tables
            return
        at = first
        for table in tables:
            yield data.with_positions(table, at)
            at += table.num_rows

    def read():
        if rows is not None:
            yield from data.RowRange(info, columns, rows[0], rows[1], f"{key}.path",
                                     positions=positions)._pieces(8192)
            return
        if info.format == "images":
            table = sources.read_images(list(files), info.root, info.schema)
            yield from numbered([table.select(columns) if columns is not None else table])
            return
        for f in files:
            yield from numbered(sources.read_file(info.format, f, schema=info.schema,
                                                  columns=columns, root=info.root, key=key))

    return read


class Prepare:
    """The transform as a Ray Data stage: each batch becomes the model's inputs plus the
    columns the worker still needs (target, id, and for per-item records, ``records``, the
    thumbnails of its images); a batch it fails on becomes a failed batch of the same rows
    (``core.prepared``)."""

    def __init__(self, spec, base_dir: str, keep: list[str], records: bool = False):
        self.spec = spec
        self.base_dir = base_dir
        self.keep = keep
        self.records = records
        self.fn = None

    def __call__(self, table: pa.Table) -> pa.Table:
        from rayeval.core.tasks.base import transformed
        from rayeval.io.model import import_callable

        try:
            if self.fn is None:
                self.fn = import_callable(self.spec.transform, self.base_dir,
                                          what=f"{self.spec.key_path}.transform")
            out = prepared.attach(table, transformed(self.fn, table, self.spec), self.keep)
        except DataError as e:
            return prepared.failed(table, e)
        return self.with_thumbnails(out, table)

    def with_thumbnails(self, out: pa.Table, table: pa.Table) -> pa.Table:
        """The records' thumbnails, made here: only the stage still has the images (the
        worker gets the transform's tensors), and the evaluation worker's CPU stays free."""
        if not self.records:
            return out
        thumbs = samples.image_thumbnails(table, self.spec)
        return out if thumbs is None else prepared.attach_thumbnails(out, thumbs)


class Tokenize:
    """A text task's tokenization as a Ray Data stage, with the driver's tokenizer: the
    worker gets each row's tokens (``prepared.attach_text``); for image items, the decoded
    images and the processor's outputs (``prepared.attach_arrays``). A batch it cannot tokenize
    (bad text) goes on as it came: the worker checks it, meets the same error and fails
    the cells. Without ``pixels`` an image item's decoded pixels stay here: only the
    processor's outputs go on (``ships_pixels``)."""

    def __init__(self, evaluation, tokenizer, pixels: bool = True):
        self.evaluation = evaluation
        self.tokenizer = tokenizer
        self.pixels = pixels

    def __call__(self, table: pa.Table) -> pa.Table:
        from types import SimpleNamespace

        from rayeval.core import tasks

        spec = self.evaluation.dataset
        load_plugins()           # a Ray Data process resolves the task's name too (once)
        task = tasks.get(self.evaluation.task)
        decoder = SimpleNamespace(text=self.tokenizer, generation=self.evaluation.generation)
        try:
            x = task.tokenize(table, spec, self.tokenizer, decoder)
        except Exception:        # noqa: BLE001 - the worker checks the rows and says why
            return table
        return task.prepared_table(table, x, self.tokenizer.key, pixels=self.pixels,
                                   records=bool(self.evaluation.samples))


def exact_split(data: dict | None = None, world: int = 0):
    """A DataConfig that splits every data set with ``equal=False``: uneven shards, no row
    dropped (the default, ``equal=True``, drops rows to even them out).

    With ``data`` on a one-node Ray, each data set is split now, before the worker group
    starts: its split coordinator (an actor that unpickles the stage, importing transformers
    for a tokenizer or processor) then starts beside the group instead of after it, when rank
    0 first asks for its shard. Ray Train asks the DataConfig once per group; a later group (a
    restart) gets splits of its own. On several nodes the split waits for the workers' nodes:
    it reads blocks where they lie."""
    from ray.train import DataConfig

    class ExactSplit(DataConfig):
        default_ingest_options = staticmethod(compat.ingest_options)   # Ray's warns

        def __init__(self):
            super().__init__()
            self.ready: dict = {}       # name -> the splits made before the group started

        def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
            shards = [{} for _ in range(world_size)]
            for name, ds in datasets.items():
                made = self.ready.pop(name, None)
                if made is None or len(made) != world_size:
                    made = self.split(name, ds, world_size, worker_node_ids)
                for rank, it in enumerate(made):
                    shards[rank][name] = it
            return shards

        def split(self, name, ds, world_size, hints):
            return split(ds, world_size, hints, self._resolve_execution_options(name))

    config = ExactSplit()
    if data and world and _one_node():
        config.ready = {name: config.split(name, ds, world, None) for name, ds in data.items()}
    return config


def split(ds, world: int, hints=None, options=None) -> list:
    """``ds`` split over ``world`` consumers with no row dropped (``equal=False``), under
    Ray Train's ingest options (``compat.ingest_options``, unless ``options`` says others):
    one ``DataIterator`` a rank, each epoch of which is one pass. ``options`` is the split's
    own (a fresh object: DataConfig's are copies)."""
    ds = ds.copy(ds)
    ds.context.execution_options = options or compat.ingest_options()
    return ds.streaming_split(world, equal=False, locality_hints=hints)


def standing_splits(plan: Plan, rank: int, world: int, nodes: list[str], broadcast) -> dict:
    """This rank's split of each of the plan's Ray Data pipelines, for a plan handed to a
    standing group (``rayeval serve``, the suite's pool): the group's fit was started without
    the plan's data sets, so rank 0 builds the pipelines and splits them here, as Ray Train's
    DataConfig does at a fit's start, and ``broadcast`` (rank 0's value on every rank) hands
    each rank the iterators; ``nodes``: the ranks' node ids, the split's locality hints on
    several nodes. The split's coordinator is rank 0's actor: a restarted group splits again
    (the coordinator of a rank 0 that died goes with it), and ``release`` ends it with the
    plan. {evaluation name: this rank's DataIterator}."""
    made = None
    if rank == 0:
        hints = nodes if len(set(nodes)) > 1 else None
        made = {name: split(ds, world, hints) for name, ds in datasets(plan).items()}
    made = broadcast(made)
    return {name: its[rank] for name, its in made.items()}


def release(its) -> None:
    """The split coordinators of these iterators (``standing_splits``) ended now, not when
    Ray collects them: an iterator handed to other ranks by pickle keeps its coordinator
    from Ray's reference counting, and a standing group sees one plan after another."""
    import ray

    for it in its:
        actor = compat.split_coordinator(it)
        if actor is not None:
            try:
                ray.kill(actor)
            except Exception:      # noqa: BLE001 - already gone (its owner, rank 0, died)
                pass


def _one_node() -> bool:
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive")) == 1


class SplitRows:
    """One worker's split of an evaluation's pipeline, read like ``data.RowRange``:
    ``iter_batches`` gives pyarrow tables, one epoch of the split per call. How many rows an
    epoch gives a worker is not known before it ends; ``num_rows`` is an even share, which
    sizes the held shard's blocks (rows beyond it are kept as they come). ``start`` begins
    the first epoch at once, on a thread, so the pipeline starts (its coordinator, its read
    and preprocessing tasks) while the worker loads its first checkpoint."""

    PREFETCH = 4

    def __init__(self, name: str, info: DatasetInfo, rank: int, world: int, it=None):
        import ray.train

        # a fit's own data sets (Ray Train's DataConfig), or a standing group's split
        self.it = it if it is not None else ray.train.get_dataset_shard(name)
        self.num_rows = -(-info.num_rows // world)
        self.early: tuple[int, object] | None = None    # (batch size, ReadAhead)

    def start(self, batch_size: int) -> None:
        from rayeval.io.data import ReadAhead

        if self.early is None:
            self.early = batch_size, ReadAhead(self._epoch(batch_size), self.PREFETCH)

    def iter_batches(self, batch_size: int, prefetch: int = PREFETCH):
        from rayeval.io.data import ReadAhead

        early, self.early = self.early, None
        if early is not None and early[0] == batch_size:
            ahead = early[1]
        else:
            if early is not None:          # begun with another batch size: never the case
                early[1].close()
            ahead = ReadAhead(self._epoch(batch_size), prefetch)
        try:
            yield from ahead
        finally:
            ahead.close()

    def _epoch(self, batch_size: int):
        for table in self.it.iter_batches(batch_size=batch_size, batch_format="pyarrow",
                                          prefetch_batches=1, drop_last=False):
            if isinstance(table, pa.RecordBatch):
                table = pa.Table.from_batches([table])
            yield table

    def close(self) -> None:
        if self.early is not None:
            self.early[1].close()
            self.early = None
