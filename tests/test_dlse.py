"""The gradient through lse: attention_backward(dout, cache, dlse) differentiates a loss on
both out and lse (lse_i = log sum_j exp(S_ij), so d lse / dS = P and D becomes D - dlse)."""
import numpy as np
import pytest
from layouts import grouped_inputs

import numpy_attention as na

RNG = np.random.default_rng(21)
MASK = RNG.random((2, 1, 4, 6)) < 0.6
MASK[1, 0, 2] = False                                            # a fully masked row
OPTIONS = {
    "plain": {},
    "mask with a dead row": {"mask": MASK},
    "causal bottom_right": {"causal": "bottom_right"},
    "bias": {"bias": RNG.standard_normal((4, 4, 6))},
    "window": {"window": (1, 2)},
    "softcap": {"softcap": 2.0, "scale": 1.0},
    "dropout": {"dropout_mask": RNG.random((2, 4, 4, 6)) < 0.8, "dropout_p": 0.2},
}
TILED = ("plain", "mask with a dead row", "causal bottom_right", "bias", "window")


def out_and_lse(implementation, options):
    """(forward, backward) of [out, lse] flattened into one output, for gradcheck."""
    def forward(q, k, v):
        out, cache = na.attention_forward(q, k, v, implementation=implementation, **options)
        lse = np.where(np.isneginf(cache.lse.real), 0, cache.lse)        # a dead row's -inf is a constant
        return np.concatenate([out.ravel(), lse.ravel()]), cache

    def backward(d, cache):
        dout, dlse = d[:cache.out.size].reshape(cache.out.shape), d[cache.out.size:].reshape(cache.lse.shape)
        return na.attention_backward(dout, cache, dlse)
    return forward, backward


@pytest.mark.parametrize("implementation, option", [(name, option) for name in ("textbook", "blocked", "tiled")
                                                    for option in (TILED if name == "tiled" else OPTIONS)])
def test_out_and_lse_gradients_equal_complex_step(implementation, option):
    q, k, v, _, _ = grouped_inputs()
    forward, backward = out_and_lse(implementation, OPTIONS[option])
    report = na.gradcheck(forward, backward, [q, k, v], method="complex")
    assert report, report


@pytest.mark.parametrize("implementation", ["blocked", "tiled"])
def test_engines_equal_the_textbook_with_dlse(implementation):
    q, k, v, dout, dlse = grouped_inputs(1)
    grads = {}
    for name in ("textbook", implementation):
        _, cache = na.attention_forward(q, k, v, mask=MASK, causal=True, implementation=name)
        grads[name] = na.attention_backward(dout, cache, dlse)
    for got, want in zip(grads[implementation][:3], grads["textbook"][:3]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13 * np.abs(want).max())


def test_dlse_against_torch_autograd_in_float64(torch):
    q, k, v, dout, dlse = grouped_inputs(2)
    bias = RNG.standard_normal((4, 4, 6))
    out, cache = na.attention_forward(q, k, v, bias=bias, causal=True)
    grads = na.attention_backward(dout, cache, dlse)
    tq, tk, tv, tb = (torch.tensor(x, requires_grad=True) for x in (q, k, v, bias))
    kk, vv = tk.repeat_interleave(2, dim=1), tv.repeat_interleave(2, dim=1)
    s = tq @ kk.transpose(-1, -2) / np.sqrt(3) + tb
    s = s.masked_fill(~torch.ones(4, 6, dtype=torch.bool).tril(), float("-inf"))
    loss = (torch.softmax(s, -1) @ vv * torch.tensor(dout)).sum() + (torch.logsumexp(s, -1) * torch.tensor(dlse)).sum()
    loss.backward()
    for ours, theirs in ((grads.dq, tq), (grads.dk, tk), (grads.dv, tv), (grads.dbias, tb)):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-12, atol=1e-13)


def test_dlse_of_the_wrong_shape_is_refused():
    q, k, v, dout, _ = grouped_inputs()
    _, cache = na.attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"dlse must have lse's shape \(2, 4, 4\)"):
        na.attention_backward(dout, cache, np.zeros((2, 4)))
