"""Score-layout pieces shared by the materialized (attention.py) and tiled (tiled.py) paths.

A leaf module (it imports nothing of the package): which (query, key) pairs causal
masking and a window keep, the grouped-query fold, and undoing a broadcast.

Shape legend:  ... leading batch axes,  H query heads,  H_kv key/value heads,
G = H / H_kv,  N lengths,  X a trailing width.
"""
import numpy as np


def with_head_axis(x):
    """[N, X] -> [1, N, X] (a single head); arrays with >= 3 axes unchanged. A view."""
    return x if x.ndim >= 3 else x[None]


def fold(x, h_kv):
    """[..., H, N, X] -> [..., H_kv, G*N, X]: the G heads of a group become rows."""
    return x.reshape(*x.shape[:-3], h_kv, x.shape[-3] // h_kv * x.shape[-2], x.shape[-1])


def unfold(x, h):
    """[..., H_kv, G*N, X] -> [..., H, N, X], the inverse of `fold`."""
    return x.reshape(*x.shape[:-3], h, x.shape[-3] * x.shape[-2] // h, x.shape[-1])


def unbroadcast(g, shape):
    """Sum g over the axes along which an array of `shape` was broadcast to g.shape."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def positional_keep(rows, cols, n_q, n_k, causal, window, align):
    """Which (query row, key column) pairs causal masking and the window keep.

    rows [r] and cols [c] are absolute positions (a tiled kernel passes one block's).
    The diagonal is i == j for 'top_left' (torch is_causal) and i + (N_k - N_q) == j for
    'bottom_right' (FlashAttention 2.1+). Causal keeps j <= diagonal; window (left, right)
    keeps diagonal - left <= j <= diagonal + right, -1 meaning unbounded.

    Returns:
        [r, c] bool array, or None when nothing is masked by position.
    """
    if not causal and window is None:
        return None
    diag = np.asarray(rows)[:, None] + (n_k - n_q if align == "bottom_right" else 0)
    j = np.asarray(cols)[None, :]
    keep = np.ones((len(rows), len(cols)), dtype=bool)
    if causal:
        keep &= j <= diag
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= j >= diag - left
        if right >= 0:
            keep &= j <= diag + right
    return keep
