"""The three backward forms agree, and each per-stage tensor is the truth torch autograd finds.

    'jacobian'  dS = J dP, J = diag(P) - P P^T
    'vjp'       dS = P * (dP - rowsum(P * dP))
    'flash'     dS = exp(S - lse) * (dP - D),  D = rowsum(dout * out)
"""
import numpy as np
import pytest

from numpy_attention import attention_backward, attention_forward

VARIANTS = {
    "plain": {},
    "mask with a fully masked row": {"mask": np.array([[1, 1, 0, 1, 0, 1]] * 2 + [[0] * 6] + [[1, 0, 0, 0, 0, 0]], bool)},
    "bias": {"bias": "random"},
    "causal bottom_right": {"causal": "bottom_right"},
    "window": {"window": (1, 2)},
    "softcap": {"softcap": 2.0},
    "dropout": {"dropout_mask": "random", "dropout_p": 0.25},
    "uniform policy": {"mask": np.array([[1] * 6, [0] * 6, [1] * 6, [1] * 6], bool), "fully_masked": "uniform"},
}


def _inputs(rng, options, gqa=True):
    q = 2 * rng.standard_normal((2, 4, 4, 5))
    kv_heads = 2 if gqa else 4
    k, v = rng.standard_normal((2, kv_heads, 6, 5)), rng.standard_normal((2, kv_heads, 6, 3))
    options = {name: (rng.standard_normal((4, 4, 6)) if name == "bias" else rng.random((2, 4, 4, 6)) < 0.7)
               if isinstance(x, str) and x == "random" else x for name, x in options.items()}
    return q, k, v, rng.standard_normal((2, 4, 4, 3)), options


@pytest.mark.parametrize("variant", VARIANTS)
def test_three_forms_agree_to_1e_13(variant):
    q, k, v, dout, options = _inputs(np.random.default_rng(0), VARIANTS[variant])
    _, cache = attention_forward(q, k, v, **options)
    grads = {m: attention_backward(dout, cache, method=m, return_stages=True) for m in ("vjp", "jacobian", "flash")}
    ref = grads["vjp"]
    for method in ("jacobian", "flash"):
        for name in ("dq", "dk", "dv", "dbias"):
            a, b = getattr(grads[method], name), getattr(ref, name)
            if b is None:
                assert a is None
                continue
            assert np.all(np.isfinite(a))
            assert np.max(np.abs(a - b)) <= 1e-13 * max(np.max(np.abs(b)), 1.0), (method, name)
        assert np.max(np.abs(grads[method].stages.dS - ref.stages.dS)) <= 1e-13 * np.max(np.abs(ref.stages.dS))


@pytest.mark.parametrize("variant", ["plain", "bias", "softcap", "mask with a fully masked row"])
def test_D_is_rowsum_of_P_times_dP(variant):
    """D = rowsum(dout * out) = rowsum(P * dP): out = P v, so sum_d dout_d out_d = sum_j P_j (dout . v_j)."""
    q, k, v, dout, options = _inputs(np.random.default_rng(1), VARIANTS[variant])
    _, cache = attention_forward(q, k, v, **options)
    st = attention_backward(dout, cache, return_stages=True).stages
    np.testing.assert_allclose(st.D, np.sum(cache.weights * st.dP, axis=-1), rtol=1e-12, atol=1e-14)


def test_cache_exposes_S_P_and_lse():
    q, k, v, _, options = _inputs(np.random.default_rng(2), VARIANTS["bias"])
    _, cache = attention_forward(q, k, v, **options)
    from scipy.special import logsumexp
    np.testing.assert_allclose(cache.lse, logsumexp(cache.scores, axis=-1), rtol=1e-14)
    np.testing.assert_allclose(cache.weights, np.exp(cache.scores - cache.lse[..., None]), rtol=1e-13)


@pytest.mark.parametrize("variant", ["plain", "bias", "softcap", "dropout"])
def test_stages_are_torch_autograds_intermediate_gradients(variant, torch):
    """dP, dS and D equal the gradients torch finds for P and S (retain_grad), float64."""
    q, k, v, dout, options = _inputs(np.random.default_rng(3), VARIANTS[variant], gqa=False)
    _, cache = attention_forward(q, k, v, **options)
    st = attention_backward(dout, cache, return_stages=True).stages
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    s = tq @ tk.transpose(-1, -2) / np.sqrt(q.shape[-1])
    if "softcap" in options:
        s = options["softcap"] * torch.tanh(s / options["softcap"])
    if "bias" in options:
        s = s + torch.tensor(options["bias"])
    s.retain_grad()
    p = torch.softmax(s, dim=-1)
    p.retain_grad()
    p_drop = p
    if "dropout_mask" in options:
        p_drop = p * torch.tensor(options["dropout_mask"]) / (1 - options["dropout_p"])
    out = p_drop @ tv
    out.backward(torch.tensor(dout))
    np.testing.assert_allclose(st.dP, p.grad.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(st.dS, s.grad.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(st.D, np.sum(dout * out.detach().numpy(), -1), rtol=1e-12, atol=1e-13)
