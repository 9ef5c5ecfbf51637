"""The sparse engine (engines/sparse.py): attention_forward(topk_indices=...) gathers each query's
listed keys and runs the whole score pipeline on them. Held to dense attention with the lists'
keep-mask (the blocked engine, and the textbook's forward mode) for every option, forward,
backward (every parameter's gradient) and JVP, to 1e-12; a repeated key against attention over
the keys with that key copied; the plan's choices and refusals."""
import numpy as np
import pytest

import numpy_attention as na

B, H_KV, G, N_Q, N_K, D, K = 2, 2, 2, 7, 13, 6, 6
H = H_KV * G


def inputs(seed=0, per_query_head=False, n_q=N_Q, n_k=N_K, lead=(B,)):
    """q, k, v, dout, lists with -1 and out-of-range padding, a key listed twice and a row with no key."""
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal(lead + (H, n_q, D)) for _ in range(2))
    k, v = (rng.standard_normal(lead + (H_KV, n_k, D)) for _ in range(2))
    lists = rng.integers(-1, n_k + 2, lead + (H if per_query_head else H_KV, n_q, K))
    lists[..., 0, :2] = 3                                             # key 3 listed twice
    lists[..., 1, :] = -1                                             # a row with no key
    return q, k, v, dout, lists


RNG = np.random.default_rng(7)
# name -> (options, tangents of the options for the JVP)
OPTIONS = {
    "plain": ({}, {}),
    "lists per query head": ({"per_query_head": True}, {}),
    "topk_length": ({"topk_length": RNG.integers(0, K + 1, (B, N_Q))}, {}),
    "scale, softcap": ({"scale": 0.7, "softcap": 1.5}, {}),
    "bias [H, N_q, N_k]": ({"bias": RNG.standard_normal((H, N_Q, N_K))}, {"bias_dot": RNG.standard_normal((H, N_Q, N_K))}),
    "bias [B, 1, 1, N_k] with -inf": ({"bias": np.where(RNG.random((B, 1, 1, N_K)) < 0.2, -np.inf,
                                                        RNG.standard_normal((B, 1, 1, N_K)))}, {}),
    "ALiBi": ({"alibi_slopes": RNG.random(H)}, {"alibi_slopes_dot": RNG.standard_normal(H)}),
    "sinks": ({"sinks": RNG.standard_normal(H)}, {"sinks_dot": RNG.standard_normal(H)}),
    "causal": ({"causal": True}, {}),
    "bottom_right, window": ({"causal": "bottom_right", "window": (3, 1)}, {}),
    "attention_chunk": ({"causal": True, "attention_chunk": 4}, {}),
    "mask": ({"mask": RNG.random((B, 1, N_Q, N_K)) < 0.7}, {}),
    "dropout": ({"dropout_mask": RNG.random((B, H, N_Q, N_K)) < 0.8, "dropout_p": 0.2}, {}),
    "score_mod with a parameter": ({"score_mod": lambda s, b, h, i, j, p: s * p["w"][h] + 0.05 * (i - j),
                                    "score_mod_params": {"w": RNG.random(H) + 0.5}}, {}),
    "mask_mod": ({"mask_mod": lambda b, h, i, j: (i + j + h) % 3 != 0}, {}),
    "rope": ({"rope": {"layout": "half"}}, {}),
    "uniform": ({"fully_masked": "uniform"}, {}),
    "uniform, dropout": ({"fully_masked": "uniform", "dropout_mask": RNG.random((B, H, N_Q, N_K)) < 0.8,
                          "dropout_p": 0.2}, {}),
    "nan": ({"fully_masked": "nan"}, {}),
    "all of them": ({"softcap": 2.0, "bias": RNG.standard_normal((1, H, N_Q, N_K)), "alibi_slopes": RNG.random(H),
                     "sinks": RNG.standard_normal(H), "causal": "bottom_right",
                     "score_mod": lambda s, b, h, i, j: s + 0.1 * np.sin(s),
                     "mask_mod": lambda b, h, i, j: j != 5, "rope": {"layout": "interleaved"}},
                    {"bias_dot": RNG.standard_normal((1, H, N_Q, N_K)), "alibi_slopes_dot": RNG.standard_normal(H),
                     "sinks_dot": RNG.standard_normal(H)}),
}
GRADS = ("dq", "dk", "dv", "dbias", "dsinks", "dalibi_slopes")


def close(ours, theirs, what):
    """Equal to 1e-12, NaN where theirs is NaN."""
    assert ours.shape == theirs.shape, what
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12, err_msg=what)


@pytest.mark.parametrize("name", OPTIONS)
def test_the_sparse_engine_is_dense_attention_over_the_lists_keep_mask(name):
    options, tangents = OPTIONS[name]
    options = dict(options)
    q, k, v, dout, lists = inputs(per_query_head=options.pop("per_query_head", False))
    rng = np.random.default_rng(1)
    dlse = rng.standard_normal(q.shape[:-1])
    out, cache = na.attention_forward(q, k, v, topk_indices=lists, block_size=3, **options)
    dense_out, dense_cache = na.attention_forward(q, k, v, topk_indices=lists, implementation="blocked", **options)
    assert cache.plan.implementation == "sparse" and cache.plan.block_size == 3
    close(out, dense_out, "out")
    close(cache.lse, dense_cache.lse, "lse")
    grads = na.attention_backward(dout, cache, dlse if name != "nan" else None)
    dense = na.attention_backward(dout, dense_cache, dlse if name != "nan" else None)
    for field in GRADS:
        ours, theirs = getattr(grads, field), getattr(dense, field)
        assert (ours is None) == (theirs is None), field
        if ours is not None:
            close(ours, theirs, field)
    for param, g in (dense.dscore_mod_params or {}).items():
        close(grads.dscore_mod_params[param], g, param)
    dots = [rng.standard_normal(x.shape) for x in (q, k, v)]
    jvp = na.attention_jvp(q, k, v, *dots, topk_indices=lists, **tangents, **options)
    dense_jvp = na.attention_jvp(q, k, v, *dots, topk_indices=lists, implementation="textbook", **tangents,
                                 **options)
    for what, ours, theirs in zip(("out", "out_dot", "lse", "lse_dot"), jvp, dense_jvp):
        close(ours, theirs, what)


def test_packed_sequences_and_per_sequence_slopes():
    """cu_seqlens (with an empty sequence and seqused_k), ALiBi slopes [B, H] per sequence, causal."""
    rng = np.random.default_rng(2)
    cu_q, cu_k = np.array([0, 3, 3, 8]), np.array([0, 5, 9, 14])
    q, dout = (rng.standard_normal((H, 8, D)) for _ in range(2))
    k, v = (rng.standard_normal((H_KV, 14, D)) for _ in range(2))
    lists = rng.integers(-1, 14, (H_KV, 8, K))
    options = dict(topk_indices=lists, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=np.array([4, 4, 5]),
                   causal="bottom_right", alibi_slopes=rng.random((3, H)))
    out, cache = na.attention_forward(q, k, v, **options)
    dense_out, dense_cache = na.attention_forward(q, k, v, implementation="blocked", **options)
    close(out, dense_out, "out")
    grads, dense = na.attention_backward(dout, cache), na.attention_backward(dout, dense_cache)
    for field in ("dq", "dk", "dv", "dalibi_slopes"):
        close(getattr(grads, field), getattr(dense, field), field)


def test_the_bits_do_not_depend_on_the_workers_and_leading_axes_keep_their_shapes():
    q, k, v, dout, lists = inputs(lead=(2, 3), seed=3)
    options = dict(topk_indices=lists, bias=np.random.default_rng(4).standard_normal((3, H, 1, N_K)),
                   sinks=np.linspace(-1, 1, H), causal=True)
    results = []
    for workers in (1, 2):
        out, cache = na.attention_forward(q, k, v, block_size=2, workers=workers, **options)
        grads = na.attention_backward(dout, cache)
        results.append([out, cache.lse, cache.max_logits, grads.dq, grads.dk, grads.dv, grads.dbias, grads.dsinks])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    assert results[0][0].shape == q.shape and results[0][6].shape == (3, H, 1, N_K)


@pytest.mark.parametrize("engine", ["textbook", "blocked", "tiled", "sparse"])
def test_a_repeated_key_is_that_key_gathered_twice_on_every_engine(engine):
    """Lists with repeated keys equal attention over K copies of the keys, entry t of row i keeping
    key L_t of copy t: a key listed twice is two columns, gathered twice. With a score_mod that is
    not a shift (the repeat's weight must not pass through it), softcap (not on tiled), bias and
    ALiBi (the reference's as a bias: key j's distance in every copy); out and every gradient."""
    rng = np.random.default_rng(5)
    q, dout = (rng.standard_normal((1, 2, 4, D)) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, 6, D)) for _ in range(2))
    lists = np.array([[[[3, 3, 1, 0], [2, 5, -1, 7], [3, 3, 3, 4], [0, 1, 2, 3]]]])
    bias, slopes = rng.standard_normal((2, 4, 6)), np.array([0.3, 0.1])
    options = dict(softcap=None if engine == "tiled" else 3.0, score_mod=lambda s, b, h, i, j: 1.3 * s + np.sin(s))
    out, cache = na.attention_forward(q, k, v, topk_indices=lists, bias=bias, alibi_slopes=slopes,
                                      implementation=engine, **options)
    grads = na.attention_backward(dout, cache)
    copies = lists.shape[-1]                                          # column t * N_k + j: key j of copy t
    keep = np.zeros((1, 2, 4, copies * 6), bool)
    for i, t in np.ndindex(4, copies):
        if 0 <= lists[0, 0, i, t] < 6:
            keep[..., i, t * 6 + lists[0, 0, i, t]] = True
    alibi = -slopes[:, None, None] * np.abs(np.arange(4)[:, None] + 2 - np.arange(6)[None, :])
    tile = lambda x: np.concatenate([x] * copies, axis=-1)
    ref_out, ref_cache = na.attention_forward(q, np.concatenate([k] * copies, axis=-2), np.concatenate([v] * copies, axis=-2),
                                              mask=keep, bias=tile(bias + alibi), implementation="textbook", **options)
    ref = na.attention_backward(dout, ref_cache)
    close(out, ref_out, "out")
    close(cache.lse, ref_cache.lse, "lse")
    by_key = lambda x: x.reshape(x.shape[:-2] + (copies, 6) + x.shape[-1:]).sum(axis=-3)    # [.., copies*6, d]
    close(grads.dq, ref.dq, "dq")
    close(grads.dk, by_key(ref.dk), "dk")
    close(grads.dv, by_key(ref.dv), "dv")
    close(grads.dbias, ref.dbias.reshape(2, 4, copies, 6).sum(axis=2), "dbias")


def test_complex_inputs_keep_nan_in_both_parts_of_a_row_with_no_key():
    """A complex-step check reads NaN's imaginary part: a row with no key under 'nan' is nan+nanj on
    the sparse engine as on the dense ones (out, its tangent, dv)."""
    q, k, v, dout, lists = inputs(seed=4)
    q = q + 1e-30j
    sparse = na.attention_forward(q, k, v, topk_indices=lists, fully_masked="nan")
    dense = na.attention_forward(q, k, v, topk_indices=lists, fully_masked="nan", implementation="blocked")
    assert np.isnan(sparse[0][:, :, 1].imag).all() and np.isnan(dense[0][:, :, 1].imag).all()
    assert np.isnan(na.attention_backward(dout, sparse[1]).dv.imag).all()
    jvp = na.attention_jvp(q, k, v, *(np.ones(x.shape) for x in (q, k, v)), topk_indices=lists, fully_masked="nan")
    assert np.isnan(jvp[1][:, :, 1].imag).all() and np.isnan(jvp[3][:, :, 1].imag).all()


def test_memory_holds_no_row_of_all_keys_and_one_copy_of_what_is_shared():
    """Peaks (tracemalloc) of cases where a careless engine forms [N_q, N_k] or copies per slice:
    'uniform' rows without a key (each such row's weights only, not every row's); a bias
    [N_q, N_k] broadcast over 4 x 8 (batch, kv head) slices (one gradient of it, not 32); lists
    per kv head for 16 query heads (its keys gathered once, not 16 times)."""
    import tracemalloc
    rng = np.random.default_rng(6)

    def peak(call):
        tracemalloc.start()
        call()
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return top
    n = 3000
    q, k, v = (rng.standard_normal((1, 1, n, 8)) for _ in range(3))
    lists = rng.integers(0, n, (1, 1, n, 2))
    lists[..., 7, :] = -1
    out, cache = na.attention_forward(q, k, v, topk_indices=lists, fully_masked="uniform")
    assert peak(lambda: na.attention_backward(out, cache)) < n * n * 8 / 8            # an eighth of [N_q, N_k]
    q, k, v = (rng.standard_normal((4, 8, 400, 8)) for _ in range(3))
    bias = rng.standard_normal((400, 400))
    out, cache = na.attention_forward(q, k, v, topk_indices=rng.integers(0, 400, (4, 8, 400, 4)), bias=bias,
                                      workers=1)
    assert peak(lambda: na.attention_backward(out, cache)) < 8 * bias.nbytes                 # (32 copies: 32)
    q = rng.standard_normal((1, 16, 256, 64))
    k, v = (rng.standard_normal((1, 1, 2048, 64)) for _ in range(2))
    listed = rng.integers(0, 2048, (1, 1, 256, 64))
    gathered = 256 * 64 * 64 * 8                                                        # one kv head's k_L
    assert peak(lambda: na.attention_forward(q, k, v, topk_indices=listed, workers=1)) < 6 * gathered


def test_the_module_with_lists_runs_a_dense_engine_for_its_weights():
    """multihead_forward returns the weights [B, H, N_q, N_k], which the sparse engine never forms:
    with topk_indices it runs the blocked engine (the textbook's results), and refuses 'sparse'."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 5, 8))
    params = {**{f"W_{n}.weight": rng.standard_normal((8, 8)) for n in "qkvo"},
              **{f"W_{n}.bias": rng.standard_normal(8) for n in "qkvo"}}
    lists = rng.integers(-1, 5, (2, 2, 5, 3))
    out, weights, _ = na.multihead_forward(x, x, x, params, 2, topk_indices=lists)
    ref, ref_weights, _ = na.multihead_forward(x, x, x, params, 2, topk_indices=lists, implementation="textbook")
    close(out, ref, "out")
    close(weights, ref_weights, "weights")
    with pytest.raises(ValueError, match="the tiled and sparse engines .* never form"):
        na.multihead_forward(x, x, x, params, 2, topk_indices=lists, implementation="sparse")


def test_the_plan_chooses_and_refuses():
    q, k, v, dout, lists = inputs()
    assert na.attention_forward(q, k, v, topk_indices=lists)[1].plan.block_size == 2 ** 15 // K
    assert na.attention_forward(q, k, v, topk_indices=lists, block_size=4)[1].plan.implementation == "sparse"
    with pytest.raises(ValueError, match="implementation='sparse' attends to each query's listed keys: it needs "
                                         "topk_indices"):
        na.attention_forward(q, k, v, implementation="sparse")
    _, cache = na.attention_forward(q, k, v, topk_indices=lists)
    for bad in ({"return_stages": True}, {"method": "jacobian"}):
        with pytest.raises(ValueError, match="which the sparse engine never forms"):
            na.attention_backward(dout, cache, **bad)
    with pytest.raises(ValueError, match="this runs on the textbook engine, not implementation='sparse'"):
        na.attention_hvp(q, k, v, dout, topk_indices=lists, implementation="sparse")
