"""Honest FP8 attention candidates with scales, in torch, the way the peers order the work, with
planted bugs, and a sweep of them through crosscheck (tests/test_crosscheck_fp8.py; the longer
one: benchmarks/variant_sweeps.py --variant fp8).

The inputs are quantized as an FP8 pipeline does: x / scale rounded to float8 (e4m3 or e5m2),
scale = the largest |x| of its group over the format's largest value, and the scale is the
kernel's descale. A group is the whole tensor, a (batch, kv head) (FlashAttention-3's descale_q/k/v
[B, H_kv]), a token of a head (vLLM's per-token-head scales) or a block of 16 or 64 tokens of a head;
or, for MXFP8 (mx_case), 32 elements of a row, the scale a power of two (OCP's MX format: 2 to the
floor of log2 of the block's largest |x| less the element format's largest exponent, 8 for e4m3,
15 for e5m2, the elements clamped to the format's range), stored as e8m0.

Two orders, written from the peers' references:
    'fa3'      FlashAttention-3's: q k^T of the float8 values in float32 times both descales,
               softmax in float32, P rounded to the intermediate dtype (float8 e4m3, or bfloat16),
               P v in float32 with v's descale, out in bfloat16 (the descales applied to the
               float8 values in float32, where a per-token descale has to be); in half the
               cases both products accumulate in 22 bits as Hopper's tensor cores do (32
               products at a time, then the float32 accumulator's low 10 bits cleared), and
               the case says accumulator_bits=22
    'dequant'  vLLM's FP8 KV cache read by a bfloat16 kernel: each tensor dequantized first
               (x8 * descale in float32, as its scaled_convert does, rounded to bfloat16), then
               Hugging Face's eager attention: (q k^T) * scale in bfloat16, the softmax in
               float32, P and P v in bfloat16 (intermediate dtype bfloat16 only)
The bugs: one descale dropped (q's, k's or v's, in turn); v's applied twice; the first head's
descale used for every head and batch entry (a per-tensor kernel given per-head scales; not
planted where the scales are per tensor); in FlashAttention-3's order, P v by an online softmax
whose P~ = exp(S - m) 2^8 is held in e4m3 with its row max moved only past 4 (log2), saturating
at 448 (flash-attention issue 2716; where that moves out beyond P~'s own rounding). MXFP8's
besides (MX_BUGS): the culprit's e8m0 scales read with a bias of 128 (halved); its scales one
block over along d (where d has two blocks).
"""
import math

import ml_dtypes
import numpy as np
import torch

import variant_sweeps

FORMATS = {"float8_e4m3fn": (torch.float8_e4m3fn, 448.0), "float8_e5m2": (torch.float8_e5m2, 57344.0)}
MX_EXPONENT = {"float8_e4m3fn": 8, "float8_e5m2": 15}                   # the elements' largest exponent
MX_BLOCK = 32
GROUPS = ("tensor", "head", "token", "block")
BUGS = {"descale_dropped": "_descale dropped", "descale_twice": "v_descale applied twice",
        "first_head_descale": "the first head's", "p_saturates": "saturated at e4m3's 448"}
MX_BUGS = {**BUGS, "exponent_bias": "bias 127 read as 128", "next_block": "one over along d"}


def quantize(x, group, block, fmt):
    """(x8 as a float8 tensor, descale float32) of x [B, H, N, d] by its group's largest |x|."""
    dtype, largest = FORMATS[fmt]
    b, h, n, _ = x.shape
    if group == "mx":                                                   # 32 along d, a power of two
        blocks = torch.nn.functional.pad(x.abs(), (0, -x.shape[-1] % MX_BLOCK)).reshape(b, h, n, -1, MX_BLOCK)
        amax = blocks.amax(dim=-1).clamp_min(2.0 ** -100)               # [B, H, N, ceil(d / 32)]
        descale = torch.exp2(torch.floor(torch.log2(amax)) - MX_EXPONENT[fmt])
        scaled = x / expand(descale, x.shape, group, block)
        return scaled.clamp(-largest, largest).to(dtype), descale
    if group == "tensor":
        amax = x.abs().amax()
    elif group == "head":
        amax = x.abs().amax(dim=(-1, -2))                               # [B, H]
    elif group == "token":
        amax = x.abs().amax(dim=-1)                                     # [B, H, N]
    else:
        padded = torch.nn.functional.pad(x.abs().amax(dim=-1), (0, -n % block))
        amax = padded.reshape(b, h, -1, block).amax(dim=-1)              # [B, H, ceil(N / block)]
    descale = (amax / largest).clamp_min(1e-12).float()
    return (x / expand(descale, x.shape, group, block)).to(dtype), descale


def expand(descale, shape, group, block):
    """The descale broadcast to x [B, H, N, 1] (MXFP8's to x [B, H, N, d])."""
    if group == "tensor":
        return descale
    if group == "head":
        return descale[..., None, None]
    if group == "block":
        descale = descale.repeat_interleave(block, dim=-1)[..., :shape[-2]]
    if group == "mx":
        return descale.repeat_interleave(MX_BLOCK, dim=-1)[..., :shape[-1]]
    return descale[..., None]


def draw(rng):
    d = int(rng.choice([32, 64, 128]))
    n_k = int(rng.integers(8, 300))
    group = GROUPS[int(rng.integers(4))]
    how = ["fa3", "dequant"][int(rng.integers(2))]
    return dict(batch=int(rng.integers(1, 3)), h_kv=int(rng.integers(1, 3)), groups=int(rng.integers(1, 3)),
                n_q=int(rng.choice([1, max(1, n_k // 4), n_k])), n_k=n_k, d=d, causal=bool(rng.integers(2)),
                group=group, block=int(rng.choice([16, 64])), fmt=list(FORMATS)[int(rng.integers(4) == 0)],
                how=how, intermediate="bfloat16" if how == "dequant" or rng.integers(3) == 0 else "float8_e4m3fn",
                culprit="qkv"[int(rng.integers(3))], accumulator=22 if how == "fa3" and rng.integers(2) else 32)


def fp8_case(rng, dtype, bug=None, mx=False):
    """A crosscheck case (dict) of a torch FP8 candidate (its output bfloat16; dtype names the
    precision's sweep key, float8 always), honest or with a bug; None where the bug changes nothing.
    mx: MXFP8's scales (e8m0, 32 elements of a row each) in place of the drawn group, products
    accumulated in float32."""
    s = draw(rng)
    if mx:
        s.update(group="mx", accumulator=32)
    if bug == "first_head_descale" and (s["group"] == "tensor" or s["group"] == "head" and s["batch"] * s["h_kv"]
                                        * s["groups"] == 1):
        return None                                      # one descale a tensor: nothing to mix up
    if bug == "p_saturates" and (s["how"] != "fa3" or s["accumulator"] != 32):
        return None                                      # FlashAttention-3's order, float32 sums
    if bug == "next_block" and s["d"] <= MX_BLOCK:
        return None                                      # one block a row: no next one
    q, k, v = draw_inputs(rng, s)
    stored = {name: quantize(x, s["group"], s["block"], s["fmt"]) for name, x in (("q", q), ("k", k), ("v", v))}
    used = {name: expand(descale, x8.shape, s["group"], s["block"]) for name, (x8, descale) in stored.items()}
    if bug == "descale_dropped":
        used[s["culprit"]] = torch.ones(())
    elif bug == "descale_twice":
        used["v"] = used["v"] * used["v"]
    elif bug == "first_head_descale":
        used = {name: x.flatten()[0] for name, x in used.items()}
    elif bug == "exponent_bias":                         # 2^(e - 128): every scale halved
        used[s["culprit"]] = used[s["culprit"]] / 2
    elif bug == "next_block":                            # block b's scale on block b + 1
        rolled = torch.roll(used[s["culprit"]], MX_BLOCK, dims=-1)
        if torch.equal(rolled, used[s["culprit"]]):
            return None                                  # every row's blocks share their scale
        used[s["culprit"]] = rolled
    out, lse = attend(stored, used, s, lazy=bug == "p_saturates")
    if bug == "p_saturates":
        out, saturated = out
        if not saturated:
            return None                                  # P~ below 448, or saturated within its rounding
    arrays = {name: stored[name][0] for name in "qkv"}
    e8m0 = lambda x: x.numpy().astype(ml_dtypes.float8_e8m0fnu) if mx else x.numpy()
    arrays.update({f"{name}_descale": e8m0(stored[name][1]) for name in "qkv"}, out=out, lse=lse,
                  precision=np.array(s["fmt"]), intermediate_dtype=np.array(s["intermediate"]))
    if s["group"] == "block":
        arrays["descale_block"] = np.array(s["block"])
    if s["accumulator"] != 32:
        arrays["accumulator_bits"] = np.array(s["accumulator"])
    if s["causal"]:
        arrays["causal"] = np.array("bottom_right")
    return arrays


def draw_inputs(rng, s):
    """(q [B, H, N_q, d], k, v [B, H_kv, N_k, d]): float32 torch tensors of a draw's settings s,
    standard normal times a factor a head (heads' magnitudes differ), by a generator seeded
    from rng."""
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    b, h_kv, h, n_q, n_k, d = s["batch"], s["h_kv"], s["h_kv"] * s["groups"], s["n_q"], s["n_k"], s["d"]
    spread = lambda heads: torch.exp(torch.randn(b, heads, 1, 1, generator=gen) / 2)
    q = torch.randn(b, h, n_q, d, generator=gen) * spread(h)
    k, v = (torch.randn(b, h_kv, n_k, d, generator=gen) * spread(h_kv) for _ in range(2))
    return q, k, v


def attend(stored, used, s, lazy=False):
    """The candidate's (out bfloat16, lse float32), in its order (module docstring); lazy: its P v
    by lazy_softmax_pv, out then (out, saturated)."""
    groups = s["groups"]
    repeat = lambda x: x.repeat_interleave(groups, dim=1) if x.ndim == 4 and x.shape[1] > 1 else x
    scale = 1 / math.sqrt(s["d"])
    if s["how"] == "fa3":
        q, k, v = (stored[name][0].float() * used[name] for name in "qkv")
    else:
        q, k, v = ((stored[name][0].float() * used[name]).to(torch.bfloat16) for name in "qkv")
    k, v = repeat(k), repeat(v)
    product = lambda a, b: narrow_matmul(a, b, s["accumulator"]) if s["accumulator"] != 32 else a @ b
    scores = (product(q, k.transpose(-1, -2)) * scale).float()   # 'dequant': rounded to bfloat16 twice
    if s["causal"]:
        n_q, n_k = scores.shape[-2:]
        keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
        scores = scores.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    if lazy:
        return lazy_softmax_pv(scores, v), lse
    p = torch.softmax(scores, dim=-1)
    p = p.to(torch.float8_e4m3fn).float() if s["intermediate"] == "float8_e4m3fn" else p.to(torch.bfloat16)
    out = product(p.to(v.dtype), v)
    return out.to(torch.bfloat16), lse


def lazy_softmax_pv(scores, v, offset=8.0, threshold=4.0, tile=128):
    """(out bfloat16, saturated): P v by FlashAttention-3's online softmax on float8 P as
    flash-attention issue 2716 describes it, in float32: P~ = exp2(S log2 e - m + offset) over tiles
    of keys, the row max m moved only when a tile passes it by more than `threshold` (log2), P~
    converted to e4m3 with saturation (cvt satfinite: 448 where larger), l summed from P~ before
    the conversion. saturated: whether the saturation moved out by more than e4m3's half-ulp
    (2^-4) of its largest entry, P~'s own rounding (the saturated share of the sums, P~ - 448
    where larger, times v)."""
    x = scores * math.log2(math.e)
    m = torch.full(x.shape[:-1], -math.inf)
    l, acc = torch.zeros(x.shape[:-1]), torch.zeros(x.shape[:-1] + v.shape[-1:])
    moved = torch.zeros(acc.shape)                                      # the saturation's share of acc
    for start in range(0, x.shape[-1], tile):
        xs = x[..., start:start + tile]
        top = xs.amax(dim=-1)
        m_new = torch.where(torch.isneginf(m) | (top > m + threshold), torch.maximum(m, top), m)
        shift = torch.where(torch.isneginf(m_new), 0.0, m_new)
        rescale = torch.where(torch.isneginf(m), 0.0, torch.exp2(m - shift))
        p = torch.exp2(xs - shift[..., None] + offset)
        p8 = p.clamp(max=448).to(torch.float8_e4m3fn).float()
        acc = acc * rescale[..., None] + p8 @ v[..., start:start + tile, :].float()
        moved = moved * rescale[..., None] + (p - p.clamp(max=448)) @ v[..., start:start + tile, :].float()
        l = l * rescale + p.sum(dim=-1)
        m = m_new
    out = acc / l.clamp_min(1e-30)[..., None]
    saturated = bool((moved / l.clamp_min(1e-30)[..., None]).abs().max() > 2 ** -4 * out.abs().max())
    return out.to(torch.bfloat16), saturated


def torch_float64_out(inputs, causal):
    """torch's float64 SDPA of a case's inputs q, k, v (grouped-query heads), bottom-right causal
    where `causal`: an independent reference for the oracle's out."""
    t = {n: torch.tensor(inputs[n]) for n in "qkv"}
    mask = None
    if causal:
        n_q, n_k = t["q"].shape[-2], t["k"].shape[-2]
        mask = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
    return torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=mask,
                                                            enable_gqa=True).numpy()


def narrow_matmul(a, b, bits):
    """a @ b (float32) with its sums in an accumulator of `bits` bits: 32 products at a time,
    then the accumulator's low 32 - bits bits cleared (float32's bits as int32)."""
    acc = torch.zeros(a.shape[:-1] + b.shape[-1:])
    for t in range(0, a.shape[-1], 32):
        acc = acc + a[..., t:t + 32] @ b[..., t:t + 32, :]
        acc = (acc.view(torch.int32) & ~((1 << (32 - bits)) - 1)).view(torch.float32)
    return acc


def sweep(cases, seed=0, dtypes=("float8",), peers=False):
    """variant_sweeps.sweep over this module's cases and bugs."""
    return variant_sweeps.sweep(fp8_case, BUGS, cases, seed, dtypes, peers)


def mx_sweep(cases, seed=0, dtypes=("mxfp8",), peers=False):
    """variant_sweeps.sweep over MXFP8's cases (fp8_case with mx) and MX_BUGS."""
    return variant_sweeps.sweep(lambda rng, dtype, bug: fp8_case(rng, dtype, bug, mx=True), MX_BUGS, cases,
                                seed, dtypes, peers)
