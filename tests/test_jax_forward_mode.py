"""attention_jvp against jax.jvp on an independent float64 jax.numpy attention, and the
tangents of the gradients against jax's jvp of grad (forward over reverse)."""
import numpy as np
import pytest
from optional import JAX_REASON

import numpy_attention as na

jax = pytest.importorskip("jax", reason=JAX_REASON)
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy


def jax_attention(q, k, v, bias, causal):
    """softmax(q k^T / sqrt(d) + bias, causal top-left, GQA by repeating k, v) v, and lse."""
    k, v = (jnp.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))
    s = q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(q.shape[-1]) + bias
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1) @ v, jax.nn.logsumexp(s, axis=-1)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_attention_jvp_equals_jax_jvp(causal):
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 4, 5, 3)), rng.standard_normal((2, 2, 7, 3)), rng.standard_normal((2, 2, 7, 2))
    bias = rng.standard_normal((4, 5, 7))
    tangents = [rng.standard_normal(x.shape) for x in (q, k, v)]
    (out, lse), (out_dot, lse_dot) = jax.jvp(lambda q, k, v: jax_attention(q, k, v, bias, causal),
                                             (q, k, v), tuple(tangents))
    ours = na.attention_jvp(q, k, v, *tangents, bias=bias, causal=causal)
    for got, want in zip(ours, (out, out_dot, lse, lse_dot)):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-12, atol=1e-13)


@pytest.mark.slow
def test_attention_hvp_equals_jax_jvp_of_grad():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((1, 4, 6, 3)), rng.standard_normal((1, 2, 6, 3)), rng.standard_normal((1, 2, 6, 2))
    dout = rng.standard_normal((1, 4, 6, 2))
    tangents = [rng.standard_normal(x.shape) for x in (q, k, v)]
    loss = lambda q, k, v: jnp.sum(jax_attention(q, k, v, 0.0, True)[0] * dout)
    _, hvp = jax.jvp(jax.grad(loss, argnums=(0, 1, 2)), (q, k, v), tuple(tangents))
    _, grads_dot = na.attention_hvp(q, k, v, dout, *tangents, causal=True)
    for got, want in zip(grads_dot[:3], hvp):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-12, atol=1e-13)
