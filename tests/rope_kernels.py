"""Honest candidates with rotary embeddings, in torch float32 and bfloat16, the way the peers order
the work, with planted bugs, and a sweep of them through crosscheck (tests/test_crosscheck_rope.py;
the longer one, benchmarks/variant_sweeps.py --variant rope).

Two turns, written from the peers' code:
    'hf'     Hugging Face's apply_rotary_pos_emb: inv_freq and the angles in float32, cos and sin
             cast to the tensors' dtype, q * cos + rotate_half(q) * sin in that dtype
    'flash'  FlashAttention's apply_rotary_emb: cos and sin in float32, the turn computed in float32
             and stored in the tensors' dtype
then attention by torch's SDPA (grouped heads, bottom-right causal as a boolean mask) and
autograd's backward through both. The bugs: the other layout (interleaved pairs for half-split,
the mix-up peers report most), and the queries' positions from 0 where they are the last N_q of
N_k (a decoding step turned as the first token).
"""
import math

import numpy as np
import torch

import variant_sweeps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TURNS = ("hf", "flash")
BUGS = {"layout": "rope_layout=", "positions_from_0": "rope positions from 0"}   # bug: its diagnosis's words


def inverse_frequencies(r, base, scaling):
    """(inv_freq [r/2], position divisor, magnitude) in float32, as Hugging Face's rope init
    functions compute them (default, linear, YaRN)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
    if scaling is None:
        return inv_freq, 1.0, 1.0
    factor = scaling["factor"]
    if scaling["type"] == "linear":
        return inv_freq, factor, 1.0
    length = scaling["original_max_position_embeddings"]
    dim = lambda rotations: (r * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = max(math.floor(dim(scaling.get("beta_fast", 32))), 0), min(math.ceil(dim(scaling.get("beta_slow", 1))), r - 1)
    ramp = torch.clamp((torch.arange(r // 2, dtype=torch.float32) - low) / ((high - low) or 0.001), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, 1.0, 0.1 * math.log(factor) + 1.0


def turn(x, positions, layout, r, base, scaling, how):
    """x [B, H, N, d] turned by its positions [N] (module docstring's 'hf' or 'flash')."""
    inv_freq, divisor, magnitude = inverse_frequencies(r, base, scaling)
    t = torch.as_tensor(positions).float() / divisor
    freqs = t[:, None] * inv_freq[None, :]                              # [N, r/2] float32
    cos, sin = freqs.cos() * magnitude, freqs.sin() * magnitude
    expand = (lambda c: torch.cat([c, c], -1)) if layout == "half" else (lambda c: c.repeat_interleave(2, -1))
    cos, sin = expand(cos), expand(sin)                                 # [N, r]
    head, rest = x[..., :r], x[..., r:]
    if how == "flash":
        head, cos, sin = head.float(), cos.float(), sin.float()
    else:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if layout == "half":
        a, b = head.chunk(2, dim=-1)
        rotated = torch.cat([-b, a], -1)
    else:
        rotated = torch.stack([-head[..., 1::2], head[..., 0::2]], -1).flatten(-2)
    return torch.cat([(head * cos + rotated * sin).to(x.dtype), rest], -1)


def draw(rng):
    """A case's settings: shapes, rope options and the turn's way."""
    d = int(rng.choice([32, 64]))
    n_k = int(rng.integers(8, 160))
    n_q = int(rng.choice([1, n_k, max(1, n_k // 3)]))
    scaling = [None, {"type": "linear", "factor": 4.0},
               {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}][int(rng.integers(3))]
    return dict(batch=int(rng.integers(1, 3)), h_kv=int(rng.integers(1, 3)), groups=int(rng.integers(1, 3)),
                n_q=n_q, n_k=n_k, d=d, causal=bool(rng.integers(2)) and n_q > 1,
                layout=["half", "interleaved"][int(rng.integers(2))], rotary_dim=int(rng.choice([d, d // 2])),
                base=float(rng.choice([10000.0, 500000.0])), scaling=scaling,
                offset=int(rng.choice([0, int(rng.integers(1, 8192))])), how=TURNS[int(rng.integers(2))])


def rope_case(rng, dtype, bug=None):
    """(case, settings): a crosscheck case (dict of arrays and rope_* keys) of a torch candidate, honest or
    with a bug, and its draw's settings."""
    s = draw(rng)
    n_q, n_k = s["n_q"], s["n_k"]
    q, dout, k, v, _ = variant_sweeps.torch_inputs(rng, s, DTYPES[dtype])
    positions_k = np.arange(n_k) + s["offset"]
    positions_q = positions_k[n_k - n_q:]
    layout = s["layout"]
    if bug == "layout":
        layout = {"half": "interleaved", "interleaved": "half"}[layout]
    turned_q = positions_k[:n_q] if bug == "positions_from_0" else positions_q
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    settings = dict(layout=layout, r=s["rotary_dim"], base=s["base"], scaling=s["scaling"], how=s["how"])
    mask = None
    if s["causal"]:
        mask = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
    out = torch.nn.functional.scaled_dot_product_attention(
        turn(leaves[0], turned_q, **settings), turn(leaves[1], positions_k, **settings), leaves[2],
        attn_mask=mask, enable_gqa=True)
    out.backward(dout)
    numpy = lambda x: x.detach()                                       # crosscheck takes tensors
    arrays = dict(q=numpy(q), k=numpy(k), v=numpy(v), dout=numpy(dout), out=numpy(out),
                  dq=numpy(leaves[0].grad), dk=numpy(leaves[1].grad), dv=numpy(leaves[2].grad))
    return {**arrays, **case_keys(s)}, s


def case_keys(s):
    """The case's keys of draw's settings: the rope_* keys (positions where they start past 0;
    the queries are the last N_q keys) and causal."""
    keys = dict(rope_layout=np.array(s["layout"]), rope_rotary_dim=np.array(s["rotary_dim"]),
                rope_base=np.array(s["base"]))
    if s["causal"]:
        keys["causal"] = np.array("bottom_right")
    if s["offset"]:
        positions_k = np.arange(s["n_k"]) + s["offset"]
        keys.update(rope_positions_q=positions_k[s["n_k"] - s["n_q"]:], rope_positions_k=positions_k)
    if s["scaling"] is not None:
        keys.update({f"rope_{'scaling' if key == 'type' else key}": np.array(x) for key, x in s["scaling"].items()})
    return keys


def sweep(cases, seed=0, dtypes=tuple(DTYPES)):
    """variant_sweeps.sweep over this module's cases and bugs (the positions bug only where N_q < N_k)."""
    def changed(rng, dtype, bug):
        arrays, s = rope_case(rng, dtype, bug)
        return None if bug == "positions_from_0" and s["n_q"] == s["n_k"] else arrays
    return variant_sweeps.sweep(changed, BUGS, cases, seed, dtypes)
