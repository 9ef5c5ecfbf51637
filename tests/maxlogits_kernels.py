"""Honest max-logits candidates in torch, the way the peers compute them, with planted bugs, and
a sweep of them through crosscheck (tests/test_max_logits.py; the longer one:
benchmarks/variant_sweeps.py --variant maxlogits).

Three ways, written from the peers' descriptions:
    'fa'     FlashAttention's row_max (flash-attention PR 2357): the row maximum of q k^T from the
             float32 accumulator, before the softmax scale; the case holds row_max * scale, per
             row [B, H, N_q], in float32
    'te'     TransformerEngine's return_max_logit: the scaled scores' maximum per head over the
             batch and the rows, [H], in float32
    'eager'  a model's eager attention: S = (q k^T) * scale in the dtype (each op rounded), its
             row maximum [B, H, N_q] in the dtype
Each case's out and lse are those of a float32 softmax of the float32 scores (with a sink where
the case has sinks), out rounded to the dtype. The bugs: the max before the scale (row_max as
it comes); the max in base 2 (times log2 e, a kernel's exp2 units); the running max started at
the sink (in cases with sinks where a sink is above some row's largest score).
"""
import math

import numpy as np
import torch

import variant_sweeps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WAYS = ("fa", "te", "eager")
BUGS = {"unscaled": "FlashAttention's row_max", "base_2": "base 2", "sink_in_max": "the sink"}


def draw(rng):
    n_k = int(rng.integers(8, 200))
    return dict(batch=int(rng.integers(1, 3)), h_kv=int(rng.integers(1, 3)), groups=int(rng.integers(1, 3)),
                n_q=int(rng.choice([1, n_k, max(1, n_k // 3)])), n_k=n_k, d=int(rng.choice([32, 64, 128])),
                causal=bool(rng.integers(2)), sinks=bool(rng.integers(3) == 0), how=WAYS[int(rng.integers(3))])


def maxlogits_case(rng, dtype, bug=None):
    """A crosscheck case (dict of tensors) of a torch candidate, honest or with a bug; None where
    the bug changes nothing (sink_in_max without sinks, or with each sink below its rows' max)."""
    s = draw(rng)
    if bug == "sink_in_max" and not s["sinks"]:
        return None
    b, h, n_q, n_k, t = s["batch"], s["h_kv"] * s["groups"], s["n_q"], s["n_k"], DTYPES[dtype]
    q, _, k, v, gen = variant_sweeps.torch_inputs(rng, s, t)
    q = 2 * q                                                          # scores spread by a few units
    sinks = (torch.randn(h, generator=gen) + 4).to(t) if s["sinks"] else None     # above some rows' scores
    scale = 1 / math.sqrt(s["d"])
    k_h, v_h = (x.repeat_interleave(s["groups"], dim=1) for x in (k, v))
    keep = torch.ones(n_q, n_k, dtype=torch.bool)
    if s["causal"]:
        keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
    qk = q.float() @ k_h.float().transpose(-1, -2)                      # the float32 accumulator
    scores = (qk * scale).masked_fill(~keep, float("-inf"))
    row = scores if sinks is None else torch.cat([scores, sinks.float()[:, None, None].expand(b, h, n_q, 1)], -1)
    lse = torch.logsumexp(row, -1)
    p = torch.exp(row - lse[..., None])[..., :n_k]
    out = (p @ v_h.float()).to(t)
    if s["how"] == "eager":
        eager = (q @ k_h.transpose(-1, -2)) * scale                       # each op rounded to the dtype
        top = eager.masked_fill(~keep, float("-inf")).amax(-1)
    else:
        top = (qk if s["how"] == "fa" else scores).masked_fill(~keep, float("-inf")).amax(-1)
        if s["how"] == "fa" and bug != "unscaled":
            top = top * scale                                           # row_max * scale, in float32
        if s["how"] == "te":
            top = top.amax(dim=(0, 2)) * (1 / scale if bug == "unscaled" else 1)
    if s["how"] == "eager" and bug == "unscaled":
        top = (q @ k_h.transpose(-1, -2)).masked_fill(~keep, float("-inf")).amax(-1)
    if bug == "base_2":
        top = top * math.log2(math.e)
    if bug == "sink_in_max":                                            # max(sink, the scores)
        sink = sinks.to(top.dtype)
        started = torch.maximum(top, sink if top.ndim == 1 else sink[:, None].expand_as(top))
        if torch.equal(started, top):                                   # the sink below every max
            return None
        top = started
    arrays = dict(q=q, k=k, v=v, out=out, lse=lse, max_logits=top)
    if s["causal"]:
        arrays["causal"] = np.array("bottom_right")
    if sinks is not None:
        arrays["sinks"] = sinks
    return arrays


def sweep(cases, seed=0, dtypes=tuple(DTYPES)):
    """variant_sweeps.sweep over this module's cases and bugs."""
    return variant_sweeps.sweep(maxlogits_case, BUGS, cases, seed, dtypes)
