"""A paged KV cache (page_table, cache_seqlens): equal to attention on each sequence's gathered
keys, with the gradients of the pages summed where pages are shared; complex step on q and both
caches."""
import numpy as np
import pytest
from layouts import LENGTHS, TABLE, gathered, paged_inputs

import numpy_attention as na

@pytest.mark.parametrize("implementation", ["textbook", "blocked", "tiled"])
@pytest.mark.parametrize("options", [{}, {"causal": "bottom_right"}, {"window": (3, 0), "causal": True},
                                     {"alibi_slopes": np.array([0.5, 0.25, 0.1, 0.05]), "sinks": np.ones(4)}])
def test_paged_equals_attention_on_the_gathered_keys(implementation, options):
    q, k_cache, v_cache, dout = paged_inputs()
    out, c = na.attention_forward(q, k_cache, v_cache, page_table=TABLE, cache_seqlens=LENGTHS,
                                  implementation=implementation, **options)
    grads = na.attention_backward(dout, c)
    dk, dv = np.zeros(k_cache.shape), np.zeros(v_cache.shape)
    for b in range(3):
        out_b, c_b = na.attention_forward(q[b], gathered(k_cache, b), gathered(v_cache, b), **options)
        np.testing.assert_allclose(out[b], out_b, rtol=1e-14, atol=1e-15)
        g = na.attention_backward(dout[b], c_b)
        np.testing.assert_allclose(grads.dq[b], g.dq, rtol=1e-13, atol=1e-14)
        for t in range(LENGTHS[b]):                              # each key's gradient, back to its page
            page, row = TABLE[b, t // 4], t % 4
            dk[page, :, row] += g.dk[:, t]
            dv[page, :, row] += g.dv[:, t]
    np.testing.assert_allclose(grads.dk, dk, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(grads.dv, dv, rtol=1e-13, atol=1e-14)
    used = np.zeros((7, 4), bool)                                # (page, row) that some key reads
    for b in range(3):
        used[TABLE[b, np.arange(LENGTHS[b]) // 4], np.arange(LENGTHS[b]) % 4] = True
    assert (grads.dk.transpose(0, 2, 1, 3)[~used] == 0).all() and (grads.dv.transpose(0, 2, 1, 3)[~used] == 0).all()


def test_paged_equals_complex_step():
    q, k_cache, v_cache, _ = paged_inputs(1, d_v=3)
    forward = lambda q, kc, vc: na.attention_forward(q, kc, vc, page_table=TABLE, cache_seqlens=LENGTHS,
                                                     causal="bottom_right")
    assert na.gradcheck(forward, na.attention_backward, [q, k_cache, v_cache], method="complex")


@pytest.mark.parametrize("kwargs, message", [
    ({"page_table": TABLE}, "needs both page_table"),
    ({"page_table": TABLE[:2], "cache_seqlens": LENGTHS}, "page_table must be an integer array \\[B, P\\]"),
    ({"page_table": TABLE, "cache_seqlens": np.array([9, 4, 13])}, "cache_seqlens must be in \\[0, P \\* page\\]"),
    ({"page_table": TABLE + 5, "cache_seqlens": LENGTHS}, "must index k_cache's 7 pages"),
    ({"page_table": TABLE, "cache_seqlens": LENGTHS, "mask": np.ones(3, bool)}, "takes no mask"),
    ({"page_table": TABLE, "cache_seqlens": LENGTHS, "cu_seqlens_k": np.array([0, 9, 13, 20])},   # (not replaced
     "takes no mask, bias, cu_seqlens"),                                                     # by the pages')
])
def test_bad_paged_arguments_are_refused(kwargs, message):
    q, k_cache, v_cache, _ = paged_inputs()
    with pytest.raises(ValueError, match=message):
        na.attention_forward(q, k_cache, v_cache, **kwargs)
