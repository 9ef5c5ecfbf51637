"""A conformance case's arrays laid out otherwise, for the properties (properties.py): the same
sequences packed in another order, alone, or with one of them emptied; a paged cache's pages
moved, or cut to another size; the cache rows no sequence reads. Each takes the arrays a case
draws (grid.py: crosscheck's keys) and returns new ones (the case's own are never written).

    reversed_sequences(arrays), renumbered(arrays)   -> (arrays, back: their results -> the drawn layout's)
    repaged(arrays, page)                     -> (arrays in pages of `page` rows, None)
    sequence_alone(arrays, results, b)        -> (sequence b's arrays as a pack of one, its results' rows)
    emptied(arrays)                           -> a pack with sequence 0's queries and sequence 1's keys removed
    unread_rows(arrays)                       -> [pages, page] bool
"""
import numpy as np

from ..oracle.schema import ROWS


def sequence_alone(arrays, results, b):
    """(packed sequence b's arrays alone, as a pack of one, and its rows of the pack's results)."""
    cu_q, cu_k = arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]
    q_rows, k_rows = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
    alone = dict(arrays, cu_seqlens_q=np.array([0, q_rows.stop - q_rows.start], cu_q.dtype),
                 cu_seqlens_k=np.array([0, k_rows.stop - k_rows.start], cu_k.dtype))
    for name, rows in (("q", q_rows), ("dout", q_rows), ("k", k_rows), ("v", k_rows)):
        if name in arrays:
            alone[name] = arrays[name][:, rows]
    mine = {name: x[..., q_rows] if name in ROWS else x[:, k_rows if name in ("dk", "dv") else q_rows]
            for name, x in results.items()}
    return alone, mine


def emptied(arrays):
    """A packed case's arrays with sequence 0's queries and sequence 1's keys removed."""
    arrays = dict(arrays)
    cu_q, cu_k = arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]
    cut = lambda x, cu, b: np.concatenate([x[..., :cu[b], :], x[..., cu[b + 1]:, :]], axis=-2)
    for name in ("q", "dout"):
        if name in arrays:
            arrays[name] = cut(arrays[name], cu_q, 0)
    arrays["k"], arrays["v"] = cut(arrays["k"], cu_k, 1), cut(arrays["v"], cu_k, 1)
    lengths = lambda cu, b: np.where(np.arange(len(cu) - 1) == b, 0, np.diff(cu))
    arrays["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(lengths(cu_q, 0))]).astype(cu_q.dtype)
    arrays["cu_seqlens_k"] = np.concatenate([[0], np.cumsum(lengths(cu_k, 1))]).astype(cu_k.dtype)
    return arrays


def reversed_sequences(arrays):
    """(a packed case's arrays with its sequences in reverse order, a function that puts results of
    those back in the drawn order)."""
    cu_q, cu_k = arrays["cu_seqlens_q"], arrays["cu_seqlens_k"]
    order = range(len(cu_q) - 2, -1, -1)
    rows = lambda cu, seq: np.concatenate([np.arange(cu[b], cu[b + 1]) for b in seq]).astype(np.intp)
    q_rows, k_rows = rows(cu_q, order), rows(cu_k, order)
    cumulative = lambda cu: np.concatenate([[0], np.cumsum(np.diff(cu)[::-1])]).astype(cu.dtype)
    other = {**arrays, "cu_seqlens_q": cumulative(cu_q), "cu_seqlens_k": cumulative(cu_k)}
    for name, at in (("q", q_rows), ("dout", q_rows), ("k", k_rows), ("v", k_rows)):
        if name in arrays:
            other[name] = arrays[name][:, at]
    back_q, back_k = np.argsort(q_rows), np.argsort(k_rows)

    def back(results):                             # rows along N: out, dq, lse by query; dk, dv by key
        return {name: np.take(x, back_k if name in ("dk", "dv") else back_q, axis=-1 if name in ROWS else -2)
                for name, x in results.items()}
    return other, back


def renumbered(arrays):
    """(a paged case's arrays with its pages moved to other places of the pool, page_table
    renumbered to match; the results' dk, dv pages moved back)."""
    pages = arrays["k"].shape[0]
    place = np.roll(np.arange(pages), pages // 2 + 1)[::-1]      # page p goes to place[p]
    other = dict(arrays, page_table=place[arrays["page_table"]].astype(arrays["page_table"].dtype))
    for name in ("k", "v"):
        moved = np.empty_like(arrays[name])
        moved[place] = arrays[name]
        other[name] = moved
    back = lambda results: {name: x[place] if name in ("dk", "dv") else x for name, x in results.items()}
    return other, back


def repaged(arrays, page):
    """(a paged case's arrays repacked in pages of `page` rows, each sequence's pages in order after
    the others'; None: its dk, dv are of other pages, not compared)."""
    table, lengths = arrays["page_table"], arrays["cache_seqlens"]
    per = -(-int(lengths.max(initial=1)) // page)
    other = dict(arrays, page_table=np.arange(len(lengths) * per).reshape(len(lengths), per).astype(table.dtype))
    for name in ("k", "v"):
        x = arrays[name]
        tokens = [np.concatenate([x[p] for p in row], axis=-2)[:, :per * page] for row in table]   # [H_kv, P old, d]
        tokens = [np.concatenate([t, np.zeros(t.shape[:1] + (per * page - t.shape[1],) + t.shape[2:], x.dtype)],
                                 axis=-2) for t in tokens]
        other[name] = np.concatenate([t.reshape(t.shape[0], per, page, t.shape[-1]).swapaxes(0, 1) for t in tokens])
    return other, None


def unread_rows(arrays):
    """[pages, rows a page] bool: the paged cache's rows that no sequence's first cache_seqlens reads."""
    pages, _, page, _ = arrays["k"].shape
    read = np.zeros((pages, page), bool)
    for table, length in zip(arrays["page_table"], arrays["cache_seqlens"]):
        for j in range(int(length)):
            read[table[j // page], j % page] = True
    return ~read
