"""The pictures of a conformance run's properties (matplotlib, the optional `plot` extra,
imported when it draws), each a failing property's errors over their bounds, y on a log scale
with the bound at 1 (above: failed):

    draw_lengths(path, results)    a dtype's lengths trials against N_k: one line of points for
                                   N_q = N_k, one for decoding's N_q = 1, the multiples of 16
                                   marked, so that a fault at a block boundary or at one length
                                   stands out from the rest (a trial not judged: no point)
    draw_batch(path, result)       a batch_invariance trial's sequences, each judged alone: a
                                   bar a batch entry, so the entries a batch leaks into show
    pictures(results)              what to draw of a run's results: (property, dtype, draw, what)
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


def draw_batch(path, result):
    """Write the PNG of the trial's by_entry to `path`; return path (errors as draw_lengths')."""
    figure, canvas, _, _ = require_matplotlib()
    fig = figure(figsize=(6, 3.5), layout="constrained")
    canvas(fig)
    axes = fig.subplots()
    ratios = [r if math.isfinite(r) and r > 0 else math.nan for r in result.by_entry]
    axes.bar(range(len(ratios)), ratios, color=["tab:red" if r > 1 else "tab:blue" for r in ratios])
    axes.axhline(1.0, color="tab:red", linewidth=1)
    axes.set_yscale("log")
    axes.set_xticks(range(len(ratios)))
    axes.set_xlabel("sequence (batch entry)")
    axes.set_ylabel("max abs error / bound")
    axes.set_title(f"batch_invariance, {result.trial.dtype}: each sequence judged alone\n{result.trial.case.id}",
                   fontsize=9)
    fig.savefig(path, dpi=100)
    return path


def pictures(results):
    """[(property, dtype, draw, what to draw)] for a run's PropertyResults: each dtype whose
    lengths trials failed (all of them, drawn together), and each dtype's first failing
    batch_invariance trial that was judged sequence by sequence."""
    failing = lambda name: [r for r in results if r.trial.property == name and r.status == "FAIL"]
    drawn = [("lengths", dtype, draw_lengths, [r for r in results if (r.trial.property, r.trial.dtype) ==
                                               ("lengths", dtype)])
             for dtype in dict.fromkeys(r.trial.dtype for r in failing("lengths"))]
    batch = {}
    for r in failing("batch_invariance"):
        if r.by_entry and r.trial.dtype not in batch:
            batch[r.trial.dtype] = r
    return drawn + [("batch_invariance", dtype, draw_batch, r) for dtype, r in batch.items()]
