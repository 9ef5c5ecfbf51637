"""Split the model width into heads and merge it back.

Shape legend:  B batch,  N length,  D model width,  H heads,  d = D / H head width.

    split_heads: [B, N, D] -> [B, N, H, d] -> [B, H, N, d]    (the seed's view + transpose(1, 2))
    merge_heads: [B, H, N, d] -> [B, N, H, d] -> [B, N, D]    (transpose(1, 2) + view)

Both are linear permutations of entries, and each is the other's inverse, so
each is the other's backward (docs/derivations.md, "Heads"):

    d(split_heads)(dxh) = merge_heads(dxh),   d(merge_heads)(dx) = split_heads(dx, H)

Any leading axes before N are allowed: [..., N, D] <-> [..., H, N, d].
Being linear, each is its own forward-mode derivative: the tangent of split_heads(x, H)
along x_dot is split_heads(x_dot, H), and likewise for merge_heads.
Both return fresh arrays (never a view into the argument).
"""
import numpy as np

from ._checks import as_float_array, require_ndim, require_positive_int


def split_heads(x, num_heads):
    """[..., N, D] -> [..., H, N, D/H]. Its backward is `merge_heads`."""
    x = as_float_array(x, "x")
    require_ndim(x, "x", 2, "[..., N, D]")
    num_heads = require_positive_int(num_heads, "num_heads")
    *lead, n, d_model = x.shape
    if d_model % num_heads:
        raise ValueError(f"x's last axis (D={d_model}, shape {x.shape}) must be divisible by "
                         f"num_heads={num_heads}")
    xh = x.reshape(*lead, n, num_heads, d_model // num_heads)   # [..., N, H, d]
    return np.swapaxes(xh, -2, -3).copy()                       # [..., H, N, d], a fresh array


def merge_heads(xh):
    """[..., H, N, d] -> [..., N, H*d]. Its backward is `split_heads(dx, H)`."""
    xh = as_float_array(xh, "xh")
    require_ndim(xh, "xh", 3, "[..., H, N, d]")
    *lead, h, n, d = xh.shape
    x = np.swapaxes(xh, -2, -3).copy()                          # [..., N, H, d], a fresh array
    return x.reshape(*lead, n, h * d)                           # [..., N, D]
