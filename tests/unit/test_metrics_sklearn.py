"""Tier 1: every metric against scikit-learn (or, where it has none, an independent numpy
formula), on data with ties, empty classes and a single class."""

import math
import os

import numpy as np
import pytest
import torch
from sklearn import metrics as sk

from rayeval.core.evaluate import compute, evaluate
from rayeval.core.metrics import IGNORE, REGISTRY, build, parse_metric

C = 4


def run(task, names, outputs, targets, size=C):
    """rayeval's values for (outputs, targets) fed through an identity 'model'."""
    specs = [parse_metric(n, task) for n in names]
    metrics = [(s.key, build(s)) for s in specs]
    model = torch.nn.Identity()
    batches = [(outputs[i:i + 37], targets[i:i + 37]) for i in range(0, len(targets), 37)]
    states = evaluate(model, batches, metrics, size, task=task)
    return compute(metrics, states, size)


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def cases():
    rng = np.random.default_rng(0)
    n = 503
    random = (rng.normal(size=(n, C)), rng.integers(0, C, n))
    # ties: logits on a coarse grid, so arg-max ties and equal probabilities are common
    ties = (rng.integers(0, 3, size=(n, C)).astype(float), rng.integers(0, C, n))
    # class 3 never occurs in targets nor predictions
    empty_logits = rng.normal(size=(n, C))
    empty_logits[:, 3] = -50
    empty = (empty_logits, rng.integers(0, 3, n))
    # a single class in the targets
    single = (rng.normal(size=(n, C)), np.zeros(n, dtype=np.int64))
    return {"random": random, "ties": ties, "empty_class": empty, "single_class": single}


CLASSIFICATION = ["accuracy", "balanced_accuracy", "nll", "brier", "top_k_accuracy",
                  "macro_precision", "micro_precision", "weighted_precision", "macro_recall",
                  "micro_recall", "weighted_recall", "macro_f1", "micro_f1", "weighted_f1"]


@pytest.mark.parametrize("case", sorted(cases()))
def test_classification_against_sklearn(case):
    logits, y = cases()[case]
    got = run("classification", CLASSIFICATION + [{"name": "top_k_accuracy", "k": 2},
                                                   "confusion_matrix"],
              torch.tensor(logits, dtype=torch.float32), torch.tensor(y))
    logits32 = torch.tensor(logits, dtype=torch.float32).double().numpy()
    prob = softmax(logits32)
    pred = torch.tensor(logits, dtype=torch.float32).argmax(1).numpy()   # torch's tie-break
    labels = list(range(C))
    want = {
        "accuracy": sk.accuracy_score(y, pred),
        "nll": sk.log_loss(y, prob, labels=labels),
        "brier": sk.brier_score_loss(y, prob, labels=labels, scale_by_half=False),
    }
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # sklearn warns on absent classes
        want["balanced_accuracy"] = sk.balanced_accuracy_score(y, pred)
        for avg in ("macro", "micro", "weighted"):
            p, r, f, _ = sk.precision_recall_fscore_support(y, pred, average=avg,
                                                            zero_division=0)
            want.update({f"{avg}_precision": p, f"{avg}_recall": r, f"{avg}_f1": f})
    # top-k with k > 1: scikit-learn breaks score ties differently; compare on distinct scores
    if case != "ties":
        want["top5_accuracy"] = 1.0                      # k=5 >= 4 classes
        want["top2_accuracy"] = sk.top_k_accuracy_score(y, logits32, k=2, labels=labels)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (case, key)


def test_confusion_matrix_against_sklearn():
    logits, y = cases()["empty_class"]
    specs = [parse_metric("confusion_matrix", "classification")]
    metrics = [(s.key, build(s)) for s in specs]
    states = evaluate(torch.nn.Identity(), [(torch.tensor(logits, dtype=torch.float32),
                                             torch.tensor(y))], metrics, C)
    from rayeval.core.evaluate import finalize

    matrix = finalize(metrics, states, C)["confusion_matrix"].matrix
    pred = torch.tensor(logits, dtype=torch.float32).argmax(1).numpy()
    assert matrix == sk.confusion_matrix(y, pred, labels=list(range(C))).tolist()


def quantized(logits, bins):
    """Probabilities put on bin centres: binned AUROC/AUPRC are then exact."""
    prob = softmax(logits)
    return (np.floor(prob * bins).clip(max=bins - 1) + 0.5) / bins


@pytest.mark.parametrize("classes", [2, 4])
@pytest.mark.parametrize("case", ["random", "ties"])
def test_binned_auroc_auprc_against_sklearn(classes, case):
    logits, y = cases()[case]
    logits, y = logits[:, :classes], y % classes
    bins = 100
    got = run("classification", ["auroc", "auprc"], torch.tensor(logits, dtype=torch.float64),
              torch.tensor(y), size=classes)
    q = quantized(torch.tensor(logits, dtype=torch.float64).float().double().numpy(), bins)
    if classes == 2:
        want_roc = sk.roc_auc_score(y, q[:, 1])
        want_pr = sk.average_precision_score(y, q[:, 1])
    else:
        want_roc = np.mean([sk.roc_auc_score(y == c, q[:, c]) for c in range(classes)])
        want_pr = np.mean([sk.average_precision_score(y == c, q[:, c]) for c in range(classes)])
    assert got["auroc"] == pytest.approx(want_roc, rel=1e-9)
    assert got["auprc"] == pytest.approx(want_pr, rel=1e-9)
    # and the binned value is close to the exact one on the raw scores
    prob = softmax(logits)
    exact = sk.roc_auc_score(y, prob[:, 1]) if classes == 2 else np.mean(
        [sk.roc_auc_score(y == c, prob[:, c]) for c in range(classes)])
    assert abs(got["auroc"] - exact) < 0.01


def test_auroc_of_a_single_class_is_nan():
    logits, y = cases()["single_class"]
    got = run("classification", ["auroc", "auprc"], torch.tensor(logits[:, :2]),
              torch.tensor(y), size=2)
    assert math.isnan(got["auroc"]) and math.isnan(got["auprc"])


def test_ece_against_numpy():
    logits, y = cases()["random"]
    got = run("classification", [{"name": "ece", "bins": 10}], torch.tensor(logits),
              torch.tensor(y))
    prob = softmax(logits)
    conf, pred = prob.max(1), prob.argmax(1)
    b = np.minimum((conf * 10).astype(int), 9)
    ece = sum(abs((pred[b == i] == y[b == i]).sum() - conf[b == i].sum()) for i in range(10))
    assert got["ece"] == pytest.approx(ece / len(y), rel=1e-9)


def test_regression_against_sklearn():
    from scipy.stats import pearsonr

    rng = np.random.default_rng(1)
    y = rng.normal(size=401) * 3 + 10
    p = y + rng.normal(size=401)
    p[:50] = np.round(p[:50])                   # ties
    p = p.astype(np.float32).astype(np.float64)  # what a float32 model can output
    got = run("regression", ["mse", "rmse", "mae", "r2", "pearson"], torch.tensor(p),
              torch.tensor(y), size=1)
    assert got["mse"] == pytest.approx(sk.mean_squared_error(y, p), rel=1e-9)
    assert got["rmse"] == pytest.approx(sk.root_mean_squared_error(y, p), rel=1e-9)
    assert got["mae"] == pytest.approx(sk.mean_absolute_error(y, p), rel=1e-9)
    assert got["r2"] == pytest.approx(sk.r2_score(y, p), rel=1e-9)
    assert got["pearson"] == pytest.approx(pearsonr(y, p).statistic, rel=1e-9)


def test_language_modeling_against_cross_entropy():
    rng = np.random.default_rng(2)
    vocab, n, t = 11, 23, 9
    logits = torch.tensor(rng.normal(size=(n, t, vocab)), dtype=torch.float32)
    lengths = rng.integers(2, t + 1, n)
    targets = torch.tensor(rng.integers(0, vocab, (n, t)))
    for i, length in enumerate(lengths):
        targets[i, length:] = IGNORE                     # padding
    targets[0, 3] = IGNORE                               # an ignored token inside a sequence
    got = run("language_modeling", ["nll", "perplexity", "token_accuracy"], logits, targets,
              size=vocab)
    shifted_logits, shifted = logits[:, :-1].reshape(-1, vocab), targets[:, 1:].reshape(-1)
    ce = torch.nn.functional.cross_entropy(shifted_logits.double(), shifted,
                                           ignore_index=IGNORE, reduction="sum")
    tokens = int((shifted != IGNORE).sum())
    assert got["nll"] == pytest.approx(float(ce) / tokens, rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(float(ce) / tokens), rel=1e-6)
    # corpus perplexity is not the mean of per-sequence perplexities
    per_seq = []
    for i in range(n):
        m = shifted.view(n, -1)[i] != IGNORE
        ce_i = torch.nn.functional.cross_entropy(logits[i, :-1][m].double(),
                                                 shifted.view(n, -1)[i][m], reduction="mean")
        per_seq.append(math.exp(float(ce_i)))
    assert abs(np.mean(per_seq) - got["perplexity"]) > 1e-3
    hits = (shifted_logits.argmax(1) == shifted) & (shifted != IGNORE)
    assert got["token_accuracy"] == pytest.approx(int(hits.sum()) / tokens)


def test_every_registered_metric_is_tested_here():
    import inspect

    source = inspect.getsource(inspect.getmodule(test_every_registered_metric_is_tested_here))
    # The text tasks' metrics have their reference in lm-evaluation-harness, not here.
    # lm-eval tasks' metrics: lm-eval's own run (test_harness_tasks.py; a task's own
    # aggregation: test_harness_aggregations.py). A judge's: a plain transformers loop
    # (test_judge.py).
    for name in ("test_text_tasks.py", "test_harness_tasks.py", "test_harness_aggregations.py",
                 "test_judge.py"):
        with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration",
                               name)) as f:
            source += f.read()
    for task, registry in REGISTRY.items():
        for name in registry:
            assert f'"{name}"' in source, (task, name)
