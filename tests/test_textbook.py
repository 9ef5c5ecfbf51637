"""The textbook's first page, the blog's attention in plain NumPy, is what every engine computes:
its forward and backward equal attention_forward / attention_backward on the three engines, and
its backward is the derivative of its forward (complex step, exact to rounding)."""
import numpy as np
import pytest

import numpy_attention as na


def case(seed=0, heads=(2, 3), n_q=7, n_k=9, d_k=5, d_v=4):
    """q, k, v, dout in float64, random normal, the same heads in q, k and v."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(heads + (n_q, d_k)), rng.standard_normal(heads + (n_k, d_k)),
            rng.standard_normal(heads + (n_k, d_v)), rng.standard_normal(heads + (n_q, d_v)))


def relative(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("implementation", ["textbook", "blocked", "tiled"])
def test_the_plain_form_is_every_engine(implementation):
    q, k, v, dout = case()
    out, P = na.plain_attention_forward(q, k, v)
    engine_out, cache = na.attention_forward(q, k, v, implementation=implementation)
    assert relative(out, engine_out) < 1e-14
    grads = na.attention_backward(dout, cache)
    for mine, theirs in zip(na.plain_attention_backward(dout, q, k, v, P), (grads.dq, grads.dk, grads.dv)):
        assert relative(mine, theirs) < 1e-13


def test_the_plain_form_takes_one_head():
    q, k, v, dout = (x[0, 0] for x in case(1))            # [N, d]: one head
    out, P = na.plain_attention_forward(q, k, v)
    assert out.shape == (7, 4) and P.shape == (7, 9) and np.allclose(P.sum(axis=-1), 1)
    grads = na.attention_backward(dout, na.attention_forward(q, k, v)[1])
    for mine, theirs in zip(na.plain_attention_backward(dout, q, k, v, P), (grads.dq, grads.dk, grads.dv)):
        assert relative(mine, theirs) < 1e-13


def test_the_plain_backward_is_the_forwards_derivative():
    """<dout, d out> along a random direction of each input by complex step (h = 1e-30: no
    cancellation) against <grad, direction> from plain_attention_backward: to 1e-13."""
    q, k, v, dout = case(2)
    rng = np.random.default_rng(3)
    grads = na.plain_attention_backward(dout, q, k, v, na.plain_attention_forward(q, k, v)[1])
    h = 1e-30
    for i, grad in enumerate(grads):
        direction = rng.standard_normal(grad.shape)
        inputs = [q, k, v]
        inputs[i] = inputs[i] + 1j * h * direction
        step = np.sum(dout * na.plain_attention_forward(*inputs)[0].imag) / h
        assert abs(step - np.sum(grad * direction)) <= 1e-13 * abs(step)


def test_the_plain_form_writes_no_input():
    q, k, v, dout = case(4)
    kept = [x.copy() for x in (q, k, v, dout)]
    out, P = na.plain_attention_forward(q, k, v)
    na.plain_attention_backward(dout, q, k, v, P)
    assert all(np.array_equal(x, y) for x, y in zip((q, k, v, dout), kept))


@pytest.mark.parametrize("shapes, named", [
    (((7, 5), (9, 4), (9, 4)), "k must be"),               # d_k of k is not q's
    (((7, 5), (9, 5), (8, 4)), "v must be"),               # v's keys are not k's
    (((5,), (9, 5), (9, 4)), "at least two axes"),
])
def test_the_plain_form_names_a_wrong_shape(shapes, named):
    q, k, v = (np.ones(shape) for shape in shapes)
    with pytest.raises(ValueError, match=named):
        na.plain_attention_forward(q, k, v)


def test_the_plain_backward_names_a_wrong_shape():
    q, k, v, dout = (x[0, 0] for x in case(5))
    out, P = na.plain_attention_forward(q, k, v)
    with pytest.raises(ValueError, match=r"dout must be \(7, 4\)"):
        na.plain_attention_backward(dout[:, :3], q, k, v, P)
    with pytest.raises(ValueError, match=r"P must be \(7, 9\)"):
        na.plain_attention_backward(dout, q, k, v, P.T)
    with pytest.raises(TypeError, match="q must be a numeric"):
        na.plain_attention_forward("q", k, v)
