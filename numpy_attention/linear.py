"""Linear projection in the blog's math layout: Y = X W + b.

Shape legend:  ... any leading axes (batch, sequence),  d_in / d_out widths.

    x  [..., d_in]     W  [d_in, d_out]     b  [d_out]     y  [..., d_out]

(torch's nn.Linear stores its weight as [d_out, d_in] and computes x W^T + b;
`MultiHeadAttention` converts at its state_dict boundary, never here.)
"""
import math
from typing import NamedTuple

import numpy as np

from ._checks import as_float_array, kept, require_cache, require_ndim, require_same_shape


class LinearCache(NamedTuple):
    x: np.ndarray            # [..., d_in]   the input as the forward saw it (_checks.kept)
    W: np.ndarray            # [d_in, d_out] the same
    has_bias: bool           # whether a bias took part (db is None otherwise)
    out_shape: tuple         # [..., d_out]  the forward output's shape


def linear_forward(x, W, b=None):
    """y = x W + b.

    Forward:   y[..., j] = sum_i x[..., i] W[i, j] + b[j]
    Backward:  see `linear_backward`.

    Args:
        x: [..., d_in] input, any number of leading axes (at least one axis).
        W: [d_in, d_out] weight, math layout.
        b: optional [d_out] bias.
    Returns:
        y [..., d_out] and a LinearCache.
    """
    x = as_float_array(x, "x")
    W = as_float_array(W, "W")
    require_ndim(x, "x", 1, "[..., d_in]")
    if W.ndim != 2:
        raise ValueError(f"W must have 2 axes [d_in, d_out], got shape {W.shape}")
    if x.shape[-1] != W.shape[0]:
        raise ValueError(f"x's last axis (d_in={x.shape[-1]}, x shape {x.shape}) must equal "
                         f"W's first axis (W shape {W.shape})")
    # as [N, d_in] @ [d_in, d_out], N = prod(...): one BLAS call, not one per leading index
    y = (x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) @ W).reshape(x.shape[:-1] + (W.shape[1],))
    if b is not None:
        b = as_float_array(b, "b")
        if b.shape != (W.shape[1],):
            raise ValueError(f"b must have shape (d_out,) = ({W.shape[1]},), got {b.shape}")
        y = np.add(y, b, out=y if np.result_type(y, b) == y.dtype else None)   # in place: y is ours
    # copies (unless nothing can write into them: kept): changing the caller's x or W after
    # the forward cannot change the backward
    return y, LinearCache(x=kept(x), W=kept(W), has_bias=b is not None, out_shape=y.shape)


def linear_backward(dy, cache):
    """Gradients of y = x W + b.

    Backward (derivation in docs/derivations.md, "Linear"):
        dx = dy W^T                                  [..., d_out] @ [d_out, d_in]
        dW = sum over leading axes of x^T dy          [d_in, N] @ [N, d_out], N = prod(...)
        db = sum over leading axes of dy              [d_out]   (None without a bias)

    Returns:
        (dx, dW, db)
    """
    require_cache(cache, LinearCache, "linear_backward", arrays=("x", "W"))
    require_same_shape(dy, cache.out_shape, "dy")
    dy = as_float_array(dy, "dy")
    x, W = cache.x, cache.W
    n = math.prod(x.shape[:-1])                          # N, the number of leading positions
    x2 = x.reshape(n, x.shape[-1])                       # [N, d_in]
    dy2 = dy.reshape(n, dy.shape[-1])                    # [N, d_out]
    # 1. dx: the forward was y = x @ W, so dx = dy @ W^T
    dx = (dy2 @ W.T).reshape(x.shape)                    # [N, d_out] @ [d_out, d_in] -> [N, d_in]
    # 2. dW: every leading position contributes an outer product x^T dy
    dW = x2.T @ dy2                                      # [d_in, N] @ [N, d_out] -> [d_in, d_out]
    # 3. db: b was broadcast over the leading axes, so its gradient sums over them
    db = dy2.sum(axis=0) if cache.has_bias else None     # [d_out]
    return dx, dW, db


def linear_jvp(x, W, b=None, x_dot=None, W_dot=None, b_dot=None):
    """(y, y_dot): y = x W + b and its directional derivative along the tangents.

    Forward mode:  y_dot = x_dot W + x W_dot + b_dot   (a tangent left None is 0)
    Shapes as linear_forward's; each tangent has its primal's shape.
    """
    y, cache = linear_forward(x, W, b)
    y_dot = np.zeros(y.shape, y.dtype)
    for name, tangent, primal in (("x_dot", x_dot, cache.x), ("W_dot", W_dot, cache.W), ("b_dot", b_dot, b)):
        if tangent is not None and np.shape(tangent) != np.shape(primal):
            raise ValueError(f"{name} must have the shape of its primal {np.shape(primal)}, got {np.shape(tangent)}")
    if x_dot is not None:
        y_dot = y_dot + linear_forward(x_dot, cache.W)[0]               # x_dot W
    if W_dot is not None:
        y_dot = y_dot + linear_forward(cache.x, W_dot)[0]               # x W_dot
    if b_dot is not None:
        y_dot = y_dot + as_float_array(b_dot, "b_dot")                   # b_dot
    return y, y_dot
