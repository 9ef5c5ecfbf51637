"""Precisions and their recipes: what an attention kernel computing in a low precision does.

A case names the precision its candidate computed in (`precision`): float64, float32,
float16, bfloat16, and for forward-only checks float8_e4m3fn and float8_e5m2 with
FlashAttention-3's per-(batch, kv head) descales. The baseline the rule holds a
candidate to is an honest implementation at that precision:

    float64, float32   naive.py: the textbook's steps in that dtype, every sum left to right
    float16, bfloat16  the recipe below, like FlashAttention's own same-precision reference
                       (attention_ref(..., upcast=False, reorder_ops=True))
    float8_*           the same recipe computing in bfloat16, with P rounded to float8 before
                       P v (attention_ref's intermediate_dtype); out is bfloat16

The recipe (T = the compute dtype, every matrix product accumulated in float32 and its
result rounded to T, every element-wise step computed in float32 and rounded to T):

    forward   k' = round(k * scale)            S = round(q k'^T)
              S = round(round(tanh(round(S / softcap))) * softcap)          (softcap)
              S = round(S + bias);  S = -inf where not kept
              P = round(softmax(S)),  lse = logsumexp(S) in float32
              P~ = P * dropout_mask (float8: rounded to float8),  v' = round(v / (1 - p))
              out = round(P~ v')
    backward  dv' = round(P~^T dout),  dv = round(dv' / (1 - p)),  dP = round(dout v'^T) * mask
              dS = round(P * (dP - rowsum(P * dP)))  (0 where masked),  dbias = round(sum of dS)
              softcap: dS = round(round(round(dS * softcap) * (1 - t^2)) / softcap)
              dq = round(dS k'),  dk = round(round(dS^T q) * scale)

Grouped-query heads sum their dk, dv in float32 before the one rounding.
Storage: bfloat16 and float8 arrays are ml_dtypes arrays (the dtypes JAX gives NumPy).
"""
from typing import NamedTuple

import ml_dtypes
import numpy as np

from .._layout import grouped_matmul, grouped_sum_matmul, unbroadcast, with_head_axis
from ..options import keep_mask


TILE_ROWS, TILE_COLS = 32, 512

class Precision(NamedTuple):
    name: str
    storage: np.dtype       # the dtype the inputs are stored in
    compute: np.dtype       # T: every intermediate is rounded to it
    weights: np.dtype       # P is rounded to it before P v
    output: np.dtype        # the dtype of out (and of the gradients)
    forward_only: bool      # no recipe for a backward (float8)
    recipe: bool            # False: the naive baseline in `compute` (float32, float64)


_F8E4, _F8E5, _BF16 = (np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
                                                ml_dtypes.bfloat16))
PRECISIONS = {
    "float64": Precision("float64", np.dtype(np.float64), np.dtype(np.float64), np.dtype(np.float64),
                         np.dtype(np.float64), False, False),
    "float32": Precision("float32", np.dtype(np.float32), np.dtype(np.float32), np.dtype(np.float32),
                         np.dtype(np.float32), False, False),
    "float16": Precision("float16", np.dtype(np.float16), np.dtype(np.float16), np.dtype(np.float16),
                         np.dtype(np.float16), False, True),
    "bfloat16": Precision("bfloat16", _BF16, _BF16, _BF16, _BF16, False, True),
    "float8_e4m3fn": Precision("float8_e4m3fn", _F8E4, _BF16, _F8E4, _BF16, True, True),
    "float8_e5m2": Precision("float8_e5m2", _F8E5, _BF16, _F8E5, _BF16, True, True),
}
# raw bit patterns of a precision, as a case may store them (or as np.savez stores ml_dtypes)
BITS = {2: (np.dtype(np.uint16), np.dtype("V2")), 1: (np.dtype(np.uint8), np.dtype("V1"))}


def eps(dtype):
    """Machine epsilon of a NumPy or ml_dtypes float dtype."""
    return float(ml_dtypes.finfo(dtype).eps)


def precision_of(dtype):
    """The precision whose storage dtype is `dtype` (None when there is none)."""
    for p in PRECISIONS.values():
        if np.dtype(dtype) == p.storage:
            return p
    return None


def recipe_attention(q, k, v, options, precision, dout=None, backward="eager", reorder=True):
    """The recipe of the module docstring: out, lse (and dq, dk, dv, dbias with dout).

    q, k, v (and dout): float32 arrays holding values of the compute dtype (float8 inputs
    already dequantized and rounded to it); options: an AttentionOptions record whose scale
    is the one the kernel applies. backward: 'eager' (the forward's ops differentiated one by
    one) or 'flash' (the tiled flash backward). reorder: the scale and the dropout's
    1 / (1 - p) applied to k and v (FlashAttention's reorder_ops), else to S and P.
    Results are float32 arrays holding values of the output dtype (lse: float32).
    """
    T = precision.compute
    rnd = lambda x: np.asarray(x, np.float32).astype(T).astype(np.float32)      # round to T
    o = options
    scale, inv_keep = np.float32(o.scale), np.float32(1 / (1 - o.dropout_p))
    if reorder:                                                                  # S = q (scale k)^T
        k_used = rnd(k * scale)
        s = rnd(grouped_matmul(q, np.swapaxes(k_used, -1, -2)))
    else:                                                                        # S = scale (q k^T)
        k_used = k
        s = rnd(rnd(grouped_matmul(q, np.swapaxes(k, -1, -2))) * scale)
    tanh = None
    if o.softcap is not None:
        tanh = rnd(np.tanh(rnd(s / np.float32(o.softcap))))
        s = rnd(tanh * np.float32(o.softcap))
    if o.bias is not None:
        s = rnd(s + rnd(o.bias))
    keep = keep_mask(o, s.shape)
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    p32, lse = _softmax32(s)
    p = rnd(p32)
    drop = _drop(o)
    if reorder:                                                                  # P~ = P mask, v' = v / (1 - p)
        p_drop, v_used = p * drop, rnd(v * inv_keep)
    else:                                                                        # P~ = P mask / (1 - p)
        p_drop, v_used = rnd(rnd(p * drop) * inv_keep), v
    p_drop = p_drop.astype(precision.weights).astype(np.float32)
    out = rnd(grouped_matmul(p_drop, v_used))
    result = {"out": out, "lse": lse}
    if dout is None:
        return result
    forward = _Forward(q=q, k=k, v=v, k_used=k_used, v_used=v_used, keep=keep, tanh=tanh, p=p,
                       p_drop=p_drop, out=out, lse=lse, reorder=reorder)
    grads = (_flash_backward if backward == "flash" else _eager_backward)(rnd, rnd(dout), o, forward)
    return {**result, **grads}


class _Forward(NamedTuple):
    """What the recipe's forward computed, for its backwards (float32 arrays)."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    k_used: np.ndarray      # the k of S = q k_used^T: scale k (reorder) or k
    v_used: np.ndarray      # the v of out = P~ v_used: v / (1 - p) (reorder) or v
    keep: object            # the keep-mask, or None
    tanh: object            # tanh(S / softcap) rounded, or None
    p: np.ndarray           # P rounded
    p_drop: np.ndarray      # P~ as multiplied with v_used
    out: np.ndarray
    lse: np.ndarray
    reorder: bool


def _softmax32(s):
    """(P, lse) of the scores in float32; a row of all -inf: P = 0, lse = -inf."""
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    e = np.exp(s - np.where(np.isneginf(m), 0, m))
    total = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = (np.where(np.isneginf(m), 0, m) + np.log(total))[..., 0]
        return np.where(total > 0, e / total, 0).astype(np.float32), lse.astype(np.float32)


def _eager_backward(rnd, dout, o, f):
    """The backward of the forward's ops, each rounded (torch's autograd in that dtype)."""
    h_kv, drop = with_head_axis(f.k).shape[-3], _drop(o)
    inv_keep, scale = np.float32(1 / (1 - o.dropout_p)), np.float32(o.scale)
    dv = rnd(grouped_sum_matmul(f.p_drop, dout, h_kv))
    dp = rnd(grouped_matmul(dout, np.swapaxes(f.v_used, -1, -2)))
    if f.reorder:
        grads, dp = {"dv": rnd(dv * inv_keep)}, dp * drop
    else:
        grads, dp = {"dv": dv}, rnd(rnd(dp * inv_keep) * drop)
    ds = rnd(f.p * (dp - np.sum(f.p * dp, axis=-1, keepdims=True)))
    if f.keep is not None:
        ds = np.where(f.keep, ds, 0)
    if o.bias is not None:
        grads["dbias"] = rnd(unbroadcast(ds, o.bias.shape))
    if f.tanh is not None:
        softcap = np.float32(o.softcap)
        ds = rnd(rnd(rnd(ds * softcap) * (1 - f.tanh ** 2)) / softcap)
    if f.reorder:
        grads["dq"] = rnd(grouped_matmul(ds, f.k_used))
        grads["dk"] = rnd(rnd(grouped_sum_matmul(ds, f.q, h_kv)) * scale)
    else:
        ds = rnd(ds * scale)
        grads["dq"] = rnd(grouped_matmul(ds, f.k))
        grads["dk"] = rnd(grouped_sum_matmul(ds, f.q, h_kv))
    return grads


def _flash_backward(rnd, dout, o, f):
    """FlashAttention's backward: P = exp(S - lse) and dS = P (dP - D) in float32 from float32
    scores, P and dS rounded to T for the products, dq, dk, dv accumulated in T over tiles
    (TILE_ROWS query rows for dk, dv; TILE_COLS keys for dq), as torch's CPU kernel does."""
    q, k, v = f.q, f.k, f.v
    h_kv, drop = with_head_axis(k).shape[-3], _drop(o)
    inv_keep, scale = np.float32(1 / (1 - o.dropout_p)), np.float32(o.scale)
    s = grouped_matmul(q, np.swapaxes(k, -1, -2)) * scale
    tanh32 = None
    if o.softcap is not None:
        tanh32 = np.tanh(s / np.float32(o.softcap))
        s = tanh32 * np.float32(o.softcap)
    if o.bias is not None:
        s = s + o.bias.astype(np.float32)
    if f.keep is not None:
        s = np.where(f.keep, s, -np.inf)
    with np.errstate(invalid="ignore"):
        p32 = np.where(np.isneginf(f.lse)[..., None], 0, np.exp(s - f.lse[..., None]))
    dp = grouped_matmul(dout, np.swapaxes(v, -1, -2)) * drop * inv_keep
    ds = p32 * (dp - np.sum(dout * f.out, axis=-1, keepdims=True))
    if f.keep is not None:
        ds = np.where(f.keep, ds, 0)
    grads = {} if o.bias is None else {"dbias": rnd(unbroadcast(ds, o.bias.shape))}
    if tanh32 is not None:
        ds = ds * (1 - tanh32 ** 2)
    p_T, ds_T = rnd(p32 * drop), rnd(ds)
    dq, dk, dv = (np.zeros(x.shape, np.float32) for x in (q, k, v))
    for r in range(0, q.shape[-2], TILE_ROWS):
        rows = (Ellipsis, slice(r, r + TILE_ROWS), slice(None))
        dv = rnd(dv + grouped_sum_matmul(p_T[rows], dout[rows], h_kv) * inv_keep)
        dk = rnd(dk + grouped_sum_matmul(ds_T[rows], q[rows], h_kv) * scale)
    for c in range(0, k.shape[-2], TILE_COLS):
        cols = slice(c, c + TILE_COLS)
        dq = rnd(dq + grouped_matmul(ds_T[..., cols], k[..., cols, :]) * scale)
    return {**grads, "dq": dq, "dk": dk, "dv": dv}


def _drop(options):
    """The dropout keep-mask as 0/1 float32 (1 without dropout)."""
    return np.float32(1) if options.dropout_scale is None else \
        (options.dropout_scale != 0).astype(np.float32)
