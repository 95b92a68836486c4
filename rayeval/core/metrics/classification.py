"""Classification metrics: outputs (rows, classes) logits, targets (rows,) class indices."""

from __future__ import annotations

from rayeval.core.metrics.base import Indexed, Metric, _Hits, _ratio
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


class _Classification(Metric):
    task = "classification"
    batched_compute = True


class Accuracy(_Hits, _Classification):
    name = "accuracy"

    @staticmethod
    def hits(outputs, targets):
        return outputs.argmax(dim=1) == targets


class TopKAccuracy(Accuracy):
    name = "top_k_accuracy"
    params = {"k": (int, 5)}

    @property
    def key(self):
        return f"top{self.k}_accuracy"

    def hits(self, outputs, targets):
        k = min(self.k, outputs.shape[1])
        return (outputs.topk(k, dim=1).indices == targets.view(-1, 1)).any(dim=1)


class _RowMean(_Classification):
    """The mean over rows of one float value per row (``per_row``)."""
    higher_is_better = False

    def init_state(self, c):
        return {"sum": torch.zeros((), dtype=torch.float64),
                "total": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        return {"sum": self.per_row(outputs, targets),
                "total": torch.ones_like(targets, dtype=torch.int64)}

    def compute(self, s):
        return _ratio(s["sum"], s["total"])


class NLL(_RowMean):
    """Mean negative log-likelihood of the target class (log-softmax of logits, float64)."""
    name = "nll"

    @staticmethod
    def per_row(outputs, targets):
        logp = torch.log_softmax(outputs.to(torch.float64), dim=1)
        return -logp.gather(1, targets.view(-1, 1)).squeeze(1)


class _PerClass(_Classification):
    """Per-class true positives, predictions and support: enough for precision, recall, F1 and
    balanced accuracy under every averaging."""
    average = "macro"
    score = "f1"

    def init_state(self, c):
        return {k: torch.zeros(c, dtype=torch.int64) for k in ("tp", "pred", "support")}

    def rows(self, outputs, targets):
        pred = outputs.argmax(dim=1)
        return {"tp": Indexed(targets, (pred == targets).to(torch.int64)),
                "pred": Indexed(pred), "support": Indexed(targets)}

    def compute(self, s):
        tp, pred, sup = (s[k].to(torch.float64) for k in ("tp", "pred", "support"))
        if self.average == "micro":
            tp, pred, sup = tp.sum(-1), pred.sum(-1), sup.sum(-1)
        zero = torch.zeros_like(tp)
        precision = torch.where(pred > 0, tp / pred.clamp(min=1), zero)
        recall = torch.where(sup > 0, tp / sup.clamp(min=1), zero)
        f1 = torch.where(pred + sup > 0, 2 * tp / (pred + sup).clamp(min=1), zero)
        value = {"precision": precision, "recall": recall, "f1": f1}[self.score]
        if self.average == "micro":
            return torch.where(sup > 0, value, torch.full_like(value, float("nan")))
        if self.average == "weighted":
            return _ratio((value * sup).sum(-1), sup.sum(-1))
        present = ((pred + sup) > 0).to(torch.float64)        # scikit-learn's label set
        return _ratio((value * present).sum(-1), present.sum(-1))


def _per_class(score: str, average: str) -> type[_PerClass]:
    return type(f"{average.title()}{score.title()}", (_PerClass,),
                {"name": f"{average}_{score}", "average": average, "score": score})


class BalancedAccuracy(_PerClass):
    """Mean recall over the classes that occur in the targets."""
    name = "balanced_accuracy"

    def compute(self, s):
        tp, sup = s["tp"].to(torch.float64), s["support"].to(torch.float64)
        present = (sup > 0).to(torch.float64)
        recall = torch.where(sup > 0, tp / sup.clamp(min=1), torch.zeros_like(tp))
        return _ratio((recall * present).sum(-1), present.sum(-1))


class ConfusionMatrix(_Classification):
    """Counts[target, prediction]; stored with the results, shown by ``rayeval confusion``."""
    name = "confusion_matrix"
    scalar = False

    def init_state(self, c):
        return {"counts": torch.zeros((c, c), dtype=torch.int64)}

    def rows(self, outputs, targets):
        c = outputs.shape[1]
        return {"counts": Indexed(targets * c + outputs.argmax(dim=1))}

    def compute(self, s):
        return s["counts"]


class ECE(_Classification):
    """Expected calibration error of the top-class confidence over equal-width bins."""
    name = "ece"
    higher_is_better = False
    params = {"bins": (int, 15)}

    def init_state(self, c):
        return {"count": torch.zeros(self.bins, dtype=torch.int64),
                "correct": torch.zeros(self.bins, dtype=torch.int64),
                "confidence": torch.zeros(self.bins, dtype=torch.float64)}

    def rows(self, outputs, targets):
        prob = torch.softmax(outputs.to(torch.float64), dim=1)
        conf, pred = prob.max(dim=1)
        b = (conf * self.bins).floor().clamp(max=self.bins - 1).to(torch.int64)
        return {"count": Indexed(b), "correct": Indexed(b, (pred == targets).to(torch.int64)),
                "confidence": Indexed(b, conf)}

    def compute(self, s):
        n = s["count"].to(torch.float64)
        gap = (s["correct"].to(torch.float64) - s["confidence"]).abs()
        return _ratio(gap.sum(-1), n.sum(-1))


class Brier(_RowMean):
    """Mean over rows of sum over classes of (probability - one-hot target)**2."""
    name = "brier"

    @staticmethod
    def per_row(outputs, targets):
        prob = torch.softmax(outputs.to(torch.float64), dim=1)
        onehot = torch.nn.functional.one_hot(targets, prob.shape[1]).to(torch.float64)
        return ((prob - onehot) ** 2).sum(dim=1)


class _Binned(_Classification):
    """Histograms of each class's predicted probability, for positives and negatives: binned
    AUROC and AUPRC. Two classes: the positive class is 1. More: one-vs-rest, macro-averaged
    over the classes that have both positives and negatives."""
    params = {"bins": (int, 100)}

    def init_state(self, c):
        return {"pos": torch.zeros((c, self.bins), dtype=torch.int64),
                "neg": torch.zeros((c, self.bins), dtype=torch.int64)}

    def rows(self, outputs, targets):
        prob = torch.softmax(outputs.to(torch.float64), dim=1)
        c = prob.shape[1]
        b = (prob * self.bins).floor().clamp(max=self.bins - 1).to(torch.int64)
        index = torch.arange(c, device=b.device).view(1, -1) * self.bins + b
        positive = torch.nn.functional.one_hot(targets, c).to(torch.int64)
        return {"pos": Indexed(index, positive), "neg": Indexed(index, 1 - positive)}

    def compute(self, s):
        pos, neg = s["pos"].to(torch.float64), s["neg"].to(torch.float64)
        if pos.shape[-2] == 2:
            pos, neg = pos[..., 1:, :], neg[..., 1:, :]
        per_class = self._score(pos.flip(-1), neg.flip(-1))   # bins from high score to low
        valid = (pos.sum(-1) > 0) & (neg.sum(-1) > 0)
        per_class = torch.where(valid, per_class, torch.zeros_like(per_class))
        return _ratio(per_class.sum(-1), valid.to(torch.float64).sum(-1))


class AUROC(_Binned):
    name = "auroc"

    @staticmethod
    def _score(pos, neg):
        # Ties within a bin count one half: the Mann-Whitney statistic on binned scores.
        neg_below = neg.sum(-1, keepdim=True) - neg.cumsum(-1)
        pairs = (pos * (neg_below + 0.5 * neg)).sum(-1)
        return pairs / (pos.sum(-1) * neg.sum(-1)).clamp(min=1)


class AUPRC(_Binned):
    """Average precision (scikit-learn's step-wise definition) on binned scores."""
    name = "auprc"

    @staticmethod
    def _score(pos, neg):
        tp, fp = pos.cumsum(-1), neg.cumsum(-1)
        precision = tp / (tp + fp).clamp(min=1)
        return (pos * precision).sum(-1) / pos.sum(-1).clamp(min=1)


# The per-class scores under each averaging, generated: macro_f1, micro_precision, ...
PER_CLASS = [_per_class(_score, _average)
             for _score in ("precision", "recall", "f1")
             for _average in ("macro", "micro", "weighted")]

# Registered by the package, in this order (``names()`` lists them so).
BUILT_IN = (Accuracy, TopKAccuracy, NLL, BalancedAccuracy, ConfusionMatrix, ECE, Brier, AUROC,
            AUPRC, *PER_CLASS)
