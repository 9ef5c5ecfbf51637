"""torch's attention kernels as crosscheck candidates, in float16, bfloat16 and float32, with
planted bugs: the cases of tests/test_torch_precisions.py (and of the measurement behind
docs/crosscheck.md's table). Needs torch; the test files import this module after
importorskip.

    case = random_case(rng, "bfloat16", "causal")          # inputs and options, the .npz keys
    arrays = run(case, "sdpa")                            # + torch's out (lse), dq, dk, dv, dbias
    arrays = run(case, "manual", bug="scale")             # a planted bug
"""
import atexit
import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import ml_dtypes
import numpy as np
import threadpoolctl
import torch

from numpy_attention import crosscheck
from numpy_attention.engines.plan import available_cores

F = torch.nn.functional
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# candidate -> the variants it can compute
KERNELS = {
    "sdpa": ("plain", "mask", "bias", "causal", "scale", "gqa"),
    "math": ("plain", "mask", "bias", "causal", "scale", "gqa", "bottom_right"),
    "flash_lse": ("plain", "causal", "scale", "gqa"),
    "manual": ("plain", "mask", "bias", "causal", "scale", "gqa", "bottom_right", "window",
               "softcap", "dropout"),
}
# the shapes and options of every day's kernels where a rule may cry wolf: decode (one query
# row, causal or not: then one key), one_key (1-3 keys: dq, dk cancel to 0 or near it),
# scale_gqa (a custom scale with grouped-query heads), softcap_bias_window (the three at once)
EVERYDAY = {
    "sdpa": ("decode", "one_key", "scale_gqa", "bias"),
    "math": ("decode", "one_key", "bias"),
    "flash_lse": ("decode", "one_key", "scale_gqa"),
    "manual": ("decode", "one_key", "scale_gqa", "softcap_bias_window"),
}
# decoding with q nearly orthogonal to its 1-3 keys: the scores and lse cancel to near 0
ORTHOGONAL = {"sdpa": ("orthogonal",), "flash_lse": ("orthogonal",), "manual": ("orthogonal",)}
# ALiBi slopes the kernel multiplies by the distance in its own dtype (biases down to -100s)
ALIBI = {"manual": ("alibi",)}
VARIANTS = sorted({v for kernels in (KERNELS, EVERYDAY) for variants in kernels.values() for v in variants})
BUGS = ("scale", "dq_entry", "lse_row", "causal_row", "window", "dropout", "gqa_group")


def plants(case, kernel, bug):
    """Whether `bug` can be planted in this case for this kernel, and changes something (a row
    must keep two keys for the scale or dq to matter: with one, P = 1 and dq = dk = 0)."""
    n_q, n_k = case["q"].shape[-2], case["k"].shape[-2]
    keep = _keep(case, n_q, n_k)
    two_keys = n_k >= 2 and (keep is None or int(keep.sum(axis=-1).max()) >= 2)
    applies = {"scale": two_keys and _moves(case), "dq_entry": two_keys, "lse_row": kernel == "flash_lse" and case["q"].shape[-2] > 1,
               "causal_row": kernel == "manual" and "causal" in case,
               "window": kernel == "manual" and "window" in case,
               "dropout": kernel == "manual" and "dropout_mask" in case,
               "gqa_group": kernel == "manual" and case["q"].shape[-3] != case["k"].shape[-3]}[bug]
    if applies and bug in ("causal_row", "window"):
        applies = not np.array_equal(_keep(case, n_q, n_k), _keep(case, n_q, n_k, bug))
    return applies


def _moves(case):
    """Whether a 1% scale error moves P: some row's kept scores spread by more than 1."""
    g = case["q"].shape[-3] // case["k"].shape[-3]
    scores = case["q"] @ np.swapaxes(np.repeat(case["k"], g, axis=-3), -1, -2)
    scores = scores * (float(case["scale"]) if "scale" in case else 1 / math.sqrt(case["q"].shape[-1]))
    keep = _keep(case, *scores.shape[-2:])
    kept = scores if keep is None else np.where(keep, scores, np.nan)
    with np.errstate(invalid="ignore"):
        return bool(np.nanmax(np.nanmax(kept, -1) - np.nanmin(kept, -1)) > 1)


def campaign(precision, cases_per_variant, seed, kernels=KERNELS, bugs=BUGS):
    """Every kernel on random cases of every variant it computes (kernels: kernel -> variants),
    honest and with each of `bugs`. The cases are drawn here, in order; they are run and
    judged on a pool of processes, one per core (judged_all).

    Returns (honest, planted): honest a list of (kernel, variant, report), planted a dict
    bug -> list of reports (one per case the bug changes).
    """
    rng = np.random.default_rng(seed)
    jobs, labels = [], []
    for kernel, variants in kernels.items():
        for variant in variants:
            for _ in range(cases_per_variant):
                case = random_case(rng, precision, variant)
                jobs.append((case, kernel, None))
                labels.append((kernel, variant, None))
                for bug in bugs:
                    if plants(case, kernel, bug):
                        jobs.append((case, kernel, bug))
                        labels.append((kernel, variant, bug))
    honest, planted = [], {bug: [] for bug in bugs}
    for (kernel, variant, bug), report in zip(labels, judged_all(jobs)):
        if bug is None:
            honest.append((kernel, variant, report))
        else:
            planted[bug].append(report)
    return honest, planted


def judged(job):
    """crosscheck's report on one (case, kernel, bug) of a campaign (bug None: honest)."""
    case, kernel, bug = job
    return crosscheck(**run(case, kernel, bug=bug))


def judged_all(jobs):
    """[judged(job) for job in jobs], on a pool of processes (one per core this process may
    use, started at the first call and kept for the session): the small cases of a campaign
    spend most of their time in Python, which threads would not share. torch and BLAS compute
    on one thread in each (_one_thread; the verdicts do not depend on it)."""
    global _POOL
    if _POOL is None:
        _POOL = ProcessPoolExecutor(available_cores(), mp_context=multiprocessing.get_context("spawn"),
                                    initializer=_one_thread)
        atexit.register(_POOL.shutdown)
    return list(_POOL.map(judged, jobs, chunksize=8))


_POOL = None


def _one_thread():
    """A pool process computes on one thread, torch and BLAS alike: the pool has a process
    per core."""
    torch.set_num_threads(1)
    threadpoolctl.threadpool_limits(1)


def false_failures(honest):
    """campaign's honest results that failed, as (kernel, variant, the report's text)."""
    return [(kernel, variant, str(report)) for kernel, variant, report in honest if not report]


def caught(planted):
    """campaign's planted results: bug -> the share of its cases that failed (bugs planted)."""
    return {bug: sum(not report for report in reports) / len(reports)
            for bug, reports in planted.items() if reports}


def random_case(rng, precision, variant, max_len=200):
    """Inputs (float32 arrays holding values of `precision`) and options of one random case."""
    gqa = variant in ("gqa", "scale_gqa")
    b, h_kv = int(rng.integers(1, 3)), int(rng.integers(2 if gqa else 1, 3))
    g = int(rng.choice([2, 3])) if gqa else 1
    n_q, n_k = (int(np.exp(rng.uniform(0, np.log(max_len)))) + 1 for _ in range(2))
    if variant == "decode":
        n_q = 1
    elif variant == "one_key":
        n_k = int(rng.integers(1, 4))
    elif variant == "orthogonal":
        n_q, n_k = 1, int(rng.integers(1, 4))
    if variant in ("causal", "bottom_right", "window", "softcap_bias_window", "alibi"):
        n_k = max(n_k, n_q)                                  # every row keeps a key
    d = int(rng.choice([8, 16, 32, 64]))
    storage = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[precision]
    rounded = lambda x: x.astype(storage).astype(np.float32)
    case = {"q": rounded(rng.uniform(0.5, 2.0) * rng.standard_normal((b, h_kv * g, n_q, d))),
            "k": rounded(rng.standard_normal((b, h_kv, n_k, d))),
            "v": rounded(rng.standard_normal((b, h_kv, n_k, d))),
            "dout": rounded(rng.standard_normal((b, h_kv * g, n_q, d))),
            "precision": np.array(precision)}
    if variant == "orthogonal":               # q's row minus all but 1e-3 of its part along its keys
        keys = np.repeat(case["k"], g, axis=-3).astype(np.float64)                 # [B, H, N_k, d]
        row = case["q"].astype(np.float64)                                         # [B, H, 1, d]
        along = np.linalg.solve(keys @ np.swapaxes(keys, -1, -2), keys @ np.swapaxes(row, -1, -2))
        along *= 1 - rng.uniform(-1e-3, 1e-3, along.shape)                         # [B, H, N_k, 1]
        case["q"] = rounded(row - np.swapaxes(along, -1, -2) @ keys)
    if variant == "mask":
        case["mask"] = rng.random((b, 1, n_q, n_k)) < rng.uniform(0.4, 1.0)
        case["mask"][..., 0] = True                          # no fully masked row
    elif variant == "bias":
        case["bias"] = rounded(rng.standard_normal((h_kv, n_q, n_k)))
    elif variant == "causal" or (variant == "decode" and rng.random() < 0.5):
        case["causal"] = np.array(True)                      # decode: one key visible
    elif variant == "bottom_right":
        case["causal"] = np.array("bottom_right")
    elif variant in ("scale", "scale_gqa"):
        case["scale"] = np.array(float(np.float32(rng.uniform(0.3, 2.0) / math.sqrt(d))))
    elif variant == "window":
        case["window"] = np.array([int(rng.integers(0, 8)), int(rng.integers(0, 8))])
    elif variant in ("softcap", "softcap_bias_window"):
        case["softcap"] = np.array(float(rng.uniform(2.0, 10.0)))
        if variant == "softcap_bias_window":
            case["bias"] = rounded(rng.standard_normal((h_kv * g, n_q, n_k)))
            case["window"] = np.array([int(rng.integers(0, 8)), int(rng.integers(0, 8))])
    elif variant == "alibi":                                 # FlashAttention's slopes 2^(-8 (h + 1) / H)
        heads = h_kv * g
        case["alibi_slopes"] = rounded(2.0 ** (-8 * np.arange(1, heads + 1) / heads))
        if rng.random() < 0.5:
            case["causal"] = np.array("bottom_right")
    elif variant == "dropout":
        p = float(rng.uniform(0.1, 0.3))
        case["dropout_p"] = np.array(p)
        case["dropout_mask"] = rng.random((b, h_kv * g, n_q, n_k)) >= p
    return case


def _keep(case, n_q, n_k, bug=None):
    """The keep-mask [.., N_q, N_k] of the case's mask, causal and window (None: all kept)."""
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    keep = np.ones((n_q, n_k), bool)
    causal = case.get("causal")
    if causal is not None:
        diag = i + (n_k - n_q if str(causal) == "bottom_right" else 0)
        keep &= j <= diag
        if bug == "causal_row":                              # one row sees the future
            row = int(np.argmin(keep.sum(axis=1)))
            keep[row] = True
    if "window" in case:
        left, right = (int(w) + (1 if bug == "window" else 0) for w in case["window"])
        keep &= (j >= i - left) & (j <= i + right)
    if "mask" in case:
        keep = keep & case["mask"]
    return None if keep.all() else keep


def _manual(q, k, v, case, scale, bug):
    """Attention as torch ops in the tensors' dtype (torch's eager math)."""
    g = q.shape[-3] // k.shape[-3]
    if bug == "gqa_group":                                   # query head h meets kv head h % H_kv
        k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)
    else:
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    s = (q @ k.transpose(-1, -2)) * scale
    if "softcap" in case:
        c = float(case["softcap"])
        s = torch.tanh(s / c) * c
    if "bias" in case:
        s = s + case["_bias"]
    if "_slopes" in case:                                    # -slope |i + N_k - N_q - j|, in the dtype
        n_q, n_k = q.shape[-2], k.shape[-2]
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        s = s - case["_slopes"][:, None, None] * (i + n_k - n_q - j).abs().to(s.dtype)
    keep = _keep(case, q.shape[-2], k.shape[-2], bug)
    if keep is not None:
        s = s.masked_fill(torch.from_numpy(~keep), float("-inf"))
    p = torch.softmax(s, dim=-1)
    if "dropout_mask" in case:
        p = p * torch.from_numpy(case["dropout_mask"]).to(p.dtype)
        if bug != "dropout":
            p = p / (1 - float(case["dropout_p"]))
    return p @ v, None


def _sdpa(q, k, v, case, scale, bug, backend=None):
    keep = _keep(case, q.shape[-2], k.shape[-2], bug)
    kw = {"scale": scale, "enable_gqa": q.shape[-3] != k.shape[-3]}
    if "bias" in case:
        bias = case["_bias"]
        kw["attn_mask"] = bias if keep is None else bias.masked_fill(torch.from_numpy(~keep), float("-inf"))
    elif keep is not None:
        causal = case.get("causal")
        if causal is not None and str(causal) != "bottom_right" and "mask" not in case and bug is None:
            kw["is_causal"] = True
        else:
            kw["attn_mask"] = torch.from_numpy(keep)
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, **kw), None
    with torch.nn.attention.sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, **kw), None


def _flash_lse(q, k, v, case, scale, bug):
    """torch's CPU flash kernel, which also returns the float32 lse [B, H, N_q]."""
    g = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    causal = case.get("causal") is not None
    if bug == "causal_row":                                  # the kernel cannot; miss the diagonal shift
        causal = False
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                          scale=scale)
    return out, lse


RUNNERS = {"sdpa": _sdpa, "manual": _manual, "flash_lse": _flash_lse,
           "math": lambda *a: _sdpa(*a, backend=torch.nn.attention.SDPBackend.MATH)}


def run(case, kernel, bug=None):
    """The case's arrays plus the candidate's results (torch's dtypes: bfloat16 as tensors)."""
    dtype = DTYPES[str(case["precision"])]
    t = {n: torch.from_numpy(case[n]).to(dtype).requires_grad_(n != "dout") for n in ("q", "k", "v", "dout")}
    if "bias" in case:
        case = {**case, "_bias": torch.from_numpy(case["bias"]).to(dtype).requires_grad_()}
    if "alibi_slopes" in case:
        case = {**case, "_slopes": torch.from_numpy(case["alibi_slopes"]).to(dtype).requires_grad_()}
    d = case["q"].shape[-1]
    scale = float(case["scale"]) if "scale" in case else 1 / math.sqrt(d)
    if bug == "scale":
        scale *= 1.01
    out, lse = RUNNERS[kernel](t["q"], t["k"], t["v"], case, scale, bug)
    out.backward(t["dout"])
    result = {n: x for n, x in case.items() if not n.startswith("_")}
    if "_bias" in case:                                      # the bias as the kernel read it: a tensor
        result["bias"] = case["_bias"].detach()              # in its dtype (bfloat16: no NumPy dtype)
    result.update(out=out.detach(), dq=t["q"].grad, dk=t["k"].grad, dv=t["v"].grad)
    if lse is not None:
        result["lse"] = lse.detach()
        if bug == "lse_row":                                 # each row gets its neighbour's lse
            result["lse"] = torch.roll(result["lse"], 1, dims=-1)
    if "_bias" in case:
        result["dbias"] = case["_bias"].grad
    if "_slopes" in case:
        result["alibi_slopes"] = case["_slopes"].detach()
        result["dalibi_slopes"] = case["_slopes"].grad
    if bug == "dq_entry":                                    # a random entry, off by 5% of max|dq|
        dq = result["dq"].float()
        index = tuple(int(i) for i in np.random.default_rng(dq.numel()).integers(0, dq.shape))
        dq[index] += 0.05 * float(dq.abs().max())
        result["dq"] = dq.to(dtype)
    return result
