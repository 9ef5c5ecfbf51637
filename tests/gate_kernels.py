"""Honest gated-attention candidates in torch (Qwen3-Next's output gate), the way the peers order
the work, with planted bugs, and a sweep of them through crosscheck (tests/test_gate.py; the
longer one: benchmarks/variant_sweeps.py --variant gate).

Two ways:
    'eager'  Hugging Face's Qwen3-Next attention: SDPA in the dtype, then
             attn_output * torch.sigmoid(gate) in the dtype; autograd's backward
    'fused'  a kernel that gates in its epilogue: the attention in float32, times sigmoid(gate)
             in float32, rounded once to the dtype; the gradients of that float32 computation,
             rounded to the dtype
The gate is headwise [B, H, N_q, 1] or elementwise [B, H, N_q, d]. The bugs: the gate not
applied (out = P V); the gate applied without its sigmoid (out = (P V) * gate).
"""
import numpy as np
import torch

import variant_sweeps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BUGS = {"not_applied": "the gate not applied", "no_sigmoid": "without its sigmoid"}


def draw(rng):
    n_k = int(rng.integers(8, 160))
    return dict(batch=int(rng.integers(1, 3)), h_kv=int(rng.integers(1, 3)), groups=int(rng.integers(1, 3)),
                n_q=int(rng.choice([1, n_k, max(1, n_k // 3)])), n_k=n_k, d=int(rng.choice([32, 64])),
                causal=bool(rng.integers(2)), headwise=bool(rng.integers(2)),
                how=("eager", "fused")[int(rng.integers(2))])


def gate_case(rng, dtype, bug=None):
    """A crosscheck case (dict of tensors) of a torch candidate, honest or with a bug."""
    s = draw(rng)
    n_q, n_k, t = s["n_q"], s["n_k"], DTYPES[dtype]
    q, dout, k, v, gen = variant_sweeps.torch_inputs(rng, s, t)
    gate = (2 * torch.randn(q.shape[:-1] + (1 if s["headwise"] else s["d"],), generator=gen)).to(t)
    mask = None
    if s["causal"]:
        mask = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
    work = t if s["how"] == "eager" else torch.float32
    leaves = [x.to(work).requires_grad_() for x in (q, k, v, gate)]
    o = torch.nn.functional.scaled_dot_product_attention(*leaves[:3], attn_mask=mask, enable_gqa=True)
    if bug == "not_applied":
        out = o + 0 * leaves[3].sum()                                   # (the gate still gets a gradient)
    elif bug == "no_sigmoid":
        out = o * leaves[3]
    else:
        out = o * torch.sigmoid(leaves[3])
    out.backward(dout.to(work))
    rounded = lambda x: x.detach().to(t)
    arrays = dict(q=q, k=k, v=v, dout=dout, gate=gate, out=rounded(out),
                  **{name: rounded(x.grad) for name, x in zip(("dq", "dk", "dv", "dgate"), leaves)})
    if s["causal"]:
        arrays["causal"] = np.array("bottom_right")
    return arrays


def sweep(cases, seed=0, dtypes=tuple(DTYPES)):
    """variant_sweeps.sweep over this module's cases and bugs."""
    return variant_sweeps.sweep(gate_case, BUGS, cases, seed, dtypes)
