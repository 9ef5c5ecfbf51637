"""Figures of the study (matplotlib, the optional `plot` extra, imported only here, lazily)."""


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib, the optional 'plot' extra: "
                          "pip install 'numpy-attention[plot]'") from None
    matplotlib.use("Agg")                         # files only, no display needed
    import matplotlib.pyplot as plt
    return plt


def plot_sweep(records, path):
    """||dL/dq|| and ||J||_F against d_k on log axes: scaled solid, unscaled dashed, a colour per N_k."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_training(curves, path):
    """Held-out loss against step, one panel per scale, a line per learning rate."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, scaled in zip(axes, (True, False)):
        for c in (c for c in curves if c.scaled is scaled):
            ax.plot(c.steps, c.loss, "-o", markersize=3, label=f"lr={c.lr:g}")
        ax.set(yscale="log", xlabel="step", title="scale 1/sqrt(d_k)" if scaled else "unscaled")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("held-out loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
