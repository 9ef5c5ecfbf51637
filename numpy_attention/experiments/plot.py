"""Figures of the study (matplotlib, the optional `plot` extra, imported only here, lazily).

Each figure is a matplotlib.figure.Figure on its own Agg canvas: no pyplot, so the
caller's backend and pyplot's list of open figures are left alone (e.g. in a notebook).
"""
import os

from .._files import replacing


def _matplotlib():
    """(Figure, FigureCanvasAgg), or ImportError naming the optional extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib, the optional 'plot' extra: "
                          "pip install 'numpy-attention[plot]'") from None
    return Figure, FigureCanvasAgg


def check_path(path):
    """Raise ImportError without matplotlib, ValueError if it cannot write `path`'s format.

    The format is the file's extension (PNG without one); the file is `path` itself.
    """
    _, canvas = _matplotlib()
    extension = os.path.splitext(path)[1][1:].lower()
    formats = canvas.get_supported_filetypes()
    if extension and extension not in formats:
        raise ValueError(f"cannot write {path!r}: unknown figure format {extension!r} "
                         f"(one of {', '.join(sorted(formats))})")


def _figure(**subplots):
    """(figure, its two axes side by side) on an Agg canvas of its own."""
    figure, canvas = _matplotlib()
    fig = figure(figsize=(11, 4.2))
    canvas(fig)
    return fig, fig.subplots(1, 2, **subplots)


def _save(fig, path):
    """Save to exactly `path`, in its extension's format (PNG without one: savefig would
    append '.png' to the name instead)."""
    fig.tight_layout()
    with replacing(path, "wb") as f:                     # a failure part-way leaves `path` as it was
        fig.savefig(f, dpi=110, format=os.path.splitext(path)[1][1:].lower() or "png")


def plot_sweep(records, path):
    """||dL/dq|| and ||J||_F against d_k on log axes: scaled solid, unscaled dashed, a colour per N_k."""
    fig, axes = _figure()
    n_keys = sorted({r["n_keys"] for r in records})
    for ax, key, title in zip(axes, ("grad_norm", "jacobian_norm"),
                              ("median ||dL/dq||", "median ||diag(p) - p p^T||_F")):
        for colour, n in zip(("tab:blue", "tab:red", "tab:green", "tab:purple"), n_keys):
            for scaled, style in ((True, "-o"), (False, "--s")):
                rows = [r for r in records if r["n_keys"] == n and r["scaled"] is scaled]
                ax.plot([r["d_k"] for r in rows], [r[key] for r in rows], style, color=colour,
                        label=f"N_k={n}, {'scale 1/sqrt(d_k)' if scaled else 'unscaled'}")
        ax.set(xscale="log", yscale="log", xlabel="d_k", title=title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    _save(fig, path)


def plot_training(curves, path):
    """Held-out loss against step, one panel per scale, a line per learning rate."""
    fig, axes = _figure(sharey=True)
    for ax, scaled in zip(axes, (True, False)):
        for c in (c for c in curves if c.scaled is scaled):
            ax.plot(c.steps, c.loss, "-o", markersize=3, label=f"lr={c.lr:g}")
        ax.set(yscale="log", xlabel="step", title="scale 1/sqrt(d_k)" if scaled else "unscaled")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("held-out loss")
    _save(fig, path)
