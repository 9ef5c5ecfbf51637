"""Full-mode gradcheck evaluated in stacked chunks (batched) gives the numbers of the
one-at-a-time evaluation, falls back for functions that do not broadcast over a new
leading axis, and still catches a wrong backward."""
import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.gradcheck_cases import attention_case, cases
from numpy_attention.finite_differences.jacobians import full_jacobians

FELL_BACK = ": it takes no stack along a new leading axis (batched=True shows why); the same numbers, only slower"
FELL_BACK_BOTH = FELL_BACK.replace("it takes", "they take")


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
    forward, backward, inputs, _ = attention_case(np.random.default_rng(2), mask=None, causal=True)
    names, wrt = ["q", "k", "v"], [0, 1, 2]
    loop, loop_batching = full_jacobians(forward, backward, inputs, wrt, names, "central", 1e-6, False,
                                         None, np.random.default_rng(0))
    stacked, stacked_batching = full_jacobians(forward, backward, inputs, wrt, names, "central", 1e-6,
                                               True, 5, np.random.default_rng(0))
    assert (loop_batching, stacked_batching) == ("looped", "vectorized")
    for i in wrt:
        np.testing.assert_allclose(stacked[i].analytic, loop[i].analytic, rtol=0, atol=1e-14)
        np.testing.assert_allclose(stacked[i].numeric, loop[i].numeric, rtol=0, atol=1e-9)   # h = 1e-6


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


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_chunk_size_is_checked(bad, error):
    """A wrong value is a ValueError, a wrong kind of object (not an integer) a TypeError."""
    forward, backward, inputs, _ = attention_case(np.random.default_rng(0))
    with pytest.raises(error, match="chunk_size"):
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


@pytest.mark.parametrize("forward, backward", [(rank_checking_forward, rank_checking_backward),
                                               (mixing_forward, mixing_backward)])
def test_a_fallback_says_it_once_for_both_functions(forward, backward):
    """Whether the stacked call raised or gave other numbers, the forward and the backward fell
    back: said once, in one sentence, under the header."""
    x = np.random.default_rng(0).standard_normal((3, 4))
    report = na.gradcheck(forward, backward, [x])
    assert report.batching == ("the forward took one perturbed input at a time, the backward one upstream "
                               "gradient" + FELL_BACK_BOTH)
    assert " ".join(str(report).splitlines()[1:3]) == f"note: {report.batching}"


def test_a_fallback_of_one_function_names_it():
    """A forward that broadcasts and a backward that refuses a stacked dout (a ValueError)."""
    def unstacked_backward(dp, cache):
        if np.ndim(dp) > 2:
            raise ValueError(f"dp must be [N, n], got {np.shape(dp)}")
        return [na.softmax_backward(dp, cache)]
    z = np.random.default_rng(11).standard_normal((3, 5))
    report = na.gradcheck(na.softmax_forward, unstacked_backward, [z], names=["z"])
    assert report and report.batching == "the backward took one upstream gradient at a time" + FELL_BACK
    with pytest.raises(ValueError, match=r"\(the backward\): ValueError: dp must be \[N, n\], got \(2, 3, 5\)"):
        na.gradcheck(na.softmax_forward, unstacked_backward, [z], names=["z"], batched=True)


def batch_sized_forward(x):
    """x [2, 3] times a per-batch weight shaped by x.shape[0]: the two-entry probe passes by chance
    (a stack of 2 reshapes, and both weights are equal), a chunk of 6 does not reshape."""
    weight = np.full(2, 3.0).reshape((x.shape[0],) + (1,) * (x.ndim - 1))
    return np.tanh(x) * weight, x


def batch_sized_backward(dout, x):
    return [3.0 * (1 - np.tanh(x) ** 2) * dout]


def test_a_fallback_on_a_later_chunk_says_why():
    x = np.random.default_rng(10).standard_normal((2, 3))
    report = na.gradcheck(batch_sized_forward, batch_sized_backward, [x], method="complex")
    rows_equal(report, na.gradcheck(batch_sized_forward, batch_sized_backward, [x], method="complex",
                                    batched=False))
    assert report and report.batching == ("the forward took one perturbed input at a time, the backward one "
                                          "upstream gradient" + FELL_BACK_BOTH)
    with pytest.raises(ValueError, match=r"batched=True, but the forward over input 0 fails on a chunk .*"
                                         r"cannot reshape array of size 2 into shape \(6,1,1\)"):
        na.gradcheck(batch_sized_forward, batch_sized_backward, [x], method="complex", batched=True)


def stack_only(error):
    """A softmax whose forward and backward are right, but whose backward raises `error` on a
    stack of upstream gradients ([C, 3, 5] instead of [3, 5]): a bug of the stacked path."""
    def backward(dp, cache):
        if np.ndim(dp) > 2:
            raise error("a bug that only a stacked call reaches")
        return [na.softmax_backward(dp, cache)]
    return backward


@pytest.mark.parametrize("error", [NameError, AttributeError, TypeError, ZeroDivisionError])
def test_a_real_error_of_the_stacked_call_is_not_hidden_by_the_fallback(error):
    """Only what a function that does not broadcast raises (ValueError, IndexError) sends the
    check to the one-at-a-time evaluation; any other error is a bug, and it propagates."""
    z = np.random.default_rng(8).standard_normal((3, 5))
    with pytest.raises(error, match="only a stacked call"):
        na.gradcheck(na.softmax_forward, stack_only(error), [z])
    assert na.gradcheck(na.softmax_forward, stack_only(error), [z], batched=False)     # never stacked


def test_a_real_error_of_the_function_itself_propagates_as_it_is():
    """An error on every call is raised by the looped evaluation too: it comes out unwrapped."""
    z = np.random.default_rng(9).standard_normal((3, 5))

    def broken_backward(dp, cache):
        return [cache.nonexistent_field * dp]
    for batched in (None, True, False):
        with pytest.raises(AttributeError, match="nonexistent_field"):
            na.gradcheck(na.softmax_forward, broken_backward, [z], batched=batched)


def test_one_probe_serves_every_input_of_a_forward_that_broadcasts():
    """The forward's probe stacks every checked input at once: checking q, k and v costs the
    forwards of checking q alone plus two per extra input (central differences), no more probes."""
    forward, backward, inputs, names = attention_case(np.random.default_rng(12), causal=True)
    calls = []

    def counting_forward(*args):
        calls.append(np.shape(args[0]))
        return forward(*args)
    per_wrt = {}
    for wrt in ([0], [0, 1, 2]):
        calls.clear()
        report = na.gradcheck(counting_forward, backward, inputs, wrt=wrt)
        assert report and report.batching == "vectorized"
        per_wrt[len(wrt)] = len(calls)
    assert per_wrt[3] - per_wrt[1] == 2 * 2


def first_weight_forward(x, W):
    """x [..., N, 4] @ W [4, 2], a stack of W read at its first entry only: right while W is
    repeated along the stack (stacks of x), wrong when W's entries differ (stacks of W)."""
    return x @ W.reshape((-1,) + W.shape[-2:])[0], (x, W)


def first_weight_backward(dout, cache):
    x, W = cache
    W = W.reshape((-1,) + W.shape[-2:])[0]
    return [dout @ W.T, np.swapaxes(x, -1, -2) @ dout]


def test_an_input_the_forward_cannot_stack_leaves_the_others_vectorized():
    """The joint probe fails, each input is probed alone: x stays vectorized, W is looped and named."""
    rng = np.random.default_rng(13)
    x, W = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    calls = []

    def forward(x, W):
        calls.append((np.ndim(x), np.ndim(W)))
        return first_weight_forward(x, W)
    report = na.gradcheck(forward, first_weight_backward, [x, W], names=["x", "W"])
    assert report and report.batching == "the forward took one perturbed W at a time" + FELL_BACK
    assert calls.count((3, 3)) >= 2                          # x's two stacked forwards (central)
    rows_equal(report, na.gradcheck(first_weight_forward, first_weight_backward, [x, W], names=["x", "W"],
                                    batched=False))
    with pytest.raises(ValueError, match=r"batched=True, but .* different numbers .*\(the forward over W\)"):
        na.gradcheck(forward, first_weight_backward, [x, W], names=["x", "W"], batched=True)
