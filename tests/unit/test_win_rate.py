"""Tier 1: the board's default aggregate, the mean win rate (``ranking.aggregate``): its value
against a hand computation on a small table (ties half, a lower-is-better metric), its interval
from the paired replicates against numpy, the other aggregates (mean, weights), the sweep's
``aggregate:`` setting and its errors, and ``select.metric``'s default. No Ray, no model."""

import math
from datetime import datetime, timezone

import numpy as np
import pytest
import yaml

from rayeval.config.run_schema import Aggregate
from rayeval.errors import SpecError, StoreError
from rayeval.plan.loader import parse_sweep
from rayeval.ranking import aggregate_spec, aggregates, build_board, compare, win_shares
from rayeval.reporting.board_html import to_html

B = 300
KEY = f"seed=0;buckets=1024;replicates={B};confidence=0.95"
WHEN = datetime(2026, 1, 1, tzinfo=timezone.utc)


def row(ckpt, step, evaluation, metric, value, higher, reps=None, bootstrap=KEY, sweep="s"):
    return {"sweep": sweep, "checkpoint": ckpt, "step": step, "evaluation": evaluation,
            "metric": metric, "value": value, "ci_low": None, "ci_high": None,
            "num_samples": 500, "created_at": WHEN, "higher_is_better": higher,
            "cell": f"{sweep}-{ckpt}-{evaluation}", "matrix": None,
            "bootstrap": None if reps is None else bootstrap,
            "replicates": None if reps is None else list(reps)}


# Four checkpoints, three evaluations: acc (higher), ppl (lower is better, 3-13: the scale
# that used to decide the mean), em (higher) with a tie between b and c.
TABLE = {            # checkpoint: (acc, ppl, em)
    "a": (0.80, 13.0, 0.30),
    "b": (0.60, 3.0, 0.50),
    "c": (0.70, 8.0, 0.50),
    "d": (0.65, 12.0, 0.10),
}
STEPS = {"a": 1, "b": 2, "c": 3, "d": 4}


def table_rows(replicates: dict | None = None):
    out = []
    for c, (acc, ppl, em) in TABLE.items():
        for e, m, v, higher in (("arith", "acc", acc, True), ("docs", "word_perplexity", ppl,
                                                               False), ("qa", "exact_match", em,
                                                                        True)):
            reps = None if replicates is None else replicates[(c, e)]
            out.append(row(f"/ck/{c}", STEPS[c], e, m, v, higher, reps))
    return out


def hand_win_rate(values: dict[str, tuple], higher: tuple[bool, ...]) -> dict[str, float]:
    """By hand: per evaluation, wins over each other checkpoint (1, a tie 1/2) / (n - 1);
    the mean over evaluations."""
    names = list(values)
    out = {}
    for c in names:
        shares = []
        for k, up in enumerate(higher):
            wins = 0.0
            for o in names:
                if o == c:
                    continue
                mine, theirs = values[c][k], values[o][k]
                better = mine > theirs if up else mine < theirs
                wins += 1.0 if better else 0.5 if mine == theirs else 0.0
            shares.append(wins / (len(names) - 1))
        out[c] = sum(shares) / len(shares)
    return out


def test_the_win_rate_against_a_hand_computation():
    # a: acc 3/3, ppl 0/3 (worst), em 1/3 -> 4/9; b: 0/3, 3/3, em 2.5/3 (the tie with c
    # half) -> 5.5/9; c: 2/3, 2/3, 2.5/3 -> 6.5/9; d: 1/3, 1/3, 0/3 -> 2/9
    board = build_board(table_rows())
    hand = hand_win_rate(TABLE, (True, False, True))
    got = {e.checkpoint[-1]: e.value("aggregate") for e in board.entries}
    assert got == pytest.approx(hand, abs=1e-15)
    assert hand == pytest.approx({"a": 4 / 9, "b": 5.5 / 9, "c": 6.5 / 9, "d": 2 / 9})
    # ranked by it: c, b, a, d; the mean (perplexity's scale decides) ranks b, c, d, a
    assert [e.checkpoint[-1] for e in board.entries] == ["c", "b", "a", "d"]
    assert board.entries[0].best
    assert board.rank_by == "aggregate" and board.aggregate.how == "win_rate"
    assert board.legend.startswith("aggregate: mean win rate on arith/acc, "
                                   "-docs/word_perplexity, qa/exact_match")
    assert all(r["aggregate"] == "win_rate" for r in aggregates(table_rows()))
    mean = build_board(table_rows(), aggregate="mean")
    assert [e.checkpoint[-1] for e in mean.entries] == ["b", "c", "d", "a"]
    assert mean.entries[0].value("aggregate") == pytest.approx((0.60 - 3.0 + 0.50) / 3)


def test_win_shares_by_rank_ties_half_and_nan_left_out():
    got = win_shares([1.0, 3.0, 3.0, math.nan, 0.5])
    assert got[:3].tolist() == [1 / 3, 2.5 / 3, 2.5 / 3] and math.isnan(got[3])
    assert got[4] == 0.0
    assert np.isnan(win_shares([2.0, math.nan])).all()          # nobody to beat
    columns = win_shares(np.array([[1.0, 2.0], [2.0, 2.0], [0.0, 1.0]]))
    assert columns.tolist() == [[0.5, 0.75], [1.0, 0.75], [0.0, 0.0]]


def paired_replicates(seed=3):
    """Replicate b of an evaluation: one resample shared by every checkpoint (paired), with
    enough noise that the order changes between replicates."""
    rng = np.random.default_rng(seed)
    out = {}
    for e, k, scale in (("arith", 0, 0.06), ("docs", 1, 2.0), ("qa", 2, 0.08)):
        shared = rng.normal(0, scale, B)
        for c, values in TABLE.items():
            out[(c, e)] = values[k] + shared + rng.normal(0, scale, B)
    return out


def test_the_interval_from_the_paired_replicates_against_numpy():
    reps = paired_replicates()
    board = build_board(table_rows(reps))
    names = list(TABLE)
    per_replicate = {c: np.zeros(B) for c in names}
    for e, up in (("arith", True), ("docs", False), ("qa", True)):
        x = np.array([reps[(c, e)] for c in names]) * (1 if up else -1)   # n x B
        for i, c in enumerate(names):        # wins over each other one, ties half, by hand
            others = np.delete(x, i, axis=0)
            wins = (others < x[i]).sum(axis=0) + 0.5 * (others == x[i]).sum(axis=0)
            per_replicate[c] += wins / (len(names) - 1) / 3
    for e in board.entries:
        agg = e.rows["aggregate"]
        mine = per_replicate[e.checkpoint[-1]]
        lo, hi = np.quantile(mine, [0.025, 0.975])
        assert np.allclose(agg["replicates"], mine, rtol=0, atol=1e-15)
        assert agg["ci_low"] == pytest.approx(lo, abs=1e-12)
        assert agg["ci_high"] == pytest.approx(hi, abs=1e-12)
        assert agg["ci_low"] <= agg["value"] + 1e-12   # the point value lies in it here
    # the marks pair the win-rate replicates: a checkpoint's differences to the best
    assert any(e.marks.get("aggregate") == "*" for e in board.entries) or \
        all(e.marks.get("aggregate") in ("~", None, "") for e in board.entries)


def test_no_interval_unless_every_checkpoint_pairs():
    reps = paired_replicates()
    rows = table_rows(reps)
    for r in rows:                          # one checkpoint's docs resampled with another seed
        if r["checkpoint"] == "/ck/d" and r["evaluation"] == "docs":
            r["bootstrap"] = KEY.replace("seed=0", "seed=1")
    found = aggregates(rows)
    assert all(a["ci_low"] is None and a["replicates"] is None for a in found)
    assert [a["value"] for a in found] == pytest.approx(
        list(hand_win_rate(TABLE, (True, False, True)).values()))


def test_a_missing_evaluation_leaves_the_aggregate_missing_but_still_counts_as_opponent():
    rows = [r for r in table_rows() if not (r["checkpoint"] == "/ck/d" and
                                            r["evaluation"] == "qa")]
    by = {a["checkpoint"][-1]: a["value"] for a in aggregates(rows)}
    assert math.isnan(by["d"])
    # qa among a, b, c only: a 0/2, b 1.5/2, c 1.5/2; arith and docs among all four
    assert by["a"] == pytest.approx((1 + 0 + 0) / 3)
    assert by["b"] == pytest.approx((0 + 1 + 0.75) / 3)


def test_one_checkpoint_shows_the_plain_mean_and_says_so():
    rows = [r for r in table_rows() if r["checkpoint"] == "/ck/a"]
    board = build_board(rows)
    agg = board.entries[0].rows["aggregate"]
    assert agg["aggregate"] == "mean"
    assert agg["value"] == pytest.approx((0.80 - 13.0 + 0.30) / 3)
    assert any(n.startswith("aggregate: one checkpoint on the board, so no win rate")
               for n in board.notes)
    assert board.legend.startswith("aggregate: mean of ")


def test_weights_and_the_mean_note():
    rows = table_rows()
    board = build_board(rows, aggregate="arith=2,docs=0,qa=1")
    a = next(e for e in board.entries if e.checkpoint == "/ck/a").rows["aggregate"]
    assert a["value"] == pytest.approx((2 * 0.80 + 1 * 0.30) / 3)
    assert a["evaluations"] == ["arith", "qa"] and a["aggregate"] == "weights"
    assert [c.name for c in board.averaged] == ["arith/acc", "qa/exact_match"]
    assert board.legend == "aggregate: weighted mean of arith/acc (2), qa/exact_match (1)"
    # interval of a weighted mean: replicate b combined with the same weights
    reps = paired_replicates()
    got = build_board(table_rows(reps), aggregate=Aggregate(
        how="weights", weights=(("arith", 2.0), ("docs", 0.0), ("qa", 1.0))))
    a = next(e for e in got.entries if e.checkpoint == "/ck/a").rows["aggregate"]
    mine = (2 * reps[("a", "arith")] + reps[("a", "qa")]) / 3
    assert np.allclose(a["replicates"], mine, atol=1e-12)
    # a plain mean of a perplexity and accuracies: one warning line; none for the win rate
    mean = build_board(rows, aggregate="mean")
    said = [n for n in mean.notes if n.startswith("warning: the aggregate")]
    assert len(said) == 1 and "docs/word_perplexity 3\u201313" in said[0]
    assert not [n for n in board.notes + build_board(rows).notes
                if n.startswith("warning: the aggregate")]
    # both directions on one scale: said too
    flipped = [dict(r, metric="error", value=r["value"] / 20) if r["evaluation"] == "docs" else r
               for r in rows]
    note = [n for n in build_board(flipped, aggregate="mean").notes
            if n.startswith("warning: the aggregate")]
    assert note and "lower-is-better ones negated (-docs/error)" in note[0]
    assert "aggregate: weighted mean of arith/acc (2)" in to_html(board)


@pytest.mark.parametrize("text, said", [
    ("win-rate", "--aggregate: unknown aggregate 'win-rate'; did you mean 'win_rate'?"),
    ("arith=x", "--aggregate: 'arith=x': expected EVAL=WEIGHT with a weight of 0 or more"),
    ("arith=-1", "--aggregate: 'arith=-1': expected EVAL=WEIGHT"),
])
def test_the_option_text_errors(text, said):
    with pytest.raises(SpecError, match="^" + said.replace("?", r"\?").replace("(", r"\(")):
        aggregate_spec(text)


def test_weights_naming_an_evaluation_the_board_lacks():
    with pytest.raises(StoreError, match=r"--aggregate: weights: no evaluation 'arth' on the "
                                         r"board; did you mean 'arith'\?"):
        build_board(table_rows(), aggregate="arth=1,docs=1,qa=1")
    with pytest.raises(StoreError, match="no weight for docs, qa"):
        build_board(table_rows(), aggregate="arith=1")


def test_compare_a_and_b_share_of_evaluations_won():
    reps = paired_replicates()
    rows = table_rows(reps)
    a = [r for r in rows if r["checkpoint"] == "/ck/a"]
    b = [r for r in rows if r["checkpoint"] == "/ck/b"]
    agg = next(c for c in compare(a, b) if c.name == "aggregate")
    # a beats b on arith, loses docs and qa: 1/3 against 2/3
    assert (agg.a["value"], agg.b["value"]) == pytest.approx((1 / 3, 2 / 3))
    assert agg.paired is not None and agg.paired.difference == pytest.approx(-1 / 3)
    mean = next(c for c in compare(a, b, aggregate="mean") if c.name == "aggregate")
    assert mean.a["value"] == pytest.approx((0.80 - 13.0 + 0.30) / 3)


# --- the sweep's aggregate: and select: ---------------------------------------------------

DATA = {"path": "data.parquet", "inputs": "x", "target": "y"}


def sweep(tmp_path, **extra):
    (tmp_path / "data.parquet").write_bytes(b"")
    raw = {"name": "s", "model": {"factory": "m:build"}, "checkpoints": ["ck/*.pt"],
           "output": "results",
           "evals": [{"name": "val", "dataset": DATA, "task": "classification",
                      "metrics": ["accuracy"]},
                     {"name": "ood", "dataset": DATA,
                      "task": "classification", "metrics": ["accuracy"]}]}
    raw.update(extra)
    return parse_sweep(yaml.safe_load(yaml.safe_dump(raw)), base_dir=str(tmp_path),
                       source="sweep.yaml")


def test_the_sweep_setting(tmp_path):
    assert sweep(tmp_path).aggregate == Aggregate()           # win_rate
    assert sweep(tmp_path, aggregate="mean").aggregate.how == "mean"
    got = sweep(tmp_path, aggregate={"weights": {"val": 2, "ood": 1}}).aggregate
    assert got.how == "weights" and got.weights == (("ood", 1.0), ("val", 2.0))


@pytest.mark.parametrize("value, said", [
    ("win_rates", "sweep.yaml: aggregate: unknown aggregate 'win_rates'; did you mean "
                  "'win_rate'?; choose one of: win_rate, mean or {weights: "),
    (3, "sweep.yaml: aggregate: expected win_rate, mean or {weights: {EVALUATION: weight, "
        "...}}, got 3 (int)"),
    ({"weight": {"val": 1}}, "sweep.yaml: aggregate.weight: unknown key; did you mean "
                             "'weights'?"),
    ({}, "sweep.yaml: aggregate.weights: missing required key"),
    ({"weights": {"val": -1, "ood": 1}}, "sweep.yaml: aggregate.weights: expected a mapping of "
                                         "evaluation names to weights of 0 or more"),
    ({"weights": {"vall": 1, "ood": 1}}, "sweep.yaml: aggregate.weights.vall: no such "
                                         "evaluation in the aggregate; did you mean 'val'?"),
    ({"weights": {"val": 1}}, "sweep.yaml: aggregate.weights: no weight for ood; give every "
                              "evaluation"),
    ({"weights": {"val": 0, "ood": 0}}, "sweep.yaml: aggregate.weights: the weights sum to 0"),
])
def test_the_sweep_setting_errors_are_one_line_with_the_key_path(tmp_path, value, said):
    with pytest.raises(SpecError) as e:
        sweep(tmp_path, aggregate=value)
    assert str(e.value).startswith(said) and "\n" not in str(e.value)


def test_select_metric_defaults_to_what_the_board_ranks_by(tmp_path):
    several = sweep(tmp_path, select={"top": 1})
    assert several.select.metric == "aggregate" and several.select.suite
    one = sweep(tmp_path, select={"top": 1}, evals=[
        {"name": "val", "dataset": DATA, "task": "classification",
         "metrics": ["accuracy", "nll"]}])
    assert one.select.metric == "val" and one.select.target(["val"]) == ("val", None)
    named = sweep(tmp_path, select={"top": 2, "metric": "ood"})
    assert named.select.metric == "ood"


def test_one_group_shown_with_its_members_has_no_aggregate_column():
    """``--members`` on a board of one lm-eval group: its members are not combined with it,
    so there is nothing to aggregate (the column used to show '-' for every checkpoint)."""
    rows = [row(f"/ck/{c}", 1, e, "acc", v, True) for c, v in (("x", 0.5), ("y", 0.6))
            for e in ("g", "g/a", "g/b")]
    board = build_board(rows)
    assert board.metrics == ["g/acc", "g/a/acc", "g/b/acc"] and board.rank_by == "g/acc"
    with pytest.raises(StoreError, match="hold only g \\(and its group's members\\)"):
        build_board(rows, "aggregate")
    rows += [row(f"/ck/{c}", 1, "h", "acc", v, True) for c, v in (("x", 0.5), ("y", 0.6))]
    board = build_board(rows)                   # a group and another evaluation: combined
    assert board.metrics[0] == "aggregate" and board.entries[0].value("aggregate") == 1.0
    assert board.entries[0].rows["aggregate"]["evaluations"] == ["g", "h"]


def test_win_shares_on_many_replicates_equal_the_pairwise_count():
    """The sorted count (transposed, threaded in ``win_rates``) against every pair compared:
    ties half, NaN left out, on a matrix with ties and NaNs."""
    rng = np.random.default_rng(11)
    x = np.round(rng.normal(size=(40, 25)), 1)
    x[rng.random(x.shape) < 0.1] = np.nan
    want = np.full(x.shape, np.nan)
    for j in range(x.shape[1]):
        col = x[:, j]
        held = ~np.isnan(col)
        for i in np.flatnonzero(held):
            others = col[held & (np.arange(len(col)) != i)]
            if len(others):
                want[i, j] = ((others < col[i]).sum() + 0.5 * (others == col[i]).sum()) \
                    / len(others)
    assert np.allclose(win_shares(x), want, equal_nan=True, rtol=0, atol=1e-15)


def test_percentiles_are_torchs_quantile_and_paired_rows_are_pairs():
    """``percentiles`` (numpy, rows at once) against torch.quantile row by row, as
    ``stats.percentile_interval`` takes it: the same bits but for a last-bit difference in a
    rare row (a long double stands in for torch's fused multiply-add); ``paired_rows`` of a
    column against a reference equals the difference of the pairs computed in torch."""
    import torch

    from rayeval.core.stats import percentile_interval
    from rayeval.ranking.replicates import percentiles
    from rayeval.ranking.compare import paired_rows

    rng = np.random.default_rng(7)
    x = rng.normal(size=(400, 301)) * 10.0 ** rng.integers(-3, 3, size=(400, 1))
    x[rng.random(x.shape) < 0.03] = np.nan
    x[5] = np.nan                                         # nothing left: NaN
    lo, hi = percentiles(x, 0.9)
    want = np.array([percentile_interval(torch.tensor(r), 0.9) for r in x])
    got = np.stack([lo, hi], axis=1)
    assert np.isnan(got[5]).all() and np.isnan(want[5]).all()
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.mean() > 0.99
    assert np.allclose(got, want, rtol=1e-15, atol=0, equal_nan=True)

    base = row("ref", 1, "qa", "acc", 0.5, True, reps=rng.normal(0.5, 0.05, B))
    others = [row(f"c{i}", i, "qa", "acc", 0.5 + i / 100, i % 2 == 0,
                  reps=np.round(rng.normal(0.5 + i / 100, 0.05, B), 2)) for i in range(6)]
    others.append(row("off", 9, "qa", "acc", 0.4, True))            # no replicates: None
    found = paired_rows(others, base, 0.95)
    assert found[-1] is None
    for a, p in zip(others[:-1], found):
        d = torch.tensor(a["replicates"]) - torch.tensor(base["replicates"])
        low, high = percentile_interval(d, 0.95)
        sign = 1.0 if a["higher_is_better"] else -1.0
        better = float(((sign * d > 0).double() + 0.5 * (d == 0).double()).mean())
        assert p.difference == a["value"] - base["value"] and p.a_better == better
        assert (p.ci_low, p.ci_high) == pytest.approx((low, high), rel=1e-15, abs=0)


def test_two_sweeps_with_different_suites_average_what_both_hold():
    """A store of two sweeps: the aggregate averages the evaluations every sweep holds (each
    checkpoint had '-' when it averaged the other sweep's evaluations too), and says what it
    left out; sweeps that share fewer than two evaluations get no aggregate column, and a
    line that says why. A checkpoint missing an evaluation of its own sweep keeps '-'."""
    rows = [row(f"/a/{c}", i, e, "acc", v, True, sweep="a")
            for i, (c, vals) in enumerate({"c1": (0.9, 0.5, 0.1), "c2": (0.8, 0.6, 0.2)}.items())
            for e, v in zip(("x", "y", "z"), vals)]
    rows += [row(f"/b/{c}", i, e, "acc", v, True, sweep="b")
             for i, (c, vals) in enumerate({"c3": (0.7, 0.7, 0.3), "c4": (0.6, 0.4, 0.4)}.items())
             for e, v in zip(("x", "y", "w"), vals)]
    board = build_board(rows, aggregate="mean")
    assert board.columns[0].name == "aggregate"
    assert [c.evaluation for c in board.averaged] == ["x", "y"]
    means = {e.checkpoint: e.value("aggregate") for e in board.entries}
    assert means == pytest.approx({"/a/c1": 0.7, "/a/c2": 0.7, "/b/c3": 0.7, "/b/c4": 0.5})
    assert "aggregate: averages what every sweep on the board holds (x, y); not in every " \
        "sweep: w (b); z (a)" in board.notes
    wins = build_board(rows)                               # the default, the win rate
    assert all(e.value("aggregate") is not None and not math.isnan(e.value("aggregate"))
               for e in wins.entries)

    apart = [r for r in rows if r["evaluation"] not in ("y",)]
    apart = [dict(r, evaluation="v") if r["sweep"] == "b" and r["evaluation"] == "x" else r
             for r in apart]
    board = build_board(apart)
    assert "aggregate" not in [c.name for c in board.columns]
    assert any(n.startswith("no aggregate: the sweeps on the board share fewer than two")
               for n in board.notes), board.notes

    lacking = [r for r in rows if not (r["checkpoint"] == "/a/c2" and r["evaluation"] == "y")]
    board = build_board(lacking, aggregate="mean")
    assert [c.evaluation for c in board.averaged] == ["x", "y"]
    assert next(e for e in board.entries if e.checkpoint == "/a/c2").value("aggregate") is None
