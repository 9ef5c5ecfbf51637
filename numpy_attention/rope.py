"""Rotary position embeddings (RoPE): each pair of a vector's entries turned by an angle that
grows with the token's position, so that q . k depends on the positions' difference alone.

Shape legend:  ... any leading axes (batch, heads),  N positions,  d the width,
r = rotary_dim (even, <= d) the width that turns: the first r entries (part='first', Llama's
and GPT-NeoX's partial rotary) or the last r (part='last', DeepSeek's MLA: [nope ; rope]); the
other d - r entries pass unchanged.

    x [..., N, d],  positions broadcastable to [..., N]  ->  y [..., N, d]

Angles: theta[p, i] = positions[p] * inv_freq[i],  inv_freq[i] = base^(-2i / r),  i < r / 2
(computed in float64, or in x's dtype where it is wider); with scaling, inv_freq and the
positions change (`frequencies`).

Pairs, by layout (the convention a kernel must match):
    'half'         (GPT-NeoX, Llama, HF's rotate_half; FlashAttention interleaved=False)
                   entry i with entry i + r/2
    'interleaved'  (GPT-J; FlashAttention interleaved=True) entry 2i with entry 2i + 1

Forward, each pair (a, b) with its angle theta:
    y_a = a cos(theta) - b sin(theta),   y_b = b cos(theta) + a sin(theta)
Backward (a rotation's transpose is the rotation back):
    da = dy_a cos(theta) + dy_b sin(theta),   db = -dy_a sin(theta) + dy_b cos(theta)
Forward mode: rope is linear in x, so y_dot = rope(x_dot).

Inside attention (`rope_qk`, attention_forward's rope=): q and k turned by their tokens'
positions, by default bottom-right (query i at i + N_k - N_q) in each packed sequence.
"""
import math
from typing import NamedTuple

import numpy as np

from ._checks import (as_float_array, brief, offenders, require_bool, require_cache, require_choice,
                      require_mapping, require_nonnegative_real, require_positive_real, require_same_shape)
from .positions import positions as score_positions

LAYOUTS = ("half", "interleaved")
PARTS = ("first", "last")
ROPE_KEYS = ("layout", "rotary_dim", "part", "base", "scaling", "positions_q", "positions_k")   # rope_qk's dict
SCALINGS = {"linear": ("type", "factor"),             # type -> the keys it takes (Hugging Face's rope_scaling)
            "yarn": ("type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
                     "mscale", "mscale_all_dim", "attention_factor")}


class RopeCache(NamedTuple):
    cos: np.ndarray             # [..., N, r/2] cos(theta), broadcastable to x's pairs (times YaRN's factor)
    sin: np.ndarray             # [..., N, r/2] sin(theta), likewise
    layout: str                 # 'half' or 'interleaved'
    rotary_dim: int             # r
    part: str                   # 'first' or 'last': which r entries turn
    shape: tuple                # x's shape


def frequencies(rotary_dim, base=10000.0, scaling=None, dtype=np.float64):
    """(inv_freq [r/2] in `dtype`, position_factor, magnitude): theta = positions *
    position_factor * inv_freq, and cos, sin times `magnitude`.

    scaling, as Hugging Face's rope_scaling (its _compute_yarn_parameters for YaRN):
        None                      inv_freq = base^(-2i / r)
        {"type": "linear", "factor": f}            positions / f
        {"type": "yarn", "factor": f, "original_max_position_embeddings": L,
         "beta_fast": 32, "beta_slow": 1,           YaRN: low frequencies interpolated (/ f), high
         "truncate": True}                          ones kept, a linear ramp between the dims of
                                                    beta_fast and beta_slow rotations over L (those
                                                    dims rounded out to integers unless truncate is
                                                    False, as gpt-oss has it)
            magnitude, YaRN's attention factor: "attention_factor" if given; else with "mscale"
            and "mscale_all_dim" both nonzero (DeepSeek's) mscale(f, mscale) / mscale(f,
            mscale_all_dim); else mscale(f, 1); mscale(f, m) = 0.1 m ln f + 1 (1 for f <= 1)
    ValueError where base, scaling or their frequencies are out of range (YaRN needs base != 1).
    """
    dtype = np.dtype(dtype)
    half = np.arange(0, rotary_dim, 2, dtype=dtype) / rotary_dim            # 2i / r
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):    # (checked below)
        powers = np.asarray(base, dtype) ** half                            # [r/2]
        inv_freq = 1 / powers                                               # (the peers' order of ops)
        inv_freq, position_factor, magnitude = _scaled(inv_freq, powers, rotary_dim, base, scaling, dtype)
    bad = ~np.isfinite(inv_freq)
    if bad.any() or not math.isfinite(position_factor):
        where = offenders("inv_freq", inv_freq, bad) if bad.any() else f"positions times {position_factor}"
        raise ValueError(f"base {base} and scaling {scaling} give frequencies outside the float range: {where}")
    return inv_freq, position_factor, magnitude


def _scaled(inv_freq, powers, rotary_dim, base, scaling, dtype):
    """frequencies' (inv_freq, position_factor, magnitude) for its scaling, from the unscaled
    inv_freq = 1 / powers [r/2]."""
    if scaling is None:
        return inv_freq, 1.0, 1.0
    require_mapping(scaling, "scaling")
    kind = require_choice(scaling.get("type"), "scaling['type']", tuple(SCALINGS))
    unknown = sorted(set(scaling) - set(SCALINGS[kind]))
    if unknown:
        raise ValueError(f"scaling has the key {unknown[0]!r}; a {kind} scaling takes {', '.join(SCALINGS[kind])}")
    factor = require_positive_real(scaling.get("factor"), "scaling['factor']")
    if kind == "linear":
        return inv_freq, 1.0 / factor, 1.0
    if base == 1:
        raise ValueError("YaRN's ramp divides by ln(base): base must not be 1")
    length = require_positive_real(scaling.get("original_max_position_embeddings"),
                                   "scaling['original_max_position_embeddings']")
    fast, slow = (require_positive_real(scaling.get(name, default), f"scaling[{name!r}]")
                  for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)))
    low, high = (_correction_dim(rotations, length, rotary_dim, base) for rotations in (fast, slow))
    if require_bool(scaling.get("truncate", True), "scaling['truncate']"):
        low, high = math.floor(low), math.ceil(high)
    low, high = float(max(low, 0)), float(min(high, rotary_dim - 1))
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=dtype) - low) / dtype.type((high - low) or 0.001), 0, 1)
    kept = 1 - ramp                                                         # 1: extrapolate (keep)
    inv_freq = 1 / (dtype.type(factor) * powers) * (1 - kept) + inv_freq * kept
    return inv_freq, 1.0, _attention_factor(scaling, factor)


def _correction_dim(rotations, length, rotary_dim, base):
    """r ln(L / (2 pi rotations)) / (2 ln base): the dim i whose wavelength turns `rotations` times
    over L positions (Hugging Face's find_correction_dim; in logs where the ratio leaves the
    float range)."""
    ratio = length / (rotations * 2 * math.pi)
    log_ratio = math.log(ratio) if 0 < ratio < math.inf else \
        math.log(length) - math.log(rotations) - math.log(2 * math.pi)
    return rotary_dim * log_ratio / (2 * math.log(base))


def _attention_factor(scaling, factor):
    """YaRN's magnitude of cos and sin (frequencies' docstring), from a yarn scaling dict."""
    if scaling.get("attention_factor") is not None:
        return require_positive_real(scaling["attention_factor"], "scaling['attention_factor']")
    mscale, mscale_all_dim = (require_nonnegative_real(scaling.get(name, 0.0), f"scaling[{name!r}]")
                              for name in ("mscale", "mscale_all_dim"))
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def yarn_mscale(factor, mscale=1.0):
    """YaRN's mscale, 0.1 mscale ln(factor) + 1 (1 for factor <= 1): its attention factor; DeepSeek's
    softmax_scale is qk_head_dim^-0.5 yarn_mscale(factor, mscale_all_dim)^2."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _pairs(x, layout, r, part="first"):
    """(a, b): the two entries of each turning pair among x's first or last r, [..., N, r/2] views."""
    x = x[..., :r] if part == "first" else x[..., x.shape[-1] - r:]
    if layout == "half":
        return x[..., :r // 2], x[..., r // 2:]
    return x[..., 0::2], x[..., 1::2]


def turned(x, cos, sin, layout, r, part, rnd=None):
    """x with each pair (a, b) turned: (a cos - b sin, b cos + a sin); the rest as it is. rnd:
    None, or a rounding applied after each product and each sum (a kernel's low precision,
    oracle/rotary.py)."""
    a, b = _pairs(x, layout, r, part)
    y = np.array(x, dtype=np.result_type(x, cos), copy=True)
    ya, yb = _pairs(y, layout, r, part)
    if rnd is None:
        ya[...], yb[...] = a * cos - b * sin, b * cos + a * sin
    else:
        ya[...], yb[...] = rnd(rnd(a * cos) - rnd(b * sin)), rnd(rnd(b * cos) + rnd(a * sin))
    return y


def rope_forward(x, positions, *, rotary_dim=None, layout="half", base=10000.0, scaling=None, part="first"):
    """y = x with each pair turned by positions * inv_freq (module docstring).

    Args:
        x: [..., N, d] (q or k, heads among the leading axes).
        positions: broadcastable to [..., N]: each token's position (an offset for decoding;
            restarting at 0 per sequence for packed ones); integers or floats.
        rotary_dim: the width r that turns (even, <= d; default d): partial rotary.
        part: 'first' (default): x's first r entries turn; 'last': its last r (DeepSeek's MLA,
            whose q and k are [nope ; rope]).
        layout: 'half' (GPT-NeoX, Llama) or 'interleaved' (GPT-J).
        base: the frequencies' base (10000; Llama 3 uses 500000).
        scaling: None, or a linear or YaRN scaling (`frequencies`).
    Returns:
        y [..., N, d] in x's dtype (cos and sin computed in float64, then in x's dtype), and
        a RopeCache.
    """
    x = as_float_array(x, "x")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 axes [..., N, d], got shape {x.shape}")
    require_choice(layout, "layout", LAYOUTS)
    require_choice(part, "part", PARTS)
    base = require_positive_real(base, "base")
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer)) or r <= 0 or r % 2 or r > x.shape[-1]:
        raise ValueError(f"rotary_dim must be an even integer from 2 to d = {x.shape[-1]} (x {x.shape}), "
                         f"got {brief(rotary_dim)}")
    positions = check_positions(positions, "positions")
    try:
        np.broadcast_shapes(positions.shape, x.shape[:-1])
    except ValueError:
        raise ValueError(f"positions of shape {positions.shape} do not broadcast to x's [..., N] = "
                         f"{x.shape[:-1]}") from None
    real = x.real.dtype
    angles = np.result_type(np.float64, real)                               # longdouble stays wide
    inv_freq, position_factor, magnitude = frequencies(int(r), base, scaling, angles)
    with np.errstate(over="ignore", invalid="ignore"):
        theta = (positions.astype(angles) * position_factor)[..., None] * inv_freq   # [..., N, r/2]
    if not np.isfinite(theta).all():
        raise ValueError(f"positions up to {np.abs(positions).max()} times the frequencies (up to "
                         f"{inv_freq.max() * position_factor}) leave the float range")
    cos, sin = ((magnitude * f(theta)).astype(real) for f in (np.cos, np.sin))
    y = turned(x, cos, sin, layout, int(r), part)
    return y, RopeCache(cos=cos, sin=sin, layout=layout, rotary_dim=int(r), part=part, shape=x.shape)


def check_positions(positions, name):
    """positions as an array of integers or finite floats (TypeError / ValueError naming `name`)."""
    positions = np.asarray(positions)
    if positions.dtype.kind not in "iuf":
        raise TypeError(f"{name} must be integers or floats, got dtype {positions.dtype}")
    bad = ~np.isfinite(positions) if positions.dtype.kind == "f" else None
    if bad is not None and bad.any():
        raise ValueError(f"{name} must be finite, got {offenders(name, positions, bad)}")
    return positions


def rope_backward(dy, cache):
    """dx = dy with each pair turned back (the transpose of the forward's rotation): [..., N, d]."""
    require_cache(cache, RopeCache, "rope_backward", arrays=("cos", "sin"))
    require_same_shape(dy, cache.shape, "dy")
    dy = as_float_array(dy, "dy")
    return turned(dy, cache.cos, -cache.sin, cache.layout, cache.rotary_dim, cache.part)


def rope_apply(x, cache):
    """x [..., N, d] turned as the forward that made the cache turned its input (rope is
    linear in x: this is also the forward's tangent along x)."""
    require_cache(cache, RopeCache, "rope_apply", arrays=("cos", "sin"))
    require_same_shape(x, cache.shape, "x")
    x = as_float_array(x, "x")
    return turned(x, cache.cos, cache.sin, cache.layout, cache.rotary_dim, cache.part)


def rope_jvp(x, positions, x_dot, **options):
    """(y, y_dot): rope_forward's y and its tangent along x_dot (rope is linear in x: y_dot is
    x_dot turned the same way). options as rope_forward's."""
    y, cache = rope_forward(x, positions, **options)
    return y, rope_apply(x_dot, cache)


def rope_settings(rope):
    """(rope_forward's options, positions_q or None, positions_k or None) from attention's rope
    dict (ROPE_KEYS); TypeError for another type or key."""
    if not isinstance(rope, dict):
        raise TypeError(f"rope must be a dict of rope_forward's options, got {type(rope).__name__}")
    unknown = sorted(set(rope) - set(ROPE_KEYS))
    if unknown:
        raise TypeError(f"rope has the key {unknown[0]!r}; it takes {', '.join(ROPE_KEYS)}")
    settings = {name: x for name, x in rope.items() if not name.startswith("positions")}
    return settings, rope.get("positions_q"), rope.get("positions_k")


def rope_positions(rope, n_q, n_k, options):
    """(positions_q [N_q], positions_k [N_k]) of attention's rope dict: its own, or key j at its
    place in its sequence and query i at i + N_k - N_q in its own (bottom-right; each packed
    sequence's from options' cu_seqlens and seqused_k, an AttentionOptions record)."""
    _, given_q, given_k = rope_settings(rope)
    at = score_positions(n_q, n_k, np.arange(n_q)[:, None], np.arange(n_k)[None, :], "bottom_right",
                         options.cu_seqlens_q, options.cu_seqlens_k, options.seqused_k)
    return (at.diagonal[:, 0] if given_q is None else check_positions(given_q, "rope['positions_q']"),
            at.cols[0] if given_k is None else check_positions(given_k, "rope['positions_k']"))


def rope_qk(q, k, rope, options):
    """(q, k turned by rope_forward, (q's RopeCache, k's)) for attention: rope is
    attention_forward's dict (rope_settings), options its AttentionOptions record."""
    settings, _, _ = rope_settings(rope)
    positions_q, positions_k = rope_positions(rope, q.shape[-2], k.shape[-2], options)
    q, q_cache = rope_forward(q, positions_q, **settings)
    k, k_cache = rope_forward(k, positions_k, **settings)
    return q, k, (q_cache, k_cache)
