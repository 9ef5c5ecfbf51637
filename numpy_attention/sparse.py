"""Sparse top-k attention: each query attends only to the keys it lists (DeepSeek Sparse
Attention's selected tokens, FlashMLA's sparse kernels; NSA's selected blocks and MoBA through
topk.py's `block_indices`). The lists are topk.py's; attention_forward(topk_indices=...) computes
the same attention densely, on any engine.

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
    a row with no valid entry: out 0 (or as fully_masked says), lse -inf (FlashMLA writes +inf),
    max_logits -inf
Backward (dense attention's over the gathered keys, then scattered back):
    dp_t = dout_i . v_{L_t},  D_i = dout_i . out_i,  ds_t = p_t (dp_t - D_i)
    dq_i = scale sum_t ds_t k_{L_t}
    dk_{L_t} += scale ds_t q_i,  dv_{L_t} += p_t dout_i   (a scatter-add: every use of a key sums,
                                                         by several queries or twice by one)
Forward mode: s_dot_t = scale (q_dot_i . k_{L_t} + q_i . k_dot_{L_t}),
    p_dot_t = p_t (s_dot_t - lse_dot_i),  lse_dot_i = sum_t p_t s_dot_t,
    out_dot_i = sum_t (p_dot_t v_{L_t} + p_t v_dot_{L_t}).

Computed a block of query rows at a time (block_rows; N_q: all rows at once, the textbook
form): the gathered keys are [G, block, K, d], never [N_q, N_k], one of k's or v's at a time;
the backward recomputes p from lse, as FlashAttention's does, so the cache holds O(N) arrays
besides the indices. It keeps its own copies of q, k, v, the indices and topk_length (or the
caller's arrays themselves where nothing can write into them: _checks.kept), so changing them
after the forward leaves the backward unchanged.

Tasks (engines/parallel.py: threads with `workers`, a Dask cluster with `scheduler`): the
forward's and JVP's spans of about TASK_ROWS query rows of each (batch index, kv head); the
backward's (batch index, kv head) slices, each summing its dk, dv over its blocks in order.
The slicing depends on neither, so the bits are the same on any number of workers or a cluster.
"""
import math
from typing import NamedTuple, Optional

import numpy as np
import scipy.sparse

from ._checks import (as_float_array, brief, kept, require_cache, require_positive_real, require_same_shape,
                      result_dtype)
from ._layout import tiles, with_head_axis
from .engines.parallel import run_tasks
from .engines.plan import check_scheduler, resolve_workers
from .option_checks import check_fully_masked, check_qkv
from .topk import check_lists, listed

GATHER_ROWS = 2 ** 15   # a block gathers at most this many keys (block_rows K) by default
TASK_ROWS = 2 ** 10     # a task of the forward or JVP takes about this many query rows (whole blocks)


class SparseCache(NamedTuple):
    q: np.ndarray               # [..., H, N_q, d_k]   (kept: a copy, or a frozen caller's array)
    k: np.ndarray               # [..., H_kv, N_k, d_k]
    v: np.ndarray               # [..., H_kv, N_k, d_v]
    indices: np.ndarray         # [..., H_kv or H, N_q, K] in the caller's integer dtype (kept)
    topk_length: Optional[np.ndarray]   # [..., N_q] or None (kept)
    out: np.ndarray             # [..., H, N_q, d_v]
    lse: np.ndarray             # [..., H, N_q]
    scale: float
    fully_masked: str
    block_rows: int
    workers: int                # where the backward runs, as the forward did
    scheduler: object


class SparseGrads(NamedTuple):
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray


def _check(q, k, v, indices, topk_length, scale, block_rows, workers, scheduler, fully_masked):
    """(q, k, v, indices, topk_length, scale, block_rows, workers, scheduler) checked, the arrays as
    the cache keeps them (_checks.kept: q, k, v in one dtype, the lists in theirs; which entries
    are valid is found a block at a time, _valid), and fully_masked."""
    q, k, v = check_qkv(q, k, v)                                       # attention's checks
    indices, topk_length = check_lists(indices, topk_length, q.shape, k.shape)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else require_positive_real(scale, "scale")
    if block_rows is None:
        block_rows = max(1, GATHER_ROWS // max(1, indices.shape[-1]))
    elif isinstance(block_rows, (bool, np.bool_)) or not isinstance(block_rows, (int, np.integer)) or block_rows < 1:
        raise ValueError(f"block_rows must be a positive integer or None, got {brief(block_rows)}")
    workers = resolve_workers(workers, "tiled", math.prod(with_head_axis(q).shape[:-1]) * indices.shape[-1])
    check_fully_masked(fully_masked, k, v)
    scheduler = check_scheduler(scheduler)
    dtype = result_dtype(q, k, v)
    return (*(kept(x, dtype) for x in (q, k, v)), kept(indices), kept(topk_length), scale, block_rows, workers,
            scheduler)


def _slices(q3, k3, indices, topk_length):
    """The computation's independent slices, one per (batch index z, kv head g): the index
    prefix of its G query heads into q3 [B, H, ..], of its kv head into k3, v3 [B, H_kv, ..],
    and its lists, indices [1, 1 or G, N_q, K] and topk_length [1, N_q] (or None)."""
    groups = q3.shape[1] // k3.shape[1]
    lists = indices.reshape((q3.shape[0],) + indices.shape[-3:])
    lengths = None if topk_length is None else topk_length.reshape(q3.shape[0], topk_length.shape[-1])
    for z in range(q3.shape[0]):
        for g in range(k3.shape[1]):
            heads, kv = (slice(z, z + 1), slice(g * groups, (g + 1) * groups)), (slice(z, z + 1), slice(g, g + 1))
            yield heads, kv, lists[heads if lists.shape[1] != k3.shape[1] else kv], \
                None if lengths is None else lengths[z:z + 1]


def _valid(idx, lengths, n_k, groups):
    """A block's lists [1, 1 or G, b, K] (lengths [1, b] or None) as the per-query-head lists
    [1, G, b, K] int64, -1 where an entry is not valid (outside [0, N_k), or past its row's
    topk_length; an unsigned index too large for int64 too)."""
    idx = np.where(listed(idx, lengths, n_k), idx.astype(np.int64, copy=False), -1)
    return np.repeat(idx, groups, axis=1) if idx.shape[1] != groups else idx


def _gathered(x, idx):
    """x [1, 1, N_k, d] (one kv head) gathered at idx [1, G, b, K] (index -1 reads row 0; zeros
    where there is no row, N_k = 0, and so every index is -1) -> [1, G, b, K, d]."""
    rows = x[0, 0]
    if rows.shape[0] == 0:
        return np.zeros(idx.shape + rows.shape[1:], rows.dtype)
    return rows[np.maximum(idx, 0)]


def _scores(q_blk, k_g, idx, scale):
    """s [1, G, b, K] = scale q . k_g (-inf where idx is -1)."""
    s = _dots(q_blk, k_g) * scale
    return np.where(idx >= 0, s, -np.inf)


def _dots(x, gathered):
    """[1, G, b, d] . [1, G, b, K, d] -> [1, G, b, K]: each row with its K gathered rows."""
    return (x[..., None, :] @ np.swapaxes(gathered, -1, -2))[..., 0, :]


def _mix(weights, gathered):
    """[1, G, b, K] x [1, G, b, K, d] -> [1, G, b, d]: each row's weighted sum of its gathered rows."""
    return (weights[..., None, :] @ gathered)[..., 0, :]


def _flat(*arrays):
    """The arrays with their leading axes as one: [..., H, N, d] -> [B, H, N, d]."""
    shaped = [with_head_axis(x) for x in arrays]
    return [x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:]) for x in shaped]


def _joined(results, blocks, shapes, dtype):
    """The tasks' results, tuples of arrays [1, G, b, ...] slice by slice ((batch index, kv head)
    in _slices' order) and `blocks` blocks of rows a slice, as one array of each of `shapes`
    [B, H, N, ...] (a lone part as it is: no copy; zeros of `dtype` where no task ran, B = 0)."""
    if not results:
        return [np.zeros(shape, dtype) for shape in shapes]
    joined = []
    for parts, shape in zip(zip(*results), shapes):
        slices = [parts[i] if blocks == 1 else np.concatenate(parts[i:i + blocks], axis=2)
                  for i in range(0, len(parts), blocks)]
        joined.append((slices[0] if len(slices) == 1 else np.concatenate(slices, axis=1)).reshape(shape))
    return joined


def _shaped(x, like):
    """x [B, H, N(, d)] with like's leading axes again ([N(, d)] for a like of one head, [N, d])."""
    return x.reshape(with_head_axis(like).shape[:-3] + x.shape[1:]) if like.ndim >= 3 else x[0, 0]


def sparse_attention_forward(q, k, v, indices, *, topk_length=None, scale=None, fully_masked="zero",
                             block_rows=None, workers=None, scheduler=None):
    """out = softmax over each query's listed keys of scale q k^T, times their values (module docstring).

    Args:
        q [..., H, N_q, d_k], k [..., H_kv, N_k, d_k], v [..., H_kv, N_k, d_v].
        indices: [..., H_kv or H, N_q, K] int, each query's keys; -1 (or any index outside
            [0, N_k)) pads; a key listed twice counts twice.
        topk_length: [..., N_q] int or None: only each row's first topk_length entries count.
        scale: multiplies q k^T; default 1 / sqrt(d_k).
        fully_masked: a row with no key gives, as in attention_forward, 'zero' (out 0, its
            gradient 0), 'uniform' (out the mean of all N_k values: dv gets dout / N_k) or 'nan'
            (out NaN, dv NaN); lse -inf in each.
        block_rows: query rows a block (memory O(G block_rows K d) a worker); N_q: all at once
            (the textbook); None (default): as many as gather GATHER_ROWS keys per head.
        workers: threads for the blocks (engines/parallel.py; None: every core from
            PARALLEL_SCORES listed entries up, else 1); scheduler: a Dask Client or address
            that runs them instead. The same bits for any workers and on a cluster.
    Returns:
        out [..., H, N_q, d_v], lse [..., H, N_q] (-inf for a row with no key), max_logits
        [..., H, N_q], and a SparseCache (the backward runs as the forward did).
    """
    q, k, v, indices, topk_length, scale, block_rows, workers, scheduler = _check(
        q, k, v, indices, topk_length, scale, block_rows, workers, scheduler, fully_masked)
    q3, k3, v3 = _flat(q, k, v)
    spans = _spans(q3.shape[2], block_rows)
    items = [(kv, (q3[heads + (rows,)],), idx[:, :, rows], None if n is None else n[:, rows])
             for heads, kv, idx, n in _slices(q3, k3, indices, topk_length) for rows in spans]
    results = run_tasks(_span, items, workers, {"block": _forward_block, "block_rows": block_rows, "k3": k3,
                                                "v3": v3, "scale": scale, "fully_masked": fully_masked}, scheduler)
    rows = q3.shape[:-1]                                                # [B, H, N_q]
    out, lse, top = (_shaped(x, q) for x in _joined(results, len(spans), (rows + v3.shape[-1:], rows, rows),
                                                    q3.dtype))
    return out, lse, top, SparseCache(q=q, k=k, v=v, indices=indices, topk_length=topk_length, out=out.copy(),
                                      lse=lse.copy(), scale=scale, fully_masked=fully_masked, block_rows=block_rows,
                                      workers=workers, scheduler=scheduler)


def _spans(n_q, block_rows):
    """The query rows of the forward's and JVP's tasks: whole blocks, about TASK_ROWS rows (one
    empty span for N_q = 0, whose results have their shapes)."""
    return _blocks(n_q, block_rows * max(1, TASK_ROWS // block_rows))


def _blocks(n, block_rows):
    """tiles(n, block_rows), or one empty block for n = 0."""
    return tiles(n, block_rows) or [slice(0, 0)]


def _span(kv, rows_of, lists, lengths, *, block, block_rows, **shared):
    """One task of the forward or JVP: `block` on each block of block_rows rows of a span of
    query rows of kv head `kv` (rows_of: the span's arrays [1, G, n, ...] of rows, lists [1, 1 or
    G, n, K], lengths [1, n] or None), its results [1, G, b, ...] written into the span's arrays."""
    results = None
    for rows in _blocks(lists.shape[2], block_rows):
        parts = block(kv, *(x[:, :, rows] for x in rows_of), lists[:, :, rows],
                      None if lengths is None else lengths[:, rows], **shared)
        if results is None:
            results = [np.empty(part.shape[:2] + (lists.shape[2],) + part.shape[3:], part.dtype) for part in parts]
        for result, part in zip(results, parts):
            result[:, :, rows] = part
    return results


def _forward_block(kv, q_blk, idx, lengths, *, k3, v3, scale, fully_masked):
    """The forward of a block: q_blk [1, G, b, d_k] of the G query heads of kv head
    `kv` with its lists -> (out [1, G, b, d_v], lse, max_logits [1, G, b])."""
    k, v = k3[kv], v3[kv]
    idx = _valid(idx, lengths, k.shape[-2], q_blk.shape[1])
    s = _scores(q_blk, _gathered(k, idx), idx, scale)
    m = s.real.max(axis=-1, initial=-np.inf)
    shift = np.where(np.isneginf(m), 0, m)[..., None]
    e = np.exp(s - shift)                                               # 0 where not valid
    total = e.sum(axis=-1)
    live = total.real > 0
    with np.errstate(divide="ignore"):
        lse = np.where(live, shift[..., 0] + np.log(np.where(live, total, 1)), -np.inf)
    p = e / np.where(live, total, 1)[..., None]
    return _no_key(_mix(p, _gathered(v, idx)), live, v, fully_masked), lse, m


def _no_key(out, live, v, fully_masked):
    """out [1, G, b, d_v] with the rows that have no key (live False) set by fully_masked: 0 (as
    computed), the mean of v's N_k rows [1, 1, N_k, d_v] ('uniform'), or NaN."""
    if fully_masked == "zero" or live.all():
        return out
    fill = np.mean(v, axis=-2, keepdims=True) if fully_masked == "uniform" else np.nan
    return np.where(live[..., None], out, fill)


def sparse_attention_backward(dout, cache):
    """SparseGrads(dq, dk, dv) of sparse_attention_forward for the upstream gradient dout
    [..., H, N_q, d_v] (module docstring: p recomputed from lse, dk and dv scattered and summed),
    a task per (batch index, kv head) summing its dk, dv over its blocks in order."""
    require_cache(cache, SparseCache, "sparse_attention_backward", arrays=("q", "k", "v", "out", "lse"))
    require_same_shape(dout, cache.out.shape, "dout")
    dout = as_float_array(dout, "dout")
    q3, k3, v3, out3, dout3 = _flat(cache.q, cache.k, cache.v, cache.out, dout)
    lse3 = cache.lse.reshape(q3.shape[:-1] + (1,))
    with np.errstate(invalid="ignore"):                                 # a row with no key: D unused
        D = np.where(np.isneginf(lse3.real), 0, np.sum(dout3 * out3, axis=-1, keepdims=True))   # [B, H, N_q, 1]
    items = [(kv, q3[heads], dout3[heads], D[heads], lse3[heads], idx, n)
             for heads, kv, idx, n in _slices(q3, k3, cache.indices, cache.topk_length)]
    results = run_tasks(_backward_slice, items, cache.workers,
                        {"k3": k3, "v3": v3, "scale": cache.scale, "block_rows": cache.block_rows,
                         "fully_masked": cache.fully_masked}, cache.scheduler)
    dq, dk, dv = (x.reshape(like.shape) for x, like in zip(
        _joined(results, 1, (q3.shape, k3.shape, v3.shape), np.result_type(q3, dout3)), (cache.q, cache.k, cache.v)))
    return SparseGrads(dq=dq, dk=dk, dv=dv)


def _backward_slice(kv, q, dout, D, lse, lists, lengths, *, k3, v3, scale, block_rows, fully_masked):
    """One task of the backward: the G query heads of kv head `kv` (q, dout [1, G, N_q, d], D,
    lse [1, G, N_q, 1]) -> (dq, dk, dv) of the slice, dk and dv summed over its blocks in order;
    the rows with no key add dout / N_k to every key's dv ('uniform') or make it NaN ('nan')."""
    k, v = k3[kv], v3[kv]
    dtype = np.result_type(q, dout)
    dq, dk, dv = np.empty(q.shape, dtype), np.zeros(k.shape, dtype), np.zeros(v.shape, dtype)
    for rows in tiles(q.shape[2], block_rows):
        idx = _valid(lists[:, :, rows], None if lengths is None else lengths[:, rows], k.shape[-2], q.shape[1])
        do = dout[:, :, rows]
        dp = _dots(do, _gathered(v, idx))                                       # [1, G, b, K]
        k_g = _gathered(k, idx)                                                 # (one at a time)
        p = _weights(_scores(q[:, :, rows], k_g, idx, scale), idx, lse[:, :, rows])
        ds = p * (dp - D[:, :, rows])
        dq[:, :, rows] = scale * _mix(ds, k_g)
        _scatter(dk, idx, scale * ds, q[:, :, rows])                            # dk_L += scale ds q_i
        _scatter(dv, idx, p, do)                                                # dv_L += p dout_i
    dead = np.isneginf(lse[..., 0].real)
    if fully_masked != "zero" and dead.any():
        dv += np.sum(dout[dead], axis=0) / k.shape[-2] if fully_masked == "uniform" else np.nan
    return dq, dk, dv


def _weights(s, idx, lse):
    """p = exp(s - lse) from the forward's lse, 0 where idx is -1 or the row has no key."""
    dead = (idx < 0) | np.isneginf(lse.real)
    with np.errstate(invalid="ignore"):
        return np.where(dead, 0, np.exp(np.where(dead, 0, s - np.where(np.isneginf(lse.real), 0, lse))))


def _scatter(target, idx, weights, rows_of):
    """target [1, 1, N_k, d] += for every listed key L_t of each row i: weights_it rows_of_i,
    i.e. M rows_of with M [N_k, b] the sum of weights_it at (L_t, i) (a scipy.sparse matrix: an
    index listed several times gets every weight; entries with idx -1 add nothing), head by head.
    idx, weights [1, G, b, K]; rows_of [1, G, b, d]."""
    b_rows, top = idx.shape[-2], idx.shape[-1]
    row = np.repeat(np.arange(b_rows), top)
    for h in range(idx.shape[1]):
        keys, w = idx[0, h].ravel(), weights[0, h].ravel()
        keep = keys >= 0
        m = scipy.sparse.csr_matrix((w[keep], (keys[keep], row[keep])), shape=(target.shape[-2], b_rows))
        target[0, 0] += m @ rows_of[0, h]


def sparse_attention_jvp(q, k, v, indices, q_dot=None, k_dot=None, v_dot=None, *, topk_length=None,
                         scale=None, fully_masked="zero", block_rows=None, workers=None, scheduler=None):
    """(out, out_dot, lse, lse_dot) along the tangents (module docstring's forward mode); a
    tangent left None is 0. The blocks run as sparse_attention_forward's."""
    out, lse, _, cache = sparse_attention_forward(q, k, v, indices, topk_length=topk_length, scale=scale,
                                                  fully_masked=fully_masked, block_rows=block_rows, workers=workers,
                                                  scheduler=scheduler)
    dots = []
    for name, x, like in (("q_dot", q_dot, cache.q), ("k_dot", k_dot, cache.k), ("v_dot", v_dot, cache.v)):
        x = np.zeros_like(like) if x is None else as_float_array(x, name)
        require_same_shape(x, like.shape, name)
        dots.append(x)
    q3, k3, v3, qd3, kd3, vd3 = _flat(cache.q, cache.k, cache.v, *dots)
    lse3 = lse.reshape(q3.shape[:-1] + (1,))
    spans = _spans(q3.shape[2], cache.block_rows)
    items = [(kv, (q3[heads + (rows,)], qd3[heads + (rows,)], lse3[heads + (rows,)]), idx[:, :, rows],
              None if n is None else n[:, rows])
             for heads, kv, idx, n in _slices(q3, k3, cache.indices, cache.topk_length) for rows in spans]
    results = run_tasks(_span, items, cache.workers, {"block": _jvp_block, "block_rows": cache.block_rows,
                                                      "k3": k3, "v3": v3, "kd3": kd3, "vd3": vd3,
                                                      "scale": cache.scale, "fully_masked": cache.fully_masked},
                        cache.scheduler)
    rows = q3.shape[:-1]                                                # [B, H, N_q]
    out_dot, lse_dot = (_shaped(x, cache.q) for x in _joined(results, len(spans), (rows + v3.shape[-1:], rows),
                                                             np.result_type(q3, qd3, kd3, vd3)))
    return out, out_dot, lse, lse_dot


def _jvp_block(kv, q_blk, qd_blk, lse, idx, lengths, *, k3, v3, kd3, vd3, scale, fully_masked):
    """The JVP of a block as _forward_block's, with its q tangent and the forward's
    lse [1, G, b, 1] -> (out_dot [1, G, b, d_v], lse_dot [1, G, b])."""
    k, v = k3[kv], v3[kv]
    idx = _valid(idx, lengths, k.shape[-2], q_blk.shape[1])
    k_g = _gathered(k, idx)
    p = _weights(_scores(q_blk, k_g, idx, scale), idx, lse)
    s_dot = scale * (_dots(qd_blk, k_g) + _dots(q_blk, _gathered(kd3[kv], idx)))
    s_dot = np.where(idx >= 0, s_dot, 0)
    lse_dot = np.sum(p * s_dot, axis=-1)
    p_dot = p * (s_dot - lse_dot[..., None])
    out_dot = _mix(p_dot, _gathered(v, idx)) + _mix(p, _gathered(vd3[kv], idx))
    live = ~np.isneginf(lse[..., 0].real)
    if fully_masked == "nan":                                            # a NaN row's tangents are NaN
        lse_dot = np.where(live, lse_dot, np.nan)
    return _no_key(out_dot, live, vd3[kv], fully_masked), lse_dot
