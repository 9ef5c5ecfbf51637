"""The blocked engine: the textbook's steps (textbook.py) on blocks of query rows.

Shape legend as in textbook.py; G = H / H_kv query heads per kv head.

The weights P [..., H, N_q, N_k] are stored whole (the backward and MultiHeadAttention's
attn_weights need them), but every other step runs on one block of rows at a time,
about BLOCK_BYTES of scores (less for smaller scores: row_blocks), so that each
element-wise pass of the softmax and its backward works on a block in the processor's cache
instead of streaming [N_q, N_k] arrays through memory. Softmax is row-wise: the blocks change
nothing but the order of dk's and dv's sums (and the columns skipped, below). The scores S
are never stored (cache.scores recomputes them): each block's scores are computed straight
into its rows of P, and the softmax runs there in place.

Key columns that masking removes from every row of a block (the keep steps of
scores.keep_mask, a -inf bias: `_kept_columns`) are skipped: their weights are set to 0
and nothing else is computed there, forward or backward, which saves about half of a long
causal attention's work. The sums then run over fewer (exactly zero) terms, so
results agree with the textbook to rounding, not bit for bit.

A block is an index tuple (one slice per leading axis, heads, rows) into [..., H, N_q]:
the whole problem when it fits, else one leading index at a time, then groups of heads,
then one head in slices of rows. A slice of heads holds whole groups of G (or a single
head), so its queries meet their kv heads by `grouped_matmul` as in the textbook.

Two details of the backward, each chosen for speed:
- dk and dv are accumulated over the blocks as their transposes, dk^T += scale q^T dS and
  dv^T += dout^T P~: a wide [d, N_k] product, which BLAS runs faster than the tall [N_k, d]
  one with a transposed operand. One task takes a kv head's blocks, in order, then scales
  and transposes its sums into dk's and dv's rows; each block scales its own dq and sums its
  own D = rowsum(dout * out): every pass on the threads, none left whole after.
- softmax_backward shifts each row of dP at the row's largest P; the forward keeps that
  index (cache.top), so the backward does not search P for it again.
"""
import math

import numpy as np

from .._layout import grouped_matmul, grouped_sum_matmul, kv_index, scaled, with_head_axis
from ..caches import AttentionCache, AttentionGrads, AttentionStages
from ..options import EVERY_SCORE
from .. import scores
from ..score_grads import ScoreGrads
from ..scores import keep_mask
from .parallel import run_tasks
from ..positions import banded
from ..softmax_row import softmax_row, softmax_row_backward, with_sink

BLOCK_BYTES = 8 << 20       # scores per block: the best of 1-32 MiB measured here (a few MiB, about L2)
SHARES = 4                  # smaller blocks for smaller scores, so that they come in this many for the
MIN_BLOCK_BYTES = 2 << 20   # threads to share, down to this size (the blocks depend on the shape alone)


def row_blocks(score_shape, group, itemsize, diagonal=False):
    """The blocks of rows of the scores [..., H, N_q, N_k], each about BLOCK_BYTES, or a
    SHARES-th of the scores where that is less (but not below MIN_BLOCK_BYTES): scores of
    8 MiB come in 4 blocks that threads can share, where BLOCK_BYTES would leave one.
    diagonal: the kept columns move with the rows (the banded keep steps of positions.py), so
    a block of fewer rows skips more columns: blocks of at most a SHARES-th of N_q's rows too
    (not below MIN_BLOCK_BYTES). Causal, a quarter of the rows skips
    about 3/8 of the scores where a whole head skips none.

    Returns index tuples (one slice per leading axis, heads, rows): every axis kept, so a
    block of any array broadcastable to the scores is x[block]. Head slices hold whole
    groups of `group` query heads, or a single head.
    """
    *lead, h, n_q, n_k = score_shape
    budget = min(BLOCK_BYTES, max(MIN_BLOCK_BYTES, math.prod(score_shape) * itemsize // SHARES))
    if diagonal:
        budget = min(budget, max(MIN_BLOCK_BYTES, n_q // SHARES * n_k * itemsize))
    fit = max(1, budget // max(1, n_k * itemsize))                  # rows of scores per block
    if math.prod(lead) * h * n_q <= fit:
        return [(slice(None),) * len(lead) + (slice(0, h), slice(0, n_q))]
    if h * n_q <= fit:                                               # all heads of one index
        heads, rows = h, n_q
    elif n_q <= fit:                                                 # some heads, whole groups
        heads, rows = fit // n_q, n_q
        heads = heads - heads % group if heads >= group else 1
    else:                                                            # one head, slices of rows
        heads, rows = 1, fit
    return [tuple(slice(i, i + 1) for i in index) + (slice(h0, min(h0 + heads, h)),
                                                      slice(r0, min(r0 + rows, n_q)))
            for index in np.ndindex(*lead) for h0 in range(0, h, heads) for r0 in range(0, n_q, rows)]


def _kept_columns(options, score_shape, block, skip=True):
    """(cols, keep): the block's columns computed and its keep mask on them.

    cols [c0, c1), a slice, holds every kept score of the block's rows: outside it the keep
    steps (scores.keep_mask) or a -inf bias remove the whole column
    from all of the block's rows, so its weights are 0 and so are its gradients. All N_k
    columns with skip=False, and where a removed score still counts (_every_score_counts).
    keep: broadcastable to the block's scores on cols, None where every score is kept.
    """
    o, n_k = options, score_shape[-1]
    keep = keep_mask(o, score_shape, block + (slice(None),))        # broadcastable to the block
    if keep is None:
        return slice(0, n_k), None
    keep = np.broadcast_to(keep, keep.shape[:-1] + (n_k,))
    if not skip or _every_score_counts(o):
        return slice(0, n_k), keep
    kept = np.flatnonzero(keep.any(axis=tuple(range(keep.ndim - 1))))   # columns kept in any row
    cols = slice(int(kept[0]), int(kept[-1]) + 1) if kept.size else slice(0, 0)
    return cols, keep[..., cols]


def _every_score_counts(options):
    """Whether a removed score still counts, so no column is skipped: an option whose step reads
    every score (options.EVERY_SCORE), the 'uniform' and 'nan' policies (a fully masked row's
    weights are not 0)."""
    return bool(options.given & EVERY_SCORE) or options.fully_masked != "zero"


def _diagonal(options):
    """Whether the columns a block skips (_kept_columns) move with its rows: a banded keep step
    (positions.banded) or one of scores.KEEP_STEPS, where columns are skipped at all."""
    o = options
    return (banded(o) or bool(o.keep_steps)) and not _every_score_counts(o)


def _block_scores(q3, k3, options, score_shape, block, group, cols, keep, out=None):
    """Steps 1-4 on a block's columns `cols` (keep: their keep mask, _kept_columns): (S,
    scores.Saved), S [..., heads, rows, cols] fresh, or written into `out`."""
    k_cols = k3[kv_index(block[:-1], group)][..., cols, :]
    s = grouped_matmul(scaled(q3[block], options.scale), np.swapaxes(k_cols, -1, -2), out=out)   # 1.
    return scores.forward(s, options, score_shape, block + (cols,), keep)                        # 2-4.


def blocked_forward(q, k, v, options, plan):
    """The textbook forward, block by block, on plan.workers threads; returns out [..., H, N_q, d_v]
    and an AttentionCache."""
    o = options
    q3, k3, v3 = with_head_axis(q), with_head_axis(k), with_head_axis(v)
    score_shape = q3.shape[:-1] + (k3.shape[-2],)                    # [..., H, N_q, N_k]
    group = q3.shape[-3] // k3.shape[-3]
    p = (np.zeros if o.masked else np.empty)(score_shape, q.dtype)   # skipped columns weigh 0
    saved = scores.Saved.whole(o, score_shape, q.dtype)              # the steps' saved stages
    lse = np.empty(score_shape[:-1], q.dtype)                        # [..., H, N_q]
    top = np.empty(score_shape[:-1] + (1,), np.intp)
    max_logits = np.empty(score_shape[:-1], q.real.dtype)           # [..., H, N_q]
    out = np.empty(q3.shape[:-1] + v3.shape[-1:], q.dtype)           # [..., H, N_q, d_v]
    saved_out = np.empty_like(out)                                   # the cache's copy
    def forward_block(block):                                        # writes only its own rows
        cols, keep = _kept_columns(o, score_shape, block)            # the columns computed; the
        p_block, index = p[block], block + (cols,)                   # rest keep P's zeros
        s, saved_block = _block_scores(q3, k3, o, score_shape, block, group, cols, keep,   # 1-4. S in
                                       out=p_block[..., cols])                   # P's place
        for whole, part in zip(saved, saved_block):
            if part is not None:
                whole[index] = part
        max_logits[block] = scores.row_max(s, o, score_shape, index)   # each row's largest score
        _, lse[block], top_cols = softmax_row(s, o, score_shape, index,   # 5. P = softmax(S), lse,
                                              out=p_block[..., cols])      #    in P's place
        dead = np.isneginf(lse[block].real)[..., None]               # fully masked rows
        top[block] = np.where(dead, 0, top_cols + cols.start)        # in the whole row; dead: 0, as one block
        p_drop = p_block[..., cols]
        if o.dropout_scale is not None:                              # 6. dropout
            p_drop = p_drop * np.broadcast_to(o.dropout_scale, score_shape)[index]
        out[block] = grouped_matmul(p_drop, v3[kv_index(block[:-1], group)][..., cols, :])   # 7. out = P~ v
        saved_out[block] = out[block]
    blocks = row_blocks(score_shape, group, p.itemsize, _diagonal(o))
    run_tasks(forward_block, [(block,) for block in blocks], plan.workers)
    out = out.reshape(q.shape[:-1] + v.shape[-1:])
    shape = lambda x: None if x is None else x.reshape(q.shape[:-1] + x.shape[-1:])
    return out, AttentionCache(options=o, q=q, k=k, v=v, out=shape(saved_out), weights=shape(p),
                               lse=lse.reshape(q.shape[:-1]), top=top.reshape(q.shape[:-1]),
                               saved=saved.map(shape), plan=plan, max_logits=max_logits.reshape(q.shape[:-1]))


def blocked_backward(dout, cache, dlse=None, *, method="vjp", return_stages=False):
    """The textbook backward, block by block; returns AttentionGrads (see attention_backward)."""
    o = cache.options
    q3, k3, v3, dout3 = (with_head_axis(x) for x in (cache.q, cache.k, cache.v, dout))
    p = with_head_axis(cache.weights)
    score_shape = p.shape
    group = q3.shape[-3] // k3.shape[-3]
    dropout_scale = None if o.dropout_scale is None else np.broadcast_to(o.dropout_scale, score_shape)
    saved = cache.saved.map(with_head_axis)
    out3 = with_head_axis(cache.out)
    lse, top = cache.lse.reshape(score_shape[:-1]), cache.top.reshape(score_shape[:-1] + (1,))
    dlse3 = None if dlse is None else dlse.reshape(score_shape[:-1])
    dtype = np.result_type(dout, p)
    dq, dk, dv = np.empty(q3.shape, dtype), np.empty(k3.shape, dtype), np.empty(v3.shape, dtype)
    D = np.empty(score_shape[:-1], dtype)                            # [..., H, N_q] rowsum(dout * out)
    dP = np.empty(score_shape, dtype) if return_stages else None     # whole stages when asked for,
    dS = np.empty(score_shape, dtype) if return_stages else None
    def backward_block(block, dkT, dvT, params):                     # dk^T, dv^T: its kv heads' sums
        kv = kv_index(block[:-1], group)                             # the block's k and v
        cols, keep = _kept_columns(o, score_shape, block, skip=dP is None)   # whole stages: every column
        index, n_kv = block + (cols,), kv[-1].stop - kv[-1].start    # its scores; outside: dS = 0
        k_cols, v_cols, p_cols = k3[kv][..., cols, :], v3[kv][..., cols, :], p[block][..., cols]
        # 7. out = P~ v:  dv^T = dout^T P~ (summed over the group),  dP~ = dout v^T
        p_drop = p_cols if dropout_scale is None else p_cols * dropout_scale[index]
        dvT[..., cols] += grouped_sum_matmul(dout3[block], p_drop, n_kv)
        dp = grouped_matmul(dout3[block], np.swapaxes(v_cols, -1, -2))
        if dropout_scale is not None:                                # 6. dP = dP~ * mask / (1 - p)
            dp *= dropout_scale[index]
        if dP is not None:
            dP[block] = dp
        # 5. dS = P * (dP - D), D = rowsum(P * dP) = rowsum(dout * out) (+ P * dlse)
        D[block] = np.sum(dout3[block] * out3[block], axis=-1)
        recompute = lambda: with_sink(_block_scores(q3, k3, o, score_shape, block, group, cols, keep)[0], o,
                                      score_shape, index)
        ds, dsink = softmax_row_backward(method, dp, D[block], p_cols, lse[block],
                                         _top_in(top[block], cols, score_shape[-1]),
                                         None if dlse is None else dlse3[block], o, score_shape, index,
                                         scores=recompute, overwrite_dp=True)
        if dsink is not None:                                        #    the sink's column
            params.add_sink(dsink.sum(axis=-1), index)
        ds = scores.backward(ds, o, score_shape, index, saved.at(index), keep, params,   # 4-2.
                             stage=dS is not None)
        if dS is not None:                                           # the whole stage dS
            ds, ds3 = ds
            dS_block = dS[block]
            dS_block[..., :cols.start], dS_block[..., cols], dS_block[..., cols.stop:] = 0, ds3, 0
        dq[block] = scaled(grouped_matmul(ds, k_cols), o.scale)      # 1. dq = scale dS k
        dkT[..., cols] += grouped_sum_matmul(q3[block], ds, n_kv)    #    dk^T = scale q^T dS

    def backward_kv(blocks):                                         # one kv head's blocks, in order
        kv = kv_index(blocks[0][:-1], group)
        dkT = np.zeros(dk[kv].shape[:-2] + dk.shape[:-3:-1], dtype)  # [..., n_kv, d_k, N_k]
        dvT = np.zeros(dv[kv].shape[:-2] + dv.shape[:-3:-1], dtype)  # [..., n_kv, d_v, N_k]
        params = ScoreGrads(o, score_shape, dtype, region=blocks)     # its blocks' parameters' gradients
        for block in blocks:
            backward_block(block, dkT, dvT, params)
        dk[kv] = np.swapaxes(scaled(dkT, o.scale), -1, -2)
        dv[kv] = np.swapaxes(dvT, -1, -2)
        return params

    regions = run_tasks(backward_kv, [(blocks,) for blocks in _by_kv_heads(
        row_blocks(score_shape, group, p.itemsize, _diagonal(o) and dP is None), group)], cache.plan.workers)
    stages = None
    if return_stages:
        stages = AttentionStages(dP=dP.reshape(cache.weights.shape), dS=dS.reshape(cache.weights.shape),
                                 D=D.reshape(cache.lse.shape))
    return AttentionGrads(dq=dq.reshape(cache.q.shape), dk=dk.reshape(cache.k.shape),
                          dv=dv.reshape(cache.v.shape), stages=stages,
                          **ScoreGrads.total(regions, o, score_shape, dtype))


def _top_in(top, cols, n_k):
    """Each row's top index (the forward's, of the whole row) within the columns `cols`; a fully
    masked row's 0 becomes the first column (its weights and gradients are 0 anyway)."""
    if cols.start == 0 and cols.stop == n_k:
        return top
    return np.clip(top - cols.start, 0, max(cols.stop - cols.start - 1, 0))


def _by_kv_heads(blocks, group):
    """The blocks grouped by the kv heads they accumulate dk, dv into, each group in order."""
    groups = {}
    for block in blocks:
        key = tuple((s.start, s.stop) for s in kv_index(block[:-1], group))
        groups.setdefault(key, []).append(block)
    return list(groups.values())
