"""Sparse top-k attention (sparse.py): against an independent torch float64 implementation of
FlashMLA's reference (ref_sparse_attn_fwd: gather the listed keys, -1 and out-of-range indices
masked, topk_length, a repeated index gathered twice) with autograd's backward; the blocked
form and threads equal to the textbook's; forward mode against torch.func.jvp; complex step; NSA's blocks;
memory; bad input."""
import math
import tracemalloc

import numpy as np
import pytest
from optional import TORCH_REASON

import numpy_attention as na
from numpy_attention.sparse import block_indices

RNG = np.random.default_rng(31)


def inputs(batch=2, h_kv=2, groups=2, n_q=7, n_k=13, d=8, top=6, per_query_head=False):
    q = RNG.standard_normal((batch, h_kv * groups, n_q, d))
    k, v = RNG.standard_normal((batch, h_kv, n_k, d)), RNG.standard_normal((batch, h_kv, n_k, d))
    heads = h_kv * groups if per_query_head else h_kv
    indices = RNG.integers(-1, n_k + 2, (batch, heads, n_q, top))    # -1 and n_k, n_k + 1 pad
    indices[..., 0, 1] = indices[..., 0, 0] = 3                        # a key listed twice
    indices[..., 1, :] = -1                                            # a row with no key
    return q, k, v, indices


def torch_sparse(torch, q, k, v, indices, scale, topk_length=None):
    """FlashMLA's ref_sparse_attn_fwd written in torch float64 for [B, H, N_q, d] and indices of
    kv heads or query heads: (out, lse, max_logits); lse -inf and out 0 for a row with no key."""
    b, h, n_q, _ = q.shape
    n_k = k.shape[-2]
    idx = torch.as_tensor(indices)
    if idx.shape[1] != h:
        idx = idx.repeat_interleave(h // idx.shape[1], dim=1)
    invalid = (idx < 0) | (idx >= n_k)
    if topk_length is not None:
        invalid |= torch.arange(idx.shape[-1]) >= torch.as_tensor(topk_length)[:, None, :, None]
    safe = torch.where(invalid, torch.zeros_like(idx), idx)
    kv_head = torch.arange(h) // (h // k.shape[1])
    gather = lambda x: x[torch.arange(b)[:, None, None, None], kv_head[None, :, None, None], safe]
    s = torch.einsum("bhqd,bhqkd->bhqk", q, gather(k)) * scale
    s = s.masked_fill(invalid, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    p = p.masked_fill(invalid, 0)
    out = torch.einsum("bhqk,bhqkd->bhqd", p, gather(v))
    return out, lse, s.max(dim=-1).values


@pytest.mark.parametrize("per_query_head", [False, True], ids=["kv-head-lists", "query-head-lists"])
@pytest.mark.parametrize("block_rows", [7, 3], ids=["textbook", "blocks"])
def test_against_an_independent_torch_float64_reference(per_query_head, block_rows):
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    q, k, v, indices = inputs(per_query_head=per_query_head)
    topk_length = RNG.integers(0, 7, (2, 7))
    dout = RNG.standard_normal((2, 4, 7, 8))
    out, lse, top, cache = na.sparse_attention_forward(q, k, v, indices, topk_length=topk_length,
                                                       block_rows=block_rows)
    grads = na.sparse_attention_backward(dout, cache)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    t_out, t_lse, t_top = torch_sparse(torch, tq, tk, tv, indices, 1 / math.sqrt(8), topk_length)
    t_out.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=0, atol=1e-13)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(t_lse.detach().numpy()))
    np.testing.assert_allclose(lse[np.isfinite(lse)], t_lse.detach().numpy()[np.isfinite(lse)], rtol=0, atol=1e-13)
    np.testing.assert_allclose(top, t_top.detach().numpy(), rtol=0, atol=1e-13)
    for ours, theirs in zip(grads, (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=1e-12)
    assert np.isneginf(lse[:, :, 1]).all() and not out[:, :, 1].any()      # the row with no key


def results(q, k, v, indices, dout, dots, **plan):
    """Forward, backward and JVP of one plan (block_rows, workers, scheduler), as a list."""
    topk_length = np.arange(q.shape[-2] * q.shape[0]).reshape(q.shape[0], -1) % 7
    out, lse, top, cache = na.sparse_attention_forward(q, k, v, indices, topk_length=topk_length, **plan)
    jvp = na.sparse_attention_jvp(q, k, v, indices, *dots, topk_length=topk_length, **plan)
    return [out, lse, top, *na.sparse_attention_backward(dout, cache), *jvp]


@pytest.mark.parametrize("per_query_head", [False, True], ids=["kv-head-lists", "query-head-lists"])
def test_blocks_and_threads_equal_the_textbook_and_the_bits_do_not_depend_on_the_workers(per_query_head):
    """Blocks of rows on threads are the textbook's (all rows at once, one thread) within 1e-13,
    and bitwise the same on 1 or 3 threads (a task per block; dk, dv summed by one task per
    (batch index, kv head) in order)."""
    q, k, v, indices = inputs(per_query_head=per_query_head, n_q=23)
    dout, dots = RNG.standard_normal(q.shape[:-1] + (8,)), [RNG.standard_normal(x.shape) for x in (q, k, v)]
    textbook = results(q, k, v, indices, dout, dots, block_rows=23, workers=1)
    one, three = (results(q, k, v, indices, dout, dots, block_rows=4, workers=n) for n in (1, 3))
    for a, b, c in zip(textbook, one, three):
        np.testing.assert_array_equal(b, c)
        finite = np.isfinite(a)
        np.testing.assert_array_equal(finite, np.isfinite(b))
        np.testing.assert_allclose(b[finite], a[finite], rtol=0, atol=1e-13)


def test_leading_axes_and_one_head_keep_their_shapes():
    q, k, v, indices = inputs(batch=6)
    shaped = [x.reshape((2, 3) + x.shape[1:]) for x in (q, k, v, indices)]
    out, lse, top, cache = na.sparse_attention_forward(*shaped, workers=2)
    flat = na.sparse_attention_forward(q, k, v, indices)
    for a, b in zip((out, lse, top), flat[:3]):
        assert a.shape == (2, 3) + b.shape[1:]
        np.testing.assert_array_equal(a.reshape(b.shape), b)
    grads = na.sparse_attention_backward(out, cache)
    assert [g.shape for g in grads] == [x.shape for x in shaped[:3]]
    one = na.sparse_attention_forward(q[0, 0], k[0, 0], v[0, 0], indices[0, 0])
    np.testing.assert_array_equal(one[0], flat[0][0, 0])
    assert na.sparse_attention_backward(one[0], one[3]).dk.shape == k[0, 0].shape


@pytest.mark.parametrize("fully_masked", ["zero", "uniform", "nan"])
def test_a_row_with_no_key_follows_fully_masked_as_dense_attention_does(fully_masked):
    """Rows whose lists hold no key (all -1, out of range or past topk_length) give what dense
    attention with the lists' keep-mask gives under the same policy: out, lse, gradients, tangents
    (NaN where it has NaN)."""
    from numpy_attention.oracle.case import topk_keep
    q, k, v, indices = inputs()
    indices[0, 1, 4] = -1
    dout, dots = RNG.standard_normal(q.shape), [RNG.standard_normal(x.shape) for x in (q, k, v)]
    out, lse, _, cache = na.sparse_attention_forward(q, k, v, indices, fully_masked=fully_masked, block_rows=3)
    grads = na.sparse_attention_backward(dout, cache)
    jvp = na.sparse_attention_jvp(q, k, v, indices, *dots, fully_masked=fully_masked, workers=2)
    keep = topk_keep(indices, None, q.shape, k.shape)
    dense_out, dense_cache = na.attention_forward(q, k, v, fully_masked=fully_masked, **keep)
    dense = na.attention_backward(dout, dense_cache)
    dense_jvp = na.attention_jvp(q, k, v, *dots, fully_masked=fully_masked, implementation="textbook", **keep)
    pairs = [(out, dense_out), (lse, dense_cache.lse), (jvp[1], dense_jvp[1]), (jvp[3], dense_jvp[3]),
             *zip(grads, (dense.dq, dense.dk, dense.dv))]
    for ours, theirs in pairs:
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-13)      # NaN where theirs is NaN
    assert np.isneginf(lse[:, :, 1]).all() and (fully_masked != "nan") == np.isfinite(out[:, :, 1]).all()


def test_a_key_listed_twice_counts_twice_and_its_gradient_sums_every_use():
    """Listing key 3 twice is attention over [3, 3, ...]: twice its weight, and dk, dv of key 3 get
    both entries' shares (a backward that assigns instead of adding loses one)."""
    q, k, v = (RNG.standard_normal((1, 1, 1, 4)), RNG.standard_normal((1, 1, 5, 4)), RNG.standard_normal((1, 1, 5, 4)))
    dout = RNG.standard_normal((1, 1, 1, 4))
    twice = np.array([[[[3, 3, 1]]]])
    out, _, _, cache = na.sparse_attention_forward(q, k, v, twice)
    dense_bias = np.full((1, 1, 1, 5), -np.inf)
    dense_bias[..., 1], dense_bias[..., 3] = 0.0, math.log(2)           # key 3 with twice the weight
    dense, dense_cache = na.attention_forward(q, k, v, bias=dense_bias)
    np.testing.assert_allclose(out, dense, rtol=0, atol=1e-15)
    g, dense_g = na.sparse_attention_backward(dout, cache), na.attention_backward(dout, dense_cache)
    for ours, theirs in zip(g, (dense_g.dq, dense_g.dk, dense_g.dv)):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-14)


def test_forward_mode_against_torch_func_jvp():
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    q, k, v, indices = inputs()
    dots = [RNG.standard_normal(x.shape) for x in (q, k, v)]
    _, out_dot, _, lse_dot = na.sparse_attention_jvp(q, k, v, indices, *dots, block_rows=4)
    f = lambda a, b, c: torch_sparse(torch, a, b, c, indices, 1 / math.sqrt(8))[:2]
    _, (t_out_dot, t_lse_dot) = torch.func.jvp(f, tuple(map(torch.from_numpy, (q, k, v))),
                                               tuple(map(torch.from_numpy, dots)))
    np.testing.assert_allclose(out_dot, t_out_dot.numpy(), rtol=0, atol=1e-12)
    finite = np.isfinite(t_lse_dot.numpy())
    np.testing.assert_allclose(lse_dot[finite], t_lse_dot.numpy()[finite], rtol=0, atol=1e-12)


def test_complex_step_gradcheck():
    q, k, v, indices = inputs(batch=1, h_kv=1, n_q=4, n_k=6, d=3, top=4)
    forward = lambda q, k, v: (lambda r: (r[0], r[3]))(na.sparse_attention_forward(q, k, v, indices, block_rows=2))
    report = na.gradcheck(forward, na.sparse_attention_backward, [q, k, v], method="complex")
    assert report and max(row.max_rel_err for row in report.rows) <= 1e-13, report


def test_nsa_block_indices_select_whole_blocks():
    """Blocks [0, 2] of size 4 over 10 keys: tokens 0-3 and 8-9 (the last block cut at N_k); a -1
    block pads its whole block."""
    tokens = block_indices(np.array([[0, 2, -1]]), 4, 10)
    np.testing.assert_array_equal(tokens, [[0, 1, 2, 3, 8, 9, -1, -1, -1, -1, -1, -1]])


def test_memory_holds_a_block_of_gathered_keys_not_the_scores():
    """N_q = N_k = 4096, K = 256, one head: the forward and backward's peak is within 1.5x of q, k,
    v and the indices themselves, with blocks of 16 rows (benchmarks/bench_sparse.py measures
    N = 32768, K = 2048 with the default blocks)."""
    n, top, d = 4096, 256, 32
    q, k, v = (RNG.standard_normal((1, 1, n, d)) for _ in range(3))
    indices = RNG.integers(0, n, (1, 1, n, top)).astype(np.int32)
    own = sum(x.nbytes for x in (q, k, v, indices))
    tracemalloc.start()
    out, _, _, cache = na.sparse_attention_forward(q, k, v, indices, block_rows=16)
    na.sparse_attention_backward(out, cache)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak <= 1.5 * own, (peak / 2 ** 20, own / 2 ** 20)


@pytest.mark.parametrize("change, error, words", [
    ({"indices": np.zeros((2, 3, 7, 6), int)}, ValueError, r"indices must be \[\.\.\., H_kv or H, N_q, K\]"),
    ({"indices": np.zeros((2, 2, 7, 6))}, TypeError, "indices must be integers"),
    ({"topk_length": np.zeros((2, 6), int)}, ValueError, r"topk_length must be integers \[\.\.\., N_q\]"),
    ({"block_rows": 0}, ValueError, "block_rows must be a positive integer or None"),
    ({"workers": 0}, ValueError, "workers must be a positive integer"),
    ({"fully_masked": "skip"}, ValueError, "fully_masked must be one of"),
    ({"scheduler": 8786}, TypeError, "scheduler must be a dask.distributed Client or a scheduler's address"),
    ({"k": np.zeros((2, 3, 13, 8))}, ValueError, "H_kv must divide H"),
])
def test_bad_input_is_refused_by_name(change, error, words):
    q, k, v, indices = inputs()
    arguments = {"q": q, "k": k, "v": v, "indices": indices, **change}
    with pytest.raises(error, match=words):
        na.sparse_attention_forward(**arguments)
