"""A large case cut into slices for a Dask cluster, one per (batch index, kv head).

The baselines (naive.py, recipe.py) compute every (batch index, kv head) on its own: its G
query heads meet only its k and v, and dk, dv sum over those heads' rows alone. So a slice is
a case of its own, with q, dout [1, .., G, N_q, d] and k, v [1, .., 1, N_k, d] of one batch
index and kv head and its options cut to match (an axis an option broadcasts along stays
whole; top-k lists [..., H_kv or H, N_q, K] to its kv head's or its query heads'): its results
are the whole case's there, bitwise, and put back together they are the whole case's. An
option with a gradient (SUMMED: a bias, a gate, the per-head vectors of options.HEAD_ROWS)
broadcast along the batch or the heads has its gradient summed over them: a case with
gradients and such an option stays whole, one slice (without gradients it is cut like any
other).

    slices = case_slices(case)                       # [(at, case of the slice)]
    whole = put_together(case, [at for at, _ in slices], [results of each slice])
"""
import numpy as np

from .._layout import cut, kv_index, kv_slices, spans_slices, with_head_axis
from ..options import OPTIONS

SUMMED = tuple(row.name for row in OPTIONS if row.gradient)   # their gradients sum where they broadcast
BY_SCORE = tuple(row.name for row in OPTIONS if row.shape in ("scores", "output"))   # to [..., H, N_q, X]
WHOLE_AXES = tuple(row.gradient for row in OPTIONS if row.gradient and row.name in BY_SCORE)   # their gradients
BY_HEAD = {row.name: row.batched for row in OPTIONS if row.shape == "heads"}   # to [H] or [..., H]


def case_slices(case):
    """[(at, the case of slice at)]: at an index prefix into the scores [..., H, N_q, N_k] (one
    slice per leading axis and the G query heads of one kv head), or [((Ellipsis,), case)]
    (also for a case with a score_mod or mask_mod: they see the whole case's indices)."""
    q = case.inputs["q"]
    if q.ndim < 3:                                   # one head, no leading axes: nothing to cut
        return [((Ellipsis,), case)]
    if any(case.options.get(name) is not None for name in ("score_mod", "mask_mod")):
        return [((Ellipsis,), case)]                 # the mods index the whole case's b and h
    k = with_head_axis(case.inputs["k"])
    score_shape = q.shape[:-1] + k.shape[-2:-1]
    group = q.shape[-3] // k.shape[-3]
    heads = len(score_shape) - 2                     # the leading axes and H
    summed = "dout" in case.inputs and any(                      # a gradient sums over slices
        spans_slices(case.options[name], len(score_shape) if name in BY_SCORE else heads, score_shape)
        for name in SUMMED if case.options.get(name) is not None)
    cut = []
    for at in kv_slices(score_shape, group, whole=summed):
        kv = kv_index(at, group)
        inputs = {name: x[kv if name in ("k", "v", "k_dot", "v_dot") else at] for name, x in case.inputs.items()}
        options = {name: _cut_option(name, x, at, len(score_shape)) for name, x in case.options.items()}
        if "topk_indices" in options:                # a list per kv head (for its queries) or per query head
            lists = case.options["topk_indices"]
            options["topk_indices"] = lists[kv if lists.shape[-3] == k.shape[-3] else at]
        out = {"out": case.candidates["out"][at]} if "out" in case.candidates else {}   # the kernel's,
        cut.append((at, case._replace(inputs=inputs, options=options, candidates=out)))  # for D
    return cut


def put_together(case, ats, results):
    """The whole case's result dict from each slice's (results[i] the dict of slice ats[i])."""
    q, k, v = (case.inputs[name] for name in ("q", "k", "v"))
    if ats == [(Ellipsis,)]:
        return results[0]
    group = q.shape[-3] // k.shape[-3]
    heads = q.ndim - 2
    shapes = {"out": q.shape[:-1] + v.shape[-1:], "lse": q.shape[:-1], "max_logits": q.shape[:-1], "dq": q.shape,
              "dk": k.shape, "dv": v.shape}
    shapes.update({f"d{name}": np.shape(case.options[name]) for name in SUMMED
                   if case.options.get(name) is not None})
    whole = {}
    for name, first in results[0].items():
        whole[name] = np.empty(shapes[name], first.dtype)
        for at, result in zip(ats, results):
            if name in ("dk", "dv"):
                whole[name][kv_index(at, group)] = result[name]
            elif name in ("out", "lse", "max_logits", "dq"):
                whole[name][at] = result[name]
            else:                                    # dbias [.. scores], dgate [.. out], a head vector's [.., H]
                cut(whole[name], at, q.ndim if name in WHOLE_AXES else heads)[...] = result[name]
    return whole


def _cut_option(name, x, at, ndim):
    """The case's option `name` for the slice at (scores of ndim axes): mask, bias, dropout
    cut along the scores' axes, a gate along out's, the per-head vectors (options.HEAD_ROWS) along
    [..., H] (one that is [H] alone, as a sink logit per head, to the slice's heads), topk_length
    [..., N_q] to its leading indices."""
    if x is None or at == (Ellipsis,):
        return x
    if name in BY_HEAD and not BY_HEAD[name]:        # [H] alone: the slice's heads
        return np.asarray(x)[at[-1]]
    if name == "topk_length":                        # [..., N_q]: the slice's leading indices
        return x[at[:-1]]
    if name in BY_SCORE or name in BY_HEAD:
        return cut(x, at, ndim if name in BY_SCORE else ndim - 2)
    return x
