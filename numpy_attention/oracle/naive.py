"""The naive baseline: attention in the candidate's dtype, its sums added as a plain kernel adds them.

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

Shapes as in textbook.py; the steps are textbook.py's:
    S = scale q k^T -> the score steps -> masks -> P = softmax(S), lse -> P~ = P * dropout
    -> out = P~ v;   backward: P = exp(S - lse),  dv = P~^T dout,  dP = (dout v^T) * dropout,
    D = rowsum(dout * out),  dS = P (dP - D),  dbias = dS summed to bias's shape,
    dq = scale dS k,  dk = scale dS^T q

Two kinds of sums, added two ways (CHUNK = 32):
- over the head width, d_k or d_v terms (S = q k^T, dP = dout v^T, D = rowsum(dout * out)):
  left to right in the dtype, s = (((x1 + x2) + x3) + ...)  (recursive_matmul). A real
  float32 kernel adds these short sums as float32 chains, and with a sharp softmax their
  error dominates its own: a baseline summing them in float64 would be too accurate, and
  honest kernels would fail.
- over the keys or the rows, N_k or N_q terms (the softmax's row sum, out = P~ v and
  dq = dS k over the keys; dk = dS^T q and dv = P~^T dout over the rows, for grouped-query
  heads over the rows of the group's heads in order, head 0's rows, then head 1's, ...):
  in chunks of CHUNK consecutive terms at fixed positions (keys 0..31, 32..63, ...; rows
  likewise), each chunk's sum one float64 BLAS product (a product of two float32 values is
  exact in float64), rounded to the dtype, the chunks' sums added left to right in the dtype:
      acc = dtype(acc + dtype(sum of the chunk's terms in float64))      (acc from +0)
  This runs at BLAS speed where a left-to-right sum takes N NumPy passes, and changes the
  baseline's error little: its max-abs error is 0.83-1.00 times that of the long sums left
  to right (each tensor's median over 20 random float32 cases; 0.42-1.19 in any one case:
  benchmarks/naive_chunks.py). A chunk's float64 sum is rounded once more, so BLAS's kernel
  (its order of the 32 terms) may move a float32 result by an ulp, about once in 2^28 entries;
  in float64 the chunks are float64 sums of float64 products, whose last bits may depend on it.
exp and log are computed in float64 and rounded to the dtype (in float64: numpy's own), so
that float32's results do not depend on the SIMD code numpy picks for float32 on a processor.

Computed a tile of CHUNK query rows at a time: query head g of each group of G = H / H_kv
heads (heads g, g + G, ...), so that the tile meets the kv heads one to one, and rows at
fixed positions (0..31, 32..63, ...); the tiles go group head by group head, rows in order,
and dk, dv continue one running sum over them. Each BLAS product is of one chunk of keys and
one tile of rows, of the same shapes wherever they are: the results do not depend on how a
case is cut (crosscheck's slices, oracle/slices.py), and a tile's arrays are O(CHUNK N_k) per
kv head.

Chunks of keys that the keep-mask (scores.keep_mask: the keep steps, a -inf bias, ...)
removes from every row of a tile are skipped: no score, product or sum of them is
computed (a causal case costs about half). Their sums would be exact zeros, which leave a
sum begun at +0 as it is: the results are bitwise those of computing them.
"""
import math
from functools import partial

import numpy as np

from .. import scores
from .._layout import with_head_axis
from ..score_grads import ScoreGrads, sums_over_keys
from ..scores import keep_mask
from ..softmax_row import masked_row_weight, row_weights, with_sink
from .row_blocks import block_of, row_slices


CHUNK = 32                  # terms of a long sum added in float64 at a time; the rows of a tile
WAY = "naive, head-width sums left to right"   # its name in a report
SUM_TILE = 1 << 17          # entries of a tile of recursive_matmul's sums: it stays in the core's cache


def recursive_matmul(a, b):
    """a @ b, [..., m, n] @ [..., n, p] -> [..., m, p], each dot product summed left to right:
    the roundings of

        acc = 0
        for i in range(n):
            acc = acc + a[..., :, i:i + 1] * b[..., i:i + 1, :]

    computed a tile of acc's rows at a time (about SUM_TILE entries, kept in cache through
    the n steps), each step in place."""
    dtype = np.result_type(a, b)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, n, p = a.shape[-2], a.shape[-1], b.shape[-1]
    acc = np.zeros(batch + (m, p), dtype)
    columns = np.swapaxes(a, -1, -2).astype(dtype)                 # [..., n, m]: a's columns as rows, in dtype
    b = np.ascontiguousarray(b, dtype)                             # its rows contiguous: twice as fast as k^T's
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


def key_chunks_sum(a, b_chunks):
    """a @ b summed over the keys in chunks (module docstring): a [..., r, W], a tile's values
    on its kept keys, and b_chunks [..., n, CHUNK, c], b on the same keys in float64 and in
    chunks (_in_chunks) -> [..., r, c] in a's dtype. Each chunk's sum is one float64 product
    [r, CHUNK] @ [CHUNK, c], rounded; the n chunks' sums are added left to right from +0."""
    parts = np.matmul(_chunked_keys(a), b_chunks).astype(a.dtype)    # [..., n, r, c]
    acc = np.zeros(parts.shape[:-3] + parts.shape[-2:], a.dtype)
    for i in range(parts.shape[-3]):
        acc += parts[..., i, :, :]
    return acc


def tile_rows_sum(a, b):
    """a^T b summed over a tile's rows (one chunk of the sum over rows): a [..., r, W] on the
    tile's kept keys, b [..., r, c] -> [..., W, c] in a's dtype, each chunk of CHUNK keys one
    float64 product [CHUNK, r] @ [r, c], rounded."""
    parts = np.matmul(_swap(_chunked_keys(a)), b.astype(_wide(b.dtype))[..., None, :, :])   # [..., n, CHUNK, c]
    return parts.reshape(parts.shape[:-3] + (-1,) + parts.shape[-1:])[..., :a.shape[-1], :].astype(a.dtype)


def _wide(dtype):
    """The dtype a chunk is summed in: float64 (complex128 for complex dtypes)."""
    return np.promote_types(dtype, np.float64)


def _chunked_keys(x):
    """x [..., r, W] in float64, cut into chunks of CHUNK keys, the last padded with zeros:
    [..., n, r, CHUNK] (a view of one fresh array)."""
    return np.moveaxis(_padded_chunks(x, -1), -2, -3)


def _in_chunks(x):
    """k or v [..., N_k, c] in float64, cut into chunks of CHUNK keys, the last padded with
    zeros: [..., n, CHUNK, c]."""
    return _padded_chunks(x, -2)


def _padded_chunks(x, axis):
    """x in float64 padded with zeros along `axis` (-1 or -2) to n * CHUNK entries, that axis
    cut into two, (n, CHUNK)."""
    axis += x.ndim
    n = -(-x.shape[axis] // CHUNK)
    wide = np.zeros(x.shape[:axis] + (n * CHUNK,) + x.shape[axis + 1:], _wide(x.dtype))
    wide[(slice(None),) * axis + (slice(0, x.shape[axis]),)] = x
    return wide.reshape(x.shape[:axis] + (n, CHUNK) + x.shape[axis + 1:])


def _in_float64(f, x):
    """f(x) (np.exp, np.log) computed in float64 and rounded to x's dtype."""
    return f(x.astype(_wide(x.dtype), copy=False)).astype(x.dtype, copy=False)


def _swap(x):
    return np.swapaxes(x, -1, -2)


def naive_attention(q, k, v, options, dout=None):
    """out, lse, max_logits (and dq, dk, dv, dbias with dout) in q's dtype, as a dict.

    q, k, v and options (an AttentionOptions record) as `attention_options` returns them:
    naive_attention(*attention_options(q, k, v, **kwargs), dout=dout). Without dout, the
    forward alone. Computed a tile of CHUNK query rows at a time (module docstring): a
    tile's scores are [..., H_kv, r, W], r <= CHUNK rows on the W keys of its kept chunks.
    """
    o = options
    q3, k3, v3 = (with_head_axis(x) for x in (q, k, v))
    dout3 = None if dout is None else with_head_axis(dout)
    groups, dtype = q3.shape[-3] // k3.shape[-3], q3.dtype
    score_shape = q3.shape[:-1] + k3.shape[-2:-1]                    # [..., H, N_q, N_k]
    keys = _Keys(k3, v3)
    out = np.empty(q3.shape[:-1] + v3.shape[-1:], dtype)
    lse = np.empty(q3.shape[:-1], dtype)
    max_logits = np.empty(q3.shape[:-1], dtype)
    dq = np.empty(q3.shape, dtype)
    dk = np.zeros(q3.shape[:-3] + k3.shape[-3:-1] + q3.shape[-1:], dtype)   # running sums over the rows
    dv = np.zeros(q3.shape[:-3] + v3.shape[-3:], dtype)
    params = ScoreGrads(o, score_shape, dtype)                      # dbias, dslopes, dscore_mod_params
    for g in range(groups):
        for rows in row_slices(score_shape[-2], CHUNK):
            index = (Ellipsis, slice(g, None, groups), rows)           # the tile's scores: index + (cols,)
            q_t = q3[..., g::groups, rows, :]                           # [..., H_kv, r, d_k]
            runs, keep = kept_runs(o, score_shape, index)
            f = _forward_tile(q_t, keys.at(runs), o, score_shape, index, runs, keep)
            out[..., g::groups, rows, :], lse[..., g::groups, rows] = f["out"], f["lse"]
            max_logits[..., g::groups, rows] = f["max_logits"]
            if dout3 is None:
                continue
            dq[..., g::groups, rows, :], dk_t, dv_t = _backward_tile(dout3[..., g::groups, rows, :], q_t, f, o,
                                                                     score_shape, index, runs, keep, params)
            for run, cols in _side_by_side(runs):                       # dk, dv += the tile's sums
                dk[..., run, :] += dk_t[..., cols, :]
                dv[..., run, :] += dv_t[..., cols, :]
            if f["dsink"] is not None:                                  # the sink's column
                params.add_sink(f["dsink"], index + (slice(None),))
    result = {"out": out.reshape(q.shape[:-1] + v.shape[-1:]), "lse": lse.reshape(q.shape[:-1]),
              "max_logits": max_logits.reshape(q.shape[:-1])}
    if dout3 is not None:
        result.update(dq=dq.reshape(q.shape), dk=(o.scale * dk).reshape(k.shape), dv=dv.reshape(v.shape))
        result.update({name: g for name, g in ScoreGrads.total([params], o, score_shape, dtype).items()
                       if g is not None})
    return result


def kept_runs(options, score_shape, index):
    """(runs, keep) of the tile S[index + (cols,)] (index: leading axes, heads, rows).

    runs: the slices of keys the tile computes, side by side: each a run of consecutive
    chunks of CHUNK keys that keep a score in some row of the tile ([slice(0, 0)]: none).
    All keys (one run) where a removed score still counts (_skips_chunks).
    keep: the keep-mask on all N_k keys, broadcastable to the tile's scores, or None.
    """
    o, n_k = options, score_shape[-1]
    keep = keep_mask(o, score_shape, index + (slice(None),))
    if keep is None:
        return [slice(0, n_k)], None
    keep = np.broadcast_to(keep, keep.shape[:-1] + (n_k,))
    if not _skips_chunks(o, n_k):
        return [slice(0, n_k)], keep
    n = -(-n_k // CHUNK)
    kept = np.zeros(n * CHUNK, bool)
    kept[:n_k] = keep.any(axis=tuple(range(keep.ndim - 1)))         # keys kept in some row
    chunks = np.concatenate(([False], kept.reshape(n, CHUNK).any(axis=-1), [False]))
    edges = np.flatnonzero(chunks[1:] != chunks[:-1])               # where runs of kept chunks start, stop
    runs = [slice(a * CHUNK, min(b * CHUNK, n_k)) for a, b in zip(edges[::2], edges[1::2])]
    return runs or [slice(0, 0)], keep


def _skips_chunks(options, n_k):
    """Whether a chunk of removed scores may be skipped: its weights are 0 (the fully_masked
    policy 'zero'; 'uniform' and 'nan' weigh a fully masked row's every key) and no parameter's
    gradient is a NumPy sum over a row's keys (score_grads.sums_over_keys), which its zeros would
    group otherwise."""
    return options.fully_masked == "zero" and not sums_over_keys(options, n_k)


def _side_by_side(runs):
    """(run, cols) for each run of keys: cols, its place among the runs laid side by side."""
    start = 0
    for run in runs:
        yield run, slice(start, start + run.stop - run.start)
        start += run.stop - run.start


def _on_runs(x, runs, axis):
    """x's entries at the runs of keys along `axis` (-1 or -2), side by side: a view for one run."""
    at = lambda run: (Ellipsis, run) + (slice(None),) * (-1 - axis)
    return x[at(runs[0])] if len(runs) == 1 else np.concatenate([x[at(run)] for run in runs], axis=axis)


class _Keys:
    """k and v [..., H_kv, N_k, d], and in float64 in chunks of keys (_in_chunks), computed once."""

    def __init__(self, k, v):
        self.k, self.v = k, v
        self.k_chunks, self.v_chunks = _in_chunks(k), _in_chunks(v)

    def at(self, runs):
        """{k, v: [..., H_kv, W, d]; k_chunks, v_chunks: [..., H_kv, n, CHUNK, d]} on the runs of keys."""
        # kept_runs' runs start at multiples of CHUNK and only a run ending at N_k ends short of one
        chunks = [slice(run.start // CHUNK, -(-run.stop // CHUNK)) for run in runs]
        return {"k": _on_runs(self.k, runs, -2), "v": _on_runs(self.v, runs, -2),
                "k_chunks": _on_runs(self.k_chunks, chunks, -3), "v_chunks": _on_runs(self.v_chunks, chunks, -3)}


def _forward_tile(q, keys, o, score_shape, index, runs, keep):
    """The forward of one tile, q [..., H_kv, r, d_k], on its runs of keys (W of them; keys:
    _Keys.at): dict out [..., H_kv, r, d_v], lse, max_logits [..., H_kv, r] and, for the backward, S,
    the score steps' Saved, dead rows, the dropout and the sink's weight."""
    s = recursive_matmul(q * o.scale, _swap(keys["k"]))               # 1.  [..., H_kv, r, W]
    s, saved = _score_steps(s, o, score_shape, index, runs, keep)    # 2-4. (scores.py)
    w = s.shape[-1]
    max_logits = np.max([scores.row_max(s[..., cols], o, score_shape, index + (run,))   # each row's
                         for run, cols in _side_by_side(runs)], axis=0, initial=-np.inf)  # largest score
    s_row = with_sink(s, o, score_shape, index + (slice(None),))     # a sink: one more logit, no value
    p_row, lse = row_weights(s_row, masked_row_weight(o.fully_masked, score_shape[-1]),   # 5. exp, log in
                             exp=partial(_in_float64, np.exp), log=partial(_in_float64, np.log),   # float64,
                             total=lambda e: _row_total(e, w))                              # sums in chunks
    p = p_row[..., :w]
    drop = block_of(o.dropout_scale, score_shape, index + (slice(None),))
    drop = None if drop is None else _on_runs(drop, runs, -1)
    p_drop = p if drop is None else (p * drop).astype(s.dtype)
    return {"out": key_chunks_sum(p_drop, keys["v_chunks"]), "lse": lse, "max_logits": max_logits, "s": s,
            "p": p, "dead": np.isneginf(lse)[..., None],               # a row with no key
            "drop": drop, "saved": saved, "keys": keys,
            "p_sink": p_row[..., w:] if p_row.shape[-1] > w else None}    # the sink's weights, or None


def _row_total(e, w):
    """The row sums [..., r, 1] of e [..., r, W (+ 1 with a sink)]: over the W keys in chunks
    (key_chunks_sum), then the sink's term."""
    total = key_chunks_sum(e[..., :w], np.ones((1, CHUNK, 1)))
    return total if e.shape[-1] == w else total + e[..., w:]


def _backward_tile(dout, q, f, o, score_shape, index, runs, keep, params):
    """The backward of one tile (dout [..., H_kv, r, d_v], f its forward): dq [..., H_kv, r, d_k]
    and the tile's sums over its rows on its runs of keys, dk / scale [..., H_kv, W, d_k] and dv
    [..., H_kv, W, d_v]; the score steps' parameters' gradients go to the ScoreGrads `params`,
    the sink's to f["dsink"]."""
    s, drop, keys = f["s"], f["drop"], f["keys"]
    with np.errstate(invalid="ignore"):                            # -inf - (-inf) in dead rows
        p = np.where(f["dead"], f["p"], _in_float64(np.exp, s - f["lse"][..., None]))   # FlashAttention's
    p_drop = p if drop is None else (p * drop).astype(s.dtype)                          # recomputation
    dv = tile_rows_sum(p_drop, dout)
    dp = recursive_matmul(dout, _swap(keys["v"]))
    dp = dp if drop is None else (dp * drop).astype(s.dtype)
    D = recursive_rowsum(dout * f["out"])                          # [..., r, 1]
    ds = p * (dp - D)
    f["dsink"] = None if f["p_sink"] is None else -np.sum(f["p_sink"] * D, axis=(-2, -1))   # the sink's
                                                                                          # column of dS, summed
    for run, cols in _side_by_side(runs):                          # 4-2. (scores.py)
        ds[..., cols] = scores.backward(ds[..., cols], o, score_shape, index + (run,), f["saved"].at(
            (Ellipsis, cols)), None if keep is None else keep[..., run], grads=params)
    return o.scale * key_chunks_sum(ds, keys["k_chunks"]), tile_rows_sum(ds, q), dv


def _score_steps(s, o, score_shape, index, runs, keep):
    """Steps 2-4 (scores.forward) on a tile's scores s [..., H_kv, r, W] on its runs of keys
    side by side (overwritten): (S, Saved)."""
    parts = [scores.forward(s[..., cols], o, score_shape, index + (run,), None if keep is None else keep[..., run])
             for run, cols in _side_by_side(runs)]
    if len(parts) == 1:
        return parts[0]
    joined = lambda xs: None if xs[0] is None else np.concatenate(xs, axis=-1)
    return joined([s for s, _ in parts]), scores.Saved(*(joined(xs) for xs in zip(*(saved for _, saved in parts))))
