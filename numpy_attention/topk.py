"""Top-k lists: the keys each query lists, checked once and counted into any block of the scores.

Shape legend as in textbook.py; K the length of each query's list, R the lists' rows.

    indices      [..., H_kv or H, N_q, K] int: query i of head h lists keys indices[.., g, i, :]
                 (g its kv head h // G, or h itself: a list per kv head or per query head);
                 -1 pads, and so does any index outside [0, N_k)
    topk_length  [..., N_q] int, optional: only a row's first topk_length entries count
    blocks       block_indices turns key blocks [..., K] into their tokens (NSA, MoBA)

Attention over the listed keys (the sparse engine gathers them) is dense attention over these scores,
with c_ij the times row i lists key j:

    S_ij + log c_ij   where c_ij >= 1   (a key listed twice counts twice: exp(S + log 2) = 2 exp(S),
    -inf              where c_ij = 0     what a kernel that gathers it twice computes)

The score pipeline (scores.py) takes both from the lists, a block of the scores at a time:
    keep           c > 0                             (step 4)
    multiplicity   log c where c > 1, else 0         (step 3; a constant: no gradient, no tangent)
so nothing of size [N_q, N_k] is formed beyond the block the engine computes anyway.

TopkLists holds the checked lists, which the sparse engine (engines/sparse.py) gathers, and
for the other engines the listed entries as one sorted array of keys r (N_k + 1) + j, r the
flat index of the entry's row over [..., H_kv or H, N_q], sorted at the first block counted:
the entries of row r inside the columns [c0, c1) are those between two binary searches, so a
block's counts cost O(rows log E + entries in the block + the block's size), E the listed
entries, whether the block is a few rows of all columns (the baselines) or a tile (the tiled
engine).
"""
from functools import cached_property

import numpy as np

from ._checks import kept, require_positive_int
from ._layout import index_ranges


class TopkLists:
    """Each query's listed keys, as the engines read them (topk_lists): the lists themselves
    and, sorted when a block is first counted, their entries (`keys`)."""

    def __init__(self, indices, lengths, groups, n_k):
        self.indices = indices      # [..., H_kv or H, N_q, K] int, checked (_checks.kept: its own)
        self.lengths = lengths      # [..., N_q] int (kept), or None
        self.rows = indices.shape[:-1]   # the lists' rows [..., H_kv or H, N_q]
        self.groups = groups        # query heads per list: G for a list per kv head, 1 per query head
        self.n_k = n_k

    @cached_property
    def keys(self):
        """[E] int64, sorted: r (N_k + 1) + j for each listed entry (repeats repeated)."""
        at = np.flatnonzero(listed(self.indices, self.lengths, self.n_k))   # the listed entries, row by row
        keys = self.indices.reshape(-1)[at].astype(np.int64, copy=False)    # each one's key j
        at //= max(self.indices.shape[-1], 1)                               # and row r
        at *= self.n_k + 1
        keys += at                                                          # r (N_k + 1) + j
        keys.sort()
        keys.flags.writeable = False
        return keys

    @cached_property
    def repeats(self):
        """Whether some row lists a key more than once."""
        return bool(np.any(self.keys[1:] == self.keys[:-1]))


def block_indices(blocks, block_size, n_k):
    """Token indices [..., N_q, K * w] (int64) of the key blocks [..., N_q, K] a query selects
    (NSA's selection branch, MoBA), w = min(block_size, n_k): block b lists keys b * block_size
    ... b * block_size + w - 1 (a block's keys from the n_k-th on are never in range). -1 pads: the
    tokens of a block outside [0, ceil(n_k / block_size)) (-1, or any index too large, of any
    integer dtype: padding, as a token index outside [0, n_k) is), and of the last block past n_k.
    """
    blocks = np.asarray(blocks)
    if blocks.dtype.kind not in "iu" or blocks.ndim < 1:
        raise TypeError(f"blocks must be integer block indices [..., K], got dtype {blocks.dtype} "
                        f"with shape {blocks.shape}")
    block_size = require_positive_int(block_size, "block_size")
    n_k = require_positive_int(n_k, "n_k", minimum=0)
    width = min(block_size, n_k)
    valid = (blocks >= 0) & (blocks < -(-n_k // block_size))                     # [..., K] in range
    # a valid block starts at b * block_size < n_k, an int64; with block_size > n_k only block 0
    # is valid, so b * width is its start either way
    tokens = (np.where(valid, blocks, 0).astype(np.int64) * width)[..., None] + np.arange(width)   # [..., K, w]
    tokens[~valid[..., None] | (tokens >= n_k)] = -1
    return tokens.reshape(blocks.shape[:-1] + (blocks.shape[-1] * width,))


def check_lists(indices, topk_length, q_shape, k_shape, name="indices"):
    """(indices, topk_length) as arrays, checked against q's and k's shapes: indices integers
    [..., H_kv or H, N_q, K] ([N_q, K] for one head), topk_length integers [..., N_q] or None.
    TypeError / ValueError naming `name` and the shapes."""
    indices = np.asarray(indices)
    if len(q_shape) == 2 and indices.ndim == 2:                    # one head: [N_q, K]
        indices = indices[None]
    if indices.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got dtype {indices.dtype}")
    q3, k3 = (shape if len(shape) >= 3 else (1,) + tuple(shape) for shape in (q_shape, k_shape))
    heads = (k3[-3], q3[-3])
    if indices.ndim != len(q3) or indices.shape[:-3] != tuple(q3[:-3]) or indices.shape[-3] not in heads \
            or indices.shape[-2] != q3[-2]:
        raise ValueError(f"{name} must be [..., H_kv or H, N_q, K] = [..., {heads[0]} or {heads[1]}, "
                         f"{q3[-2]}, K] (q {tuple(q_shape)}, k {tuple(k_shape)}), got {indices.shape}")
    if topk_length is not None:
        topk_length = np.asarray(topk_length)
        rows = tuple(q3[:-3]) + (q3[-2],)
        if topk_length.dtype.kind not in "iu" or topk_length.shape != rows:
            raise ValueError(f"topk_length must be integers [..., N_q] = {rows}, "
                             f"got dtype {topk_length.dtype} with shape {topk_length.shape}")
    return indices, topk_length


def listed(indices, lengths, n_k):
    """Which entries of the lists [..., N_q, K] name a key: inside [0, n_k) and, with lengths
    [..., N_q] (the lists' leading axes but their head), among each row's first lengths."""
    valid = (indices >= 0) & (indices < n_k)
    if lengths is not None:
        valid &= np.arange(indices.shape[-1]) < lengths[..., None, :, None]
    return valid


def topk_lists(indices, topk_length, q_shape, k_shape):
    """The TopkLists of the lists `indices` (and topk_length, or None) for q of q_shape
    [..., H, N_q, d_k] and k of k_shape [..., H_kv, N_k, d_k], checked (check_lists; the names
    are attention_forward's). Its arrays are its own, or the caller's where frozen (_checks.kept)."""
    indices, topk_length = check_lists(indices, topk_length, q_shape, k_shape, "topk_indices")
    h = q_shape[-3] if len(q_shape) >= 3 else 1
    return TopkLists(kept(indices), kept(topk_length), groups=h // indices.shape[-3],
                     n_k=k_shape[-2])


def counts(lists, score_shape, index=(Ellipsis, slice(None), slice(None))):
    """[..., heads, rows, cols] int64, the shape of the block S[index] of the scores
    [..., H, N_q, N_k]: how many times each of its rows lists each of its keys (0: not listed).

    index: a tuple into the scores whose last two entries are slices of rows and columns, as
    scores.keep_mask takes it (slices of the leading axes and heads before them, or an Ellipsis).
    """
    axes = [np.arange(n)[part] for n, part in zip(score_shape, index_ranges(index, score_shape))]
    *lead, rows, cols = axes                                         # the block's indices, axis by axis
    heads = lead.pop() if lead else np.zeros(1, np.int64)           # ([N_q, N_k] scores: one head)
    batch = np.ravel_multi_index(np.ix_(*lead), lists.rows[:-2]) if lead else np.zeros((), np.int64)
    # 1. the list row r of each of the block's rows [..., heads, rows]: its batch index, its
    #    head's list (h // G), its query
    r = (batch[..., None] * lists.rows[-2] + heads // lists.groups)[..., None] * lists.rows[-1] + rows
    # 2. its entries in the block's columns c0 ... c0 + span - 1: the keys from r (N_k + 1) + c0 on
    c0, span = (int(cols[0]), int(cols[-1]) - int(cols[0]) + 1) if cols.size else (0, 0)
    low = (r * (lists.n_k + 1) + c0).ravel()
    start = np.searchsorted(lists.keys, low)
    n = np.searchsorted(lists.keys, low + span) - start
    # 3. those entries, each as (its block row, its column - c0), counted
    at = np.arange(n.sum()) + np.repeat(start - (np.cumsum(n) - n), n)     # their places in keys
    block_row = np.repeat(np.arange(n.size), n)
    column = lists.keys[at] - np.repeat(low, n)
    found = np.bincount(block_row * span + column, minlength=n.size * span).reshape(r.shape + (span,))
    step = int(cols[1] - cols[0]) if cols.size > 1 else 1
    return found[..., ::step].reshape(tuple(len(a) for a in axes))


def log_multiplicity(lists, score_shape, index, dtype):
    """log c where the block's row lists its key c > 1 times, else 0 (scores.forward's step 3):
    [..., heads, rows, cols] in `dtype`, computed in float64."""
    return np.log(np.maximum(counts(lists, score_shape, index), 1).astype(np.float64)).astype(dtype)
