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

Grouped-query attention folds the G query heads that share a kv head into the
row axis: q [..., H, N_q, d] -> [..., H_kv, G*N_q, d]; then every step is one
batched matmul against k [..., H_kv, N_k, d] and the group sums in dk, dv are
part of that matmul.
"""
import math
from typing import NamedTuple, Optional

import numpy as np

from ._checks import (as_float_array, as_mask, broadcast_shape_to, require_bool, require_cache,
                      require_choice, require_positive_real, require_probability, require_same_shape,
                      result_dtype)
from ._layout import (check_window, fold, positional_keep, resolve_alignment, unbroadcast, unfold,
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
    bias_shape: Optional[tuple]     # the bias's own shape, for dbias; None without a bias
    scores: np.ndarray              # [..., H, N_q, N_k] S, the softmax input (-inf where masked)
    weights: np.ndarray             # [..., H, N_q, N_k] P, before dropout
    lse: np.ndarray                 # [..., H, N_q] logsumexp of each row of S (-inf: fully masked)
    dropout_scale: Optional[np.ndarray]  # broadcastable to P: dropout_mask / (1 - dropout_p), or None
    out: np.ndarray                 # [..., H, N_q, d_v]
    fully_masked: str
    masked: bool                    # whether step 4 set any score to -inf


class AttentionStages(NamedTuple):
    dP: np.ndarray                  # [..., H, N_q, N_k] gradient w.r.t. P (before dropout)
    dS: np.ndarray                  # [..., H, N_q, N_k] gradient w.r.t. S (the softmax input)
    D: np.ndarray                   # [..., H, N_q] rowsum(dout * out) = rowsum(P * dP)


class AttentionGrads(NamedTuple):
    dq: np.ndarray                  # [..., H, N_q, d_k]
    dk: np.ndarray                  # [..., H_kv, N_k, d_k]
    dv: np.ndarray                  # [..., H_kv, N_k, d_v]
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
                         f"(grouped-query attention), got q {q.shape}, k {k.shape}")
    dtype = result_dtype(q, k, v)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)          # astype copies


def _check_finite(name, x, allow_neginf=False):
    bad = np.isnan(x) | (np.isposinf(x.real) if allow_neginf else ~np.isfinite(x))
    if bad.any():
        raise ValueError(f"{name} (shape {x.shape}) has {int(bad.sum())} non-finite entries "
                         f"(check_finite=True)")


# ----------------------------------------------------------------------------- forward / backward

def attention_forward(q, k, v, *, mask=None, bias=None, causal=False, align=None, window=None,
                      scale=None, softcap=None, dropout_mask=None, dropout_p=0.0,
                      fully_masked="zero", check_finite=False, block_size=None):
    """out = softmax(scale * q k^T [+ options]) v, materializing the [N_q, N_k] scores.

    Args:
        q: [..., H, N_q, d_k]; k: [..., H_kv, N_k, d_k]; v: [..., H_kv, N_k, d_v].
        mask: keep-mask broadcastable to [..., H, N_q, N_k]; True/nonzero = attend.
        bias: additive float scores broadcastable to [..., H, N_q, N_k]; gets a gradient.
            An additive mask (0 / -inf) belongs here.
        causal: False, True, 'top_left' (torch is_causal) or 'bottom_right' (FlashAttention).
        align: diagonal alignment for causal=True and for window: 'top_left' (default)
            or 'bottom_right'.
        window: (left, right) sliding window around the diagonal, -1 = unbounded
            (FlashAttention's window_size).
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
            no [N_q, N_k] array, O(N) memory, the same results; mask, bias, causal,
            window, scale, GQA and fully_masked='zero' only (ValueError for the rest).
    Returns:
        out [..., H, N_q, d_v] and an AttentionCache (scores S, weights P, lse inside),
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
    if block_size is not None:                                   # the tiled path, O(N) memory
        block_size = check_tiled_options(block_size, softcap, dropout_scale, fully_masked)
        bias = None if bias is None else bias.copy()             # the tiled cache keeps it
        return tiled_forward(q, k, v, keep=keep, bias=bias, scale=scale, causal=causal,
                             window=window, align=align, block_size=block_size)

    q3, k3, v3 = map(with_head_axis, (q, k, v))                  # a head axis always
    h, h_kv = q3.shape[-3], k3.shape[-3]
    n_q, n_k = q.shape[-2], k.shape[-2]

    # 1. S = scale * q k^T, with each group's query heads folded into rows
    s = unfold(fold(q3 * scale, h_kv) @ np.swapaxes(k3, -1, -2), h)   # [..., H, N_q, N_k]
    s = s.reshape(score_shape)
    # (s is this function's own array from here on: steps 3-5 work on it in place)
    # 2. softcap
    t = None
    if softcap is not None:
        t = np.tanh(s / softcap)
        s = softcap * t
    # 3. additive bias
    if bias is not None:
        s += bias
    # 4. masks: -inf where a pair is not kept
    pos = positional_keep(np.arange(n_q), np.arange(n_k), n_q, n_k, causal, window, align)
    if pos is not None:
        keep = pos if keep is None else keep & pos
    if keep is not None:
        np.copyto(s, -np.inf, where=~keep)
    # 5. softmax (rows of all -inf come out as zeros) and lse, then the fully-masked policy
    p, lse = softmax_and_logsumexp(s)                            # [..., H, N_q, N_k], [..., H, N_q]
    if fully_masked != "zero":
        dead = np.isneginf(lse.real)[..., None]
        np.copyto(p, 1.0 / n_k if fully_masked == "uniform" else np.nan, where=dead)
    # 6. dropout with the caller's keep-mask
    p_drop = p if dropout_scale is None else p * dropout_scale
    # 7. out = P~ v
    p3 = with_head_axis(p_drop)
    out = unfold(fold(p3, h_kv) @ v3, h).reshape(q.shape[:-1] + (v.shape[-1],))
    masked = keep is not None or (bias is not None and bool(np.isneginf(bias.real).any()))
    cache = AttentionCache(q=q, k=k, v=v, scale=scale, softcap=softcap, softcap_tanh=t,
                           bias_shape=None if bias is None else bias.shape, scores=s, weights=p,
                           lse=lse, dropout_scale=dropout_scale, out=out.copy(),
                           fully_masked=fully_masked, masked=masked)
    return out, cache


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
        method: how step 5 (softmax) is differentiated; all three agree to rounding:
            'vjp'      dS = P * (dP - rowsum(P * dP))             (softmax_backward)
            'jacobian' dS = J dP with J = diag(P) - P P^T per row  (softmax_jacobian; O(N_k^2) per row)
            'flash'    dS = P * (dP - D), D = rowsum(dout * out), P recomputed as exp(S - lse)
                       (FlashAttention's backward)
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
    q, k, v, p = cache.q, cache.k, cache.v, cache.weights
    q3, k3, v3, dout3 = map(with_head_axis, (q, k, v, dout))
    h, h_kv = q3.shape[-3], k3.shape[-3]
    as_weights = lambda x: x.reshape(p.shape)    # [..., H, N_q, N_k]: 2-axis inputs lose the head axis

    # 7. out = P~ v:  dv = P~^T dout (summed over the group),  dP~ = dout v^T
    p_drop = p if cache.dropout_scale is None else p * cache.dropout_scale
    p_drop3 = with_head_axis(p_drop)
    dout_f = fold(dout3, h_kv)                                  # [..., H_kv, G*N_q, d_v]
    dv = (np.swapaxes(fold(p_drop3, h_kv), -1, -2) @ dout_f).reshape(v.shape)
    dp = as_weights(unfold(dout_f @ np.swapaxes(v3, -1, -2), h))
    # 6. dropout:  dP = dP~ * mask / (1 - p)
    if cache.dropout_scale is not None:
        dp *= cache.dropout_scale                                # dp is this function's own array
    # 5. softmax:  dS = P * (dP - rowsum(P * dP))
    D = np.sum(dout * cache.out, axis=-1)                        # [..., H, N_q] = rowsum(P * dP)
    if method == "vjp":
        ds = softmax_backward(dp, SoftmaxCache(p=p), overwrite_dp=not return_stages)
    elif method == "jacobian":
        ds = (softmax_jacobian(p) @ dp[..., None])[..., 0]      # [..., N_k, N_k] @ [..., N_k, 1]
    else:
        with np.errstate(invalid="ignore"):                      # -inf - (-inf) in fully masked rows
            p_re = np.exp(cache.scores - cache.lse[..., None])
        ds = np.where(np.isnan(p_re), 0, p_re) * (dp - D[..., None])
    # 4. masks: a score that is -inf is a constant; nothing flows through it
    if cache.masked:
        np.copyto(ds, 0, where=np.isneginf(cache.scores.real))  # ds is this function's own array
    stages = AttentionStages(dP=dp, dS=ds, D=D) if return_stages else None
    # 3. bias:  S = S + bias  ->  dbias = dS, summed over the axes bias was broadcast along
    dbias = None if cache.bias_shape is None else unbroadcast(ds, cache.bias_shape)
    # 2. softcap:  S = c tanh(S0 / c)  ->  dS0 = dS (1 - tanh^2)
    if cache.softcap_tanh is not None:
        ds = ds * (1 - cache.softcap_tanh ** 2)
    # 1. S = scale * q k^T:  dq = scale * dS k,  dk = scale * dS^T q (summed over the group)
    ds_f = fold(with_head_axis(ds), h_kv)         # [..., H_kv, G*N_q, N_k]
    dq = (cache.scale * unfold(ds_f @ k3, h)).reshape(q.shape)
    dk = (cache.scale * (np.swapaxes(ds_f, -1, -2) @ fold(q3, h_kv))).reshape(k.shape)
    return AttentionGrads(dq=dq, dk=dk, dv=dv, dbias=dbias, stages=stages)
