"""Regression metrics: outputs (rows,) predictions, targets (rows,) values."""

from __future__ import annotations

from rayeval.core.metrics.base import Metric, _ratio
from rayeval.lazy import lazy_module

torch = lazy_module("torch")        # imported on first use (rayeval.lazy)


class _Regression(Metric):
    task = "regression"
    batched_compute = True
    higher_is_better = False
    sums = ("n", "se", "ae", "y", "yy", "p", "pp", "yp")

    def init_state(self, c):
        return {k: torch.zeros((), dtype=torch.int64 if k == "n" else torch.float64)
                for k in self.sums}

    def rows(self, outputs, targets):
        p, y = outputs.to(torch.float64), targets.to(torch.float64)
        e = p - y
        every = {"n": lambda: torch.ones_like(y, dtype=torch.int64), "se": lambda: e * e,
                 "ae": lambda: e.abs(), "y": lambda: y, "yy": lambda: y * y, "p": lambda: p,
                 "pp": lambda: p * p, "yp": lambda: y * p}
        return {k: every[k]() for k in self.sums}


class MSE(_Regression):
    name = "mse"
    sums = ("n", "se")

    def compute(self, s):
        return _ratio(s["se"], s["n"])


class RMSE(MSE):
    name = "rmse"

    def compute(self, s):
        return _ratio(s["se"], s["n"]).sqrt()


class MAE(_Regression):
    name = "mae"
    sums = ("n", "ae")

    def compute(self, s):
        return _ratio(s["ae"], s["n"])


class R2(_Regression):
    name = "r2"
    higher_is_better = True
    sums = ("n", "se", "y", "yy")

    def compute(self, s):
        n = s["n"].to(torch.float64)
        total = s["yy"] - s["y"] ** 2 / n.clamp(min=1)
        return torch.where(total > 0, 1 - s["se"] / total.clamp(min=1e-300),
                           torch.full_like(total, float("nan")))


class Pearson(_Regression):
    name = "pearson"
    higher_is_better = True
    sums = ("n", "y", "yy", "p", "pp", "yp")

    def compute(self, s):
        n = s["n"].to(torch.float64)
        cov = n * s["yp"] - s["y"] * s["p"]
        var = (n * s["yy"] - s["y"] ** 2) * (n * s["pp"] - s["p"] ** 2)
        return torch.where(var > 0, cov / var.clamp(min=1e-300).sqrt(),
                           torch.full_like(cov, float("nan")))


# Registered by the package, in this order (``names()`` lists them so).
BUILT_IN = (MSE, RMSE, MAE, R2, Pearson)
