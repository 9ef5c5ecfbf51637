"""The largest sum of absolute terms behind an entry of each tensor: what crosscheck's atol
scales with (rule.py: atol = ATOL_ULPS * eps(dtype) * |X|max).

Rounding error is relative to the terms, not to the result: a gradient entry that cancels
to 0 still rounds at the size of its terms. The products inside a term are sums of terms
too, bounded by Cauchy-Schwarz with the rows' lengths:

    dq   the terms of entry (i, c): scale * sum_j P_ij (|dP_ij| + |D_i| + ||dout_i|| (||v_j||
         + ||out_i||)) |k_jc|, the last two the terms of dP_ij = dout_i . v_j and of
         D_i = dout_i . out_i (one key: dP - D cancels to exactly 0, and rounds at their size);
         dk likewise down the columns, and dbias and the slopes' from the same terms
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

A per-head vector's gradient (options.HEAD_ROWS) sums over every row of its head, and over
the batch where the vector is broadcast along it ([H]), or for a [B, H] one of packed
sequences over the rows of its sequence alone; so do its terms, each row's by its table row's
`term` (TERMS): 'distance' dS times a distance below N_q + N_k (ALiBi's slopes), 'weight' the
logit's weight times D, P_sink D = (1 - rowsum(P)) D (a sink).
"""
import numpy as np

from .._layout import bias_block, unbroadcast, with_head_axis
from ..options import GRADIENTS, HEAD_ROWS
from ..scores import slopes_sum
from .rule import ATOL_ULPS

EXPONENT_ULPS = 1           # the rounding of a weight's argument S - lse, in ulps of its terms
TERMS = ("distance", "weight")   # the per-head vectors' bounds (options.Option.term)


def term_magnitudes(stage_blocks, inputs, options):
    """{tensor: the largest sum of |terms| behind one of its entries}, from the oracle's stages.

    stage_blocks: (index, stages) for blocks of query rows of the scores (index as in
    row_blocks.py), stages the block's S, P, P~ [..., H, b, N_k], optionally lse [..., H, b] (with
    gradients also dP [..., H, b, N_k] and D [..., H, b]) in float64. Sums along a row (out, dq) are maxed
    over the blocks, sums down a column (dv, dk, dbias) added up. NaN weights (the 'nan'
    policy's fully masked rows) are terms of 0.
    """
    return magnitudes_of(term_sums(stage_blocks, inputs, options), inputs, options)


def term_sums(stage_blocks, inputs, options):
    """The largest sums of the terms' weights (P, |dS|'s terms) along each tensor's rows or
    columns, before they are scaled by the inputs' largest entries (magnitudes_of). The case
    cut in (batch index, kv head) slices (slices.py) gives the whole case's: the largest of
    its slices' (max_sums).

    Each weight's rounding is w_ij = 1 + c (|S_ij| + |lse_i|) = u_i + c |S_ij| (c =
    EXPONENT_ULPS / ATOL_ULPS), and with Y = P |dP| and o_i = (P~ ||v||)_i >= ||out_i|| the
    sums are row sums and matrix-vector products (a matrix of terms only for dbias):
        out  sum_j P~_ij w_ij = u_i rowsum(P~)_i + c rowsum(P~ |S|)_i
        dv   sum_i P~_ij w_ij = (P~^T u)_j + c colsum(P~ |S|)_j
        dq   sum_j P_ij ((|dP_ij| + |D_i|) w_ij + ||dout_i|| (||v_j|| + o_i))
             = u_i rowsum(Y)_i + c rowsum(Y |S|)_i + |D_i| (u_i rowsum(P)_i + c rowsum(P |S|)_i)
               + ||dout_i|| ((P ||v||)_i + o_i rowsum(P)_i)
        dk   the same terms down a column j: (Y^T u)_j + c colsum(Y |S|)_j
             + (P^T (|D| u + ||dout|| o))_j + ||v_j|| (P^T ||dout||)_j + c ((P |S|)^T |D|)_j
    """
    h_kv = with_head_axis(inputs["k"]).shape[-3]
    groups = with_head_axis(inputs["q"]).shape[-3] // h_kv
    v_lengths = np.repeat(_lengths(with_head_axis(inputs["v"])), groups, axis=-2)   # [..., H, N_k]
    dout_lengths = _lengths(with_head_axis(inputs["dout"])) if "dout" in inputs else None
    row_max = {"out": 0.0, "lse": 0.0, "dq": 0.0}       # the largest sum along a row
    col_sum = {"dv": 0.0, "dk": 0.0}                    # [..., H, N_k] sums down the columns
    dbias = np.zeros(np.shape(options["bias"])) if "bias" in options else None
    head_rows = {term: np.zeros(with_head_axis(inputs["q"]).shape[:-1]) for term in TERMS}
                                                        # [..., H, N_q] each row's terms of a per-head
                                                        # vector's gradient, by its row's term
    reach = inputs["q"].shape[-2] + inputs["k"].shape[-2]         # ALiBi's distances are below N_q + N_k
    c = EXPONENT_ULPS / ATOL_ULPS
    for index, stages in stage_blocks:
        s, lse = stages["S"], stages.get("lse")
        a = np.abs(s)                                                  # |S_ij|, 0 where masked (the 'uniform'
        np.copyto(a, 0, where=np.isinf(a))                             # policy's weights are there)
        u = 1 + c * (0 if lse is None else np.where(np.isfinite(lse), np.abs(lse), 0)) * np.ones(s.shape[:-1])
        p_drop, p_drop_rows = _without_nan(stages["P~"])
        pa_drop = p_drop * a
        row_max["out"] = max(row_max["out"], (u * p_drop_rows + c * pa_drop.sum(-1)).max(initial=0))
        row_max["lse"] = max(row_max["lse"], a.max(initial=0))
        if "dP" not in stages:
            continue
        p, p_rows = (p_drop, p_drop_rows) if stages["P~"] is stages["P"] else _without_nan(stages["P"])
        pa = pa_drop if p is p_drop else p * a
        D = np.abs(stages["D"])
        head_rows["weight"][index[:-1]] = np.clip(1 - p_rows, 0, None) * D   # P_sink D = (1 - rowsum(P)) D
        if np.isnan(D).any():                                          # NaN rows (out NaN): no term
            dead = np.isnan(D)
            p, pa = (np.where(dead[..., None], 0, x) for x in (p, pa))
            p_rows, D = np.where(dead, 0, p_rows), np.where(dead, 0, D)
        dl = dout_lengths[index[:-1]]                                  # [..., H, b] ||dout_i||
        out_lengths = _matvec(p_drop, v_lengths)                       # o_i
        y = np.abs(stages["dP"])
        y *= p                                                         # Y = P |dP|
        if dbias is not None:                                          # each term, summed to the bias
            terms = (y + D[..., None] * p) * (u[..., None] + c * a) \
                + p * (dl[..., None] * (v_lengths[..., None, :] + out_lengths[..., None]))
            block = bias_block(dbias, index)
            block += unbroadcast(terms, block.shape)
        dv_cols = _vecmat(u, p_drop) + c * pa_drop.sum(-2)
        dk_cols = _vecmat(u, y) + _vecmat(D * u + dl * out_lengths, p) + v_lengths * _vecmat(dl, p) + c * _vecmat(D, pa)
        p_v = out_lengths if p is p_drop else _matvec(p, v_lengths)
        dq_rows = u * y.sum(-1) + D * (u * p_rows + c * pa.sum(-1)) + dl * (p_v + out_lengths * p_rows)
        y *= a                                                         # Y |S|
        dq_rows += c * y.sum(-1)
        dk_cols += c * y.sum(-2)
        row_max["dq"] = max(row_max["dq"], dq_rows.max(initial=0))
        col_sum = {"dv": col_sum["dv"] + dv_cols, "dk": col_sum["dk"] + dk_cols}
        head_rows["distance"][index[:-1]] = reach * dq_rows
    sums = {**row_max, "dv": _kv_column_max(col_sum["dv"], h_kv), "dk": _kv_column_max(col_sum["dk"], h_kv)}
    if dbias is not None:
        sums["dbias"] = float(dbias.max(initial=0))
    for row in HEAD_ROWS:                           # each entry's rows: its head's, or its sequence's
        if row.gradient and row.name in options:
            total = slopes_sum(head_rows[row.term], options[row.name], options.get("cu_seqlens_q"))
            sums[row.gradient] = float(np.max(total, initial=0))
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
    mags = {"out": sums["out"] * v.max(initial=0), "lse": lse,
            "max_logits": sums["lse"] + scale * longest(q) * longest(k)}   # a score's terms
    if "dout" in inputs:
        mags.update(dv=sums["dv"] * np.abs(inputs["dout"]).max(initial=0),
                    dq=scale * sums["dq"] * k.max(initial=0),
                    dk=scale * sums["dk"] * q.max(initial=0))
        mags.update({name: sums[name] for name in GRADIENTS if name in sums})
    return mags


def _without_nan(p):
    """(p with NaN weights as 0, its row sums [..., b]): the 'nan' policy's fully masked rows are
    terms of 0 (a copy only where a row holds NaN)."""
    rows = p.sum(-1)
    if not np.isnan(rows).any():
        return p, rows
    p = np.where(np.isnan(p), 0, p)
    return p, p.sum(-1)


def _matvec(m, x):
    """(m x)_i = sum_j m_ij x_j for m [..., b, n] and x [..., n]: [..., b]."""
    return np.matmul(m, x[..., None])[..., 0]


def _vecmat(x, m):
    """(m^T x)_j = sum_i x_i m_ij for x [..., b] and m [..., b, n]: [..., n]."""
    return np.matmul(x[..., None, :], m)[..., 0, :]


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
    stages = {name: truth[name].reshape(shape[:-1] if name in ("D", "lse") else shape).astype(np.float64, copy=False)
              for name in ("S", "P", "P~", "dP", "D", "lse") if name in truth}
    if truth["P~"] is truth["P"]:                       # no dropout: one array (term_sums reads it once)
        stages["P~"] = stages["P"]
    return [((Ellipsis, slice(None), slice(None)), stages)]
