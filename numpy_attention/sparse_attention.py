"""Sparse top-k attention under its own names: each query attends only to the keys it lists
(DeepSeek Sparse Attention's selected tokens, FlashMLA's sparse kernels; NSA's selected blocks
and MoBA through topk.py's `block_indices`). Thin names for the sparse engine
(engines/sparse.py: the formulas, the blocks, the tasks), which attention_forward(topk_indices=...)
runs with every option; these take the lists and the plan alone.

    q [..., H, N_q, d_k]   k [..., H_kv, N_k, d_k]   v [..., H_kv, N_k, d_v]
    indices [..., H_kv or H, N_q, K] int: query i of head h lists keys indices[.., g, i, :]
            (g its kv head h // G, or h itself); -1 pads, and so does any index outside [0, N_k)
    topk_length [..., N_q] (optional): only a row's first topk_length entries count
        ->  out [..., H, N_q, d_v],  lse [..., H, N_q],  max_logits [..., H, N_q]

A key listed twice counts twice (FlashMLA's reference gathers it twice); a row with no valid
entry gives out 0 (or as fully_masked says), lse -inf (FlashMLA writes +inf), max_logits -inf.
The cache keeps q, k, v and the lists as _checks.kept does (a frozen caller's arrays uncopied,
else copies), so changing them after the forward leaves the backward unchanged.
"""
from typing import NamedTuple, Optional

import numpy as np

from ._checks import as_float_array, brief, kept, require_cache, require_same_shape, result_dtype
from .caches import TiledAttentionCache
from .engines.plan import attention_plan
from .engines.sparse import sparse_backward, sparse_forward
from .forward_mode import attention_jvp
from .option_checks import check_qkv
from .options import options_record
from .topk import check_lists


class SparseCache(NamedTuple):
    q: np.ndarray               # [..., H, N_q, d_k]   (kept: a copy, or a frozen caller's array)
    k: np.ndarray               # [..., H_kv, N_k, d_k]
    v: np.ndarray               # [..., H_kv, N_k, d_v]
    indices: np.ndarray         # [..., H_kv or H, N_q, K] in the caller's integer dtype (kept)
    topk_length: Optional[np.ndarray]   # [..., N_q] or None (kept)
    attention: TiledAttentionCache      # the sparse engine's (out, lse, max_logits, its plan)


class SparseGrads(NamedTuple):
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray


def _block_rows(block_rows):
    """block_rows checked: a positive integer (the engine's block_size) or None."""
    if block_rows is not None and (isinstance(block_rows, (bool, np.bool_))
                                   or not isinstance(block_rows, (int, np.integer)) or block_rows < 1):
        raise ValueError(f"block_rows must be a positive integer or None, got {brief(block_rows)}")
    return block_rows


def sparse_attention_forward(q, k, v, indices, *, topk_length=None, scale=None, fully_masked="zero",
                             block_rows=None, workers=None, scheduler=None):
    """out = softmax over each query's listed keys of scale q k^T, times their values (module docstring).

    Args:
        q [..., H, N_q, d_k], k [..., H_kv, N_k, d_k], v [..., H_kv, N_k, d_v].
        indices: [..., H_kv or H, N_q, K] int, each query's keys; -1 (or any index outside
            [0, N_k)) pads; a key listed twice counts twice.
        topk_length: [..., N_q] int or None: only each row's first topk_length entries count.
        scale: multiplies q k^T; default 1 / sqrt(d_k).
        fully_masked: a row with no key gives, as in attention_forward, 'zero' (out 0, its
            gradient 0), 'uniform' (out the mean of all N_k values: dv gets dout / N_k) or 'nan'
            (out NaN, dv NaN); lse -inf in each.
        block_rows: query rows a block (memory O(G block_rows K d) a worker); N_q: all at once
            (the textbook); None (default): as many as gather engines/sparse.GATHER_ROWS keys per head.
        workers: threads for the blocks (engines/parallel.py; None: every core from
            PARALLEL_SCORES listed entries up, else 1); scheduler: a Dask Client or address
            that runs them instead. The same bits for any workers and on a cluster.
    Returns:
        out [..., H, N_q, d_v], lse [..., H, N_q] (-inf for a row with no key), max_logits
        [..., H, N_q], and a SparseCache (the backward runs as the forward did).
    """
    q, k, v = check_qkv(q, k, v)
    check_lists(indices, topk_length, q.shape, k.shape)               # (its errors name `indices`)
    dtype = result_dtype(q, k, v)
    q, k, v, o = options_record(*(kept(x, dtype) for x in (q, k, v)), topk_indices=indices, topk_length=topk_length,
                                scale=scale, fully_masked=fully_masked)
    plan = attention_plan(o, q.shape, k.shape, implementation="sparse", block_size=_block_rows(block_rows),
                          workers=workers, scheduler=scheduler)
    out, cache = sparse_forward(q, k, v, o, plan)
    return out, cache.lse.copy(), cache.max_logits.copy(), SparseCache(q=q, k=k, v=v, indices=o.topk.indices,
                                                         topk_length=o.topk.lengths, attention=cache)


def sparse_attention_backward(dout, cache):
    """SparseGrads(dq, dk, dv) of sparse_attention_forward for the upstream gradient dout
    [..., H, N_q, d_v] (engines/sparse.py: P recomputed from lse, dk and dv scattered and
    summed), a task per (batch index, kv head) summing its dk, dv over its blocks in order."""
    require_cache(cache, SparseCache, "sparse_attention_backward", arrays=("q", "k", "v"))
    require_same_shape(dout, cache.attention.out.shape, "dout")
    grads = sparse_backward(as_float_array(dout, "dout"), cache.attention)
    return SparseGrads(dq=grads.dq, dk=grads.dk, dv=grads.dv)


def sparse_attention_jvp(q, k, v, indices, q_dot=None, k_dot=None, v_dot=None, *, topk_length=None,
                         scale=None, fully_masked="zero", block_rows=None, workers=None, scheduler=None):
    """(out, out_dot, lse, lse_dot) along the tangents (engines/sparse.py's forward mode); a
    tangent left None is 0. The blocks run as sparse_attention_forward's."""
    return attention_jvp(q, k, v, q_dot, k_dot, v_dot, topk_indices=indices, topk_length=topk_length, scale=scale,
                         fully_masked=fully_masked, implementation="sparse", block_size=_block_rows(block_rows),
                         workers=workers, scheduler=scheduler)
