"""Sparse top-k attention: each query attends only to the keys it lists (DeepSeek Sparse
Attention's selected tokens, FlashMLA's sparse kernels; NSA's selected blocks and MoBA through
`block_indices`).

Shape legend:  ... leading axes,  H query heads,  H_kv kv heads (G = H / H_kv),  N_q, N_k
lengths,  K the length of each query's list,  d_k, d_v widths.

    q [..., H, N_q, d_k]   k [..., H_kv, N_k, d_k]   v [..., H_kv, N_k, d_v]
    indices [..., H_kv or H, N_q, K] int: query i of head h lists keys indices[.., g, i, :]
            (g its kv head h // G, or h itself); -1 pads, and so does any index outside [0, N_k)
    topk_length [..., N_q] (optional): only a row's first topk_length entries count
        ->  out [..., H, N_q, d_v],  lse [..., H, N_q],  max_logits [..., H, N_q]

Forward, for query i of head h and its list L (t over the valid entries; a key listed twice
counts twice, as FlashMLA's reference gathers it twice):
    s_t = scale q_i . k_{L_t}
    lse_i = log sum_t exp(s_t),  p_t = exp(s_t - lse_i),  out_i = sum_t p_t v_{L_t}
    max_logits_i = max_t s_t
    a row with no valid entry: out 0, lse -inf (FlashMLA writes +inf), max_logits -inf
Backward (dense attention's over the gathered keys, then scattered back):
    dp_t = dout_i . v_{L_t},  D_i = dout_i . out_i,  ds_t = p_t (dp_t - D_i)
    dq_i = scale sum_t ds_t k_{L_t}
    dk_{L_t} += scale ds_t q_i,  dv_{L_t} += p_t dout_i   (a scatter-add: every use of a key sums,
                                                         by several queries or twice by one)
Forward mode: s_dot_t = scale (q_dot_i . k_{L_t} + q_i . k_dot_{L_t}),
    p_dot_t = p_t (s_dot_t - lse_dot_i),  lse_dot_i = sum_t p_t s_dot_t,
    out_dot_i = sum_t (p_dot_t v_{L_t} + p_t v_dot_{L_t}).

Computed a block of query rows at a time (block_rows; N_q: all rows at once, the textbook
form): the gathered keys are [..., H, block, K, d], never [N_q, N_k], one of k's or v's at a
time; the backward recomputes p from lse, as FlashAttention's does, so the cache holds O(N)
arrays besides the indices (kept as given, not copied).
"""
import math
from typing import NamedTuple, Optional

import numpy as np
import scipy.sparse

from ._checks import as_float_array, require_cache, require_same_shape
from ._layout import with_head_axis

GATHER_ROWS = 2 ** 15   # a block gathers at most this many keys (block_rows K) by default


class SparseCache(NamedTuple):
    q: np.ndarray               # [..., H, N_q, d_k]
    k: np.ndarray               # [..., H_kv, N_k, d_k]
    v: np.ndarray               # [..., H_kv, N_k, d_v]
    indices: np.ndarray         # [..., H_kv or H, N_q, K] as given (not copied: they are the largest input)
    topk_length: Optional[np.ndarray]   # [..., N_q] or None
    out: np.ndarray             # [..., H, N_q, d_v]
    lse: np.ndarray             # [..., H, N_q]
    scale: float
    block_rows: int


class SparseGrads(NamedTuple):
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray


def block_indices(blocks, block_size, n_k):
    """Token indices [..., N_q, K * block_size] of the key blocks a query selects (NSA's selection
    branch, MoBA): block b lists keys b * block_size ... b * block_size + block_size - 1; -1 pads,
    and so do the tokens of a last block past n_k."""
    blocks = np.asarray(blocks)
    if blocks.dtype.kind not in "iu":
        raise TypeError(f"blocks must be integer block indices, got dtype {blocks.dtype}")
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    tokens = blocks[..., None] * block_size + np.arange(block_size)              # [..., K, block_size]
    tokens = np.where((blocks[..., None] >= 0) & (tokens < n_k), tokens, -1)
    return tokens.reshape(blocks.shape[:-1] + (-1,))


def check_lists(indices, topk_length, q_shape, k_shape, name="indices"):
    """(indices, topk_length) as arrays, checked against q's and k's shapes: indices integers
    [..., H_kv or H, N_q, K] ([N_q, K] for one head), topk_length integers [..., N_q] or None.
    TypeError / ValueError naming `name` and the shapes."""
    indices = np.asarray(indices)
    if len(q_shape) == 2 and indices.ndim == 2:                    # one head: [N_q, K]
        indices = indices[None]
    if indices.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got dtype {indices.dtype}")
    q3, k3 = (shape if len(shape) >= 3 else (1,) + tuple(shape) for shape in (q_shape, k_shape))
    heads = (k3[-3], q3[-3])
    if indices.ndim != len(q3) or indices.shape[:-3] != tuple(q3[:-3]) or indices.shape[-3] not in heads \
            or indices.shape[-2] != q3[-2]:
        raise ValueError(f"{name} must be [..., H_kv or H, N_q, K] = [..., {heads[0]} or {heads[1]}, "
                         f"{q3[-2]}, K] (q {tuple(q_shape)}, k {tuple(k_shape)}), got {indices.shape}")
    if topk_length is not None:
        topk_length = np.asarray(topk_length)
        rows = tuple(q3[:-3]) + (q3[-2],)
        if topk_length.dtype.kind not in "iu" or topk_length.shape != rows:
            raise ValueError(f"topk_length must be integers [..., N_q] = {rows}, "
                             f"got dtype {topk_length.dtype} with shape {topk_length.shape}")
    return indices, topk_length


def listed(indices, lengths, n_k):
    """Which entries of the lists [..., N_q, K] name a key: inside [0, n_k) and, with lengths
    [..., N_q] (the lists' leading axes but their head), among each row's first lengths."""
    valid = (indices >= 0) & (indices < n_k)
    if lengths is not None:
        valid &= np.arange(indices.shape[-1]) < lengths[..., None, :, None]
    return valid


def _check(q, k, v, indices, topk_length, scale, block_rows):
    """(q, k, v, indices, topk_length, scale, block_rows) checked (indices as given: which entries
    are valid is found a block at a time, _rows)."""
    q, k, v = (as_float_array(x, name) for name, x in (("q", q), ("k", k), ("v", v)))
    q3, k3, v3 = (with_head_axis(x) for x in (q, k, v))
    if k3.shape[:-1] != v3.shape[:-1] or q3.shape[:-3] != k3.shape[:-3] or q3.shape[-1] != k3.shape[-1] \
            or q3.shape[-3] % k3.shape[-3]:
        raise ValueError(f"q [..., H, N_q, d_k], k [..., H_kv, N_k, d_k] and v [..., H_kv, N_k, d_v] do not "
                         f"agree (H_kv must divide H): q {q.shape}, k {k.shape}, v {v.shape}")
    indices, topk_length = check_lists(indices, topk_length, q.shape, k.shape)
    scale = 1 / math.sqrt(q3.shape[-1]) if scale is None else float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if block_rows is None:
        block_rows = max(1, GATHER_ROWS // max(1, indices.shape[-1]))
    elif isinstance(block_rows, (bool, np.bool_)) or not isinstance(block_rows, (int, np.integer)) or block_rows < 1:
        raise ValueError(f"block_rows must be a positive integer or None, got {block_rows!r}")
    return q, k, v, indices, topk_length, scale, block_rows


def _gathered(x3, idx, groups):
    """x3 [B, H_kv, N_k, d] gathered at idx [B, H, b, K] (index -1 reads row 0) -> [B, H, b, K, d]."""
    b = np.arange(x3.shape[0])[:, None, None, None]
    kv = (np.arange(idx.shape[1]) // groups)[None, :, None, None]
    return x3[b, kv, np.maximum(idx, 0)]


def _rows(q3, k3, cache_like, rows):
    """The block's per-query-head list [B, H, b, K], -1 where an entry is not valid (outside
    [0, N_k), or past its row's topk_length); a kv head's list repeated for its queries."""
    indices, topk_length = cache_like
    idx = indices.reshape((-1,) + indices.shape[-3:])[:, :, rows]
    lengths = None if topk_length is None else topk_length.reshape(-1, topk_length.shape[-1])[:, rows]
    idx = np.where(listed(idx, lengths, k3.shape[-2]), idx, -1)
    return np.repeat(idx, q3.shape[1] // idx.shape[1], axis=1) if idx.shape[1] != q3.shape[1] else idx


def _scores(q_blk, k_g, idx, scale):
    """s [B, H, b, K] = scale q . k_g (-inf where idx is -1)."""
    s = _dots(q_blk, k_g) * scale
    return np.where(idx >= 0, s, -np.inf)


def _dots(x, gathered):
    """[B, H, b, d] . [B, H, b, K, d] -> [B, H, b, K]: each row with its K gathered rows."""
    return (x[..., None, :] @ np.swapaxes(gathered, -1, -2))[..., 0, :]


def _mix(weights, gathered):
    """[B, H, b, K] x [B, H, b, K, d] -> [B, H, b, d]: each row's weighted sum of its gathered rows."""
    return (weights[..., None, :] @ gathered)[..., 0, :]


def _flat(*arrays):
    """The arrays with their leading axes as one: [..., H, N, d] -> [B, H, N, d]."""
    return [with_head_axis(x).reshape((-1,) + with_head_axis(x).shape[-3:]) for x in arrays]


def sparse_attention_forward(q, k, v, indices, *, topk_length=None, scale=None, block_rows=None):
    """out = softmax over each query's listed keys of scale q k^T, times their values (module docstring).

    Args:
        q [..., H, N_q, d_k], k [..., H_kv, N_k, d_k], v [..., H_kv, N_k, d_v].
        indices: [..., H_kv or H, N_q, K] int, each query's keys; -1 (or any index outside
            [0, N_k)) pads; a key listed twice counts twice.
        topk_length: [..., N_q] int or None: only each row's first topk_length entries count.
        scale: multiplies q k^T; default 1 / sqrt(d_k).
        block_rows: query rows a block (memory O(block_rows K d)); N_q: all at once (the textbook);
            None (default): as many as gather GATHER_ROWS keys per batch entry and head.
    Returns:
        out [..., H, N_q, d_v], lse [..., H, N_q] (-inf for a row with no key), max_logits
        [..., H, N_q], and a SparseCache.
    """
    q, k, v, indices, topk_length, scale, block_rows = _check(q, k, v, indices, topk_length, scale, block_rows)
    q3, k3, v3 = _flat(q, k, v)
    groups = q3.shape[1] // k3.shape[1]
    dtype = np.result_type(q3, k3, v3)
    out = np.zeros(q3.shape[:-1] + v3.shape[-1:], dtype)
    lse = np.full(q3.shape[:-1], -np.inf, dtype)
    top = np.full(q3.shape[:-1], -np.inf, np.zeros((), dtype).real.dtype)
    n_q = q3.shape[2]
    for start in range(0, n_q, block_rows):
        rows = slice(start, start + block_rows)
        idx = _rows(q3, k3, (indices, topk_length), rows)
        s = _scores(q3[:, :, rows], _gathered(k3, idx, groups), idx, scale)
        m = s.real.max(axis=-1, initial=-np.inf)
        shift = np.where(np.isneginf(m), 0, m)[..., None]
        e = np.exp(s - shift)                                           # 0 where not valid
        total = e.sum(axis=-1)
        live = total.real > 0
        with np.errstate(divide="ignore"):
            lse[:, :, rows] = np.where(live, shift[..., 0] + np.log(np.where(live, total, 1)), -np.inf)
        p = e / np.where(live, total, 1)[..., None]
        out[:, :, rows] = _mix(p, _gathered(v3, idx, groups))
        top[:, :, rows] = m
    lead = with_head_axis(q).shape[:-3]
    shape = lambda x: x.reshape(lead + x.shape[1:]) if q.ndim >= 3 else x[0, 0]
    out, lse, top = (shape(x) for x in (out, lse, top))
    return out, lse, top, SparseCache(q=q, k=k, v=v, indices=indices, topk_length=topk_length, out=out.copy(),
                                      lse=lse, scale=scale, block_rows=block_rows)


def sparse_attention_backward(dout, cache):
    """SparseGrads(dq, dk, dv) of sparse_attention_forward for the upstream gradient dout
    [..., H, N_q, d_v] (module docstring: p recomputed from lse, dk and dv scattered and summed)."""
    require_cache(cache, SparseCache, "sparse_attention_backward", arrays=("q", "k", "v", "out", "lse"))
    require_same_shape(dout, cache.out.shape, "dout")
    dout = as_float_array(dout, "dout")
    q3, k3, v3, out3, dout3 = _flat(cache.q, cache.k, cache.v, cache.out, dout)
    lse3 = cache.lse.reshape(q3.shape[:-1])
    groups = q3.shape[1] // k3.shape[1]
    dq = np.zeros(q3.shape, np.result_type(q3, dout3))
    dk, dv = np.zeros(k3.shape, dq.dtype), np.zeros(v3.shape, dq.dtype)
    n_q, block_rows = q3.shape[2], cache.block_rows
    for start in range(0, n_q, block_rows):
        rows = slice(start, start + block_rows)
        idx = _rows(q3, k3, (cache.indices, cache.topk_length), rows)
        do = dout3[:, :, rows]
        dp = _dots(do, _gathered(v3, idx, groups))                                # [B, H, b, K]
        k_g = _gathered(k3, idx, groups)                                          # (one at a time)
        s = _scores(q3[:, :, rows], k_g, idx, cache.scale)
        p = _weights(s, idx, lse3[:, :, rows, None])
        D = np.sum(do * out3[:, :, rows], axis=-1, keepdims=True)
        ds = p * (dp - D)
        dq[:, :, rows] = cache.scale * _mix(ds, k_g)
        _scatter(dk, idx, groups, cache.scale * ds, q3[:, :, rows])         # dk_L += scale ds q_i
        _scatter(dv, idx, groups, p, do)                                    # dv_L += p dout_i
    reshape = lambda x, like: x.reshape(np.shape(like))
    return SparseGrads(dq=reshape(dq, cache.q), dk=reshape(dk, cache.k), dv=reshape(dv, cache.v))


def _weights(s, idx, lse):
    """p = exp(s - lse) from the forward's lse, 0 where idx is -1 or the row has no key."""
    dead = (idx < 0) | np.isneginf(lse.real)
    with np.errstate(invalid="ignore"):
        return np.where(dead, 0, np.exp(np.where(dead, 0, s - np.where(np.isneginf(lse.real), 0, lse))))


def _scatter(target, idx, groups, weights, rows_of):
    """target [B, H_kv, N_k, d] += for every listed key L_t of each row i: weights_it rows_of_i,
    i.e. M rows_of with M [N_k, b] the sum of weights_it at (L_t, i) (a scipy.sparse matrix: an
    index listed several times gets every weight; entries with idx -1 add nothing).
    idx, weights [B, H, b, K]; rows_of [B, H, b, d]."""
    b_rows, top = idx.shape[-2], idx.shape[-1]
    row = np.repeat(np.arange(b_rows), top)
    for z in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            keys, w = idx[z, h].ravel(), weights[z, h].ravel()
            keep = keys >= 0
            m = scipy.sparse.csr_matrix((w[keep], (keys[keep], row[keep])), shape=(target.shape[-2], b_rows))
            target[z, h // groups] += m @ rows_of[z, h]


def sparse_attention_jvp(q, k, v, indices, q_dot=None, k_dot=None, v_dot=None, *, topk_length=None,
                         scale=None, block_rows=None):
    """(out, out_dot, lse, lse_dot) along the tangents (module docstring's forward mode); a
    tangent left None is 0."""
    out, lse, _, cache = sparse_attention_forward(q, k, v, indices, topk_length=topk_length, scale=scale,
                                                  block_rows=block_rows)
    dots = []
    for name, x, like in (("q_dot", q_dot, cache.q), ("k_dot", k_dot, cache.k), ("v_dot", v_dot, cache.v)):
        x = np.zeros_like(like) if x is None else as_float_array(x, name)
        require_same_shape(x, like.shape, name)
        dots.append(x)
    q3, k3, v3, qd3, kd3, vd3 = _flat(cache.q, cache.k, cache.v, *dots)
    lse3 = lse.reshape(q3.shape[:-1])
    groups = q3.shape[1] // k3.shape[1]
    out_dot = np.zeros(q3.shape[:-1] + v3.shape[-1:], np.result_type(q3, qd3))
    lse_dot = np.zeros(q3.shape[:-1], out_dot.dtype)
    n_q, block_rows = q3.shape[2], cache.block_rows
    for start in range(0, n_q, block_rows):
        rows = slice(start, start + block_rows)
        idx = _rows(q3, k3, (cache.indices, cache.topk_length), rows)
        k_g = _gathered(k3, idx, groups)
        s = _scores(q3[:, :, rows], k_g, idx, cache.scale)
        p = _weights(s, idx, lse3[:, :, rows, None])
        s_dot = cache.scale * (_dots(qd3[:, :, rows], k_g) + _dots(q3[:, :, rows], _gathered(kd3, idx, groups)))
        s_dot = np.where(idx >= 0, s_dot, 0)
        l_dot = np.sum(p * s_dot, axis=-1)
        p_dot = p * (s_dot - l_dot[..., None])
        out_dot[:, :, rows] = _mix(p_dot, _gathered(v3, idx, groups)) + _mix(p, _gathered(vd3, idx, groups))
        lse_dot[:, :, rows] = l_dot
    lead = with_head_axis(cache.q).shape[:-3]
    shape = lambda x: x.reshape(lead + x.shape[1:]) if cache.q.ndim >= 3 else x[0, 0]
    return out, shape(out_dot), lse, shape(lse_dot)
