"""Real attention kernels that nobody here wrote, judged by crosscheck in float16, bfloat16 and
float32 with planted bugs, and FlashAttention's own test rule beside it on the same results: the
campaigns of tests/test_real_kernels.py and benchmarks/real_kernels.py. Needs torch (the
float64 reference of FlashAttention's rule is torch's); jax and mlx for their kernels.

    case = random_case(rng, "bfloat16", "causal", "flex", random_layout(rng, "causal", "flex"))
    arrays = run(case, "flex")                   # + the kernel's out, lse (dq, dk, dv, dbias)
    report = crosscheck(**arrays)
    fa_passed = fa_rule(arrays, report)          # FlashAttention's rule on the same results
    result = campaign("jax_xla", "float16", cases=48, seed=0)   # honest and planted outcomes

The kernels (KERNELS), each called the way its users call it:
    sdpa_math      torch SDPA under sdpa_kernel(SDPBackend.MATH), autograd
    sdpa_flash     torch SDPA under sdpa_kernel(SDPBackend.FLASH_ATTENTION): the CPU flash kernel
                   (no gradient for a float mask: its bias is a constant)
    flash_lse      torch.ops.aten._scaled_dot_product_flash_attention_for_cpu with its float32
                   lse (tests/torch_kernels.py's runner; top-left causal only, no mask)
    flex           torch.nn.attention.flex_attention, eager (its math decomposition): causal in
                   both alignments, windows, padding as mask_mod (a BlockMask), softcap, bias
                   and ALiBi as score_mod, its lse (return_aux); on CPU it has no backward. Run
                   without the dynamo trace that wraps each eager call (the same bits, 70x
                   faster); RUNNERS["flex_traced"] runs it with the trace, as users' calls do
    flex_compiled  torch.compile(flex_attention, dynamic=False): forward only (torch 2.13 on CPU
                   compiles inference only, without lse); each shape compiles for seconds, so
                   its cases share a few shapes and one generic mask_mod / score_mod, their
                   options held in tensors (a Python constant would recompile)
    jax_xla        jax.nn.dot_product_attention(implementation="xla") jitted with its jax.vjp
                   (float16 eager: jitted, it fails on CPU), the lse from return_residual=True;
                   [B, N, H, d] transposed here; cases share shapes (Kernel.repeats: each
                   (shape, causal, window) compiles once)
    mlx_sdpa       mx.fast.scaled_dot_product_attention on the CPU (causal bottom-right, rows
                   with no key averaging v), gradients by mx.vjp, a bias as its additive mask

A case is a dict of crosscheck's keys: q, k, v, dout as float32 arrays holding values of the
case's precision, "precision", the options, and private keys (a leading "_") that only the
runners read. run() adds the kernel's results as NumPy arrays in the kernel's dtypes (bfloat16
as ml_dtypes), so that a failure saves as it was judged (save_failures).

Planted bugs (BUGS), where a real kernel shows them: "scale" the kernel called with its scale
1% off; "dq_entry" one dq entry off by 5% of max|dq|; "lse_row" each row given its
neighbour's lse; "causal_row" the kernel's causal mask missing on its first row (the row with
fewest keys); "window" the kernel's window one wider on each side; "gqa_group" query head h
given kv head h % H_kv instead of h // (H / H_kv). (torch_kernels.py's "dropout" is not
planted: none of these kernels hands out its dropout mask on CPU.)
"""
import functools
import math
import os
import tempfile
import time
import warnings
from typing import NamedTuple

import ml_dtypes
import numpy as np
import torch
import torch_kernels as tk

from numpy_attention import crosscheck
from numpy_attention._checks import to_numpy
from numpy_attention.oracle import CaseError, save_case
from numpy_attention.oracle.rule import abs_errors

PRECISIONS = ("float16", "bfloat16", "float32")
STORAGE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
LENGTHS = (1, 3, 64, 113, 128, 239, 256, 512, 799, 1024, 2048)    # FlashAttention's tests' kind
HEAD_DIMS = (32, 64, 128)
# a case's work, by size: crosscheck's time grows with its scores B * H * N_q * N_k and with its
# tensors' entries B * (H * N_q + H_kv * N_k) * d (about 1 us each in a 16-bit precision)
WORK_CAPS = {"small": 2 ** 14, "mid": 2 ** 17, "large": 2 ** 21}
MID_EVERY = 20                  # every 20th case (or layout) of a campaign is mid-sized
BUGS = ("scale", "dq_entry", "lse_row", "causal_row", "window", "gqa_group")
DECODE = ("decode", "decode_causal", "single_key")      # one query row, or one key
# ALiBi's large scores where a row sees one key or few (top-left causal where the kernel has it):
# one query row over up to 2048 keys, and N_q >> N_k (biases near -1000 at N_q = 2048)
ALIBI_LARGE = ("alibi_decode", "alibi_tall")
ONE_ROW = DECODE + ALIBI_LARGE[:1]                      # the variants of one query row or one key
RECOMPILE_LIMIT = 64            # compiled flex's graphs (a layout and dtype each), torch's default 8
FA_RTOL = 2.0                   # FlashAttention's tests: err <= 2 * err(reference in dtype) + atol
FAILURES_DIR = os.path.join(tempfile.gettempdir(), "real_kernel_failures")


class Kernel(NamedTuple):
    library: str                # "torch", "jax" or "mlx": what must be installed
    variants: tuple             # the case variants it computes, cycled through by a campaign
    gradients: bool             # returns dq, dk, dv
    lse: bool                   # returns an lse
    causal: str                 # its own causal flag's diagonal: "top_left" / "bottom_right"
    window_align: str           # the diagonal of the windows handed to it
    fully_masked: str           # what it returns for a row with no key: "zero" / "uniform"
    alibi_as_bias: bool         # ALiBi handed to it as a bias tensor (no ALiBi of its own)
    bias_grad: bool             # returns dbias
    gqa: bool                   # takes fewer kv heads than query heads
    repeats: int                # cases per layout (shape, window), of one variant: a layout
                                # compiles once; 0: one layout for the whole campaign
    bugs: tuple

    @property
    def bottom_right(self):
        """Whether it computes bottom-right causal attention (natively or by a mask)."""
        return self.causal == "bottom_right" or "bottom_right" in self.variants


_SDPA_VARIANTS = ("plain", "padding", "mask", "bias", "causal", "bottom_right", "window", "alibi",
                  "scale") + DECODE + ALIBI_LARGE
KERNELS = {
    "sdpa_math": Kernel("torch", _SDPA_VARIANTS, True, False, "top_left", "top_left", "zero", True,
                        True, True, 1, ("scale", "dq_entry", "causal_row", "window", "gqa_group")),
    "sdpa_flash": Kernel("torch", _SDPA_VARIANTS, True, False, "top_left", "top_left", "zero", True,
                         False, True, 1, ("scale", "dq_entry", "causal_row", "window", "gqa_group")),
    "flash_lse": Kernel("torch", ("plain", "causal", "scale") + DECODE, True, True, "top_left",
                        "top_left", "zero", False, False, True, 1,
                        ("scale", "dq_entry", "lse_row", "causal_row", "gqa_group")),
    "flex": Kernel("torch", ("plain", "padding", "bias", "causal", "bottom_right", "window", "softcap",
                             "softcap_window", "alibi", "scale") + DECODE + ALIBI_LARGE,
                   False, True, "top_left", "bottom_right", "zero", False, False, True, 1,
                   ("scale", "lse_row", "causal_row", "window", "gqa_group")),
    "flex_compiled": Kernel("torch", ("plain", "padding", "bottom_right", "window", "alibi"), False, False,
                            "bottom_right", "bottom_right", "zero", False, False, True, 0,
                            ("causal_row", "window")),
    "jax_xla": Kernel("jax", ("causal", "window", "mask", "padding", "bias", "alibi", "scale",
                              "plain") + DECODE + ALIBI_LARGE,   # (its few layouts: causal, window early)
                      True, True, "top_left", "top_left", "uniform", True, True, True, 10,
                      ("scale", "dq_entry", "lse_row", "causal_row", "window", "gqa_group")),
    "mlx_sdpa": Kernel("mlx", ("plain", "padding", "mask", "bias", "causal", "window", "alibi",
                               "scale") + DECODE + ALIBI_LARGE,
                       True, False, "bottom_right", "bottom_right", "uniform", True, True, True, 1,
                       ("scale", "dq_entry", "causal_row", "window", "gqa_group")),
}


# ----------------------------------------------------------------------------- cases

class Layout(NamedTuple):
    """What a jitted or compiled kernel specializes on: the shapes and the window."""
    b: int
    h: int
    h_kv: int
    n_q: int
    n_k: int
    d: int
    window: tuple               # (left, right), or () without a window


def work(layout):
    """A layout's scores plus its tensors' entries: what crosscheck's time grows with."""
    b, h, h_kv, n_q, n_k, d, _ = layout
    return b * h * n_q * n_k + b * (h * n_q + h_kv * n_k) * d


def random_layout(rng, variant, kernel, size="small", gqa=None):
    """The shape (and window) of a random case of `variant` for `kernel`, its work within
    WORK_CAPS[size]: lengths from LENGTHS with N_q != N_k (1 only in ONE_ROW's variants, 1024 and
    2048 only in a decoding case
    or at size "large", where one length is 1024 or 2048, the other 64 or more; "alibi_tall":
    N_q >= 256 and 4 N_k <= N_q, at least "mid" sized), batch 1-4, 1-8 heads, grouped-query
    heads half the time where the kernel has them, head widths 32 / 64 / 128 (batch, heads,
    then width reduced to fit the size, else lengths drawn again). gqa True: grouped-query heads
    with at least 2 kv heads (a layout that shows the bug gqa_group), where the kernel has them."""
    spec = KERNELS[kernel]
    cap = WORK_CAPS["mid" if variant == "alibi_tall" and size == "small" else size]   # its rows are long
    longest = 2048 if size == "large" or variant in ONE_ROW else 799
    lengths = [n for n in LENGTHS if n <= longest and (n > 1 or variant in ONE_ROW)]
    while True:
        if variant in ("decode", "decode_causal", "alibi_decode"):
            n_q, n_k = 1, int(rng.choice([n for n in lengths if n > 1]))
        elif variant == "alibi_tall":                   # N_q >> N_k: one key or a few, far from the rows
            n_q = int(rng.choice([n for n in LENGTHS if n >= 256]))
            n_k = int(rng.choice([n for n in LENGTHS if 4 * n <= n_q]))
        elif variant == "single_key":
            n_q, n_k = int(rng.choice(lengths)), 1
        else:
            n_q, n_k = (int(rng.choice(lengths)) for _ in range(2))
            if size == "large" and (max(n_q, n_k) < 1024 or min(n_q, n_k) < 64):
                continue
            if n_q == n_k or (variant in ("causal", "bottom_right", "window", "softcap_window")
                              and n_k == 1):
                continue
        grouped = spec.gqa and gqa
        h = int(rng.choice([4, 6, 8])) if grouped else int(rng.integers(1, 9))
        divisors = [x for x in range(2 if grouped else 1, h) if h % x == 0] if spec.gqa else []
        h_kv = int(rng.choice(divisors)) if divisors and (grouped or rng.random() < 0.5) else h
        b, d = int(rng.integers(1, 5)), int(rng.choice(HEAD_DIMS))
        fits = lambda: work(Layout(b, h, h_kv, n_q, n_k, d, ())) <= cap
        while not fits() and b > 1:
            b -= 1
        while not fits() and d > HEAD_DIMS[0]:
            d //= 2
        while not fits() and h > 1 and (h, h_kv) != (4, 2):
            if grouped:                             # the fewest grouped heads: 4 on 2 kv heads
                h, h_kv = 4, 2
            else:
                h, h_kv = max(h // 2, 1), max(h_kv // 2, 1)
                h_kv = h_kv if h % h_kv == 0 else 1
        if fits():
            break
    window = ()
    if variant in ("window", "softcap_window"):
        window = (int(rng.integers(0, n_k)), int(rng.integers(0, n_k)))
    return Layout(b, h, h_kv, n_q, n_k, d, window)


def random_case(rng, precision, variant, kernel, layout):
    """Inputs (float32 arrays holding values of `precision`) and options of one random case of
    `variant` on `layout`, in `kernel`'s conventions (its causal diagonal, its windows' one, what
    it does with a row with no key): the keys crosscheck takes, plus private ones (leading "_")."""
    spec = KERNELS[kernel]
    b, h, h_kv, n_q, n_k, d, window = layout
    rounded = lambda x: np.asarray(x).astype(STORAGE[precision]).astype(np.float32)
    case = {"q": rounded(rng.uniform(0.5, 2.0) * rng.standard_normal((b, h, n_q, d))),
            "k": rounded(rng.standard_normal((b, h_kv, n_k, d))),
            "v": rounded(rng.standard_normal((b, h_kv, n_k, d))),
            "dout": rounded(rng.standard_normal((b, h, n_q, d))),
            "precision": np.array(precision)}
    native = np.array(True) if spec.causal == "top_left" else np.array("bottom_right")
    if variant == "padding":                        # key padding: sequence b has its first lengths[b] keys
        lengths = rng.integers(1, n_k + 1, b)
        lengths[rng.integers(0, b)] = rng.integers(1, n_k) if n_k > 1 else 1
        case["_lengths"] = lengths
        case["mask"] = (np.arange(n_k) < lengths[:, None])[:, None, None, :]
    elif variant == "mask":
        case["mask"] = rng.random((b, 1, n_q, n_k)) < rng.uniform(0.4, 1.0)
        case["mask"][..., 0] = True                 # no row without a key
    elif variant == "bias":
        case["bias"] = rounded(rng.standard_normal((int(rng.choice([1, b])), h, n_q, n_k)))
    elif variant in ("causal", "decode_causal"):
        case["causal"] = native
    elif variant == "bottom_right":
        case["causal"] = np.array("bottom_right")
    elif variant == "scale":
        case["scale"] = np.array(float(np.float32(rng.uniform(0.3, 2.0) / math.sqrt(d))))
    elif variant in ("softcap", "softcap_window"):
        case["softcap"] = np.array(float(np.float32(rng.uniform(1.0, 15.0))))
    elif variant in ("alibi",) + ALIBI_LARGE:       # FlashAttention's slopes 2^(-8 (h + 1) / H)
        slopes = rounded(2.0 ** (-8 * np.arange(1, h + 1) / h))
        if variant in ALIBI_LARGE:                  # top-left: the first rows see the first keys
            if spec.causal == "top_left" or spec.alibi_as_bias:
                case["causal"] = np.array(True)
        elif rng.random() < 0.5 and (n_q <= n_k or spec.fully_masked == "zero"):
            case["causal"] = np.array("bottom_right") if spec.bottom_right else np.array(True)
        if spec.alibi_as_bias:                      # -slope |i + N_k - N_q - j|, rounded to the dtype
            distance = np.abs(np.arange(n_q)[:, None] + n_k - n_q - np.arange(n_k)[None, :])
            case["bias"] = rounded(-slopes[None, :, None, None] * distance)
        else:
            case["alibi_slopes"] = slopes
    if variant in ("window", "softcap_window"):
        case["window"] = np.array(window or (int(rng.integers(0, n_k)), int(rng.integers(0, n_k))))
        if spec.window_align == "bottom_right":
            case["align"] = np.array("bottom_right")
    keep = keep_mask(case)
    if spec.fully_masked != "zero" and keep is not None and not keep.any(axis=-1).all():
        case["fully_masked"] = np.array(spec.fully_masked)
    return case


def keep_mask(case, bug=None):
    """The case's keep-mask [..., N_q, N_k] of its mask, causal and window as crosscheck reads
    them (None: every key kept). bug "causal_row": the row with the fewest keys under the causal
    mask sees every key; "window": the window one wider on each side (tests/torch_kernels.py's
    _keep, with the window's alignment `align`)."""
    n_q, n_k = case["q"].shape[-2], case["k"].shape[-2]
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    keep = np.ones((n_q, n_k), bool)
    causal = case.get("causal")
    if causal is not None:
        keep &= j <= i + (n_k - n_q if str(causal) == "bottom_right" else 0)
        if bug == "causal_row":
            keep[int(np.argmin(keep.sum(axis=1)))] = True
    if "window" in case:
        left, right = (int(w) + (bug == "window") for w in case["window"])
        diag = i + (n_k - n_q if str(case.get("align", "top_left")) == "bottom_right" else 0)
        keep &= (j >= diag - left) & (j <= diag + right)
    if "mask" in case:
        keep = keep & case["mask"]
    return None if keep.all() else keep


def _scale_moves(case):
    """Whether a 1% scale error moves P: some row's kept scores spread by more than 1."""
    g = case["q"].shape[-3] // case["k"].shape[-3]
    scores = case["q"] @ np.swapaxes(np.repeat(case["k"], g, axis=-3), -1, -2)
    scores = scores * (float(case["scale"]) if "scale" in case else 1 / math.sqrt(case["q"].shape[-1]))
    keep = keep_mask(case)
    kept = scores if keep is None else np.where(keep, scores, np.nan)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # rows with no key: all NaN
        return bool(np.nanmax(np.nanmax(kept, -1) - np.nanmin(kept, -1)) > 1)


def plants(case, kernel, bug):
    """Whether `bug` can be planted in this case for this kernel and changes the exact result (a
    row must keep two keys for the scale or dq to matter: with one, P = 1 and dq = dk = 0)."""
    spec = KERNELS[kernel]
    if bug not in spec.bugs:
        return False
    n_q, n_k = case["q"].shape[-2], case["k"].shape[-2]
    h, h_kv = case["q"].shape[-3], case["k"].shape[-3]
    keep = keep_mask(case)
    two_keys = n_k >= 2 and (keep is None or int(keep.sum(axis=-1).max()) >= 2)
    if bug == "scale":
        return two_keys and _scale_moves(case)
    if bug == "dq_entry":
        return spec.gradients and two_keys
    if bug == "lse_row":
        return spec.lse and n_q > 1 and "fully_masked" not in case
    if bug in ("causal_row", "window"):
        needed = "causal" if bug == "causal_row" else "window"
        if needed not in case:
            return False
        wrong = keep_mask(case, bug)
        return not np.array_equal(np.ones((n_q, n_k), bool) if keep is None else keep,
                                  np.ones((n_q, n_k), bool) if wrong is None else wrong)
    return bug == "gqa_group" and h_kv >= 2 and h > h_kv


# ----------------------------------------------------------------------------- runners

def run(case, kernel, bug=None):
    """The case's arrays for crosscheck plus the kernel's results (NumPy arrays in the kernel's
    dtypes; bfloat16 as ml_dtypes), with `bug` planted (None: honest)."""
    d = case["q"].shape[-1]
    scale = float(case["scale"]) if "scale" in case else 1 / math.sqrt(d)
    if bug == "scale":
        scale *= 1.01
    results = RUNNERS[kernel](case, scale, bug)
    arrays = {n: x for n, x in case.items() if not n.startswith("_")}
    arrays.update({n: np.array(to_numpy(x, n)) for n, x in results.items()})
    if bug == "dq_entry":                           # a random entry, off by 5% of max|dq|
        dq = arrays["dq"].astype(np.float32)
        index = tuple(int(i) for i in np.random.default_rng(dq.size).integers(0, dq.shape))
        dq[index] += 0.05 * float(np.abs(dq).max())
        arrays["dq"] = dq.astype(arrays["dq"].dtype)
    if bug == "lse_row":                            # each row gets its neighbour's lse
        arrays["lse"] = np.roll(arrays["lse"], 1, axis=-1)
    return arrays


def _torch_wrong_groups(x, h):
    """kv heads [B, H_kv, ...] as H heads, query head i given kv head i % H_kv (gqa_group)."""
    return x[:, torch.arange(h) % x.shape[1]]


def _run_torch(case, scale, bug, kernel_fn, spec):
    """A torch kernel's results: kernel_fn(q, k, v, case, scale, bug) -> (out, lse or None) in
    tests/torch_kernels.py's runner signature (the case's bias as the tensor case["_bias"])."""
    dtype = tk.DTYPES[str(case["precision"])]
    t = {n: torch.from_numpy(case[n]).to(dtype) for n in ("q", "k", "v", "dout")}
    if spec.gradients:
        for n in ("q", "k", "v"):
            t[n].requires_grad_()
    case = dict(case)
    if "bias" in case:
        case["_bias"] = torch.from_numpy(case["bias"]).to(dtype).requires_grad_(spec.bias_grad)
    k, v = t["k"], t["v"]
    if bug == "gqa_group":
        k, v = (_torch_wrong_groups(x, t["q"].shape[1]) for x in (k, v))
    out, lse = kernel_fn(t["q"], k, v, case, scale, bug)
    results = {"out": out.detach()}
    if lse is not None:
        results["lse"] = lse.detach()
    if spec.gradients:
        out.backward(t["dout"])
        results.update(dq=t["q"].grad, dk=t["k"].grad, dv=t["v"].grad)
        if spec.bias_grad and "bias" in case:
            results["dbias"] = case["_bias"].grad
    return results


def _flex_mask_mods(case, bug):
    """The case's masks as flex_attention mask_mods (True = attend): causal in its alignment,
    the window around its diagonal, key padding; bug "causal_row" / "window" as keep_mask's."""
    n_q, n_k = case["q"].shape[-2], case["k"].shape[-2]
    mods = []
    causal = case.get("causal")
    if causal is not None:
        offset = n_k - n_q if str(causal) == "bottom_right" else 0
        row = int(np.argmin(np.tril(np.ones((n_q, n_k), bool), offset).sum(axis=1)))
        if bug == "causal_row":
            mods.append(lambda b, h, q_idx, kv_idx: (q_idx + offset >= kv_idx) | (q_idx == row))
        else:
            mods.append(lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx)
    if "window" in case:
        left, right = (int(w) + (bug == "window") for w in case["window"])
        offset = n_k - n_q if str(case.get("align", "top_left")) == "bottom_right" else 0
        mods.append(lambda b, h, q_idx, kv_idx: (kv_idx >= q_idx + offset - left)
                    & (kv_idx <= q_idx + offset + right))
    if "_lengths" in case:
        lengths = torch.from_numpy(case["_lengths"])
        mods.append(lambda b, h, q_idx, kv_idx: kv_idx < lengths[b])
    return mods


def _flex_score_mod(case, dtype):
    """softcap, bias and ALiBi as one flex_attention score_mod (in crosscheck's order: softcap,
    then bias, then ALiBi), or None. The bias is a tensor in the kernel's dtype, the slopes
    float32 (their values the dtype's)."""
    n_q, n_k = case["q"].shape[-2], case["k"].shape[-2]
    cap = float(case["softcap"]) if "softcap" in case else None
    bias = torch.from_numpy(case["bias"]).to(dtype) if "bias" in case else None
    slopes = torch.from_numpy(case["alibi_slopes"]) if "alibi_slopes" in case else None
    if cap is None and bias is None and slopes is None:
        return None
    per_batch = bias is not None and bias.shape[0] > 1

    def score_mod(score, b, h, q_idx, kv_idx):
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if bias is not None:
            score = score + (bias[b, h, q_idx, kv_idx] if per_batch else bias[0, h, q_idx, kv_idx])
        if slopes is not None:
            score = score - slopes[h] * (q_idx + n_k - n_q - kv_idx).abs()
        return score
    return score_mod


def _flex(q, k, v, case, scale, bug, traced=False):
    """torch's flex_attention, eager, with its lse (AuxRequest). Eager flex_attention traces its
    call with dynamo (backend "eager", ~0.4 s for each new shape or score_mod) and then runs its
    dense decomposition (math_attention: scores and softmax in float32, P rounded to the dtype
    before P @ V); traced=False runs that decomposition directly, as torch's own debug switch
    _FLEX_ATTENTION_DISABLE_COMPILE_DEBUG does: the same bits (tests/test_real_kernels.py), 70x
    faster."""
    from torch.nn.attention import flex_attention as fa
    mods = _flex_mask_mods(case, bug)
    block_mask = None
    if mods:
        batch = q.shape[0] if "_lengths" in case else None
        block_mask = fa.create_block_mask(fa.and_masks(*mods), batch, None, q.shape[-2], k.shape[-2],
                                          device="cpu")
    debug = fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)    # "called without torch.compile()"
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = not traced
        try:
            out, aux = fa.flex_attention(q, k, v, score_mod=_flex_score_mod(case, q.dtype),
                                         block_mask=block_mask, scale=scale,
                                         enable_gqa=q.shape[-3] != k.shape[-3],
                                         return_aux=fa.AuxRequest(lse=True))
        finally:
            fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = debug
    return out, aux.lse


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """torch.compile(flex_attention) with static shapes: with dynamic ones (torch's default after
    a second shape) torch 2.13's CPU template fails to compile a mask_mod that indexes a tensor
    by batch (CppCompileError: 'cur_qSplitSize8' was not declared)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _flex_compiled(q, k, v, case, scale, bug):
    """torch.compile(flex_attention): one generic mask_mod (key padding, the window around the
    bottom-right diagonal, causal as a window (N_k, 0), one row unmasked for bug "causal_row")
    and one score_mod (ALiBi; slopes 0 without it: exactly the scores), their settings in
    tensors, so that every case of a layout runs one compiled graph (a dtype or a shape is a new
    one). Recompiling past dynamo's limit, which would fall back to eager, is an error here; the
    limit is raised to RECOMPILE_LIMIT graphs."""
    from torch.nn.attention.flex_attention import create_block_mask
    b, n_q, n_k = q.shape[0], q.shape[-2], k.shape[-2]
    none = n_q + n_k                                        # a window side that masks nothing
    left, right = none, none
    if "causal" in case:
        right = 0
    if "window" in case:
        left, right = (int(w) for w in case["window"])
    if bug == "window":
        left, right = left + 1, right + 1
    keep_row = torch.tensor(0 if bug == "causal_row" else -1)
    offset, left, right = (torch.tensor(x) for x in (n_k - n_q, left, right))
    lengths = torch.from_numpy(case["_lengths"]) if "_lengths" in case else torch.full((b,), n_k)
    slopes = torch.from_numpy(case["alibi_slopes"]) if "alibi_slopes" in case else torch.zeros(q.shape[1])

    def mask_mod(b, h, q_idx, kv_idx):
        diag = q_idx + offset
        return (((kv_idx >= diag - left) & (kv_idx <= diag + right)) | (q_idx == keep_row)) \
            & (kv_idx < lengths[b])

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offset - kv_idx).abs()

    block_mask = create_block_mask(mask_mod, b, None, n_q, n_k, device="cpu")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=RECOMPILE_LIMIT), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                               enable_gqa=q.shape[-3] != k.shape[-3])
    return out, None


@functools.lru_cache(maxsize=None)
def _jax_attention(jitted):
    """jax.nn.dot_product_attention(implementation="xla") and its jax.vjp: jitted, the shapes,
    is_causal and the window compile while values, masks, biases and the scale are traced; else
    eager (op by op). float16 runs eager: jitted, jax 0.10.2 on CPU raises "The precision
    'F16_F16_F32' is not supported by dot_general on CPU" (its try / except fallback to the
    default precision catches the error eagerly only, not when the jit lowers)."""
    import jax
    import jax.numpy as jnp

    def attention(q, k, v, bias, mask, kv_lengths, dout, scale, groups, is_causal, window):
        def forward(q, k, v, bias):
            if groups is not None:                  # gqa_group: query head h meets kv head groups[h]
                k, v = k[:, :, groups], v[:, :, groups]
            return jax.nn.dot_product_attention(
                q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
                key_value_seq_lengths=kv_lengths, local_window_size=window, implementation="xla",
                return_residual=True)
        (out, lse), pull = jax.vjp(forward, q, k, v, bias)
        dq, dk, dv, dbias = pull((dout, jnp.zeros_like(lse)))
        return out, lse, dq, dk, dv, dbias
    return jax.jit(attention, static_argnames=("is_causal", "window")) if jitted else attention


def _run_jax(case, scale, bug):
    """JAX's attention on the case ([B, N, H, d], transposed from and back to [B, H, N, d]):
    causal by is_causal (top-left), the window by local_window_size (top-left), key padding by
    key_value_seq_lengths, a mask by mask; bugs "causal_row" / "window" hand it keep_mask's
    wrong mask instead. No lse where a row has no key (it is then JAX's fill value's)."""
    import jax.numpy as jnp
    dtype = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}[str(case["precision"])]
    bnhd = lambda x: jnp.asarray(np.swapaxes(x, 1, 2), dtype)
    q, k, v, dout = (bnhd(case[n]) for n in ("q", "k", "v", "dout"))
    groups = jnp.asarray(np.arange(q.shape[2]) % k.shape[2]) if bug == "gqa_group" else None
    bias = jnp.asarray(case["bias"], dtype) if "bias" in case else None
    is_causal = "causal" in case
    window = tuple(int(w) for w in case["window"]) if "window" in case else None
    kv_lengths = jnp.asarray(case["_lengths"], jnp.int32) if "_lengths" in case else None
    mask = None if "mask" not in case or "_lengths" in case else jnp.asarray(case["mask"])
    if bug in ("causal_row", "window"):             # the kernel's own mask, wrong
        wrong = keep_mask(case, bug)
        mask = None if wrong is None else jnp.asarray(wrong.reshape((1,) * (4 - wrong.ndim) + wrong.shape))
        is_causal, window, kv_lengths = False, None, None
    out, lse, dq, dk, dv, dbias = _jax_attention(dtype != jnp.float16)(q, k, v, bias, mask, kv_lengths, dout,
                                                   jnp.float32(scale), groups, is_causal, window)
    back = lambda x: np.swapaxes(np.asarray(x), 1, 2)
    results = {"out": back(out), "dq": back(dq), "dk": back(dk), "dv": back(dv)}
    if "fully_masked" not in case:
        results["lse"] = np.swapaxes(np.asarray(lse), 1, 2)     # [B, N, H] -> [B, H, N]
    if bias is not None:
        results["dbias"] = np.asarray(dbias)
    return results


def _run_mlx(case, scale, bug):
    """MLX's attention: causal as mask="causal" (bottom-right), a bias as its additive mask (with
    -inf where a causal mask hides a key), other masks as a bool mask; gradients by mx.vjp."""
    import mlx.core as mx
    dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}[str(case["precision"])]
    q, k, v, dout = (mx.array(case[n]).astype(dtype) for n in ("q", "k", "v", "dout"))
    index = mx.array(np.arange(q.shape[1]) % k.shape[1]) if bug == "gqa_group" else None
    keep = keep_mask(case, bug if bug in ("causal_row", "window") else None)
    primals = [q, k, v]
    if "bias" in case:
        bias = mx.array(case["bias"]).astype(dtype)
        primals.append(bias)
        hidden = None if keep is None else mx.array(np.where(keep, 0.0, -np.inf).astype(np.float32))
        hidden = None if hidden is None else hidden.astype(dtype)
        mask_of = (lambda b: b) if hidden is None else (lambda b: b + hidden)
    elif "causal" in case and bug != "causal_row" and "window" not in case and "mask" not in case:
        mask_of = lambda: "causal"
    else:
        fixed = None if keep is None else mx.array(keep)
        mask_of = lambda: fixed

    def attention(q, k, v, *bias):
        if index is not None:                       # gqa_group: query head h meets kv head h % H_kv
            k, v = mx.take(k, index, axis=1), mx.take(v, index, axis=1)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask_of(*bias))

    (out,), grads = mx.vjp(attention, primals, [dout])
    mx.eval(out, *grads)
    results = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if "bias" in case:
        results["dbias"] = grads[3]
    return results


RUNNERS = {
    "sdpa_math": lambda c, s, b: _run_torch(c, s, b, lambda *a: tk._sdpa(
        *a, backend=torch.nn.attention.SDPBackend.MATH), KERNELS["sdpa_math"]),
    "sdpa_flash": lambda c, s, b: _run_torch(c, s, b, lambda *a: tk._sdpa(
        *a, backend=torch.nn.attention.SDPBackend.FLASH_ATTENTION), KERNELS["sdpa_flash"]),
    "flash_lse": lambda c, s, b: _run_torch(c, s, b, tk._flash_lse, KERNELS["flash_lse"]),
    "flex": lambda c, s, b: _run_torch(c, s, b, _flex, KERNELS["flex"]),
    "flex_traced": lambda c, s, b: _run_torch(c, s, b, functools.partial(_flex, traced=True),
                                              KERNELS["flex"]),
    "flex_compiled": lambda c, s, b: _run_torch(c, s, b, _flex_compiled, KERNELS["flex_compiled"]),
    "jax_xla": _run_jax,
    "mlx_sdpa": _run_mlx,
}


# ----------------------------------------------------------------------------- FlashAttention's rule

def reference64(arrays):
    """FlashAttention's attention_ref in torch float64 on the values the kernel read: out, lse
    and, by autograd, dq, dk, dv, dbias, dalibi_slopes (those among arrays' results)."""
    f64 = lambda n: torch.from_numpy(np.asarray(arrays[n], np.float64))
    q, k, v, dout = (f64(n) for n in ("q", "k", "v", "dout"))
    wanted = [n for n in ("dq", "dk", "dv", "dbias", "dalibi_slopes") if n in arrays]
    leaves = {"dq": q, "dk": k, "dv": v}
    bias = f64("bias") if "bias" in arrays else None
    slopes = f64("alibi_slopes") if "alibi_slopes" in arrays else None
    leaves.update(dbias=bias, dalibi_slopes=slopes)
    for n in wanted:
        leaves[n].requires_grad_()
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    g = q.shape[-3] // k.shape[-3]
    scale = float(arrays["scale"]) if "scale" in arrays else 1 / math.sqrt(d)
    s = q @ k.repeat_interleave(g, dim=-3).transpose(-1, -2) * scale
    if "softcap" in arrays:
        c = float(arrays["softcap"])
        s = c * torch.tanh(s / c)
    if bias is not None:
        s = s + bias
    if slopes is not None:
        distance = (torch.arange(n_q)[:, None] + n_k - n_q - torch.arange(n_k)[None, :]).abs()
        s = s - slopes[:, None, None] * distance.to(torch.float64)
    keep = keep_mask(arrays)
    keep = torch.ones(s.shape, dtype=torch.bool) if keep is None else torch.from_numpy(keep).expand(s.shape)
    empty = ~keep.any(dim=-1, keepdim=True)                 # rows with no key
    masked = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(masked, dim=-1)
    if str(arrays.get("fully_masked", "zero")) == "uniform":    # the mean of v
        p = torch.softmax(masked.masked_fill(empty, 0.0), dim=-1)
    else:                                                    # 0
        p = torch.softmax(masked.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    out = p @ v.repeat_interleave(g, dim=-3)
    ref = {"out": out.detach().numpy(), "lse": lse.detach().numpy()}
    if wanted:
        out.backward(dout)
        ref.update({n: leaves[n].grad.numpy() for n in wanted})
    return ref


def _fa_atol(ref, dtype):
    """FlashAttention's atol: 2 * max|(ref + 0.3 - 0.3) - ref|, ref rounded to `dtype` and the
    arithmetic in `dtype` (torch's), over ref's finite entries."""
    t = torch.from_numpy(np.where(np.isfinite(ref), ref, 0.0)).to(dtype)
    return 2 * float(((t + 0.3 - 0.3) - t).abs().max()) if t.numel() else 0.0


TORCH_OF = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float64": torch.float64}


def fa_rule(arrays, report, ref=None):
    """FlashAttention's test rule on the tensors crosscheck judged: each passes iff
    max|x - ref| <= 2 * max|x_pt - ref| + atol, with ref float64 (reference64), x_pt the
    crosscheck baseline's error (the report row's baseline_err) and atol _fa_atol in the
    tensor's own dtype. Returns True iff every tensor passes."""
    ref = reference64(arrays) if ref is None else ref
    for row in report.rows:
        x = np.asarray(arrays[row.name]).astype(np.float64)
        err = float(np.max(abs_errors(x, ref[row.name]), initial=0.0))
        if not err <= FA_RTOL * row.baseline_err + _fa_atol(ref[row.name], TORCH_OF[row.dtype]):
            return False
    return True


# ----------------------------------------------------------------------------- campaigns

class Outcome(NamedTuple):
    kernel: str
    precision: str
    variant: str
    layout: Layout
    bug: str                    # None: honest
    passed: bool                # crosscheck's verdict
    fa_passed: bool             # FlashAttention's rule's verdict on the same results
    report: object              # the CrosscheckReport (a refusal's message where it could not judge)
    arrays: dict                # what crosscheck judged: kept for an honest case that failed, else None


class Campaign(NamedTuple):
    honest: list                # Outcomes, bug None
    planted: dict               # bug -> Outcomes of the cases it changes
    seconds: float              # wall time of the campaign
    first_call: float           # wall time of the kernel's first call (a compiling kernel's compile)


def campaign(kernel, precision, cases, seed, bugs=BUGS, large=0, plant_all=False, plant_large=True,
             plant_every=1):
    """`cases` random cases of `kernel` in `precision` (plus `large` ones with a length of 1024
    or 2048, of the variants with more than one query row and key), the variants in turn from
    one the seed picks (every
    MID_EVERY-th case, or layout, mid-sized), each judged honest and with a bug it can show: the
    one planted least so far (plant_all: every one; plant_large False: none in a large case;
    plant_every n: in every n-th case only). Every third layout has grouped-query heads (with
    2 or more kv heads) where the kernel has them. A kernel whose layouts compile shares each
    layout between Kernel.repeats cases (0: all of them). Every outcome carries FlashAttention's
    verdict beside crosscheck's."""
    spec = KERNELS[kernel]
    rng = np.random.default_rng(seed)
    honest, planted = [], {bug: [] for bug in bugs if bug in spec.bugs}
    started, first_call = time.perf_counter(), None
    layout, group = None, max(spec.repeats, 1)
    first = 5 * seed % len(spec.variants)                  # campaigns of other seeds start elsewhere
    for i in range(cases + large):
        slot = i if spec.repeats == 0 else i // group      # the variant's turn (a layout's, repeated)
        variant = spec.variants[(first + slot) % len(spec.variants)]
        if i >= cases:
            longer = [v for v in spec.variants if v not in ONE_ROW]
            variant = longer[i % len(longer)]
            layout = random_layout(rng, variant, kernel, "large")
        elif layout is None or (spec.repeats and i % group == 0):
            size = "mid" if slot % MID_EVERY == MID_EVERY - 1 and spec.repeats else "small"
            layout = random_layout(rng, "window" if spec.repeats == 0 else variant, kernel, size,
                                   gqa=slot % 3 == 1)
        case = random_case(rng, precision, variant, kernel, layout)
        t0 = time.perf_counter()
        arrays = run(case, kernel)
        first_call = time.perf_counter() - t0 if first_call is None else first_call
        ref = reference64(arrays)
        passed, fa_passed, report = _judged(arrays, ref)
        honest.append(Outcome(kernel, precision, variant, layout, None, passed, fa_passed, report,
                              None if passed else arrays))
        able = [bug for bug in planted if plants(case, kernel, bug)]
        if (i >= cases and not plant_large) or i % plant_every:
            able = []
        if able and not plant_all:
            able = [min(able, key=lambda bug: len(planted[bug]))]
        for bug in able:
            bad = run(case, kernel, bug)
            planted[bug].append(Outcome(kernel, precision, variant, layout, bug, *_judged(bad, ref), None))
    return Campaign(honest, planted, time.perf_counter() - started, first_call)


def _judged(arrays, ref):
    """(crosscheck's verdict, FlashAttention's rule's, the CrosscheckReport) of a kernel's results;
    a case crosscheck cannot judge (CaseError) is no PASS: False, FlashAttention's rule not
    applied (True), and the refusal's message in place of the report."""
    try:
        report = crosscheck(**arrays)
    except CaseError as exc:
        return False, True, f"crosscheck: cannot be judged: {exc}"
    return bool(report), fa_rule(arrays, report, ref), report


def false_failures(outcomes):
    """The honest outcomes that failed crosscheck."""
    return [o for o in outcomes if not o.passed]


def save_failures(outcomes, directory=FAILURES_DIR):
    """Save each failed honest outcome as <kernel>_<precision>_<n>.npz in `directory` (the arrays
    crosscheck judged, 16-bit values as float32 with the "precision" key; n the first number
    free there) and its report beside it as .txt. Returns the paths of the .npz files."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for o in false_failures(outcomes):
        n = 0
        while os.path.exists(os.path.join(directory, f"{o.kernel}_{o.precision}_{n}.npz")):
            n += 1
        path = os.path.join(directory, f"{o.kernel}_{o.precision}_{n}.npz")
        as_saved = {name: x.astype(np.float32) if x.dtype.kind == "f" or x.dtype == ml_dtypes.bfloat16 else x
                    for name, x in ((name, np.asarray(x)) for name, x in o.arrays.items())}
        save_case(path, **as_saved)
        with open(path[:-4] + ".txt", "w") as f:
            f.write(f"{o.kernel} {o.precision} {o.variant} {o.layout}\n{o.report}\n")
        paths.append(path)
    return paths


def shares(outcomes):
    """(cases, caught by crosscheck, caught by FlashAttention's rule) of planted outcomes."""
    return len(outcomes), sum(not o.passed for o in outcomes), sum(not o.fa_passed for o in outcomes)
