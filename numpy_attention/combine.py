"""Split-KV combine: merge attention computed over separate key splits, forward and backward.

Shape legend:  S splits,  ... leading axes (batch, heads),  N query rows,  d value width.

    outs [S, ..., N, d], lses [S, ..., N]   ->   out [..., N, d], lse [..., N]

Split-KV decoding and ring attention run attention over each split s of the keys alone and
keep (out_s, lse_s); attention over all the keys is then

    lse = log sum_s exp(lse_s)                       (one softmax's denominator, summed)
    w_s = exp(lse_s - lse)                           the share of split s: sum_s w_s = 1
    out = sum_s w_s out_s

A split whose keys are all masked has lse_s = -inf and weight 0; when every split is, the
row is fully masked: out = 0 and lse = -inf (the 'zero' policy). With base=2 (kernels that
keep lse in log2 for exp2) lse = log2 sum_s 2^lse_s and w_s = 2^(lse_s - lse).

Backward (docs/derivations.md, "Split-KV combine"), with dw_t / dlse_s = c w_t ([t = s] - w_s),
c = 1 for base e and ln 2 for base 2:

    dout_s = w_s dout
    dlse_s = c w_s (<dout, out_s> - <dout, out>) + w_s dlse
"""
import math
import warnings
from typing import NamedTuple

import numpy as np

from ._checks import as_float_array, require_cache, require_same_shape

BASES = ("e", 2)


class CombineCache(NamedTuple):
    outs: np.ndarray        # [S, ..., N, d] the partial outputs (a copy)
    weights: np.ndarray     # [S, ..., N] w_s, 0 for a split with lse_s = -inf
    out: np.ndarray         # [..., N, d]
    base: object            # 'e' or 2


def _check(outs, lses, base):
    if isinstance(base, (bool, np.bool_)) or base not in BASES:
        raise ValueError(f"base must be 'e' or 2, got {base!r}")
    outs, lses = as_float_array(outs, "outs"), as_float_array(lses, "lses")
    if outs.ndim < 3 or lses.shape != outs.shape[:-1]:
        raise ValueError(f"outs must be [S, ..., N, d] and lses [S, ..., N] (outs' shape without d), "
                         f"got outs {outs.shape}, lses {lses.shape}")
    if outs.shape[0] == 0:
        raise ValueError(f"outs and lses need at least one split (S >= 1), got outs {outs.shape}")
    if np.isnan(lses).any() or np.isposinf(lses.real).any():
        raise ValueError("lses must be finite or -inf (a split with every key masked); got NaN or +inf")
    dtype = np.result_type(outs, lses)
    return outs.astype(dtype), lses.astype(dtype, copy=False)


def combine_forward(outs, lses, base="e"):
    """(out [..., N, d], lse [..., N], CombineCache): the partials merged (module docstring)."""
    outs, lses = _check(outs, lses, base)
    exp, log = (np.exp, np.log) if base == "e" else (np.exp2, np.log2)
    top = np.max(lses.real, axis=0)                                   # [..., N], -inf: every split masked
    shift = np.where(np.isneginf(top), 0, top)
    e = exp(lses - shift)                                             # [S, ..., N] in [0, 1]
    total = np.sum(e, axis=0)
    dead = total == 0
    with np.errstate(divide="ignore"):
        lse = np.where(dead, -np.inf, shift + log(np.where(dead, 1, total)))
    weights = e / np.where(dead, 1, total)                            # w_s = exp(lse_s - lse)
    out = np.sum(weights[..., None] * outs, axis=0)                   # sum_s w_s out_s
    return out, lse, CombineCache(outs=outs, weights=weights, out=out.copy(), base=base)


def combine_backward(dout, cache, dlse=None):
    """(douts [S, ..., N, d], dlses [S, ..., N]): the gradients of the partials.

    dout [..., N, d]; cache: combine_forward's; dlse [..., N] or None (0), in the order
    attention_backward takes them. The older order (dout, dlse, cache) still works, with a
    DeprecationWarning.
    """
    if isinstance(dlse, CombineCache) and not isinstance(cache, CombineCache):
        warnings.warn("combine_backward(dout, dlse, cache) is deprecated: pass (dout, cache, dlse), the "
                      "order of attention_backward", DeprecationWarning, stacklevel=2)
        cache, dlse = dlse, cache
    require_cache(cache, CombineCache, "combine_backward", arrays=("outs", "weights", "out"))
    require_same_shape(dout, cache.out.shape, "dout")
    dout = as_float_array(dout, "dout")
    w = cache.weights
    douts = w[..., None] * dout                                       # dout_s = w_s dout
    c = 1.0 if cache.base == "e" else math.log(2)
    dots = np.sum(dout * cache.outs, axis=-1) - np.sum(dout * cache.out, axis=-1)   # <dout, out_s - out>
    dlses = c * w * dots
    if dlse is not None:
        require_same_shape(dlse, w.shape[1:], "dlse")
        dlses = dlses + w * as_float_array(dlse, "dlse")              # d lse / d lse_s = w_s
    return douts, dlses
