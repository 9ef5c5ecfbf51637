"""Sparse top-k attention (sparse_attention.py): against an independent torch float64 implementation of
FlashMLA's reference (ref_sparse_attn_fwd: gather the listed keys, -1 and out-of-range indices
masked, topk_length, a repeated index gathered twice) with autograd's backward; the blocked
form and threads equal to the textbook's; forward mode against torch.func.jvp; complex step; NSA's blocks;
memory; bad input."""
import math
import tracemalloc

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.topk import block_indices

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
def test_against_an_independent_torch_float64_reference(per_query_head, block_rows, torch):
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
    q, k, v, indices = inputs()
    indices[0, 1, 4] = -1
    dout, dots = RNG.standard_normal(q.shape), [RNG.standard_normal(x.shape) for x in (q, k, v)]
    out, lse, _, cache = na.sparse_attention_forward(q, k, v, indices, fully_masked=fully_masked, block_rows=3)
    grads = na.sparse_attention_backward(dout, cache)
    jvp = na.sparse_attention_jvp(q, k, v, indices, *dots, fully_masked=fully_masked, workers=2)
    keep = {"topk_indices": indices}                                  # dense attention over the lists
    dense_out, dense_cache = na.attention_forward(q, k, v, fully_masked=fully_masked, implementation="blocked", **keep)
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


def test_forward_mode_against_torch_func_jvp(torch):
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


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [True, False], ids=["read-only inputs", "writeable inputs"])
def test_memory_holds_a_block_of_gathered_keys_not_the_scores(frozen):
    """N_q = N_k = 4096, K = 256, one head: the forward and backward's peak is within 1.5x of q, k,
    v and the indices themselves, with blocks of 16 rows, plus the cache's copies of them where
    the caller can still write into them (benchmarks/bench_sparse.py measures N = 32768, K = 2048
    with the default blocks)."""
    n, top, d = 4096, 256, 32
    q, k, v = (RNG.standard_normal((1, 1, n, d)) for _ in range(3))
    indices = RNG.integers(0, n, (1, 1, n, top)).astype(np.int32)
    for x in (q, k, v, indices):
        x.flags.writeable = not frozen
    own = sum(x.nbytes for x in (q, k, v, indices))
    tracemalloc.start()
    out, _, _, cache = na.sparse_attention_forward(q, k, v, indices, block_rows=16)
    na.sparse_attention_backward(out, cache)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    copies = 0 if frozen else own
    assert all((held is given) is frozen for held, given in zip(cache[:4], (q, k, v, indices)))
    assert peak <= 1.5 * own + copies, (peak / 2 ** 20, own / 2 ** 20)


@pytest.mark.parametrize("change, error, words", [
    ({"indices": np.zeros((2, 3, 7, 6), int)}, ValueError, r"^indices must be \[\.\.\., H_kv or H, N_q, K\]"),
    ({"indices": np.zeros((2, 2, 7, 6))}, TypeError, "^indices must be integers"),
    ({"topk_length": np.zeros((2, 6), int)}, ValueError, r"topk_length must be integers \[\.\.\., N_q\]"),
    ({"block_rows": 0}, ValueError, "block_rows must be a positive integer or None"),
    ({"workers": 0}, ValueError, "workers must be a positive integer"),
    ({"fully_masked": "skip"}, ValueError, "fully_masked must be one of"),
    ({"scheduler": 8786}, TypeError, "scheduler must be a dask.distributed Client or a scheduler's address"),
    ({"k": np.zeros((2, 3, 13, 8)), "v": np.zeros((2, 3, 13, 8))}, ValueError, "H_kv=3 must divide q's heads H=4"),
    ({"v": np.zeros((2, 3, 13, 8))}, ValueError, r"k and v must have the same heads and length \[\.\.\., H_kv, N_k\]"),
    ({"q": np.zeros((2, 4, 7, 0)), "k": np.zeros((2, 2, 13, 0))}, ValueError, "d_k >= 1"),
    ({"scale": "1"}, TypeError, "scale must be a finite real number > 0, got '1'"),
    ({"scale": True}, TypeError, "scale must be a finite real number > 0, got True"),
    ({"scale": 1j}, TypeError, r"scale must be a finite real number > 0, got 1j"),
    ({"scale": 10 ** 400}, ValueError, "scale must be a finite real number > 0, got an integer of 401 digits"),
    ({"scale": float("nan")}, ValueError, "scale must be a finite real number > 0, got nan"),
])
def test_bad_input_is_refused_by_name(change, error, words):
    q, k, v, indices = inputs()
    arguments = {"q": q, "k": k, "v": v, "indices": indices, **change}
    with pytest.raises(error, match=words):
        na.sparse_attention_forward(**arguments)


def test_a_block_out_of_range_pads_whatever_its_integer_dtype():
    """A block index outside [0, ceil(N_k / block_size)) is padding, as -1 is: 2^30 blocks of 4
    keys (int32: 2^32 wraps to token 0), 2^62 (int64), 2^64 - 1 (uint64), 200 > 127 blocks (int8);
    tokens come back as int64, never float64 (uint64 + int64 is float64 in NumPy)."""
    for blocks, size, n_k in [(np.array([[2 ** 30, 1]], np.int32), 4, 8), (np.array([[2 ** 62, 1]], np.int64), 4, 8),
                              (np.array([[2 ** 64 - 1, 1]], np.uint64), 4, 8), (np.array([[-1, 1]], np.int8), 4, 8)]:
        tokens = block_indices(blocks, size, n_k)
        assert tokens.dtype == np.int64, blocks.dtype
        np.testing.assert_array_equal(tokens, [[-1, -1, -1, -1, 4, 5, 6, 7]])
    many = np.array([[127, 126]], np.int8)
    np.testing.assert_array_equal(block_indices(many, 2, 256), [[254, 255, 252, 253]])
    np.testing.assert_array_equal(block_indices(many, 2, 253), [[-1, -1, 252, -1]])


def test_a_block_larger_than_the_keys_lists_them_once():
    """block_size >= 2^31 with int32 blocks (no overflow) and any block_size > N_k: block 0 is
    every key, each block's width is N_k (the rest of a block could only pad), the others pad."""
    tokens = block_indices(np.array([[0, 1], [1, -1]], np.int32), 2 ** 31, 3)
    np.testing.assert_array_equal(tokens, [[0, 1, 2, -1, -1, -1], [-1, -1, -1, -1, -1, -1]])
    assert block_indices(np.zeros((2, 0), np.int64), 4, 8).shape == (2, 0)
    assert block_indices(np.zeros((2, 3), np.int64), 4, 0).shape == (2, 0)
    with pytest.raises(TypeError, match="block_size must be a positive integer"):
        block_indices(np.zeros((1, 1), int), 2.0, 8)
    with pytest.raises(TypeError, match=r"blocks must be integer block indices \[\.\.\., K\]"):
        block_indices(np.array(3), 2, 8)


def topk_case(blocks, size, fill=None):
    """A crosscheck case of key blocks (q [1, 2, 3, 8], k, v [1, 1, 8, 8]) with the candidate our
    sparse attention over `fill` (default: the blocks' tokens, every out-of-range block padding)."""
    rng = np.random.default_rng(12)
    q, dout = rng.standard_normal((1, 2, 3, 8)), rng.standard_normal((1, 2, 3, 8))
    k, v = rng.standard_normal((1, 1, 8, 8)), rng.standard_normal((1, 1, 8, 8))
    tokens = block_indices(blocks, size, 8) if fill is None else fill
    out, lse, _, cache = na.sparse_attention_forward(q, k, v, tokens)
    g = na.sparse_attention_backward(dout, cache)
    return dict(q=q, k=k, v=v, dout=dout, topk_indices=blocks, topk_block_size=np.array(size), out=out, lse=lse,
                dq=g.dq, dk=g.dk, dv=g.dv)


def test_crosscheck_of_key_blocks_passes_a_padding_kernel_and_fails_a_wrapping_one():
    """Block 2^30 of 4 keys (int32): a kernel that pads it passes; one whose int32 product wraps to
    block 0 (keys 0-3 twice) fails. uint64 blocks and int32 blocks of 2^31 keys are judged too."""
    blocks = np.array([[[[0, 2 ** 30], [1, 0], [2 ** 30, 1]]]], np.int32)
    assert na.crosscheck(**topk_case(blocks, 4))
    wrapped = np.where(blocks == 2 ** 30, 0, blocks)                   # 2^30 * 4 = 2^32 = 0 in int32
    assert not na.crosscheck(**topk_case(blocks, 4, fill=block_indices(wrapped, 4, 8)))
    huge = np.array([[[[0, 2 ** 64 - 1], [1, 0], [2 ** 63, 1]]]], np.uint64)
    assert na.crosscheck(**topk_case(huge, 4))
    assert na.crosscheck(**topk_case(np.array([[[[0, 1], [1, 0], [-1, 0]]]], np.int32), 2 ** 31))


def test_unsigned_indices_out_of_range_pad():
    """uint64 indices 2^63 and 2^64 - 1 pad (as -1 does), not wrap to the last key."""
    q, k, v, _ = inputs(batch=1, h_kv=1, groups=1, n_q=2, n_k=6)
    unsigned = np.array([[[[1, 2 ** 63, 4], [2 ** 64 - 1, 0, 5]]]], np.uint64)
    signed = np.array([[[[1, -1, 4], [-1, 0, 5]]]])
    dout = RNG.standard_normal(q.shape)
    ours, theirs = (na.sparse_attention_forward(q, k, v, lists) for lists in (unsigned, signed))
    for a, b in zip(ours[:3], theirs[:3]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(na.sparse_attention_backward(dout, ours[3]), na.sparse_attention_backward(dout, theirs[3])):
        np.testing.assert_array_equal(a, b)


EMPTY = {      # q, k, v [1, 4, 5, 3] / [1, 2, 6, 3], lists [1, 2, 5, 4] with one axis emptied
    "K = 0": lambda q, k, v, idx: (q, k, v, idx[..., :0]),
    "N_q = 0": lambda q, k, v, idx: (q[..., :0, :], k, v, idx[..., :0, :]),
    "N_k = 0": lambda q, k, v, idx: (q, k[..., :0, :], v[..., :0, :], idx),
    "d_v = 0": lambda q, k, v, idx: (q, k, v[..., :0], idx),
    "B = 0": lambda q, k, v, idx: (q[:0], k[:0], v[:0], idx[:0]),
}


@pytest.mark.parametrize("plan", [{"block_rows": 5, "workers": 1}, {"block_rows": 2, "workers": 1},
                                  {"block_rows": 2, "workers": 3}], ids=["textbook", "blocks", "threads"])
@pytest.mark.parametrize("fully_masked", ["zero", "nan"])
@pytest.mark.parametrize("empty", EMPTY)
def test_an_empty_axis_gives_what_dense_attention_with_the_lists_keep_mask_gives(empty, fully_masked, plan):
    """K, N_q, N_k, d_v or the batch 0: forward, backward and forward mode equal dense attention's
    with the lists' keep-mask (every row without a key where K = 0 or N_k = 0), shapes included."""
    q, k, v, indices = EMPTY[empty](*inputs(batch=1, h_kv=2, groups=2, n_q=5, n_k=6, d=3, top=4))
    dout, dots = RNG.standard_normal(q.shape[:-1] + v.shape[-1:]), [RNG.standard_normal(x.shape) for x in (q, k, v)]
    keep = {"topk_indices": indices}                                  # dense attention over the lists
    if fully_masked == "nan" and empty == "N_k = 0":                  # as dense attention, refused
        for call in (na.sparse_attention_forward, na.attention_forward):
            with pytest.raises(ValueError, match="fully_masked='nan' needs at least one key"):
                call(q, k, v, **({"indices": indices} if call is na.sparse_attention_forward else keep),
                     fully_masked=fully_masked)
        return
    out, lse, _, cache = na.sparse_attention_forward(q, k, v, indices, fully_masked=fully_masked, **plan)
    grads = na.sparse_attention_backward(dout, cache)
    jvp = na.sparse_attention_jvp(q, k, v, indices, *dots, fully_masked=fully_masked, **plan)
    dense_out, dense_cache = na.attention_forward(q, k, v, fully_masked=fully_masked, implementation="blocked", **keep)
    dense = na.attention_backward(dout, dense_cache)
    dense_jvp = na.attention_jvp(q, k, v, *dots, fully_masked=fully_masked, implementation="textbook", **keep)
    pairs = [(out, dense_out), (lse, dense_cache.lse), (jvp[1], dense_jvp[1]), (jvp[3], dense_jvp[3]),
             *zip(grads, (dense.dq, dense.dk, dense.dv))]
    for ours, theirs in pairs:
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-13)      # NaN where theirs is NaN
