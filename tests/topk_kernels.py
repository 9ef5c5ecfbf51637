"""Honest sparse top-k attention candidates in torch float32 and bfloat16, the way FlashMLA's
reference orders the work, with planted bugs, and a sweep of them through crosscheck
(tests/test_crosscheck_topk.py; the longer one: benchmarks/variant_sweeps.py --variant topk).

The candidate gathers each query's listed keys and values (index_select on the flattened
tensors; -1 and out-of-range entries read key 0 and are masked), computes the scores, the
softmax and P v over them in float32 and stores out in the dtype (FlashMLA's reference's
order), and autograd's backward scatters the gathered rows' gradients back (index_add, so
every use sums). (gathered_attention's 'eager' order, everything in the dtype, is left out:
crosscheck models a repeated key as a log-multiplicity bias added to the rounded scores, and
in bfloat16 that rounding differs from a kernel's two copies in a few sharp rows.) A case lists key tokens (DeepSeek Sparse Attention) or key blocks with a block
size (NSA's selection). The bugs: every index read one key over; -1 read as the last key (a
gather with negative indexing); a key listed twice getting one use's gradient in the backward
(an assignment where the scatter must add); the block size off by a factor of 2.
"""
import math

import numpy as np
import torch

import variant_sweeps
from numpy_attention.topk import block_indices

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BUGS = {"off_by_one": "the indices read one key over", "minus_one_last": "-1 read as the last key",
        "repeat_dropped_backward": "one use's gradient for each key", "block_size_doubled": "topk_block_size="}


def draw(rng):
    n_k = int(rng.integers(16, 200))
    blocks = bool(rng.integers(3) == 0)
    return dict(batch=int(rng.integers(1, 3)), h_kv=int(rng.integers(1, 3)), groups=int(rng.integers(1, 3)),
                n_q=int(rng.integers(1, 40)), n_k=n_k, d=int(rng.choice([32, 64])),
                top=int(rng.integers(4, 48)), blocks=blocks, block=int(rng.choice([4, 8, 16])),
                per_query_head=bool(rng.integers(4) == 0), how="flashmla")


def gathered_attention(q, k, v, idx, valid, how):
    """out [B, H, N_q, d] over each row's gathered keys; idx [B, H, N_q, K] (valid ones >= 0)."""
    b, h, n_q, _ = q.shape
    groups = h // k.shape[1]
    kv_head = torch.arange(h) // groups
    flat = lambda x: x.reshape(-1, x.shape[-1])                         # [B * H_kv * N_k, d]
    base = (torch.arange(b)[:, None, None, None] * k.shape[1] + kv_head[None, :, None, None]) * k.shape[2]
    rows = (base + idx).reshape(-1)
    k_g = flat(k).index_select(0, rows).reshape(idx.shape + (k.shape[-1],))
    v_g = flat(v).index_select(0, rows).reshape(idx.shape + (v.shape[-1],))
    work = torch.float32 if how == "flashmla" else q.dtype
    s = torch.einsum("bhqd,bhqkd->bhqk", q.to(work), k_g.to(work)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~valid, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhqkd->bhqd", p, v_g.to(work)).to(q.dtype)


def topk_case(rng, dtype, bug=None):
    """A crosscheck case (dict), honest or with a bug; None where the bug changes nothing."""
    s = draw(rng)
    if bug == "block_size_doubled" and not s["blocks"]:
        return None
    t = DTYPES[dtype]
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    b, h_kv, h, n_q, n_k, d = s["batch"], s["h_kv"], s["h_kv"] * s["groups"], s["n_q"], s["n_k"], s["d"]
    q, dout = (torch.randn(b, h, n_q, d, generator=gen).to(t) for _ in range(2))
    k, v = (torch.randn(b, h_kv, n_k, d, generator=gen).to(t) for _ in range(2))
    heads = h if s["per_query_head"] else h_kv
    if s["blocks"]:
        n_blocks = -(-n_k // s["block"])
        listed = np.stack([np.stack([np.stack([rng.permutation(n_blocks)[:max(1, s["top"] // s["block"])]
                                               for _ in range(n_q)]) for _ in range(heads)]) for _ in range(b)])
        listed[..., -1][rng.random(listed.shape[:-1]) < 0.2] = -1       # some rows list one block fewer
        size = s["block"] * (2 if bug == "block_size_doubled" else 1)
        tokens = block_indices(listed, size, n_k)
    else:
        listed = rng.integers(-1, n_k, (b, heads, n_q, s["top"]))         # repeats and -1 pads
        tokens = listed
    if bug == "repeat_dropped_backward" and not _repeats(tokens):
        return None
    if bug == "minus_one_last" and not (tokens == -1).any():
        return None
    idx = torch.as_tensor(tokens)
    if heads != h:
        idx = idx.repeat_interleave(s["groups"], dim=1)
    valid = (idx >= 0) & (idx < n_k)
    if bug == "off_by_one":
        idx = torch.where(valid, idx + 1, idx)
        valid = (idx >= 0) & (idx < n_k)
    elif bug == "minus_one_last":
        idx, valid = torch.where(idx == -1, n_k - 1, idx), valid | (idx == -1)
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = gathered_attention(*leaves, safe, valid, s["how"])
    out.backward(dout)
    dk, dv = leaves[1].grad, leaves[2].grad
    if bug == "repeat_dropped_backward":
        dk, dv = (_assigned(x, leaves[0], k, v, safe, valid, dout, s["how"], name) for x, name in ((dk, "k"), (dv, "v")))
    arrays = dict(q=q, k=k, v=v, dout=dout, out=out.detach(), dq=leaves[0].grad, dk=dk, dv=dv,
                  topk_indices=listed)
    if s["blocks"]:
        arrays["topk_block_size"] = np.array(s["block"])
    return arrays


def _repeats(tokens):
    """Whether some row lists a valid key more than once."""
    ordered = np.sort(np.where(tokens >= 0, tokens, -np.arange(1, tokens.shape[-1] + 1)), axis=-1)
    return bool((np.diff(ordered, axis=-1) == 0).any())


def _assigned(grad, q, k, v, safe, valid, dout, how, name):
    """k's or v's gradient where each gathered row's gradient is written, not added, to its key:
    a key listed several times keeps one use's (the scatter of a buggy backward)."""
    k_g = k.detach().reshape(-1, k.shape[-1])
    b, h, n_q, _ = q.shape
    base = (torch.arange(b)[:, None, None, None] * k.shape[1]
            + (torch.arange(h) // (h // k.shape[1]))[None, :, None, None]) * k.shape[2]
    rows = (base + safe).reshape(-1)
    source = (k if name == "k" else v).detach().reshape(-1, k.shape[-1])
    picked = source.index_select(0, rows).reshape(safe.shape + (k.shape[-1],)).requires_grad_()
    other = (v if name == "k" else k).detach().reshape(-1, k.shape[-1]).index_select(0, rows).reshape(picked.shape)
    k_in, v_in = (picked, other) if name == "k" else (other, picked)
    work = torch.float32 if how == "flashmla" else q.dtype
    s = torch.einsum("bhqd,bhqkd->bhqk", q.detach().to(work), k_in.to(work)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~valid, -math.inf), dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bhqkd->bhqd", p, v_in.to(work)).to(q.dtype)
    out.backward(dout)
    per_entry = torch.where(valid[..., None], picked.grad, torch.zeros_like(picked.grad)).reshape(-1, k.shape[-1])
    assigned = torch.zeros_like(k_g)
    assigned[rows[valid.reshape(-1)]] = per_entry[valid.reshape(-1)]   # duplicates: one write survives
    del k_g
    return assigned.reshape(grad.shape).to(grad.dtype)


def sweep(cases, seed=0, dtypes=tuple(DTYPES)):
    """variant_sweeps.sweep over this module's cases and bugs."""
    return variant_sweeps.sweep(topk_case, BUGS, cases, seed, dtypes)
