"""The pictures of a conformance run's properties: a `lengths` failure drawn as each trial's
error over its bound against N_k, so that a fault at a block boundary, or at one length, shows
as the points off the rest (matplotlib, the optional `plot` extra, imported when it draws).

    draw_lengths(path, results)    results: the lengths trials' PropertyResults of one dtype

One line of points for N_q = N_k and one for decoding's N_q = 1; y on a log scale with the
bound at 1 (above: the trial failed); the multiples of 16 marked. A trial that raised or could
not be judged has no point.
"""
import math

from ..oracle.errormap import require_matplotlib

BLOCK = 16                  # the multiples marked: the lengths property's step


def draw_lengths(path, results):
    """Write the PNG to `path`; return path. ImportError without matplotlib; OSError if the
    file cannot be written."""
    figure, canvas, _, _ = require_matplotlib()
    fig = figure(figsize=(9, 3.5), layout="constrained")
    canvas(fig)
    axes = fig.subplots()
    top = max((r.trial.case.n_k for r in results), default=BLOCK)
    for n in range(BLOCK, top + 1, BLOCK):
        axes.axvline(n, color="0.9", linewidth=0.8, zorder=0)
    for label, marker, decoding in (("N_q = N_k", "o", False), ("N_q = 1", "x", True)):
        points = sorted((r.trial.case.n_k, r.worst) for r in results
                        if (r.trial.case.n_q == 1) == decoding and math.isfinite(r.worst) and r.worst > 0)
        axes.plot([n for n, _ in points], [w for _, w in points], marker, label=label, markersize=4)
    axes.axhline(1.0, color="tab:red", linewidth=1)
    axes.set_yscale("log")
    axes.set_xlabel("N_k (grey: multiples of 16)")
    axes.set_ylabel("max abs error / bound")
    dtype = results[0].trial.dtype if results else ""
    axes.set_title(f"lengths, {dtype}: each trial's worst tensor (above the red line: failed)")
    axes.legend(loc="upper left")
    fig.savefig(path, dpi=100)
    return path
