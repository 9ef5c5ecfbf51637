"""Hostile input: no crash, no silent wrong answer, a clear ValueError / TypeError naming the
argument (the repros of the reliability review, each failing before its fix)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.softmax import SoftmaxCache


def test_an_empty_query_block_never_touches_memory_it_does_not_own():
    """N_q = 0 with N_k > 0: the softmax backward once wrote into an empty einsum result
    (complex long double aborted the process under malloc checking)."""
    code = ("import numpy as np, numpy_attention as na\n"
            "q = np.zeros((1, 2, 0, 3), np.clongdouble); k = np.ones((1, 2, 4, 3), np.clongdouble)\n"
            "for _ in range(2000):\n"
            "    out, c = na.attention_forward(q, k, k)\n"
            "    g = na.attention_backward(out, c)\n"
            "assert g.dq.shape == (1, 2, 0, 3) and not g.dk.any()\n")
    env = {**os.environ, "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-500:]


@pytest.mark.parametrize("window", [(-1, sys.maxsize), (2 ** 63, 2 ** 64), (np.uint64(2 ** 63), -1),
                                    (sys.maxsize, sys.maxsize)])
@pytest.mark.parametrize("implementation", ["textbook", "blocked", "tiled"])
def test_a_window_wider_than_any_sequence_is_unbounded(window, implementation):
    q = np.random.default_rng(0).standard_normal((1, 2, 4, 3))
    wide = na.attention_forward(q, q, q, window=window, implementation=implementation)[0]
    np.testing.assert_array_equal(wide, na.attention_forward(q, q, q, implementation=implementation)[0])


@pytest.mark.parametrize("call", [
    lambda q: na.attention_forward(q, q, q, scale=10 ** 400),
    lambda q: na.attention_forward(q, q, q, softcap=10 ** 400),
    lambda q: na.gradcheck(lambda x: (x, None), lambda d, c: [d], [q], eps=10 ** 400),
    lambda q: na.taylor_test(lambda x: (x, None), lambda d, c: [d], [q], h0=10 ** 400),
    lambda q: na.crosscheck(q=q, k=q, v=q, out=q, atol=10 ** 400),
    lambda q: na.crosscheck(q=q, k=q, v=q, out=q, k_factors={"out": 10 ** 400}),
])
def test_huge_python_integers_are_a_value_error(call):
    with pytest.raises(ValueError, match="an integer of 401 digits"):
        call(np.ones((1, 2, 3)))


def test_ragged_lists_and_caches_built_by_hand_get_errors_that_name_them():
    q = np.ones((1, 2, 3))
    out, cache = na.attention_forward(q, q, q)
    with pytest.raises(TypeError, match="dout must be a numeric array .* a ragged nested list"):
        na.attention_backward([[[1, 2, 3], [1, 2]]], cache)
    with pytest.raises(TypeError, match="dy must be a numeric array"):
        na.linear_backward([[1], [1, 2]], na.linear_forward(np.ones((2, 2)), np.ones((2, 2)))[1])
    with pytest.raises(TypeError, match="dp must be a numeric array"):
        na.softmax_backward([[1], [1, 2]], na.softmax_forward(np.ones((2, 2)))[1])
    np.testing.assert_array_equal(na.softmax_backward(np.ones((1, 2)), SoftmaxCache(p=[[0.5, 0.5]])), 0)
    with pytest.raises(TypeError, match="cache.p must be a numeric"):
        na.softmax_backward(np.ones((1, 2)), SoftmaxCache(p=None))
    with pytest.raises(TypeError, match="its weights is NoneType, not an array"):
        na.attention_backward(out, cache._replace(weights=None))


@pytest.mark.parametrize("implementation", ["textbook", "blocked", "tiled"])
def test_a_scale_beyond_float32_still_computes_in_float32(implementation):
    """q = 1e-20 and scale = 1e39: scale q k^T = 3e19 fits in float32, the scale alone does not."""
    q, k = np.full((1, 2, 3), 1e-20, np.float32), np.ones((1, 2, 3), np.float32)
    out, cache = na.attention_forward(q, k, k, scale=1e39, implementation=implementation)
    grads = na.attention_backward(np.ones_like(out), cache)
    assert out.dtype == np.float32 and np.isfinite(out).all() and np.isfinite(grads.dq).all()
    np.testing.assert_allclose(cache.lse, 3e19 + np.log(2), rtol=1e-6)
