"""Packed variable-length batches (cu_seqlens_q, cu_seqlens_k, seqused_k): equal to running each
sequence alone, forward and backward, in every engine and with causal (both alignments), window,
grouped-query heads, ALiBi, sinks and zero-length sequences; complex step on the whole Jacobian."""
import numpy as np
import pytest
from layouts import CU_K, CU_Q, LEN_Q, USED, packed_inputs

import numpy_attention as na

SLOPES, SINKS = np.array([0.5, 0.25, 0.125, 0.0625]), np.array([0.3, -1.0, 0.0, 2.0])
OPTIONS = {
    "plain": {},
    "causal bottom_right, window, GQA": {"causal": "bottom_right", "window": (2, 0)},
    "causal top_left": {"causal": True},
    "ALiBi": {"alibi_slopes": SLOPES},
    "sinks, causal": {"sinks": SINKS, "causal": True},
    "ALiBi, sinks, window": {"alibi_slopes": SLOPES, "sinks": SINKS, "window": (1, 1)},
}


def one_by_one(q, k, v, dout, options):
    """out, dq, dk, dv of each sequence alone (its used keys only), packed again."""
    out, dq, dk, dv = np.zeros(dout.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(len(LEN_Q)):
        rows, keys = slice(CU_Q[b], CU_Q[b + 1]), slice(CU_K[b], CU_K[b] + USED[b])
        out[:, rows], cache = na.attention_forward(q[:, rows], k[:, keys], v[:, keys], **options)
        grads = na.attention_backward(dout[:, rows], cache)
        dq[:, rows], dk[:, keys], dv[:, keys] = grads.dq, grads.dk, grads.dv
    return out, dq, dk, dv


@pytest.mark.parametrize("implementation", ["textbook", "blocked", "tiled"])
@pytest.mark.parametrize("option", OPTIONS)
def test_packed_equals_each_sequence_alone(implementation, option):
    q, k, v, dout, _ = packed_inputs()
    out, cache = na.attention_forward(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, seqused_k=USED,
                                      implementation=implementation, **OPTIONS[option])
    grads = na.attention_backward(dout, cache)
    for got, want in zip((out, grads.dq, grads.dk, grads.dv), one_by_one(q, k, v, dout, OPTIONS[option])):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-14 * max(1, np.abs(want).max()))


@pytest.mark.parametrize("option", OPTIONS)
def test_packed_equals_complex_step(option):
    q, k, v, _, _ = packed_inputs(1)
    per_head = [n for n in ("alibi_slopes", "sinks") if n in OPTIONS[option]]
    fixed = {n: x for n, x in OPTIONS[option].items() if n not in per_head}

    def forward(q, k, v, *heads):
        return na.attention_forward(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, seqused_k=USED,
                                    **fixed, **dict(zip(per_head, heads)))

    def backward(dout, cache):
        grads = na.attention_backward(dout, cache)
        return [grads.dq, grads.dk, grads.dv] + [getattr(grads, "d" + n) for n in per_head]
    report = na.gradcheck(forward, backward, [q, k, v] + [OPTIONS[option][n] for n in per_head], method="complex")
    assert report, report


def test_a_zero_length_sequence_and_unused_keys_get_no_gradient():
    q, k, v, dout, _ = packed_inputs(2)
    _, cache = na.attention_forward(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, seqused_k=USED)
    grads = na.attention_backward(dout, cache)
    unused = np.concatenate([np.arange(CU_K[b] + USED[b], CU_K[b + 1]) for b in range(4)])
    assert (grads.dk[:, unused] == 0).all() and (grads.dv[:, unused] == 0).all()
    keys_of_empty = slice(CU_K[1], CU_K[2])                          # sequence 1 has no query
    assert (grads.dk[:, keys_of_empty] == 0).all()


def test_against_torch_float64_per_sequence(torch):
    q, k, v, dout, _ = packed_inputs(3)
    out, cache = na.attention_forward(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, seqused_k=USED,
                                      causal="bottom_right", alibi_slopes=SLOPES)
    grads = na.attention_backward(dout, cache)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    outs = []
    for b in range(4):
        n_q, n_k = LEN_Q[b], USED[b]
        qb = tq[:, CU_Q[b]:CU_Q[b + 1]]
        kb, vb = (t[:, CU_K[b]:CU_K[b] + n_k].repeat_interleave(2, dim=0) for t in (tk, tv))
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        s = qb @ kb.transpose(-1, -2) / np.sqrt(3) - torch.tensor(SLOPES)[:, None, None] * (i + n_k - n_q - j).abs()
        s = s.masked_fill(j > i + n_k - n_q, float("-inf"))
        dead = torch.isinf(s).all(-1, keepdim=True)                 # a row with no key: 0 (safe softmax)
        outs.append(torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0) @ vb)
    (torch.cat(outs, dim=1) * torch.tensor(dout)).sum().backward()
    np.testing.assert_allclose(out, torch.cat(outs, dim=1).detach().numpy(), rtol=1e-13, atol=1e-14)
    for ours, theirs in ((grads.dq, tq), (grads.dk, tk), (grads.dv, tv)):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"cu_seqlens_q": CU_Q}, ValueError, "need both cu_seqlens_q and cu_seqlens_k"),
    ({"seqused_k": USED}, ValueError, "seqused_k needs cu_seqlens_q and cu_seqlens_k"),
    ({"cu_seqlens_q": CU_Q[:-1], "cu_seqlens_k": CU_K}, ValueError, "cu_seqlens_q must be \\[B \\+ 1\\]"),
    ({"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K[::-1]}, ValueError, "cu_seqlens_k must be"),
    ({"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K[:-1] * 0 + np.array([0, 5, 7, 16])}, ValueError,
     "count the same B \\+ 1 sequences"),
    ({"cu_seqlens_q": CU_Q * 1.0, "cu_seqlens_k": CU_K}, TypeError, "cu_seqlens_q must be an integer array"),
    ({"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K, "seqused_k": [4, 3, 3, 6]}, ValueError,
     "seqused_k must have 0 <= seqused_k\\[b\\] <= sequence b's key length, got seqused_k\\[1\\] = 3 where"),
    ({"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K, "seqused_k": [4, 3, 3]}, ValueError,
     "seqused_k must be \\[B\\] = \\(4,\\)"),
])
def test_bad_packed_sequences_are_refused(kwargs, exc, message):
    q, k, v, _, _ = packed_inputs()
    with pytest.raises(exc, match=message):
        na.attention_forward(q, k, v, **kwargs)


def test_packed_sequences_take_no_batch_axes():
    q, k, v, _, _ = packed_inputs()
    with pytest.raises(ValueError, match="packed \\[H, total, d\\] with no batch axes"):
        na.attention_forward(q[None], k[None], v[None], cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K)


def test_review_findings_on_packed_sequences():
    """A packed row with every key masked cannot be 'uniform' (it would spread over every
    sequence); a paged cache's dlse may be packed like cache.lse or in the caller's layout."""
    q, k, v, _, _ = packed_inputs()
    with pytest.raises(ValueError, match="fully_masked='uniform' would spread a row"):
        na.attention_forward(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, fully_masked="uniform")
    rng = np.random.default_rng(9)
    q4, k_cache, v_cache = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((3, 1, 4, 4)), rng.standard_normal((3, 1, 4, 4))
    out, cache = na.attention_forward(q4, k_cache, v_cache, page_table=[[0, 1], [2, 0]], cache_seqlens=[5, 2])
    packed_dlse, dlse = rng.standard_normal(cache.lse.shape), None
    dlse = np.moveaxis(packed_dlse.reshape(2, 2, 3), 1, 0)          # the same, as [B, H, N_q]
    a = na.attention_backward(np.ones(out.shape), cache, packed_dlse)
    b = na.attention_backward(np.ones(out.shape), cache, dlse)
    np.testing.assert_array_equal(a.dq, b.dq)
