"""Full-mode gradcheck evaluated in stacked chunks (batched) gives the numbers of the
one-at-a-time evaluation, falls back for functions that do not broadcast over a new
leading axis, and still catches a wrong backward."""
import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.selfcheck import attention_case, cases


def rows_equal(a, b):
    """Every number of two reports, row by row (batched vs unbatched must agree to rounding)."""
    assert bool(a) == bool(b)
    for ra, rb in zip(a.rows, b.rows, strict=True):
        assert ra.name == rb.name and ra.passed == rb.passed
        np.testing.assert_allclose([ra.max_abs_err, ra.analytic, ra.numeric, ra.tol],
                                   [rb.max_abs_err, rb.analytic, rb.numeric, rb.tol], rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize("method", ["central", "complex", "richardson"])
@pytest.mark.parametrize("name", ["attention", "attention bias", "causal bottom_right",
                                  "GQA 4q/2kv heads", "softmax", "dropout"])
def test_batched_equals_unbatched(name, method):
    forward, backward, inputs, names = cases(np.random.default_rng(0))[name]
    looped = na.gradcheck(forward, backward, inputs, method=method, names=names, batched=False)
    stacked = na.gradcheck(forward, backward, inputs, method=method, names=names, batched=True)
    rows_equal(stacked, looped)
    assert stacked


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_chunk_size_does_not_change_the_numbers(chunk_size):
    forward, backward, inputs, names = attention_case(np.random.default_rng(1), causal=True)
    reference = na.gradcheck(forward, backward, inputs, batched=False)
    rows_equal(na.gradcheck(forward, backward, inputs, batched=True, chunk_size=chunk_size), reference)


def test_the_whole_jacobian_matches_the_loop():
    """Not just the summary: the Jacobians themselves, entry by entry."""
    from numpy_attention.gradcheck import _full_jacobians
    forward, backward, inputs, _ = attention_case(np.random.default_rng(2), mask=None, causal=True)
    names, wrt = ["q", "k", "v"], [0, 1, 2]
    loop = _full_jacobians(forward, backward, inputs, wrt, names, "central", 1e-6, False, None,
                           np.random.default_rng(0))
    stacked = _full_jacobians(forward, backward, inputs, wrt, names, "central", 1e-6, True, 5,
                              np.random.default_rng(0))
    for i in wrt:
        np.testing.assert_allclose(stacked[i][0], loop[i][0], rtol=0, atol=1e-14)   # analytic
        np.testing.assert_allclose(stacked[i][1], loop[i][1], rtol=0, atol=1e-9)    # numeric (h = 1e-6)


def rank_checking_forward(x):
    """A forward that does not broadcast: it insists on 2 axes."""
    if np.ndim(x) != 2:
        raise ValueError(f"x must be 2-d, got {np.shape(x)}")
    return np.tanh(x) @ np.arange(1.0, 1 + x.shape[1]), x


def rank_checking_backward(dout, x):
    return [(1 - np.tanh(x) ** 2) * np.outer(dout, np.arange(1.0, 1 + x.shape[1]))]


def mixing_forward(x):
    """Broadcasts without error but mixes the leading axis: stacked numbers would be wrong."""
    y = np.sin(x)
    return y - y.mean(axis=0, keepdims=True), x


def mixing_backward(dout, x):
    g = dout - dout.mean(axis=0, keepdims=True)
    return [np.cos(x) * g]


@pytest.mark.parametrize("forward, backward", [(rank_checking_forward, rank_checking_backward),
                                               (mixing_forward, mixing_backward)])
def test_auto_falls_back_for_functions_that_do_not_broadcast(forward, backward):
    x = np.random.default_rng(0).standard_normal((3, 4))
    auto = na.gradcheck(forward, backward, [x])
    rows_equal(auto, na.gradcheck(forward, backward, [x], batched=False))
    assert auto


@pytest.mark.parametrize("forward, backward, words", [
    (rank_checking_forward, rank_checking_backward, "fail on inputs stacked"),
    (mixing_forward, mixing_backward, "different numbers")])
def test_batched_true_refuses_functions_that_do_not_broadcast(forward, backward, words):
    x = np.random.default_rng(0).standard_normal((3, 4))
    with pytest.raises(ValueError, match=words):
        na.gradcheck(forward, backward, [x], batched=True)


def test_batched_still_catches_a_wrong_backward():
    forward, backward, inputs, names = attention_case(np.random.default_rng(3), causal=True)

    def wrong(dout, cache):
        dq, dk, dv, *rest = backward(dout, cache)
        return [dq, dk * 1.001, dv, *rest]
    for batched in (True, False):
        report = na.gradcheck(forward, wrong, inputs, names=names, batched=batched)
        assert [row.passed for row in report.rows] == [True, False, True]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_chunk_size_is_checked(bad):
    forward, backward, inputs, _ = attention_case(np.random.default_rng(0))
    with pytest.raises(ValueError, match="chunk_size"):
        na.gradcheck(forward, backward, inputs, chunk_size=bad)


def test_batched_is_checked():
    forward, backward, inputs, _ = attention_case(np.random.default_rng(0))
    with pytest.raises(TypeError, match="batched"):
        na.gradcheck(forward, backward, inputs, batched="yes")


def test_auto_mode_falls_back_when_a_real_chunk_trips_the_forward():
    """A bias of lower rank than q with B = 2: the two-entry probe broadcasts by chance, a chunk
    of another size does not; auto mode must fall back to one-at-a-time, not raise."""
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 3))
    bias = rng.standard_normal((2, 3, 5))                              # [H, N_q, N_k]
    forward = lambda q, k, v: na.attention_forward(q, k, v, bias=bias)
    auto = na.gradcheck(forward, na.attention_backward, [q, k, v], method="complex")
    looped = na.gradcheck(forward, na.attention_backward, [q, k, v], method="complex", batched=False)
    assert auto and [r.max_abs_err for r in auto.rows] == [r.max_abs_err for r in looped.rows]


@pytest.mark.parametrize("batched", [True, False])
def test_one_analytic_pass_serves_every_checked_input(batched):
    """A backward returns every input's gradient, so the analytic Jacobians of q, k and v cost
    the backward calls of one input, not three."""
    forward, backward, inputs, names = attention_case(np.random.default_rng(6), causal=True)
    calls = []

    def counting_backward(dout, cache):
        calls.append(np.shape(dout))
        return backward(dout, cache)
    per_wrt = {}
    for wrt in ([0], [0, 1, 2]):
        calls.clear()
        assert na.gradcheck(forward, counting_backward, inputs, wrt=wrt, batched=batched)
        per_wrt[len(wrt)] = list(calls)
    assert per_wrt[3] == per_wrt[1] and per_wrt[1]
