"""Rotary embeddings in a case: q and k turned as the candidate's precision turns them.

A case with rope (schema.py's rope_* keys) holds the unturned q and k; the oracle and each
baseline turn them before attention, and turn dq and dk back after:

    oracle     rope.py's rope_qk in the oracle's dtype (angles in float64, or np.longdouble)
    float64    the same in float64
    float32    the angles as Hugging Face, vLLM and FlashAttention's rotary module compute
               them: inv_freq = base^(-2i / r) in float32 (2i / r rounded, then the power),
               positions in float32, theta = pos * inv_freq rounded to float32, cos and sin
               of it in float32; the turn in float32
    16-bit     those cos and sin rounded to T, and every step of the turn rounded to T, as
               Hugging Face's apply_rotary_pos_emb in T does:
               y_a = round(round(a cos) - round(b sin)),  y_b = round(round(b cos) + round(a sin))
               da = round(round(dy_a cos) + round(dy_b sin)),  db = round(round(dy_b cos) - round(dy_a sin))

Angles in float32 are off by about |theta| eps(float32): far past the sums' rounding at long
positions (position 4096: 2e-4 radians), and what an honest float32 rope does.
"""
import math
from functools import partial

import numpy as np

from ..options import attention_options
from ..rope import frequencies, rope_backward, rope_positions, rope_qk, rope_settings, turned
from .precision import round_to


def turn_qk(q, k, rope, options, compute):
    """(q, k turned, back): back(dq, dk) -> the gradients of the unturned q and k.

    q, k: the case's, in `compute`'s values (held in float32 for a 16-bit T); rope: the case's
    rope dict; options: its AttentionOptions record (packed sequences); compute: the dtype the
    turn is computed in (module docstring)."""
    compute = np.dtype(compute)
    if compute.itemsize >= 8:                                  # float64, np.longdouble: rope.py's
        q, k, (q_cache, k_cache) = rope_qk(q, k, rope, options)
        return q, k, lambda dq, dk: (rope_backward(dq, q_cache), rope_backward(dk, k_cache))
    settings, _, _ = rope_settings(rope)
    positions_q, positions_k = rope_positions(rope, q.shape[-2], k.shape[-2], options)
    layout, r = settings.get("layout", "half"), settings.get("rotary_dim") or q.shape[-1]
    angles = [_cos_sin(at, r, settings, compute) for at in (positions_q, positions_k)]
    rnd = None if compute == np.float32 else partial(round_to, dtype=compute)  # float32's ops round
    turn = lambda x, cos, sin: turned(np.asarray(x, np.float32), cos, sin, layout, r, settings.get("part", "first"),
                                      rnd)
    back = lambda dq, dk: (turn(dq, angles[0][0], -angles[0][1]), turn(dk, angles[1][0], -angles[1][1]))
    return turn(q, *angles[0]), turn(k, *angles[1]), back


def _cos_sin(positions, r, settings, compute):
    """(cos, sin) [..., N, r/2] in float32 holding values of `compute`: from float32 angles."""
    f32 = np.float32
    inv_freq, position_factor, magnitude = frequencies(r, settings.get("base", 10000.0), settings.get("scaling"), f32)
    theta = (np.asarray(positions).astype(f32) * f32(position_factor))[..., None] * inv_freq.astype(f32)
    values = (f32(magnitude) * f(theta) for f in (np.cos, np.sin))
    return tuple(x if compute == np.float32 else round_to(x, compute) for x in values)


def angle_error(case):
    """The largest error, in radians, of the float32 angles a kernel turns the case's q and k by
    (_cos_sin's theta against float64's), 0.0 without rope: near 1 and beyond, a float32
    kernel's turn, and its result, are noise (positions past 2^24 hold no fraction in float32)."""
    rope = case.options.get("rope")
    if rope is None:
        return 0.0
    plain = {name: x for name, x in case.options.items() if name != "rope"}
    q, k = case.inputs["q"], case.inputs["k"]
    record = attention_options(q, k, case.inputs["v"], **plain)[3]
    settings, _, _ = rope_settings(rope)
    r = settings.get("rotary_dim") or q.shape[-1]
    worst = 0.0
    for positions in rope_positions(rope, q.shape[-2], k.shape[-2], record):
        thetas = []
        for dtype in (np.float32, np.float64):
            inv_freq, factor, _ = frequencies(r, settings.get("base", 10000.0), settings.get("scaling"), dtype)
            thetas.append((np.asarray(positions).astype(dtype) * dtype(factor))[..., None] * inv_freq)
        worst = max(worst, float(np.max(np.abs(thetas[0].astype(np.float64) - thetas[1]), initial=0)))
    return worst


def turned_case(case):
    """(the case with q and k turned in float64 and no rope, the largest |cos| + |sin| of a
    pair's turn, sqrt(2) times YaRN's magnitude): for the term magnitudes (magnitudes.py), whose
    dq and dk are then summed over a pair by the turn back."""
    rope = case.options["rope"]
    plain = {name: x for name, x in case.options.items() if name != "rope"}
    record = attention_options(case.inputs["q"], case.inputs["k"], case.inputs["v"], **plain)[3]
    q, k, _ = rope_qk(case.inputs["q"], case.inputs["k"], rope, record)
    settings, _, _ = rope_settings(rope)
    r = settings.get("rotary_dim") or q.shape[-1]
    magnitude = frequencies(r, settings.get("base", 10000.0), settings.get("scaling"))[2]
    return case._replace(inputs={**case.inputs, "q": q, "k": k}, options=plain), math.sqrt(2) * max(magnitude, 1.0)
