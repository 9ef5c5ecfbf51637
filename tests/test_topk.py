"""Top-k lists (topk.py) as a step of the score pipeline: the counts of any block of the scores
(a tile, a block of rows, heads with a stride, a single head's [N_q, N_k]) are those of the
dense count of the lists there, and attention_forward(topk_indices=...) on each engine gives
sparse attention's results (which tests/test_sparse.py holds to torch's)."""
import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.topk import counts, topk_lists

RNG = np.random.default_rng(41)


def dense_counts(tokens, length, heads, n_k):
    """[..., H, N_q, N_k]: how many times each query's list names each key, one entry at a time."""
    valid = (tokens >= 0) & (tokens < n_k)
    if length is not None:
        valid &= np.arange(tokens.shape[-1]) < length[..., None, :, None]
    found = np.zeros(tokens.shape[:-1] + (n_k,), np.int64)
    np.add.at(found, np.nonzero(valid)[:-1] + (tokens[valid].astype(np.int64),), 1)
    return np.repeat(found, heads // found.shape[-3], axis=-3)


BLOCKS = {
    "all": (Ellipsis, slice(None), slice(None)),
    "a tile": (Ellipsis, slice(2, 7), slice(3, 11)),
    "one batch index and kv head's queries": (slice(1, 2), slice(2, 4), slice(0, 9), slice(5, 6)),
    "every other head (the naive baseline's)": (Ellipsis, slice(1, None, 2), slice(4, 9), slice(None)),
    "columns with a stride": (Ellipsis, slice(0, 3), slice(1, 12, 3)),
    "no row": (Ellipsis, slice(5, 5), slice(None)),
    "no column": (Ellipsis, slice(None), slice(4, 4)),
}


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("lists", ["per kv head", "per query head, topk_length"])
def test_a_blocks_counts_are_the_dense_counts_there(lists, block):
    heads = 2 if lists == "per kv head" else 4
    indices = RNG.integers(-2, 16, (2, heads, 9, 7))                  # -2, -1, 13-15 pad; repeats
    length = RNG.integers(0, 8, (2, 9)) if "topk_length" in lists else None
    score_shape = (2, 4, 9, 13)
    found = counts(topk_lists(indices, length, (2, 4, 9, 8), (2, 2, 13, 8)), score_shape, BLOCKS[block])
    want = dense_counts(indices, length, 4, 13)[BLOCKS[block]]
    assert found.shape == want.shape and np.array_equal(found, want)


def test_a_single_heads_lists_count_into_its_n_q_by_n_k_scores():
    indices = RNG.integers(-1, 6, (5, 4))
    lists = topk_lists(indices, None, (5, 3), (6, 3))
    want = dense_counts(indices[None], None, 1, 6)[0]
    assert np.array_equal(counts(lists, (5, 6)), want)
    assert np.array_equal(counts(lists, (5, 6), (slice(1, 4), slice(2, 5))), want[1:4, 2:5])
    assert lists.repeats == bool((want > 1).any())


def test_the_lists_are_the_records_own():
    """Writing into the caller's lists after the forward leaves its backward unchanged; the
    record's keys are read-only."""
    q, k, v = (RNG.standard_normal(shape) for shape in [(1, 2, 4, 8), (1, 1, 6, 8), (1, 1, 6, 8)])
    dout = RNG.standard_normal(q.shape)
    indices = RNG.integers(0, 6, (1, 1, 4, 3))
    kept = indices.copy()
    _, cache = na.attention_forward(q, k, v, topk_indices=indices, implementation="tiled")
    indices[...] = 0
    _, fresh = na.attention_forward(q, k, v, topk_indices=kept, implementation="tiled")
    assert not cache.options.topk.keys.flags.writeable
    for a, b in zip(na.attention_backward(dout, cache)[:3], na.attention_backward(dout, fresh)[:3]):
        assert np.array_equal(a, b)


ENGINES = {"textbook": {"implementation": "textbook"}, "blocked": {}, "blocked on threads": {"workers": 3},
           "tiled": {"block_size": 3}, "tiled on threads": {"block_size": 4, "workers": 2}}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("lists", ["per kv head, repeats", "per query head, topk_length"])
def test_attention_forward_over_the_lists_is_sparse_attention(engine, lists):
    """out, lse, dq, dk, dv and the forward-mode tangents (textbook and tiled) equal
    sparse_attention_forward's (gathering the keys) to rounding; rows with no key too."""
    q, dout = RNG.standard_normal((2, 4, 7, 8)), RNG.standard_normal((2, 4, 7, 6))
    k, v = RNG.standard_normal((2, 2, 11, 8)), RNG.standard_normal((2, 2, 11, 6))
    heads = 2 if "kv head" in lists else 4
    indices = RNG.integers(-1, 13, (2, heads, 7, 5))
    indices[..., 0, :2] = 4                                            # a key listed twice
    indices[:, :, 3] = -1                                              # a row with no key
    length = RNG.integers(0, 6, (2, 7)) if "topk_length" in lists else None
    out, cache = na.attention_forward(q, k, v, topk_indices=indices, topk_length=length, **ENGINES[engine])
    grads = na.attention_backward(dout, cache)
    s_out, s_lse, _, s_cache = na.sparse_attention_forward(q, k, v, indices, topk_length=length)
    s_grads = na.sparse_attention_backward(dout, s_cache)
    assert np.isneginf(cache.lse[:, :, 3]).all() and np.array_equal(np.isneginf(cache.lse), np.isneginf(s_lse))
    finite = np.isfinite(s_lse)
    np.testing.assert_allclose(cache.lse[finite], s_lse[finite], rtol=0, atol=1e-13)
    for ours, theirs in [(out, s_out), *zip(grads[:3], s_grads)]:
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-13)
    if "workers" not in ENGINES[engine] and engine != "blocked":      # forward mode: textbook, tiled
        dots = [RNG.standard_normal(x.shape) for x in (q, k, v)]
        jvp = na.attention_jvp(q, k, v, *dots, topk_indices=indices, topk_length=length, **ENGINES[engine])
        s_jvp = na.sparse_attention_jvp(q, k, v, indices, *dots, topk_length=length)
        np.testing.assert_allclose(jvp[1], s_jvp[1], rtol=0, atol=1e-13)
        np.testing.assert_allclose(jvp[3], s_jvp[3], rtol=0, atol=1e-13)


def test_bad_lists_are_refused_by_name():
    q = RNG.standard_normal((1, 2, 3, 8))
    with pytest.raises(ValueError, match="topk_length counts entries of topk_indices: pass topk_indices too"):
        na.attention_forward(q, q, q, topk_length=np.array([[1, 1, 1]]))
    with pytest.raises(ValueError, match=r"topk_indices must be \[\.\.\., H_kv or H, N_q, K\] = \[\.\.\., 2 or 2, 3, K\]"):
        na.attention_forward(q, q, q, topk_indices=np.zeros((1, 3, 3, 2), int))
    with pytest.raises(TypeError, match="topk_indices must be integers, got dtype float64"):
        na.attention_forward(q, q, q, topk_indices=np.zeros((1, 2, 3, 2)))
    with pytest.raises(ValueError, match=r"topk_length must be integers \[\.\.\., N_q\] = \(1, 3\)"):
        na.attention_forward(q, q, q, topk_indices=np.zeros((1, 2, 3, 2), int), topk_length=np.zeros(3, int))
    with pytest.raises(ValueError, match="takes no mask, bias, cu_seqlens, seqused_k or topk_indices"):
        na.attention_forward(q[:, :1], q[None, 0, :1, :2].repeat(2, 0), q[None, 0, :1, :2].repeat(2, 0),
                             page_table=np.array([[0]]), cache_seqlens=np.array([2]),
                             topk_indices=np.zeros((1, 1, 3, 2), int))
