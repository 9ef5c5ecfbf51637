"""Honest MLA candidates (the absorbed form) in torch float32 and bfloat16, the way the peers order
the work, with planted bugs, and a sweep of them through crosscheck (tests/test_crosscheck_mla.py;
the longer one: benchmarks/variant_sweeps.py --variant mla).

Two orders, written from the peers' references:
    'eager'     the operations in the dtype, as DeepSeek's model code runs them in torch: scores
                q kv^T times the scale, softmax, times the values kv[..., :r]
    'flashmla'  FlashMLA's reference: q and kv to float32, scores and softmax in float32, out
                = P kv[..., :r] in float32, stored in the dtype
and autograd's backward through either (kv's two uses summed, as a framework sums them). A case
is dense ([B, H, N_q, r + p] queries, [B, 1, N_k, r + p] latent keys, causal bottom-right when
N_q > 1) or a paged latent cache of 64-row pages. The bugs: the values read from kv's last r
columns; the rotary columns' scores not scaled; kv's gradient the keys' alone.
"""
import math

import numpy as np
import torch

import variant_sweeps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BUGS = {"values_last": "the values read from kv's last", "rope_unscaled": "the scores of the rotary columns",
        "keys_gradient_alone": "dkv matches the keys' gradient dk alone"}
PAGE = 64


def attend(q, kv, r, scale, causal, how, bug):
    """One sequence's absorbed attention: q [H, N_q, r + p], kv [N_k, r + p] -> out [H, N_q, r]."""
    p = kv.shape[-1] - r
    work = torch.float32 if how == "flashmla" else q.dtype
    q, kv = q.to(work), kv.to(work)
    values = kv.detach() if bug == "keys_gradient_alone" else kv
    values = values[..., p:] if bug == "values_last" else values[..., :r]
    if bug == "rope_unscaled":
        s = q[..., :r] @ kv[..., :r].T * scale + q[..., r:] @ kv[..., r:].T
    else:
        s = q @ kv.T * scale
    if causal:
        n_q, n_k = s.shape[-2:]
        keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, dim=-1) @ values


def draw(rng):
    r, p = [(32, 16), (64, 16), (128, 64), (512, 64)][int(rng.integers(4))]
    heads = int(rng.choice([1, 2, 4, 16]))
    n_k = int(rng.integers(8, 200))
    return dict(r=r, p=p, heads=heads, batch=int(rng.integers(1, 3)), n_k=n_k,
                n_q=int(rng.choice([1, 1, 2, 4])), paged=bool(rng.integers(3) == 0),
                deepseek_scale=bool(rng.integers(2)), how=["eager", "flashmla"][int(rng.integers(2))])


def mla_case(rng, dtype, bug=None):
    """A crosscheck case (dict) of a torch candidate, honest or with a bug; None never (every bug
    changes every case)."""
    s = draw(rng)
    t = DTYPES[dtype]
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    b, h, n_q, r, p = s["batch"], s["heads"], s["n_q"], s["r"], s["p"]
    lengths = [max(n_q, int(rng.integers(s["n_k"] // 2, s["n_k"] + 1))) for _ in range(b)]
    scale = 1 / math.sqrt(128 + p) if s["deepseek_scale"] else 1 / math.sqrt(r + p)
    q, dout = torch.randn(b, h, n_q, r + p, generator=gen).to(t), torch.randn(b, h, n_q, r, generator=gen).to(t)
    if s["paged"]:
        pages = [-(-n // PAGE) for n in lengths]
        table = np.full((b, max(pages)), -1)
        order = rng.permutation(sum(pages))
        for i, count in enumerate(pages):
            table[i, :count] = order[sum(pages[:i]):sum(pages[:i]) + count]
        kv = torch.randn(sum(pages), 1, PAGE, r + p, generator=gen).to(t)
        rows = lambda x, i: torch.cat([x[page, 0] for page in table[i] if page >= 0])[:lengths[i]]
    else:
        kv = torch.randn(b, 1, max(lengths), r + p, generator=gen).to(t)
        lengths = [kv.shape[-2]] * b
        rows = lambda x, i: x[i, 0]
    tq, tkv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = torch.stack([attend(tq[i], rows(tkv, i), r, scale, n_q > 1, s["how"], bug) for i in range(b)])
    out.to(t).backward(dout)
    arrays = dict(q=q, kv=kv, dout=dout, out=out.detach().to(t), dq=tq.grad, dkv=tkv.grad, head_dim_v=np.array(r))
    if s["deepseek_scale"]:
        arrays["scale"] = np.array(scale)
    if n_q > 1:
        arrays["causal"] = np.array("bottom_right")
    if s["paged"]:
        arrays.update(page_table=table, cache_seqlens=np.array(lengths))
    return arrays


def sweep(cases, seed=0, dtypes=tuple(DTYPES)):
    """variant_sweeps.sweep over this module's cases and bugs."""
    return variant_sweeps.sweep(mla_case, BUGS, cases, seed, dtypes)
