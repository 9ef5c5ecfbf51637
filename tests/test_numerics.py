"""Defined numerics at the edges (README, "Reliability"): huge logits, NaN and Inf inputs,
fully-masked rows, empty sequences and the dtype rule.

Shapes: B = 2 batch entries, H = 4 query heads sharing H_kv = 2 kv heads (G = 2: query head
h uses kv head h // 2), N_q = 5, N_k = 6, d_k = 3, d_v = 4.
"""
import numpy as np
import pytest

import numpy_attention as na

rng = np.random.default_rng(11)
B, H, H_KV, N_Q, N_K, D_K, D_V = 2, 4, 2, 5, 6, 3, 4
G = H // H_KV


def qkv(dtype=np.float64, n_q=N_Q, n_k=N_K):
    return (rng.standard_normal((B, H, n_q, D_K)).astype(dtype),
            rng.standard_normal((B, H_KV, n_k, D_K)).astype(dtype),
            rng.standard_normal((B, H_KV, n_k, D_V)).astype(dtype))


def forward_backward(q, k, v, dout, method="vjp", **options):
    out, cache = na.attention_forward(q, k, v, **options)
    return out, cache, na.attention_backward(dout, cache, method=method)


# ----------------------------------------------------------------------------- huge logits

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("magnitude", [1e4, 1e8, 1e15, 1e30])
@pytest.mark.parametrize("method, block_size", [("vjp", None), ("jacobian", None), ("flash", None),
                                                ("vjp", 2), ("flash", 2)])
def test_huge_logits_give_finite_outputs_and_gradients(dtype, magnitude, method, block_size):
    q, k, v = qkv(dtype)
    dout = rng.standard_normal((B, H, N_Q, D_V)).astype(dtype)
    bias = np.where(rng.random((N_Q, N_K)) < 0.5, -magnitude, magnitude).astype(dtype)
    for options in ({"scale": magnitude}, {"bias": bias}):          # logits of +-magnitude
        out, _, grads = forward_backward(q, k, v, dout, method, block_size=block_size, **options)
        for x in (out, grads.dq, grads.dk, grads.dv):
            assert x.dtype == dtype and np.isfinite(x).all()
        _, cache = na.attention_forward(q, k, v, **options)
        assert np.abs(cache.scores).max() >= magnitude / 10
        np.testing.assert_allclose(cache.weights.sum(-1), 1, rtol=0, atol=4 * np.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_of_huge_logits_is_exactly_one_hot(dtype):
    z = np.array([[1e4, -1e4, 0.0], [-1e30, 1e30, 1e29]], dtype)
    p, cache = na.softmax_forward(z)
    assert np.array_equal(p, np.array([[1, 0, 0], [0, 1, 0]], dtype))
    assert np.array_equal(na.logsumexp(z), np.array([1e4, 1e30], dtype))
    assert np.isfinite(na.softmax_backward(rng.standard_normal((2, 3)).astype(dtype), cache)).all()


# ----------------------------------------------------------------------------- NaN and Inf poison

def poisoned_regions(name, mask, b, g, j, c):
    """(reached, may_reach): where a NaN of input `name` at (b, kv head g, row j, column c)
    always reaches the output, and where any non-finite value there may reach it."""
    reached = np.zeros((B, H, N_Q, D_V), bool)
    heads = slice(g * G, (g + 1) * G)
    if name == "q":                                   # q[b, h=g, i=j]: that one output row
        reached[b, g, j, :] = True
    elif name == "k":                                 # k[b, g, j]: the rows of g's heads that attend j
        reached[b, heads] = mask[:, j][:, None]
    else:                                             # v[b, g, j, c]: column c of those rows ...
        reached[b, heads, :, c] = mask[:, j]
    may_reach = reached.copy()
    if name == "v":                                   # ... and maybe of the rest: 0 * NaN = NaN
        may_reach[b, heads, :, c] = True
    return reached, may_reach


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("block_size", [None, 2])
def test_a_non_finite_input_reaches_exactly_the_rows_it_touches(name, value, block_size):
    """NaN fills the rows it reaches; +-Inf may give NaN, Inf or a finite limit (+inf in q
    makes a one-hot row) there; every other output entry, and every gradient outside its
    batch entry and kv head, is bitwise what it is without it. Both paths (block_size)."""
    q, k, v = qkv()
    dout = rng.standard_normal((B, H, N_Q, D_V))
    mask = rng.random((N_Q, N_K)) < 0.6
    mask[:, 0] = True
    b, g, j, c = 1, 1, 2, 3                                     # for q, g is a query head
    clean_out, _, clean = forward_backward(q, k, v, dout, mask=mask, block_size=block_size)
    inputs = {"q": q, "k": k, "v": v}
    bad = inputs[name].copy()
    bad[b, g, j, c if name == "v" else 1] = value
    with np.errstate(invalid="ignore", over="ignore"):
        out, _, grads = forward_backward(**{**inputs, name: bad}, dout=dout, mask=mask,
                                         block_size=block_size)
    reached, may_reach = poisoned_regions(name, mask, b, g, j, c)
    assert np.array_equal(out[~may_reach], clean_out[~may_reach])
    if np.isnan(value):
        assert np.isnan(out[reached]).all()
    outside = np.ones((B, H_KV), bool)
    outside[b, g // G if name == "q" else g] = False            # other batch entries and kv heads
    heads_outside = np.repeat(outside, G, axis=1)
    assert np.array_equal(grads.dq[heads_outside], clean.dq[heads_outside])
    assert np.array_equal(grads.dk[outside], clean.dk[outside])
    assert np.array_equal(grads.dv[outside], clean.dv[outside])


def test_a_nan_in_bias_reaches_the_rows_it_broadcasts_onto_unless_masked():
    q, k, v = qkv()
    mask = np.ones((N_Q, N_K), bool)
    mask[3, 4] = False
    bias = np.zeros((N_Q, N_K))
    clean, _ = na.attention_forward(q, k, v, mask=mask, bias=bias)
    bias[1, 2] = bias[3, 4] = np.nan                            # (3, 4) is masked: harmless
    out, _ = na.attention_forward(q, k, v, mask=mask, bias=bias)
    assert np.isnan(out[:, :, 1]).all()
    rows = np.arange(N_Q) != 1
    assert np.array_equal(out[:, :, rows], clean[:, :, rows])


def test_nan_in_a_query_row_of_mha_poisons_that_output_row_only():
    m = na.MultiHeadAttention(8, 2, seed=0)
    query, key = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 8))
    clean, _ = m(query, key, key)
    query[1, 2, 5] = np.nan
    out, _ = m(query, key, key)
    assert np.isnan(out[1, 2]).all()
    others = np.ones((2, 3), bool)
    others[1, 2] = False
    assert np.array_equal(out[others], clean[others])


def test_check_finite_passes_clean_inputs_and_an_additive_mask_unchanged():
    q, k, v = qkv()
    bias = np.where(rng.random((N_Q, N_K)) < 0.3, -np.inf, 0.0)   # -inf in bias is a mask
    plain, _ = na.attention_forward(q, k, v, bias=bias)
    checked, _ = na.attention_forward(q, k, v, bias=bias, check_finite=True)
    assert np.array_equal(plain, checked)


# ----------------------------------------------------------------------------- fully-masked rows

DEAD_ROW = 2


def masked_runs(policy, method):
    """Row DEAD_ROW masked two ways: by the keep-mask and by a -inf additive bias."""
    q, k, v = qkv()
    dout = rng.standard_normal((B, H, N_Q, D_V))
    mask = np.ones((N_Q, N_K), bool)
    mask[DEAD_ROW] = False
    bias = np.where(mask, 0.0, -np.inf)
    for options in (dict(mask=mask), dict(bias=bias)):
        yield (q, k, v, dout, options,
               *forward_backward(q, k, v, dout, method, fully_masked=policy, **options))


@pytest.mark.parametrize("method", ["vjp", "jacobian", "flash"])
def test_fully_masked_rows_under_zero_give_zero_output_and_zero_finite_gradients(method):
    for q, k, v, dout, options, out, cache, grads in masked_runs("zero", method):
        assert np.all(out[:, :, DEAD_ROW] == 0) and np.all(cache.weights[:, :, DEAD_ROW] == 0)
        assert np.all(grads.dq[:, :, DEAD_ROW] == 0)
        for g in (grads.dq, grads.dk, grads.dv) + ((grads.dbias,) if grads.dbias is not None else ()):
            assert np.isfinite(g).all()
        # the dead row contributes nothing: dk, dv equal those without its upstream gradient
        quiet = dout.copy()
        quiet[:, :, DEAD_ROW] = 0
        again = na.attention_backward(quiet, cache, method=method)
        np.testing.assert_array_equal(grads.dk, again.dk)
        np.testing.assert_array_equal(grads.dv, again.dv)


def test_fully_masked_rows_under_zero_pass_the_complex_step_check():
    q, k, v = (x[:1, :2] for x in qkv())
    mask = np.ones((N_Q, N_K), bool)
    mask[DEAD_ROW] = False
    report = na.gradcheck(lambda q, k, v: na.attention_forward(q, k, v, mask=mask), na.attention_backward,
                          [q, k, v], method="complex", mode="projection", n_projections=4)
    assert report, str(report)


@pytest.mark.parametrize("method", ["vjp", "jacobian", "flash"])
def test_fully_masked_rows_under_uniform_average_v(method):
    for q, k, v, dout, options, out, cache, grads in masked_runs("uniform", method):
        expected = np.repeat(v.mean(axis=2), G, axis=1)           # [B, H, d_v]
        np.testing.assert_allclose(out[:, :, DEAD_ROW], expected, rtol=1e-14, atol=1e-15)
        assert np.all(grads.dq[:, :, DEAD_ROW] == 0)
        assert all(np.isfinite(g).all() for g in (grads.dq, grads.dk, grads.dv))


@pytest.mark.parametrize("method", ["vjp", "jacobian", "flash"])
def test_fully_masked_rows_under_nan_give_nan_rows_and_leave_the_others(method):
    for q, k, v, dout, options, out, cache, grads in masked_runs("nan", method):
        zero, _ = na.attention_forward(q, k, v, **options)
        assert np.isnan(out[:, :, DEAD_ROW]).all()
        live = np.arange(N_Q) != DEAD_ROW
        assert np.array_equal(out[:, :, live], zero[:, :, live])
        assert np.all(grads.dq[:, :, DEAD_ROW] == 0) and np.isfinite(grads.dq).all()
        assert np.isnan(grads.dv).all()                          # P^T dout sums the NaN row in


def test_causal_bottom_right_with_more_queries_than_keys_masks_the_first_rows():
    q, k, v = qkv(n_q=6, n_k=4)
    out, cache = na.attention_forward(q, k, v, causal="bottom_right")
    assert np.all(out[:, :, :2] == 0) and np.all(cache.weights[:, :, :2] == 0)
    np.testing.assert_allclose(cache.weights[:, :, 2:].sum(-1), 1, rtol=1e-15)


# ----------------------------------------------------------------------------- empty sequences

def test_no_queries_give_an_empty_output_and_zero_key_gradients():
    q, k, v = qkv(n_q=0)
    out, cache = na.attention_forward(q, k, v)
    assert out.shape == (B, H, 0, D_V)
    grads = na.attention_backward(np.zeros(out.shape), cache)
    assert grads.dq.shape == q.shape and np.all(grads.dk == 0) and np.all(grads.dv == 0)


def test_no_keys_make_every_row_fully_masked():
    """'zero' gives zeros; 'uniform' and 'nan' raise (tests/test_validation.py)."""
    q, k, v = qkv(n_k=0)
    out, cache = na.attention_forward(q, k, v)
    assert np.array_equal(out, np.zeros((B, H, N_Q, D_V)))
    grads = na.attention_backward(rng.standard_normal(out.shape), cache)
    assert np.all(grads.dq == 0) and grads.dk.shape == k.shape and grads.dv.shape == v.shape


def test_empty_batch_and_empty_value_width_work():
    q, k, v = (x[:0] for x in qkv())
    assert na.attention_forward(q, k, v)[0].shape == (0, H, N_Q, D_V)
    q, k, v = qkv()
    out, cache = na.attention_forward(q, k, v[..., :0])
    assert out.shape == (B, H, N_Q, 0)
    assert np.all(na.attention_backward(out, cache).dq == 0)


def test_empty_sequences_through_the_module_and_the_small_ops():
    m = na.MultiHeadAttention(8, 2)
    out, weights = m(np.ones((1, 0, 8)), np.ones((1, 3, 8)), np.ones((1, 3, 8)))
    assert out.shape == (1, 0, 8) and weights.shape == (1, 2, 0, 3)
    assert np.all(m.backward(out)["W_q.weight"] == 0)
    out, _ = m(np.ones((1, 2, 8)), np.ones((1, 0, 8)), np.ones((1, 0, 8)))   # no keys: attention 0
    assert np.array_equal(out, np.broadcast_to(m.params["W_o.bias"], (1, 2, 8)))
    p, cache = na.softmax_forward(np.ones((3, 0)))
    assert p.shape == (3, 0) and na.softmax_backward(p, cache).shape == (3, 0)
    assert np.all(na.logsumexp(np.ones((3, 0))) == -np.inf)


# ----------------------------------------------------------------------------- the dtype rule

@pytest.mark.parametrize("dtype, expected", [
    (np.float16, np.float32), (np.float32, np.float32), (np.float64, np.float64),
    (np.int32, np.float64), (np.int64, np.float64), (np.uint8, np.float64),
    (np.complex128, np.complex128)])
def test_dtype_rule(dtype, expected):
    q, k, v = (np.round(4 * x).astype(dtype) for x in qkv())
    out, cache = na.attention_forward(q, k, v)
    grads = na.attention_backward(np.ones(out.shape, dtype), cache)
    for x in (out, cache.q, cache.weights, grads.dq, grads.dk, grads.dv):
        assert x.dtype == expected
    for x in (na.linear_forward(q[0, 0], k[0, 0].T)[0], na.softmax_forward(q)[0], na.split_heads(q[0], 3),
              na.merge_heads(q)):
        assert x.dtype == expected


def test_mixed_dtypes_compute_in_the_wider_one():
    q, k, v = qkv()
    out, _ = na.attention_forward(q.astype(np.float32), k, v.astype(np.float16))
    assert out.dtype == np.float64
    out, _ = na.attention_forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                                  bias=np.zeros((N_Q, N_K)))
    assert out.dtype == np.float64                              # a float64 bias widens the scores


def test_float16_input_equals_float32_input_upcast():
    q, k, v = qkv(np.float16)
    out16, _ = na.attention_forward(q, k, v)
    out32, _ = na.attention_forward(*(x.astype(np.float32) for x in (q, k, v)))
    assert np.array_equal(out16, out32)


def test_module_dtype():
    m = na.MultiHeadAttention(8, 2, dtype=np.float32)
    x = np.arange(48).reshape(2, 3, 8)                          # integers: cast to the module's dtype
    out, weights = m(x, x, x)
    assert out.dtype == weights.dtype == np.float32
    assert all(g.dtype == np.float32 for g in m.backward(np.ones((2, 3, 8), np.float32)).values())


def test_bool_int_and_float_keep_masks_agree():
    q, k, v = qkv()
    keep = rng.random((N_Q, N_K)) < 0.6
    outs = [na.attention_forward(q, k, v, mask=m)[0] for m in (keep, keep.astype(int), keep * 1.0)]
    assert np.array_equal(outs[0], outs[1], equal_nan=True) and np.array_equal(outs[0], outs[2])
