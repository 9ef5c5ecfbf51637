"""Where and how attention runs: the plan, apart from the math (options.py).

    plan = attention_plan(options, q.shape, k.shape, implementation=None, block_size=None,
                          workers=None, scheduler=None)

The options say what is computed; the plan says which engine computes it, in tiles of what
size, on how many threads or on which Dask cluster. Every engine computes the same result
whatever its plan (tested), so a plan never changes the math: an engine reads it, never
writes it, and never patches the options.
"""
import math
import os

import numpy as np

from .._checks import require_choice, require_positive_int
from ..caches import AttentionPlan
from ..options import untiled
from .parallel import check_address
from .sparse import default_block_rows

IMPLEMENTATIONS = ("textbook", "blocked", "tiled", "sparse")
PARALLEL = ("blocked", "tiled", "sparse")       # the engines that run on threads
CLUSTER = ("tiled", "sparse")                   # and those that run on a Dask cluster
TILE_SIZE = 256             # the tiled engine's default block size (rows and columns per tile)
PARALLEL_SCORES = 1 << 19   # workers=None: every core from this many scores [..., H, N_q, N_k] up
PARALLEL_PROJECTIONS = 1 << 24   # MultiHeadAttention's projections: every core also from this many
                                 # multiply-adds in the forward's four projections (B N D^2 each)
PARALLEL_HEAD_COPIES = 1 << 20   # and its splits and merges of heads from arrays of this many bytes up


def attention_plan(options, q_shape, k_shape, *, implementation=None, block_size=None, workers=None,
                   scheduler=None):
    """The plan of a call whose arguments attention_options checked into `options`, for q
    [..., H, N_q, d_k] and k [..., H_kv, N_k, d_k]: implementation None is 'sparse' with top-k
    lists, else 'tiled' when block_size is given, else 'blocked'; the tiled engine has
    neither the options whose row of options.OPTIONS says tiled=False nor the 'uniform' / 'nan'
    policies, the sparse engine needs top-k lists (ValueError naming it)."""
    implementation, block_size = _engine(implementation, block_size, options)
    scores = score_count(q_shape, k_shape[-2], (options.cu_seqlens_q, options.cu_seqlens_k))
    if implementation == "sparse":                  # the scores it computes: the listed entries
        scores = math.prod(q_shape[:-3] + (q_shape[-3] if len(q_shape) >= 3 else 1,)) * q_shape[-2] \
            * options.topk.indices.shape[-1]
    return AttentionPlan(implementation=implementation, block_size=block_size,
                         workers=resolve_workers(workers, implementation, scores),
                         scheduler=check_scheduler(scheduler, implementation))


def score_count(q_shape, n_k, packed=(None, None)):
    """The scores the engines work on for q [..., H, N_q, d_k] and N_k keys: [..., H, N_q, N_k];
    with packed sequences (cu_seqlens_q, cu_seqlens_k) each sequence's own block,
    H * sum_b n_q[b] * n_k[b] (the tiled engine skips the tiles between two sequences, the
    blocked engine the columns outside a block's sequences)."""
    if packed[0] is None:
        return math.prod(q_shape[:-1]) * n_k
    return math.prod(q_shape[:-2]) * int(np.dot(np.diff(packed[0]), np.diff(packed[1])))


def available_cores():
    """The cores this process may use (os.sched_getaffinity; os.cpu_count where it has none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_workers(workers, implementation, scores, projections=0):
    """workers as an int >= 1; more than one runs the blocked, tiled or sparse engine on threads.
    None: every core this process may use (os.sched_getaffinity) for those engines when they
    compute at least PARALLEL_SCORES scores (score_count), or when
    MultiHeadAttention's projections take at least PARALLEL_PROJECTIONS multiply-adds
    (`projections`), where threads gained here (below both there is little work to share);
    else 1. The sparse engine counts the listed entries as its scores."""
    if workers is None:
        if implementation not in PARALLEL or (scores < PARALLEL_SCORES and projections < PARALLEL_PROJECTIONS):
            return 1
        return available_cores()
    workers = require_positive_int(workers, "workers")
    if workers > 1 and implementation not in PARALLEL:
        raise ValueError(f"workers={workers} runs the blocked, tiled or sparse engine on threads; "
                         f"implementation={implementation!r} runs on one")
    return workers


def check_scheduler(scheduler, implementation="tiled"):
    """scheduler checked: None, a dask.distributed Client (anything with submit, scatter and
    gather), or a scheduler's address string that dask reads as one (parallel.check_address);
    it runs the tiled or the sparse engine's slices."""
    if scheduler is None:
        return None
    if not isinstance(scheduler, str) and not all(hasattr(scheduler, name) for name in
                                                  ("submit", "scatter", "gather")):
        raise TypeError(f"scheduler must be a dask.distributed Client or a scheduler's address such "
                        f"as 'tcp://host:8786', got {type(scheduler).__name__}")
    if isinstance(scheduler, str) and not scheduler.strip():
        raise ValueError("scheduler must be a scheduler's address such as 'tcp://host:8786', got ''")
    if implementation not in CLUSTER:
        raise ValueError(f"scheduler= runs the tiled or sparse engine's slices on a Dask cluster; "
                         f"implementation={implementation!r} runs here (use implementation='tiled')")
    if isinstance(scheduler, str):
        check_address(scheduler)
    return scheduler


def _engine(implementation, block_size, options):
    """(implementation, block_size) checked: block_size belongs to the tiled engine, which
    supports neither the options options.untiled names nor the 'uniform' / 'nan' policies, and
    to the sparse engine (its block rows; default sparse.default_block_rows), which needs
    top-k lists."""
    if implementation is None:
        implementation = "sparse" if options.topk is not None else "blocked" if block_size is None else "tiled"
    require_choice(implementation, "implementation", IMPLEMENTATIONS)
    if implementation == "sparse":
        if options.topk is None:
            raise ValueError("implementation='sparse' attends to each query's listed keys: it needs topk_indices")
        return implementation, (default_block_rows(options.topk.indices.shape[-1]) if block_size is None
                                else require_positive_int(block_size, "block_size"))
    if implementation != "tiled":
        if block_size is not None:
            raise ValueError(f"block_size={block_size!r} is the tiled engine's tile size (the sparse "
                             f"engine's block rows); implementation={implementation!r} takes none")
        return implementation, None
    block_size = TILE_SIZE if block_size is None else require_positive_int(block_size, "block_size")
    unsupported = untiled(options.given) + ([f"fully_masked={options.fully_masked!r}"]
                                            if options.fully_masked != "zero" else [])
    if unsupported:
        raise ValueError(f"the tiled engine (implementation='tiled', block_size={block_size}) "
                         f"does not support {unsupported[0]}; use implementation='blocked' or 'textbook'")
    return implementation, block_size
