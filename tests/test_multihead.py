"""MultiHeadAttention on its own: gradients by complex step, initialization, state_dict, dtype.

Against the seed's PyTorch class and torch.nn.MultiheadAttention: test_torch_multihead.py."""
import numpy as np
import pytest

import numpy_attention as na


@pytest.mark.parametrize("implementation", ["textbook", "blocked"])
def test_kdim_vdim_gradients_against_complex_step(implementation):
    """multihead_forward with D = 6, kdim = 4, vdim = 3, a mask: the whole Jacobian of every
    input, on the textbook pair and on the threaded engine."""
    rng = np.random.default_rng(11)
    mha = na.MultiHeadAttention(6, 2, kdim=4, vdim=3, seed=2)
    keys = list(mha.params)
    mask = rng.random((2, 1, 3, 5)) < 0.7
    mask[..., 0] = True

    def forward(query, key, value, *params):
        out, _, cache = na.multihead_forward(query, key, value, dict(zip(keys, params)), 2, mask=mask,
                                             implementation=implementation)
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


def test_the_textbook_pair_is_the_five_steps_and_the_threads_equal_it():
    """textbook_multihead_forward / _backward are the ops' own functions in the docstring's order
    (the same values as calling them by hand); the default engine, on threads, equals them to
    rounding, with kdim / vdim, causal masking and a bias."""
    rng = np.random.default_rng(13)
    mha = na.MultiHeadAttention(8, 2, kdim=6, vdim=5, seed=4)
    query, key, value = (rng.standard_normal(s) for s in ((2, 4, 8), (2, 7, 6), (2, 7, 5)))
    bias, dout = rng.standard_normal((2, 4, 7)), rng.standard_normal((2, 4, 8))
    options = dict(causal="bottom_right", bias=bias)
    runs = {}
    for implementation, workers in (("textbook", None), ("blocked", 1), ("blocked", 2)):
        out, weights, cache = na.multihead_forward(query, key, value, mha.params, 2, implementation=implementation,
                                                   workers=workers, **options)
        runs[implementation, workers] = {"out": out, "weights": weights, **na.multihead_backward(dout, cache)}
    W = {n: mha.params[f"W_{n}.weight"].T for n in "qkvo"}
    b = {n: mha.params[f"W_{n}.bias"] for n in "qkvo"}
    heads = [na.split_heads(x @ W[n] + b[n], 2) for n, x in zip("qkv", (query, key, value))]
    by_hand = na.merge_heads(na.attention_forward(*heads, implementation="textbook", **options)[0]) @ W["o"] + b["o"]
    textbook = runs["textbook", None]
    np.testing.assert_allclose(textbook["out"], by_hand, rtol=1e-14, atol=1e-14)
    for name, x in runs["blocked", 1].items():
        assert np.array_equal(x, runs["blocked", 2][name]), name              # any workers: the same bits
        assert np.linalg.norm(x - textbook[name]) <= 1e-13 * np.linalg.norm(textbook[name]), name
    assert set(textbook) == set(runs["blocked", 1]) and "bias" in textbook


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
