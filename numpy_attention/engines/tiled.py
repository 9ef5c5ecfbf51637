"""Tiled, memory-efficient attention (FlashAttention's algorithm), forward and backward.

Shape legend (as in textbook.py):
    ...   leading batch axes;  H query heads,  H_kv key/value heads (G = H / H_kv)
    N_q, N_k lengths;  d_k, d_v widths;  b the block size;  i a query block, j a key block

    q [..., H, N_q, d_k]   k [..., H_kv, N_k, d_k]   v [..., H_kv, N_k, d_v]   ->   out [..., H, N_q, d_v]

The same function as the materialized `attention_forward`, but no [N_q, N_k] array is
ever formed: only one [..., H, b, b] block of scores exists at a time, and the cache
keeps out and the row logsumexp lse [..., H, N_q] (O(N) memory instead of O(N^2), plus a
copy of the mask and bias the caller passed, if any).

Forward, per query block i (online softmax over the key blocks j):
    S_ij = scale * q_i k_j^T + bias_ij (+ ALiBi), -inf where not kept   [..., H, b, b]
    m_i' = max(m_i, rowmax S_ij)                                  running row maximum
    P_ij = exp(S_ij - m_i'),  a = exp(m_i - m_i')                 a rescales what came before
    l_i  = a l_i + rowsum P_ij,   acc_i = a acc_i + P_ij v_j
    out_i = acc_i / l_i,   lse_i = m_i + log l_i                  (l_i = 0: fully masked row)

Backward, per query block i and key block j (P recomputed from lse, never stored):
    P_ij = exp(S_ij - lse_i)                                      exact softmax weights
    dv_j += P_ij^T dout_i,   dP_ij = dout_i v_j^T
    dS_ij = P_ij * (dP_ij - D_i),   D = rowsum(dout * out)        (= rowsum(P * dP))
    dq_i += scale * dS_ij k_j,   dk_j += scale * dS_ij^T q_i,   dbias_ij = dS_ij (unbroadcast)
    dslope_i += -rowsum(dS_ij * |i + N_k - N_q - j|)              each row's; summed per slope at the end

Blocks in which the keep-mask (scores.keep_mask) keeps no score are skipped in both passes.
Grouped-query heads meet their kv heads as in the textbook (`grouped_matmul`: the G query heads
of a kv head stacked as rows), so dk and dv sum over each group inside the matmul.

Tasks (engines/parallel.py: threads with `workers`, a Dask cluster with `scheduler`): the
forward's query tiles i, each reading all of k and v; the backward's slices, one per (batch
index, kv head), each summing its own dk_j, dv_j over its query tiles in order, so the bits do
not depend on where or on how many workers the tasks run.

Supported: every option whose row of options.OPTIONS says tiled (scores.py's steps on each
tile; a tile that the keep steps remove is skipped; a sink starts each row's online softmax:
m = sink, l = 1) with fully_masked='zero'; its plan (engines/plan.py) refuses the others.
The backward is the 'flash' form ('vjp' names the same computation here); method='jacobian'
and return_stages need the [N_q, N_k] weights: ValueError.
"""
from typing import NamedTuple

import numpy as np

from .._checks import require_choice
from .._layout import (grouped_matmul, grouped_sum_matmul, kv_index, kv_slices, scaled, spans_slices, tiles,
                       with_head_axis)
from .. import scores
from ..caches import AttentionGrads, TiledAttentionCache
from ..score_grads import ScoreGrads
from ..scores import heads_view, keep_mask
from .parallel import run_tasks


def tile_scores(options, q_i, k_j, score_shape, tile):
    """S_ij = (scale q_i) k_j^T + bias_ij (+ ALiBi), -inf where not kept: [..., H, b_q, b_k],
    fresh (scores.py's steps on the tile).

    q_i is the query tile, already scaled. Returns (S_ij, keep, scores.Saved): keep is the
    tile's keep mask (None: every score kept), or False when the tile keeps nothing (then
    S_ij and the Saved are None).
    """
    keep = keep_mask(options, score_shape, tile)
    if keep is not None and not keep.any():
        return None, False, None
    s = grouped_matmul(q_i, np.swapaxes(k_j, -1, -2))                  # 1.
    s, saved = scores.forward(s, options, score_shape, tile, keep)      # 2-4.
    return s, keep, saved


# ----------------------------------------------------------------------------- forward / backward

def tiled_forward(q, k, v, options, plan):
    """out = softmax(S) v by online softmax over key tiles; O(N) memory (module docstring).

    q, k, v and options as `attention_options` returns them; the plan's block_size, workers and
    scheduler (engines/plan.py).
    Returns out [..., H, N_q, d_v] and a TiledAttentionCache (out, lse and max_logits inside).
    """
    o = options
    q3, k3, v3 = with_head_axis(q), with_head_axis(k), with_head_axis(v)
    score_shape = q3.shape[:-1] + (k3.shape[-2],)                      # [..., H, N_q, N_k]
    out = np.empty(q3.shape[:-1] + v3.shape[-1:], dtype=q3.dtype)     # [..., H, N_q, d_v]
    lse = np.empty(q3.shape[:-1], dtype=q3.dtype)                      # [..., H, N_q]
    max_logits = np.empty(q3.shape[:-1], dtype=q3.real.dtype)          # [..., H, N_q]
    row_tiles = tiles(score_shape[-2], plan.block_size)
    items = [(scaled(q3[..., rows, :], o.scale), rows) for rows in row_tiles]
    shared = _shared(o, plan, k3=k3, v3=v3, score_shape=score_shape)
    for rows, result in zip(row_tiles, run_tasks(_forward_rows, items, plan.workers, shared, plan.scheduler)):
        out[..., rows, :], lse[..., rows], max_logits[..., rows] = result
    out, lse = out.reshape(q.shape[:-1] + v.shape[-1:]), lse.reshape(q.shape[:-1])
    return out, TiledAttentionCache(options=o, q=q, k=k, v=v, out=out.copy(), lse=lse, plan=plan,
                                    max_logits=max_logits.reshape(q.shape[:-1]))


def _forward_rows(q_i, rows, tangents=None, *, o, block_size, k3, v3, score_shape):
    """(out_i, lse_i, max_logits_i) of one query tile (q_i scaled) by the online softmax over key
    tiles j; with tangents (Tangents of the tile), (out_i, lse_i, out_dot_i, lse_dot_i) (tiled_jvp)."""
    lead = q_i.shape[:-1]                                               # [..., H, b_q]
    m = np.full(lead, -np.inf, dtype=q_i.real.dtype)                    # running row max of Re S
    top = m.copy()                                                      # of the scores alone (m: the sink's too)
    l = np.zeros(lead, dtype=q_i.dtype)                                 # running row sum of P
    acc = np.zeros(lead + v3.shape[-1:], dtype=q_i.dtype)               # running P v
    acc_dot, l_dot = np.zeros(acc.shape, acc.dtype), np.zeros(lead, l.dtype)   # sum P (S_dot v + v_dot), sum P S_dot
    if o.sinks is not None:                                             # the sink starts each row:
        sink = _row_sinks(o, score_shape)                               # its exp(sink - m) is in l:
        shift = np.where(np.isneginf(sink.real), 0, sink.real)          # 1, or 0 for a sink of -inf
        m, l = np.broadcast_to(sink.real, lead).copy(), np.exp(sink - shift) * np.ones(lead)
        if tangents is not None and tangents.sinks is not None:
            l_dot = l * heads_view(tangents.sinks, score_shape)[..., None]
    for cols in tiles(score_shape[-1], block_size):
        s, keep, saved = tile_scores(o, q_i, k3[..., cols, :], score_shape, (Ellipsis, rows, cols))
        if keep is False:
            continue
        m_new = np.maximum(m, s.real.max(axis=-1))
        top = np.maximum(top, scores.row_max(s, o, score_shape, (Ellipsis, rows, cols)))
        shift = np.where(np.isneginf(m_new), 0.0, m_new)                # nothing kept yet: any shift
        s -= shift[..., None]
        p = np.exp(s, out=s)                                            # P_ij = exp(S_ij - m'), in place
        a = np.exp(m - shift)                                           # rescales the earlier tiles
        l = a * l + p.sum(axis=-1)
        acc = a[..., None] * acc + grouped_matmul(p, v3[..., cols, :])
        if tangents is not None:                                        # the same sums with S_dot
            p_s_dot = p * tile_scores_tangent(o, q_i, k3[..., cols, :], tangents, score_shape, rows, cols,
                                              keep, saved)
            l_dot = a * l_dot + p_s_dot.sum(axis=-1)
            acc_dot = a[..., None] * acc_dot + grouped_matmul(p_s_dot, v3[..., cols, :]) \
                + grouped_matmul(p, tangents.v[..., cols, :])
        m = m_new
    dead = l == 0                                                       # fully masked rows
    safe_l = np.where(dead, 1, l)[..., None]
    out = acc / safe_l                                                  # 0 in a dead row
    with np.errstate(divide="ignore"):
        lse = np.where(dead, -np.inf, np.where(np.isneginf(m), 0.0, m) + np.log(np.where(dead, 1, l)))
    if tangents is None:
        return out, lse, top
    lse_dot = l_dot / safe_l[..., 0]                                    # <P, S_dot>
    return out, lse, (acc_dot - out * l_dot[..., None]) / safe_l, lse_dot


class Tangents(NamedTuple):
    """The tangents of one query tile's computation (tiled_jvp); None: 0."""
    q: np.ndarray                   # [..., H, b_q, d_k] the tile's q_dot, scaled like q
    k: np.ndarray                   # [..., H_kv, N_k, d_k]
    v: np.ndarray                   # [..., H_kv, N_k, d_v]
    scores: dict                    # the score steps' parameters' tangents (scores.tangent's bias_dot, ...)
    sinks: object                   # sinks_dot or None


def tile_scores_tangent(o, q_i, k_j, tangents, score_shape, rows, cols, keep, saved):
    """S_dot_ij = scale (q_dot_i k_j^T + q_i k_dot_j^T) + bias_dot_ij - slope_dot |..|, through
    score_mod, 0 where not kept (q_i, q_dot_i scaled; keep, saved: the tile's, tile_scores)."""
    s_dot = grouped_matmul(tangents.q, np.swapaxes(k_j, -1, -2)) \
        + grouped_matmul(q_i, np.swapaxes(tangents.k[..., cols, :], -1, -2))           # 1.
    return scores.tangent(s_dot, o, score_shape, (Ellipsis, rows, cols), saved, keep, **tangents.scores)   # 2-4.


def tiled_jvp(q, k, v, options, plan, q_dot, k_dot, v_dot, score_dots, row_dots):
    """(out, out_dot, lse, lse_dot) by the online softmax carrying its tangents, O(N) memory.

    With e_j = exp(S_j - m) over a row's kept keys j (and the sink):
        out_dot = (sum_j e_j (S_dot_j v_j + v_dot_j) - out sum_j e_j S_dot_j) / sum_j e_j
        lse_dot = sum_j e_j S_dot_j / sum_j e_j
    both sums rescaled with the running max exactly as out's (module docstring).
    q, k, v, options as `attention_options` returns them, the plan as tiled_forward's;
    tangents of their primals' shapes; score_dots and row_dots: the tangents of the options that
    act in the score steps (scores.tangent's bias_dot, ...) and in the row's (sinks_dot); None: 0.
    """
    o = options
    q3, k3, v3 = with_head_axis(q), with_head_axis(k), with_head_axis(v)
    q_dot3, k_dot3, v_dot3 = with_head_axis(q_dot), with_head_axis(k_dot), with_head_axis(v_dot)
    score_shape = q3.shape[:-1] + (k3.shape[-2],)
    out, out_dot = (np.empty(q3.shape[:-1] + v3.shape[-1:], q3.dtype) for _ in range(2))
    lse, lse_dot = (np.empty(q3.shape[:-1], q3.dtype) for _ in range(2))
    row_tiles = tiles(score_shape[-2], plan.block_size)
    items = [(scaled(q3[..., rows, :], o.scale), rows, scaled(q_dot3[..., rows, :], o.scale)) for rows in row_tiles]
    shared = _shared(o, plan, k3=k3, v3=v3, score_shape=score_shape, k_dot=k_dot3, v_dot=v_dot3,
                     score_dots=score_dots, sinks_dot=row_dots.get("sinks_dot"))
    for rows, result in zip(row_tiles, run_tasks(_jvp_rows, items, plan.workers, shared, plan.scheduler)):
        out[..., rows, :], lse[..., rows], out_dot[..., rows, :], lse_dot[..., rows] = result
    shape = q.shape[:-1]
    return (out.reshape(shape + v.shape[-1:]), out_dot.reshape(shape + v.shape[-1:]), lse.reshape(shape),
            lse_dot.reshape(shape))


def _jvp_rows(q_i, rows, q_dot_i, *, k_dot, v_dot, score_dots, sinks_dot, **forward):
    """One task of tiled_jvp: _forward_rows of the tile, carrying its tangents."""
    tangents = Tangents(q=q_dot_i, k=k_dot, v=v_dot, scores=score_dots, sinks=sinks_dot)
    return _forward_rows(q_i, rows, tangents, **forward)


def _row_sinks(o, score_shape):
    """Each row's sink logit, [..., H, 1]: broadcastable to the rows [..., H, N_q]."""
    return heads_view(o.sinks, score_shape)[..., None]


def tiled_backward(dout, cache, dlse=None, *, method="flash", return_stages=False):
    """Gradients of `tiled_forward`, recomputing P tile by tile (module docstring).

    method 'vjp' and 'flash' are the same computation here; 'jacobian' and return_stages
    need the [N_q, N_k] weights, which the tiled engine never forms: ValueError.
    Returns AttentionGrads (see attention_backward).
    """
    require_choice(method, "method", ("vjp", "flash"))
    if return_stages:
        raise ValueError("return_stages=True needs the [N_q, N_k] stages, which the tiled engine "
                         "(block_size) never forms; use implementation='blocked' or 'textbook'")
    o, plan = cache.options, cache.plan
    q3, k3, v3, dout3 = (with_head_axis(x) for x in (cache.q, cache.k, cache.v, dout))
    group = q3.shape[-3] // k3.shape[-3]
    score_shape = q3.shape[:-1] + (k3.shape[-2],)
    D = np.sum(dout3 * with_head_axis(cache.out), axis=-1)             # [..., H, N_q] rowsum(dout * out)
    if dlse is not None:                                                # d lse / dS = P: D - dlse
        D = D - dlse.reshape(D.shape)
    lse = np.where(np.isneginf(cache.lse.real), np.inf, cache.lse).reshape(score_shape[:-1])  # dead row: P = 0
    dq, dk, dv = (np.empty(x.shape, dout3.dtype) for x in (q3, k3, v3))   # every slice writes its own
    # one slice for all where the bias broadcasts across slices (its gradient sums over them)
    slices = kv_slices(score_shape, group, whole=o.bias is not None and spans_slices(o.bias, len(score_shape),
                                                                                      score_shape))
    items = [(at, q3[at], dout3[at], D[at], lse[at], k3[kv_index(at, group)], v3[kv_index(at, group)])
             for at in slices]
    results = run_tasks(_backward_slice, items, plan.workers, _shared(o, plan, score_shape=score_shape),
                        plan.scheduler)
    for at, (dq_s, dk_s, dv_s, _) in zip(slices, results):
        dq[at], dk[kv_index(at, group)], dv[kv_index(at, group)] = dq_s, dk_s, dv_s
    return AttentionGrads(dq=dq.reshape(cache.q.shape), dk=dk.reshape(cache.k.shape),
                          dv=dv.reshape(cache.v.shape), **ScoreGrads.total([r[-1] for r in results], o, score_shape, dout3.dtype))


def _backward_slice(at, q, dout, D, lse, k, v, *, o, block_size, score_shape):
    """One task of the backward: the scores' slice `at` (a batch index and the G query heads of
    one kv head; (Ellipsis,): all), its q, dout [.., G, N_q, d], D, lse [.., G, N_q] and its kv
    head's k, v [.., 1, N_k, d]. Returns its (dq, dk, dv, ScoreGrads of the slice), the sums of
    its tiles: over key tiles j for dq, over query tiles i, in order, for dk and dv."""
    dq, dk, dv = np.zeros(q.shape, dout.dtype), np.zeros(k.shape, dout.dtype), np.zeros(v.shape, dout.dtype)
    params = ScoreGrads(o, score_shape, dout.dtype, region=at)          # dbias, dslopes of its tiles
    n_kv = k.shape[-3]
    for rows in tiles(score_shape[-2], block_size):
        q_i, dout_i = scaled(q[..., rows, :], o.scale), dout[..., rows, :]
        D_i, lse_i = D[..., rows, None], lse[..., rows, None]
        for cols in tiles(score_shape[-1], block_size):
            tile = at + (rows, cols)
            s, keep, saved = tile_scores(o, q_i, k[..., cols, :], score_shape, tile)
            if keep is False:
                continue
            s -= lse_i
            p = np.exp(s, out=s)                                        # P_ij = exp(S_ij - lse_i)
            dv[..., cols, :] += grouped_sum_matmul(p, dout_i, n_kv)      # dv_j += P_ij^T dout_i
            ds = grouped_matmul(dout_i, np.swapaxes(v[..., cols, :], -1, -2))   # dP_ij = dout_i v_j^T
            ds -= D_i
            ds *= p                                                     # dS_ij = P_ij (dP_ij - D_i)
            ds = scores.backward(ds, o, score_shape, tile, saved, keep, params)   # 4-3.
            dq[..., rows, :] += scaled(grouped_matmul(ds, k[..., cols, :]), o.scale)   # dq_i += scale dS k_j
            dk[..., cols, :] += grouped_sum_matmul(ds, q_i, n_kv)       # dk_j += dS^T (scale q_i)
    if o.sinks is not None:                                             # dsink = P_sink (dlse - D), summed
        with np.errstate(invalid="ignore"):                             # over the rows
            p_sink = np.exp(_row_sinks(o, score_shape)[at] - lse)       # [.., G, N_q]
        params.add_sink(-np.sum(p_sink * D, axis=-1), at + (slice(None), slice(None)))
    return dq, dk, dv, params


def _shared(o, plan, **arrays):
    """The keyword arguments every task of a call shares: the options, the plan's tile size and
    `arrays` (where the tasks run, workers and scheduler, stays with the caller)."""
    return {"o": o, "block_size": plan.block_size, **arrays}
