"""A custom metric for the example: the mean probability the model gives the true class.

rayeval needs three methods. States are tensors that merge by addition across workers
(integer dtypes for counts, float64 for sums); compute() sees the sum over every worker.
"""

import torch


class TargetProbability:
    name = "target_probability"        # the name results are stored under
    higher_is_better = True

    def init_state(self, num_classes):
        return {"sum": torch.zeros((), dtype=torch.float64),
                "rows": torch.zeros((), dtype=torch.int64)}

    def update(self, state, outputs, targets):
        """Add one batch: outputs are logits (rows, classes), targets class indices (rows,)."""
        p = torch.softmax(outputs.double(), dim=1).gather(1, targets.view(-1, 1))
        state["sum"] += p.sum()
        state["rows"] += targets.numel()

    def compute(self, state):
        rows = int(state["rows"])
        return float(state["sum"]) / rows if rows else float("nan")


class TargetProbabilityRows(TargetProbability):
    """The same metric with the optional rows() method: each row's contribution to each state.
    With it rayeval sums float states exactly (identical for any number of workers) and
    computes bootstrap replicates without calling update() once per row bucket."""

    name = "target_probability_rows"

    def rows(self, outputs, targets):
        p = torch.softmax(outputs.double(), dim=1).gather(1, targets.view(-1, 1)).squeeze(1)
        return {"sum": p, "rows": torch.ones_like(targets)}
