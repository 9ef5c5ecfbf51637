"""A bfloat16 attention kernel that keeps the softmax's row sum l in bfloat16, everything else as
an honest kernel does: what crosscheck cannot always see (docs/crosscheck.md, "What the rule
cannot see"; benchmarks/row_sum_bf16.py measures it on the real-kernel campaigns' cases).

    results = row_sum_attention(case, kernel, "ltr")      # the tensors `kernel` returns

Forward, q, k, v holding bfloat16 values (float32 arrays), S = scale q k^T with softcap, bias and
ALiBi in float32, -inf where not kept, m = rowmax S, p = exp(S - m) in float32:
    "ltr"        l = bf16(... bf16(bf16(p_1) + p_2) ... + p_N), each key added in bfloat16
    "online128"  FlashAttention's online softmax over blocks of 128 keys, l = bf16(a l + rowsum p)
                 once per block (a = exp(m_old - m_new))
    out = bf16(bf16(p) v / l), lse = m + log l (float32)
"_f32" after either keeps l in float32: the honest control. The gradients, where the kernel
returns them, are FlashAttention's backward from its own out and lse: P = exp(S - lse),
dS = P (dP - D), each product in float32 and each result rounded to bfloat16.
"""
import math

import numpy as np
import torch

import real_kernels as rk

VARIANTS = ("ltr", "online128")


def bf(x):
    """x rounded to bfloat16, held in float32."""
    return x.to(torch.bfloat16).float()


def scores(case, q, k, scale):
    """(S [B, H, N_q, N_k] in float32, -inf where the case keeps no key; tanh of softcap or None)."""
    s = (q @ k.transpose(-1, -2)) * scale
    t = None
    if "softcap" in case:
        t = torch.tanh(s / float(case["softcap"]))
        s = float(case["softcap"]) * t
    n_q, n_k = q.shape[-2], k.shape[-2]
    if "bias" in case:
        s = s + torch.from_numpy(np.asarray(case["bias"], np.float32))
    if "alibi_slopes" in case:
        slopes = torch.from_numpy(np.asarray(case["alibi_slopes"], np.float32))
        s = s - slopes[:, None, None] * (torch.arange(n_q)[:, None] + n_k - n_q - torch.arange(n_k)[None, :]).abs()
    keep = rk.keep_mask(case)
    if keep is not None:
        s = s.masked_fill(~torch.from_numpy(np.ascontiguousarray(keep)), -math.inf)
    return s, t


def softmax_sums(s, v, variant):
    """(bf16(p) v [..., N_q, d_v] before the division, l [..., N_q], m [..., N_q]) of the variant."""
    sum_in = (lambda x: x) if variant.endswith("_f32") else bf
    block = None if variant.startswith("ltr") else int(variant.removesuffix("_f32")[len("online"):])
    if block is None:
        m = s.amax(-1)
        p = torch.exp(s - torch.where(torch.isneginf(m), 0.0, m)[..., None])
        l = torch.zeros_like(m)
        for j in range(s.shape[-1]):
            l = sum_in(l + p[..., j])
        return bf(p) @ v, l, m
    m, l = torch.full(s.shape[:-1], -math.inf), torch.zeros(s.shape[:-1])
    acc = torch.zeros(s.shape[:-1] + v.shape[-1:])
    for c in range(0, s.shape[-1], block):
        m_new = torch.maximum(m, s[..., c:c + block].amax(-1))
        safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
        a = torch.exp(m - safe)
        p = torch.exp(s[..., c:c + block] - safe[..., None])
        l = sum_in(a * l + p.sum(-1))
        acc = a[..., None] * acc + bf(p) @ v[..., c:c + block, :]
        m = m_new
    return acc, l, m


def row_sum_attention(case, kernel, variant):
    """The kernel's results (those real_kernels.KERNELS[kernel] returns) as torch tensors:
    bfloat16, the lse float32 (bfloat16 for jax_xla, as JAX's)."""
    spec = rk.KERNELS[kernel]
    q, k, v, dout = (torch.from_numpy(np.asarray(case[n], np.float32)) for n in ("q", "k", "v", "dout"))
    g = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
    scale = float(case["scale"]) if "scale" in case else 1 / math.sqrt(q.shape[-1])
    s, t = scores(case, q, k, scale)
    acc, l, m = softmax_sums(s, v, variant)
    empty = l == 0
    out = bf(torch.where(empty[..., None], 0.0, acc / torch.where(empty, 1.0, l)[..., None]))
    if str(case.get("fully_masked", "zero")) == "uniform":
        out = torch.where(empty[..., None], bf(v.mean(-2, keepdim=True)).expand_as(out), out)
    lse = torch.where(empty, -math.inf, m + torch.log(torch.where(empty, 1.0, l)))
    results = {"out": out.to(torch.bfloat16)}
    if spec.lse and "fully_masked" not in case:
        results["lse"] = lse.to(torch.bfloat16) if kernel == "jax_xla" else lse
    if not spec.gradients:
        return results
    p = torch.where(torch.isneginf(s) | torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
    dout = bf(dout)
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    dbias = ds
    if t is not None:
        ds = ds * (1 - t * t)
    group = lambda x: x.reshape(x.shape[:-3] + (x.shape[-3] // g, g) + x.shape[-2:]).sum(-3)
    results.update(dq=bf(bf(ds) @ k * scale).to(torch.bfloat16),
                   dk=bf(group(bf(ds).transpose(-1, -2) @ q * scale)).to(torch.bfloat16),
                   dv=bf(group(bf(p).transpose(-1, -2) @ dout)).to(torch.bfloat16))
    if spec.bias_grad and "bias" in case:
        summed = [i for i in range(4) if case["bias"].shape[i] == 1 and dbias.shape[i] > 1]
        results["dbias"] = bf(dbias.sum(dim=summed, keepdim=True) if summed else dbias).to(torch.bfloat16)
    return results
