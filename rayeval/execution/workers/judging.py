"""The judge stage of a judged evaluation (docs/judges.md), on the same workers, after every
checkpoint's generations.

    Generations   the sink of a judged cell's generation pass: rank 0 keeps its merged
                  states under the generation key (``io.store.states``' generations folder,
                  with the tag of the records that hold the responses); nothing is published
    JudgeStage    once every checkpoint is generated (and the evaluated model let go), the
                  judge loads once per worker and grades each judged cell's stored
                  responses: each rank its share of the items, one all-reduce of the judge's
                  states, and rank 0 publishes the cell (the generation's metrics and the
                  judge's, in the sweep's order) with every item's record

The responses are read back from the store, in this run as in a later one: changing only the
judge re-runs only this stage (the cell's generation key is unchanged), and a restarted group
finds the generations its earlier attempt kept.
"""

from __future__ import annotations

import time

import torch

from rayeval.config.schema import Generation
from rayeval.core import judge as judging, judge_model, stats, tasks
from rayeval.core.backends.base import Context
from rayeval.core.judge_model import JudgeModel
from rayeval.core.evaluate import ROWS, Accumulator
from rayeval.core.metrics import build_all
from rayeval.errors import RayevalError, SpecError, StoreError
from rayeval.execution.workers import dist
from rayeval.execution.workers.checkpoints import Stop
from rayeval.execution.workers.rank import RankContext
from rayeval.io import data
from rayeval.io.store import states as store_states
from rayeval.io.store import ResultStore
from rayeval.plan.cells import Cell, CellOutcome, Evaluation, Plan, generation_spec

_FAILED = "_judge_failed"      # any rank failed the cell (reduced with the states)
_STOP = "_stop"


class Generations:
    """Keep a judged cell's generation states (rank 0) for the judge stage; publish nothing."""

    def __init__(self, ctx: RankContext, plan: Plan, samples_tag: str):
        self.ctx, self.plan, self.tag = ctx, plan, samples_tag
        self.store = ResultStore(plan.sweep.output) if ctx.rank == 0 else None
        # judged cell key -> (its checkpoint's step, layout), once generated in this run
        self.done: dict[str, tuple] = {}

    def keep(self, cell: Cell, ev: Evaluation, merged: dict, step, layout
             ) -> CellOutcome | None:
        """Every rank: the cell is generated. Rank 0: its states kept (a failed write fails
        the cell)."""
        if self.ctx.rank == 0:
            counted = int(merged[ROWS])
            if counted != ev.data.num_rows:
                return self.ctx.failure(cell, step, (
                    f"{cell.checkpoint.location}: {ev.name}: counted {counted} rows but the "
                    f"data set has {ev.data.num_rows}; not kept (a sharding bug: please "
                    "report it)"))
            try:
                store_states.write(self.store, cell.generation,
                                   {k: v.numpy() for k, v in merged.items()},
                                   ev.spec.bootstrap.k, ev.spec.bootstrap.k,
                                   store_states.GENERATIONS,
                                   {"samples": self.tag, "step": "" if step is None else str(step)})
            except RayevalError as e:
                return self.ctx.failure(cell, step, f"{ev.name}: {e.message}")
        self.done[cell.key] = (step, layout)
        return None


class JudgeStage:
    """Grades judged cells on one rank: the judge model (loaded once per judge spec), the
    prompts each evaluation renders, and the verdicts read back; ``publisher`` writes the
    cell (``sinks.Publish``)."""

    def __init__(self, ctx: RankContext, plan: Plan, publisher, samples_tag: str,
                 index_of: dict[str, int]):
        self.ctx, self.plan, self.publisher = ctx, plan, publisher
        self.tag = samples_tag
        self.index_of = index_of
        self.store = ResultStore(plan.sweep.output)
        self.loaded: tuple[str, JudgeModel] | None = None     # (its judge's key, the judge)
        self.graded: dict[tuple[str, str], str] = {}    # (judge, prompt) -> the judge's text
        # each evaluation's rows, read once for all its checkpoints' cells (the template
        # may name any column, so all of them)
        self.items: dict[str, object] = {}

    def run(self, cells: list[Cell], generated: dict[str, tuple], finish) -> None:
        """Judge each cell whose generations are kept (``generated``: those generated in
        this run, with their checkpoint's step and layout; the others' checkpoints are not
        loaded: their outcome's layout is "judge"); its outcome goes to ``finish``."""
        try:
            for cell in cells:
                ev = self.plan.evaluation(cell.evaluation)
                started = time.perf_counter()
                step, layout = generated.get(cell.key, (None, "judge"))
                outcome = self.judge(cell, ev, step, layout, started)
                if outcome is not None:
                    finish(outcome)
        finally:
            self.close()

    def close(self) -> None:
        if self.loaded is not None:
            self.loaded[1].close()          # its memory freed (core.judge_model.release)
            self.loaded = None

    # --- one cell ------------------------------------------------------------------------

    def judge(self, cell: Cell, ev: Evaluation, step, layout: str, started: float
              ) -> CellOutcome | None:
        ctx = self.ctx
        index = self.index_of.get(cell.key, 0)
        ctx.mark("judge", f"while judging {cell.checkpoint.location} on {ev.name}")
        error, states, records, generations = None, None, None, None
        with ctx.timer.span("judge", doing=f"judging {ev.name}"):
            try:
                # first, on every rank alike: an engine's start may be collective, and a
                # rank that failed on the store before it would leave the others waiting
                self.judge_model(ev.spec.judge)
                generations, meta = self.saved_generations(cell)
                if step is None and meta.get("step"):
                    step = int(meta["step"])
                states, records = self.grade(cell, ev, meta["samples"], index)
            except (RayevalError, StoreError) as e:
                error = f"{cell.checkpoint.location}: {ev.name}: judge: {e.message}"
                ctx.details[cell.key] = e.detail
            except Exception as e:          # noqa: BLE001 - the judge model or the template
                from rayeval import errors

                ctx.details[cell.key] = errors.traceback_of(e)
                error = (f"{cell.checkpoint.location}: {ev.name}: the judge failed: "
                         f"{errors.reason(e, typed=True)}")
        if error is None and records is not None:
            try:
                self.store.write_samples(cell.key, self.tag, ctx.rank, ctx.world, records)
            except RayevalError as e:
                error = f"{ev.name}: per-item records: {e.message}"
        if error:
            ctx.ledger.cell_error(cell.key, error, ctx.details.get(cell.key))
        if states is None:
            states = _empty_states(ev)
        states[_FAILED] = torch.tensor(1 if error else 0, dtype=torch.int64)
        states[_STOP] = torch.tensor(int(ctx.ledger.stopping()), dtype=torch.int64)
        where = f"the end of judging {cell.checkpoint.location} on {ev.name}"
        dist.sync(where, ctx.timeout)
        merged = dist.all_reduce_states(states, where, ctx.timeout)
        if merged.pop(_STOP):
            raise Stop
        if merged.pop(_FAILED):
            if ctx.rank != 0:
                return None
            if not error:
                error = ctx.ledger.error_of(cell.key)[0] or (
                    f"{cell.checkpoint.location}: judging {ev.name} failed on another worker; "
                    "see the worker logs")
            return ctx.failure(cell, step, error)
        if ctx.rank != 0:
            return None
        judged = merged.pop(ROWS)
        if int(judged) != ev.data.num_rows:
            return ctx.failure(cell, step, f"{cell.checkpoint.location}: {ev.name}: the judge "
                                           f"graded {int(judged)} items but the data set has "
                                           f"{ev.data.num_rows}; not published (please "
                                           "report this bug)")
        whole = {k: torch.from_numpy(v) for k, v in generations.items()}
        whole.update(merged)
        return self.publisher.publish(cell, ev, whole, step, layout, started,
                                      metrics=metrics_of(ev))

    def saved_generations(self, cell: Cell) -> tuple[dict, dict]:
        """The states of a judged cell's generations saved in the store, and their metadata."""
        meta: dict = {}
        states, _, _ = store_states.read(self.store, cell.generation, store_states.GENERATIONS,
                                         meta)
        if not meta.get("samples"):
            raise StoreError(f"the generations of cell {cell.key} name no records; evaluate "
                             "it again with --force")
        return states, meta

    def grade(self, cell: Cell, ev: Evaluation, tag: str, index: int):
        """This rank's share of the items: (the judge's states, their records). Pairwise
        (``judge.baseline``): each item asked in both orders, its score the mean of how much
        the checkpoint's answer wins in each (a judge that favours a position cancels)."""
        ctx = self.ctx
        spec = ev.spec
        js = spec.judge
        task = tasks.get(spec.task)
        if ev.name not in self.items:
            self.items[ev.name] = _items(ev)
        table = self.items[ev.name]
        start, stop = ev.data.shard_rows(ctx.rank, ctx.world)
        mine = table.slice(start, stop - start)
        fields = task.item_fields(mine, spec.dataset)
        responses = _records(self.store.read_samples(cell.generation, tag), cell)
        base = self.baseline(cell) if js.baseline else None
        backend, tok = self.judge_model(js)
        prompts = judging.Prompts(js.prompt, f"{js.key_path}.prompt")
        verdicts = judging.Verdicts(js.verdict, f"{js.key_path}.verdict")
        answered, texts, swapped, theirs = [], [], [], []
        for row, ident, target in zip(mine.to_pylist(), fields["id"], fields["target"]):
            mine_, other = responses.get(_ident(ident)), \
                (base or {}).get(_ident(ident), {}).get("response")
            if mine_ is None or (base is not None and other is None):
                raise StoreError(f"the stored generations lack item {ident!r} "
                                 f"({'the baseline' if mine_ else 'this checkpoint'}'s); "
                                 "evaluate the cell again with --force")
            answered.append(mine_)
            item = {**row, "response": mine_["response"], "target": target}
            if base is None:
                texts.append(prompts.render(item))
                continue
            theirs.append(other)
            texts.append(prompts.render({**item, "response_a": mine_["response"],
                                         "response_b": other}))
            swapped.append(prompts.render({**item, "response_a": other,
                                           "response_b": mine_["response"]}))
        outputs = self.outputs(texts + swapped, backend, tok, js, spec, index)
        said, said_swapped = outputs[:len(texts)], outputs[len(texts):]
        first = [_verdict(verdicts, out) for out in said]
        if base is None:
            scores = [v for v, _ in first]
            failures = [why for _, why in first]
        else:
            second = [_verdict(verdicts, out) for out in said_swapped]
            scores = [None if a is None or b is None else (a + (1.0 - b)) / 2
                      for (a, _), (b, _) in zip(first, second)]
            failures = [why_a or (f"swapped: {why_b}" if why_b else None)
                        for (_, why_a), (_, why_b) in zip(first, second)]
        metrics = _judge_metrics(js)
        acc = Accumulator(metrics, 1, spec.bootstrap.k)
        if texts:
            ids = task.row_ids(mine, spec.dataset, None, None)
            buckets = stats.buckets_of(ids, spec.bootstrap.seed, spec.bootstrap.k) \
                if spec.bootstrap.enabled else torch.zeros(len(texts), dtype=torch.int64)
            acc.add(judging.outputs_of(scores), torch.zeros(len(texts)), buckets)
        ctx.ledger.rows(index, ctx.counted(len(texts)), force=True)
        # each item's generation record (its response, its generation metrics' values) with
        # what the judge made of it: the prompt, the judge's text, the score (None: failed)
        # and why it failed
        import pyarrow as pa

        if not texts:      # a worker given no items writes a table without columns
            return dict(acc.states), pa.table({})
        records = {name: [r[name] for r in answered] for name in answered[0]}
        # typed: another worker's items may all lack a verdict (null columns would not join)
        text = pa.string()
        records.update({judging.JUDGE: pa.array(scores, pa.float64()),
                        "judge_prompt": pa.array(texts, text),
                        "judge_output": pa.array(said, text),
                        judging.FAILED: pa.array(failures, text)})
        if base is not None:
            records.update({"baseline_response": pa.array(theirs, text),
                            "judge_prompt_swapped": pa.array(swapped, text),
                            "judge_output_swapped": pa.array(said_swapped, text)})
        return dict(acc.states), pa.table(records)

    def baseline(self, cell: Cell) -> dict:
        """The baseline checkpoint's records of the same evaluation, by item id."""
        meta: dict = {}
        try:
            store_states.read(self.store, cell.baseline, store_states.GENERATIONS, meta)
        except StoreError:
            raise StoreError("the baseline's generations are not in the store (its "
                             "generation failed or was removed); evaluate it again "
                             "with --force") from None
        return _records(self.store.read_samples(cell.baseline, meta["samples"]), cell)

    def outputs(self, texts: list[str], backend, tok, js, spec, index: int
                ) -> list[str | None]:
        """The judge's new text for each prompt (None: it does not fit the judge's
        context); a prompt graded before by the same judge is not graded again."""
        name = _judge_key(js)
        todo, contexts = [], []
        for text in texts:
            if (name, text) in self.graded or text in todo:
                continue
            tokens = judging.chat_tokens(tok, text)
            if len(tokens) + js.max_new_tokens > tok.max_length:
                self.graded[(name, text)] = None
                continue
            todo.append(text)
            contexts.append(tokens)
        if todo:
            gen = Generation(until=(), max_new_tokens=js.max_new_tokens)
            context = Context(spec=spec.dataset, task="generation", text=tok, generation=gen,
                              batch=js.batch_size, device=self.ctx.device,
                              progress=lambda done, total: self.ctx.ledger.rows(
                                  index, self.ctx.counted(done)))
            for text, out in zip(todo, backend.generate(contexts, None, context)):
                self.graded[(name, text)] = out[0]
        return [self.graded[(name, t)] for t in texts]

    def judge_model(self, js):
        """The judge's backend and tokenizer, loaded once per judge (the last one let go
        before another loads)."""
        name = _judge_key(js)
        if self.loaded is not None and self.loaded[0] == name:
            return self.loaded[1].backend, self.loaded[1].tokenizer
        self.close()
        backend_name = js.backend or self.plan.sweep.model.backend
        with self.ctx.timer.span("load", doing="loading the judge"):
            judge = judge_model.load(js, backend_name, self.ctx.device, self.plan.sweep.model)
        self.loaded = (name, judge)
        return judge.backend, judge.tokenizer


def metrics_of(ev: Evaluation) -> list:
    """A judged cell's metrics in the sweep's order, ``judge_failed`` (and pairwise
    ``judge_bt``) right after ``judge``."""
    out = []
    for key, m in build_all(ev.spec.metrics):
        if key == judging.JUDGE:
            out += _judge_metrics(ev.spec.judge)
        else:
            out.append((key, m))
    return out


def _items(ev: Evaluation):
    """Every row of the evaluation's data set, every column (a judge's template may name
    any), in the data set's order."""
    import pyarrow as pa

    spec = ev.spec.dataset
    columns = list(ev.data.schema.names) if ev.data.schema is not None else None
    tables = list(data.read_batches(ev.data, spec, 4096, columns=columns))
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables)


def _records(records, cell: Cell) -> dict:
    """The generation's records by item id."""
    if "response" not in records.column_names or "id" not in records.column_names:
        raise StoreError(f"the generations of cell {cell.key} keep no responses; evaluate it "
                         "again with --force")
    rows = records.to_pylist()
    found = {_ident(r["id"]): r for r in rows}
    if len(found) != len(rows):
        raise SpecError("dataset.id: two items share an id; a judge matches responses to "
                        "items by id: give every item its own")
    return found


def _ident(value) -> str:
    return repr(value)


def _judge_key(js) -> str:
    return f"{js.model}|{js.dtype}|{js.backend}"


def _empty_states(ev: Evaluation) -> dict:
    return dict(Accumulator(_judge_metrics(ev.spec.judge), 1, ev.spec.bootstrap.k).states)


def _judge_metrics(js) -> list:
    """The judge stage's metrics: ``judge``, ``judge_failed`` and, pairwise, ``judge_bt``."""
    out = [(judging.JUDGE, judging.Judge()), (judging.FAILED, judging.JudgeFailed())]
    if js.baseline:
        out.append((judging.STRENGTH, judging.Strength()))
    return out


def _verdict(verdicts, out: str | None) -> tuple[float | None, str | None]:
    """(score, why it failed) of one judge text (None: the prompt did not fit)."""
    if out is None:
        return None, "the prompt does not fit the judge's context"
    score = verdicts.read(out)
    return score, None if score is not None else "no verdict in the judge's text"


__all__ = ["Generations", "JudgeStage", "generation_spec"]
