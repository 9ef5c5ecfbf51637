"""Float8 P's range in FlashAttention-3/4's online softmax, for the diagnosis: a kernel that
holds P~ = exp(S - m) 2^offset in e4m3 (the offset, 8, uses the format's range) and moves its
running row maximum m only when a tile of keys passes it by more than a threshold (lazy
rescaling) lets P~ reach 2^(offset + threshold): past e4m3's largest value 448 (2^8.8) it
saturates (flash-attention issue 2716: offset 8, threshold 4, P~ up to 4096).

    for each tile of `tile` keys, in log2 units (x = S log2 e):
        m' = tile max  if tile max > m + threshold  else m      (the first tile sets m)
        P~ = 2^(x - m' + offset),  rounded to e4m3, 448 where larger (saturated)
        acc = acc 2^(m - m') + P~ v,   l = l 2^(m - m') + rowsum(2^(x - m' + offset))
    out = acc / l          (l of P~ before its rounding, as the kernels sum it in float32)

lazy_out computes it in float64 from the oracle's S and v (the case's dequantized values);
the diagnosis compares a failing out with it (named.py's p_saturation).
"""
import math

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
SETTINGS = ((8.0, 4.0, 128), (8.0, 8.0, 128), (8.0, 4.0, 64), (8.0, 8.0, 64))   # (offset, threshold, tile)


def lazy_out(s, v, offset, threshold, tile):
    """(out [..., H, N_q, d_v], saturated [..., H, N_q] bool): the online softmax above on S
    [..., H, N_q, N_k] (-inf where masked; float64) and v [..., H, N_k, d_v] (each query head's,
    float64); a row with no key gives out 0."""
    x = s * math.log2(math.e)
    lead = s.shape[:-1]
    m = np.full(lead, -np.inf)
    l, acc = np.zeros(lead), np.zeros(lead + v.shape[-1:])
    saturated = np.zeros(lead, bool)
    for start in range(0, s.shape[-1], tile):
        cols = slice(start, start + tile)
        top = x[..., cols].max(axis=-1, initial=-np.inf)
        moved = np.isneginf(m) | (top > m + threshold)
        m_new = np.where(moved, np.maximum(m, top), m)
        shift = np.where(np.isneginf(m_new), 0.0, m_new)
        with np.errstate(invalid="ignore"):
            rescale = np.where(np.isneginf(m), 0.0, np.exp2(m - shift))
            p = np.exp2(x[..., cols] - shift[..., None] + offset)       # P~, float64
        saturated |= (p > E4M3_MAX).any(axis=-1)
        p8 = np.minimum(p, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        acc = acc * rescale[..., None] + p8 @ v[..., cols, :]
        l = l * rescale + p.sum(axis=-1)
        m = m_new
    return acc / np.where(l > 0, l, 1)[..., None], saturated
