"""A picture of where a candidate's error lies: each judged tensor's error over its bound.

    maps = error_maps(**arrays)                 # {tensor: [H, rows] float64}: > 1 fails
    plot_error_maps("errors.png", **arrays)     # the same as a PNG, two panels per tensor

`arrays` are crosscheck's keyword arguments (verdicts.py: the .npz keys, and its settings).
crosscheck judges the case once; each tensor's judge (rule.judge) also gives here, for every
entry, its error over the bound the rule holds that entry's row to (rows along the last
axis, as in rule.py):

    r[..., h, i, c] = |X - oracle|[..., h, i, c] / bound[..., h, i]
    bound           = k * err(baseline) + atol                  the tensor's (TensorVerdict.bound)
                      and in a 16- or 8-bit precision, where the row-wise check applies, at most
                      k * max(err(row of baseline), rms(baseline - oracle)) + atol

so that some r > 1 iff the tensor fails the max-abs or the row-wise check; the normwise and
scale checks are not per entry (a tensor that fails only them is all <= 1, and its panel's
title names the check). 0 / 0 = 0; a NaN where the oracle is finite, or a wrong infinity, has
r = inf (rule.abs_errors); an lse of +inf where the oracle's is -inf has r = 0, as judge has it.

A map folds r over the batch (every axis before the head axis) and the features, by the max:
map[h, i] = max over b, c of r[b, h, i, c], the worst entry of row i of head h in any sequence:

    out, dq, out_dot   [..., H, N_q, d]        -> [H, N_q]      query rows
    dk, dv             [..., H_kv, N_k, d]     -> [H_kv, N_k]   key rows (a paged KV cache's
                                                                [pages, H_kv, page, d]: a page's slots)
    dbias              [..., H_b, N_q, N_k]    -> [H_b, N_q]    (H_b = 1 for a bias [N_q, N_k])
    lse, lse_dot       [..., H, N_q]           -> [H, N_q]      (the rule's row: a head's N_q entries)
    d(head vector)     [..., H]                -> [H, 1]        one column (options.HEAD_GRADIENTS)

What each pattern looks like: one head wrong (grouped heads mixed up, one head's dk negated)
is a line across the heads x rows panel; one row wrong (a mask) a line down it; a causal
mask off by one every query row (but the last, with one key of the future kept), fainter
down the rows, where one key more or less weighs less among a row's i + 1. The second panel
of a tensor with features is its worst head's entries, rows x features (for dbias rows x
key columns: a causal mask off by one shows its triangle one diagonal too wide or narrow).
"""
import os

import numpy as np

from .._files import replacing
from ..options import HEAD_GRADIENTS
from .verdicts import crosscheck
from .rule import abs_errors, baseline_rows, judge

DECADES = 4             # the colour scale spans ratios 10^-4 .. 10^4 (beyond: the end colours)
PANEL_HEIGHT = 2.4      # inches per tensor
DPI = 100
_AFTER_HEAD = {"lse": 1, "lse_dot": 1, "max_logits": 1,        # axes after the head's; else 2
               **{name: 0 for name in HEAD_GRADIENTS}}
_ROWS = {"dk": "key row", "dv": "key row", **{name: "one entry per head" for name in HEAD_GRADIENTS}}   # else "query row"
_HEADS = {"dk": "kv head", "dv": "kv head", "dbias": "bias head"}      # else "head"
_FEATURES = {"out": "d_v", "out_dot": "d_v", "dv": "d_v", "dq": "d_k", "dk": "d_k", "dbias": "key column"}


def entry_ratios(verdict, candidate, oracle, baseline, baseline_oracle=None, rows=False):
    """r = |candidate - oracle| / bound of each entry, float64 of the oracle's shape (module
    docstring), from judge's arguments (baseline: an array or a list) and its TensorVerdict:
    bound = verdict.bound, with rows at most verdict.k * max(err(row of baseline),
    rms(baseline - oracle)) + verdict.atol per row (rule.py's row-wise check, last axis)."""
    candidate, oracle = np.asarray(candidate), np.asarray(oracle)
    err = abs_errors(candidate, oracle)
    if verdict.name == "lse":            # judge's convention: +inf for -inf (fully masked row)
        err = np.where(np.isneginf(oracle) & np.isposinf(candidate.astype(np.float64)), 0, err)
    err = err.astype(np.float64)
    bound = np.full(err.shape[:-1] + (1,), verdict.bound)
    if rows and err.size:
        ref = oracle if baseline_oracle is None else np.asarray(baseline_oracle)
        base_errs = [abs_errors(b, ref) for b in (baseline if isinstance(baseline, list) else [baseline])]
        bound = np.minimum(bound, verdict.k * baseline_rows(base_errs)[..., None] + verdict.atol)
    bound = np.broadcast_to(bound, err.shape)
    return np.divide(err, bound, out=np.where(err > 0, np.inf, 0.0), where=bound > 0)


def crosscheck_errors(**arrays):
    """(CrosscheckReport, {tensor: entry_ratios}): crosscheck(**arrays), which judges each
    tensor once, and every entry's error over its bound, of the tensor's own shape."""
    ratios = {}

    def judge_and_keep(name, candidate, oracle, baseline, **settings):
        verdict = judge(name, candidate, oracle, baseline, **settings)
        ratios[name] = entry_ratios(verdict, candidate, oracle, baseline,
                                    settings.get("baseline_oracle"), settings.get("rows", False))
        return verdict                   # (verdicts.py judges each tensor once)

    report = crosscheck(**arrays, judge=judge_and_keep)
    return report, ratios


def head_rows(name, ratios, heads=True):
    """A tensor's entry ratios as [batch, H, rows, features] (module docstring's table): the
    axes before the head axis flattened into one, axes of length 1 where it has none. heads:
    whether the case has a head axis (out's ratios of 3 axes or more), which makes a max_logits
    of one axis one per head."""
    r = np.asarray(ratios)
    after = 0 if name == "max_logits" and r.ndim == 1 and heads else _AFTER_HEAD.get(name, 2)
    r = r.reshape(r.shape + (1,) * (2 - after))
    r = r.reshape((1,) * max(0, 3 - r.ndim) + r.shape)
    return r.reshape((-1,) + r.shape[-3:])


def error_maps(**arrays):
    """{tensor: map [H, rows] float64} for each candidate tensor of crosscheck(**arrays):
    map[h, i] = max over the batch and the features of |X - oracle| / bound (module
    docstring); > 1 where the tensor fails its max-abs or row-wise check, inf at a NaN."""
    _, ratios = crosscheck_errors(**arrays)
    return {name: _fold(head_rows(name, r, np.ndim(ratios["out"]) >= 3)) for name, r in ratios.items()}


def _fold(r):
    """The map [H, rows] of entry ratios [batch, H, rows, features]: the max over batch and features."""
    return np.max(r, axis=(0, 3), initial=0.0)


def require_matplotlib():
    """matplotlib's (Figure, FigureCanvasAgg, colormaps, colors), or ImportError in one line."""
    try:
        from matplotlib import colormaps, colors
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("matplotlib is needed for --plot (pip install matplotlib)") from None
    return Figure, FigureCanvasAgg, colormaps, colors


def plot_error_maps(path, **arrays):
    """Write `path` (a PNG) of crosscheck(**arrays)'s error maps (draw_error_maps); return path."""
    return draw_error_maps(path, *crosscheck_errors(**arrays))


def draw_error_maps(path, report, ratios):
    """Write a PNG to `path` (whatever its extension), one row of panels per tensor of the
    report; return path. ratios: crosscheck_errors' {tensor: entry ratios}.

    Colour: log10(r) from -DECADES to +DECADES, blues for r <= 1 (within the bound, darker
    the smaller), reds for r > 1 (darker the larger): the bound is where blue turns red.
    Left: the map [H, rows] (heads down, rows across), titled with the tensor's verdict
    (PASS, or FAIL and the first check it failed, rule.py). Right, for a tensor with
    features: its worst head's entries, features down and rows across, the max over the
    batch. The same arguments give the same file (Agg, no pyplot: the caller's matplotlib
    backend is left alone). ImportError without matplotlib; OSError if path cannot be written.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    names = [row.name for row in report.rows]
    if sorted(names) != sorted(ratios):
        raise ValueError(f"ratios must hold the report's tensors {names}, got {sorted(ratios)}")
    figure, canvas, colormaps, colors = require_matplotlib()
    cmap = colors.ListedColormap(np.vstack([colormaps["Blues"](np.linspace(0.9, 0.25, 128)),
                                            colormaps["Reds"](np.linspace(0.4, 1.0, 128))]))
    norm = colors.Normalize(-DECADES, DECADES)
    fig = figure(figsize=(11, 0.8 + PANEL_HEIGHT * len(names)), layout="constrained")
    canvas(fig)
    axes = fig.subplots(len(names), 2, squeeze=False)
    for (left, right), verdict in zip(axes, report.rows):
        r = head_rows(verdict.name, ratios[verdict.name], np.ndim(ratios["out"]) >= 3)
        image = _panel(left, _fold(r), cmap, norm)
        said = (f"FAIL: {verdict.failed[0]}" if not verdict.passed else
                f"PASS (max |err| / bound {float(np.max(r, initial=0.0)):.3g})")
        left.set_title(f"{verdict.name} {said}", fontsize=9, loc="left")
        left.set(xlabel=_ROWS.get(verdict.name, "query row"), ylabel=_HEADS.get(verdict.name, "head"))
        if verdict.name in _FEATURES:
            head = int(np.argmax(np.max(r, axis=(0, 2, 3))))    # the first worst head
            _panel(right, np.max(r[:, head], axis=0).T, cmap, norm)
            right.set_title(f"{verdict.name}, {_HEADS.get(verdict.name, 'head')} {head}: each entry",
                            fontsize=9, loc="left")
            right.set(xlabel=_ROWS.get(verdict.name, "query row"), ylabel=_FEATURES[verdict.name])
        else:
            right.set_axis_off()
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), extend="both", shrink=min(1.0, 4 / len(names)))
    bar.set_label("log10(|err| / bound): <= 0 passes")
    fig.suptitle(f"crosscheck {'PASS' if report else 'FAIL'}: each entry's error |candidate - oracle| over "
                 f"the bound its tensor is held to (above 1 fails), the largest over the batch", fontsize=10)
    with replacing(os.fspath(path), "wb") as f:           # a failure part-way leaves path as it was
        fig.savefig(f, format="png", dpi=DPI)
    return path


def _panel(ax, ratio_map, cmap, norm):
    """Draw a [down, across] ratio map as log10, clipped to +-DECADES; return the image. Ticks
    on whole indices only (a tick per head or feature up to 16); none across one column."""
    from matplotlib.ticker import MaxNLocator
    with np.errstate(divide="ignore"):
        shown = np.clip(np.log10(ratio_map), -DECADES, DECADES)
    image = ax.imshow(shown, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if shown.shape[0] <= 16:                              # a tick per head (or feature)
        ax.set_yticks(range(shown.shape[0]))
    if shown.shape[1] == 1:                               # one entry per head: no index across
        ax.set_xticks([])
    return image
