"""attention_chunk, Llama 4's chunked attention as FlashAttention 3 defines it: a query row keeps
the keys of its diagonal's chunk. Against FlashAttention's own definition of the pairs, per
packed sequence, through crosscheck, in the tiled engine's skipped tiles; every engine against
the same mask as a mask_mod is in test_score_mods.py."""
import numpy as np
import pytest

import numpy_attention as na

RNG = np.random.default_rng(7)


def kept(n_q, n_k, chunk, **options):
    """The pairs attention_forward keeps: where its scores are finite, [N_q, N_k]."""
    q, k = RNG.standard_normal((1, n_q, 4)), RNG.standard_normal((1, n_k, 4))
    _, cache = na.attention_forward(q, k, k, attention_chunk=chunk, implementation="textbook", **options)
    return np.isfinite(cache.scores[0])


def flash_attention_3_chunk(n_q, n_k, chunk):
    """FlashAttention 3's chunk mask, written from its definition (hopper's construct_chunk_mask):
    row i's chunk starts at d - d mod chunk, d = i + N_k - N_q; it keeps [start, start + chunk)."""
    d = np.arange(n_q)[:, None] + n_k - n_q
    start = d - d % chunk
    j = np.arange(n_k)[None, :]
    return (j >= start) & (j < start + chunk)


@pytest.mark.parametrize("n_q, n_k, chunk", [(9, 9, 4), (5, 13, 4), (13, 5, 3), (7, 20, 1), (6, 6, 100)])
def test_the_pairs_are_flashattention_3s_with_the_bottom_right_diagonal(n_q, n_k, chunk):
    assert np.array_equal(kept(n_q, n_k, chunk, align="bottom_right"), flash_attention_3_chunk(n_q, n_k, chunk))
    llama4 = kept(n_q, n_k, chunk, causal="bottom_right")             # Llama 4: causal within chunks
    j, d = np.arange(n_k)[None, :], np.arange(n_q)[:, None] + n_k - n_q
    assert np.array_equal(llama4, flash_attention_3_chunk(n_q, n_k, chunk) & (j <= d))


def test_the_top_left_diagonal_counts_from_the_first_key():
    keep = kept(4, 10, 3)                                           # align top_left (the default)
    i, j = np.arange(4)[:, None], np.arange(10)[None, :]
    assert np.array_equal(keep, i // 3 == j // 3)


def test_chunks_restart_in_each_packed_sequence():
    """With cu_seqlens each sequence counts its own positions: the same as one call per sequence."""
    lengths = [5, 7, 3]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    q, k, v = (RNG.standard_normal((2, cu[-1], 4)) for _ in range(3))
    out, _ = na.attention_forward(q, k, v, attention_chunk=3, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    for start, stop in zip(cu[:-1], cu[1:]):
        alone, _ = na.attention_forward(q[:, start:stop], k[:, start:stop], v[:, start:stop],
                                        attention_chunk=3, causal=True)
        np.testing.assert_allclose(out[:, start:stop], alone, rtol=1e-14, atol=1e-15)


def test_the_tiled_engine_skips_the_tiles_outside_the_chunks(monkeypatch):
    from numpy_attention.engines import tiled
    calls, original = [], tiled.tile_scores
    def counted(*args):
        s, keep, saved = original(*args)
        calls.extend([] if keep is False else [1])
        return s, keep, saved
    monkeypatch.setattr(tiled, "tile_scores", counted)
    x = RNG.standard_normal((1, 1, 16, 4))
    out, cache = na.attention_forward(x, x, x, attention_chunk=8, block_size=4)
    assert len(calls) == 8                                  # two chunks of 2 x 2 tiles, of the 16
    calls.clear()
    na.attention_backward(np.ones_like(out), cache)
    assert len(calls) == 8


def test_crosscheck_reads_it_from_a_case_and_catches_a_kernel_without_it(tmp_path):
    q, k, v, dout = (RNG.standard_normal((1, 2, 12, 8)).astype(np.float32) for _ in range(4))
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    case = dict(q=q, k=k, v=v, dout=dout, causal=np.array(True), attention_chunk=np.array(4))
    results = {}
    for name, chunk in (("honest", 4), ("without", None)):
        out, cache = na.attention_forward(*wide[:3], causal=True, attention_chunk=chunk)
        g = na.attention_backward(wide[3], cache)
        results[name] = dict(out=out.astype(np.float32), dq=g.dq.astype(np.float32),
                             dk=g.dk.astype(np.float32), dv=g.dv.astype(np.float32))
    assert na.crosscheck(**case, **results["honest"])
    assert not na.crosscheck(**case, **results["without"])
    from numpy_attention.oracle import load_case, save_case
    save_case(tmp_path / "case.npz", **case, **results["honest"])
    assert na.crosscheck(**load_case(tmp_path / "case.npz"))


@pytest.mark.parametrize("chunk, error, words", [
    (0, ValueError, "attention_chunk must be a positive integer, got 0"),
    (2.5, TypeError, "attention_chunk must be a positive integer"),
    (True, TypeError, "attention_chunk must be a positive integer")])
def test_a_bad_chunk_is_refused_by_name(chunk, error, words):
    x = np.zeros((1, 3, 2))
    with pytest.raises(error, match=words):
        na.attention_forward(x, x, x, attention_chunk=chunk)


def test_an_unknown_keyword_is_a_type_error():
    x = np.zeros((1, 3, 2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'attention_chunks'"):
        na.attention_forward(x, x, x, attention_chunks=4)
