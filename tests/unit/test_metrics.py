"""Tier 1: metric states. The key property: states merged from any split of the rows equal
one pass over all rows, and metrics match an independent single-process reference."""

import math

import numpy as np
import pytest
import torch

from rayeval.core import tasks
from rayeval.errors import CheckpointError, DataError
from rayeval.core.evaluate import ROWS, Pass, compute, evaluate, output_size
from rayeval.core.metrics import REGISTRY
from support import build_model, make_data, reference_metrics

METRICS = [(name, cls()) for name, cls in REGISTRY["classification"].items()]


def batches(x, y, size):
    for i in range(0, len(y), size):
        yield torch.from_numpy(x[i:i + size]), torch.from_numpy(y[i:i + size])


def merge(*states):
    """Sum states as the all-reduce does, then carry the fixed-point limbs."""
    from rayeval.core.stats import normalize

    floats = {f"{key}/{n}" for key, m in METRICS for n, t in m.init_state(4).items()
              if t.dtype.is_floating_point}
    out = {k: sum(s[k] for s in states) for k in states[0]}
    return {k: normalize(v) if k in floats else v for k, v in out.items()}


@pytest.mark.parametrize("n", [1, 7, 1001])
def test_single_pass_matches_reference(n):
    model = build_model(seed=3).eval()
    x, y = make_data(n, seed=n)
    states = evaluate(model, batches(x, y, 64), METRICS, 4)
    got = compute(METRICS, states, 4)
    ref = reference_metrics(model, x, y)
    assert int(states[ROWS]) == n
    for key in ref:
        # The model runs in float32, and the reference takes other kernels for the same rows
        # (a one-row batch, another batch size: ~3e-8 apart in a logit on some CPUs), so the
        # float metrics agree to float32 precision; counts-based ones exactly.
        exact = key in ("accuracy", "top5_accuracy", "balanced_accuracy") or "_" in key \
            and key.split("_")[0] in ("macro", "micro", "weighted")
        tol = dict(rel=0, abs=0) if exact else dict(rel=1e-6, abs=1e-9)
        assert got[key] == pytest.approx(ref[key], **tol), key


class Lookup(torch.nn.Module):
    """Fixed logits per row (input = row index): outputs that cannot depend on batching, so the
    test sees only what rayeval adds. (Real kernels may round a row differently by batch size:
    2.98e-8 in logits between batches of 3 and 64 rows here.)"""

    def __init__(self, logits):
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, x):
        return self.logits[x[:, 0].long()]


@pytest.mark.parametrize("shards", [2, 3, 5])
@pytest.mark.parametrize("buckets", [1, 64])
def test_merged_shard_states_equal_one_pass(shards, buckets):
    from rayeval.core.stats import buckets_of

    x0, y = make_data(1009, seed=1)
    with torch.no_grad():
        model = Lookup(build_model(seed=4)(torch.from_numpy(x0)))
    x = np.arange(len(y), dtype=np.float32).reshape(-1, 1)
    b_all = buckets_of(torch.arange(len(y)), 0, buckets).numpy()

    def batches(x, y, size, b=None):
        for i in range(0, len(y), size):
            yield (torch.from_numpy(x[i:i + size]), torch.from_numpy(y[i:i + size]),
                   torch.from_numpy(b[i:i + size]))

    rng = np.random.default_rng(shards)
    owner = rng.integers(0, shards, size=len(y))       # an arbitrary, uneven sharding
    parts = [evaluate(model, batches(x[owner == s], y[owner == s], 50, b_all[owner == s]),
                      METRICS, 4, buckets=buckets) for s in range(shards)]
    merged = merge(*parts)
    whole = evaluate(model, batches(x, y, 64, b_all), METRICS, 4, buckets=buckets)
    for k in whole:
        assert torch.equal(merged[k], whole[k]), k     # exact: integers and fixed-point limbs
    from rayeval.config.schema import Bootstrap
    from rayeval.core.evaluate import finalize

    boot = Bootstrap(replicates=50, buckets=buckets)
    got, want = finalize(METRICS, merged, 4, boot), finalize(METRICS, whole, 4, boot)
    for key in want:
        assert got[key].matrix == want[key].matrix
        if want[key].matrix is None:
            assert got[key].value == want[key].value, key
            assert (got[key].ci_low, got[key].ci_high) == (want[key].ci_low, want[key].ci_high)


def test_macro_f1_skips_classes_absent_from_targets_and_predictions():
    # 4 model classes; only classes 0 and 1 occur in targets or predictions.
    metric = REGISTRY["classification"]["macro_f1"]()
    state = metric.init_state(4)
    logits = torch.tensor([[5.0, 0, 0, 0], [5.0, 0, 0, 0], [0, 5.0, 0, 0]])
    metric.update(state, logits, torch.tensor([0, 1, 1]))
    # class 0: tp 1, fp 1, fn 0 -> 2/3; class 1: tp 1, fp 0, fn 1 -> 2/3
    assert metric.compute(state) == pytest.approx(2 / 3)


def test_empty_state_is_nan():
    for _, metric in METRICS:
        if metric.scalar:
            assert math.isnan(float(metric.compute(metric.init_state(3)))), metric.name


def test_target_outside_the_model_classes():
    p = Pass(build_model().eval(), METRICS, 4, torch.device("cpu"))
    with pytest.raises(DataError, match=r"class index 4 is outside the model's 4 classes"):
        p.update(torch.zeros(2, 8), torch.tensor([0, 4]))
    with pytest.raises(DataError, match=r"class index -1"):
        p.update(torch.zeros(2, 8), torch.tensor([-1, 0]))


def test_nan_outputs_fail_the_checkpoint():
    model = build_model().eval()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    p = Pass(model, METRICS, 4, torch.device("cpu"))
    with pytest.raises(CheckpointError, match="NaN or infinite outputs"):
        p.update(torch.ones(2, 8), torch.tensor([0, 1]))


def test_num_classes_probe_and_bad_model_output():
    from rayeval.errors import ModelError

    cls, reg = tasks.get("classification"), tasks.get("regression")
    assert output_size(build_model(), cls, torch.zeros(3, 8)) == 4
    with torch.device("meta"):
        meta = build_model()
    assert output_size(meta, cls, torch.zeros(3, 8), "meta") == 4
    with pytest.raises(ModelError, match=r"cannot take inputs of shape \(3, 5\)"):
        output_size(build_model(), cls, torch.zeros(3, 5))
    with pytest.raises(ModelError, match="logits of shape"):
        output_size(torch.nn.Flatten(0), cls, torch.zeros(3, 8))
    with pytest.raises(ModelError, match="one prediction per row"):
        output_size(build_model(), reg, torch.zeros(3, 8))


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=13, dim=6):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        return self.out(self.emb(ids))


@pytest.mark.parametrize("names", [[], ["nll"], ["token_accuracy", "perplexity"]])
def test_language_modeling_counts_scored_tokens_whatever_the_metrics(names):
    import pyarrow as pa

    from rayeval.config.schema import DatasetSpec
    from rayeval.core.metrics import build, parse_metric

    rng = np.random.default_rng(4)
    ignore = 3                       # dataset.ignore_index: a real id that is not scored
    seqs = [rng.integers(0, 13, rng.integers(1, 10)).tolist() for _ in range(41)]
    spec = DatasetSpec(path="", inputs=("tokens",), ignore_index=ignore, pad_id=0)
    table = pa.table({"tokens": pa.array(seqs, pa.list_(pa.int64()))})
    task = tasks.get("language_modeling")
    # right-padded per batch of 8 (IGNORE at padding, and where a token is `ignore`)
    data = [task.decode(b, spec, {})
            for b in (table.slice(i, 8) for i in range(0, len(seqs), 8))]
    # position t predicts token t + 1: a sequence scores its tokens after the first
    expected = sum(sum(1 for t in s[1:] if t != ignore) for s in seqs)
    torch.manual_seed(0)
    model = TinyLM().eval()
    metrics = [(m.key, build(m)) for m in (parse_metric(n, task.name) for n in names)]
    states = evaluate(model, data, metrics, 13, task=task)
    assert int(states[ROWS]) == len(seqs)
    assert task.scored_units(states) == expected
    if "nll" in names:
        assert int(states["nll/tokens"].sum()) == expected
    halves = [evaluate(model, part, metrics, 13, task=task) for part in (data[:2], data[2:])]
    merged = {k: halves[0][k] + halves[1][k] for k in halves[0]}     # as the all-reduce sums
    assert task.scored_units(merged) == expected


def test_classification_and_regression_keep_no_token_count():
    model = build_model(seed=3).eval()
    x, y = make_data(10)
    states = evaluate(model, batches(x, y, 4), METRICS, 4)
    assert set(states) == {ROWS} | {f"{k}/{n}" for k, m in METRICS for n in m.init_state(4)}
    for name in ("classification", "regression"):
        assert tasks.get(name).scored_units(states) is None


def test_a_metric_that_raises_is_named_as_the_culprit():
    """A custom metric's own bug is a MetricError naming it (with the traceback for --debug),
    neither the model's fault nor a crash of the worker group."""
    from rayeval.errors import MetricError
    from rayeval.core.evaluate import finalize

    class Broken:
        name = "broken"

        def init_state(self, c):
            return {"n": torch.zeros((), dtype=torch.int64)}

        def update(self, state, outputs, targets):
            state["n"] += targets.shape[0]

        def compute(self, state):
            raise ZeroDivisionError("no rows")

    from rayeval.core.metrics import CustomMetric

    metrics = [("broken", CustomMetric(Broken()))]
    states = evaluate(build_model().eval(), batches(*make_data(10), 4), metrics, 4)
    with pytest.raises(MetricError, match=r"^metric 'broken' failed computing its value: "
                                          r"ZeroDivisionError: no rows") as e:
        finalize(metrics, states, 4)
    assert "raise ZeroDivisionError" in e.value.detail


class Spread:
    """A float state of three elements with a contribution per row for each (no index)."""
    name, scalar = "spread", True

    def init_state(self, c):
        return {"s": torch.zeros(3, dtype=torch.float64)}

    def rows(self, outputs, targets):
        p = torch.softmax(outputs.double(), dim=1)
        return {"s": p[:, :3] - 0.25}

    def compute(self, state):
        return state["s"].sum()


@pytest.mark.parametrize("flush_values", [1, 700, 1 << 20])
def test_held_contributions_give_the_same_states_whenever_they_are_added(
        monkeypatch, flush_values):
    """Float contributions are held and converted to limbs in groups (fewer kernels per
    batch on a GPU); where the groups fall must not change a bit of the states."""
    from rayeval.core.evaluate import Accumulator
    from rayeval.core.stats import buckets_of, from_limbs

    model = build_model(seed=5).eval()
    x, y = make_data(1003, seed=2)
    metrics = METRICS + [("spread", Spread())]
    b = buckets_of(torch.arange(len(y)), 0, 16)

    def states():
        p = Pass(model, metrics, 4, torch.device("cpu"), buckets=16)
        for i in range(0, len(y), 64):
            p.update(torch.from_numpy(x[i:i + 64]), torch.from_numpy(y[i:i + 64]), b[i:i + 64])
        p.finish()
        return p.states

    want = states()
    monkeypatch.setattr(Accumulator, "FLUSH_VALUES", flush_values)
    got = states()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    with torch.no_grad():
        p = torch.softmax(model(torch.from_numpy(x)).double(), dim=1)[:, :3] - 0.25
    per_bucket = torch.zeros(16, 3, dtype=torch.float64).index_add_(0, b, p)
    assert torch.allclose(from_limbs(got["spread/s"]), per_bucket, rtol=0, atol=1e-12)


def test_a_non_finite_contribution_names_its_metric_and_abandon_reads_without_adding():
    from rayeval.errors import MetricError

    class Bad(Spread):
        name = "bad"

        def rows(self, outputs, targets):
            return {"s": torch.full((targets.shape[0], 3), float("nan"), dtype=torch.float64)}

    p = Pass(build_model().eval(), METRICS + [("bad", Bad())], 4, torch.device("cpu"))
    x, y = make_data(10)
    p.update(torch.from_numpy(x), torch.from_numpy(y))     # held: nothing converted yet
    states = p.abandon()                                    # a failed cell's states: no raise
    assert int(states[ROWS]) == 10 and not states["bad/s"].any()
    p.update(torch.from_numpy(x), torch.from_numpy(y))
    with pytest.raises(MetricError, match=r"^metric 'bad' failed on a batch: ValueError: "
                                          r"a metric contribution is not finite"):
        p.finish()


def test_all_finite_is_exact_where_the_sum_overflows():
    from rayeval.core.stats import all_finite

    big = torch.full((4,), 3e38, dtype=torch.float32)       # finite values, an infinite sum
    assert all_finite(big) and all_finite(torch.zeros(0)) and all_finite(torch.arange(3))
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(5)
        t[3] = bad
        assert not all_finite(t) and not all_finite(torch.cat([big, t]))
    assert not all_finite(torch.tensor([float("inf"), -float("inf")]))   # sum is NaN
