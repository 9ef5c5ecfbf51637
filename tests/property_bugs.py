"""Faulty kernels for the conformance properties' tests (conformance/properties.py): numpy
kernels that are examples.numpy_float32 with one fault each, written from the bugs that
shipped past kernel test suites; each breaks one property and passes the others.

    cached_by_shape       returns the results cached from its first call with the same shapes
                          (KernelBench issue 165: outputs reused across calls)
    wrong_at_one_length   drops the last key at exactly N_k = 144 (flash-attention issue 2577:
                          wrong at one KV length, right one either side)
    partial_block_dropped ignores the keys past the last multiple of 16 (jax issue 27224:
                          right only at multiples of the block size)
    partial_block_doubled counts the keys past the last multiple of 16 twice
    noisy                 one ulp of noise on out from a per-process counter: not the same bits
                          twice (declared deterministic)
    batch_dependent       each sequence's keys summed in another order when it is not alone:
                          other bits in a batch (declared batch_invariant), right to rounding
    batch_leak            a split-KV merge that mixes in the first sequence's lse in a batch:
                          wrong in a batch, right alone (torch PR 176905's class of bug)
    unshifted_softmax     exp(S) in float16 without the shift by the row's largest score: a
                          saturated row overflows (right where the scores stay small)
    sink_leak             rows with no key carried into dsinks (cudnn-frontend PR 557)
    nan_swallowed         NaN in out replaced by 0: a NaN in the inputs no longer shows
    paged_tail_read       a paged cache's pages read whole, the rows past cache_seqlens masked by
                          -inf scores but multiplied by 0 in P v: a stale row's NaN reaches out
    page_size_16          a paged cache read as pages of 16 rows whatever their size
    packed_order_dependent  packed sequences after the first summed in another order: other bits
                          where a sequence sits elsewhere in the pack (declared batch_invariant)
    partial_block_of_320  keys past the last multiple of its declared block of 320 dropped: found
                          only at the lengths its declaration adds (321, 639, 641; beyond 256)
    lse_rows_by_keys      lse kept in a buffer of N_k rows: with more queries than keys, the rows
                          past N_k hold the last one's (out right): only the split trial's parts,
                          of fewer keys than queries, show it
    rows_rotated          each row's out is the next row's: the output's norm exactly right
                          (flash-attention PR 2553), every row wrong
    zeros_in_low_precision, one_row_repeated   zeros, or row 0's out in every row, in a 16-bit dtype
                          (outputs a loose tolerance passes): every 16-bit trial fails, no float32 one
"""
import itertools

import numpy as np

from numpy_attention.conformance import declare
from numpy_attention.conformance.examples import numpy_float32

SUPPORTS = ("gqa", "lse", "gradients")
_CACHE = {}
_CALLS = itertools.count()


@declare(kind="numpy", supports=SUPPORTS)
def cached_by_shape(q, k, v, dout=None, **options):
    key = (q.shape, k.shape, v.shape, None if dout is None else dout.shape, q.dtype.str)
    if key not in _CACHE:
        _CACHE[key] = numpy_float32(q, k, v, dout=dout, **options)
    return dict(_CACHE[key])


@declare(kind="numpy", supports=SUPPORTS)
def wrong_at_one_length(q, k, v, dout=None, **options):
    if k.shape[-2] != 144:
        return numpy_float32(q, k, v, dout=dout, **options)
    results = numpy_float32(q, k[..., :-1, :], v[..., :-1, :], dout=dout, **options)
    if dout is not None:                                 # the dropped key's gradients: 0
        pad = lambda x: np.concatenate([x, np.zeros(x.shape[:-2] + (1,) + x.shape[-1:], x.dtype)], axis=-2)
        results.update(dk=pad(results["dk"]), dv=pad(results["dv"]))
    return results


@declare(kind="numpy", supports=SUPPORTS)
def partial_block_dropped(q, k, v, dout=None, **options):
    n_k = k.shape[-2]
    kept = n_k - n_k % 16 if n_k >= 16 else n_k
    results = numpy_float32(q, k[..., :kept, :], v[..., :kept, :], dout=dout, **options)
    if dout is not None and kept < n_k:
        pad = lambda x: np.concatenate([x, np.zeros(x.shape[:-2] + (n_k - kept,) + x.shape[-1:], x.dtype)], -2)
        results.update(dk=pad(results["dk"]), dv=pad(results["dv"]))
    return results


@declare(kind="numpy", supports=SUPPORTS + ("deterministic",))
def noisy(q, k, v, dout=None, **options):
    results = numpy_float32(q, k, v, dout=dout, **options)
    out = results["out"]
    if next(_CALLS) % 2:                                 # every other call: out one ulp up at [0, ..., 0]
        out = out.copy()
        out.flat[0] = np.nextafter(out.flat[0], np.inf, dtype=out.dtype) if out.dtype == np.float32 \
            else (out.flat[0].astype(np.float32) * (1 + 2 ** -7)).astype(out.dtype)
    return {**results, "out": out}


def _reversed_keys(q, k, v, dout, options):
    """numpy_float32 with the keys in reverse order: the same attention, other roundings."""
    flip = lambda x: x[..., ::-1, :]
    results = numpy_float32(q, flip(k), flip(v), dout=dout, **options)
    if dout is not None:
        results.update(dk=flip(results["dk"]).copy(), dv=flip(results["dv"]).copy())
    return results


@declare(kind="numpy", supports=SUPPORTS + ("batch_invariant",))
def batch_dependent(q, k, v, dout=None, **options):
    if q.shape[0] == 1:
        return numpy_float32(q, k, v, dout=dout, **options)
    return _reversed_keys(q, k, v, dout, options)


@declare(kind="numpy", supports=SUPPORTS)
def batch_leak(q, k, v, dout=None, **options):
    results = numpy_float32(q, k, v, dout=dout, **options)
    if q.shape[0] > 1:                                  # the last sequence's out rescaled by the first's lse
        out = results["out"].astype(np.float32)
        lse = results["lse"]
        out[-1] *= np.exp(np.minimum(lse[0] - lse[-1], 0))[..., None]
        results["out"] = out.astype(results["out"].dtype)
    return results


@declare(kind="numpy", supports=("gqa", "lse"), dtypes=("float16",))
def unshifted_softmax(q, k, v, dout=None, scale=None, **options):
    """P = exp(S) / rowsum(exp(S)) with exp taken in the inputs' dtype and no shift by the row's
    largest score: float16's exp overflows past S = 11.09, and a saturated row's weights are NaN.
    Only where a row's largest score passes 8 (the grid's rarely do); else the honest kernel."""
    groups = q.shape[-3] // k.shape[-3]
    each = lambda x: np.repeat(x.astype(np.float32), groups, axis=-3)    # each query head's k, v
    s = (q.astype(np.float32) @ np.swapaxes(each(k), -1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if s.max() <= 8:
        return numpy_float32(q, k, v, dout=dout, scale=scale, **options)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        e = np.exp(s.astype(q.dtype)).astype(np.float32)
        out = (e / e.sum(axis=-1, keepdims=True)) @ each(v)
        return {"out": out.astype(q.dtype), "lse": np.log(e.sum(axis=-1))}


def _fully_masked_rows(q, k, mask):
    """[B, 1 or H, N_q] the rows whose mask keeps no key."""
    return ~np.broadcast_to(mask, mask.shape[:-1] + (k.shape[-2],)).any(axis=-1)


@declare(kind="numpy", supports=("gqa", "mask", "sinks", "lse", "gradients"))
def sink_leak(q, k, v, dout=None, mask=None, sinks=None, **options):
    """The sink's gradient takes the rows with no key too, their D = rowsum(dout * out) read
    from a buffer they never wrote (here: the mean of v) where it is 0 (cudnn-frontend PR 557:
    padded query rows carried a finite sink lse into the dSink reduction)."""
    given = {name: x for name, x in (("mask", mask), ("sinks", sinks)) if x is not None}
    results = numpy_float32(q, k, v, dout=dout, **given, **options)
    if dout is None or sinks is None or mask is None:
        return results
    groups = q.shape[-3] // k.shape[-3]
    stale = np.repeat(v.astype(np.float32).mean(axis=-2, keepdims=True), groups, axis=-3)   # [B, H, 1, d]
    D = np.sum(dout.astype(np.float32) * stale, axis=-1)                                      # [B, H, N_q]
    empty = np.broadcast_to(_fully_masked_rows(q, k, mask), D.shape)
    leak = -np.sum(np.where(empty, D, 0), axis=(0, 2))                                        # P_sink = 1 there
    return {**results, "dsinks": (results["dsinks"].astype(np.float32) + leak).astype(results["dsinks"].dtype)}


@declare(kind="numpy", supports=SUPPORTS)
def nan_swallowed(q, k, v, dout=None, **options):
    """out with NaN replaced by 0 (np.nan_to_num): a NaN in the inputs no longer shows."""
    results = numpy_float32(q, k, v, dout=dout, **options)
    return {**results, "out": np.nan_to_num(results["out"], nan=0.0)}


@declare(kind="numpy", supports=("gqa", "paged"))
def paged_tail_read(q, k, v, page_table=None, cache_seqlens=None, **options):
    """A paged kernel that reads each sequence's pages whole and masks the rows past cache_seqlens
    with -inf scores: P is 0 there, but P @ v multiplies 0 by whatever those rows hold (a stale
    cache's NaN becomes the row's out)."""
    if page_table is None:
        return numpy_float32(q, k, v, **options)
    groups = q.shape[-3] // k.shape[-3]
    gathered = lambda x: np.repeat(np.concatenate([x[page_table[:, p]] for p in range(page_table.shape[1])],
                                                  axis=-2).astype(np.float32), groups, axis=-3)   # [B, H, P page, d]
    keys, values = gathered(k), gathered(v)
    s = q.astype(np.float32) @ np.swapaxes(keys, -1, -2) / np.sqrt(q.shape[-1])
    n_k = keys.shape[-2]
    kept = np.arange(n_k)[None, None, None, :] < cache_seqlens[:, None, None, None]
    kept = kept & (np.arange(n_k)[None, None, None, :] <= np.arange(q.shape[-2])[None, None, :, None]
                   + cache_seqlens[:, None, None, None] - q.shape[-2]) if options.get("causal") is not None else kept
    s = np.where(kept, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isinf(top), 0, top))                   # a row with no key: 0 (out 0)
    p /= np.maximum(p.sum(axis=-1, keepdims=True), np.finfo(np.float32).tiny)
    return {"out": (p @ values).astype(q.dtype)}


@declare(kind="numpy", supports=("gqa", "paged"))
def page_size_16(q, k, v, page_table=None, cache_seqlens=None, **options):
    """A paged kernel that finds token j at row j % 16 of page page_table[b, j // 16], whatever the
    cache's page size: right in pages of 16 rows, wrong in any other."""
    if page_table is None:
        return numpy_float32(q, k, v, **options)
    longest = int(max(cache_seqlens.max(initial=0), 1))
    at = np.arange(longest)
    gather = lambda x: np.stack([np.moveaxis(x[table[np.minimum(at // 16, table.size - 1)], :, at % 16], 0, 1)
                                 for table in page_table])                       # [B, H_kv, L, d]
    keep = (at[None, :] < cache_seqlens[:, None])[:, None, None, :]
    used = lambda x: np.where(np.swapaxes(keep, -1, -2), gather(x), 0).astype(x.dtype)   # (no row past the end)
    return numpy_float32(q, used(k), used(v), mask=keep, **options)


@declare(kind="numpy", supports=SUPPORTS)
def lse_rows_by_keys(q, k, v, dout=None, **options):
    """An lse written into rows bounded by the keys' count: query rows past N_k repeat row N_k - 1's."""
    results = numpy_float32(q, k, v, dout=dout, **options)
    rows = np.minimum(np.arange(q.shape[-2]), k.shape[-2] - 1)
    return {**results, "lse": results["lse"][..., rows]}


@declare(kind="numpy", supports=("gqa", "varlen", "lse", "gradients", "batch_invariant"))
def packed_order_dependent(q, k, v, dout=None, cu_seqlens_q=None, cu_seqlens_k=None, **options):
    """Packed sequences after the first have their keys summed in reverse order: right to rounding,
    but a sequence's bits depend on where it sits in the pack (declared batch_invariant)."""
    packed = {} if cu_seqlens_q is None else {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    results = numpy_float32(q, k, v, dout=dout, **packed, **options)
    if cu_seqlens_q is None or options.get("causal") is not None:
        return results
    order = np.concatenate([np.arange(cu_seqlens_k[0], cu_seqlens_k[1])]
                           + [np.arange(b - 1, a - 1, -1) for a, b in zip(cu_seqlens_k[1:-1], cu_seqlens_k[2:])])
    other = numpy_float32(q, k[:, order], v[:, order], dout=dout, **packed, **options)
    later = np.arange(q.shape[-2]) >= cu_seqlens_q[1]                 # the rows of sequences 1, 2, ...
    for name in ("out", "lse", "dq"):
        if name in results:
            axis = -1 if name == "lse" else -2
            pick = later if axis == -1 else later[:, None]
            results[name] = np.where(pick, other[name], results[name])
    back = np.argsort(order)
    for name in ("dk", "dv"):
        if name in results:
            results[name] = other[name][:, back]
    return results


@declare(kind="numpy", supports=SUPPORTS)
def zeros_in_low_precision(q, k, v, dout=None, **options):
    """Zeros for out and every gradient in a 16-bit dtype (KernelBench 165's class: an output
    that a loose tolerance passes); honest in float32."""
    results = numpy_float32(q, k, v, dout=dout, **options)
    if q.dtype == np.float32:
        return results
    return {name: x if name == "lse" else np.zeros_like(x) for name, x in results.items()}


@declare(kind="numpy", supports=SUPPORTS)
def one_row_repeated(q, k, v, dout=None, **options):
    """Every query row's out is row 0's, in a 16-bit dtype: right where attention is nearly
    uniform (each row then the mean of v), wrong wherever rows differ; honest in float32."""
    results = numpy_float32(q, k, v, dout=dout, **options)
    if q.dtype == np.float32:
        return results
    return {**results, "out": np.broadcast_to(results["out"][..., :1, :], results["out"].shape).copy()}


@declare(kind="numpy", supports=SUPPORTS, block_sizes=(320,))
def partial_block_of_320(q, k, v, dout=None, **options):
    """Keys past the last multiple of its block of 320 dropped, beyond one block (jax 27224 at a
    block size past the lengths of 16 to 256: wrong from 321 to 639, and past 640)."""
    n_k = k.shape[-2]
    kept = n_k - n_k % 320 if n_k > 320 else n_k
    results = numpy_float32(q, k[..., :kept, :], v[..., :kept, :], dout=dout, **options)
    if dout is not None and kept < n_k:
        pad = lambda x: np.concatenate([x, np.zeros(x.shape[:-2] + (n_k - kept,) + x.shape[-1:], x.dtype)], -2)
        results.update(dk=pad(results["dk"]), dv=pad(results["dv"]))
    return results


@declare(kind="numpy", supports=SUPPORTS)
def partial_block_doubled(q, k, v, dout=None, **options):
    """The keys past the last multiple of 16 counted twice (a last partial block accumulated
    again): right at multiples of 16 and below 16 keys, wrong one past them."""
    n_k = k.shape[-2]
    kept = n_k - n_k % 16 if n_k >= 16 else n_k
    if kept == n_k:
        return numpy_float32(q, k, v, dout=dout, **options)
    again = lambda x: np.concatenate([x, x[..., kept:, :]], axis=-2)
    results = numpy_float32(q, again(k), again(v), dout=dout, **options)
    if dout is not None:                                 # both copies' gradients to the key's
        fold = lambda x: np.concatenate([x[..., :kept, :], x[..., kept:n_k, :] + x[..., n_k:, :]], axis=-2)
        results.update(dk=fold(results["dk"]), dv=fold(results["dv"]))
    return results


@declare(kind="numpy", supports=SUPPORTS)
def rows_rotated(q, k, v, dout=None, **options):
    """Each query row's out is the next row's (flash-attention PR 2553: a forward wrong by far
    while its output's norm matched the reference's): every head's norm exactly the honest
    one's, every row wrong."""
    results = numpy_float32(q, k, v, dout=dout, **options)
    return {**results, "out": np.roll(results["out"], 1, axis=-2)}
