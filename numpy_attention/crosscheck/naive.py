"""The naive baseline: attention with every sum taken left to right, in the candidate's dtype.

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

Shapes as in attention.py; the steps are attention.py's, with recursive sums:
    S = scale q k^T -> softcap -> + bias -> masks -> P = softmax(S), lse -> P~ = P * dropout
    -> out = P~ v;   backward: P = exp(S - lse),  dv = P~^T dout,  dP = (dout v^T) * dropout,
    D = rowsum(dout * out),  dS = P (dP - D),  dbias = dS summed to bias's shape,
    dq = scale dS k,  dk = scale dS^T q
"""
import numpy as np

from .._layout import unbroadcast
from ..options import keep_mask


def recursive_matmul(a, b):
    """a @ b, [..., m, n] @ [..., n, p] -> [..., m, p], each dot product summed left to right."""
    acc = np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                   dtype=np.result_type(a, b))
    for i in range(a.shape[-1]):
        acc = acc + a[..., :, i:i + 1] * b[..., i:i + 1, :]
    return acc


def recursive_rowsum(x):
    """sum over the last axis, left to right: [..., n] -> [..., 1]."""
    return recursive_matmul(x, np.ones(x.shape[-1:] + (1,), dtype=x.dtype))


def _heads(q, k):
    """(H, H_kv) with a head axis of 1 for 2-axis inputs."""
    return (q.shape[-3], k.shape[-3]) if q.ndim >= 3 else (1, 1)


def naive_attention(q, k, v, options, dout=None):
    """out, lse (and dq, dk, dv, dbias with dout) in q's dtype, as a dict.

    q, k, v and options (an AttentionOptions record) as `attention_options` returns them:
    naive_attention(*attention_options(q, k, v, **kwargs), dout=dout). Without dout, the
    forward alone.
    """
    o = options
    h, h_kv = _heads(q, k)
    fold = lambda x: (x.reshape(x.shape[:-3] + (h_kv, x.shape[-3] // h_kv * x.shape[-2], x.shape[-1]))
                      if q.ndim >= 3 else x)                          # [..., H, N, X] -> [..., H_kv, G*N, X]
    n_k = k.shape[-2]
    s = recursive_matmul(fold(q) * o.scale, np.swapaxes(k, -1, -2)).reshape(q.shape[:-1] + (n_k,))
    softcap_tanh = None
    if o.softcap is not None:
        softcap_tanh = np.tanh(s / o.softcap)
        s = o.softcap * softcap_tanh
    if o.bias is not None:
        s = s + o.bias
    keep = keep_mask(o, s.shape)
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)          # -inf: no key (N_k = 0) or all masked
    m = np.where(np.isneginf(m), 0, m)
    e = np.exp(s - m)
    total = recursive_rowsum(e)
    dead = total == 0                                              # a fully masked row
    fill = {"zero": 0.0, "uniform": 1.0 / max(n_k, 1), "nan": np.nan}[o.fully_masked]   # (no key: 'zero' only)
    p = np.where(dead, fill,
                 e / np.where(dead, 1, total)).astype(s.dtype)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total))[..., 0]
    drop = o.dropout_scale
    p_drop = p if drop is None else (p * drop).astype(s.dtype)
    out = recursive_matmul(fold(p_drop), v).reshape(q.shape[:-1] + v.shape[-1:])
    result = {"out": out, "lse": lse}
    if dout is None:
        return result
    swap = lambda x: np.swapaxes(x, -1, -2)
    with np.errstate(invalid="ignore"):                            # -inf - (-inf) in dead rows
        p = np.where(dead, p, np.exp(s - lse[..., None]))           # FlashAttention's recomputation
    p_drop = p if drop is None else (p * drop).astype(s.dtype)
    result["dv"] = recursive_matmul(swap(fold(p_drop)), fold(dout)).reshape(v.shape)
    dp = recursive_matmul(fold(dout), swap(v)).reshape(p.shape)
    dp = dp if drop is None else (dp * drop).astype(s.dtype)
    ds = p * (dp - recursive_rowsum(dout * out))
    ds = np.where(np.isneginf(s), 0, ds)
    if o.bias is not None:
        result["dbias"] = unbroadcast(ds, o.bias.shape)
    if softcap_tanh is not None:
        ds = ds * (1 - softcap_tanh ** 2)
    result["dq"] = o.scale * recursive_matmul(fold(ds), k).reshape(q.shape)
    result["dk"] = o.scale * recursive_matmul(swap(fold(ds)), fold(q)).reshape(k.shape)
    return result
