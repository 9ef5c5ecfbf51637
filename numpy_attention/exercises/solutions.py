"""Reference solutions of the exercises: each backward in plain NumPy, one line per formula.

These are what `exercises.check` expects a learner's function to compute; read them after
writing your own. Shape legend (the blog's names):
    ...  leading axes (batch, heads),  N / N_q / N_k lengths,  B batch,  H heads
    d_in, d_out  a projection's widths;  D = d_model;  d_k, d_v head widths (d_k = D / H)

The forwards they differentiate (grading.py's EXERCISES call these):
    linear      y = x W + b                     x [..., d_in], W [d_in, d_out], b [d_out]
    softmax     p = exp(z) / sum_j exp(z_j)     over the last axis, z [..., n]
    attention   S = q k^T / sqrt(d_k),  P = softmax(S),  out = P v
                q [..., N_q, d_k], k [..., N_k, d_k], v [..., N_k, d_v], out [..., N_q, d_v]
    heads       split [B, N, D] -> [B, H, N, d_k],  merge [B, H, N, d_k] -> [B, N, D]
    multihead   the blog's five steps (multihead_forward below)

Everything here accepts complex input (the checker differentiates the forwards by complex
step); the softmax is softmax.py's two-line plain_softmax.
"""
import numpy as np

from ..softmax import plain_softmax as softmax     # p = exp(z - max z) / sum_j exp(z_j - max z)


def _t(x):
    """x^T: the last two axes swapped."""
    return np.swapaxes(x, -1, -2)


# ----------------------------------------------------------------------------- forwards

def attention(q, k, v):
    """(out, P): S = q k^T / sqrt(d_k), P = softmax(S), out = P v."""
    S = q @ _t(k) / np.sqrt(q.shape[-1])            # [..., N_q, N_k]
    P = softmax(S)                                  # [..., N_q, N_k]
    return P @ v, P                                 # [..., N_q, d_v]


def multihead_forward(query, key, value, params, num_heads):
    """(out, cache): MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o + b_o, in five steps.

    query [B, N_q, D], key and value [B, N_k, D]; params {"W_q", "b_q", ..., "W_o", "b_o"} in the
    math layout, W [D, D] (y = x W + b; torch's nn.Linear stores W^T). cache: a dict of the
    inputs, params, num_heads and what each step made (Qh, Kh, Vh, P, heads, concat).
    """
    p = params
    Q = query @ p["W_q"] + p["b_q"]                 # 1. projections          [B, N, D]
    K = key @ p["W_k"] + p["b_k"]
    V = value @ p["W_v"] + p["b_v"]
    Qh, Kh, Vh = (split_heads(x, num_heads) for x in (Q, K, V))   # 2. split   [B, H, N, d_k]
    heads, P = attention(Qh, Kh, Vh)                # 3. attention per head   [B, H, N_q, d_k]
    concat = merge_heads(heads)                     # 4. merge                [B, N_q, D]
    out = concat @ p["W_o"] + p["b_o"]              # 5. output projection    [B, N_q, D]
    cache = dict(query=query, key=key, value=value, params=params, num_heads=num_heads,
                 Qh=Qh, Kh=Kh, Vh=Vh, P=P, heads=heads, concat=concat)
    return out, cache


# ----------------------------------------------------------------------------- the exercises

def linear_backward(dy, x, W):
    """(dx, dW, db) of y = x W + b: dx = dy W^T, dW = x^T dy and db = dy, each summed over
    the leading axes (every position used the same W and b)."""
    dx = dy @ W.T                                                   # [..., d_in]
    dW = x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])   # [d_in, d_out]
    db = dy.reshape(-1, dy.shape[-1]).sum(axis=0)                   # [d_out]
    return dx, dW, db


def softmax_backward(dp, p):
    """dz = J^T dp with J = diag(p) - p p^T, row by row: dz = p * (dp - rowsum(p * dp))."""
    return p * (dp - np.sum(p * dp, axis=-1, keepdims=True))


def attention_backward(dout, q, k, v, p):
    """(dq, dk, dv) of out = softmax(q k^T / sqrt(d_k)) v, P = p given: the forward's
    three lines in reverse."""
    dv = _t(p) @ dout                               # out = P v:  dv = P^T dout  [..., N_k, d_v]
    dP = dout @ _t(v)                               #             dP = dout v^T  [..., N_q, N_k]
    dS = softmax_backward(dP, p)                    # P = softmax(S)             [..., N_q, N_k]
    dq = dS @ k / np.sqrt(q.shape[-1])              # S = q k^T / sqrt(d_k)      [..., N_q, d_k]
    dk = _t(dS) @ q / np.sqrt(q.shape[-1])          #                            [..., N_k, d_k]
    return dq, dk, dv


def split_heads(x, num_heads):
    """[..., N, D] -> [..., H, N, D / H]: the width cut into H heads, then heads before N."""
    *lead, n, d_model = x.shape
    xh = x.reshape(*lead, n, num_heads, d_model // num_heads)   # [..., N, H, d_k]
    return np.swapaxes(xh, -2, -3)                               # [..., H, N, d_k]


def merge_heads(xh):
    """[..., H, N, d_k] -> [..., N, H d_k]: split_heads undone (each is the other's backward)."""
    *lead, h, n, d = xh.shape
    return np.swapaxes(xh, -2, -3).reshape(*lead, n, h * d)     # [..., N, H, d_k] -> [..., N, D]


def multihead_backward(dout, cache):
    """The gradients of multihead_forward: its five steps in reverse, one line each.

    Returns {"query", "key", "value", "W_q", "b_q", "W_k", "b_k", "W_v", "b_v", "W_o", "b_o"}.
    """
    c, p, H = cache, cache["params"], cache["num_heads"]
    g = {}
    dconcat, g["W_o"], g["b_o"] = linear_backward(dout, c["concat"], p["W_o"])     # 5. output projection
    dheads = split_heads(dconcat, H)                                               # 4. merge's backward
    dQh, dKh, dVh = attention_backward(dheads, c["Qh"], c["Kh"], c["Vh"], c["P"])  # 3. attention
    dQ, dK, dV = (merge_heads(d) for d in (dQh, dKh, dVh))                         # 2. split's backward
    g["query"], g["W_q"], g["b_q"] = linear_backward(dQ, c["query"], p["W_q"])     # 1. projections
    g["key"], g["W_k"], g["b_k"] = linear_backward(dK, c["key"], p["W_k"])
    g["value"], g["W_v"], g["b_v"] = linear_backward(dV, c["value"], p["W_v"])
    return g
