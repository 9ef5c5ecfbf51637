"""The cross-check's verdicts on torch, both ways: honest results (torch's own SDPA, float32
and float64, 1,000 random cases) must pass, and results with planted bugs must fail.
"""
import numpy as np
import pytest
from optional import TORCH_REASON

from numpy_attention import attention_backward, attention_forward
from numpy_attention.oracle import crosscheck

torch = pytest.importorskip("torch", reason=TORCH_REASON)      # every test here needs it: skip the file
F = torch.nn.functional

VARIANTS = ("plain", "mask", "bias", "causal", "scale")


def torch_case(rng, dtype, variant, max_len=300, min_len=1):
    """A random case and torch SDPA's results for it (the .npz keys)."""
    b, h_kv, g = (int(x) for x in (rng.integers(1, 3), rng.integers(1, 3), rng.choice([1, 2, 3])))
    n_q, n_k = (int(np.exp(rng.uniform(np.log(min_len), np.log(max_len)))) for _ in range(2))
    d_k, d_v = (int(x) for x in rng.choice([1, 3, 8, 16, 32, 64], 2))
    amp = rng.uniform(0.5, 3.0)
    arrays = {"q": amp * rng.standard_normal((b, h_kv * g, n_q, d_k)),
              "k": rng.standard_normal((b, h_kv, n_k, d_k)),
              "v": rng.standard_normal((b, h_kv, n_k, d_v)),
              "dout": rng.standard_normal((b, h_kv * g, n_q, d_v))}
    arrays = {name: x.astype(dtype) for name, x in arrays.items()}
    t = {name: torch.from_numpy(x).requires_grad_(name != "dout") for name, x in arrays.items()}
    kw = {"enable_gqa": g > 1}
    if variant == "mask":
        arrays["mask"] = rng.random((b, 1, n_q, n_k)) < rng.uniform(0.3, 1.0)
        kw["attn_mask"] = torch.from_numpy(arrays["mask"])
    elif variant == "bias":
        shape = [(n_q, n_k), (h_kv * g, n_q, n_k), (b, 1, 1, n_k)][rng.integers(3)]
        arrays["bias"] = rng.standard_normal(shape).astype(dtype)
        t["bias"] = kw["attn_mask"] = torch.from_numpy(arrays["bias"]).requires_grad_()
    elif variant == "causal":
        arrays["causal"] = np.array(True)
        kw["is_causal"] = True
    elif variant == "scale":
        kw["scale"] = float(rng.uniform(0.05, 2.0) / np.sqrt(d_k))
        arrays["scale"] = np.array(kw["scale"])
    out = F.scaled_dot_product_attention(t["q"], t["k"], t["v"], **kw)
    out.backward(t["dout"])
    arrays.update(out=out.detach().numpy(), dq=t["q"].grad.numpy(), dk=t["k"].grad.numpy(),
                  dv=t["v"].grad.numpy())
    if "bias" in t:
        arrays["dbias"] = t["bias"].grad.numpy()
    return arrays


# ----------------------------------------------------------------------------- verdicts on torch

def test_float64_candidates_get_a_longdouble_oracle():
    report = crosscheck(**torch_case(np.random.default_rng(1), np.float64, "bias", max_len=20))
    assert report, str(report)
    assert report.oracle_dtype == str(np.dtype(np.longdouble))


@pytest.mark.parametrize("variant", VARIANTS)
def test_torch_float32_sdpa_passes(variant):
    arrays = torch_case(np.random.default_rng(2), np.float32, variant, max_len=64)
    report = crosscheck(**arrays)
    assert report, str(report)
    assert {row.name for row in report.rows} >= {"out", "dq", "dk", "dv"}


@pytest.mark.slow
def test_no_false_failure_over_1000_torch_cases():
    rng = np.random.default_rng(2024)
    failures = []
    for i in range(1000):
        dtype = (np.float32, np.float64)[i % 2]
        variant = VARIANTS[(i // 2) % len(VARIANTS)]
        report = crosscheck(**torch_case(rng, dtype, variant, max_len=300 if i % 10 == 0 else 48))
        if not report:
            failures.append(f"case {i} ({np.dtype(dtype)}, {variant}):\n{report}")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- planted bugs

def _buggy_grads(arrays, forget_rowsum=False):
    """float32 gradients by hand: dS = P (dP - D), or P dP when forget_rowsum (one head group)."""
    q, k, v, dout = (arrays[n].astype(np.float32) for n in ("q", "k", "v", "dout"))
    _, cache = attention_forward(q, k, v, causal=bool(arrays.get("causal", False)))
    g = attention_backward(dout, cache, return_stages=True)
    p, dp = cache.weights, g.stages.dP
    ds = p * dp if forget_rowsum else g.stages.dS
    return cache.options.scale * ds @ k, cache.options.scale * np.swapaxes(ds, -1, -2) @ q


def test_planted_bug_one_dq_element_off_by_one_percent():
    detected = 0
    for seed in range(20):                             # N_k >= 2: with one key, dq = 0 exactly
        arrays = torch_case(np.random.default_rng(seed), (np.float32, np.float64)[seed % 2], "plain", 64, 2)
        dq = arrays["dq"].copy()
        dq[(0,) * dq.ndim] += 0.01 * np.abs(dq).max()
        report = crosscheck(**{**arrays, "dq": dq})
        rows = {row.name: row.passed for row in report.rows}
        detected += not rows["dq"]
        assert rows["out"] and rows["dk"] and rows["dv"]
    assert detected == 20


def test_planted_bug_softmax_backward_without_the_row_sum():
    for seed in range(10):
        arrays = torch_case(np.random.default_rng(seed), np.float32, "causal", 64)
        if arrays["k"].shape[-3] != arrays["q"].shape[-3] or arrays["k"].shape[-2] == 1:
            continue                                   # one kv head per query head; N_k = 1 has dq = 0
        dq, dk = _buggy_grads(arrays, forget_rowsum=True)
        rows = {row.name: row.passed for row in crosscheck(**{**arrays, "dq": dq, "dk": dk}).rows}
        assert not rows["dq"] and not rows["dk"] and rows["dv"] and rows["out"]
        honest_dq, honest_dk = _buggy_grads(arrays)
        assert crosscheck(**{**arrays, "dq": honest_dq, "dk": honest_dk})


def test_planted_bug_causal_alignment_swapped():
    for seed in range(10):
        arrays = torch_case(np.random.default_rng(seed), np.float32, "causal", 64)
        if arrays["q"].shape[-2] == arrays["k"].shape[-2]:
            continue                                   # the alignments agree when N_q == N_k
        q, k, v = (torch.from_numpy(arrays[n]) for n in "qkv")
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2])
        swapped = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
        report = crosscheck(**{**arrays, "out": swapped.numpy()})
        assert not report.rows[0].passed, str(report)
