"""Blocks of query rows: how crosscheck runs a large case in O(N) memory.

A case is large when its scores [..., H, N_q, N_k] have more than SCORE_BUDGET entries
(one float64 array of them is then over 128 MiB; a (1, 16, 16384, 128) case's P is 32 GiB).
crosscheck (verdicts.py) then runs the oracle on the tiled engine, and the recipe (recipe.py)
and the term magnitudes in blocks of query rows, one block of scores [..., H, b, N_k] at a
time (the naive baseline, naive.py, always goes a tile of 32 rows at a time): nothing of
size N_q x N_k is formed besides the case's own arrays (a mask or bias it gives whole).

Softmax is row-wise: out, lse and dq of a block of rows need only that block. dk, dv and
dbias are sums over rows: the recipe continues its own sums across the blocks, in its own
order (float32 sums rounded once, or the flash backward's tiles). Masks, bias and the steps
that depend on positions (positions.py) are taken at the block's absolute positions, so a
block of the scores is exactly those rows of the whole.

Shape legend (textbook.py): ... batch axes, H query heads, N_q / N_k lengths, b rows of a
block. An index into the scores is a tuple (Ellipsis, ..., rows, cols) of slices, as
options.keep_mask takes it: (Ellipsis, rows, cols), or (Ellipsis, heads, rows, cols).
"""
import math

import numpy as np

SCORE_BUDGET = 2 ** 24      # scores [..., H, N_q, N_k] above this many entries: blocks of rows
BLOCK_SHARE = 8             # a block of rows holds at most SCORE_BUDGET / BLOCK_SHARE scores


def score_entries(score_shape):
    """The number of entries of scores of shape [..., H, N_q, N_k]."""
    return math.prod(score_shape)


def block_rows(score_shape, multiple):
    """Query rows per block for scores [..., H, N_q, N_k]: None (whole arrays) when they have at
    most SCORE_BUDGET entries; else the largest multiple of `multiple` (at least `multiple`)
    whose block [..., H, b, N_k] has at most SCORE_BUDGET // BLOCK_SHARE entries."""
    if score_entries(score_shape) <= SCORE_BUDGET:
        return None
    per_row = max(score_entries(score_shape[:-2]) * score_shape[-1], 1)       # [..., H, 1, N_k]
    return max(multiple, SCORE_BUDGET // BLOCK_SHARE // per_row // multiple * multiple)


def row_slices(n_q, rows):
    """Slices of `rows` query rows covering range(n_q), the last one shorter; rows None: one
    slice of them all."""
    if rows is None:
        return [slice(0, n_q)]
    return [slice(i, min(i + rows, n_q)) for i in range(0, n_q, rows)]


def block_of(x, score_shape, index):
    """x's block of the scores, np.broadcast_to(x, score_shape)[index]: a read-only view
    (None stays None). x broadcastable to score_shape [..., H, N_q, N_k]."""
    return None if x is None else np.broadcast_to(x, score_shape)[index]
