"""The naive baseline: attention with every sum taken left to right, in the candidate's dtype.

The rule (rule.py) asks a candidate to be at most k times worse than "an honest
implementation at that precision". That yardstick must be naive: BLAS sums a dot
product in several interleaved partial sums, which in float32 is 3-4 times more
accurate than the recursive sum  s = (((x1 + x2) + x3) + ...)  that PyTorch's CPU
matmul and most hand-written kernels use. Measured against attention.py in float32
(numpy's BLAS), PyTorch's own SDPA came out up to 12 times worse and the rule cried
wolf; against this baseline it does not (tests/test_crosscheck.py).

Its backward is FlashAttention's: P is recomputed as exp(S - lse). An lse that is
off by eps |lse| (as any lse is) comes back as a relative error eps |lse| in every
weight; with sharp rows (|S| ~ 100) that dominates the error of a flash kernel
(PyTorch's CPU flash kernel measured 30 times our stored-P error on dv).

Shapes as in attention.py; the steps are attention.py's, with recursive sums:
    S = scale q k^T -> softcap -> + bias -> masks -> P = softmax(S), lse -> P~ = P * dropout
    -> out = P~ v;   backward: P = exp(S - lse),  dv = P~^T dout,  dP = (dout v^T) * dropout,
    D = rowsum(dout * out),  dS = P (dP - D),  dbias = dS summed to bias's shape,
    dq = scale dS k,  dk = scale dS^T q

Computed block by block (blocks.py): a block is query head g of each group of G = H / H_kv
heads (heads g, g + G, ...) and a range of rows, so it meets the kv heads one to one. The
blocks go group head by group head, rows in order: dk and dv continue one running sum over
the rows of each group (head 0's rows, then head 1's, ...), the order of one sum over the
whole array, and the results are the same bitwise for any block size; but for dbias of a
bias broadcast along heads or rows: a NumPy sum over them, which the blocks split (the
same to rounding).
"""
import math

import numpy as np

from .. import scores
from .._layout import with_head_axis
from ..scores import ScoreGrads, head_gradient, with_sink
from .blocks import block_of, row_slices


SUM_TILE = 1 << 17          # entries of a tile of recursive_matmul's sums: it stays in the core's cache


def recursive_matmul(a, b, start=None):
    """start + a @ b, [..., m, n] @ [..., n, p] -> [..., m, p], each dot product summed left to
    right (continuing from start [..., m, p]; default zeros): the roundings of

        for i in range(n):
            acc = acc + a[..., :, i:i + 1] * b[..., i:i + 1, :]

    computed a tile of acc's rows at a time (about SUM_TILE entries, kept in cache through
    the n steps), each step in place."""
    dtype = np.result_type(a, b)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, n, p = a.shape[-2], a.shape[-1], b.shape[-1]
    acc = np.zeros(batch + (m, p), dtype) if start is None else np.array(start, dtype)
    columns = np.swapaxes(a, -1, -2).astype(dtype)                 # [..., n, m]: a's columns as rows, in dtype
    rows = max(1, SUM_TILE // max(1, math.prod(batch) * p))
    product = np.empty(batch + (min(rows, m), p), dtype)
    for top in range(0, m, rows):
        tile = acc[..., top:top + rows, :]
        term = product[..., :tile.shape[-2], :]
        for i in range(n):
            np.multiply(columns[..., i, top:top + rows, None], b[..., i:i + 1, :], out=term)
            np.add(tile, term, out=tile)
    return acc


def recursive_rowsum(x):
    """sum over the last axis, left to right: [..., n] -> [..., 1]."""
    return recursive_matmul(x, np.ones(x.shape[-1:] + (1,), dtype=x.dtype))


def _swap(x):
    return np.swapaxes(x, -1, -2)


def naive_attention(q, k, v, options, dout=None, block_rows=None):
    """out, lse (and dq, dk, dv, dbias with dout) in q's dtype, as a dict.

    q, k, v and options (an AttentionOptions record) as `attention_options` returns them:
    naive_attention(*attention_options(q, k, v, **kwargs), dout=dout). Without dout, the
    forward alone. block_rows: query rows per block (None: all of them), the same results
    bitwise (module docstring); a block's scores are [..., H_kv, block_rows, N_k].
    """
    o = options
    q3, k3, v3 = (with_head_axis(x) for x in (q, k, v))
    dout3 = None if dout is None else with_head_axis(dout)
    groups = q3.shape[-3] // k3.shape[-3]
    score_shape = q3.shape[:-1] + k3.shape[-2:-1]                    # [..., H, N_q, N_k]
    out = np.empty(q3.shape[:-1] + v3.shape[-1:], q3.dtype)
    lse = np.empty(q3.shape[:-1], q3.dtype)
    dq, dk, dv = np.empty(q3.shape, q3.dtype), None, None       # dk, dv: running sums (None: start)
    params = ScoreGrads(o, score_shape, q3.dtype)                   # dbias, dslopes, dscore_mod_params
    dsinks = None if o.sinks is None else np.zeros(score_shape[:-2], q3.dtype)   # [..., H]
    for g in range(groups):
        for rows in row_slices(score_shape[-2], block_rows):
            index = (Ellipsis, slice(g, None, groups), rows, slice(None))
            q_b = q3[..., g::groups, rows, :]                           # [..., H_kv, b, d_k]
            f = _forward_block(q_b, k3, v3, o, score_shape, index)
            out[..., g::groups, rows, :], lse[..., g::groups, rows] = f["out"], f["lse"]
            if dout3 is None:
                continue
            dout_b = dout3[..., g::groups, rows, :]
            dq[..., g::groups, rows, :], dk, dv = _backward_block(dout_b, q_b, k3, v3, o, f, dk, dv, score_shape,
                                                                  index, params)
            if o.sinks is not None:
                dsinks[..., g::groups] += f["dsink"]
    result = {"out": out.reshape(q.shape[:-1] + v.shape[-1:]), "lse": lse.reshape(q.shape[:-1])}
    if dout3 is not None:
        result.update(dq=dq.reshape(q.shape), dk=(o.scale * dk).reshape(k.shape),
                      dv=dv.reshape(v.shape))
        if dsinks is not None:
            result["dsinks"] = head_gradient(dsinks, o.sinks)
        result.update({name: g for name, g in ScoreGrads.total([params], o, score_shape, q3.dtype).items()
                       if g is not None})
    return result


def masked_row_weight(policy, n_k):
    """Each weight of a row whose keys are all masked, by the fully_masked policy: 'zero' 0,
    'uniform' 1 / N_k (the mean of v), 'nan' NaN."""
    return {"zero": 0.0, "uniform": 1.0 / max(n_k, 1), "nan": np.nan}[policy]


def _forward_block(q, k, v, o, score_shape, index):
    """The forward of one block, q [..., H_kv, b, d_k]: dict out [..., H_kv, b, d_v], lse
    [..., H_kv, b] and, for the backward, S, the score steps' Saved, dead rows and the dropout."""
    n_k = k.shape[-2]
    s = recursive_matmul(q * o.scale, _swap(k))                      # 1.  [..., H_kv, b, N_k]
    s, saved = scores.forward(s, o, score_shape, index)              # 2-4. (scores.py)
    s_row = with_sink(s, o, score_shape, index)                     # sinks: one more logit, no value
    m = np.max(s_row, axis=-1, keepdims=True, initial=-np.inf)      # -inf: no key (N_k = 0) or all masked
    m = np.where(np.isneginf(m), 0, m)
    e = np.exp(s_row - m)
    total = recursive_rowsum(e)
    dead = total == 0                                              # a fully masked row
    fill = masked_row_weight(o.fully_masked, n_k)                   # (no key: 'zero' only)
    p_row = np.where(dead, fill, e / np.where(dead, 1, total)).astype(s.dtype)
    p = p_row[..., :n_k]
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0]
    drop = block_of(o.dropout_scale, score_shape, index)
    p_drop = p if drop is None else (p * drop).astype(s.dtype)
    return {"out": recursive_matmul(p_drop, v), "lse": lse, "s": s, "p": p, "dead": dead,
            "drop": drop, "saved": saved, "p_sink": p_row[..., n_k:]}


def _backward_block(dout, q, k, v, o, f, dk, dv, score_shape, index, params):
    """The backward of one block (dout [..., H_kv, b, d_v], the scores' S[index]): dq [..., H_kv,
    b, d_k], and dk / scale and dv continued over the block's rows (dk, dv None: the first
    block); the score steps' parameters' gradients go to the ScoreGrads `params`."""
    s, drop = f["s"], f["drop"]
    with np.errstate(invalid="ignore"):                            # -inf - (-inf) in dead rows
        p = np.where(f["dead"], f["p"], np.exp(s - f["lse"][..., None]))   # FlashAttention's recomputation
    p_drop = p if drop is None else (p * drop).astype(s.dtype)
    dv = recursive_matmul(_swap(p_drop), dout, start=dv)
    dp = recursive_matmul(dout, _swap(v))
    dp = dp if drop is None else (dp * drop).astype(s.dtype)
    D = recursive_rowsum(dout * f["out"])                          # [..., b, 1]
    ds = p * (dp - D)
    f["dsink"] = -np.sum(f["p_sink"] * D, axis=(-2, -1))          # the sink's column of dS, summed
    ds = scores.backward(ds, o, score_shape, index, f["saved"], grads=params)   # 4-2. (scores.py)
    dq = o.scale * recursive_matmul(ds, k)
    dk = recursive_matmul(_swap(ds), q, start=dk)
    return dq, dk, dv
