"""Layout pieces shared by the textbook and the engines.

A leaf module (it imports nothing of the package): a block's index into the scores, the
grouped-query fold and its matmuls, the scale in any dtype, and undoing a broadcast.

Shape legend:  ... leading batch axes,  H query heads,  H_kv key/value heads,
G = H / H_kv,  N lengths,  X a trailing width.
"""
import numpy as np


def tiles(n, b):
    """Slices of length b (the last one shorter) covering range(n): an engine's blocks of rows."""
    return [slice(i, min(i + b, n)) for i in range(0, n, b)]


def index_ranges(index, shape):
    """index (a tuple of slices, maybe with an Ellipsis, maybe short) as a slice of each axis
    of an array of `shape`, explicit: slice(start, stop, step)."""
    index = tuple(index)
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*part.indices(n)) for part, n in zip(index, shape))


def is_gathered(index):
    """Whether the block `index` into the scores gathers each row's own columns: its last entry
    an integer array cols [heads, rows, K] (scores.py's gathered block) instead of a slice."""
    return isinstance(index[-1], np.ndarray)


def block_ranges(index, shape):
    """index_ranges of a block of the scores of `shape`; a gathered block's with every column."""
    return index_ranges(index[:-1] if is_gathered(index) else index, shape)


def gathered_cols(index, ndim):
    """A gathered block's columns cols [heads, rows, K] with `ndim` axes (leading ones added):
    broadcastable to the block."""
    cols = index[-1]
    return cols.reshape((1,) * (ndim - cols.ndim) + cols.shape)


def with_head_axis(x):
    """[N, X] -> [1, N, X] (a single head); arrays with >= 3 axes unchanged. A view."""
    return x if x.ndim >= 3 else x[None]


def fold(x, h_kv):
    """[..., H, N, X] -> [..., H_kv, G*N, X]: the G heads of a group become rows."""
    return x.reshape(*x.shape[:-3], h_kv, x.shape[-3] // h_kv * x.shape[-2], x.shape[-1])


def unfold(x, h):
    """[..., H_kv, G*N, X] -> [..., H, N, X], the inverse of `fold`."""
    return x.reshape(*x.shape[:-3], h, x.shape[-3] * x.shape[-2] // h, x.shape[-1])


def grouped_matmul(x, y, out=None):
    """x [..., H, N, a] @ y [..., H_kv, a, b] -> [..., H, N, b]: query head h meets kv head h // G.

    Grouped-query attention: the G = H / H_kv query heads of a kv head are stacked as the
    rows of one matrix (`fold`), so each kv head is one matrix product and no k or v is
    ever repeated. With H == H_kv (or [N, a] arrays) it is x @ y.

    out: an array of the result's shape to write it into (then returned); the product is
    written straight into it where out folds without a copy, else copied in.
    """
    if x.ndim < 3:
        return np.matmul(x, y, out=out)
    if out is None:
        return unfold(fold(x, y.shape[-3]) @ y, x.shape[-3])
    folded = fold(out, y.shape[-3])
    if np.may_share_memory(folded, out):                 # a view: the product lands in out
        np.matmul(fold(x, y.shape[-3]), y, out=folded)
    else:
        out[...] = unfold(fold(x, y.shape[-3]) @ y, x.shape[-3])
    return out


def grouped_sum_matmul(x, y, h_kv):
    """sum over the G query heads of each kv head of x_h^T y_h: the gradient's side of
    `grouped_matmul`. x [..., H, N, a], y [..., H, N, b] -> [..., H_kv, a, b]."""
    if x.ndim < 3:
        return np.swapaxes(x, -1, -2) @ y
    return np.swapaxes(fold(x, h_kv), -1, -2) @ fold(y, h_kv)


def scaled(x, scale):
    """scale * x in x's dtype. A scale outside the dtype's range (1e39 for float32) would turn to
    inf (or 0) before it multiplies; then the product is taken in float64 and rounded once."""
    info = np.finfo(x.real.dtype)
    if float(info.tiny) <= scale <= float(info.max):
        return scale * x
    return (np.float64(scale) * x).astype(x.dtype)


def unbroadcast(g, shape):
    """Sum g over the axes along which an array of `shape` was broadcast to g.shape."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def kv_slices(score_shape, group, whole=False):
    """Index prefixes into scores [..., H, N_q, N_k], one per (batch index, kv head): a slice per
    leading axis, then the G = group query heads of one kv head. whole: [(Ellipsis,)], one
    prefix for all (a sum over the batch or the heads must not be split)."""
    *lead, h, _, _ = score_shape
    if whole:
        return [(Ellipsis,)]
    return [tuple(slice(i, i + 1) for i in index) + (slice(h0, h0 + group),)
            for index in np.ndindex(*lead) for h0 in range(0, h, group)]


def kv_index(at, group):
    """The index prefix into k, v [..., H_kv, N_k, d] of a prefix `at` into the scores [..., H]
    (kv_slices, or a block's leading slices and heads): the kv heads of its query heads (a
    single head of a group: its group's kv head)."""
    if at == (Ellipsis,):
        return at
    heads = at[-1]
    return at[:-1] + (slice(heads.start // group, -(-heads.stop // group)),)


def spans_slices(x, ndim, score_shape):
    """Whether x, padded to ndim axes (the scores' [..., H, N_q, N_k], or [..., H]), has size 1
    along a leading or head axis the scores have more of: its gradient then sums across the
    kv_slices, which must keep such a computation whole."""
    shape = (1,) * (ndim - np.ndim(x)) + np.shape(x)
    heads = len(score_shape) - 2
    return any(n == 1 and s > 1 for n, s in zip(shape[:heads], score_shape[:heads]))


def cut(x, at, ndim):
    """x (broadcastable to an array of ndim axes) at the kv_slices prefix `at`, along the axes
    x has in full (those of size 1 stay whole); a view."""
    if at == (Ellipsis,):
        return x
    x = np.asarray(x)
    x = x.reshape((1,) * (ndim - x.ndim) + x.shape)
    return x[tuple(a if n != 1 else slice(None) for a, n in zip(at, x.shape))]


def bias_block(dbias, index):
    """The block of a bias-shaped array (dbias summed block by block) that the scores' block
    S[index] sums into: a view. Its axes are the scores' last ones; an axis of length 1 (the
    bias broadcast along it) is taken whole, the others as index takes them."""
    parts = index[1:]                                   # slices of the scores' last axes
    parts = parts[max(len(parts) - dbias.ndim, 0):]
    lengths = dbias.shape[dbias.ndim - len(parts):]
    return dbias[(Ellipsis,) + tuple(slice(None) if n == 1 else part for part, n in zip(parts, lengths))]
