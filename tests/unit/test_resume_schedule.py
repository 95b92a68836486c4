"""A cell kept as it goes (``resume:``): the segment schedule, kept states and their records'
tags on disk, the planner picking them up (and --force not), the plan line, and record sets
of several segments read as one. No Ray: ``tests/e2e/test_resume.py`` and
``tests/integration/test_recovery.py`` run the real thing."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from rayeval.core.evaluate import ROWS
from rayeval.execution.workers.resume import OVERHEAD, PROBE, Pace, Schedule
from rayeval.execution.workers.scorer import Cost, Gather
from rayeval.io.store import states as store_states
from rayeval.io.store import ResultStore
from rayeval.plan.cells import make_plan
from rayeval.plan.loader import parse_sweep
from rayeval.reporting.display import plan_line


def segments(schedule: Schedule, seconds_per_bucket: float, fixed: float):
    """Run a schedule against a cost model: each segment costs fixed + buckets x rate."""
    out = []
    while schedule.a < schedule.k:
        a, b = schedule.next()
        out.append((a, b))
        busy = (b - a) * seconds_per_bucket
        schedule.done(b, Cost(wall=busy + fixed, busy=busy, rows=0))
    return out


def test_a_first_cell_probes_then_segments_take_about_every_seconds():
    got = segments(Schedule(every=5, k=1024, lo=0, pace=None), 0.1, 0.0)
    assert got[0] == (0, 1024 // PROBE)
    assert [b - a for a, b in got[1:-1]] == [50] * (len(got) - 2)     # 5 s at 0.1 s a bucket
    assert got[-1][1] == 1024 and got[-1][1] - got[-1][0] <= 75       # the tail joins
    assert all(b == a2 for (_, b), (a2, _) in zip(got, got[1:]))      # contiguous


def test_a_segment_is_long_enough_that_its_fixed_cost_stays_under_two_percent():
    k, rate, fixed = 65536, 0.001, 0.2        # a 65.5 s cell, a segment's fixed cost 0.2 s
    got = segments(Schedule(every=1, k=k, lo=0, pace=None), rate, fixed)
    spans = [b - a for a, b in got[1:-1]]
    assert len(spans) >= 3 and all(s * rate >= fixed * (1 - OVERHEAD) / OVERHEAD - rate
                                   for s in spans)
    # what segmenting adds: a fixed cost per segment beyond the one pass (the probe's too)
    assert fixed * (len(got) - 1) / (k * rate) <= OVERHEAD + fixed / (k * rate)


def test_a_short_cell_is_one_pass_once_its_pace_is_known_and_every_0_never_cuts():
    assert segments(Schedule(every=60, k=1024, lo=0, pace=Pace(0.001, 0.01)), 0.001, 0.01) \
        == [(0, 1024)]
    assert segments(Schedule(every=0, k=1024, lo=0, pace=None), 1.0, 0.0) == [(0, 1024)]
    assert segments(Schedule(every=5, k=1, lo=0, pace=None), 1.0, 0.0) == [(0, 1)]  # no buckets
    assert segments(Schedule(every=5, k=1024, lo=1000, pace=Pace(0.001, 0.0)), 0.001, 0.0) \
        == [(1000, 1024)]


def test_a_first_read_of_a_shard_now_kept_in_memory_is_no_segment_s_fixed_cost():
    assert Pace.of(Cost(wall=3.0, busy=1.0, first_read=True), 10) == Pace(0.1, 0.0)
    assert Pace.of(Cost(wall=3.0, busy=1.0), 10) == Pace(0.1, 2.0)      # read every pass


def test_gather_gives_full_batches_of_a_segment_s_rows():
    g = Gather(task=None, size=4)
    parts = [(torch.arange(3 * i, 3 * i + 3).view(3, 1).float(), torch.arange(3),
              torch.arange(3)) for i in range(3)]
    out = [p for part in parts for p in g.add(*part)] + g.rest()
    assert [len(y) for _, y, _ in out] == [6, 3]
    assert torch.cat([x for x, _, _ in out]).view(-1).tolist() == list(range(9))


def _sweep(tmp_path):
    import yaml

    from support import build_model, make_data, write_model_module, write_parquet

    write_model_module(str(tmp_path))
    x, y = make_data(50, seed=1)
    write_parquet(str(tmp_path / "data.parquet"), x, y)
    (tmp_path / "ckpts").mkdir()
    torch.save(build_model(seed=1).state_dict(), tmp_path / "ckpts" / "step_1.pt")
    raw = {"name": "t", "model": {"factory": "tiny_models:build"}, "checkpoints": ["ckpts/*"],
           "dataset": {"path": "data.parquet", "inputs": "x", "target": "y"},
           "task": "classification", "metrics": ["accuracy"], "output": "out",
           "resume": {"every": 5}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(raw))
    return parse_sweep(raw, base_dir=str(tmp_path), source="sweep.yaml")


def _plan(sweep, store, force=False):
    from rayeval.core import tasks
    from rayeval.io.data import inspect_dataset
    from rayeval.plan.cells import Evaluation

    evaluations = tuple(Evaluation(s, inspect_dataset(s.dataset, tasks.get(s.task)), 4)
                        for s in sweep.evals)
    return make_plan(sweep, evaluations, store, force=force)


def test_kept_states_resume_the_cell_and_force_starts_it_over(tmp_path):
    sweep = _sweep(tmp_path)
    assert sweep.resume.every == 5
    store = ResultStore(sweep.output)
    (cell,) = _plan(sweep, store).cells
    assert cell.resume == 0
    store_states.write(store, cell.key, {ROWS: np.array(20), "accuracy/total": np.arange(4)},
                       300, 1024, meta={"samples": "run1.0+run1.32"})
    meta: dict = {}
    states, below, k = store_states.read(store, cell.key, meta=meta)
    assert (below, k, meta) == (300, 1024, {"samples": "run1.0+run1.32"})
    assert states["accuracy/total"].tolist() == [0, 1, 2, 3]

    plan = _plan(sweep, store)
    (resumed,) = plan.cells
    assert (resumed.resume, resumed.saved_rows) == (300, 20)
    assert "1 cell resumed from 40% of their rows (--force starts them over)" in plan_line(plan)
    (forced,) = _plan(sweep, store, force=True).cells
    assert forced.resume == 0 and "resumed" not in plan_line(_plan(sweep, store, force=True))

    store_states.remove(store, cell.key)
    store_states.remove(store, cell.key)           # gone already: nothing
    assert _plan(sweep, store).cells[0].resume == 0


def test_the_records_of_several_segments_read_as_one_cell(tmp_path):
    store = ResultStore(str(tmp_path / "out"))
    for tag, ids in (("r.0", [[1, 2], [3]]), ("r.32", [[4], [5, 6]])):
        for rank, part in enumerate(ids):
            store.write_samples("c", tag, rank, 2, pa.table({"id": part}))
    assert sorted(store.read_samples("c", "r.0+r.32")["id"].to_pylist()) == [1, 2, 3, 4, 5, 6]
    store.write_samples("c", "r.64", 0, 2, pa.table({"id": [7]}))
    with pytest.raises(Exception, match="incomplete"):
        store.read_samples("c", "r.0+r.64")
