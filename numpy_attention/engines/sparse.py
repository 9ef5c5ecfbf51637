"""The sparse engine: attention over the keys each query lists (top-k lists, topk.py), the
textbook's steps on blocks of query rows with their listed keys gathered.

Shape legend as in textbook.py; G = H / H_kv, K the length of each list, b a block's rows.

    q [..., H, N_q, d_k]   k [..., H_kv, N_k, d_k]   v [..., H_kv, N_k, d_v]
    options.topk: the lists [..., H_kv or H, N_q, K] (-1, or any index outside [0, N_k), pads;
                  past a row's topk_length too)   ->   out [..., H, N_q, d_v],  lse [..., H, N_q]

For the G query heads of one kv head and a block of rows, each row's listed keys L are gathered,
k_L [G, b, K, d_k] and v_L [G, b, K, d_v], and the block of scores is a gathered block of the
score pipeline (scores.py): its entry t in row i is the score S[.., i, L_t].
    1.   s_t = scale q_i . k_{L_t}
    2-4. scores.forward: the score and keep steps, each read at (i, L_t) (score_mod and mask_mod
         with kv_idx = L_t); -inf where an entry pads
    5.   softmax_row: P, lse (and the sink)
    6-7. out_i = sum_t P~_t v_{L_t}   (P~ = P times the dropout scale read at (i, L_t))
A key listed c times is gathered c times: c times its weight, as dense attention's S + log c.
Backward, the flash form (P recomputed from lse, as FlashAttention's):
    dP_t = dout_i . v_{L_t},  softmax_row_backward,  scores.backward (dbias scattered back to
    (i, L_t), the other parameters' gradients: ScoreGrads)
    dq_i = scale sum_t dS_t k_{L_t},  dk_{L_t} += scale dS_t q_i,  dv_{L_t} += P~_t dout_i
    (scatter-adds: every use of a key sums, by several rows or twice by one)
Forward mode: scores.tangent and softmax_row_tangent on the block,
    out_dot_i = sum_t (P~_dot_t v_{L_t} + P~_t v_dot_{L_t}).
A row that keeps no listed key follows fully_masked as dense attention does: out 0 ('zero'),
the mean of all N_k values ('uniform': dv gets dout / N_k; with dropout, its row of the mask),
NaN ('nan': dv NaN).

Memory: a block's gathered keys, one of k's or v's at a time, never [N_q, N_k]; block rows
(plan.block_size) default to as many as gather GATHER_ROWS keys per head. The cache holds out
and lse; the backward recomputes each block's scores.

Tasks (engines/parallel.py: threads with `workers`, a Dask cluster with `scheduler`): the
forward's and JVP's spans of about TASK_ROWS query rows of each (batch index, kv head); the
backward's (batch index, kv head) slices, each summing its dk, dv over its blocks in order.
The bits are the same on any number of workers or a cluster.
"""
import numpy as np
import scipy.sparse

from .._layout import kv_index, kv_slices, spans_slices, tiles, with_head_axis
from .. import scores
from ..caches import AttentionGrads, TiledAttentionCache
from ..score_grads import ScoreGrads
from ..scores import block_of, keep_mask
from ..softmax_row import (masked_row_weight, softmax_row, softmax_row_backward, softmax_row_tangent,
                           weights_from_lse)
from ..topk import listed
from .parallel import run_tasks

GATHER_ROWS = 2 ** 15   # a block gathers at most this many keys a head (block rows times K) by default
TASK_ROWS = 2 ** 10     # a task of the forward or JVP takes about this many query rows (whole blocks)


def default_block_rows(n_top):
    """The block rows that gather GATHER_ROWS keys a head with lists of n_top entries."""
    return max(1, GATHER_ROWS // max(1, n_top))


def sparse_forward(q, k, v, options, plan):
    """out [..., H, N_q, d_v] and a TiledAttentionCache (out, lse and max_logits inside) of the
    lists in options.topk; q, k, v and options as attention_options returns them."""
    out, lse, top = _run_spans(q, k, v, options, plan)
    return out, TiledAttentionCache(options=options, q=q, k=k, v=v, out=out.copy(), lse=lse, max_logits=top,
                                    plan=plan)


def sparse_jvp(q, k, v, options, plan, q_dot, k_dot, v_dot, score_dots, row_dots):
    """(out, out_dot, lse, lse_dot) along the tangents (of their primals' shapes; score_dots and
    row_dots: the tangents of the options that act in the score steps and in the row's, by their
    keywords in scores.tangent and softmax_row_tangent; None: 0), the blocks as sparse_forward's."""
    tangents = {"q_dot": q_dot, "k_dot": k_dot, "v_dot": v_dot, "score_dots": score_dots, "row_dots": row_dots}
    out, lse, _, out_dot, lse_dot = _run_spans(q, k, v, options, plan, tangents)
    return out, out_dot, lse, lse_dot


def _run_spans(q, k, v, o, plan, tangents=None):
    """(out, lse, max_logits[, out_dot, lse_dot]) of every span's blocks (`_span`), joined."""
    q3, k3, v3 = with_head_axis(q), with_head_axis(k), with_head_axis(v)
    score_shape = q3.shape[:-1] + (k3.shape[-2],)
    group, n_q = q3.shape[-3] // k3.shape[-3], score_shape[-2]
    spans = tiles(n_q, plan.block_size * max(1, TASK_ROWS // plan.block_size))
    items = [(at, rows) for at in kv_slices(score_shape, group) for rows in spans]
    shared = {"o": o, "score_shape": score_shape, "block_rows": plan.block_size, "q3": q3, "k3": k3, "v3": v3}
    if tangents is not None:
        shared.update({**tangents, **{name: with_head_axis(tangents[name]) for name in ("q_dot", "k_dot", "v_dot")}})
    rows_of = q3.shape[:-1]
    outs = [np.empty(rows_of + v3.shape[-1:], q3.dtype), np.empty(rows_of, q3.dtype), np.empty(rows_of, q3.real.dtype)]
    if tangents is not None:
        outs += [np.empty(outs[0].shape, q3.dtype), np.empty(rows_of, q3.dtype)]
    for (at, rows), results in zip(items, run_tasks(_span, items, plan.workers, shared, plan.scheduler)):
        for whole, part in zip(outs, results):
            whole[at + (rows,)] = part
    rows, outs_of = q.shape[:-1], q.shape[:-1] + v.shape[-1:]              # the caller's layout
    shapes = [outs_of, rows, rows] + ([outs_of, rows] if tangents is not None else [])
    return [x.reshape(shape) for x, shape in zip(outs, shapes, strict=True)]


def _lists(o, at, rows):
    """The lists of the rows `rows` of the prefix `at` (a kv_slices one: a batch index, the G query
    heads of a kv head) as [G, b, K] int64 (lists per query head) or [1, b, K] (one list per kv
    head: its keys are gathered once for its G query heads), -1 where an entry names no key
    (padding, outside [0, N_k), past its row's topk_length; every entry when N_k = 0)."""
    t, heads = o.topk, at[-1]
    per_kv_head = slice(heads.start // t.groups, heads.start // t.groups + 1)     # (t.groups = G)
    lists = t.indices[at[:-1] + ((heads if t.groups == 1 else per_kv_head), rows)]
    lengths = None if t.lengths is None else t.lengths[at[:-1] + (rows,)]
    idx = np.where(listed(lists, lengths, t.n_k), lists.astype(np.int64, copy=False), -1)
    idx = idx.reshape(idx.shape[-3:])
    return idx[..., :0] if t.n_k == 0 else idx


def _block_scores(o, score_shape, at, rows, q_rows, k_h, idx):
    """Steps 1-4 on the gathered block of the rows `rows` of prefix `at`, q_rows [G, b, d_k],
    k_h [N_k, d_k] its kv head's keys and idx [G or 1, b, K] their lists (_lists): (S [.., G, b,
    K], scores.Saved, keep, index, k_L [G or 1, b, K, d_k])."""
    cols = np.maximum(idx, 0)
    index = at + (rows, cols)
    k_listed = k_h[cols]                                                   # [G or 1, b, K, d_k]
    s = _dots(q_rows, k_listed) * o.scale                                 # 1. s_t = scale q . k_{L_t}
    s = s.reshape((1,) * (len(score_shape) - 3) + s.shape)                 # the scores' axes
    keep = keep_mask(o, score_shape, index)
    keep = idx >= 0 if keep is None else keep & (idx >= 0)
    s, saved = scores.forward(s, o, score_shape, index, keep)              # 2-4.
    return s, saved, keep, index, k_listed


def _dots(x, listed_rows):
    """[G, b, d] . [G or 1, b, K, d] -> [G, b, K]: each row with its K gathered rows."""
    return (x[..., None, :] @ np.swapaxes(listed_rows, -1, -2))[..., 0, :]


def _mix(weights, listed_rows):
    """[.., G, b, K] x [G or 1, b, K, d] -> [G, b, d]: each row's weighted sum of its gathered rows."""
    return (weights.reshape(weights.shape[-3:])[..., None, :] @ listed_rows)[..., 0, :]


def _dropped(P, o, score_shape, index):
    """P~ = P times the dropout scale at the block (P itself without dropout)."""
    return P if o.dropout_scale is None else P * block_of(o.dropout_scale, score_shape, index)


def _row_options(o):
    """The options softmax_row takes for a gathered block: its weights 0 in a row without keys
    (the row's policy is applied to all N_k keys: _no_key)."""
    return o if o.fully_masked == "zero" else o._replace(fully_masked="zero")


def _uniform_rows(o, score_shape, at, rows, dead):
    """The 'uniform' policy's weights over all N_k keys of each row without a key (dead [G, b]),
    in np.argwhere(dead)'s order: [n, N_k], 1 / N_k times the row's dropout scale, read a row at
    a time (never [b, N_k] of them); without dropout [1, N_k], every such row's."""
    weight = masked_row_weight("uniform", score_shape[-1])
    if o.dropout_scale is None:
        return np.full((1, score_shape[-1]), weight)
    row = lambda g, i: at[:-1] + (slice(at[-1].start + g, at[-1].start + g + 1), slice(rows.start + i, rows.start + i + 1),
                                  slice(None))
    return np.stack([weight * block_of(o.dropout_scale, score_shape, row(g, i)).reshape(-1)
                     for g, i in np.argwhere(dead)]).reshape(-1, score_shape[-1])


def _nan(dtype):
    """NaN in `dtype` (a complex one's: NaN in both parts, as 0 * NaN gives on the dense engines)."""
    return np.array(complex(np.nan, np.nan) if np.dtype(dtype).kind == "c" else np.nan, dtype)


def _no_key(x, dead, o, score_shape, at, rows, values):
    """x [G, b, d_v] (out or out_dot) where rows have no key (dead [G, b]) by fully_masked: as
    computed (0) for 'zero', the 'uniform' weights times `values` [N_k, d_v] (v or v_dot), NaN."""
    if o.fully_masked == "zero" or not dead.any():
        return x
    if o.fully_masked == "nan":
        return np.where(dead[..., None], _nan(x.dtype), x)
    x = x.copy()
    x[dead] = _uniform_rows(o, score_shape, at, rows, dead) @ values
    return x


def _span(at, span, *, o, score_shape, block_rows, q3, k3, v3, k_dot=None, v_dot=None, **tangents):
    """One task of the forward (or, with tangents, the JVP): the blocks of the rows `span` of prefix
    `at`, each (out [G, b, d_v], lse, max_logits [G, b][, out_dot, lse_dot]) written into the span's."""
    kv = kv_index(at, q3.shape[-3] // k3.shape[-3])
    head = lambda x: None if x is None else x[kv].reshape(x.shape[-2:])   # its kv head's [N_k, d]
    k_h, v_h = head(k3), head(v3)
    if k_dot is not None:
        tangents.update(kd_h=head(k_dot), vd_h=head(v_dot))
    results = None
    for part in tiles(span.stop - span.start, block_rows):
        rows = slice(span.start + part.start, span.start + part.stop)
        parts = _forward_block(o, score_shape, at, rows, q3, k_h, v_h, **tangents)
        if results is None:
            results = [np.empty(p.shape[:1] + (span.stop - span.start,) + p.shape[2:], p.dtype) for p in parts]
        for result, p in zip(results, parts):
            result[:, part] = p
    return results


def _forward_block(o, score_shape, at, rows, q3, k_h, v_h, q_dot=None, kd_h=None, vd_h=None, score_dots=None,
                   row_dots=None):
    """(out [G, b, d_v], lse, max_logits [G, b][, out_dot, lse_dot]) of one block (a function of
    its own, so that its gathered keys and values are gone before the next block gathers)."""
    heads, b = at[-1].stop - at[-1].start, rows.stop - rows.start
    q_rows = q3[at + (rows,)].reshape((heads, b, q3.shape[-1]))
    s, saved, keep, index = _block_scores(o, score_shape, at, rows, q_rows, k_h,      # 1-4. (k_L not held)
                                          _lists(o, at, rows))[:4]
    top = scores.row_max(s, o, score_shape, index).reshape(heads, b)  # the row's largest score
    P, lse, _ = softmax_row(s, _row_options(o), score_shape, index)   # 5. (s its scratch)
    cols = index[-1]
    v_listed = v_h[cols]
    dead = np.isneginf(lse.real).reshape(heads, b)
    out = _no_key(_mix(_dropped(P, o, score_shape, index), v_listed), dead, o, score_shape, at, rows, v_h)   # 6-7.
    if q_dot is None:
        return out, lse.reshape(heads, b), top
    qd_rows = q_dot[at + (rows,)].reshape(q_rows.shape)                # forward mode
    s_dot = (_dots(qd_rows, k_h[cols]) + _dots(q_rows, kd_h[cols])) * o.scale   # 1.
    s_dot = scores.tangent(s_dot.reshape(s.shape), o, score_shape, index, saved, keep, **score_dots)   # 2-4.
    P_dot, lse_dot = softmax_row_tangent(P, lse, s_dot, _row_options(o), score_shape=score_shape, index=index,
                                         **row_dots)                   # 5.
    P_dot = P_dot[..., :s.shape[-1]]                                   # (the sink's multiplies no value)
    out_dot = _mix(_dropped(P_dot, o, score_shape, index), v_listed) + \
        _mix(_dropped(P, o, score_shape, index), vd_h[cols])          # 6-7.
    lse_dot = lse_dot.reshape(heads, b)
    return (out, lse.reshape(heads, b), top, _no_key(out_dot, dead, o, score_shape, at, rows, vd_h),
            np.where(dead, _nan(lse_dot.dtype), lse_dot) if o.fully_masked == "nan" else lse_dot)


def sparse_backward(dout, cache, dlse=None, *, method="flash", return_stages=False):
    """AttentionGrads of sparse_forward (module docstring: the flash form), a task per (batch
    index, kv head); method 'vjp' names the same computation here, 'jacobian' and return_stages
    need the [N_q, N_k] weights: ValueError."""
    if method == "jacobian" or return_stages:
        raise ValueError("method='jacobian' and return_stages=True need the [N_q, N_k] weights, which the "
                         "sparse engine never forms; use implementation='blocked' or 'textbook'")
    o, plan = cache.options, cache.plan
    q3, k3, v3, dout3 = (with_head_axis(x) for x in (cache.q, cache.k, cache.v, dout))
    score_shape = q3.shape[:-1] + (k3.shape[-2],)
    group = q3.shape[-3] // k3.shape[-3]
    lse = cache.lse.reshape(score_shape[:-1])
    with np.errstate(invalid="ignore"):                                # a row with no key: D unused
        D = np.where(np.isneginf(lse.real), 0, np.sum(dout3 * with_head_axis(cache.out), axis=-1))
    dlse3 = None if dlse is None else dlse.reshape(score_shape[:-1])
    slices = kv_slices(score_shape, group)
    # one task for all slices where the bias broadcasts across them (its gradient sums over them:
    # one copy of it, not one a slice), else a task a slice
    whole = o.bias is not None and spans_slices(o.bias, len(score_shape), score_shape)
    items = [(slices,)] if whole else [([at],) for at in slices]
    shared = {"o": o, "score_shape": score_shape, "block_rows": plan.block_size, "q3": q3, "k3": k3, "v3": v3,
              "dout3": dout3, "D": D, "lse": lse, "dlse": dlse3}
    results = run_tasks(_backward_slices, items, plan.workers, shared, plan.scheduler)
    dtype = np.result_type(q3, dout3)
    dq, dk, dv = np.empty(q3.shape, dtype), np.empty(k3.shape, dtype), np.empty(v3.shape, dtype)
    for (ats,), (grads, _) in zip(items, results):
        for at, (dq_s, dk_s, dv_s) in zip(ats, grads):
            dq[at], dk[kv_index(at, group)], dv[kv_index(at, group)] = dq_s, dk_s, dv_s
    return AttentionGrads(dq=dq.reshape(cache.q.shape), dk=dk.reshape(cache.k.shape), dv=dv.reshape(cache.v.shape),
                          **ScoreGrads.total([r[-1] for r in results], o, score_shape, dtype))


def _backward_slices(ats, *, o, score_shape, block_rows, q3, k3, v3, dout3, D, lse, dlse):
    """One task of the backward: the slices `ats` (kv_slices prefixes: the G query heads of a kv
    head), in order -> ([(dq, dk, dv) of each], their ScoreGrads), each slice's dk and dv
    summed over its blocks in order."""
    params = ScoreGrads(o, score_shape, np.result_type(q3, dout3), region=[at + (slice(None), slice(None))
                                                                           for at in ats])
    return [_backward_slice(at, o, score_shape, block_rows, q3, k3, v3, dout3, D, lse, dlse, params)
            for at in ats], params


def _backward_slice(at, o, score_shape, block_rows, q3, k3, v3, dout3, D, lse, dlse, params):
    """(dq, dk, dv) of the slice `at` (dout3 [.., H, N_q, d_v]; D, lse, dlse [.., H, N_q]), its
    parameters' gradients added to params."""
    kv = kv_index(at, q3.shape[-3] // k3.shape[-3])
    k_h, v_h = k3[kv].reshape(k3.shape[-2:]), v3[kv].reshape(v3.shape[-2:])
    heads, dtype, n_q = at[-1].stop - at[-1].start, np.result_type(q3, dout3), score_shape[-2]
    q_heads, dout = q3[at].reshape((heads, n_q, q3.shape[-1])), dout3[at].reshape((heads, n_q, dout3.shape[-1]))
    dq, dk, dv = np.empty(q_heads.shape, dtype), np.zeros(k_h.shape, dtype), np.zeros(v_h.shape, dtype)
    for rows in tiles(n_q, block_rows):
        block = lambda x: None if x is None else x[at + (rows,)]
        dq[:, rows] = _backward_block(o, score_shape, at, rows, q_heads[:, rows], dout[:, rows], block(D),
                                      block(lse), block(dlse), k_h, v_h, dk, dv, params)
    dead = np.isneginf(lse[at].real).reshape(heads, n_q)
    if o.fully_masked != "zero" and dead.any():                            # rows with no key: all N_k keys
        if o.fully_masked == "nan":
            dv[...] = _nan(dtype)
        else:                                                              # dv += w^T dout of each such row
            weights = _uniform_rows(o, score_shape, at, slice(0, n_q), dead)   # (one row for all: their douts' sum)
            douts = dout[dead] if o.dropout_scale is not None else dout[dead].sum(axis=0, keepdims=True)
            dv += weights.T @ douts
    return dq, dk, dv


def _backward_block(o, score_shape, at, rows, q_rows, dout, D, lse, dlse, k_h, v_h, dk, dv, params):
    """The backward of one block (q_rows [G, b, d_k], dout [G, b, d_v]; D, lse, dlse [.., G, b]):
    its dq [G, b, d_k], returned; its shares of dk, dv scattered into them and its parameters'
    gradients added to params (a function of its own, so that its gathered keys are gone
    before the next block gathers values)."""
    idx = _lists(o, at, rows)
    dp = _dots(dout, v_h[np.maximum(idx, 0)])                          # 7. dP~ = dout . v_L (one gather
    s, saved, keep, index, k_listed = _block_scores(o, score_shape, at, rows, q_rows, k_h, idx)   # at a time)
    cols = index[-1]
    P = weights_from_lse(s, lse)                                       # 5. P = exp(S - lse), in S's place
    dp = _dropped(dp.reshape(P.shape), o, score_shape, index)          # 6.
    ds, dsink = softmax_row_backward("flash", dp, D, P, lse, None, dlse, o, score_shape, index,
                                     overwrite_dp=True)                # 5.
    if dsink is not None:
        params.add_sink(dsink.sum(axis=-1), index)
    ds = scores.backward(ds, o, score_shape, index, saved, keep, params)   # 4-2.
    ds = ds.reshape(ds.shape[-3:])
    _scatter(dk, cols, ds * o.scale, q_rows)                           # 1. dk_L += scale dS q
    _scatter(dv, cols, _dropped(P, o, score_shape, index).reshape(ds.shape), dout)   # dv_L += P~ dout
    return _mix(ds, k_listed) * o.scale                                #    dq = scale dS k_L


def _scatter(target, cols, weights, rows_of):
    """target [N_k, d] += for every entry t of each row i: weights_it rows_of_i at key cols_it,
    i.e. M rows_of with M [N_k, b] the sum of weights_it at (cols_it, i) (a scipy.sparse matrix:
    a key listed several times gets every weight; a padding entry's weight is 0), head by head.
    cols [G or 1, b, K], weights [G, b, K]; rows_of [G, b, d]."""
    cols = np.broadcast_to(cols, weights.shape)
    n_rows, top = cols.shape[-2], cols.shape[-1]
    row = np.repeat(np.arange(n_rows), top)
    for h in range(cols.shape[0]):
        m = scipy.sparse.csr_matrix((weights[h].ravel(), (cols[h].ravel(), row)), shape=(target.shape[0], n_rows))
        target += m @ rows_of[h]
