"""Softmax over the last axis, its Jacobian, its vector-Jacobian product, logsumexp.

Shape legend:  ... any leading axes,  n the softmax axis (the last).

    z [..., n] -> p [..., n],   p_i = exp(z_i - m) / sum_j exp(z_j - m),   m = max_j Re z_j

Numerical choices:
- Max shift: subtracting the row maximum makes exp never overflow; logits of
  +-1e4 (and beyond) give exact one-hot rows, never NaN.
- A row whose entries are all -inf has no distribution: softmax returns zeros
  there (the "safe softmax" of torch 2.5+ SDPA) and logsumexp returns -inf.
  Attention builds its fully-masked-row policies on this.
- Complex input is accepted (for complex-step gradient checks): the shift uses
  the real part, which is constant in the imaginary perturbation.
"""
from typing import NamedTuple

import numpy as np

from ._checks import as_float_array, require_cache, require_ndim, require_same_shape


class SoftmaxCache(NamedTuple):
    p: np.ndarray            # [..., n] the softmax output: all the backward needs


def _row_max(z):
    """m = max_j Re z_j per row, with rows of all -inf (or empty) shifted by 0 instead."""
    if z.shape[-1] == 0:
        return np.zeros(z.shape[:-1] + (1,), dtype=z.real.dtype)
    m = np.max(z.real, axis=-1, keepdims=True)           # [..., 1]
    return np.where(np.isneginf(m), 0.0, m).astype(z.real.dtype)


def logsumexp(z, axis=-1, keepdims=False):
    """lse = m + log(sum_j exp(z_j - m)) over the last axis; -inf for a row of all -inf.

    Args:
        z: [..., n] logits (real or complex).
        axis: must be -1 (the softmax axis); accepted for familiarity with scipy.
    Returns:
        [...] (or [..., 1] with keepdims).
    """
    if axis not in (-1, None) and axis != np.ndim(z) - 1:
        raise ValueError(f"logsumexp reduces the last axis only, got axis={axis}")
    z = as_float_array(z, "z")
    require_ndim(z, "z", 1, "[..., n]")
    m = _row_max(z)                                      # [..., 1]
    s = np.sum(np.exp(z - m), axis=-1, keepdims=True)    # [..., 1], 0 for an all -inf row
    with np.errstate(divide="ignore"):                   # log(0) = -inf for an all -inf row
        lse = m + np.log(s)
    return lse if keepdims else lse[..., 0]


def softmax_forward(z):
    """p = softmax(z) over the last axis, max-shifted.

    Forward:   p_i = exp(z_i - m) / sum_j exp(z_j - m)
    Backward:  dz = p * (dp - sum(dp * p))   (see `softmax_backward`)

    Args:
        z: [..., n] logits; -inf entries get weight 0.
    Returns:
        p [..., n] and a SoftmaxCache.
    """
    z = as_float_array(z, "z")
    require_ndim(z, "z", 1, "[..., n]")
    e = np.exp(z - _row_max(z))                          # [..., n], every entry in [0, 1]
    s = np.sum(e, axis=-1, keepdims=True)                # [..., 1], >= 1 unless the row is all -inf
    p = e / np.where(s == 0, 1, s)                       # an all -inf row stays all zeros
    return p, SoftmaxCache(p=p)


def softmax_backward(dp, cache):
    """Vector-Jacobian product of softmax: dz = J^T dp with J = diag(p) - p p^T.

    Backward (docs/derivations.md, "Softmax"):
        dz_i = sum_j dp_j (p_j [i == j] - p_j p_i) = p_i (dp_i - sum_j dp_j p_j)

    Uses only the output p, never z. Equal to `softmax_jacobian(p) @ dp`
    (J is symmetric) at O(n) instead of O(n^2) per row.

    Returns:
        dz [..., n]
    """
    require_cache(cache, SoftmaxCache, "softmax_backward")
    require_same_shape(dp, cache.p.shape, "dp")
    dp = as_float_array(dp, "dp")
    p = cache.p
    return p * (dp - np.sum(dp * p, axis=-1, keepdims=True))


def softmax_jacobian(p):
    """The explicit softmax Jacobian J[..., i, j] = dp_i / dz_j = p_i [i == j] - p_i p_j.

    Args:
        p: [..., n] softmax output.
    Returns:
        J [..., n, n] = diag(p) - p p^T (symmetric), for study; use
        `softmax_backward` to differentiate.
    """
    p = as_float_array(p, "p")
    require_ndim(p, "p", 1, "[..., n]")
    n = p.shape[-1]
    diag = p[..., :, None] * np.eye(n, dtype=p.dtype)    # [..., n, n]
    return diag - p[..., :, None] * p[..., None, :]      # diag(p) - p p^T
