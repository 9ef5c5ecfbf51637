"""Step 5, the softmax row (softmax_row.py): the forward against the formula written out, the
fully masked rows' policies, the backward's three methods and the sink's gradient against
complex step, and the tangent against the backward (the engines' equality to the textbook is
tests/test_engines.py's)."""
import numpy as np
import pytest

from numpy_attention.options import attention_options
from numpy_attention.softmax_row import (masked_row_weight, row_weights, softmax_row, softmax_row_backward,
                                           softmax_row_tangent, with_sink)

RNG = np.random.default_rng(8)
H, N_Q, N_K = 2, 3, 5


def options(**kwargs):
    q = np.zeros((H, N_Q, 4))
    return attention_options(q, q[:, :1].repeat(N_K, 1), q[:, :1].repeat(N_K, 1), **kwargs)[3]


def scores():
    S = RNG.standard_normal((H, N_Q, N_K))
    S[0, 1] = -np.inf                                  # a fully masked row
    S[1, 2, :2] = -np.inf
    return S


@pytest.mark.parametrize("sinks", [False, True])
def test_the_forward_is_the_formula(sinks):
    o = options(sinks=RNG.standard_normal(H) if sinks else None)
    S = scores()
    P, lse, top = softmax_row(S.copy(), o)
    S_row = np.concatenate([S, np.broadcast_to(o.sinks[:, None, None], (H, N_Q, 1))], -1) if sinks else S
    with np.errstate(divide="ignore", invalid="ignore"):
        want_lse = np.log(np.sum(np.exp(S_row), axis=-1))
        want_P = np.nan_to_num(np.exp(S_row - want_lse[..., None]))[..., :N_K]
    np.testing.assert_allclose(lse, want_lse, rtol=1e-15, atol=0)
    np.testing.assert_allclose(P, want_P, rtol=1e-15, atol=0)
    P_row = np.concatenate([P, np.exp(S_row[..., -1:] - lse[..., None])], -1) if sinks else P
    live = np.isfinite(lse)
    assert np.array_equal(np.take_along_axis(P_row, top, -1)[..., 0][live], P_row.max(-1)[live])


@pytest.mark.parametrize("policy, weight", [("zero", 0.0), ("uniform", 1 / N_K), ("nan", np.nan)])
def test_a_fully_masked_row_takes_its_policys_weight(policy, weight):
    P, lse, _ = softmax_row(scores(), options(fully_masked=policy))
    assert np.isneginf(lse[0, 1]) and np.array_equal(P[0, 1], np.full(N_K, weight), equal_nan=True)
    assert np.isfinite(P[1]).all()


@pytest.mark.parametrize("method", ["vjp", "jacobian", "flash"])
@pytest.mark.parametrize("sinks", [False, True])
def test_the_backward_is_complex_step_of_the_forward(method, sinks):
    """dS and the sink's column equal the complex-step gradient of <dP, P> + <dlse, lse> w.r.t.
    S and the sinks, to 1e-14, by each method (a random upstream gradient dP and dlse)."""
    sink_values = RNG.standard_normal(H) if sinks else None
    o = options(sinks=sink_values)
    S, dP, dlse = scores(), RNG.standard_normal((H, N_Q, N_K)), RNG.standard_normal((H, N_Q))
    P, lse, top = softmax_row(S.copy(), o)
    D = np.sum(P * dP, axis=-1)
    dS, dsink = softmax_row_backward(method, dP, D, P, lse, top, dlse, o, scores=lambda: with_sink(S.copy(), o))
    def loss(S, o):                                    # a fully masked row's lse (-inf) is a constant
        P, lse, _ = softmax_row(S, o)
        return np.sum(dP * P) + np.sum(dlse * np.where(np.isneginf(lse.real), 0, lse))
    h = 1e-30
    want = np.zeros_like(S)
    for at in zip(*np.nonzero(np.isfinite(S))):
        Sc = S.astype(complex)
        Sc[at] += 1j * h
        want[at] = loss(Sc, o).imag / h
    np.testing.assert_allclose(dS, want, rtol=0, atol=1e-14)
    assert (dS[~np.isfinite(S)] == 0).all()
    if sinks:
        for head in range(H):
            stepped = sink_values.astype(complex)
            stepped[head] += 1j * h
            want_sink = loss(S.astype(complex), options(sinks=stepped)).imag / h
            np.testing.assert_allclose(dsink[head].sum(), want_sink, rtol=0, atol=1e-14)
    else:
        assert dsink is None


@pytest.mark.parametrize("sinks", [False, True])
def test_the_tangent_is_the_backward_transposed(sinks):
    """<dP, P_dot> + <dlse, lse_dot> = <dS, S_dot> + <dsink, sink_dot>: forward and reverse mode
    are each other's transposes (to 1e-14)."""
    o = options(sinks=RNG.standard_normal(H) if sinks else None)
    S, S_dot = scores(), RNG.standard_normal((H, N_Q, N_K))
    S_dot[~np.isfinite(S)] = 0
    sink_dot = RNG.standard_normal(H) if sinks else None
    dP, dlse = RNG.standard_normal((H, N_Q, N_K)), RNG.standard_normal((H, N_Q))
    P, lse, top = softmax_row(S.copy(), o)
    dlse[np.isneginf(lse)] = 0
    P_dot_row, lse_dot = softmax_row_tangent(P, lse, S_dot, o, sink_dot)
    dS, dsink = softmax_row_backward("vjp", dP, np.sum(P * dP, axis=-1), P, lse, top, dlse, o)
    forward = np.sum(dP * P_dot_row[..., :N_K]) + np.sum(dlse * lse_dot)
    reverse = np.sum(dS * S_dot) + (np.sum(dsink * sink_dot[:, None]) if sinks else 0)
    np.testing.assert_allclose(forward, reverse, rtol=0, atol=1e-14)


def test_the_backward_leaves_dp_alone_unless_allowed():
    o = options()
    S, dP = scores(), RNG.standard_normal((H, N_Q, N_K))
    P, lse, top = softmax_row(S.copy(), o)
    kept = dP.copy()
    softmax_row_backward("vjp", dP, np.sum(P * dP, -1), P, lse, top, None, o)
    assert np.array_equal(dP, kept)


@pytest.mark.parametrize("policy", ["zero", "uniform", "nan"])
@pytest.mark.parametrize("sinks", [False, True])
def test_row_weights_written_out_are_softmax_row(policy, sinks):
    """The baselines' form (row_weights: max, exp, sum, log with their own hooks) gives
    softmax_row's weights and lse, the sink's column and a fully masked row's fill included;
    a total summed in other ways (pairs, float64) changes only the rounding."""
    o = options(sinks=RNG.standard_normal(H) if sinks else None, fully_masked=policy if not sinks else "zero")
    S = scores()
    P, lse, _ = softmax_row(S.copy(), o)
    fill = masked_row_weight(o.fully_masked, N_K)
    for total in (None, lambda e: e[..., ::2].sum(-1, keepdims=True) + e[..., 1::2].sum(-1, keepdims=True)):
        P_row, lse_row = row_weights(with_sink(S, o), fill, **({} if total is None else {"total": total}))
        np.testing.assert_allclose(P_row[..., :N_K], P, rtol=1e-15, atol=1e-16)
        np.testing.assert_allclose(lse_row, lse, rtol=1e-15, atol=1e-16)
        assert P_row.shape[-1] == N_K + sinks
    assert np.isneginf(lse[0, 1]) == (not sinks)


def test_row_weights_keep_the_dtype_and_take_the_kernels_exp():
    S = scores().astype(np.float16)
    P_row, lse = row_weights(S, 0.0, exp=lambda x: np.exp(x.astype(np.float64)).astype(x.dtype))
    assert P_row.dtype == lse.dtype == np.float16
    np.testing.assert_allclose(P_row, softmax_row(S.astype(np.float64), options())[0], atol=2e-3)
    assert not P_row[0, 1].any() and np.isneginf(lse[0, 1])
    S[1, 0, 2] = np.inf                                # a score that overflowed float16: NaN, not a weight
    P_row, lse = row_weights(S, 0.0)
    assert np.isnan(P_row[1, 0]).all() and np.isnan(lse[1, 0]) and not np.isnan(P_row[1, 1]).any()
