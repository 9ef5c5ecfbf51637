"""softmax_forward / softmax_backward / softmax_jacobian / logsumexp."""
import numpy as np
import pytest
import scipy.special

import numpy_attention as na


def wrong_softmax_backward(dp, cache):
    """The classic bug: the row-sum term forgotten (dz = p * dp)."""
    return [cache.p * dp]


def test_forward_matches_scipy_and_rows_sum_to_one():
    z = 3 * np.random.default_rng(0).standard_normal((4, 5, 7))
    p, _ = na.softmax_forward(z)
    np.testing.assert_allclose(p, scipy.special.softmax(z, axis=-1), rtol=1e-14)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-15)


def test_the_two_line_softmax_is_softmax_forward_to_rounding():
    """plain_softmax (exp(z - max z) / sum) and softmax_forward agree within 2 ulps entry by
    entry, on ordinary, saturated, complex and partly masked rows; a fully masked row is NaN
    in the two lines (0 / 0), zeros in softmax_forward."""
    rng = np.random.default_rng(1)
    rows = [3 * rng.standard_normal((4, 5, 7)), np.array([[40.0, 3.0, -1.0, 2.0, 0.5], [1e4, -1e4, 0, 1, 2]]),
            rng.standard_normal((3, 6)) + 1j * 1e-20 * rng.standard_normal((3, 6)),
            np.where(rng.random((3, 6)) < 0.5, -np.inf, rng.standard_normal((3, 6)))]
    rows[3][:, 0] = 1.0
    for z in rows:
        plain, careful = na.plain_softmax(z), na.softmax_forward(z)[0]
        assert np.all(np.abs(plain - careful) <= 2 * np.finfo(float).eps * np.abs(careful)), z
    z = np.array([[-np.inf, -np.inf], [0.0, -np.inf]])
    with np.errstate(invalid="ignore"):
        assert np.isnan(na.plain_softmax(z)[0]).all() and np.array_equal(na.softmax_forward(z)[0][0], [0, 0])
    np.testing.assert_array_equal(na.plain_softmax(z[1:]), [[1.0, 0.0]])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("big", [1e4, 1e6, 1e30])
def test_stable_at_huge_logits(dtype, big):
    z = np.array([[big, -big, 0.0], [-big, -big, -big + 1]], dtype=dtype)
    p, cache = na.softmax_forward(z)
    assert p.dtype == dtype and np.isfinite(p).all()
    np.testing.assert_array_equal(p[0], [1, 0, 0])
    dp = np.ones_like(z) * np.array([1, 2, 3], dtype=dtype)
    dz = na.softmax_backward(dp, cache)
    z64 = z.astype(np.float64)                                    # the rounded logits, exactly
    p64 = scipy.special.softmax(z64, axis=-1)
    tol = {np.float32: 1e-6, np.float64: 1e-15}[dtype]
    np.testing.assert_allclose(p, p64, rtol=tol, atol=tol)
    np.testing.assert_allclose(dz, p64 * (dp - np.sum(p64 * dp, -1, keepdims=True)), rtol=tol, atol=tol)
    np.testing.assert_allclose(na.logsumexp(z), scipy.special.logsumexp(z64, axis=-1), rtol=tol)


def test_all_minus_inf_row_gives_zeros_and_minus_inf_lse():
    z = np.array([[-np.inf, -np.inf], [0.0, -np.inf]])
    p, cache = na.softmax_forward(z)
    np.testing.assert_array_equal(p, [[0, 0], [1, 0]])
    np.testing.assert_array_equal(na.logsumexp(z), [-np.inf, 0.0])
    np.testing.assert_array_equal(na.softmax_backward(np.ones_like(z), cache), 0)


def test_logsumexp_matches_scipy():
    z = 10 * np.random.default_rng(1).standard_normal((3, 6))
    np.testing.assert_allclose(na.logsumexp(z), scipy.special.logsumexp(z, axis=-1), rtol=1e-14)
    assert na.logsumexp(z, keepdims=True).shape == (3, 1)


def test_jacobian_times_vector_equals_vjp():
    rng = np.random.default_rng(2)
    z, dp = 2 * rng.standard_normal((3, 4, 6)), rng.standard_normal((3, 4, 6))
    p, cache = na.softmax_forward(z)
    J = na.softmax_jacobian(p)
    assert J.shape == (3, 4, 6, 6)
    np.testing.assert_allclose(J, np.swapaxes(J, -1, -2), rtol=0, atol=0)       # symmetric
    np.testing.assert_allclose((J @ dp[..., None])[..., 0], na.softmax_backward(dp, cache),
                               rtol=1e-13, atol=1e-15)


def test_jacobian_is_the_complex_step_jacobian():
    z = 2 * np.random.default_rng(3).standard_normal(5)
    p, _ = na.softmax_forward(z)
    h = 1e-20
    numeric = np.stack([np.imag(na.softmax_forward(z + 1j * h * e)[0]) / h for e in np.eye(5)], axis=1)
    np.testing.assert_allclose(na.softmax_jacobian(p), numeric, rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_backward_against_complex_step(scale):
    z = scale * np.random.default_rng(4).standard_normal((3, 6))
    report = na.gradcheck(na.softmax_forward, lambda d, c: [na.softmax_backward(d, c)], [z],
                          method="complex")
    assert report and report.rows[0].max_rel_err <= 1e-12, report


def test_forward_cache_knows_each_rows_largest_p():
    z = 3 * np.random.default_rng(6).standard_normal((4, 5, 7))
    p, cache = na.softmax_forward(z)
    assert cache.top.shape == (4, 5, 1)
    np.testing.assert_array_equal(cache.top[..., 0], np.argmax(p, axis=-1))
    dp = np.random.default_rng(7).standard_normal(z.shape)
    np.testing.assert_array_equal(na.softmax_backward(dp, cache),                 # searched for
                                  na.softmax_backward(dp, na.SoftmaxCache(p=cache.p)))  # when not given


def test_any_shift_index_gives_the_same_gradient_but_the_largest_p_keeps_it_exact():
    """J 1 = 0: the shift index cannot change dz; in a saturated row only the largest p's index
    keeps the vanishing top entry of dz relatively exact (the complex-step Jacobian is the truth)."""
    z = np.array([[40.0, 3.0, -1.0, 2.0, 0.5]])                 # p_top = 1 - 1e-16
    dp = np.array([[0.7, -1.3, 0.4, 2.1, -0.2]])
    p, cache = na.softmax_forward(z)
    h = 1e-20
    J = np.stack([np.imag(na.softmax_forward(z + 1j * h * e)[0])[0] / h for e in np.eye(5)], axis=-1)
    exact = J.T @ dp[0]                                          # ~1e-16 everywhere
    rel = lambda dz: np.abs(dz[0] - exact) / np.abs(exact)
    other = na.softmax_backward(dp, cache._replace(top=np.array([[1]])))
    assert rel(na.softmax_backward(dp, cache)).max() <= 1e-14
    assert rel(other)[0] > 0.1                                   # absolute error eps, relative O(1)
    np.testing.assert_allclose(other, na.softmax_backward(dp, cache), rtol=0, atol=1e-15)


@pytest.mark.parametrize("top", [np.zeros((3, 1)), np.zeros((3,), np.intp), np.zeros((2, 1), np.intp)])
def test_a_malformed_cache_top_is_refused(top):
    z = np.random.default_rng(8).standard_normal((3, 6))
    _, cache = na.softmax_forward(z)
    with pytest.raises(ValueError, match=r"cache.top must be integer indices of shape .*\(3, 1\)"):
        na.softmax_backward(np.ones_like(z), cache._replace(top=top))


@pytest.mark.parametrize("method", ["complex", "central"])
@pytest.mark.parametrize("mode", ["full", "projection"])
def test_wrong_backward_fails(method, mode):
    z = np.random.default_rng(5).standard_normal((3, 6))
    report = na.gradcheck(na.softmax_forward, wrong_softmax_backward, [z], method=method, mode=mode)
    assert not report
    assert report.rows[0].max_rel_err > 1e-2


def test_logsumexp_refuses_other_axes():
    with pytest.raises(ValueError, match="axis"):
        na.logsumexp(np.zeros((2, 3)), axis=None)
    with pytest.raises(ValueError, match="axis"):
        na.logsumexp(np.zeros((2, 3)), axis=0)
