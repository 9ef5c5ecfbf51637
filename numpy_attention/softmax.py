"""Softmax over the last axis, its Jacobian, its vector-Jacobian product, logsumexp.

Shape legend:  ... any leading axes,  n the softmax axis (the last).

    z [..., n] -> p [..., n],   p_i = exp(z_i) / sum_j exp(z_j)

`plain_softmax` is the formula in two lines; `softmax_forward` computes the same p to
rounding, with these numerical choices:
- Max shift: every row is shifted by its top entry z_top (the largest real
  part), so exp never overflows; logits of +-1e4 (and beyond) give exact
  one-hot rows, never NaN.
- The top entry's exp(0) = 1 is kept apart from the others' mass t:
  sum_j exp(z_j - z_top) = 1 + t, lse = z_top + log1p(t). Nothing computes
  1 - p_top by subtraction, so a saturated row (p nearly one-hot) keeps the
  small quantities 1 - p_top = t / (1 + t) to full relative accuracy. This
  is what lets a complex-step check reach ~1e-15 on gradients of 1e-13.
- A row whose entries are all -inf has no distribution: softmax returns zeros
  there (the "safe softmax" of torch 2.5+ SDPA) and logsumexp returns -inf.
  Attention builds its fully-masked-row policies on this.
- Complex input is accepted (for complex-step gradient checks): the top entry
  is chosen by real part, and the shift subtracts the (complex) top entry
  itself, so the perturbation is carried without cancellation.
"""
from typing import NamedTuple, Optional

import numpy as np

from ._checks import as_float_array, require_cache, require_ndim, require_same_shape


class SoftmaxCache(NamedTuple):
    p: np.ndarray            # [..., n] the softmax output: all the backward needs
    top: Optional[np.ndarray] = None   # [..., 1] index of each row's largest p, if known
                                       # (softmax_backward finds it otherwise)


def _exp_below_top(z, overwrite_z=False):
    """Split each row at its top entry z_top (largest real part) and exponentiate the rest.

    Returns:
        e [..., n]      exp(z_j - z_top) for j != top, 0 at the top entry: a fresh array
                        (z's own memory with overwrite_z=True)
        top [..., 1]    the top entry's index
        t [..., 1]      sum_j e_j, the other entries' mass relative to the top one
        z_top [..., 1]  the top entry (-inf for a row of all -inf, where e and t are 0)
    so that sum_j exp(z_j - z_top) = 1 + t with the 1 exact and never added to t.
    A row of NaN picks a NaN as its top entry and comes out all NaN.
    """
    top = np.argmax(z.real, axis=-1)[..., None]                   # [..., 1]
    z_top = np.take_along_axis(z, top, axis=-1)                   # [..., 1]
    e = np.subtract(z, np.where(np.isneginf(z_top.real), 0, z_top),   # -inf rows stay -inf
                    out=z if overwrite_z else None)
    np.exp(e, out=e)                                              # in [0, 1]
    np.put_along_axis(e, top, 0, axis=-1)
    return e, top, np.sum(e, axis=-1, keepdims=True), z_top


def softmax_and_logsumexp(z, *, out=None, overwrite_z=False):
    """(p [..., n], lse [...], top [..., 1]) of the rows of z in one pass.

    p_i = exp(z_i - z_top) / (1 + t) and lse = z_top + log1p(t), t = sum_{j != top} exp(z_j - z_top).
    top is the index of each row's top entry, so also of its largest p (SoftmaxCache.top).
    A row of all -inf gives p = 0 and lse = -inf; an empty row gives lse = -inf (and top 0).

    out: an array of z's shape and dtype to write p into (attention writes each block of
        rows straight into its weights); p is a fresh array otherwise.
    overwrite_z=True lets the function use z's memory as scratch (z is lost): for callers
        that own z and do not need it afterwards.
    """
    if z.shape[-1] == 0:
        p = np.zeros(z.shape, z.dtype) if out is None else out
        return p, np.full(z.shape[:-1], -np.inf, z.dtype), np.zeros(z.shape[:-1] + (1,), np.intp)
    e, top, t, z_top = _exp_below_top(z, overwrite_z)
    inv = 1 / (1 + t)                                             # [..., 1]
    p = np.multiply(e, inv, out=e if out is None else out)        # e is ours: p may take its place
    np.put_along_axis(p, top, np.where(np.isneginf(z_top.real), 0, inv), axis=-1)
    return p, (z_top + np.log1p(t))[..., 0], top


def logsumexp(z, axis=-1, keepdims=False):
    """lse = z_top + log1p(sum_{j != top} exp(z_j - z_top)) over the last axis.

    Equal to log(sum_j exp(z_j)), never overflowing; -inf for a row of all -inf.

    Args:
        z: [..., n] logits (real or complex).
        axis: must be -1 (the softmax axis; scipy's axis=None, all axes, is refused).
    Returns:
        [...] (or [..., 1] with keepdims).
    """
    if axis is None or (axis != -1 and axis != np.ndim(z) - 1):
        raise ValueError(f"logsumexp reduces the last axis only (axis=-1), got axis={axis}")
    z = as_float_array(z, "z")
    require_ndim(z, "z", 1, "[..., n]")
    lse = softmax_and_logsumexp(z)[1]
    return lse[..., None] if keepdims else lse


def plain_softmax(z):
    """p = softmax(z) over the last axis in the blog's two lines: the formula to read first.

        e = exp(z - max z)            the shift changes nothing (it cancels) and keeps exp <= 1
        p = e / sum(e)

    softmax_forward computes the same p to rounding (tests/test_softmax.py: within 2 ulps,
    saturated rows too), with what this form lacks for a reference: a row of all -inf gives
    0 / 0 = NaN here but zeros there, the row's logsumexp comes with it (log1p of the small
    mass, accurate when the row is saturated), and the cache knows each row's largest p for
    an exact backward of saturated rows. Complex input works (the shift uses real parts).
    """
    e = np.exp(z - np.max(np.real(z), axis=-1, keepdims=True))   # [..., n]
    return e / np.sum(e, axis=-1, keepdims=True)                 # [..., n]


def softmax_forward(z):
    """p = softmax(z) over the last axis, shifted by each row's top entry.

    Forward:   p_i = exp(z_i - z_top) / (1 + t),   t = sum_{j != top} exp(z_j - z_top)
               (= exp(z_i) / sum_j exp(z_j))
    Backward:  dz = p * (dp - sum(dp * p))   (see `softmax_backward`)

    Args:
        z: [..., n] logits; -inf entries get weight 0.
    Returns:
        p [..., n] and a SoftmaxCache.
    """
    z = as_float_array(z, "z")
    require_ndim(z, "z", 1, "[..., n]")
    p, _, top = softmax_and_logsumexp(z)
    return p, SoftmaxCache(p=p.copy(), top=top)                   # the caller may write into p


def softmax_backward(dp, cache, *, overwrite_dp=False):
    """Vector-Jacobian product of softmax: dz = J^T dp with J = diag(p) - p p^T.

    Backward (docs/derivations.md, "Softmax"):
        dz_i = sum_j dp_j (p_j [i == j] - p_j p_i) = p_i (dp_i - sum_j dp_j p_j)

    Uses only the output p, never z. Equal to `softmax_jacobian(p) @ dp`
    (J is symmetric) at O(n) instead of O(n^2) per row. dp is first shifted by its
    value at the row's largest p (the result is unchanged because J 1 = 0), which
    keeps vanishing gradients of saturated rows accurate to rounding, relatively.
    The forward's cache knows where that is (cache.top); without it, it is searched for.

    overwrite_dp=True lets the function compute dz in dp's memory (as scipy's overwrite_a):
    for callers that own dp and do not need it afterwards.

    Returns:
        dz [..., n]
    """
    require_cache(cache, SoftmaxCache, "softmax_backward")
    p = as_float_array(cache.p, "cache.p")                        # a cache built by hand: any array
    dp = as_float_array(dp, "dp")
    require_same_shape(dp, p.shape, "dp")
    # J 1 = 0, so dz does not change if a row of dp is shifted by a constant. Shifting by dp at
    # the row's largest p makes that entry's bracket exactly 0: in a saturated row (p nearly
    # one-hot) the tiny gradient is then a sum of small terms, not a difference of O(1) ones,
    # and keeps full relative accuracy instead of an absolute error of eps.
    if p.size == 0:                                               # no row, or empty rows: no gradient
        return np.zeros(p.shape, np.result_type(p, dp))           # (and no einsum over nothing)
    top = np.argmax(p.real, axis=-1)[..., None] if cache.top is None else np.asarray(cache.top)
    if top.shape != p.shape[:-1] + (1,) or top.dtype.kind not in "iu":
        raise ValueError(f"cache.top must be integer indices of shape p.shape[:-1] + (1,) = "
                         f"{p.shape[:-1] + (1,)} (p {p.shape}), got {top.dtype} {top.shape}")
    shift = np.take_along_axis(dp, top, axis=-1)
    dtype = np.result_type(dp, p)
    dz = np.subtract(dp, shift, dtype=dtype, out=dp if overwrite_dp and dp.dtype == dtype else None)
    # dz is ours from here (fresh, or dp's memory by permission) and is worked in place
    dz -= np.einsum("...i,...i->...", dz, p)[..., None]           # dp - sum(dp * p)
    dz *= p                                                       # p * (dp - sum(dp * p))
    return dz


def softmax_jvp(z, z_dot):
    """(p, p_dot): p = softmax(z) and its directional derivative along z_dot (forward mode).

    Forward mode (docs/derivations.md):  p_dot = J z_dot = p * (z_dot - <p, z_dot>)
    (J is symmetric, so this is softmax_backward's formula with z_dot in dp's place; z_dot
    is shifted by its value at the row's largest p first, which changes nothing since
    J 1 = 0 and keeps the tiny tangents of saturated rows accurate.)
    Shapes: z, z_dot [..., n] -> p, p_dot [..., n].
    """
    p, cache = softmax_forward(z)
    return p, softmax_backward(z_dot, cache)


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
