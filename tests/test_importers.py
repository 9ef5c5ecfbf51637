"""Importers: the seed's torch class and nn.MultiheadAttention against torch float64 autograd."""
import re

import numpy as np
import pytest
from optional import TORCH_REASON

torch = pytest.importorskip("torch", reason=TORCH_REASON)      # every test here needs it: skip the file

from seed_model import SeedMultiHeadAttention  # noqa: E402  (imports torch)

from numpy_attention import MultiHeadAttention  # noqa: E402
from numpy_attention.oracle.importers import from_torch  # noqa: E402

nn = torch.nn


def assert_close(ours, theirs, name, rtol=1e-12, scale=None):
    """max |ours - theirs| <= rtol * scale, scale = max |theirs| unless given."""
    theirs = theirs.detach().numpy()
    err = np.max(np.abs(ours - theirs)) / (np.max(np.abs(theirs)) if scale is None else scale)
    assert err <= rtol, f"{name}: relative error {err:.2e}"


def check_against_autograd(module, ours, inputs, call_kw, torch_kw=None, out_index=0):
    """Forward outputs and every gradient of ours equal torch's (random upstream gradient)."""
    t = [torch.tensor(x, requires_grad=True) for x in inputs]
    out_t, weights_t = module(*t, **(torch_kw or call_kw))
    dout = np.random.default_rng(99).standard_normal(tuple(out_t.shape))
    out_t.backward(torch.tensor(dout))
    out, weights = ours(*inputs, **call_kw)
    assert_close(out, out_t, "out")
    assert_close(weights, weights_t, "weights")
    grads = ours.backward(dout)
    for name, x in zip(("query", "key", "value"), t):
        assert_close(grads[name], x.grad, name)
    params = dict(module.named_parameters())
    assert set(grads) - {"query", "key", "value"} == set(params)
    for name, p in params.items():
        assert_close(grads[name], p.grad, name)


def test_seed_class():
    torch.manual_seed(0)
    seed = SeedMultiHeadAttention(8, 2).double()
    ours = from_torch(seed)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
    mask = rng.random((2, 1, 3, 5)) < 0.6
    mask[1, :, 2] = False                                       # a fully masked row: the -1e9 fill
    t = [torch.tensor(a, requires_grad=True) for a in (x, y, y)]
    out_t, w_t = seed(*t, mask=torch.tensor(mask))
    dout = rng.standard_normal(tuple(out_t.shape))
    out_t.backward(torch.tensor(dout))
    out, w = ours(x, y, y, mask=mask)
    assert_close(out, out_t, "out")
    assert_close(w, w_t, "weights")
    grads = ours.backward(dout)
    for name, a in zip(("query", "key", "value"), t):
        assert_close(grads[name], a.grad, name)
    for name, p in seed.named_parameters():
        # W_k.bias's gradient is 0 up to rounding (softmax ignores a row's constant shift):
        # measured against the size of W_k.weight's gradient
        scale = np.max(np.abs(grads["W_k.weight"])) if name == "W_k.bias" else None
        assert_close(grads[name], p.grad, name, scale=scale)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("average", [True, False])
def test_nn_multihead_attention_packed(batch_first, average):
    torch.manual_seed(1)
    module = nn.MultiheadAttention(12, 3, batch_first=batch_first, dtype=torch.float64)
    ours = from_torch(module)
    rng = np.random.default_rng(1)
    b, n_q, n_k = 2, 4, 6
    shape = (lambda n: (b, n, 12)) if batch_first else (lambda n: (n, b, 12))
    kpm = np.zeros((b, n_k), bool)
    kpm[0, 4:] = True                                           # True = ignore, torch's polarity
    attn_mask = np.triu(np.ones((n_q, n_k), bool), 3)           # True = not allowed
    kw = dict(key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=average)
    torch_kw = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    check_against_autograd(module, ours, [rng.standard_normal(shape(n)) for n in (n_q, n_k, n_k)], kw, torch_kw)


def test_nn_multihead_attention_kdim_vdim_and_float_mask():
    torch.manual_seed(2)
    module = nn.MultiheadAttention(8, 2, kdim=5, vdim=3, batch_first=True, dtype=torch.float64)
    ours = from_torch(module)
    rng = np.random.default_rng(2)
    bias = rng.standard_normal((2 * 2, 4, 6))                   # [B * H, N_q, N_k], added to scores
    kw = dict(attn_mask=bias)
    inputs = [rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 6, 5)), rng.standard_normal((2, 6, 3))]
    check_against_autograd(module, ours, inputs, kw, {"attn_mask": torch.tensor(bias)})


def test_fully_masked_query_is_nan_like_torch():
    module = nn.MultiheadAttention(4, 2, dtype=torch.float64)
    kpm = np.array([[False, False, False], [True, True, True]])
    x = np.random.default_rng(3).standard_normal((3, 2, 4))
    out_t, _ = module(*[torch.tensor(x)] * 3, key_padding_mask=torch.tensor(kpm))
    out, _ = from_torch(module)(x, x, x, key_padding_mask=kpm)
    assert np.isnan(out[:, 1]).all() and torch.isnan(out_t[:, 1]).all()
    assert_close(out[:, 0], out_t[:, 0], "out")


def test_unsupported_modules_are_refused():
    with pytest.raises(TypeError, match="from_torch takes"):
        from_torch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_torch(nn.MultiheadAttention(4, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="eval"):
        from_torch(nn.MultiheadAttention(4, 2, dropout=0.1))


def _module_and_inputs():
    """nn.MultiheadAttention(8, 2) (batch_first=False) and query, key, value [N, B, E] of N_q 3, N_k 5, B 2."""
    module = nn.MultiheadAttention(8, 2, dtype=torch.float64)
    rng = np.random.default_rng(4)
    return from_torch(module), [rng.standard_normal((n, 2, 8)) for n in (3, 5, 5)]


@pytest.mark.parametrize("change, exc, message", [
    ({"query": None}, TypeError, "query must be a numeric"),
    ({"query": np.ones((3, 2, 8), bool)}, TypeError, "query must be a numeric"),
    ({"key": np.ones((5, 8))}, ValueError, "key must have 3 axes [N, B, E] (batch_first=False), got shape (5, 8)"),
    ({"key_padding_mask": np.zeros((2, 4), bool)}, ValueError, "key_padding_mask must have shape (2, 5), got (2, 4)"),
    ({"key_padding_mask": np.zeros((2, 5), int)}, TypeError, "key_padding_mask must be a bool or floating array"),
    ({"attn_mask": np.zeros((3, 3, 5))}, ValueError, "attn_mask must have shape (3, 5) or (4, 3, 5), got (3, 3, 5)"),
    ({"attn_mask": "x"}, TypeError, "attn_mask must be a bool or floating array"),
    ({"attn_mask": [None]}, TypeError, "attn_mask must be a bool or floating array"),
])
def test_torch_wrapper_bad_inputs_are_named(change, exc, message):
    ours, (query, key, value) = _module_and_inputs()
    args = {"query": query, "key": key, "value": value, **change}
    with pytest.raises(exc, match=re.escape(message)):
        ours(**args)


def test_torch_wrapper_backward_checks_its_order_and_gradient():
    ours, inputs = _module_and_inputs()
    with pytest.raises(ValueError, match="needs a forward first"):
        ours.backward(np.ones((3, 2, 8)))
    ours(*inputs)
    with pytest.raises(ValueError, match=re.escape("grad_output must have the forward output's shape (3, 2, 8)")):
        ours.backward(np.ones((2, 3, 8)))
    assert ours.backward(np.ones((3, 2, 8)))["query"].shape == (3, 2, 8)


def test_a_bias_free_module_loads_into_our_class_with_zero_biases():
    """nn.MultiheadAttention(bias=False).state_dict() has no bias keys: load_state_dict takes
    it as zero biases, and the module's output is torch's."""
    torch.manual_seed(5)
    module = nn.MultiheadAttention(8, 2, bias=False, batch_first=True, dtype=torch.float64)
    ours = MultiHeadAttention(8, 2)
    ours.load_state_dict(module.state_dict())
    assert all(not ours.params[f"{p}.bias"].any() for p in ("W_q", "W_k", "W_v", "W_o"))
    x = np.random.default_rng(5).standard_normal((2, 3, 8))
    assert_close(ours(x, x, x)[0], module(*[torch.tensor(x)] * 3)[0], "out")


def test_key_padding_mask_when_the_batch_equals_the_query_length():
    """key_padding_mask [B, N_k] with B == N_q has the shape of a 2-D attn_mask [N_q, N_k]:
    it must still mask keys per batch entry, not per query row."""
    torch.manual_seed(6)
    module = nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    rng = np.random.default_rng(6)
    b = n_q = 3
    kpm = np.zeros((b, 5), bool)
    kpm[0, 3:] = kpm[2, :2] = True
    inputs = [rng.standard_normal((b, n, 8)) for n in (n_q, 5, 5)]
    check_against_autograd(module, from_torch(module), inputs, {"key_padding_mask": kpm},
                           {"key_padding_mask": torch.tensor(kpm)})
