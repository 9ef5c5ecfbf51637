"""Multi-head Latent Attention (DeepSeek-V2/V3): keys and values made from one latent vector
per token, attended in two equal forms.

Shape legend:  ... leading axes,  H query heads,  N_q, N_k lengths,  r the latent width
(kv_lora_rank, 512 in DeepSeek-V3),  p the rotary width (qk_rope_head_dim, 64),  n the
per-head key width without rope (qk_nope_head_dim, 128),  d_v the per-head value width
(v_head_dim, 128).

Absorbed form (`mla_forward`; decoding kernels: FlashMLA, FlashInfer's MLA): one kv head
whose rows are the latent vector and the rotary key, the values the latent part of the same rows:

    q [..., H, N_q, r + p]     kv [..., 1, N_k, r + p]     ->     out [..., H, N_q, r]
    out = softmax(scale q kv^T) kv[..., :r]                (attention with k = kv, v = kv[..., :r])
    backward:  dkv = dk + [dv ; 0]                         (the tensor serves as k and as v:
                                                            its gradient is the sum of both)

Non-absorbed form (`mla_unabsorbed_forward`; training and prefill): per-head up-projections
w_uk [H, r, n] and w_uv [H, r, d_v] of the latent c_kv [..., N_k, r]:

    k_h = [c_kv w_uk[h] ; k_pe],  v_h = c_kv w_uv[h],  q_h = [q_nope_h ; q_pe_h]
    out_h = softmax(scale q_h k_h^T) v_h                   [..., H, N_q, d_v]
    backward:  dc_kv = sum_h (dk_nope_h w_uk[h]^T + dv_h w_uv[h]^T),  dk_pe = sum_h dk_pe_h,
               dw_uk[h] = sum c_kv^T dk_nope_h,  dw_uv[h] = sum c_kv^T dv_h   (over the leading axes)

The two are one attention: q_nope_h . (c_j w_uk[h]) = (q_nope_h w_uk[h]^T) . c_j, so with
q = [q_nope w_uk^T ; q_pe] (`mla_absorb`) and kv = [c_kv ; k_pe], the absorbed out times
w_uv[h] is out_h (docs/derivations.md, section 14).

Scale: FlashMLA's default is 1 / sqrt(r + p), the absorbed q's width (attention's default
here too); DeepSeek's model passes 1 / sqrt(n + p), times rope.yarn_mscale(factor,
mscale_all_dim)^2 with YaRN, whose rope_scaling (mscale and mscale_all_dim included) then leaves
cos and sin unscaled (docs/variants.md, "DeepSeek's scale with YaRN").
Rope: the last p columns of q and kv (q_pe, k_pe) are the rotary part; rope={...} turns them
(rope.py's options; rotary_dim is p and part 'last'), the latent part never turns.
"""
from collections import namedtuple
from typing import NamedTuple

import numpy as np

from ._checks import as_float_array, brief, kept, require_cache
from .attention import AttentionCache, attention_backward, attention_forward
from .forward_mode import attention_jvp
from .options import GRADIENTS
from .rope import rope_settings


class MlaCache(NamedTuple):
    attention: AttentionCache   # attention_forward's cache, k = kv and v = kv[..., :r]
    latent: int                 # r: the values' width


MlaGrads = namedtuple("MlaGrads", ("dq", "dkv") + GRADIENTS, defaults=(None,) * len(GRADIENTS))
MlaGrads.__doc__ = """mla_backward's: dq [..., H, N_q, r + p], dkv (kv's shape: the keys' and the values'
gradients summed), and the options' gradients (options.GRADIENTS) as attention_backward's."""


class MlaUnabsorbedCache(NamedTuple):
    attention: AttentionCache   # of q = [q_nope ; q_pe], k_h = [c_kv w_uk[h] ; k_pe], v_h = c_kv w_uv[h]
    c_kv: np.ndarray            # [..., N_k, r]  (_checks.kept: a copy, or the caller's frozen array)
    w_uk: np.ndarray            # [H, r, n]
    w_uv: np.ndarray            # [H, r, d_v]


class MlaUnabsorbedGrads(NamedTuple):
    dq_nope: np.ndarray         # [..., H, N_q, n]
    dq_pe: np.ndarray           # [..., H, N_q, p]
    dc_kv: np.ndarray           # [..., N_k, r]
    dk_pe: np.ndarray           # [..., N_k, p]
    dw_uk: np.ndarray           # [H, r, n]
    dw_uv: np.ndarray           # [H, r, d_v]


def _rope_part(options, rope_dim):
    """attention_forward's options with the rope dict turning the last rope_dim columns."""
    rope = options.get("rope")
    if rope is None:
        return options
    rope_settings(rope)                                  # a dict of rope's keys (TypeError otherwise)
    fixed = {"rotary_dim": rope_dim, "part": "last"}
    for name, value in fixed.items():
        if name in rope and rope[name] != value:
            raise ValueError(f"MLA turns the last rope_dim = {rope_dim} columns: rope[{name!r}] must be "
                             f"{value!r} or absent, got {brief(rope[name])}")
    return {**options, "rope": {**rope, **fixed}}


def _latent(q, kv, rope_dim):
    """r, the latent width, after checking q [..., H, N_q, r + p] and kv [..., 1, N_k, r + p]."""
    if kv.ndim < 3 or kv.shape[-3] != 1:
        raise ValueError(f"kv must be one latent head [..., 1, N_k, r + p], got shape {kv.shape}")
    if q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"q and kv must have the same width r + p, got q {q.shape} and kv {kv.shape}")
    if isinstance(rope_dim, (bool, np.bool_)) or not isinstance(rope_dim, (int, np.integer)) \
            or not 0 <= rope_dim < kv.shape[-1]:
        raise ValueError(f"rope_dim must be an integer from 0 to below the width {kv.shape[-1]} "
                         f"(kv {kv.shape}), got {brief(rope_dim)}")
    return kv.shape[-1] - int(rope_dim)


def mla_forward(q, kv, *, rope_dim=64, **options):
    """The absorbed form (module docstring): out = softmax(scale q kv^T) kv[..., :r].

    Args:
        q: [..., H, N_q, r + p]: [q_nope w_uk^T ; q_pe] per head (mla_absorb).
        kv: [..., 1, N_k, r + p]: [c_kv ; k_pe] per token, or a paged latent cache
            [num_pages, 1, page, r + p] with page_table and cache_seqlens (FlashMLA's pages
            are 64 rows).
        rope_dim: p, the rotary columns at the end (64 in DeepSeek-V3).
        options: attention_forward's (scale, causal, page_table, cache_seqlens, implementation,
            block_size, workers, rope={layout, base, scaling, positions_q, positions_k}, ...).
    Returns:
        out [..., H, N_q, r] and an MlaCache.
    """
    q, kv = as_float_array(q, "q"), as_float_array(kv, "kv")
    r = _latent(q, kv, rope_dim)
    out, cache = attention_forward(q, kv, kv[..., :r], **_rope_part(options, rope_dim))
    return out, MlaCache(attention=cache, latent=r)


def mla_backward(dout, cache, dlse=None):
    """MlaGrads of mla_forward: dq, and dkv = dk + [dv ; 0] (kv serves as the keys and the values)."""
    require_cache(cache, MlaCache, "mla_backward")
    g = attention_backward(dout, cache.attention, dlse)
    dkv = g.dk.copy()
    dkv[..., :cache.latent] += g.dv
    return MlaGrads(dq=g.dq, dkv=dkv, **{name: getattr(g, name) for name in GRADIENTS})


def mla_jvp(q, kv, q_dot=None, kv_dot=None, *, rope_dim=64, **options):
    """(out, out_dot, lse, lse_dot) of the absorbed form along (q_dot, kv_dot): attention_jvp
    with k_dot = kv_dot and v_dot = kv_dot[..., :r]. options as attention_jvp's."""
    q, kv = as_float_array(q, "q"), as_float_array(kv, "kv")
    r = _latent(q, kv, rope_dim)
    kv_dot = np.zeros_like(kv) if kv_dot is None else as_float_array(kv_dot, "kv_dot")
    if kv_dot.shape != kv.shape:
        raise ValueError(f"kv_dot must have kv's shape {kv.shape}, got {kv_dot.shape}")
    return attention_jvp(q, kv, kv[..., :r], q_dot, kv_dot, kv_dot[..., :r], **_rope_part(options, rope_dim))


def mla_absorb(q_nope, w_uk):
    """The absorbed query's latent part: q_nope_h w_uk[h]^T, [..., H, N_q, n] -> [..., H, N_q, r]."""
    return np.einsum("...hqn,hrn->...hqr", q_nope, w_uk)


def mla_unabsorbed_forward(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, **options):
    """The non-absorbed form (module docstring): out_h = softmax(scale q_h k_h^T) v_h.

    Args:
        q_nope [..., H, N_q, n], q_pe [..., H, N_q, p], c_kv [..., N_k, r], k_pe [..., N_k, p]
        (one rotary key per token, shared by the heads), w_uk [H, r, n], w_uv [H, r, d_v].
        options: attention_forward's; rope turns q_pe and k_pe.
    Returns:
        out [..., H, N_q, d_v] and an MlaUnabsorbedCache.
    """
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (as_float_array(x, name) for name, x in (
        ("q_nope", q_nope), ("q_pe", q_pe), ("c_kv", c_kv), ("k_pe", k_pe), ("w_uk", w_uk), ("w_uv", w_uv)))
    c_kv, w_uk, w_uv = (kept(x) for x in (c_kv, w_uk, w_uv))            # the backward's: copies, or frozen
    heads, r = q_nope.shape[-3], c_kv.shape[-1]
    for name, w, width in (("w_uk", w_uk, q_nope.shape[-1]), ("w_uv", w_uv, None)):
        if w.ndim != 3 or w.shape[:2] != (heads, r) or (width is not None and w.shape[2] != width):
            raise ValueError(f"{name} must be [H, r, {'n' if width else 'd_v'}] = [{heads}, {r}, "
                             f"{width if width else 'd_v'}] (q_nope {q_nope.shape}, c_kv {c_kv.shape}), got {w.shape}")
    if k_pe.shape[:-1] != c_kv.shape[:-1] or q_pe.shape[:-1] != q_nope.shape[:-1]:
        raise ValueError(f"k_pe must be c_kv's [..., N_k] and q_pe q_nope's [..., H, N_q] with their rotary "
                         f"width, got k_pe {k_pe.shape}, c_kv {c_kv.shape}, q_pe {q_pe.shape}, q_nope {q_nope.shape}")
    k_nope = np.einsum("...kr,hrn->...hkn", c_kv, w_uk)                 # [..., H, N_k, n]
    k_rope = np.broadcast_to(k_pe[..., None, :, :], k_nope.shape[:-1] + k_pe.shape[-1:])
    v = np.einsum("...kr,hrv->...hkv", c_kv, w_uv)                       # [..., H, N_k, d_v]
    q = np.concatenate([q_nope, q_pe], axis=-1)
    k = np.concatenate([k_nope, k_rope], axis=-1)
    out, cache = attention_forward(q, k, v, **_rope_part(options, q_pe.shape[-1]))
    return out, MlaUnabsorbedCache(attention=cache, c_kv=c_kv, w_uk=w_uk, w_uv=w_uv)


def mla_unabsorbed_backward(dout, cache):
    """MlaUnabsorbedGrads of mla_unabsorbed_forward (module docstring's backward)."""
    require_cache(cache, MlaUnabsorbedCache, "mla_unabsorbed_backward", arrays=("c_kv", "w_uk", "w_uv"))
    g = attention_backward(dout, cache.attention)
    n = cache.w_uk.shape[-1]
    dk_nope, dk_rope = g.dk[..., :n], g.dk[..., n:]                     # [..., H, N_k, n], [..., H, N_k, p]
    lead = "".join(chr(ord("a") + i) for i in range(cache.c_kv.ndim - 2))   # the leading axes, summed
    return MlaUnabsorbedGrads(
        dq_nope=np.ascontiguousarray(g.dq[..., :n]), dq_pe=np.ascontiguousarray(g.dq[..., n:]),
        dc_kv=np.einsum("...hkn,hrn->...kr", dk_nope, cache.w_uk) + np.einsum("...hkv,hrv->...kr", g.dv, cache.w_uv),
        dk_pe=dk_rope.sum(axis=-3),
        dw_uk=np.einsum(f"{lead}kr,{lead}hkn->hrn", cache.c_kv, dk_nope),
        dw_uv=np.einsum(f"{lead}kr,{lead}hkv->hrv", cache.c_kv, g.dv))
