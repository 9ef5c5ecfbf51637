"""MultiHeadAttention against the seed's PyTorch class (retyped in seed_model.py) and torch.nn.MultiheadAttention."""
import numpy as np
import pytest
import torch
from seed_model import SeedMultiHeadAttention

import numpy_attention as na

nn = torch.nn


def rel(a, b):
    """Normwise relative error max|a - b| / max|b| (the absolute error where b is exactly 0)."""
    err, scale = np.max(np.abs(a - b)), np.max(np.abs(b))
    return err / scale if scale > 0 else err


def run_both(d_model, num_heads, B, n_q, n_k, mask=None, fully_masked="zero", seed=0):
    """Run the seed (torch, float64) and ours with the same weights; return both outputs and grads."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    seed_mha = SeedMultiHeadAttention(d_model, num_heads).double()
    ours = na.MultiHeadAttention(d_model, num_heads, fully_masked=fully_masked)
    ours.load_state_dict(seed_mha.state_dict())
    x = [rng.standard_normal((B, n, d_model)) for n in (n_q, n_k, n_k)]
    xt = [torch.tensor(a, requires_grad=True) for a in x]
    out_t, w_t = seed_mha(*xt, mask=None if mask is None else torch.tensor(mask))
    out, w = ours(*x, mask=mask)
    dout = rng.standard_normal(out.shape)
    out_t.backward(torch.tensor(dout))
    grads = ours.backward(dout)
    torch_grads = {"query": xt[0].grad, "key": xt[1].grad, "value": xt[2].grad}
    torch_grads.update({name: p.grad for name, p in seed_mha.named_parameters()})
    return (out, w, grads), (out_t.detach().numpy(), w_t.detach().numpy(),
                             {k: v.numpy() for k, v in torch_grads.items()})


def assert_match(ours, theirs, tol=1e-12):
    (out, w, grads), (out_t, w_t, grads_t) = ours, theirs
    assert rel(out, out_t) <= tol and rel(w, w_t) <= tol
    assert set(grads) == set(grads_t)
    for name in grads:
        if name == "W_k.bias":          # exactly zero: both sides are rounding noise
            assert np.max(np.abs(grads[name])) < 1e-12 and np.max(np.abs(grads_t[name])) < 1e-12
        else:
            assert rel(grads[name], grads_t[name]) <= tol, name


@pytest.mark.parametrize("d_model,num_heads,B,n_q,n_k", [
    (512, 8, 2, 10, 10),     # the seed's example
    (16, 4, 3, 5, 7),        # cross-attention, N_q != N_k
    (6, 3, 1, 1, 1),         # N = 1, B = 1
    (5, 1, 2, 3, 4),         # H = 1, odd width
    (21, 7, 1, 9, 2),        # odd sizes
])
def test_against_the_seed_without_mask(d_model, num_heads, B, n_q, n_k):
    assert_match(*run_both(d_model, num_heads, B, n_q, n_k))


def test_against_the_seed_with_causal_mask():
    mask = np.tril(np.ones((6, 6), bool))[None, None]        # broadcast over batch and heads
    assert_match(*run_both(16, 4, 2, 6, 6, mask=mask))


def test_against_the_seed_with_padding_mask_and_unequal_lengths():
    mask = np.ones((3, 1, 1, 7), bool)
    mask[0, ..., 5:] = False                                 # batch 0: the last two keys are padding
    mask[2, ..., 1:] = False
    assert_match(*run_both(16, 4, 3, 5, 7, mask=mask))


def test_fully_masked_rows_equal_the_seed_under_uniform():
    mask = np.ones((2, 4, 5, 5), bool)
    mask[1, 2, 3] = False                                    # one row masked everywhere
    assert_match(*run_both(16, 4, 2, 5, 5, mask=mask, fully_masked="uniform"))


def test_float_0_1_mask_means_nonzero_attends():
    mask = np.tril(np.ones((6, 6)))                          # float 0/1, like the seed allows
    assert_match(*run_both(8, 2, 2, 6, 6, mask=mask))


def as_torch_parameters(g, packed):
    """Our gradients under nn.MultiheadAttention's parameter names and layouts."""
    w = [g[f"W_{c}.weight"] for c in "qkv"]
    named = {"in_proj_weight": np.concatenate(w)} if packed else {f"{c}_proj_weight": x for c, x in zip("qkv", w)}
    named["in_proj_bias"] = np.concatenate([g[f"W_{c}.bias"] for c in "qkv"])
    named["out_proj.weight"], named["out_proj.bias"] = g["W_o.weight"], g["W_o.bias"]
    return named


@pytest.mark.parametrize("kdim,vdim", [(None, None), (5, 7), (12, 3), (2, 2)],
                         ids=["packed", "kdim5-vdim7", "vdim3", "kdim2-vdim2"])
def test_torch_nn_multiheadattention_weights(kdim, vdim):
    """load_state_dict takes nn.MultiheadAttention's keys (packed, or q/k/v_proj_weight with
    kdim/vdim); forward, weights and every gradient agree with torch autograd."""
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    D, H, B, n_q, n_k = 12, 3, 2, 4, 6
    tmha = nn.MultiheadAttention(D, H, kdim=kdim, vdim=vdim, batch_first=True).double()
    packed = "in_proj_weight" in tmha.state_dict()
    assert packed == (kdim in (None, D) and vdim in (None, D))
    ours = na.MultiHeadAttention(D, H, kdim=kdim, vdim=vdim)
    ours.load_state_dict(tmha.state_dict())
    x = [rng.standard_normal((B, n, d)) for n, d in ((n_q, D), (n_k, kdim or D), (n_k, vdim or D))]
    ignore = rng.random((B, n_k)) < 0.3                      # torch's key_padding_mask: True = ignore
    ignore[:, 0] = False
    xt = [torch.tensor(a, requires_grad=True) for a in x]
    out_t, w_t = tmha(*xt, key_padding_mask=torch.tensor(ignore), average_attn_weights=False)
    out, w = ours(*x, mask=~ignore[:, None, None, :])
    assert rel(out, out_t.detach().numpy()) <= 1e-12 and rel(w, w_t.detach().numpy()) <= 1e-12
    dout = rng.standard_normal(out.shape)
    out_t.backward(torch.tensor(dout))
    g = ours.backward(dout)
    for i, name in enumerate(("query", "key", "value")):
        assert g[name].shape == x[i].shape and rel(g[name], xt[i].grad.numpy()) <= 1e-12, name
    named = as_torch_parameters(g, packed)
    params = dict(tmha.named_parameters())
    assert set(named) == set(params)
    for name, p in params.items():
        assert rel(named[name], p.grad.numpy()) <= 1e-12, name


def test_kdim_vdim_gradients_against_complex_step():
    """multihead_forward with D = 6, kdim = 4, vdim = 3, a mask: the whole Jacobian of every input."""
    rng = np.random.default_rng(11)
    mha = na.MultiHeadAttention(6, 2, kdim=4, vdim=3, seed=2)
    keys = list(mha.params)
    mask = rng.random((2, 1, 3, 5)) < 0.7
    mask[..., 0] = True

    def forward(query, key, value, *params):
        out, _, cache = na.multihead_forward(query, key, value, dict(zip(keys, params)), 2, mask=mask)
        return out, cache

    def backward(dout, cache):
        g = na.multihead_backward(dout, cache)
        return [g[name] for name in ["query", "key", "value"] + keys]

    inputs = [rng.standard_normal(shape) for shape in ((2, 3, 6), (2, 5, 4), (2, 5, 3))]
    report = na.gradcheck(forward, backward, inputs + list(mha.params.values()), method="complex",
                          names=["query", "key", "value"] + keys)
    assert report, report
    # W_k.bias's gradient is exactly zero (softmax ignores a per-row shift): rounding only
    assert max(r.max_rel_err for r in report.rows if r.name != "W_k.bias") <= 1e-12, report


def test_an_attention_bias_gets_its_gradient():
    """A bias passed through attention_options comes back as grads["bias"] (complex step);
    without one there is no "bias" key."""
    rng = np.random.default_rng(12)
    mha = na.MultiHeadAttention(6, 2, seed=3)
    x = rng.standard_normal((2, 3, 6))

    def forward(bias):
        out, _, cache = na.multihead_forward(x, x, x, mha.params, 2, bias=bias)
        return out, cache

    backward = lambda dout, cache: [na.multihead_backward(dout, cache)["bias"]]
    report = na.gradcheck(forward, backward, [rng.standard_normal((1, 2, 3, 3))], method="complex")
    assert report and report.rows[0].max_rel_err <= 1e-12, report
    mha(x, x, x)
    assert "bias" not in mha.backward(np.ones((2, 3, 6)))


@pytest.mark.parametrize("kdim,vdim", [(None, None), (5, 3)])
def test_initialization_is_nn_linear_in_the_input_width(kdim, vdim):
    """U(-1/sqrt(in), 1/sqrt(in)) per projection, weight then bias, W_q, W_k, W_v, W_o, from
    default_rng(seed): with kdim = vdim = d_model, exactly the seed's sequence."""
    D = 8
    rng = np.random.default_rng(3)
    expected = {}
    for name, d_in in zip(("W_q", "W_k", "W_v", "W_o"), (D, kdim or D, vdim or D, D)):
        bound = 1.0 / np.sqrt(d_in)
        expected[f"{name}.weight"] = rng.uniform(-bound, bound, (D, d_in))
        expected[f"{name}.bias"] = rng.uniform(-bound, bound, D)
    sd = na.MultiHeadAttention(D, 2, kdim=kdim, vdim=vdim, seed=3).state_dict()
    assert list(sd) == list(expected)
    for key in sd:
        np.testing.assert_array_equal(sd[key], expected[key], err_msg=key)


def test_state_dict_keys_and_layouts():
    mha = na.MultiHeadAttention(8, 2)
    sd = mha.state_dict()
    assert list(sd) == ["W_q.weight", "W_q.bias", "W_k.weight", "W_k.bias",
                        "W_v.weight", "W_v.bias", "W_o.weight", "W_o.bias"]
    assert all(sd[k].shape == ((8, 8) if k.endswith("weight") else (8,)) for k in sd)
    sd["W_q.weight"][:] = 0                                  # a copy: the module is unchanged
    assert np.abs(mha.state_dict()["W_q.weight"]).sum() > 0
    other = na.MultiHeadAttention(8, 2, seed=5)
    other.load_state_dict(mha.state_dict())
    x = np.random.default_rng(0).standard_normal((1, 3, 8))
    np.testing.assert_array_equal(other(x, x, x)[0], mha(x, x, x)[0])


def test_self_attention_gradient_is_the_sum_of_the_three():
    mha = na.MultiHeadAttention(8, 2)
    X = np.random.default_rng(2).standard_normal((2, 4, 8))
    out, _ = mha(X, X, X)
    dout = np.random.default_rng(3).standard_normal(out.shape)
    g = mha.backward(dout)
    dX = g["query"] + g["key"] + g["value"]
    h = 1e-20
    V = np.random.default_rng(4).standard_normal(X.shape)
    numeric = np.sum(dout * np.imag(mha(X + 1j * h * V, X + 1j * h * V, X + 1j * h * V)[0])) / h
    assert abs(np.sum(dX * V) - numeric) <= 1e-12 * abs(numeric)


def test_float32_model_computes_in_float32():
    mha = na.MultiHeadAttention(8, 2, dtype=np.float32)
    X = np.random.default_rng(5).standard_normal((2, 3, 8))
    out, w = mha(X, X, X)
    assert out.dtype == w.dtype == np.float32
    g = mha.backward(np.ones_like(out))
    assert all(v.dtype == np.float32 for v in g.values())
    ref = na.MultiHeadAttention(8, 2)
    ref.load_state_dict(mha.state_dict())
    np.testing.assert_allclose(out, ref(X, X, X)[0], rtol=1e-5, atol=1e-6)
