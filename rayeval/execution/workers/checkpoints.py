"""The worker's checkpoint loop: each checkpoint loaded ONCE per worker, agreed on by every
rank, served to the sweep's backend, and handed to a scorer for each of its pending cells
before the next load (which is fetched while this one runs).

    load and agree    any rank's load failure fails all of the checkpoint's cells, on every rank
    serve             the backend takes the loaded model (an engine's start is collective)
    score             ``score(model, cell, step, layout, start)`` for each pending cell

A race keeps a CPU worker's loaded checkpoints for its next round while they fit a share of
the memory budget (``keep``); every other run lets each go before the next load.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable

import torch

from rayeval.config import constants
from rayeval.core import tasks
from rayeval.errors import CheckpointError, ModelError, SpecError
from rayeval.execution.workers import dist
from rayeval.execution.workers.prefetch import Prefetch
from rayeval.execution.workers.rank import RankContext, peak_rss
from rayeval.execution.workers.shards import cache_budget_bytes
from rayeval.io import layouts
from rayeval.io.checkpoints import fetch
from rayeval.io.model import ModelSource
from rayeval.plan.cells import CellOutcome, Plan


class Stop(Exception):
    """Every rank agreed to stop: the run was interrupted; finished cells are published."""


class CheckpointLoop:
    """Loads checkpoints for one rank: the model source and loader (a sharded model's
    replica in lockstep), the prefetch of the next one, the checkpoints a race keeps."""

    def __init__(self, ctx: RankContext, plan: Plan):
        sweep = plan.sweep
        self.ctx = ctx
        self.backend = None            # the sweep's backend, given once it is built
        self.on_tokenizer: Callable[[object], None] | None = None   # text evaluations' decode
        self.source = ModelSource(sweep.model, sweep.base_dir)
        # Backend vllm with generation only: the engine holds the weights on the GPU, so
        # rayeval's copy of each checkpoint (what the engine is given) stays on the CPU.
        staged = torch.device("cpu") if sweep.model.backend == "vllm" and \
            ctx.device.type != "cpu" and generation_only(plan) else ctx.device
        self.loader = self.source.loader(staged, sweep.checkpoint)
        self.lockstep = None           # a sharded model's replica runs its forwards in step
        if sweep.parallelism.sharded:
            from rayeval.execution.workers.sharding import (Lockstep, ShardedLoader,
                                                    give_back_gathered_memory)

            give_back_gathered_memory()
            mesh = dist.replica_mesh(sweep.parallelism.shard)
            self.loader = ShardedLoader(self.loader, mesh, sweep.parallelism)
            self.lockstep = Lockstep(mesh, ctx.timeout)
        self.cache_dir = os.path.join(tempfile.gettempdir(), "rayeval-checkpoints")
        # A sharded model reads its slices when it loads (collectively): only fetch ahead.
        self.ahead = Prefetch(self.cache_dir, None if self.lockstep else (
            lambda path: layouts.read(path, sweep.checkpoint.trust_pickle)),
            cache_budget_bytes(), enabled=constants.prefetch_enabled())
        self.loaded_rss = 0
        self.held, self.held_bytes, self.folders = {}, {}, {}   # a race's loaded checkpoints
        self.keep_budget = cache_budget_bytes() // 2

    def run(self, plan: Plan, todo: set[str], index_of: dict[str, int], score,
            finish: Callable[[CellOutcome], None], keep: bool = False) -> None:
        """Load each checkpoint of ``plan`` with a cell in ``todo`` once, and ``score`` each
        such cell on it (its outcome, or None, goes to ``finish``); ``keep``: keep the loaded
        checkpoint for a later round (a race)."""
        pending = [(ref, fingerprint, [c for c in group if c.key in todo])
                   for ref, fingerprint, group in plan.by_checkpoint()]
        pending = [p for p in pending if p[2]]
        for i, (ref, fingerprint, group) in enumerate(pending):
            start = time.perf_counter()
            self.ctx.ledger.rows(index_of[group[0].key], 0, force=True)
            self.ctx.mark("load", f"while loading {ref.location}")
            with self.ctx.timer.span("load", doing=f"loading {_name(ref.location)}"):
                model, raw, error = self.load_and_agree(ref, fingerprint)
            if i + 1 < len(pending) and pending[i + 1][0].location not in self.held:
                # the next one comes in while this one runs
                self.ahead.start(pending[i + 1][0].location, pending[i + 1][1])
            if model is None:
                for cell in group:
                    finish(self.ctx.failure(cell, ref.step, error))
                continue
            step = raw.step if raw.step is not None else ref.step   # Lightning's global_step
            for cell in group:
                outcome = score(model, cell, step, raw.layout, start)
                if outcome is not None:
                    finish(outcome)
                start = time.perf_counter()
            self.backend.release()
            if keep:
                self.keep(ref.location, model, raw)
            del model            # freed before the next load

    def close(self) -> None:
        self.ahead.close()

    def keep(self, location: str, model, raw) -> None:
        """Keep a CPU worker's loaded checkpoint for a race's next round while the kept ones
        fit a share of the memory budget: a round otherwise loads every survivor again (the
        language-model example's race: 93 loads, 8.9 s of its 14.5 s on the workers). Each
        rank decides for itself: its load step joins the others' agreement whether it loaded
        or kept (``load_and_agree``)."""
        if self.lockstep is not None or self.ctx.device.type != "cpu" \
                or self.backend.collective_serve or location in self.held:
            return
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        if size + sum(self.held_bytes.values()) <= self.keep_budget:
            self.held[location] = ((model, raw), self.folders[location])
            self.held_bytes[location] = size

    def forget(self, locations: set[str]) -> None:
        """Let go of the kept checkpoints that left the race."""
        for location in set(self.held) & locations:
            del self.held[location]
            del self.held_bytes[location]

    def load_and_agree(self, ref, fingerprint: str):
        """(model, raw, None) on every rank, or (None, None, why) on every rank when any
        rank failed to load the checkpoint. A sharded model is loaded in two steps, agreed on
        after each: its fit checked from the checkpoint's headers, then its rows read (DCP's
        load is collective: no rank may enter it alone)."""
        where = f"the load of {ref.location}"
        loaded = folder = None

        def stage():
            nonlocal loaded, folder
            if ref.location in self.held:          # a race's earlier round loaded it here
                loaded, folder = self.held[ref.location]
                self._tokenizer(folder, loaded[0])
                return
            local, raw = self.ahead.take(ref.location)
            if local is None:
                local = fetch(ref.location, self.cache_dir, fingerprint)
            folder = local
            loaded = self.loader.stage(local) if self.lockstep else \
                self.loader.load(local, raw)
            self._tokenizer(local, loaded.model if self.lockstep else loaded[0])

        why = self.agree(ref.location, stage, where)
        if why is None and self.lockstep is not None:
            staged = loaded

            def shard():
                nonlocal loaded
                loaded = self.loader.load(staged)
                self.lockstep.attach(loaded[0])

            why = self.agree(ref.location, shard, f"the sharded load of {ref.location}")
        serve = (lambda: self.backend.serve(loaded[0], folder, self.source.spec.tokenizer,
                                            ref.location, self.ctx.timer))
        if why is None and self.backend.collective_serve:
            # after every rank has loaded: an engine's start is collective
            name = self.backend.title or self.backend.name
            why = self.agree(ref.location, serve, f"the {name} load of {ref.location}")
        elif why is None:
            serve()
        if why is not None:
            return None, None, why
        self.ctx.ledger.loaded(ref.location)
        self.loaded_rss = peak_rss()
        self.folders[ref.location] = folder
        return loaded[0], loaded[1], None

    def _tokenizer(self, folder: str, model) -> None:
        if self.on_tokenizer is not None:
            self.on_tokenizer(self.source.tokenizer(folder, model))

    def agree(self, location: str, step, where: str) -> str | None:
        """Run one loading step on every rank; why it failed (on any rank), or None."""
        ledger, error = self.ctx.ledger, None
        try:
            step()
        except (CheckpointError, SpecError, ModelError) as e:
            error = e.message
            ledger.cell_error(location, error)   # before the reduce: rank 0 reads it
        dist.sync(where, self.ctx.timeout)
        any_failed, stop = dist.all_reduce_max([1.0 if error else 0.0,
                                                1.0 if ledger.stopping() else 0.0],
                                               where, self.ctx.timeout)
        if stop:
            raise Stop
        if any_failed:
            return error or ledger.error_of(location)[0] or (
                f"{location}: could not be loaded on another worker; see the worker logs")
        return None


def generation_only(plan: Plan) -> bool:
    """Whether every evaluation of the plan only generates (nothing runs the model's own
    forward): each evaluation's task says (``Task.only_generates``)."""
    return all(tasks.get(ev.spec.task).only_generates(ev.spec) for ev in plan.evaluations)


def _name(location: str) -> str:
    """A checkpoint's last path part, as the progress line names it."""
    return location.rstrip("/").rsplit("/", 1)[-1]
