"""What the plugin adds:

    example_ranking  a task: rows of class indices scored by logits of shape (rows, classes),
                     like classification, where what matters is how high the true class ranks
    example_mrr      its metric: mean reciprocal rank of the true class, the rank counting
                     every class scored at least as high (ties rank against the model)
    example_hinge    a metric for the built-in classification task: the mean multiclass hinge
                     loss (Crammer-Singer), max(0, 1 + best other logit - true logit)

Each metric keeps additive states (a float64 sum and an int64 count) with ``rows`` giving
every row's contribution: rayeval sums them over the workers and over bootstrap replicates.
"""

import torch

from rayeval.core import metrics
from rayeval.core.tasks import TASKS
from rayeval.core.tasks.base import Classification


@TASKS.register(instance=True)
class Ranking(Classification):
    """Classification's data and model checks; only its metrics differ."""
    name = "example_ranking"


class _RowMean(metrics.Metric):
    """The mean of one float64 value per row (``per_row``)."""
    batched_compute = True        # compute also takes states with a leading replicate axis

    def init_state(self, num_classes):
        return {"sum": torch.zeros((), dtype=torch.float64),
                "rows": torch.zeros((), dtype=torch.int64)}

    def rows(self, outputs, targets):
        return {"sum": self.per_row(outputs.to(torch.float64), targets),
                "rows": torch.ones_like(targets, dtype=torch.int64)}

    def compute(self, state):
        rows = state["rows"].to(torch.float64)
        return torch.where(rows > 0, state["sum"] / rows.clamp(min=1), float("nan"))


@metrics.register
class MeanReciprocalRank(_RowMean):
    name = "example_mrr"
    task = "example_ranking"

    @staticmethod
    def per_row(outputs, targets):
        true = outputs.gather(1, targets.view(-1, 1))
        return 1.0 / (outputs >= true).sum(dim=1).to(torch.float64)


@metrics.register
class Hinge(_RowMean):
    name = "example_hinge"
    task = "classification"
    higher_is_better = False

    @staticmethod
    def per_row(outputs, targets):
        true = outputs.gather(1, targets.view(-1, 1)).squeeze(1)
        others = outputs.scatter(1, targets.view(-1, 1), float("-inf")).max(dim=1).values
        return (1.0 + others - true).clamp(min=0.0)
