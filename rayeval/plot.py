"""``rayeval leaderboard --plot FILE.png``: each metric against the training step, one line per
(sweep, data set) with its bootstrap interval as a band."""

from __future__ import annotations

import math
import os
import tempfile

from .errors import RayevalError, StoreError


def series(rows: list[dict], metrics: list[str]) -> dict[str, dict[tuple, list[tuple]]]:
    """metric -> (sweep, dataset) -> [(step, value, ci_low, ci_high)] sorted by step; rows
    without a step are left out."""
    out: dict[str, dict[tuple, list[tuple]]] = {m: {} for m in metrics}
    for r in rows:
        if r["metric"] not in out or r["step"] is None or r.get("matrix"):
            continue
        out[r["metric"]].setdefault((r["sweep"], r["dataset"]), []).append(
            (r["step"], r["value"], r.get("ci_low"), r.get("ci_high")))
    for groups in out.values():
        for points in groups.values():
            points.sort(key=lambda p: p[0])
    return out


def plot(rows: list[dict], metrics: list[str], path: str, title: str | None = None) -> int:
    """Write the PNG atomically; returns the number of points drawn."""
    try:
        import matplotlib
    except ImportError:
        raise RayevalError("--plot needs matplotlib: pip install matplotlib "
                           "(or rayeval[plot])") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(rows, metrics)
    drawn = sum(len(p) for groups in data.values() for p in groups.values())
    if not drawn:
        raise StoreError("--plot: no stored result has a training step to plot against; steps "
                         "come from checkpoint names (step_1000.pt, epoch=3-step=1000.ckpt) or "
                         "Lightning's global_step")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise RayevalError(f"--plot: folder {folder!r} does not exist; create it or choose "
                           "another path")
    n = len(metrics)
    cols = min(n, 2)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 3.8 * nrows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for (sweep, dataset), points in sorted(data[metric].items()):
            steps = [p[0] for p in points]
            values = [p[1] for p in points]
            label = sweep if len({d for _, d in data[metric]}) == 1 else f"{sweep} on {dataset}"
            line, = ax.plot(steps, values, marker="o", markersize=3, label=label)
            if all(p[2] is not None and p[3] is not None for p in points):
                ax.fill_between(steps, [p[2] for p in points], [p[3] for p in points],
                                color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(metric)
        ax.set_xlabel("training step")
        ax.grid(True, alpha=0.3)
        if data[metric]:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(prefix=".rayeval-plot-", suffix=".png", dir=folder)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=100)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)         # mkstemp makes it private
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return drawn
