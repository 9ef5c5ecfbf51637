"""Attention's options, checked once: the frozen record that every engine and crosscheck share.

    q, k, v, options = attention_options(q, k, v, mask=mask, causal=True, ...)

`attention_options` runs every check of `attention_forward`'s arguments, so an engine only
computes. Shape legend (as in attention.py):
    ...   leading batch axes;  H query heads,  H_kv key/value heads (H_kv divides H)
    N_q, N_k lengths;  d_k, d_v widths;  the scores S are [..., H, N_q, N_k]

Which scores are kept (step 4 of the forward) depends on four options at once:
    keep = mask & causal & window & (bias != -inf)        (True = attend)
`keep_mask(options, score_shape, index)` gives that for any block of the scores, and
`alibi_bias(options, score_shape, index)` ALiBi's bias for it: -slope * |i + N_k - N_q - j|,
each row's slope its head's (alibi_slopes [H] or [..., H]) or, with packed sequences and
alibi_slopes [B, H], its sequence's and head's. Its gradient is one per row and block
(alibi_row_gradient), summed to each slope's rows by alibi_slopes_gradient.
"""
import math
import os
from typing import NamedTuple, Optional

import numpy as np

from ._checks import (as_float_array, as_mask, broadcast_shape_to, require_bool, require_choice,
                      read_only_copy, require_positive_int, require_positive_real, require_probability,
                      result_dtype)
from ._layout import check_window, resolve_alignment, unbroadcast
from .positions import band_keep, distance, positions, sequence_lengths, sequence_of

FULLY_MASKED_POLICIES = ("zero", "uniform", "nan")
IMPLEMENTATIONS = ("textbook", "blocked", "tiled")
TILE_SIZE = 256             # the tiled engine's default block size (rows and columns per tile)
PARALLEL_SCORES = 1 << 19   # workers=None: every core from this many scores [..., H, N_q, N_k] up
PARALLEL_PROJECTIONS = 1 << 24   # MultiHeadAttention's projections: every core also from this many
                                 # multiply-adds in the forward's four projections up (B N D^2 each)
PARALLEL_HEAD_COPIES = 1 << 20   # and its splits and merges of heads from arrays of this many bytes up


class AttentionOptions(NamedTuple):
    scale: float                        # multiplies q k^T
    softcap: Optional[float]            # S <- softcap * tanh(S / softcap), or None
    bias: Optional[np.ndarray]          # additive scores broadcastable to [..., H, N_q, N_k] (read-only copy)
    mask: Optional[np.ndarray]          # bool keep-mask broadcastable to the scores (read-only), True = attend
    causal: bool
    align: str                          # 'top_left' or 'bottom_right': the diagonal of causal and window
    window: Optional[tuple]             # (left, right), -1 = unbounded
    dropout_scale: Optional[np.ndarray]  # dropout_mask / (1 - dropout_p), broadcastable to P (read-only)
    dropout_p: float                    # the drop probability (0 without dropout)
    fully_masked: str                   # 'zero', 'uniform' or 'nan'
    sinks: Optional[np.ndarray]         # [H] one extra logit per query head, with no value (read-only)
    alibi_slopes: Optional[np.ndarray]  # [H], [..., H], or [B, H] per packed sequence: S += -slope
                                        # |i + N_k - N_q - j| (read-only)
    cu_seqlens_q: Optional[np.ndarray]  # [B + 1] packed sequences' offsets along N_q (positions.py)
    cu_seqlens_k: Optional[np.ndarray]  # [B + 1] along N_k
    seqused_k: Optional[np.ndarray]     # [B] keys used of each sequence (None: all)
    masked: bool                        # whether any score is set to -inf (step 4)
    implementation: str                 # 'textbook', 'blocked' or 'tiled'
    block_size: Optional[int]           # the tiled engine's tile size; None for the others
    paged: Optional[object] = None      # paged.PagedLayout: q, k, v were packed from a paged KV cache
    workers: int = 1                    # threads of the blocked and tiled engines (engines/parallel.py)
    scheduler: object = None            # the tiled engine's Dask cluster: a Client or an address (or None)


def keep_mask(options, score_shape, index=(Ellipsis, slice(None), slice(None))):
    """Which scores of S[index] are kept: mask & causal & window & (bias != -inf).

    score_shape: [..., H, N_q, N_k]; index: a tuple into the scores whose last two
    entries are the slices of rows and columns.
    Returns a bool array broadcastable to S[index], or None when every score is kept.
    """
    o = options
    if not o.masked:
        return None
    keep = band_keep(_positions(o, score_shape, index, o.align), o.causal, o.window)   # [rows, cols] or None
    block = lambda x: np.broadcast_to(x, score_shape)[index]          # a view of x's block
    parts = ([] if o.mask is None else [block(o.mask)]) + \
            ([] if o.bias is None else [~np.isneginf(block(o.bias).real)])
    for part in parts:
        keep = part if keep is None else keep & part
    return keep


def attention_options(q, k, v, *, mask=None, bias=None, causal=False, align=None, window=None,
                      scale=None, softcap=None, dropout_mask=None, dropout_p=0.0,
                      fully_masked="zero", check_finite=False, implementation=None, block_size=None,
                      sinks=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                      seqused_k=None, workers=None, scheduler=None):
    """Check attention_forward's arguments; return (q, k, v, AttentionOptions).

    q, k, v come back as fresh row-major arrays of the computation's dtype (a cache that keeps
    them then never shares memory with the caller's arrays, and each head's [N, d] matrix has
    unit stride for BLAS whatever the caller's layout: a transposed view, a broadcast stack);
    mask, bias and the dropout scale are read-only copies. implementation None is 'tiled' when
    block_size is given, else 'blocked'. Raises ValueError / TypeError naming the argument and
    the shapes.
    """
    q, k, v = _check_qkv(q, k, v)
    causal, align = resolve_alignment(causal, align)
    window = check_window(window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else require_positive_real(scale, "scale")
    softcap = None if softcap is None else require_positive_real(softcap, "softcap")
    require_choice(fully_masked, "fully_masked", FULLY_MASKED_POLICIES)
    if fully_masked != "zero" and k.shape[-2] == 0:     # every row is fully masked, P is [N_q, 0]
        raise ValueError(f"fully_masked={fully_masked!r} needs at least one key; with N_k = 0 "
                         f"only 'zero' defines the output: k {k.shape}, v {v.shape}")
    score_shape = q.shape[:-1] + (k.shape[-2],)                  # [..., H, N_q, N_k]
    legend = "the scores [..., H, N_q, N_k]"
    if bias is not None:
        bias = as_float_array(bias, "bias")
        broadcast_shape_to(bias, "bias", score_shape, legend)
    keep = None if mask is None else as_mask(mask, "mask", score_shape, legend)
    dropout_p = require_probability(dropout_p, "dropout_p")
    dropout_scale = _dropout_scale(dropout_mask, dropout_p, score_shape, legend)
    packed = _packed_sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k)
    sinks, alibi_slopes = _per_head(q, sinks, alibi_slopes, fully_masked,
                                    None if packed[0] is None else packed[0].size - 1)
    if require_bool(check_finite, "check_finite"):
        for name, x in (("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes)):
            if x is not None:
                _require_finite(name, x)
        for name, x in (("bias", bias), ("sinks", sinks)):         # -inf: masked, or no sink
            if x is not None:
                _require_finite(name, x, allow_neginf=True)
    # a float64 bias widens float32 scores; per-head vectors (often Python lists) widen only to
    # complex, for complex-step checks: real ones are cast to the scores' dtype
    dtype = result_dtype(q, bias, *(x for x in (sinks, alibi_slopes) if x is not None and x.dtype.kind == "c"))
    q, k, v = (x.astype(dtype, copy=False) for x in (q, k, v))
    sinks, alibi_slopes = (None if x is None else x.astype(dtype) for x in (sinks, alibi_slopes))
    if dropout_scale is not None:                                # keep / (1 - p) in the scores' dtype
        dropout_scale = dropout_scale.astype(q.real.dtype)
    implementation, block_size = _engine(implementation, block_size, softcap, dropout_scale,
                                         fully_masked)
    if packed[0] is not None and fully_masked == "uniform":
        raise ValueError("fully_masked='uniform' would spread a row over every packed sequence's keys; "
                         "with cu_seqlens (or a paged KV cache) use 'zero' or 'nan'")
    masked = (keep is not None or causal or window is not None or packed[0] is not None
              or (bias is not None and bool(np.isneginf(bias.real).any())))
    return q, k, v, AttentionOptions(
        scale=scale, softcap=softcap, bias=read_only_copy(bias), mask=read_only_copy(keep),
        causal=causal, align=align, window=window, dropout_scale=read_only_copy(dropout_scale),
        dropout_p=dropout_p,
        fully_masked=fully_masked, sinks=read_only_copy(sinks), alibi_slopes=read_only_copy(alibi_slopes),
        cu_seqlens_q=read_only_copy(packed[0]), cu_seqlens_k=read_only_copy(packed[1]),
        seqused_k=read_only_copy(packed[2]),
        masked=masked, implementation=implementation, block_size=block_size,
        workers=resolve_workers(workers, implementation, score_count(q.shape, k.shape[-2], packed)),
        scheduler=check_scheduler(scheduler, implementation))


def score_count(q_shape, n_k, packed=(None, None)):
    """The scores the engines work on for q [..., H, N_q, d_k] and N_k keys: [..., H, N_q, N_k];
    with packed sequences (cu_seqlens_q, cu_seqlens_k) each sequence's own block,
    H * sum_b n_q[b] * n_k[b] (the tiled engine skips the tiles between two sequences, the
    blocked engine the columns outside a block's sequences)."""
    if packed[0] is None:
        return math.prod(q_shape[:-1]) * n_k
    return math.prod(q_shape[:-2]) * int(np.dot(np.diff(packed[0]), np.diff(packed[1])))


def _packed_sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """(cu_seqlens_q, cu_seqlens_k, seqused_k) checked as int64 arrays, or Nones.

    Packed sequences (positions.py): q [H, total_q, d_k], k and v [H_kv, total_k, d]
    (no batch axes), cu_seqlens_* [B + 1] non-decreasing from 0 to the total length,
    seqused_k [B] with 0 <= seqused_k[b] <= sequence b's key length.
    """
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if seqused_k is not None:
            raise ValueError("seqused_k needs cu_seqlens_q and cu_seqlens_k (packed sequences)")
        return None, None, None
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("packed sequences need both cu_seqlens_q and cu_seqlens_k")
    if q.ndim > 3:
        raise ValueError(f"with cu_seqlens, q, k, v are packed [H, total, d] with no batch axes, "
                         f"got q {q.shape}, k {k.shape}")
    checked = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[-2]), ("cu_seqlens_k", cu_seqlens_k, k.shape[-2])):
        cu = _int_array(cu, name)
        if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or cu[-1] != total or (np.diff(cu) < 0).any():
            raise ValueError(f"{name} must be [B + 1] non-decreasing offsets from 0 to the packed "
                             f"length {total}, got {cu.tolist() if cu.size <= 16 else cu.shape}")
        checked.append(cu)
    if checked[0].size != checked[1].size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must count the same B + 1 sequences, "
                         f"got {checked[0].size} and {checked[1].size}")
    if seqused_k is not None:
        seqused_k = _int_array(seqused_k, "seqused_k")
        lengths = sequence_lengths(checked[1])
        if seqused_k.shape != lengths.shape or (seqused_k < 0).any() or (seqused_k > lengths).any():
            raise ValueError(f"seqused_k must be [B] = {lengths.shape} with 0 <= seqused_k[b] <= "
                             f"the key lengths {lengths.tolist()}, got {seqused_k.tolist()}")
    return checked[0], checked[1], seqused_k


def _int_array(x, name):
    """x as an int64 array; TypeError for anything but integers."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype} with shape {arr.shape}")
    return arr.astype(np.int64)


def _per_head(q, sinks, alibi_slopes, fully_masked, sequences=None):
    """sinks and alibi_slopes checked (check_per_head) for q and its `sequences` packed
    sequences (None: not packed). With sinks a row whose keys are all masked puts its whole
    weight on the sink: out = 0 and lse = sink, which is the 'zero' policy's output; the other
    policies are refused.
    """
    checked = check_per_head(q.shape, sinks, alibi_slopes, sequences)
    if sinks is not None and fully_masked != "zero":
        raise ValueError(f"sinks take a fully masked row's weight (out = 0, lse = sink): "
                         f"fully_masked={fully_masked!r} does not apply; use 'zero'")
    return checked


def check_per_head(q_shape, sinks, alibi_slopes, sequences=None):
    """(sinks, alibi_slopes) as float (or complex) arrays, or None, checked against the caller's
    q [..., H, N_q, d_k] (a single head's [N, d]: H = 1): sinks [H]; alibi_slopes [H] or
    [..., H] (q's leading axes), or with B = `sequences` sequences (packed, or a paged KV
    cache's batch) [H] or [B, H], one row per sequence (FlashAttention's varlen and kvcache).
    ValueError naming the shapes accepted and q's.
    """
    heads = q_shape[-3] if len(q_shape) >= 3 else 1
    if sequences is None:
        slopes = ([(heads,), tuple(q_shape[:-2])], f"[H] or [..., H] for q {tuple(q_shape)}")
    else:
        slopes = ([(heads,), (sequences, heads)], f"[H], or [B, H] with one row per sequence, "
                                                  f"for q {tuple(q_shape)} and B = {sequences} sequences")
    checked = []
    for name, x, (shapes, legend) in (("sinks", sinks, ([(heads,)], f"[H] for q {tuple(q_shape)}")),
                                      ("alibi_slopes", alibi_slopes, slopes)):
        if x is not None:
            x = as_float_array(x, name)
            shapes = list(dict.fromkeys(shapes))                 # [..., H] of q [H, N, d] is [H]
            if x.shape not in shapes:
                raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))} ({legend}), "
                                 f"got {x.shape}")
        checked.append(x)
    return checked


def heads_view(x, score_shape):
    """A per-head array ([H], or [..., H]; [1] for [N, d] inputs) broadcast to score_shape[:-2]."""
    lead = tuple(score_shape[:-2])
    return np.broadcast_to(x.reshape(x.shape[len(x.shape) - len(lead):]) if x.ndim > len(lead) else x, lead)


def _positions(options, score_shape, index, align):
    """positions.Positions of the rows and columns of S[index] (index as for keep_mask)."""
    n_q, n_k = score_shape[-2:]
    return positions(n_q, n_k, np.arange(n_q)[index[-2]], np.arange(n_k)[index[-1]], align,
                     options.cu_seqlens_q, options.cu_seqlens_k, options.seqused_k)


def alibi_distance(options, score_shape, index=(Ellipsis, slice(None), slice(None))):
    """|i + N_k - N_q - j| [rows, cols] for the rows and columns of S[index]: the distance from
    the bottom-right-aligned diagonal, in each row's own sequence (FlashAttention's ALiBi;
    N_q == N_k: the main diagonal)."""
    return distance(_positions(options, score_shape, index, "bottom_right"))


def _per_sequence(slopes, cu_seqlens_q):
    """Whether slopes are [B, H], one row per packed sequence (else one slope per head)."""
    return cu_seqlens_q is not None and np.ndim(slopes) == 2


def _row_slopes(slopes, options, score_shape, index):
    """The slope of each row of S[index], broadcastable to its block [..., heads, rows, cols]:
    slope_h, [..., heads, 1, 1], for slopes [H] or [..., H]; slopes[b, h] of the row's sequence
    b, [heads, rows, 1], for slopes [B, H] with packed sequences."""
    if not _per_sequence(slopes, options.cu_seqlens_q):
        return heads_view(slopes, score_shape)[index[:-2]][..., None, None]
    rows = np.arange(score_shape[-2])[index[-2]]
    by_row = np.swapaxes(slopes[sequence_of(options.cu_seqlens_q, rows)], 0, 1)    # [H, rows]
    by_row = by_row.reshape(tuple(score_shape[:-2]) + rows.shape)     # ([rows] for one [N, d] head)
    return by_row[index[:-2] + (slice(None),)][..., None]


def alibi_bias(options, score_shape, index=(Ellipsis, slice(None), slice(None)), slopes=None,
               rounded=None):
    """ALiBi's bias of the scores S[index], -slope * alibi_distance, or None without
    alibi_slopes: each row's slope its head's (slopes [H] or [..., H]) or, for slopes [B, H]
    with packed sequences, that of its sequence b and head, slopes[b, h]. slopes:
    options.alibi_slopes by default (a tangent of them has their shape). index as for keep_mask.
    In the slopes' dtype (the distances are integers below 2^24, exact in float32): a float32
    case's bias is float32, as a float32 kernel's is. rounded: applied to the distances first
    (a kernel that turns them into its 16-bit dtype, as torch's int * bfloat16 does), or None."""
    slopes = options.alibi_slopes if slopes is None else slopes
    if slopes is None:
        return None
    rows = _row_slopes(slopes, options, score_shape, index)
    distance = alibi_distance(options, score_shape, index).astype(rows.dtype)          # in the slopes' dtype
    return -rows * (distance if rounded is None else rounded(distance))


def alibi_row_gradient(dS, options, score_shape, index=(Ellipsis, slice(None), slice(None)),
                       rounded=None):
    """The gradient of each row's slope from the block dS = dS[index] [..., heads, rows, cols]
    (the gradient of S where ALiBi adds to it): -sum_j dS_ij |i + N_k - N_q - j|, [..., heads,
    rows]. A block of columns gives its part of the sum; alibi_slopes_gradient sums the rows.
    rounded: applied to the distances and to each product before the sum (a 16-bit autograd
    rounds them), or None."""
    distance = alibi_distance(options, score_shape, index).astype(dS.dtype)
    if rounded is None:
        return -np.sum(dS * distance, axis=-1)
    return -np.sum(rounded(dS * rounded(distance)), axis=-1)


def alibi_slopes_gradient(row_gradient, options):
    """dalibi_slopes, of alibi_slopes' shape, from every row's gradient [..., H, N_q]
    (alibi_row_gradient): summed over each slope's rows (slopes_sum)."""
    return slopes_sum(row_gradient, options.alibi_slopes, options.cu_seqlens_q)


def slopes_sum(x, slopes, cu_seqlens_q=None):
    """A value per row x [..., H, N_q] summed over each slope's rows, to the shape of slopes: for
    slopes [H] or [..., H] every row of the slope's head (and the batch where [H] broadcasts
    along it); for slopes [B, H] with packed sequences (cu_seqlens_q [B + 1]) the rows of
    sequence b alone, dslopes[b, h] = sum_{i in b} x[h, i]."""
    slopes = np.asarray(slopes)
    if not _per_sequence(slopes, cu_seqlens_q):
        return head_gradient(np.sum(x, axis=-1), slopes)
    sums = np.zeros((len(cu_seqlens_q) - 1,) + x.shape[:-1], x.dtype)       # [B, H] (or [B])
    for b, (start, stop) in enumerate(zip(cu_seqlens_q[:-1], cu_seqlens_q[1:])):
        sums[b] = np.sum(x[..., start:stop], axis=-1)
    return sums.reshape(slopes.shape)


def head_gradient(g, x):
    """A per-head gradient g [..., H] summed to the shape of x ([H] or [..., H]; [1] for a
    single head's [N, d] inputs)."""
    return unbroadcast(g, x.shape if x.ndim <= g.ndim else ()).reshape(x.shape)


def with_sink(S, options, score_shape=None, index=(Ellipsis, slice(None), slice(None))):
    """S[index] [..., rows, cols], with the sink as one more column [..., rows, cols + 1] when
    the options have sinks: a logit per head in every row's softmax, with no value.
    score_shape: the whole scores' shape (default S.shape: S is all of them)."""
    if options.sinks is None:
        return S
    sinks = heads_view(options.sinks, S.shape if score_shape is None else score_shape)[index[:-2]]
    column = np.broadcast_to(sinks[..., None, None], S.shape[:-1] + (1,))
    return np.concatenate([S, column.astype(S.dtype)], axis=-1)


def with_sink_weight(P, lse, options, score_shape=None, index=(Ellipsis, slice(None), slice(None))):
    """The softmax's whole row: P [..., rows, cols] with the sink's weight exp(sink - lse) as one
    more column [..., rows, cols + 1] when the options have sinks; P itself without.
    lse [..., rows]; score_shape, index: as for with_sink."""
    if options.sinks is None:
        return P
    sink = with_sink(np.zeros(P.shape[:-1] + (0,), P.dtype), options, score_shape, index)
    with np.errstate(invalid="ignore"):              # a -inf sink in a dead row: -inf - (-inf)
        return np.concatenate([P, np.exp(sink - lse[..., None])], axis=-1)


def available_cores():
    """The cores this process may use (os.sched_getaffinity; os.cpu_count where it has none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def resolve_workers(workers, implementation, scores, projections=0):
    """workers as an int >= 1; more than one runs the blocked or tiled engine on threads.
    None: every core this process may use (os.sched_getaffinity) for the blocked and tiled
    engines when they compute at least PARALLEL_SCORES scores (score_count), or when
    MultiHeadAttention's projections take at least PARALLEL_PROJECTIONS multiply-adds
    (`projections`), where threads gained here (below both there is little work to share);
    else 1."""
    if workers is None:
        if implementation == "textbook" or (scores < PARALLEL_SCORES and projections < PARALLEL_PROJECTIONS):
            return 1
        return available_cores()
    workers = require_positive_int(workers, "workers")
    if workers > 1 and implementation not in ("blocked", "tiled"):
        raise ValueError(f"workers={workers} runs the blocked or tiled engine on threads; "
                         f"implementation={implementation!r} runs on one")
    return workers


def check_scheduler(scheduler, implementation="tiled"):
    """scheduler checked: None, a dask.distributed Client (anything with submit, scatter and
    gather), or a scheduler's address string; it runs the tiled engine's slices."""
    if scheduler is None:
        return None
    if not isinstance(scheduler, str) and not all(hasattr(scheduler, name) for name in
                                                  ("submit", "scatter", "gather")):
        raise TypeError(f"scheduler must be a dask.distributed Client or a scheduler's address such "
                        f"as 'tcp://host:8786', got {type(scheduler).__name__}")
    if isinstance(scheduler, str) and not scheduler.strip():
        raise ValueError("scheduler must be a scheduler's address such as 'tcp://host:8786', got ''")
    if implementation != "tiled":
        raise ValueError(f"scheduler= runs the tiled engine's slices on a Dask cluster; "
                         f"implementation={implementation!r} runs here (use implementation='tiled')")
    return scheduler


def _check_qkv(q, k, v):
    """q, k, v checked against each other; fresh row-major arrays of one dtype."""
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    shapes = f"q {q.shape}, k {k.shape}, v {v.shape}"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 axes [..., N, d], got shape {x.shape}")
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"q, k, v must have the same number of axes, got shapes {shapes}")
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-3] != v.shape[:-3]:
        raise ValueError(f"q, k, v must share their leading batch axes, got shapes {shapes}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same width d_k, got q {q.shape}, k {k.shape}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same heads and length [..., H_kv, N_k], "
                         f"got k {k.shape}, v {v.shape}")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k must have a width d_k >= 1, got q {q.shape}, k {k.shape}")
    if q.ndim >= 3 and min(q.shape[-3], k.shape[-3]) == 0:
        raise ValueError(f"q and k must have at least one head (H >= 1, H_kv >= 1), "
                         f"got q {q.shape}, k {k.shape}")
    if q.ndim >= 3 and q.shape[-3] % k.shape[-3]:
        raise ValueError(f"k's heads H_kv={k.shape[-3]} must divide q's heads H={q.shape[-3]} "
                         f"(grouped-query attention), got q {q.shape}, k {k.shape}; the layout is "
                         f"[..., H, N, d] (torch's and FlashAttention's [B, N, H, d] need a transpose)")
    dtype = result_dtype(q, k, v)
    return tuple(x.astype(dtype, order="C") for x in (q, k, v))         # copies, row-major


def _require_finite(name, x, allow_neginf=False):
    bad = np.isnan(x) | (np.isposinf(x.real) if allow_neginf else ~np.isfinite(x))
    if bad.any():
        raise ValueError(f"{name} (shape {x.shape}) has {int(bad.sum())} non-finite entries "
                         f"(check_finite=True)")


def _dropout_scale(dropout_mask, dropout_p, score_shape, legend):
    """dropout_mask / (1 - dropout_p), checked; None when there is no dropout."""
    if dropout_mask is None:
        if dropout_p > 0:
            raise ValueError("dropout_p > 0 needs an explicit dropout_mask (keep = True); "
                             "attention_forward draws no random numbers")
        return None
    keep = as_mask(dropout_mask, "dropout_mask", score_shape, legend)
    return keep / (1.0 - dropout_p)


def _engine(implementation, block_size, softcap, dropout_scale, fully_masked):
    """(implementation, block_size) checked: block_size belongs to the tiled engine, which
    supports neither softcap, dropout nor the 'uniform' / 'nan' policies."""
    if implementation is None:
        implementation = "blocked" if block_size is None else "tiled"
    require_choice(implementation, "implementation", IMPLEMENTATIONS)
    if implementation != "tiled":
        if block_size is not None:
            raise ValueError(f"block_size={block_size!r} is the tiled engine's tile size; "
                             f"implementation={implementation!r} takes none")
        return implementation, None
    block_size = TILE_SIZE if block_size is None else require_positive_int(block_size, "block_size")
    unsupported = {"softcap": softcap is not None, "dropout_mask": dropout_scale is not None,
                   f"fully_masked={fully_masked!r}": fully_masked != "zero"}
    for name, used in unsupported.items():
        if used:
            raise ValueError(f"the tiled engine (implementation='tiled', block_size={block_size}) "
                             f"does not support {name}; use implementation='blocked' or 'textbook'")
    return implementation, block_size
