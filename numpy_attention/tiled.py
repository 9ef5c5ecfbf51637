"""Tiled, memory-efficient attention (FlashAttention's algorithm), forward and backward.

Shape legend (as in attention.py):
    ...   leading batch axes;  H query heads,  H_kv key/value heads (G = H / H_kv)
    N_q, N_k lengths;  d_k, d_v widths;  b the block size;  i a query block, j a key block

    q [..., H, N_q, d_k]   k [..., H_kv, N_k, d_k]   v [..., H_kv, N_k, d_v]   ->   out [..., H, N_q, d_v]

The same function as the materialized `attention_forward`, but no [N_q, N_k] array is
ever formed: only one [..., H, b, b] block of scores exists at a time, and the cache
keeps out and the row logsumexp lse [..., H, N_q] (O(N) memory instead of O(N^2), plus a
copy of the mask and bias the caller passed, if any).

Forward, per query block i (online softmax over the key blocks j):
    S_ij = scale * q_i k_j^T + bias_ij, -inf where not kept      [..., H, b, b]
    m_i' = max(m_i, rowmax S_ij)                                  running row maximum
    P_ij = exp(S_ij - m_i'),  a = exp(m_i - m_i')                 a rescales what came before
    l_i  = a l_i + rowsum P_ij,   acc_i = a acc_i + P_ij v_j
    out_i = acc_i / l_i,   lse_i = m_i + log l_i                  (l_i = 0: fully masked row)

Backward, per query block i and key block j (P recomputed from lse, never stored):
    P_ij = exp(S_ij - lse_i)                                      exact softmax weights
    dv_j += P_ij^T dout_i,   dP_ij = dout_i v_j^T
    dS_ij = P_ij * (dP_ij - D_i),   D = rowsum(dout * out)        (= rowsum(P * dP))
    dq_i += scale * dS_ij k_j,   dk_j += scale * dS_ij^T q_i,   dbias_ij = dS_ij (unbroadcast)

Blocks that causal masking or the window mask entirely (or that the mask masks
entirely) are skipped in both passes. Grouped-query heads are folded into rows
(_layout.fold: the G query heads of a kv head become G blocks of rows), so dk and dv sum
over each group inside the matmul.

Supported: mask, bias, causal (both alignments), window, scale, GQA, fully_masked='zero'.
Not supported (ValueError): softcap, dropout, fully_masked 'uniform'/'nan',
backward method='jacobian' and return_stages (there is no [N_q, N_k] stage to return).
"""
from typing import NamedTuple, Optional

import numpy as np

from ._checks import as_float_array, require_choice, require_positive_int, require_same_shape, result_dtype
from ._layout import fold, positional_keep, unbroadcast, unfold, with_head_axis


class TiledAttentionCache(NamedTuple):
    q: np.ndarray                   # [..., H, N_q, d_k]
    k: np.ndarray                   # [..., H_kv, N_k, d_k]
    v: np.ndarray                   # [..., H_kv, N_k, d_v]
    keep: Optional[np.ndarray]      # the caller's keep-mask, >= 2 axes, broadcastable to the scores
    bias: Optional[np.ndarray]      # the additive bias, >= 2 axes, broadcastable to the scores
    bias_shape: Optional[tuple]     # the bias's own shape, for dbias; None without a bias
    scale: float
    causal: bool
    window: Optional[tuple]
    align: str
    block_size: int
    out: np.ndarray                 # [..., H, N_q, d_v]
    lse: np.ndarray                 # [..., H, N_q] row logsumexp of S (-inf: fully masked row)


def check_tiled_options(block_size, softcap, dropout_scale, fully_masked):
    """block_size as an int; ValueError for an option the tiled path does not support."""
    block_size = require_positive_int(block_size, "block_size")
    unsupported = {"softcap": softcap is not None, "dropout_mask": dropout_scale is not None,
                   f"fully_masked={fully_masked!r}": fully_masked != "zero"}
    for name, used in unsupported.items():
        if used:
            raise ValueError(f"block_size={block_size} (the tiled path) does not support {name}; "
                             f"use block_size=None (the materialized path)")
    return block_size


# ----------------------------------------------------------------------------- blocks

def _blocks(n, b):
    """Slices of length b (the last one shorter) covering range(n)."""
    return [slice(i, min(i + b, n)) for i in range(0, n, b)]


def _at_least_2d(x):
    """A mask or bias broadcastable to the scores, with the (row, column) axes spelled out."""
    return None if x is None else x.reshape((1,) * (2 - x.ndim) + x.shape)


def _score_block(x, rows, cols):
    """The (rows, cols) block of an array broadcastable to the scores; a view.

    Axes of length 1 (broadcast) are kept whole; None stays None.
    """
    if x is None:
        return None
    return x[..., rows if x.shape[-2] != 1 else slice(None), cols if x.shape[-1] != 1 else slice(None)]


def _block_keep(c, rows, cols, n_q, n_k):
    """Keep-mask of block (rows, cols), positional & the caller's; None keeps everything.

    Returns (keep, skip); skip is True when the block keeps nothing at all.
    """
    keep = positional_keep(np.arange(n_q)[rows], np.arange(n_k)[cols], n_q, n_k,
                           c.causal, c.window, c.align)
    mask = _score_block(c.keep, rows, cols)
    if mask is not None:
        keep = mask if keep is None else keep & mask
    return keep, keep is not None and not keep.any()


def _block_scores(c, q_f, k_j, rows, cols, keep, h):
    """S_ij = (scale q_i) k_j^T + bias_ij, -inf where not kept: [..., H, b_q, b_k], fresh.

    q_f is the query block, scaled and folded: [..., H_kv, G*b_q, d_k].
    """
    s = unfold(q_f @ np.swapaxes(k_j, -1, -2), h)              # [..., H, b_q, b_k]
    bias = _score_block(c.bias, rows, cols)
    if bias is not None:
        s += bias
    if keep is not None:
        np.copyto(s, -np.inf, where=~keep)
    return s


# ----------------------------------------------------------------------------- forward / backward

def tiled_forward(q, k, v, *, keep, bias, scale, causal, window, align, block_size):
    """out = softmax(S) v by online softmax over key blocks; O(N) memory (module docstring).

    Called by `attention_forward(..., block_size=b)`, which checks every argument first.
    Args are attention_forward's after its checks: keep is the boolean mask (or None).
    Returns:
        out [..., H, N_q, d_v] and a TiledAttentionCache (out and lse inside).
    """
    q3, k3, v3 = map(with_head_axis, (q, k, v))
    h, h_kv = q3.shape[-3], k3.shape[-3]
    n_q = q3.shape[-2]
    c = TiledAttentionCache(q=q, k=k, v=v, keep=_at_least_2d(keep), bias=_at_least_2d(bias),
                            bias_shape=None if bias is None else bias.shape, scale=scale,
                            causal=causal, window=window, align=align, block_size=block_size,
                            out=None, lse=None)
    out = np.empty(q3.shape[:-1] + (v3.shape[-1],), dtype=q3.dtype)   # [..., H, N_q, d_v]
    lse = np.empty(q3.shape[:-1], dtype=q3.dtype)                       # [..., H, N_q]
    for rows in _blocks(n_q, block_size):
        q_f = fold(q3[..., rows, :] * scale, h_kv)                     # [..., H_kv, G*b_q, d_k]
        out[..., rows, :], lse[..., rows] = _forward_row_block(c, q_f, k3, v3, rows, h, h_kv)
    out, lse = out.reshape(q.shape[:-1] + (v.shape[-1],)), lse.reshape(q.shape[:-1])
    return out, c._replace(out=out.copy(), lse=lse)


def _forward_row_block(c, q_f, k3, v3, rows, h, h_kv):
    """(out_i, lse_i) of one query block by the online softmax over key blocks j."""
    n_q, n_k = c.q.shape[-2], k3.shape[-2]
    lead = q_f.shape[:-3] + (h, rows.stop - rows.start)                 # [..., H, b_q]
    m = np.full(lead, -np.inf, dtype=q_f.real.dtype)                    # running row max of Re S
    l = np.zeros(lead, dtype=q_f.dtype)                                 # running row sum of P
    acc = np.zeros(lead + (v3.shape[-1],), dtype=q_f.dtype)             # running P v
    for cols in _blocks(n_k, c.block_size):
        keep, skip = _block_keep(c, rows, cols, n_q, n_k)
        if skip:
            continue
        s = _block_scores(c, q_f, k3[..., cols, :], rows, cols, keep, h)
        m_new = np.maximum(m, s.real.max(axis=-1))
        shift = np.where(np.isneginf(m_new), 0.0, m_new)                # nothing kept yet: any shift
        s -= shift[..., None]
        p = np.exp(s, out=s)                                            # P_ij = exp(S_ij - m'), in place
        a = np.exp(m - shift)                                           # rescales the earlier blocks
        l = a * l + p.sum(axis=-1)
        acc = a[..., None] * acc + unfold(fold(p, h_kv) @ v3[..., cols, :], h)
        m = m_new
    dead = l == 0                                                       # fully masked rows
    out = acc / np.where(dead, 1, l)[..., None]                        # 0 in a dead row
    with np.errstate(divide="ignore"):
        lse = np.where(dead, -np.inf, np.where(np.isneginf(m), 0.0, m) + np.log(np.where(dead, 1, l)))
    return out, lse


def tiled_backward(dout, cache, *, method="flash", return_stages=False):
    """Gradients of `tiled_forward`, recomputing P block by block (module docstring).

    Called by `attention_backward` for a TiledAttentionCache. method 'vjp' and 'flash'
    are the same computation here; 'jacobian' and return_stages need the [N_q, N_k]
    weights, which the tiled path never forms: ValueError.
    Returns:
        (dq, dk, dv, dbias); attention_backward returns them as AttentionGrads.
    """
    require_same_shape(dout, cache.out.shape, "dout")
    require_choice(method, "method", ("vjp", "flash"))
    if return_stages:
        raise ValueError("return_stages=True needs the [N_q, N_k] stages, which the tiled path "
                         "(block_size) never forms; use block_size=None")
    dout = as_float_array(dout, "dout").astype(result_dtype(cache.out, np.asarray(dout)), copy=False)
    c = cache
    q3, k3, v3, dout3 = map(with_head_axis, (c.q, c.k, c.v, dout))
    h, h_kv = q3.shape[-3], k3.shape[-3]
    n_q, n_k = q3.shape[-2], k3.shape[-2]
    dtype = dout3.dtype
    D = np.sum(dout * c.out, axis=-1).reshape(q3.shape[:-1])           # [..., H, N_q] rowsum(dout * out)
    lse = np.where(np.isneginf(c.lse.real), np.inf, c.lse).reshape(q3.shape[:-1])  # dead row: P = 0
    dq, dk, dv = np.zeros(q3.shape, dtype), np.zeros(k3.shape, dtype), np.zeros(v3.shape, dtype)
    dbias = None if c.bias is None else np.zeros(c.bias.shape, dtype)
    for rows in _blocks(n_q, c.block_size):
        q_f = fold(q3[..., rows, :] * c.scale, h_kv)                  # [..., H_kv, G*b_q, d_k]
        dout_f = fold(dout3[..., rows, :], h_kv)                       # [..., H_kv, G*b_q, d_v]
        for cols in _blocks(n_k, c.block_size):
            keep, skip = _block_keep(c, rows, cols, n_q, n_k)
            if skip:
                continue
            s = _block_scores(c, q_f, k3[..., cols, :], rows, cols, keep, h)
            s -= lse[..., rows, None]
            p = np.exp(s, out=s)                                        # P_ij = exp(S_ij - lse_i)
            dv[..., cols, :] += np.swapaxes(fold(p, h_kv), -1, -2) @ dout_f   # dv_j += P_ij^T dout_i
            ds = unfold(dout_f @ np.swapaxes(v3[..., cols, :], -1, -2), h)    # dP_ij = dout_i v_j^T
            ds -= D[..., rows, None]
            ds *= p                                                     # dS_ij = P_ij (dP_ij - D_i)
            if dbias is not None:
                block = _score_block(dbias, rows, cols)
                block += unbroadcast(ds, block.shape)
            ds_f = fold(ds, h_kv)                                      # [..., H_kv, G*b_q, b_k]
            dq[..., rows, :] += c.scale * unfold(ds_f @ k3[..., cols, :], h)  # dq_i += scale dS k_j
            dk[..., cols, :] += np.swapaxes(ds_f, -1, -2) @ q_f         # dk_j += dS^T (scale q_i)
    dbias = None if dbias is None else dbias.reshape(c.bias_shape)
    return dq.reshape(c.q.shape), dk.reshape(c.k.shape), dv.reshape(c.v.shape), dbias
