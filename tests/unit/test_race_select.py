"""``select:`` before any round: the bucket rounds, a round's rows of a batch, the decision on
the items a round actually scored, and every bad ``select:`` failing in one line before Ray
starts (through the real command line's main(), in this process)."""

import numpy as np
import pytest
import torch

from rayeval.core import racing, stats, tasks
from rayeval.core.tasks.text import TextBatch
from support import build_model, make_data, rayeval_main, write_model_module, write_parquet, \
    write_sweep


def test_bucket_rounds_are_nested_shares_of_the_items_ending_at_every_bucket():
    bounds = racing.bucket_rounds(4000, 1024, 32)
    assert bounds == sorted(set(bounds)) and bounds[-1] == 1024
    assert bounds[0] == 9                    # ceil(1024 * 32 / 4000): at least 32 items expected
    assert all(b2 >= 2 * b1 - 1 for b1, b2 in zip(bounds, bounds[1:-1]))
    assert racing.bucket_rounds(20, 1024, 32) == [1024]      # fewer items than a first round


def test_every_bucket_is_in_exactly_one_round_for_any_bucket_count():
    bounds = racing.bucket_rounds(5000, 1024, 32)
    for k in (1, 7, 256, 1024, 4096):
        ranges = [racing.bucket_range(bounds, r, k, 1024) for r in range(len(bounds))]
        covered = [b for lo, hi in ranges for b in range(lo, hi)]
        assert covered == list(range(k)), k
    # without a bootstrap (one bucket) an evaluation is scored whole in the first round
    assert racing.bucket_range(bounds, 0, 1, 1024) == (0, 1)


def test_a_round_takes_the_rows_its_hash_share_promises():
    """Rows by a hash of (seed, row id): round r holds about its share of them, and the
    rounds' row sets are nested the same way for any ordering of the rows."""
    ids = torch.arange(20_000, dtype=torch.int64)
    buckets = stats.buckets_of(ids, 0, 1024)
    bounds = racing.bucket_rounds(20_000, 1024, 32)
    for r, b in enumerate(bounds):
        n = int((buckets < b).sum())
        assert abs(n - 20_000 * b / 1024) < 5 * np.sqrt(20_000 * b / 1024) + 1, (r, n)
    shuffled = ids[torch.randperm(20_000)]
    assert set(shuffled[stats.buckets_of(shuffled, 0, 1024) < bounds[2]].tolist()) == \
        set(ids[buckets < bounds[2]].tolist())


def test_take_keeps_the_rows_of_every_kind_of_batch():
    index = torch.tensor([0, 2])
    x = torch.arange(12).view(4, 3)
    assert tasks.take(x, index, 4).tolist() == [[0, 1, 2], [6, 7, 8]]
    assert tasks.take({"a": x, "b": x[:, 0]}, index, 4)["b"].tolist() == [0, 6]
    text = TextBatch(rows=[[1], [2], [3], [4]], extra=["a", "b", "c", "d"], nbytes=400,
                     items={"id": [10, 11, 12, 13]}, ids=[5, 6, 7, 8])
    kept = tasks.take(text, index, 4)
    assert (kept.rows, kept.extra, kept.items, kept.ids, kept.nbytes) == \
        ([[1], [3]], ["a", "c"], {"id": [10, 12]}, [5, 7], 200)


def test_decide_bounds_with_the_items_actually_scored():
    race = racing.Race(checkpoints=3, schedule=(40, 80, 160, 400))
    sums = [30.0, 12.0, 29.0]
    at_schedule = racing.decide(race, sums, None, 0)           # 40 items: 1 left behind
    fewer = racing.decide(race, sums, None, 0, n=36)           # the hashed round held 36
    assert at_schedule.items == 40 and fewer.items == 36
    # the same bound as a schedule whose first round held 36 (same looks, same items in all)
    assert fewer.upper == racing.decide(racing.Race(3, (36, 80, 160, 400)), sums, None, 0).upper
    assert fewer.upper != at_schedule.upper
    with pytest.raises(ValueError, match="n must lie"):
        racing.decide(race, sums, None, 0, n=0)


@pytest.fixture
def folder(tmp_path):
    write_model_module(str(tmp_path))
    x, y = make_data(200)
    write_parquet(str(tmp_path / "data.parquet"), x, y)
    (tmp_path / "ckpts").mkdir()
    for i in range(3):
        torch.save(build_model(seed=i).state_dict(), tmp_path / "ckpts" / f"step_{i}.pt")
    return tmp_path


@pytest.mark.parametrize("select,extra,message", [
    ({"metric": "nope"}, {}, "select.metric: 'nope' names no evaluation of the suite (data)"),
    ({"metric": "data/f1"}, {}, "select.metric: data has no metric 'f1' (accuracy, macro_f1, "
                                "nll)"),
    ({"metric": "data/nll"}, {}, "select.metric: data/nll is not a mean of bounded per-item "
                                 "values and cannot be raced"),
    ({"metric": "data", "confidence": 1.5}, {}, "select.confidence: expected a number between "
                                                "0 and 1"),
    ({"metric": "data", "top": 0}, {}, "select.top: must be at least 1, got 0"),
    ({"metric": "data", "colour": 1}, {}, "select.colour: unknown key"),
    ({"metric": "data"}, {"bootstrap": {"replicates": 0}},
     "bootstrap: racing takes its rounds from the bootstrap's row buckets, and data has 1"),
    ({"metric": "data", "top": 3}, {}, "select.top: 3 keeps every one of the 3 checkpoints"),
    ({"metric": "aggregate"}, {}, "select.metric: aggregate averages two evaluations or more, "
                                  "and the suite has one"),
    ({"metric": "aggregate"}, {"evals": [
        {"name": n, "task": "classification", "metrics": m,
         "dataset": {"path": "data.parquet", "inputs": "x", "target": "y"}}
        for n, m in (("a", ["accuracy"]), ("b", ["nll", "accuracy"]))],
        "dataset": None, "task": None, "metrics": None},
     "select.metric: b/nll (its first metric, which the aggregate averages) is not a mean"),
])
def test_bad_select_fails_in_one_line_before_ray(folder, select, extra, message):
    path = write_sweep(str(folder), select=select, **extra)
    done = rayeval_main("run", path)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr and not (folder / "out").exists()
