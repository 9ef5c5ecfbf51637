"""Property tests over random shapes, masks and scales (hypothesis).

Hypothesis draws the sizes (B, H_kv, G = H / H_kv, N_q, N_k, d_k, d_v up to small values),
the options (scale, causal, a random keep-mask, a bias) and a seed; the arrays come from
numpy.random.default_rng(seed), so a failing example shrinks to small sizes and is replayed
exactly.
"""
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from compare import assert_normwise_equal

import numpy_attention as na

SETTINGS = settings(max_examples=40, deadline=None)


class Problem(NamedTuple):
    q: np.ndarray                   # [B, H, N_q, d_k]
    k: np.ndarray                   # [B, H_kv, N_k, d_k]
    v: np.ndarray                   # [B, H_kv, N_k, d_v]
    options: dict                   # mask, bias, scale, causal
    dout: np.ndarray                # [B, H, N_q, d_v] a random upstream gradient


@st.composite
def problems(draw, with_bias=True):
    b, h_kv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n_q, n_k, d_k, d_v = (draw(st.integers(1, 4)) for _ in range(4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    options = {"scale": draw(st.floats(0.05, 4.0)),
               "causal": draw(st.sampled_from([False, "top_left", "bottom_right"]))}
    keep_fraction = draw(st.sampled_from([None, 0.3, 0.7]))     # None: no mask
    if keep_fraction is not None:
        options["mask"] = rng.random((b, 1, n_q, n_k)) < keep_fraction   # may mask whole rows
    if with_bias and draw(st.booleans()):
        options["bias"] = rng.standard_normal((h_kv * g, n_q, n_k))
    return Problem(q=rng.standard_normal((b, h_kv * g, n_q, d_k)), k=rng.standard_normal((b, h_kv, n_k, d_k)),
                   v=rng.standard_normal((b, h_kv, n_k, d_v)), options=options,
                   dout=rng.standard_normal((b, h_kv * g, n_q, d_v)))


def expand_kv(x, heads):
    """[B, H_kv, N, d] -> [B, H, N, d]: each kv head repeated for its G query heads."""
    return np.repeat(x, heads // x.shape[1], axis=1)


@SETTINGS
@given(problems())
def test_rows_sum_to_one_or_zero_when_fully_masked(p):
    out, cache = na.attention_forward(p.q, p.k, p.v, **p.options)
    sums = cache.weights.sum(axis=-1)
    dead = np.isneginf(cache.scores).all(axis=-1)
    assert np.all(sums[dead] == 0) and np.all(out[dead] == 0)
    np.testing.assert_allclose(sums[~dead], 1.0, rtol=0, atol=8 * np.finfo(float).eps)
    assert np.all(cache.weights >= 0)


@SETTINGS
@given(problems(), st.integers(0, 2**32 - 1))
def test_each_output_row_lies_in_the_convex_hull_of_the_attended_values(p, seed):
    """<u, out_i> is between min_j and max_j of <u, v_j> over the keys row i attends, for any u."""
    out, cache = na.attention_forward(p.q, p.k, p.v, **p.options)
    u = np.random.default_rng(seed).standard_normal((8, p.v.shape[-1]))          # 8 directions
    proj_out = out @ u.T                                                         # [B, H, N_q, 8]
    proj_v = expand_kv(p.v, p.q.shape[1]) @ u.T                                  # [B, H, N_k, 8]
    kept = np.isfinite(cache.scores)[..., None]                                  # [B, H, N_q, N_k, 1]
    high = np.where(kept, proj_v[:, :, None], -np.inf).max(axis=3)               # [B, H, N_q, 8]
    low = np.where(kept, proj_v[:, :, None], np.inf).min(axis=3)
    live = kept.any(axis=3)[..., 0]
    slack = 1e-12 * (1 + np.abs(proj_v).max())
    assert np.all(proj_out[live] <= high[live] + slack)
    assert np.all(proj_out[live] >= low[live] - slack)


@SETTINGS
@given(problems())
def test_gradients_agree_with_complex_step(p):
    has_bias = "bias" in p.options
    options = {key: value for key, value in p.options.items() if key != "bias"}
    inputs = [p.q, p.k, p.v] + ([p.options["bias"]] if has_bias else [])

    def forward(q, k, v, bias=None):
        return na.attention_forward(q, k, v, bias=bias, **options)

    def backward(dout, cache):
        g = na.attention_backward(dout, cache)
        return g.dq, g.dk, g.dv, g.dbias

    report = na.gradcheck(forward, backward, inputs, method="complex", mode="projection", n_projections=2)
    assert report, str(report)
    assert max(row.max_rel_err for row in report.rows) < 1e-13, str(report)   # seen: <= 5e-15


@SETTINGS
@given(problems(), st.sampled_from(["vjp", "jacobian", "flash"]))
def test_grouped_query_attention_equals_attention_with_repeated_kv(p, method):
    h = p.q.shape[1]
    out, cache = na.attention_forward(p.q, p.k, p.v, **p.options)
    grads = na.attention_backward(p.dout, cache, method=method)
    out_rep, cache_rep = na.attention_forward(p.q, expand_kv(p.k, h), expand_kv(p.v, h), **p.options)
    grads_rep = na.attention_backward(p.dout, cache_rep, method=method)
    group_sum = lambda g: g.reshape(g.shape[0], p.k.shape[1], -1, *g.shape[2:]).sum(axis=2)
    np.testing.assert_allclose(out, out_rep, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(grads.dq, grads_rep.dq, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(grads.dk, group_sum(grads_rep.dk), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(grads.dv, group_sum(grads_rep.dv), rtol=1e-12, atol=1e-13)


@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=0, max_size=2), st.integers(0, 4), st.integers(1, 4),
       st.integers(0, 4), st.integers(0, 2**32 - 1))
def test_split_then_merge_is_the_identity(lead, n, heads, d, seed):
    x = np.random.default_rng(seed).standard_normal((*lead, n, heads * d))
    xh = na.split_heads(x, heads)
    assert xh.shape == (*lead, heads, n, d)
    assert np.array_equal(na.merge_heads(xh), x)
    assert np.array_equal(na.split_heads(na.merge_heads(xh), heads), xh)


@pytest.mark.parametrize("policy", ["uniform", "nan"])
@SETTINGS
@given(p=problems(with_bias=False))
def test_live_rows_do_not_depend_on_the_fully_masked_policy(policy, p):
    """Bit for bit in the textbook; to rounding in the blocked engine, which under "zero" skips
    the key columns masked in all of a block's rows (the other policies weigh them)."""
    for implementation in ("textbook", "blocked"):
        zero, cache = na.attention_forward(p.q, p.k, p.v, implementation=implementation, **p.options)
        other, _ = na.attention_forward(p.q, p.k, p.v, fully_masked=policy, implementation=implementation,
                                        **p.options)
        live = ~np.isneginf(cache.scores).all(axis=-1)
        if implementation == "textbook":
            assert np.array_equal(zero[live], other[live])
        else:
            assert_normwise_equal({"out": zero[live]}, {"out": other[live]}, 1e-13)
