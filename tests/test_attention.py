"""attention_forward / attention_backward: the core formula, every backward by complex step,
the fully-masked-row policies, the cache, edge shapes and dtypes."""
import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.gradcheck_cases import attention_case, cases


def naive_attention(q, k, v, keep=None, scale=None):
    """softmax(scale q k^T) v one row at a time, for [B, H, N, d] arrays (H_kv = H)."""
    B, H, n_q, d_k = q.shape
    scale = 1 / np.sqrt(d_k) if scale is None else scale
    out = np.zeros((B, H, n_q, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for i in range(n_q):
                s = np.array([scale * q[b, h, i] @ k[b, h, j] for j in range(k.shape[2])])
                if keep is not None:
                    s = np.where(keep[b, h, i], s, -np.inf)
                w = np.exp(s - s.max())
                out[b, h, i] = (w / w.sum()) @ v[b, h]
    return out


def test_forward_is_the_formula_row_by_row():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((2, 3, 6, 2))
    keep = rng.random((2, 3, 4, 6)) < 0.6
    keep[..., 0] = True
    for mask in (None, keep):
        out, _ = na.attention_forward(q, k, v, mask=mask)
        np.testing.assert_allclose(out, naive_attention(q, k, v, mask), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("name", [n for n in cases(np.random.default_rng(0))])
def test_every_backward_against_complex_step(name):
    forward, backward, inputs, names = cases(np.random.default_rng(7))[name]
    report = na.gradcheck(forward, backward, inputs, method="complex", names=names)
    assert report, report
    # W_k.bias has an exactly zero gradient (softmax ignores a per-row shift): only rounding
    # remains there, so its relative error is meaningless; the verdict above still covers it
    worst = max(r.max_rel_err for r in report.rows if r.name != "W_k.bias")
    assert worst <= 1e-12, report


@pytest.mark.parametrize("name", ["attention", "attention bias", "GQA 4q/2kv heads", "softcap"])
def test_central_differences_agree_to_their_accuracy(name):
    forward, backward, inputs, names = cases(np.random.default_rng(8))[name]
    report = na.gradcheck(forward, backward, inputs, method="central", names=names)
    assert report, report
    assert max(r.max_rel_err for r in report.rows) < 1e-7


def test_saturated_regime_gradients_are_tiny_and_still_exact():
    """scale=1 with d_k=256: logits of std 16; the gradient vanishes but stays exact."""
    forward, backward, inputs, _ = attention_case(np.random.default_rng(9), (1, 2, 4, 256),
                                                  (1, 2, 8, 256), scale=1.0)
    report = na.gradcheck(forward, backward, inputs, method="complex", mode="projection")
    assert report and max(r.max_rel_err for r in report.rows) <= 1e-12, report


def test_wrong_softmax_backward_inside_attention_is_caught():
    """Attention whose softmax step forgets the row-sum term: gradcheck must fail on q and k."""
    def wrong_backward(dout, cache):
        p = cache.weights
        dp = dout @ np.swapaxes(cache.v, -1, -2)
        ds = p * dp                                              # the bug
        return [cache.options.scale * ds @ cache.k, cache.options.scale * np.swapaxes(ds, -1, -2) @ cache.q,
                np.swapaxes(p, -1, -2) @ dout]
    forward, _, inputs, names = attention_case(np.random.default_rng(10))
    report = na.gradcheck(forward, wrong_backward, inputs, method="complex", names=names)
    assert [r.passed for r in report.rows] == [False, False, True] and not report


def test_cache_exposes_scores_weights_lse_and_top():
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 5, 4))
    out, cache = na.attention_forward(q, k, v, causal=True)
    S = q @ np.swapaxes(k, -1, -2) / 2.0
    S = np.where(np.tril(np.ones((3, 5), bool)), S, -np.inf)
    np.testing.assert_allclose(cache.scores, S, rtol=1e-14)
    np.testing.assert_allclose(cache.lse, na.logsumexp(S), rtol=1e-14)
    np.testing.assert_array_equal(cache.top, np.argmax(S, axis=-1))
    np.testing.assert_array_equal(cache.top, np.argmax(cache.weights, axis=-1))
    np.testing.assert_allclose(cache.weights, np.exp(S - cache.lse[..., None]), rtol=1e-13)
    np.testing.assert_allclose(out, cache.weights @ v, rtol=1e-14)


def test_causal_alignments_with_unequal_lengths():
    rng = np.random.default_rng(12)
    q, k, v = rng.standard_normal((2, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 3))
    _, top = na.attention_forward(q, k, v, causal="top_left")
    _, bottom = na.attention_forward(q, k, v, causal=True, align="bottom_right")
    np.testing.assert_array_equal(np.isfinite(top.scores), [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(np.isfinite(bottom.scores), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])


def fully_masked_setup():
    rng = np.random.default_rng(13)
    q, k, v = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 5, 3))
    keep = np.ones((1, 2, 3, 5), bool)
    keep[0, 1, 2] = False                                        # head 1, query 2: nothing to attend
    return q, k, v, keep, rng.standard_normal((1, 2, 3, 3))


def test_fully_masked_zero_policy_gives_zero_output_and_finite_zero_gradients():
    q, k, v, keep, dout = fully_masked_setup()
    out, cache = na.attention_forward(q, k, v, mask=keep)
    np.testing.assert_array_equal(out[0, 1, 2], 0)
    np.testing.assert_array_equal(cache.weights[0, 1, 2], 0)
    assert np.isneginf(cache.lse[0, 1, 2])
    g = na.attention_backward(dout, cache)
    assert all(np.isfinite(x).all() for x in g[:3])
    np.testing.assert_array_equal(g.dq[0, 1, 2], 0)
    assert na.gradcheck(lambda q, k, v: na.attention_forward(q, k, v, mask=keep),
                        na.attention_backward, [q, k, v], method="complex")


def test_fully_masked_uniform_policy_is_the_seeds_minus_1e9_fill():
    q, k, v, keep, dout = fully_masked_setup()
    out, cache = na.attention_forward(q, k, v, mask=keep, fully_masked="uniform")
    S = np.where(keep, q @ np.swapaxes(k, -1, -2) / 2.0, -1e9)    # the seed's masked_fill
    P = np.exp(S - S.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, P @ v, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(out[0, 1, 2], v[0, 1].mean(0), rtol=1e-14)
    g = na.attention_backward(dout, cache)
    np.testing.assert_array_equal(g.dq[0, 1, 2], 0)              # the row is a constant of q and k
    assert na.gradcheck(lambda q, k, v: na.attention_forward(q, k, v, mask=keep, fully_masked="uniform"),
                        na.attention_backward, [q, k, v], method="complex")


def test_fully_masked_nan_policy_gives_nan_rows_only():
    q, k, v, keep, _ = fully_masked_setup()
    out, _ = na.attention_forward(q, k, v, mask=keep, fully_masked="nan")
    assert np.isnan(out[0, 1, 2]).all()
    assert np.isfinite(np.delete(out.reshape(-1, 3), 5, axis=0)).all()


@pytest.mark.parametrize("shape_q,shape_kv", [
    ((1, 1, 1, 1), (1, 1, 1, 1)),          # N = 1, H = 1, B = 1, d = 1
    ((1, 1, 7, 3), (1, 1, 1, 3)),          # one key
    ((3, 1, 1, 5), (3, 1, 9, 5)),          # one query
    ((2, 3, 5, 7), (2, 3, 11, 7)),         # odd sizes
    ((5, 3), (4, 3)),                      # no batch or head axis
    ((2, 2, 2, 3, 4), (2, 2, 2, 6, 4)),    # two batch axes
])
def test_edge_shapes(shape_q, shape_kv):
    forward, backward, inputs, names = attention_case(np.random.default_rng(14), shape_q, shape_kv, d_v=2)
    out, _ = forward(*inputs)
    assert out.shape == shape_q[:-1] + (2,)
    report = na.gradcheck(forward, backward, inputs, method="complex", names=names)
    assert report and max(r.max_rel_err for r in report.rows) <= 1e-12, report


@pytest.mark.parametrize("dtype,expected", [(np.float32, np.float32), (np.float64, np.float64),
                                            (np.float16, np.float32), (np.int64, np.float64)])
def test_dtype_rule(dtype, expected):
    rng = np.random.default_rng(15)
    q, k, v = ((3 * rng.standard_normal((2, 3, 4))).astype(dtype) for _ in range(3))
    out, cache = na.attention_forward(q, k, v)
    assert out.dtype == expected
    g = na.attention_backward(np.ones(out.shape, dtype=expected), cache)
    assert g.dq.dtype == g.dk.dtype == g.dv.dtype == expected
    ref, _ = na.attention_forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    tol = 1e-5 if expected == np.float32 else 0.0          # float16 and int64 inputs are exact in float32 / 64
    np.testing.assert_allclose(out, ref, rtol=tol or 1e-14, atol=tol)


def test_three_backward_methods_agree():
    forward, _, inputs, _ = attention_case(np.random.default_rng(16), bias=(1, 2, 3, 5), causal=True)
    out, cache = forward(*inputs)
    dout = np.random.default_rng(17).standard_normal(out.shape)
    ref = na.attention_backward(dout, cache)
    for method in ("jacobian", "flash"):
        g = na.attention_backward(dout, cache, method=method)
        for a, b in zip(g[:4], ref[:4]):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14 * np.abs(b).max())


def test_dropout_keeps_float32():
    rng = np.random.default_rng(18)
    q = rng.standard_normal((2, 3, 4)).astype(np.float32)
    out, cache = na.attention_forward(q, q, q, dropout_mask=rng.random((2, 3, 3)) < 0.8, dropout_p=0.2)
    g = na.attention_backward(np.ones_like(out), cache)
    assert out.dtype == g.dq.dtype == g.dk.dtype == g.dv.dtype == np.float32


def test_multihead_refuses_the_tiled_path_clearly():
    mha = na.MultiHeadAttention(8, 2)
    x = np.zeros((1, 3, 8))
    with pytest.raises(ValueError, match="block_size"):
        mha(x, x, x, block_size=2)


@pytest.mark.parametrize("window, align", [((2, 1), "top_left"), ((2, 1), "bottom_right"),
                                           ((0, -1), "top_left"), ((-1, 0), "bottom_right")])
def test_window_keeps_exactly_its_band(window, align):
    """Row i attends to key j iff d - left <= j <= d + right, d = i (top_left) or i + N_k - N_q
    (bottom_right), -1 unbounded: written out entry by entry, and read back from P > 0."""
    rng = np.random.default_rng(16)
    n_q, n_k = 4, 7
    q, k, v = rng.standard_normal((n_q, 3)), rng.standard_normal((n_k, 3)), rng.standard_normal((n_k, 2))
    _, cache = na.attention_forward(q, k, v, window=window, align=align)
    left, right = window
    shift = n_k - n_q if align == "bottom_right" else 0
    band = np.array([[(left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)
                      for j in range(n_k)] for i in range(n_q)])
    np.testing.assert_array_equal(cache.weights > 0, band)
