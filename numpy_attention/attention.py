"""Scaled dot-product attention, forward and hand-written backward.

Shape legend:
    ...   leading batch axes (any number, the same for q, k and v)
    H     query heads,  H_kv key/value heads (H_kv divides H; G = H / H_kv queries share a kv head)
    N_q   query length,  N_k key length,  d_k query/key width,  d_v value width

    q [..., H, N_q, d_k]   k [..., H_kv, N_k, d_k]   v [..., H_kv, N_k, d_v]   ->   out [..., H, N_q, d_v]

Arrays with two axes ([N, d]) are a single head.

Forward, in this order (documented once, here):
    1. S = scale * q k^T                    scale defaults to 1 / sqrt(d_k)
    2. S = softcap * tanh(S / softcap)      only when softcap is set
    3. S = S + bias                         bias broadcasts to [..., H, N_q, N_k]
    4. S = -inf where not kept              keep = mask & causal & window (True = attend)
    5. P = softmax(S), lse = logsumexp(S)   rows of all -inf: the `fully_masked` policy
    6. P~ = P * dropout_mask / (1 - dropout_p)
    7. out = P~ v

Backward, the same steps in reverse (derivations in docs/derivations.md):
    7. dv = P~^T dout,  dP~ = dout v^T
    6. dP = dP~ * dropout_mask / (1 - dropout_p)
    5. dS = P * (dP - rowsum(P * dP))       = P * (dP - D),  D = rowsum(dout * out)
    4. dS = 0 where S = -inf                 (masked scores do not depend on anything)
    3. dbias = dS summed to bias's shape
    2. dS = dS * (1 - tanh^2(S / softcap))
    1. dq = scale * dS k,  dk = scale * dS^T q   (dk, dv summed over each query group)

Grouped-query attention splits the query heads as [H_kv, G]: q [..., H, N_q, d] is
viewed as [..., H_kv, G, N_q, d] and meets k [..., H_kv, 1, N_k, d] by broadcasting,
so every step is one batched matmul, and dk, dv sum over the G axis.

The steps run on blocks of query rows ("blocks of rows" below); only P is stored whole.
dk and dv are accumulated over those blocks as their transposes, dk^T = scale * q^T dS and
dv^T = dout^T P~: the same sums, but a wide [d, N_k] product, which BLAS runs about 1.3x
faster here than the tall [N_k, d] one with a transposed operand.
"""
import math
from typing import NamedTuple, Optional

import numpy as np

from ._checks import (as_float_array, as_mask, broadcast_shape_to, require_bool, require_cache,
                      require_choice, require_positive_real, require_probability, require_same_shape,
                      result_dtype)
from ._layout import (check_window, positional_keep, resolve_alignment, unbroadcast,
                      with_head_axis)
from .softmax import SoftmaxCache, softmax_and_logsumexp, softmax_backward, softmax_jacobian
from .tiled import TiledAttentionCache, check_tiled_options, tiled_backward, tiled_forward

FULLY_MASKED_POLICIES = ("zero", "uniform", "nan")
BACKWARD_METHODS = ("vjp", "jacobian", "flash")


class AttentionCache(NamedTuple):
    q: np.ndarray                   # [..., H, N_q, d_k]
    k: np.ndarray                   # [..., H_kv, N_k, d_k]
    v: np.ndarray                   # [..., H_kv, N_k, d_v]
    scale: float
    softcap: Optional[float]
    softcap_tanh: Optional[np.ndarray]   # [..., H, N_q, N_k] tanh(scale q k^T / softcap), or None
    keep: Optional[np.ndarray]      # the caller's keep-mask (bool), broadcastable to the scores
    bias: Optional[np.ndarray]      # a copy of the caller's bias, broadcastable to the scores
    causal: bool
    window: Optional[tuple]
    align: str
    weights: np.ndarray             # [..., H, N_q, N_k] P, before dropout
    lse: np.ndarray                 # [..., H, N_q] logsumexp of each row of S (-inf: fully masked)
    top: np.ndarray                 # [..., H, N_q] index of each row's largest S, so of its largest P
                                    # (where the backward's softmax_backward shifts dP)
    dropout_scale: Optional[np.ndarray]  # broadcastable to P: dropout_mask / (1 - dropout_p), or None
    out: np.ndarray                 # [..., H, N_q, d_v]
    fully_masked: str
    masked: bool                    # whether step 4 sets any score to -inf

    @property
    def scores(self):
        """S [..., H, N_q, N_k], the softmax input (-inf where masked), recomputed from q and k.

        Not stored: the forward only ever holds one block of it (see `_row_blocks`).
        """
        g = _grouped(self)
        return _block_scores(self, g, _whole(g))[0].reshape(self.weights.shape)


class AttentionStages(NamedTuple):
    dP: np.ndarray                  # [..., H, N_q, N_k] gradient w.r.t. P (before dropout)
    dS: np.ndarray                  # [..., H, N_q, N_k] gradient w.r.t. S (the softmax input)
    D: np.ndarray                   # [..., H, N_q] rowsum(dout * out) = rowsum(P * dP)


class AttentionGrads(NamedTuple):
    dq: np.ndarray                  # [..., H, N_q, d_k]
    dk: np.ndarray                  # [..., H_kv, N_k, d_k]  the materialized path computes dk^T, dv^T:
    dv: np.ndarray                  # [..., H_kv, N_k, d_v]  these two are transposed views of them
    dbias: Optional[np.ndarray]     # bias's shape, or None without a bias
    stages: Optional[AttentionStages] = None   # with return_stages=True


# ----------------------------------------------------------------------------- helpers

def _check_scale(scale, d_k):
    return 1.0 / math.sqrt(d_k) if scale is None else require_positive_real(scale, "scale")


def _check_softcap(softcap):
    return None if softcap is None else require_positive_real(softcap, "softcap")


def _check_qkv(q, k, v):
    """Validate shapes; return (q, k, v) as fresh arrays of one dtype.

    Fresh: the cache then never shares memory with the caller's arrays, so changing them
    after the forward cannot change the backward (a copy is O(N d), the scores O(N^2 d)).
    """
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 axes [..., N, d], got shape {x.shape}")
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"q, k, v must have the same number of axes, got shapes "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-3] != v.shape[:-3]:
        raise ValueError(f"q, k, v must share their leading batch axes, got shapes "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same width d_k, got q {q.shape}, k {k.shape}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same heads and length [..., H_kv, N_k], "
                         f"got k {k.shape}, v {v.shape}")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k must have a width d_k >= 1, got q {q.shape}, k {k.shape}")
    if q.ndim >= 3 and min(q.shape[-3], k.shape[-3]) == 0:
        raise ValueError(f"q and k must have at least one head (H >= 1, H_kv >= 1), "
                         f"got q {q.shape}, k {k.shape}")
    if q.ndim >= 3 and q.shape[-3] % k.shape[-3]:
        raise ValueError(f"k's heads H_kv={k.shape[-3]} must divide q's heads H={q.shape[-3]} "
                         f"(grouped-query attention), got q {q.shape}, k {k.shape}; the layout is "
                         f"[..., H, N, d] (torch's and FlashAttention's [B, N, H, d] need a transpose)")
    dtype = result_dtype(q, k, v)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)          # astype copies


def _check_finite(name, x, allow_neginf=False):
    bad = np.isnan(x) | (np.isposinf(x.real) if allow_neginf else ~np.isfinite(x))
    if bad.any():
        raise ValueError(f"{name} (shape {x.shape}) has {int(bad.sum())} non-finite entries "
                         f"(check_finite=True)")


# ----------------------------------------------------------------------------- blocks of rows
#
# The materialized path stores P [..., H, N_q, N_k] whole, but computes everything else
# one block of rows at a time, so that each element-wise pass over the scores works on a
# block in the processor's cache instead of streaming [N_q, N_k] arrays through memory
# (softmax is row-wise: the blocks change nothing but the order of dk's and dv's sums).
# It works in a grouped layout where the G query heads that share a kv head meet it by
# broadcasting, so no array is ever copied per group:
#
#     q [..., H_kv, G, N_q, d_k]    k [..., H_kv, 1, N_k, d_k]    v [..., H_kv, 1, N_k, d_v]
#     scores, mask, bias, dropout [..., H_kv, G, N_q, N_k]          (views; G = 1 without GQA)
#
# A block is an index tuple ix over [..., H_kv, G, N_q] (slices only, so every axis stays):
# the scores' block is x[ix], its query rows q[ix], its keys and values k[ix[:-2]], v[ix[:-2]].

BLOCK_BYTES = 8 << 20       # scores per block: the best of 1-32 MiB measured here (a few MiB, about L2)


class _Grouped(NamedTuple):
    q: np.ndarray                   # [..., H_kv, G, N_q, d_k]
    k: np.ndarray                   # [..., H_kv, 1, N_k, d_k]
    v: np.ndarray                   # [..., H_kv, 1, N_k, d_v]
    keep: Optional[np.ndarray]      # [..., H_kv, G, N_q, N_k] broadcast views, or None
    bias: Optional[np.ndarray]
    dropout_scale: Optional[np.ndarray]


def _grouped(c):
    """The cache's arrays in the grouped layout (views, no copies)."""
    q3, k3 = with_head_axis(c.q), with_head_axis(c.k)
    h_kv, n_q, n_k = k3.shape[-3], q3.shape[-2], k3.shape[-2]
    lead = q3.shape[:-3] + (h_kv, q3.shape[-3] // h_kv)
    scores = lead + (n_q, n_k)
    as_scores = lambda x: None if x is None else np.broadcast_to(x, c.q.shape[:-1] + (n_k,)).reshape(scores)
    return _Grouped(q=q3.reshape(lead + q3.shape[-2:]), k=k3[..., None, :, :],
                    v=with_head_axis(c.v)[..., None, :, :], keep=as_scores(c.keep),
                    bias=as_scores(c.bias), dropout_scale=as_scores(c.dropout_scale))


def _whole(g):
    """The block index of all the scores at once."""
    return (slice(None),) * (g.q.ndim - 1)


def _row_blocks(g, itemsize):
    """The blocks the materialized path works on, each about BLOCK_BYTES of scores.

    The block space is [..., H_kv, G, N_q] (a row of scores costs N_k * itemsize): its
    trailing axes are taken whole while they fit, the next axis in chunks, and the axes
    before it one index at a time. Small problems are one block (one batched matmul per
    step), a long sequence is one head at a time in slices of rows.
    """
    shape = g.q.shape[:-1]
    fit = max(1, BLOCK_BYTES // max(1, g.k.shape[-2] * itemsize))     # rows per block
    a, inner = len(shape), 1                                          # shape[a:] fits whole
    while a > 0 and inner * shape[a - 1] <= fit:
        a -= 1
        inner *= shape[a]
    if a == 0:
        return [_whole(g)]
    step, tail = fit // inner, (slice(None),) * (len(shape) - a)
    return [tuple(slice(i, i + 1) for i in outer) + (slice(j, min(j + step, shape[a - 1])),) + tail
            for outer in np.ndindex(*shape[:a - 1]) for j in range(0, shape[a - 1], step)]


def _block_keep(c, g, ix):
    """Which scores of block ix are kept: mask & causal & window & (bias != -inf); None: all."""
    n_q, n_k = g.q.shape[-2], g.k.shape[-2]
    keep = positional_keep(np.arange(n_q)[ix[-1]], np.arange(n_k), n_q, n_k,
                           c.causal, c.window, c.align)                  # [rows, N_k] or None
    for part in (None if g.keep is None else g.keep[ix],
                 None if g.bias is None else ~np.isneginf(g.bias[ix].real)):
        if part is not None:
            keep = part if keep is None else keep & part
    return keep


def _block_scores(c, g, ix):
    """Steps 1-4 on block ix: (S, tanh(S_1 / softcap) or None), S a fresh [..., rows, N_k]."""
    s = (g.q[ix] * c.scale) @ np.swapaxes(g.k[ix[:-2]], -1, -2)       # 1. scale q k^T
    t = None
    if c.softcap is not None:                                         # 2. softcap
        t = np.tanh(s / c.softcap)
        s = np.multiply(t, c.softcap, out=s)
    if g.bias is not None:                                            # 3. bias
        s += g.bias[ix]
    if c.masked:                                                      # 4. -inf where not kept
        np.copyto(s, -np.inf, where=~_block_keep(c, g, ix))
    return s, t


# ----------------------------------------------------------------------------- forward / backward

def attention_forward(q, k, v, *, mask=None, bias=None, causal=False, align=None, window=None,
                      scale=None, softcap=None, dropout_mask=None, dropout_p=0.0,
                      fully_masked="zero", check_finite=False, block_size=None):
    """out = softmax(scale * q k^T [+ options]) v, materializing the [N_q, N_k] weights P.

    The steps run on blocks of rows of about BLOCK_BYTES of scores (see "blocks of rows"
    above); only P, which the backward and the caller need, is stored whole.

    Args:
        q: [..., H, N_q, d_k]; k: [..., H_kv, N_k, d_k]; v: [..., H_kv, N_k, d_v].
        mask: keep-mask broadcastable to [..., H, N_q, N_k]; True/nonzero = attend.
        bias: additive float scores broadcastable to [..., H, N_q, N_k]; gets a gradient.
            An additive mask (0 / -inf) belongs here.
        causal: False, True, 'top_left' (torch is_causal) or 'bottom_right' (FlashAttention).
        align: diagonal alignment for causal=True and for window: 'top_left' (default)
            or 'bottom_right'.
        window: (left, right) sliding window around the diagonal, -1 = unbounded
            (FlashAttention's window_size; FlashAttention aligns it bottom-right, so pass
            align='bottom_right' to match it when N_q != N_k).
        scale: multiplies q k^T; default 1/sqrt(d_k); 1.0 for the unscaled experiment.
        softcap: S <- softcap * tanh(S / softcap), after scaling and before bias and masks.
        dropout_mask, dropout_p: explicit keep-mask (broadcastable to the weights) and
            drop probability: P <- P * dropout_mask / (1 - dropout_p). No RNG inside.
        fully_masked: a row with every score -inf gives
            'zero'    output 0 and gradient 0 (torch 2.5+ SDPA, FlashAttention, ONNX);
            'uniform' the mean of v's rows (the seed's -1e9 fill, JAX), gradient 0 to q, k;
            'nan'     NaN output (the SDPA formula written out).
        check_finite: raise ValueError on NaN/Inf in q, k, v (and NaN/+inf in bias)
            instead of letting them poison the rows they touch.
        block_size: an int b selects the tiled path (tiled.py, FlashAttention's algorithm):
            no [N_q, N_k] array, O(N) memory, the same results (normwise to rounding; its
            backward is the 'flash' form below); mask, bias, causal, window, scale, GQA and
            fully_masked='zero' only (ValueError for the rest).
    Returns:
        out [..., H, N_q, d_v] and an AttentionCache (weights P and lse inside; cache.scores
        recomputes S),
        or a TiledAttentionCache (out, lse) with block_size.
    """
    q, k, v = _check_qkv(q, k, v)
    causal, align = resolve_alignment(causal, align)
    window = check_window(window)
    scale = _check_scale(scale, q.shape[-1])
    softcap = _check_softcap(softcap)
    require_choice(fully_masked, "fully_masked", FULLY_MASKED_POLICIES)
    if fully_masked != "zero" and k.shape[-2] == 0:     # every row is fully masked, P is [N_q, 0]
        raise ValueError(f"fully_masked={fully_masked!r} needs at least one key; with N_k = 0 "
                         f"only 'zero' defines the output: k {k.shape}, v {v.shape}")
    score_shape = q.shape[:-1] + (k.shape[-2],)                  # [..., H, N_q, N_k]
    legend = "the scores [..., H, N_q, N_k]"
    if bias is not None:
        bias = as_float_array(bias, "bias")
        broadcast_shape_to(bias, "bias", score_shape, legend)
    keep = None if mask is None else as_mask(mask, "mask", score_shape, legend)
    dropout_scale = _dropout_scale(dropout_mask, dropout_p, score_shape, legend)
    if require_bool(check_finite, "check_finite"):
        for name, x in (("q", q), ("k", k), ("v", v)):
            _check_finite(name, x)
        if bias is not None:
            _check_finite("bias", bias, allow_neginf=True)
    dtype = q.dtype if bias is None else result_dtype(q, bias)
    q, k, v = q.astype(dtype, copy=False), k.astype(dtype, copy=False), v.astype(dtype, copy=False)
    if dropout_scale is not None:                                # keep / (1 - p) in the scores' dtype
        dropout_scale = dropout_scale.astype(q.real.dtype)
    bias = None if bias is None else bias.copy()                 # the cache keeps it
    if block_size is not None:                                   # the tiled path, O(N) memory
        block_size = check_tiled_options(block_size, softcap, dropout_scale, fully_masked)
        return tiled_forward(q, k, v, keep=keep, bias=bias, scale=scale, causal=causal,
                             window=window, align=align, block_size=block_size)

    masked = (keep is not None or causal or window is not None
              or (bias is not None and bool(np.isneginf(bias.real).any())))
    c = AttentionCache(q=q, k=k, v=v, scale=scale, softcap=softcap, softcap_tanh=None, keep=keep,
                       bias=bias, causal=causal, window=window,
                       align=align, weights=None, lse=None, top=None, dropout_scale=dropout_scale,
                       out=None, fully_masked=fully_masked, masked=masked)
    g = _grouped(c)                                               # the grouped layout (views)
    grouped_shape = g.q.shape[:-1] + (g.k.shape[-2],)             # [..., H_kv, G, N_q, N_k]
    p = np.empty(grouped_shape, q.dtype)
    t = None if softcap is None else np.empty(grouped_shape, q.dtype)
    lse = np.empty(grouped_shape[:-1], q.dtype)                   # [..., H_kv, G, N_q]
    top = np.empty(grouped_shape[:-1] + (1,), np.intp)            # [..., H_kv, G, N_q, 1]
    out = np.empty(grouped_shape[:-1] + (g.v.shape[-1],), q.dtype)   # [..., H_kv, G, N_q, d_v]
    for ix in _row_blocks(g, p.itemsize):
        # 1-4. S = scale q k^T, softcap, + bias, -inf where not kept (one block of rows)
        s, t_block = _block_scores(c, g, ix)
        if t is not None:
            t[ix] = t_block
        # 5. P = softmax(S) (rows of all -inf come out as zeros), lse; the fully-masked policy
        p_block, lse[ix], top[ix] = softmax_and_logsumexp(s, out=p[ix], overwrite_z=True)
        if fully_masked != "zero":
            dead = np.isneginf(lse[ix].real)[..., None]
            np.copyto(p_block, 1.0 / g.k.shape[-2] if fully_masked == "uniform" else np.nan, where=dead)
        # 6. dropout with the caller's keep-mask
        if g.dropout_scale is not None:
            p_block = p_block * g.dropout_scale[ix]
        # 7. out = P~ v
        np.matmul(p_block, g.v[ix[:-2]], out=out[ix])
    out = out.reshape(q.shape[:-1] + (v.shape[-1],))              # back to [..., H, ...]
    c = c._replace(weights=p.reshape(score_shape), lse=lse.reshape(q.shape[:-1]),
                   top=top.reshape(q.shape[:-1]), out=out.copy(),
                   softcap_tanh=None if t is None else t.reshape(score_shape))
    return out, c


def _dropout_scale(dropout_mask, dropout_p, score_shape, legend):
    """dropout_mask / (1 - dropout_p), checked; None when there is no dropout."""
    dropout_p = require_probability(dropout_p, "dropout_p")
    if dropout_mask is None:
        if dropout_p > 0:
            raise ValueError("dropout_p > 0 needs an explicit dropout_mask (keep = True); "
                             "attention_forward draws no random numbers")
        return None
    keep = as_mask(dropout_mask, "dropout_mask", score_shape, legend)
    return keep / (1.0 - dropout_p)


def attention_backward(dout, cache, *, method="vjp", return_stages=False):
    """Gradients of `attention_forward` w.r.t. q, k, v and bias.

    Args:
        dout: [..., H, N_q, d_v] upstream gradient.
        cache: the AttentionCache from attention_forward.
        method: how step 5 (softmax) is differentiated; all three agree to rounding
            normwise, but only 'vjp' keeps the tiny gradients of saturated rows (1 - max P
            near eps) accurate relatively (docs/derivations.md, "Softmax"):
            'vjp'      dS = P * (dP - rowsum(P * dP))             (softmax_backward)
            'jacobian' dS = J dP with J = diag(P) - P P^T per row  (softmax_jacobian; O(N_k^2) per row)
            'flash'    dS = P * (dP - D), D = rowsum(dout * out), P recomputed as exp(S - lse)
                       with S recomputed from q and k (FlashAttention's backward)
        return_stages: also return AttentionStages(dP, dS, D) for per-stage comparison.
    A TiledAttentionCache (block_size) goes to the tiled backward: method 'vjp' or 'flash'
    (the same there), no stages.
    Returns:
        AttentionGrads(dq, dk, dv, dbias, stages).
    """
    if isinstance(cache, TiledAttentionCache):
        return AttentionGrads(*tiled_backward(dout, cache, method=method, return_stages=return_stages))
    require_cache(cache, AttentionCache, "attention_backward")
    require_same_shape(dout, cache.out.shape, "dout")
    require_choice(method, "method", BACKWARD_METHODS)
    dout = as_float_array(dout, "dout").astype(result_dtype(cache.out, np.asarray(dout)), copy=False)
    g = _grouped(cache)                                           # the grouped layout (views)
    grouped = lambda x: x.reshape(g.q.shape[:-2] + x.shape[-2:])  # [..., H, N_q, X] -> [..., H_kv, G, N_q, X]
    p, dout_g = grouped(cache.weights), grouped(with_head_axis(dout))
    t = None if cache.softcap_tanh is None else grouped(cache.softcap_tanh)
    D = np.sum(dout * cache.out, axis=-1)                         # [..., H, N_q] = rowsum(P * dP)
    D_g, lse_g, top_g = (x.reshape(g.q.shape[:-1]) for x in (D, cache.lse, cache.top))
    dtype = np.result_type(dout, p)
    dq = np.empty(g.q.shape, dtype)
    dkT, dvT = np.zeros(_t(g.k).shape, dtype), np.zeros(_t(g.v).shape, dtype)   # [..., H_kv, 1, d, N_k]
    dP = np.empty(p.shape, dtype) if return_stages else None     # whole stages only when asked for,
    dS = np.empty(p.shape, dtype) if return_stages or cache.bias is not None else None   # or for dbias
    for ix in _row_blocks(g, p.itemsize):
        kv = ix[:-2]                                              # the block's k, v (its kv heads)
        # 7. out = P~ v:  dv^T = dout^T P~ (summed over the group),  dP~ = dout v^T
        p_block = p[ix]
        p_drop = p_block if g.dropout_scale is None else p_block * g.dropout_scale[ix]
        dvT[kv] += _group_sum(_t(dout_g[ix]) @ p_drop)
        dp = dout_g[ix] @ _t(g.v[kv])
        # 6. dropout:  dP = dP~ * mask / (1 - p)
        if g.dropout_scale is not None:
            dp *= g.dropout_scale[ix]                             # dp is this function's own block
        if dP is not None:
            dP[ix] = dp
        # 5. softmax:  dS = P * (dP - rowsum(P * dP))
        if method == "vjp":
            ds = softmax_backward(dp, SoftmaxCache(p=p_block, top=top_g[ix][..., None]),
                                  overwrite_dp=True)
        elif method == "jacobian":
            ds = (softmax_jacobian(p_block) @ dp[..., None])[..., 0]   # [..., N_k, N_k] @ [..., N_k, 1]
        else:                                                     # P recomputed from S and lse
            s = _block_scores(cache, g, ix)[0]
            with np.errstate(invalid="ignore"):                   # -inf - (-inf) in fully masked rows
                s -= lse_g[ix][..., None]
            p_re = np.exp(s, out=s)
            ds = np.where(np.isnan(p_re), 0, p_re) * (dp - D_g[ix][..., None])
        # 4. masks: a score that is -inf is a constant; nothing flows through it
        if cache.masked:
            np.copyto(ds, 0, where=~_block_keep(cache, g, ix))   # ds is this function's own block
        if dS is not None:
            dS[ix] = ds
        # 3. bias: dbias = dS summed over the axes bias was broadcast along (after the loop)
        # 2. softcap:  S = c tanh(S0 / c)  ->  dS0 = dS (1 - tanh^2)
        if t is not None:
            ds *= 1 - t[ix] ** 2
        # 1. S = scale * q k^T:  dq = scale * dS k,  dk^T = scale * q^T dS (summed over the group)
        np.matmul(ds, g.k[kv], out=dq[ix])
        dkT[kv] += _group_sum(_t(g.q[ix]) @ ds)
    dq *= cache.scale
    dkT *= cache.scale
    score_shape = cache.weights.shape
    dbias = None if cache.bias is None else unbroadcast(dS.reshape(score_shape), cache.bias.shape)
    stages = (AttentionStages(dP=dP.reshape(score_shape), dS=dS.reshape(score_shape), D=D)
              if return_stages else None)
    return AttentionGrads(dq=dq.reshape(cache.q.shape), dk=_t(dkT).reshape(cache.k.shape),
                          dv=_t(dvT).reshape(cache.v.shape), dbias=dbias, stages=stages)


def _t(x):
    """The transpose of the last two axes (a view)."""
    return np.swapaxes(x, -1, -2)


def _group_sum(x):
    """Sum over the G query heads of a group (axis -3 of the grouped layout), keeping the axis."""
    return x.sum(axis=-3, keepdims=True)
