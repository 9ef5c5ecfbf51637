"""Every attention variant torch has, against SDPA in float64 autograd (the variants it lacks are
checked by complex step in test_complex_step_variants.py).

Gradients use a random upstream gradient; agreement is relative to the largest entry, <= 1e-12.
"""
import numpy as np
import pytest
from optional import TORCH_REASON

from numpy_attention import attention_backward, attention_forward

torch = pytest.importorskip("torch", reason=TORCH_REASON)      # every test here needs it: skip the file

F = torch.nn.functional
RTOL = 1e-12


def assert_close(ours, theirs, name):
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else theirs
    err = np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-300)
    assert err <= RTOL, f"{name}: relative error {err:.2e}"


def compare_with_sdpa(rng, shape_q, shape_kv, d_v=5, bias_shape=None, ours=None, **torch_kw):
    """Run ours and torch SDPA (float64, autograd) on the same inputs; compare out and every grad."""
    q, k = rng.standard_normal(shape_q), rng.standard_normal(shape_kv)
    v = rng.standard_normal(shape_kv[:-1] + (d_v,))
    dout = rng.standard_normal(shape_q[:-1] + (d_v,))
    t = {name: torch.tensor(x, requires_grad=True) for name, x in (("q", q), ("k", k), ("v", v))}
    ours = dict(ours or {})
    if bias_shape is not None:
        ours["bias"] = rng.standard_normal(bias_shape)
        t["bias"] = torch_kw["attn_mask"] = torch.tensor(ours["bias"], requires_grad=True)
    out_t = F.scaled_dot_product_attention(t["q"], t["k"], t["v"], **torch_kw)
    out_t.backward(torch.tensor(dout))
    out, cache = attention_forward(q, k, v, **ours)
    g = attention_backward(dout, cache)
    assert_close(out, out_t, "out")
    for name, grad in (("q", g.dq), ("k", g.dk), ("v", g.dv), ("bias", g.dbias)):
        if name in t:
            assert grad.shape == t[name].shape
            assert_close(grad, t[name].grad, "d" + name)


@pytest.mark.parametrize("n_q, n_k", [(4, 4), (3, 7), (7, 3)])
def test_plain_and_scale(n_q, n_k):
    rng = np.random.default_rng(0)
    compare_with_sdpa(rng, (2, 3, n_q, 6), (2, 3, n_k, 6))
    compare_with_sdpa(rng, (2, 3, n_q, 6), (2, 3, n_k, 6), ours={"scale": 0.37}, scale=0.37)


@pytest.mark.parametrize("n_q, n_k", [(5, 5), (3, 7), (7, 3)])
def test_bool_mask(n_q, n_k):
    rng = np.random.default_rng(1)
    mask = rng.random((2, 1, n_q, n_k)) < 0.6
    mask[..., 0] = True                                  # fully masked rows: their own test
    compare_with_sdpa(rng, (2, 3, n_q, 4), (2, 3, n_k, 4), ours={"mask": mask},
                      attn_mask=torch.tensor(mask))


@pytest.mark.parametrize("bias_shape", [(3, 6), (2, 1, 3, 6), (1, 4, 1, 6), (2, 4, 3, 6)])
def test_float_bias_and_its_gradient(bias_shape):
    compare_with_sdpa(np.random.default_rng(2), (2, 4, 3, 5), (2, 4, 6, 5), bias_shape=bias_shape)


@pytest.mark.parametrize("n_q, n_k", [(5, 5), (3, 8), (8, 3)])
def test_causal_top_left_is_torch_is_causal(n_q, n_k):
    rng = np.random.default_rng(3)
    for causal in (True, "top_left"):
        compare_with_sdpa(rng, (1, 2, n_q, 4), (1, 2, n_k, 4), ours={"causal": causal}, is_causal=True)


@pytest.mark.parametrize("n_q, n_k", [(3, 8), (5, 5)])
def test_causal_bottom_right_is_torch_causal_lower_right(n_q, n_k):
    from torch.nn.attention.bias import causal_lower_right
    compare_with_sdpa(np.random.default_rng(4), (1, 2, n_q, 4), (1, 2, n_k, 4),
                      ours={"causal": "bottom_right"}, attn_mask=causal_lower_right(n_q, n_k))


@pytest.mark.parametrize("h, h_kv", [(4, 2), (6, 1), (6, 3)])
def test_grouped_query_attention_is_enable_gqa(h, h_kv):
    compare_with_sdpa(np.random.default_rng(5), (2, h, 3, 4), (2, h_kv, 7, 4), enable_gqa=True)
    compare_with_sdpa(np.random.default_rng(6), (2, h, 7, 4), (2, h_kv, 3, 4), ours={"causal": True},
                      is_causal=True, enable_gqa=True)


def test_window_is_a_band_mask_in_torch():
    n_q, n_k, (left, right) = 5, 9, (2, 1)
    i, j = np.arange(n_q)[:, None] + (n_k - n_q), np.arange(n_k)[None, :]
    band = (j >= i - left) & (j <= i + right)             # bottom-right diagonal
    compare_with_sdpa(np.random.default_rng(8), (1, 2, n_q, 4), (1, 2, n_k, 4),
                      ours={"window": (left, right), "align": "bottom_right"},
                      attn_mask=torch.tensor(band))


# ----------------------------------------------------------------------------- fully masked rows

def _fully_masked_inputs():
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 5, 3)), rng.standard_normal((2, 2, 5, 3))
    mask = rng.random((2, 1, 4, 5)) < 0.7
    mask[:, :, 1] = False                                 # row 1 of every head: no key at all
    mask[:, :, [0, 2, 3], 0] = True
    return q, k, v, mask, rng.standard_normal((2, 2, 4, 3))


def test_fully_masked_zero_equals_torch_sdpa():
    """torch 2.13's SDPA (math path on CPU) returns 0 and gradient 0 for a row with no key."""
    q, k, v, mask, dout = _fully_masked_inputs()
    compare_with_sdpa(np.random.default_rng(10), q.shape, k.shape, d_v=3, ours={"mask": mask},
                      attn_mask=torch.tensor(mask))
    out, cache = attention_forward(q, k, v, mask=mask, fully_masked="zero")
    g = attention_backward(dout, cache)
    assert np.all(out[:, :, 1] == 0)
    assert all(np.isfinite(x).all() for x in (g.dq, g.dk, g.dv)) and np.all(g.dq[:, :, 1] == 0)
    t = [torch.tensor(x) for x in (q, k, v)]
    assert torch.all(F.scaled_dot_product_attention(*t, attn_mask=torch.tensor(mask))[:, :, 1] == 0)


def seed_sdpa(Q, K, V, mask):
    """The seed's scaled_dot_product_attention (section 6), verbatim but for self.d_k."""
    scores = torch.matmul(Q, K.transpose(-2, -1)) / np.sqrt(Q.shape[-1])
    scores = scores.masked_fill(mask == 0, -1e9)
    return torch.matmul(F.softmax(scores, dim=-1), V)


def test_fully_masked_uniform_equals_the_seeds_fill():
    q, k, v, mask, dout = _fully_masked_inputs()
    t = {name: torch.tensor(x, requires_grad=True) for name, x in (("q", q), ("k", k), ("v", v))}
    out_t = seed_sdpa(t["q"], t["k"], t["v"], torch.tensor(mask))
    out_t.backward(torch.tensor(dout))
    out, cache = attention_forward(q, k, v, mask=mask, fully_masked="uniform")
    g = attention_backward(dout, cache)
    np.testing.assert_allclose(out[:, :, 1], v.mean(axis=-2), rtol=1e-13)
    for ours, theirs in ((out, out_t), (g.dq, t["q"].grad), (g.dk, t["k"].grad), (g.dv, t["v"].grad)):
        assert_close(ours, theirs, "uniform")
