"""MultiHeadAttention against the seed's PyTorch class (retyped in seed_model.py) and torch.nn.MultiheadAttention.

The module's checks that need no torch are in test_multihead.py."""
import numpy as np
import pytest
from optional import TORCH_REASON

torch = pytest.importorskip("torch", reason=TORCH_REASON)      # every test here needs it: skip the file

from seed_model import SeedMultiHeadAttention  # noqa: E402  (imports torch)

import numpy_attention as na  # noqa: E402

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
