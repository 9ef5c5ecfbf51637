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


ENGINES = {"textbook": {"implementation": "textbook"}, "blocked": {"implementation": "blocked"},
           "blocked on threads": {"implementation": "blocked", "workers": 3},
           "tiled": {"implementation": "tiled", "block_size": 3},
           "tiled on threads": {"implementation": "tiled", "block_size": 4, "workers": 2}}


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


def every_option_case(seed):
    """q, k, v, dout, the lists (a key listed twice, a row with none, topk_length) and the
    options besides them: softcap, bias, ALiBi, sinks, a score_mod with a parameter, a mask_mod,
    rope and the bottom-right causal diagonal; the dense keep-mask and log-multiplicity bias
    the lists make."""
    rng = np.random.default_rng(seed)
    b, h, h_kv, n_q, n_k, d = 2, 4, 2, 7, 11, 8
    q, dout = rng.standard_normal((b, h, n_q, d)), rng.standard_normal((b, h, n_q, 6))
    k, v = rng.standard_normal((b, h_kv, n_k, d)), rng.standard_normal((b, h_kv, n_k, 6))
    indices = rng.integers(-1, 13, (b, h_kv, n_q, 5))
    indices[..., 0, :2] = 4
    indices[:, :, 3] = -1
    length = rng.integers(1, 6, (b, n_q))
    options = {"softcap": 3.0, "bias": rng.standard_normal((b, h, n_q, n_k)),
               "alibi_slopes": rng.uniform(0.1, 0.5, h), "sinks": rng.standard_normal(h),
               "score_mod": lambda s, b, h, i, j, p: s + p["rel"][h, i - j + n_k],
               "score_mod_params": {"rel": rng.standard_normal((h, n_q + n_k + 1))},
               "mask_mod": lambda b, h, i, j: (i + j) % 5 != 1, "rope": {}, "causal": "bottom_right"}
    found = dense_counts(indices, length, h, n_k)
    return (q, k, v, dout), (indices, length), options, found > 0, np.log(np.maximum(found, 1))


@pytest.mark.parametrize("engine", ["textbook", "blocked", "tiled"])
def test_the_lists_with_every_option_are_dense_attention_with_their_keep_mask(engine):
    """attention_forward / _backward / attention_jvp with topk_indices equal dense attention with
    the keep-mask the lists make (and log c on a key listed c times) to 1e-12, with softcap (not
    on the tiled engine, which has none), bias, ALiBi, sinks, score_mod, mask_mod and rope: out,
    lse, dq, dk, dv, dbias, dsinks, dalibi_slopes, the score_mod parameter's gradient; the
    tangents on the engines with a forward mode (textbook, tiled)."""
    (q, k, v, dout), (indices, length), options, keep, log_c = every_option_case(3)
    plan = {"implementation": engine, **({"block_size": 3} if engine == "tiled" else {})}
    if engine == "tiled":
        del options["softcap"]
    listed = dict(options, topk_indices=indices, topk_length=length)
    dense = dict(options, mask=keep, bias=options["bias"] + log_c)
    results = []
    for kwargs in (listed, dense):
        out, cache = na.attention_forward(q, k, v, **kwargs, **plan)
        grads = na.attention_backward(dout, cache)
        results.append([out, cache.lse, *grads[:3], grads.dbias, grads.dsinks, grads.dalibi_slopes,
                        grads.dscore_mod_params["rel"]])
    lse_empty = results[0][1][:, :, 3]                                 # the row with no key: the sink's
    assert np.array_equal(lse_empty, np.broadcast_to(options["sinks"], lse_empty.shape))
    for name, ours, theirs in zip(["out", "lse", "dq", "dk", "dv", "dbias", "dsinks", "dalibi_slopes", "drel"],
                                  *results):
        assert np.array_equal(np.isfinite(ours), np.isfinite(theirs)), name
        finite = np.isfinite(theirs)
        np.testing.assert_allclose(ours[finite], theirs[finite], rtol=0, atol=1e-12, err_msg=name)
    assert np.abs(results[0][5][~keep]).max() == 0                     # dbias: 0 off the lists
    if engine != "blocked":                                            # forward mode: textbook, tiled
        rng = np.random.default_rng(4)
        dots = [rng.standard_normal(x.shape) for x in (q, k, v)]
        more = {"bias_dot": rng.standard_normal(keep.shape), "sinks_dot": rng.standard_normal(4),
                "alibi_slopes_dot": rng.standard_normal(4)}
        jvps = [na.attention_jvp(q, k, v, *dots, **more, **kwargs, **plan) for kwargs in (listed, dense)]
        for name, ours, theirs in zip(["out", "out_dot", "lse", "lse_dot"], *jvps):
            finite = np.isfinite(theirs)
            assert np.array_equal(np.isfinite(ours), finite), name
            np.testing.assert_allclose(ours[finite], theirs[finite], rtol=0, atol=1e-12, err_msg=name)


def test_crosscheck_judges_a_top_k_case_with_every_option():
    """A float32 candidate of the lists with softcap, bias, a mask, ALiBi, sinks, score_mod, mask_mod
    and rope (our float64 results rounded) passes; the same with dq or dk 0.1% off fails, as do
    one that ignores topk_length, one that ignores the mask and one that ignores the bias."""
    (q, k, v, dout), (indices, length), options, _, _ = every_option_case(5)
    low = lambda x: x.astype(np.float32)
    mods = {name: options.pop(name) for name in ("score_mod", "score_mod_params", "mask_mod")}
    del options["rope"]
    options = {name: low(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}
    case = dict(q=low(q), k=low(k), v=low(v), dout=low(dout), topk_indices=indices, topk_length=length,
                rope_layout="half", mask=np.random.default_rng(6).random(q.shape[-2:-1] + k.shape[-2:-1]) > 0.2,
                **options)

    def candidate(without=(), **lists):
        wide = {name: x.astype(np.float64) if isinstance(x, np.ndarray) and x.dtype == np.float32 else x
                for name, x in case.items()
                if name not in ("rope_layout", "topk_indices", "topk_length", "dout") + without}
        out, cache = na.attention_forward(**wide, **lists, rope={}, **mods)
        grads = na.attention_backward(case["dout"].astype(np.float64), cache)
        return {name: low(x) for name, x in dict(out=out, lse=cache.lse, dq=grads.dq, dk=grads.dk, dv=grads.dv,
                                                  dbias=grads.dbias, dsinks=grads.dsinks,
                                                  dalibi_slopes=grads.dalibi_slopes).items() if x is not None}

    honest = candidate(topk_indices=indices, topk_length=length)
    report = na.crosscheck(**case, **honest, **mods)
    assert report, report
    for name in ("dq", "dk"):
        off = dict(honest, **{name: honest[name] * np.float32(1.001)})
        report = na.crosscheck(**case, **off, **mods)
        assert not report and [row.name for row in report.rows if not row.passed] == [name], report
    assert not na.crosscheck(**case, **candidate(topk_indices=indices), **mods)
    for option in ("mask", "bias"):                                    # one that ignores the mask, the bias
        ignored = candidate((option,), topk_indices=indices, topk_length=length)
        assert not na.crosscheck(**case, **{**ignored, "dbias": honest["dbias"]}, **mods)
