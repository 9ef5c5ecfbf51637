"""MultiHeadAttention's linear projections on threads: linear.py's formulas by blocks of rows.

Shape legend as in linear.py, x flattened to n rows: x [n, d_in], W [d_in, d_out], y [n, d_out].

    y  = x W + b      by rows of y:    y[r]  = x[r] W + b           (row r of y reads row r of x)
    dx = dy W^T       by rows of dx:   dx[r] = dy[r] W^T
    dW = x^T dy       by rows of dW:   dW[r] = x[:, r]^T dy         (row r of dW reads column r of x)
    db = sum dy       whole:           db    = sum over rows of dy

A product is cut into up to BLOCKS blocks of rows by its size alone (blocks of at least
MIN_ROWS rows and MIN_BLOCK multiply-adds), and the blocks of all the linears given run on
`workers` threads with BLAS on one thread (parallel.run_tasks): the same products for every
worker count, so bitwise the same results, and the threads share them evenly (on two threads
the module's three input projections at 2048 rows are six rounds of quarters of a product;
whole ones would take two rounds, one thread idle in the second). The results equal those of
linear_forward and linear_backward to rounding: BLAS may sum a block of rows in another order
than the whole product (its kernels depend on the processor and on the product's size), so an
entry may differ by a rounding error of its sum, within 2 (d_in + 2) u |x| |W| (tested).

Called by multihead_forward / multihead_backward, after their checks.
"""
import math

import numpy as np

from .._checks import frozen
from ..linear import LinearCache
from .parallel import run_tasks

BLOCKS = 8                  # blocks per product at most: enough to share out over a few threads
MIN_ROWS = 512              # rows per block at least: each block packs all of the other operand again
MIN_BLOCK = 1 << 21         # multiply-adds per block at least


def projections_forward(items, workers):
    """[linear_forward(x, W, b) for x, W, b in items], y's rows in blocks."""
    results, tasks = [], []
    for x, W, b in items:
        n = math.prod(x.shape[:-1])
        x2 = x.reshape(n, x.shape[-1])                                  # [n, d_in]
        y = np.empty((n, W.shape[1]), np.result_type(x, W))            # [n, d_out]
        in_place = b is not None and np.result_type(y, b) == y.dtype    # else b widens y: added after
        # the cache keeps x and W themselves if they are frozen, else copies the tasks make
        saved_x, saved_W = (a if frozen(a) else np.empty_like(a, order="K") for a in (x2, W))
        if saved_W is not W:
            tasks.append((np.copyto, saved_W, W))
        copy_x = None if saved_x is x2 else saved_x
        tasks += [(_forward_rows, x2, W, b if in_place else None, y, copy_x, rows)
                  for rows in _blocks(n, x2.shape[1] * W.shape[1])]
        results.append((b, in_place, y, LinearCache(x=saved_x.reshape(x.shape), W=saved_W,
                                                     has_bias=b is not None,
                                                     out_shape=x.shape[:-1] + (W.shape[1],))))
    run_tasks(_call, tasks, workers)
    return [((y if b is None or in_place else y + b).reshape(cache.out_shape), cache)
            for b, in_place, y, cache in results]


def projections_backward(items, workers):
    """[linear_backward(dy, cache) for dy, cache in items], dx's rows and dW's rows in blocks.

    An item (dy, cache, part) computes only `part` of its gradients: "dx" ((dx, None, None)),
    or "dW" ((None, dW, db)), so that a caller can put products that nothing needs yet with
    later ones, on the same threads (MultiHeadAttention's dW_o with the input projections').
    """
    results, tasks = [], []
    for dy, cache, *part in items:
        part = part[0] if part else "all"
        if part not in ("all", "dx", "dW"):
            raise ValueError(f"part must be 'dx' or 'dW' (or left out, for both), got {part!r}")
        x, W = cache.x, cache.W
        n = math.prod(x.shape[:-1])
        x2, dy2 = x.reshape(n, x.shape[-1]), dy.reshape(n, dy.shape[-1])   # [n, d_in], [n, d_out]
        dx = dW = db = None
        if part != "dx":
            dW = np.empty(W.shape, np.result_type(x, dy))                   # [d_in, d_out]
            # dW first: often one block, as large as all of dx's; one thread takes it, the others dx's
            tasks += [(_dW_rows, x2, dy2, dW, rows) for rows in _blocks(W.shape[0], dy2.size)]
        if part != "dW":
            dx = np.empty(x2.shape, np.result_type(dy, W))                  # [n, d_in]
            tasks += [(_dx_rows, dy2, W, dx, rows) for rows in _blocks(n, W.size)]
        if part != "dx" and cache.has_bias:
            db = np.empty(W.shape[1], dy.dtype)                             # [d_out]
            tasks.append((np.sum, dy2, 0, None, db))                       # db = sum over rows of dy
        results.append((None if dx is None else dx.reshape(x.shape), dW, db))
    run_tasks(_call, tasks, workers)
    return results


def _forward_rows(x2, W, b, y, saved_x, rows):
    """y[rows] = x[rows] W (+ b), and the cache's copy of x's rows (if it keeps a copy)."""
    np.matmul(x2[rows], W, out=y[rows])
    if b is not None:
        y[rows] += b
    if saved_x is not None:
        saved_x[rows] = x2[rows]


def _dx_rows(dy2, W, dx, rows):
    """dx[rows] = dy[rows] W^T."""
    np.matmul(dy2[rows], W.T, out=dx[rows])


def _dW_rows(x2, dy2, dW, rows):
    """dW[rows] = x[:, rows]^T dy."""
    np.matmul(x2[:, rows].T, dy2, out=dW[rows])


def _blocks(n, per_row):
    """range(n), the rows of a product of `per_row` multiply-adds a row, in up to BLOCKS slices
    as even as can be, each of at least MIN_ROWS rows and MIN_BLOCK multiply-adds (one slice
    for a smaller product)."""
    parts = max(1, min(BLOCKS, n // MIN_ROWS, n * per_row // MIN_BLOCK))
    edges = [n * i // parts for i in range(parts + 1)]
    return [slice(start, stop) for start, stop in zip(edges, edges[1:])]


def _call(fn, *args):
    """fn(*args): one task of the pool."""
    return fn(*args)
