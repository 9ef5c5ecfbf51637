"""linear_forward / linear_backward: Y = X W + b, any leading axes."""
import numpy as np
import pytest

import numpy_attention as na


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_forward_is_the_formula(lead):
    rng = np.random.default_rng(0)
    x, W, b = rng.standard_normal(lead + (4,)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    y, _ = na.linear_forward(x, W, b)
    assert y.shape == lead + (5,)
    np.testing.assert_allclose(y, np.einsum("...i,ij->...j", x, W) + b, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_backward_against_complex_step(lead, with_bias):
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(lead + (4,)), rng.standard_normal((4, 5))]
    if with_bias:
        inputs.append(rng.standard_normal(5))
    report = na.gradcheck(na.linear_forward, na.linear_backward, inputs, method="complex")
    assert report, report
    assert max(r.max_rel_err for r in report.rows) <= 1e-12


def test_backward_formulas_by_hand():
    rng = np.random.default_rng(2)
    x, W, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    y, cache = na.linear_forward(x, W, b)
    dy = rng.standard_normal(y.shape)
    dx, dW, db = na.linear_backward(dy, cache)
    np.testing.assert_allclose(dx, dy @ W.T, rtol=1e-14)
    np.testing.assert_allclose(dW, sum(x[i, j][:, None] * dy[i, j][None, :]
                                       for i in range(2) for j in range(3)), rtol=1e-13)
    np.testing.assert_allclose(db, dy.sum(axis=(0, 1)), rtol=1e-14)


def test_no_bias_gives_no_bias_gradient():
    rng = np.random.default_rng(3)
    y, cache = na.linear_forward(rng.standard_normal((3, 4)), rng.standard_normal((4, 2)))
    assert na.linear_backward(np.ones_like(y), cache)[2] is None


def test_central_differences_agree_to_their_accuracy():
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((3, 4)), rng.standard_normal((4, 2)), rng.standard_normal(2)]
    report = na.gradcheck(na.linear_forward, na.linear_backward, inputs, method="central")
    assert report, report
    assert max(r.max_rel_err for r in report.rows) < 1e-8


def test_zero_width_input():
    y, cache = na.linear_forward(np.zeros((3, 0)), np.zeros((0, 2)), np.ones(2))
    dx, dW, db = na.linear_backward(np.ones((3, 2)), cache)
    assert dx.shape == (3, 0) and dW.shape == (0, 2)
    np.testing.assert_array_equal(db, [3, 3])
