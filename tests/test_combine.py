"""Split-KV combine: merging attention over key splits equals attention over all the keys,
forward and backward, in base e and base 2; its own backward equals complex step."""
import numpy as np
import pytest

import numpy_attention as na

SPLITS = [(0, 3), (3, 4), (4, 9)]                     # key ranges of three splits of N_k = 9


def case(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 9, 4)), rng.standard_normal((2, 3, 9, 6))
    return q, k, v, rng.standard_normal((2, 3, 5, 6)), rng.standard_normal((2, 3, 5))


def split_attention(q, k, v, mask, base):
    """Each split's (out, lse, cache), lse in `base`."""
    parts = [na.attention_forward(q, k[..., a:b, :], v[..., a:b, :], mask=mask[..., a:b]) for a, b in SPLITS]
    to_base = 1 if base == "e" else 1 / np.log(2)
    return [(out, cache.lse * to_base, cache) for out, cache in parts]


@pytest.mark.parametrize("base", ["e", 2])
def test_combine_equals_attention_over_all_keys_forward_and_backward(base):
    q, k, v, dout, dlse = case()
    mask = np.ones((5, 9), bool)
    mask[1, :4] = False                              # row 1: the first two splits see no key
    mask[3] = False                                  # row 3: fully masked everywhere
    parts = split_attention(q, k, v, mask, base)
    out, lse, cache = na.combine_forward(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]), base=base)
    want_out, want_cache = na.attention_forward(q, k, v, mask=mask)
    to_base = 1 if base == "e" else 1 / np.log(2)
    np.testing.assert_allclose(out, want_out, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse, want_cache.lse * to_base, rtol=1e-13, atol=1e-14)
    assert np.isneginf(lse[..., 3]).all() and (out[..., 3, :] == 0).all()
    # backward: through the combine, then each split's attention, = the whole attention's
    douts, dlses = na.combine_backward(dout, cache, dlse)
    grads = [na.attention_backward(douts[i], parts[i][2], dlses[i] * to_base) for i in range(len(SPLITS))]
    want = na.attention_backward(dout, want_cache, dlse * to_base)
    np.testing.assert_allclose(sum(g.dq for g in grads), want.dq, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(np.concatenate([g.dk for g in grads], axis=-2), want.dk, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(np.concatenate([g.dv for g in grads], axis=-2), want.dv, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("base", ["e", 2])
def test_combine_backward_equals_complex_step(base):
    rng = np.random.default_rng(1)
    outs, lses = rng.standard_normal((3, 2, 4, 5)), 3 * rng.standard_normal((3, 2, 4))

    def forward(outs, lses):
        out, lse, cache = na.combine_forward(outs, lses, base=base)
        return np.concatenate([out.ravel(), lse.ravel()]), cache

    def backward(d, cache):
        n = cache.out.size
        return na.combine_backward(d[:n].reshape(cache.out.shape), cache, d[n:].reshape(cache.weights.shape[1:]))
    assert na.gradcheck(forward, backward, [outs, lses], method="complex")


def test_combine_against_torch_autograd(torch):
    rng = np.random.default_rng(2)
    outs, lses = rng.standard_normal((4, 3, 6)), rng.standard_normal((4, 3))
    dout, dlse = rng.standard_normal((3, 6)), rng.standard_normal(3)
    to, tl = torch.tensor(outs, requires_grad=True), torch.tensor(lses, requires_grad=True)
    lse = torch.logsumexp(tl, 0)
    out = (torch.exp(tl - lse)[..., None] * to).sum(0)
    ((out * torch.tensor(dout)).sum() + (lse * torch.tensor(dlse)).sum()).backward()
    ours_out, ours_lse, cache = na.combine_forward(outs, lses)
    douts, dlses = na.combine_backward(dout, cache, dlse)
    np.testing.assert_allclose(ours_out, out.detach().numpy(), rtol=1e-13)
    np.testing.assert_allclose(douts, to.grad.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dlses, tl.grad.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("outs, lses, base, message", [
    (np.zeros((2, 3, 4)), np.zeros((2, 4)), "e", "lses .*outs' shape without d"),
    (np.zeros((0, 3, 4)), np.zeros((0, 3)), "e", "at least one split"),
    (np.zeros((2, 3, 4)), np.full((2, 3), np.nan), "e", "NaN or \\+inf"),
    (np.zeros((2, 3, 4)), np.zeros((2, 3)), 10, "base must be 'e' or 2"),
    (np.zeros((2, 3, 4)), np.zeros((2, 3)), True, "base must be 'e' or 2"),
])
def test_bad_partials_are_refused(outs, lses, base, message):
    with pytest.raises(ValueError, match=message):
        na.combine_forward(outs, lses, base=base)


def test_the_older_argument_order_works_with_a_deprecation_warning():
    rng = np.random.default_rng(3)
    outs, lses = rng.standard_normal((3, 2, 4, 5)), rng.standard_normal((3, 2, 4))
    out, lse, cache = na.combine_forward(outs, lses)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    expected = na.combine_backward(dout, cache, dlse)
    for dl in (dlse, None):
        with pytest.warns(DeprecationWarning, match=r"pass \(dout, cache, dlse\)"):
            got = na.combine_backward(dout, dl, cache)
        want = expected if dl is not None else na.combine_backward(dout, cache)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
