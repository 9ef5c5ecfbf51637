"""The tiled path (attention_forward(..., block_size=b)): the same numbers as the materialized
path for every option both support, O(N) cache, skipped blocks, clear errors for the rest."""
import numpy as np
import pytest

import numpy_attention as na
from numpy_attention import TiledAttentionCache

RTOL = 1e-12          # float64, normwise: max |tiled - materialized| / max |materialized|


def normwise(a, b):
    return np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-300)


def both_paths(shape_q, shape_kv, block_size, d_v=5, seed=0, **options):
    """(materialized (out, lse, grads), tiled (out, lse, grads)) on random inputs and dout."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal(shape_q), rng.standard_normal(shape_kv)
    v = rng.standard_normal(shape_kv[:-1] + (d_v,))
    results = []
    for b in (None, block_size):
        out, cache = na.attention_forward(q, k, v, block_size=b, **options)
        dout = np.random.default_rng(seed + 1).standard_normal(out.shape)
        results.append((out, cache.lse, na.attention_backward(dout, cache)))
    return results


def assert_same(materialized, tiled):
    (out_m, lse_m, g_m), (out_t, lse_t, g_t) = materialized, tiled
    assert out_t.shape == out_m.shape and out_t.dtype == out_m.dtype
    assert normwise(out_t, out_m) <= RTOL
    np.testing.assert_array_equal(np.isneginf(lse_t), np.isneginf(lse_m))
    finite = np.isfinite(lse_m)
    assert normwise(lse_t[finite], lse_m[finite]) <= RTOL
    for name in ("dq", "dk", "dv", "dbias"):
        a, b = getattr(g_t, name), getattr(g_m, name)
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape, name
        assert normwise(a, b) <= RTOL, name


MASK = np.random.default_rng(7).random((2, 1, 9, 13)) < 0.5
MASK[0, 0, 3] = False                                  # one fully masked row

CASES = {
    "plain, N multiple of b": ((2, 3, 8, 4), (2, 3, 8, 4), 4, {}),
    "N not a multiple of b": ((2, 3, 7, 4), (2, 3, 11, 4), 3, {}),
    "block larger than N": ((2, 3, 7, 4), (2, 3, 11, 4), 64, {}),
    "block size 1": ((1, 2, 5, 4), (1, 2, 6, 4), 1, {"causal": True}),
    "causal top_left, N_q < N_k": ((2, 3, 7, 4), (2, 3, 11, 4), 4, {"causal": True}),
    "causal top_left, N_q > N_k": ((2, 3, 11, 4), (2, 3, 7, 4), 4, {"causal": "top_left"}),
    "causal bottom_right, N_q < N_k": ((2, 3, 7, 4), (2, 3, 11, 4), 4, {"causal": "bottom_right"}),
    "causal bottom_right, N_q > N_k (dead rows)": ((2, 3, 11, 4), (2, 3, 7, 4), 3,
                                                   {"causal": True, "align": "bottom_right"}),
    "window": ((2, 3, 9, 4), (2, 3, 13, 4), 4, {"window": (2, 1)}),
    "window bottom_right": ((2, 3, 9, 4), (2, 3, 13, 4), 4, {"window": (3, 0), "align": "bottom_right"}),
    "mask with a dead row": ((2, 3, 9, 4), (2, 3, 13, 4), 4, {"mask": MASK}),
    "mask + causal": ((2, 3, 9, 4), (2, 3, 13, 4), 5, {"mask": MASK, "causal": True}),
    "GQA 4q/2kv heads, causal": ((2, 4, 9, 4), (2, 2, 13, 4), 5, {"causal": True}),
    "scale": ((2, 3, 9, 4), (2, 3, 13, 4), 4, {"scale": 1.0}),
    "two-axis input (one head)": ((9, 4), (13, 4), 4, {"causal": True}),
    "extra batch axes": ((2, 2, 2, 6, 4), (2, 2, 2, 7, 4), 3, {}),
}


@pytest.mark.parametrize("name", CASES)
def test_tiled_equals_materialized(name):
    shape_q, shape_kv, b, options = CASES[name]
    assert_same(*both_paths(shape_q, shape_kv, b, **options))


@pytest.mark.parametrize("bias_shape", [(2, 3, 9, 13), (3, 1, 13), (9, 13), (13,)])
def test_tiled_bias_and_its_gradient(bias_shape):
    bias = np.random.default_rng(3).standard_normal(bias_shape)
    assert_same(*both_paths((2, 3, 9, 4), (2, 3, 13, 4), 4, bias=bias, causal=True))


def test_row_constant_bias_gets_zero_gradient_on_both_paths():
    """softmax ignores a shift of a row: the exact dbias is 0, so both paths give rounding only
    (a relative comparison of two roundings would be meaningless)."""
    bias = np.random.default_rng(3).standard_normal((1, 9, 1))
    for out, _, g in both_paths((2, 3, 9, 4), (2, 3, 13, 4), 4, bias=bias, causal=True):
        assert g.dbias.shape == (1, 9, 1)
        assert np.max(np.abs(g.dbias)) <= 1e-13 * np.max(np.abs(g.dq))


def test_additive_minus_inf_bias_is_a_mask():
    bias = np.where(MASK, 0.0, -np.inf)
    assert_same(*both_paths((2, 3, 9, 4), (2, 3, 13, 4), 4, bias=bias))


def test_float32_stays_float32():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 9, 4)).astype(np.float32) for _ in range(3))
    out_m, _ = na.attention_forward(q, k, v, causal=True)
    out_t, cache = na.attention_forward(q, k, v, causal=True, block_size=4)
    g = na.attention_backward(np.ones_like(out_t), cache)
    assert out_t.dtype == np.float32 and cache.lse.dtype == np.float32 and g.dq.dtype == np.float32
    assert normwise(out_t, out_m) <= 1e-5


def test_cache_is_linear_in_n_and_exposes_out_and_lse():
    out, cache = na.attention_forward(*(np.ones((1, 2, 64, 4)) for _ in range(3)), block_size=16)
    assert isinstance(cache, TiledAttentionCache)
    np.testing.assert_array_equal(cache.out, out)
    assert cache.lse.shape == (1, 2, 64)
    sizes = [x.size for x in cache if isinstance(x, np.ndarray)]
    assert max(sizes) <= 2 * 64 * 4                       # nothing of size N_q * N_k


@pytest.mark.parametrize("causal", [{"causal": True}, {"mask_mod": lambda b, h, i, j: j <= i}],
                         ids=["option", "mask_mod"])
def test_causal_skips_blocks_above_the_diagonal(monkeypatch, causal):
    """Fully masked blocks are never computed, whether causal=True or a mask_mod removes them:
    count the score blocks formed."""
    from numpy_attention.engines import tiled
    calls = []
    original = tiled.tile_scores

    def counted(*args):
        s, keep, saved = original(*args)
        calls.extend([] if keep is False else [1])
        return s, keep, saved
    monkeypatch.setattr(tiled, "tile_scores", counted)
    x = np.random.default_rng(0).standard_normal((1, 1, 16, 4))
    out, cache = na.attention_forward(x, x, x, block_size=4, **causal)
    assert len(calls) == 10                                 # 4 + 3 + 2 + 1 of the 16 blocks
    calls.clear()
    na.attention_backward(np.ones_like(out), cache)
    assert len(calls) == 10


def test_complex_step_gradcheck_of_the_tiled_path():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 5, 3)), rng.standard_normal((1, 2, 7, 3)), rng.standard_normal((1, 2, 7, 2))
    forward = lambda q, k, v: na.attention_forward(q, k, v, causal=True, block_size=3)
    assert na.gradcheck(forward, na.attention_backward, [q, k, v], method="complex")


def test_does_not_write_into_its_arguments():
    rng = np.random.default_rng(0)
    q, k, v, bias = (rng.standard_normal((1, 2, 6, 6)) for _ in range(4))
    copies = [x.copy() for x in (q, k, v, bias)]
    out, cache = na.attention_forward(q, k, v, bias=bias, causal=True, block_size=4)
    dout = rng.standard_normal(out.shape)
    dout_copy = dout.copy()
    na.attention_backward(dout, cache)
    for x, c in zip((q, k, v, bias, dout), copies + [dout_copy]):
        np.testing.assert_array_equal(x, c)


@pytest.mark.parametrize("options, words", [
    ({"softcap": 2.0}, "softcap"),
    ({"dropout_mask": np.ones((1, 2, 4, 4), bool), "dropout_p": 0.1}, "dropout_mask"),
    ({"fully_masked": "uniform"}, "uniform"),
    ({"fully_masked": "nan"}, "nan"),
    ({"block_size": 0}, "block_size"),
])
def test_unsupported_options_raise(options, words):
    x = np.ones((1, 2, 4, 4))
    options = {"block_size": 2, **options}
    with pytest.raises(ValueError, match=words):
        na.attention_forward(x, x, x, **options)


def test_block_size_must_be_an_integer():
    x = np.ones((1, 2, 4, 4))
    with pytest.raises(TypeError, match="block_size"):
        na.attention_forward(x, x, x, block_size=2.5)


@pytest.mark.parametrize("kwargs, words", [({"method": "jacobian"}, "method"),
                                           ({"return_stages": True}, "return_stages")])
def test_backward_options_the_tiled_path_lacks_raise(kwargs, words):
    x = np.ones((1, 2, 4, 4))
    out, cache = na.attention_forward(x, x, x, block_size=2)
    with pytest.raises(ValueError, match=words):
        na.attention_backward(np.ones_like(out), cache, **kwargs)


def test_backward_checks_dout_shape():
    x = np.ones((1, 2, 4, 4))
    _, cache = na.attention_forward(x, x, x, block_size=2)
    with pytest.raises(ValueError, match=r"dout.*\(1, 2, 4, 4\)"):
        na.attention_backward(np.ones((1, 2, 4, 3)), cache)
