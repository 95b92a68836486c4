"""``rayeval leaderboard --plot FILE`` (.png, .svg or .pdf, as the name ends): one panel per
board column (``EVAL/METRIC``, or the aggregate), each value against the training step (or, in
a panel where the checkpoints' names give epochs but no steps, against the epoch), one line
per sweep with its bootstrap interval as a band. A sweep keeps one colour in every panel."""

from __future__ import annotations

import math
import os
import tempfile

from rayeval.errors import RayevalError, StoreError
from rayeval.ranking import Board, Column

_HINT = "--plot needs matplotlib: pip install matplotlib (or pip install 'rayeval[plot]')"


class MatplotlibMissing(RayevalError):
    """``--plot`` without matplotlib."""

    def __init__(self, _message: str | None = None):
        super().__init__(_HINT)


Point = tuple       # (step or epoch, value, ci_low, ci_high)
STEP, EPOCH = "step", "epoch"
LABELS = {STEP: "training step", EPOCH: "epoch"}


def epoch_of(entry) -> int | None:
    """A checkpoint's epoch, from any of its stored rows (the aggregate row has none)."""
    return next((r["epoch"] for r in entry.rows.values() if r.get("epoch") is not None), None)


def axis_of(board: Board, column: Column) -> str:
    """What a panel's x-axis counts: steps when every point has one, else epochs when every
    point has one; when neither covers every point, steps if any point has one (as before
    epochs were stored), else epochs. Never both: a step and an epoch share no scale. The
    points without the chosen one are left out."""
    shown = [e for e in board.entries if e.value(column.name) is not None]
    if all(e.step is not None for e in shown):
        return STEP
    if all(epoch_of(e) is not None for e in shown) or all(e.step is None for e in shown):
        return EPOCH
    return STEP


def series(board: Board, columns: list[Column]) -> dict[str, dict[str, list[Point]]]:
    """column name -> sweep -> [(x, value, ci_low, ci_high)] sorted by x, where x is the step or
    the epoch as ``axis_of`` chooses for the column; checkpoints without one, and missing
    values, are left out."""
    out: dict[str, dict[str, list[Point]]] = {c.name: {} for c in columns}
    for c in columns:
        axis = axis_of(board, c)
        for e in board.entries:
            x = e.step if axis == STEP else epoch_of(e)
            v = e.value(c.name)
            if x is None or v is None:
                continue
            row = e.rows[c.name]
            out[c.name].setdefault(e.sweep, []).append(
                (x, v, row.get("ci_low"), row.get("ci_high")))
    for by_sweep in out.values():
        for points in by_sweep.values():
            points.sort(key=lambda p: p[0])
    return out


def sweep_styles(sweeps) -> dict[str, dict]:
    """One (colour, line style) per sweep, the same in every panel: matplotlib's ten cycle
    colours, then the same colours dashed, dotted, ..."""
    styles = ("-", "--", ":", "-.")
    return {s: {"color": f"C{i % 10}", "linestyle": styles[(i // 10) % len(styles)]}
            for i, s in enumerate(sorted(set(sweeps)))}


def figure(board: Board, columns: list[Column], title: str | None = None):
    """The figure (not saved): a grid of panels, the title above them (constrained layout
    keeps room for it), one legend for the figure."""
    plt = _pyplot()

    data = series(board, columns)
    styles = sweep_styles(s for by_sweep in data.values() for s in by_sweep)
    ncols = min(len(columns), 2)
    nrows = math.ceil(len(columns) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, 3.8 * nrows + 0.6),
                             squeeze=False, layout="constrained")
    for ax, column in zip(axes.flat, columns):
        for sweep, points in sorted(data[column.name].items()):
            _draw_series(ax, sweep, points, styles[sweep])
        ax.set_title(f"{column.name} ({'higher' if column.higher_is_better else 'lower'} "
                     "is better)")
        ax.set_xlabel(LABELS[axis_of(board, column)])
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(columns):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    if styles:
        handles = [plt.Line2D([], [], marker="o", markersize=3, **style)
                   for style in styles.values()]
        fig.legend(handles, list(styles), loc="outside lower center",
                   ncols=min(len(styles), 4), fontsize="small")
    return fig


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MatplotlibMissing() from None
    matplotlib.use("Agg")                 # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _draw_series(ax, sweep: str, points: list[Point], style: dict) -> None:
    steps = [p[0] for p in points]
    ax.plot(steps, [p[1] for p in points], marker="o", markersize=3, label=sweep, **style)
    if all(p[2] is not None and p[3] is not None for p in points):
        ax.fill_between(steps, [p[2] for p in points], [p[3] for p in points],
                        color=style["color"], alpha=0.2, linewidth=0)


# The formats a name may ask for: the file is what its suffix says (an .svg of PNG bytes
# shows as a blank page)
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}


def format_of(path: str) -> str:
    """The format a plot's file name asks for, by its suffix; any other is refused."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise RayevalError(f"--plot: {path!r} must end in .png, .svg or .pdf (the format it "
                           "is written in); got " + (repr(suffix) if suffix else "no suffix"))
    return FORMATS[suffix]


def plot(board: Board, columns: list[Column], path: str, title: str | None = None) -> int:
    """Write the plot atomically, as its suffix says (``format_of``: checked before anything
    else); returns the number of points drawn. Prints nothing."""
    fmt = format_of(path)
    plt = _pyplot()
    drawn = sum(len(p) for by_sweep in series(board, columns).values()
                for p in by_sweep.values())
    if not drawn:
        raise StoreError("--plot: no stored result has a training step or epoch to plot "
                         "against; they come from checkpoint names (step_1000.pt, epoch_3.pt, "
                         "epoch=3-step=1000.ckpt) or Lightning's global_step")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise RayevalError(f"--plot: folder {folder!r} does not exist; create it or choose "
                           "another path")
    fig = figure(board, columns, title)
    fd, tmp = tempfile.mkstemp(prefix=".rayeval-plot-", suffix=f".{fmt}", dir=folder)
    os.close(fd)
    try:
        fig.savefig(tmp, format=fmt, dpi=100)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)         # mkstemp makes it private
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return drawn
