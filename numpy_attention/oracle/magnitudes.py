"""The largest sum of absolute terms behind an entry of each tensor: what crosscheck's atol
scales with (rule.py: atol = ATOL_ULPS * eps(dtype) * |X|max).

Rounding error is relative to the terms, not to the result: a gradient entry that cancels
to 0 still rounds at the size of its terms. The products inside a term are sums of terms
too, bounded by Cauchy-Schwarz with the rows' lengths:

    dq   the terms of entry (i, c): scale * sum_j P_ij (|dP_ij| + |D_i| + ||dout_i|| (||v_j||
         + ||out_i||)) |k_jc|, the last two the terms of dP_ij = dout_i . v_j and of
         D_i = dout_i . out_i (one key: dP - D cancels to exactly 0, and rounds at their size);
         dk likewise down the columns, and dbias, dalibi_slopes from the same terms
    lse  the largest |S|, plus the terms of a score, scale sum_c |q_ic k_jc| <= scale
         ||q_i|| ||k_j|| (the longest rows: decoding's one key nearly orthogonal to q gives
         lse = S = 0.001, rounded at the size of q and k), plus log N_k

Every weight is exp of an argument that is a difference of terms, P_ij = exp(S_ij - lse_i)
(the forward's S_ij - m_i, the backward's recomputation from lse, in base 2 or e): it rounds
at their size, so P_ij is off by a relative EXPONENT_ULPS * eps (|S_ij| + |lse_i|) in any
kernel, however exact its sums. Each P_ij in the terms above counts with that weight too,
P_ij (1 + EXPONENT_ULPS / ATOL_ULPS (|S_ij| + |lse_i|)). It matters where the scores are
large (ALiBi's -slope |i - j| near -1000) and a row sees one key: the baseline's lse is then
S exactly and its P exactly 1, while a kernel's lse, computed in base 2 or from a scale
rounded apart, is off by eps |S|, and so is every weight it recomputes from it.

A per-head vector's gradient (dsinks, dalibi_slopes) sums over every row of its head, and
over the batch where the vector is broadcast along it (sinks [H]), or for ALiBi slopes [B, H]
of packed sequences over the rows of its sequence alone; so do its terms.
"""
import numpy as np

from .._layout import bias_block, unbroadcast, with_head_axis
from ..scores import slopes_sum
from .rule import ATOL_ULPS

EXPONENT_ULPS = 1           # the rounding of a weight's argument S - lse, in ulps of its terms


def term_magnitudes(stage_blocks, inputs, options):
    """{tensor: the largest sum of |terms| behind one of its entries}, from the oracle's stages.

    stage_blocks: (index, stages) for blocks of query rows of the scores (index as in
    blocks.py), stages the block's S, P, P~ [..., H, b, N_k], optionally lse [..., H, b] (with
    gradients also dP [..., H, b, N_k] and D [..., H, b]) in float64. Sums along a row (out, dq) are maxed
    over the blocks, sums down a column (dv, dk, dbias) added up. NaN weights (the 'nan'
    policy's fully masked rows) are terms of 0.
    """
    return magnitudes_of(term_sums(stage_blocks, inputs, options), inputs, options)


def term_sums(stage_blocks, inputs, options):
    """The largest sums of the terms' weights (P, |dS|'s terms) along each tensor's rows or
    columns, before they are scaled by the inputs' largest entries (magnitudes_of). The case
    cut in (batch index, kv head) slices (slices.py) gives the whole case's: the largest of
    its slices' (max_sums)."""
    q, k = (np.abs(inputs[name]).astype(np.float64) for name in ("q", "k"))
    h_kv = with_head_axis(k).shape[-3]
    groups = with_head_axis(q).shape[-3] // h_kv
    v_lengths = np.repeat(_lengths(with_head_axis(inputs["v"]))[..., None, :], groups, axis=-3)
    dout_lengths = _lengths(with_head_axis(inputs["dout"])) if "dout" in inputs else None
    row_max = {"out": 0.0, "lse": 0.0, "dq": 0.0}       # the largest sum along a row
    col_sum = {"dv": 0.0, "dk": 0.0}                    # [..., H, N_k] sums down the columns
    dbias = np.zeros(np.shape(options["bias"])) if "bias" in options else None
    head_sums = {"dsinks": 0.0}                        # [..., H] sums over rows
    slope_rows = np.zeros(with_head_axis(q).shape[:-1])   # [..., H, N_q] each row's ALiBi terms
    reach = q.shape[-2] + k.shape[-2]                  # ALiBi's distances are below N_q + N_k
    for index, stages in stage_blocks:
        kept = stages["S"]
        weight = 1 + EXPONENT_ULPS / ATOL_ULPS * _exponent_terms(kept, stages.get("lse"))
        p_drop = np.nan_to_num(stages["P~"])
        rounded = p_drop * weight                               # each weight with its own rounding
        row_max["out"] = max(row_max["out"], np.sum(rounded, -1).max(initial=0))
        row_max["lse"] = max(row_max["lse"], np.abs(kept[np.isfinite(kept)]).max(initial=0))
        if "dP" not in stages:
            continue
        # dP_ij = dout_i . v_j and D_i = dout_i . out_i are sums of terms too: at most
        # ||dout_i|| ||v_j|| and ||dout_i|| ||out_i||, ||out_i|| <= sum_j P~_ij ||v_j||
        out_lengths = np.sum(p_drop * v_lengths, -1, keepdims=True)
        dots = dout_lengths[index[:-1]][..., None] * (v_lengths + out_lengths)
        terms = np.nan_to_num(stages["P"] * ((np.abs(stages["dP"]) + np.abs(stages["D"])[..., None]) * weight
                                             + dots))
        row_max["dq"] = max(row_max["dq"], np.sum(terms, -1).max(initial=0))    # |dS|'s terms
        col_sum = {"dv": col_sum["dv"] + np.sum(rounded, -2),
                   "dk": col_sum["dk"] + np.sum(terms, -2)}
        p_sink = np.clip(1 - np.sum(np.nan_to_num(stages["P"]), -1), 0, None)      # a sink's weight
        head_sums = {"dsinks": head_sums["dsinks"] + np.sum(p_sink * np.abs(stages["D"]), -1)}
        slope_rows[index[:-1]] = reach * np.sum(terms, -1)
        if dbias is not None:
            block = bias_block(dbias, index)
            block += unbroadcast(terms, block.shape)
    sums = {**row_max, "dv": _kv_column_max(col_sum["dv"], h_kv), "dk": _kv_column_max(col_sum["dk"], h_kv)}
    if dbias is not None:
        sums["dbias"] = float(dbias.max(initial=0))
    for name, total in head_sums.items():          # [..., H]: summed where the option broadcasts
        if name[1:] in options:                     # (sinks [H] over the batch), like its gradient
            total = unbroadcast(total, np.shape(options[name[1:]])) if np.ndim(total) else total
            sums[name] = float(np.max(total, initial=0))
    if "alibi_slopes" in options:                   # each slope's rows: its head's, or its sequence's
        slope_sums = slopes_sum(slope_rows, options["alibi_slopes"], options.get("cu_seqlens_q"))
        sums["dalibi_slopes"] = float(np.max(slope_sums, initial=0))
    return sums


def max_sums(slices_sums):
    """The whole case's term_sums from its slices' (a list of dicts): the largest of each."""
    return {name: max(sums[name] for sums in slices_sums) for name in slices_sums[0]}


def magnitudes_of(sums, inputs, options):
    """{tensor: the largest sum of |terms|}: term_sums times the inputs' largest entries."""
    q, k, v = (np.abs(inputs[name]).astype(np.float64) for name in ("q", "k", "v"))
    scale = options.get("scale", 1 / np.sqrt(q.shape[-1]))
    longest = lambda x: _lengths(x).max(initial=0)
    lse = sums["lse"] + scale * longest(q) * longest(k) + np.log(max(k.shape[-2], 1))
    mags = {"out": sums["out"] * v.max(initial=0), "lse": lse}
    if "dout" in inputs:
        mags.update(dv=sums["dv"] * np.abs(inputs["dout"]).max(initial=0),
                    dq=scale * sums["dq"] * k.max(initial=0),
                    dk=scale * sums["dk"] * q.max(initial=0))
        mags.update({name: sums[name] for name in ("dbias", "dsinks", "dalibi_slopes") if name in sums})
    return mags


def _exponent_terms(scores, lse):
    """|S_ij| + |lse_i| [..., b, N_k], the terms of a weight's argument (0 where a score is
    masked or an lse is not finite); |S| alone without lse."""
    terms = np.where(np.isfinite(scores), np.abs(scores), 0)
    if lse is not None:
        terms = terms + np.where(np.isfinite(lse), np.abs(lse), 0)[..., None]
    return terms


def _lengths(x):
    """The length ||x_i||_2 of each row of x (the last axis), in float64."""
    return np.sqrt(np.sum(np.square(np.asarray(x, np.float64)), axis=-1))


def _kv_column_max(col_sum, h_kv):
    """The largest sum down a column of a kv head's G query heads: col_sum [..., H, N_k] summed
    to [..., H_kv, N_k], then its max (0 when no block had terms: col_sum is 0)."""
    if np.ndim(col_sum) == 0 or col_sum.size == 0:                   # no block, or no key
        return 0.0
    return col_sum.reshape(col_sum.shape[:-2] + (h_kv, -1) + col_sum.shape[-1:]).sum(-2).max(initial=0)


def whole_stages(truth):
    """The oracle's stages as one block of all rows (for term_magnitudes), as [..., H, N_q, N_k]."""
    shape = with_head_axis(truth["S"]).shape
    stages = {name: truth[name].reshape(shape[:-1] if name in ("D", "lse") else shape).astype(np.float64)
              for name in ("S", "P", "P~", "dP", "D", "lse") if name in truth}
    return [((Ellipsis, slice(None), slice(None)), stages)]
