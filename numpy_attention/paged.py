"""A paged KV cache (FlashAttention's kvcache path, vLLM, FlashInfer) as packed sequences.

Shape legend:  B batch,  H / H_kv heads,  N_q new queries per sequence,  P pages per
sequence (page_table's width),  page the page size,  L_b = cache_seqlens[b] cached keys.

    q [B, H, N_q, d_k]   k_cache [num_pages, H_kv, page, d_k]   v_cache [num_pages, H_kv, page, d_v]
    page_table [B, P] int   cache_seqlens [B] int   ->   out [B, H, N_q, d_v]

Sequence b's keys are its pages' rows in order: key t (t < L_b) is row t % page of page
page_table[b, t // page]. Attention over them is attention over packed sequences
(positions.py): q packed as [H, B N_q, d_k], the keys gathered as [H_kv, sum_b L_b, d_k],
with cu_seqlens from N_q and cache_seqlens, so the steps by position align on each
sequence's own L_b (causal='bottom_right' puts the new queries at the end of the
cache, as FlashAttention's kvcache does), and ALiBi slopes [B, H] give sequence b its row
(with [H], every sequence the same). The backward scatters each key's gradient back into its page
row (summed, where pages are shared).
"""
from typing import NamedTuple

import numpy as np

from ._checks import offenders, read_only_copy

# the options a paged KV cache takes none of: each sequence's keys are its cache_seqlens rows,
# packed here (no caller's cu_seqlens or seqused_k, no mask or bias laid over them); no output gate
NOT_WITH_PAGES = ("mask", "bias", "cu_seqlens_q", "cu_seqlens_k", "seqused_k", "gate")


class PagedLayout(NamedTuple):
    page_table: np.ndarray          # [B, P] int (a read-only copy)
    cache_seqlens: np.ndarray       # [B] int (a read-only copy)
    q_shape: tuple                  # [B, H, N_q, d_k]
    k_cache_shape: tuple            # [num_pages, H_kv, page, d_k]
    v_cache_shape: tuple            # [num_pages, H_kv, page, d_v]


def check_pages(q, k_cache, v_cache, page_table, cache_seqlens):
    """The PagedLayout of these arrays, checked (ValueError / TypeError naming the argument)."""
    if page_table is None or cache_seqlens is None:
        raise ValueError("a paged KV cache needs both page_table [B, P] and cache_seqlens [B]")
    shapes = f"q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape}"
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.ndim != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"a paged KV cache takes q [B, H, N_q, d_k], k_cache [num_pages, H_kv, page, "
                         f"d_k] and v_cache [num_pages, H_kv, page, d_v], got {shapes}")
    table, lengths = (np.asarray(x) for x in (page_table, cache_seqlens))
    for name, x, ndim in (("page_table", table, 2), ("cache_seqlens", lengths, 1)):
        if x.dtype.kind not in "iu" or x.ndim != ndim or x.shape[0] != q.shape[0]:
            raise ValueError(f"{name} must be an integer array [B{', P' if ndim == 2 else ''}] with "
                             f"B = {q.shape[0]} (q's batch), got dtype {x.dtype} with shape {x.shape}")
    num_pages, page = k_cache.shape[0], k_cache.shape[2]
    bad = (lengths < 0) | (lengths > table.shape[1] * page)
    if bad.any():
        raise ValueError(f"cache_seqlens must be in [0, P * page] = [0, {table.shape[1] * page}], "
                         f"got {offenders('cache_seqlens', lengths, bad)}")
    used = np.arange(table.shape[1])[None, :] * page < lengths[:, None]        # [B, P] pages in use
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        raise ValueError(f"page_table's used entries must index k_cache's {num_pages} pages, "
                         f"got {offenders('page_table', table, bad)}")
    return PagedLayout(page_table=read_only_copy(table, np.int64),
                       cache_seqlens=read_only_copy(lengths, np.int64),
                       q_shape=q.shape, k_cache_shape=k_cache.shape, v_cache_shape=v_cache.shape)


def _key_rows(layout):
    """(pages, rows) [sum_b L_b]: where each packed key lives in the cache."""
    page = layout.k_cache_shape[2]
    t = np.concatenate([np.arange(n) for n in layout.cache_seqlens] + [np.zeros(0, np.int64)])
    b = np.repeat(np.arange(len(layout.cache_seqlens)), layout.cache_seqlens)
    return layout.page_table[b, t // page], t % page


def cu_seqlens(layout):
    """(cu_seqlens_q, cu_seqlens_k) [B + 1] of the packed problem."""
    batch, n_q = layout.q_shape[0], layout.q_shape[2]
    return np.arange(batch + 1) * n_q, np.concatenate([[0], np.cumsum(layout.cache_seqlens)])


def pack(q, k_cache, v_cache, layout):
    """q [H, B N_q, d_k] and the gathered keys k, v [H_kv, sum_b L_b, d] (fresh arrays)."""
    pages, rows = _key_rows(layout)
    gather = lambda cache: np.swapaxes(cache[pages, :, rows, :], 0, 1)        # [H_kv, sum L, d]
    return pack_rows(q), gather(k_cache), gather(v_cache)


def pack_rows(x):
    """[B, H, N_q, ...] -> [H, B N_q, ...] (q, out, dout; lse without the last axis)."""
    x = np.moveaxis(x, 0, 1)
    return x.reshape(x.shape[:1] + (x.shape[1] * x.shape[2],) + x.shape[3:])


def unpack_rows(x, layout):
    """[H, B N_q, ...] -> [B, H, N_q, ...], the inverse of pack_rows."""
    batch, n_q = layout.q_shape[0], layout.q_shape[2]
    return np.moveaxis(x.reshape(x.shape[:1] + (batch, n_q) + x.shape[2:]), 1, 0)


def scatter_keys(dk, shape, layout):
    """A packed keys' gradient [H_kv, sum_b L_b, d] summed back into its pages: [num_pages, H_kv, page, d]."""
    pages, rows = _key_rows(layout)
    grad = np.zeros(shape, dk.dtype)
    np.add.at(grad, (pages, slice(None), rows), np.swapaxes(dk, 0, 1))
    return grad
