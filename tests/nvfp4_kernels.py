"""Honest NVFP4 attention candidates in torch, in the order of FlashAttention's block-scaled
forward (its NVFP4+BF16 and NVFP4+FP8 modes), with planted bugs, and a sweep of them through
crosscheck (tests/test_crosscheck_nvfp4.py; the longer one: benchmarks/variant_sweeps.py
--variant nvfp4).

q and k are quantized as NVIDIA's NVFP4 recipe does, per tensor x [B, H, N, d]:
    g  = amax |x| / (448 * 6)                    the tensor's float32 scale
    s  = e4m3(amax |block| / 6 / g)              each block of 16 elements of a row: its e4m3
                                                 scale (at least e4m3's smallest, 2^-9)
    x4 = e2m1(x / (s g))                         the elements: rounded to nearest even, at most 6
The case's q_descale and k_descale are s g [B, H, N, d / 16] (float64: the product exact). The
kernel: q k^T of the dequantized values in float32 (e2m1 times e4m3 is exact in float32, the
products too), the softmax in float32, P rounded to P's dtype, P v summed in float32, out
bfloat16 (fp8_kernels.attend's 'fa3' order). The modes:
    nvfp4_bf16   v bfloat16, P rounded to bfloat16 (the case's precision: bfloat16)
    nvfp4_fp8    v e4m3 with a per-tensor descale, P rounded to e4m3 (precision float8_e4m3fn)
The bugs (BUGS), each in the culprit's (q's or k's) scales: dropped (its e2m1 values used as
they are), read in blocks of 32 (MXFP8's), one block over along d, read transposed (its
[N, d / 16] scales as laid out [d / 16, N]).
"""
import ml_dtypes
import numpy as np
import torch

import fp8_kernels
import variant_sweeps

BLOCK = 16
E2M1_MAX, E4M3_MAX, E4M3_TINY = 6.0, 448.0, 2.0 ** -9
MODES = {"nvfp4_bf16": "bfloat16", "nvfp4_fp8": "float8_e4m3fn"}      # mode: the case's precision
BUGS = {"descale_dropped": "_descale dropped", "blocks_of_32": "read as blocks of 32",
        "next_block": "one over along d", "transposed": "read transposed"}


def quantize(x):
    """(x4 [B, H, N, d] float32 holding e2m1 values, descale [B, H, N, d / 16] float64 = s g) of
    x [B, H, N, d] (float32 numpy, d a multiple of 16), by the module docstring's recipe."""
    g = np.float32(np.abs(x).max() / (E4M3_MAX * E2M1_MAX))
    blocks = x.reshape(x.shape[:-1] + (-1, BLOCK))
    wanted = np.abs(blocks).max(axis=-1) / np.float32(E2M1_MAX) / g
    s = np.maximum(wanted.astype(ml_dtypes.float8_e4m3fn).astype(np.float32), E4M3_TINY)
    descale = s.astype(np.float64) * np.float64(g)
    x4 = (blocks / (s * g)[..., None]).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return x4.reshape(x.shape), descale


def used_scales(descale, bug, d):
    """The kernel's scales broadcast over x [B, H, N, d]: the case's, or as `bug` reads them; None
    where the bug reads the same scales."""
    spread = lambda blocks, width=BLOCK: np.repeat(blocks, width, axis=-1)[..., :d]
    if bug == "descale_dropped":
        return np.ones(descale.shape[:-1] + (d,))
    if bug == "blocks_of_32":
        read = spread(descale, 32)
    elif bug == "next_block":
        read = spread(np.roll(descale, 1, axis=-1))
    elif bug == "transposed":
        read = spread(np.swapaxes(descale, -1, -2).reshape(descale.shape))
    else:
        return spread(descale)
    return None if np.array_equal(read, spread(descale)) else read


def draw(rng):
    n_k = int(rng.integers(8, 300))
    return dict(batch=int(rng.integers(1, 3)), h_kv=int(rng.integers(1, 3)), groups=int(rng.integers(1, 3)),
                n_q=int(rng.choice([1, max(1, n_k // 4), n_k])), n_k=n_k, d=int(rng.choice([32, 64, 128])),
                causal=bool(rng.integers(2)), culprit="qk"[int(rng.integers(2))], how="fa3", accumulator=32)


def nvfp4_case(rng, mode, bug=None):
    """A crosscheck case (dict) of a torch NVFP4 candidate in `mode` (MODES), honest or with a bug;
    None where the bug changes nothing (one block a row, or one row)."""
    s = draw(rng)
    s["intermediate"] = "bfloat16" if mode == "nvfp4_bf16" else "float8_e4m3fn"
    q, k, v = fp8_kernels.draw_inputs(rng, s)
    stored, used, descales = {}, {}, {}
    for name, x in (("q", q), ("k", k)):
        x4, descales[name] = quantize(x.numpy())
        read = used_scales(descales[name], bug if name == s["culprit"] else None, s["d"])
        if read is None:
            return None
        stored[name], used[name] = (torch.from_numpy(x4), None), torch.from_numpy(read).float()
    if mode == "nvfp4_bf16":
        stored["v"], used["v"] = (v.to(torch.bfloat16), None), torch.ones(())
    else:
        stored["v"] = fp8_kernels.quantize(v, "tensor", None, "float8_e4m3fn")
        used["v"] = stored["v"][1]
    out, lse = fp8_kernels.attend(stored, used, s)
    as_e2m1 = lambda x: x.numpy().astype(ml_dtypes.float4_e2m1fn)
    arrays = {"q": as_e2m1(stored["q"][0]), "k": as_e2m1(stored["k"][0]), "v": stored["v"][0],
              "q_descale": descales["q"], "k_descale": descales["k"], "out": out, "lse": lse,
              "precision": np.array(MODES[mode])}
    if mode == "nvfp4_fp8":
        arrays["v_descale"] = stored["v"][1].numpy()
    if s["causal"]:
        arrays["causal"] = np.array("bottom_right")
    return arrays


def sweep(cases, seed=0, dtypes=tuple(MODES), peers=False):
    """variant_sweeps.sweep over NVFP4's cases in each mode and BUGS."""
    return variant_sweeps.sweep(nvfp4_case, BUGS, cases, seed, dtypes, peers)
