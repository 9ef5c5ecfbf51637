"""crosscheck on a FlashAttention-2 kernel written in Triton (tests/triton_attention.py), run by
Triton's CPU interpreter: forward (out, lse) and backward (dq, dk, dv) in float16, bfloat16 and
float32, on random cases of every option it has (N_q != N_k with lengths 1 to 256 that are no
multiple of its 32-row blocks, decoding, causal in both alignments, a custom scale, grouped-query
heads, head dims 16 / 32 / 64).

Honest results must all pass (0 false failures; a failing case is saved as an .npz under the
temporary directory's triton_failures/ for the rule's owner). Planted bugs in the kernel must
fail: a scale 1% off, the causal diagonal excluded, dq missing its scale and one kv head's dk
negated in every case they change; the running sum rounded to the 16-bit dtype after every key
block in as many cases as measured on this fixed seed set. FlashAttention's own test rule is
computed on the same results for comparison and printed beside crosscheck's (pytest -s).

Why a subprocess: the interpreter needs TRITON_INTERPRET=1 before `import triton`, not only
before our kernels are decorated. Triton reads it at each @triton.jit decoration, and
triton.language's own helpers (tl.zeros, tl.sum, tl.max, ...) are @triton.jit functions decorated
when triton is imported; imported without it (by pytest.importorskip below, or by any test file
that ran first), they stay compiled-mode functions, and an interpreted kernel calling them fails
with "Cannot call @triton.jit'd outside of the scope of a kernel". So the campaign runs in a fresh
Python (this file as a script) whose environment has TRITON_INTERPRET=1 from the start, and
returns its verdicts as JSON; this process only imports triton to know it is there.
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
import pytest
from optional import TORCH_REASON, TRITON_REASON
from threadpoolctl import threadpool_limits

from numpy_attention.oracle import crosscheck, reference, save_case

torch = pytest.importorskip("torch", reason=TORCH_REASON)

pytestmark = pytest.mark.slow                   # every test here judges the interpreted kernels' campaign
PRECISIONS = ("float16", "bfloat16", "float32")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
STORAGE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
BUGS = ("scale", "causal_diagonal", "low_sum", "dq_unscaled", "dk_head")   # triton_attention.BUGS
LENGTHS = (1, 3, 17, 64, 113, 128)
LARGE = (160, 192, 256)
# the cases of one precision, by variant (random_case); 9 per precision, about 10 s here
VARIANTS = ("plain", "decode", "decode", "causal", "bottom_right", "bottom_right", "scale", "gqa",
            "large")
SEED = 2024
GROSS = ("scale", "causal_diagonal", "dq_unscaled", "dk_head")     # caught in every case they change
BACKWARD_BUGS = ("dq_unscaled", "dk_head")     # planted in every other case each (the interpreter's time)
# low_sum: (cases caught, cases planted) on this seed set, as measured. A sum rounded to the
# 16-bit T after each key block moves out by about eps(T)/2 per block, the size of out's own
# rounding, and the rule lets an lse be off by eps(T)/2 (what a kernel that sums its weights
# rounded to T makes of it, as torch's CPU flash kernel does): mostly unseen.
LOW_SUM_CAUGHT = {"float16": (2, 7), "bfloat16": (1, 7)}
FAILURES = os.path.join(tempfile.gettempdir(), "triton_failures")
CAMPAIGN_TIMEOUT = 600                          # seconds; the campaign takes about 30 here


def random_case(rng, precision, variant):
    """One case: q, k, v, dout (float32 arrays holding values of `precision`) [B, H, N, D] and
    the options causal (False, True, "bottom_right") and scale (None: 1/sqrt(D))."""
    d = int(rng.choice([16, 32, 64]))
    b, kv_heads, group = 1, 1, 1                         # the interpreter's time grows with B * H
    n_q, n_k = (int(rng.choice(LENGTHS)) for _ in range(2))
    causal, scale = False, None
    if variant == "plain":                               # two sequences: the batch offsets
        b = 2
    elif variant == "decode":                            # one query; causal top-left sees one key
        n_q, causal = 1, [False, True, "bottom_right"][int(rng.integers(0, 3))]
    elif variant == "causal":
        causal = True
    elif variant == "bottom_right":                      # N_q > N_k: the first rows see no key
        causal = "bottom_right"
    elif variant == "scale":
        scale = float(np.float32(rng.uniform(0.3, 2.0) / math.sqrt(d)))
    elif variant == "gqa":
        kv_heads, group = 2, int(rng.choice([2, 3]))     # h // group, not h % kv_heads
        causal = [False, "bottom_right"][int(rng.integers(0, 2))]
    elif variant == "large":
        n_q, n_k, kv_heads = int(rng.choice(LARGE)), int(rng.choice(LARGE)), 1
        causal = [False, True, "bottom_right"][int(rng.integers(0, 3))]
    rounded = lambda x: x.astype(STORAGE[precision]).astype(np.float32)
    heads = kv_heads * group
    return {"q": rounded(rng.uniform(0.5, 2.0) * rng.standard_normal((b, heads, n_q, d))),
            "k": rounded(rng.standard_normal((b, kv_heads, n_k, d))),
            "v": rounded(rng.standard_normal((b, kv_heads, n_k, d))),
            "dout": rounded(rng.standard_normal((b, heads, n_q, d))),
            "causal": causal, "scale": scale, "precision": precision, "variant": variant}


def keep_mask(case):
    """[N_q, N_k] bool: query i sees key j."""
    n_q, n_k = case["q"].shape[-2], case["k"].shape[-2]
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    if case["causal"] is False:
        return np.ones((n_q, n_k), bool)
    return j <= i + (n_k - n_q if case["causal"] == "bottom_right" else 0)


def plants(case, bug):
    """Whether `bug` changes this case's exact results. With at most one key per row P is 1 and
    dq = dk = 0 (scale, l, dq and dk bugs change nothing); a scale error moves P only where a
    row's scores spread (by more than 1, as tests/torch_kernels.py asks); the running sum in a
    16-bit dtype only where the dtype is 16-bit."""
    keep = keep_mask(case)
    two_keys = int(keep.sum(axis=1).max()) >= 2
    if bug == "causal_diagonal":                         # every causal row has its diagonal key
        return case["causal"] is not False
    if bug == "low_sum":
        return two_keys and case["precision"] != "float32"
    if bug == "scale":
        group = case["q"].shape[1] // case["k"].shape[1]
        scale = case["scale"] or 1 / math.sqrt(case["q"].shape[-1])
        s = scale * case["q"] @ np.swapaxes(np.repeat(case["k"], group, axis=1), -1, -2)
        seen = keep.any(axis=1)                          # rows with a key
        spread = np.where(keep, s, -np.inf).max(-1) - np.where(keep, s, np.inf).min(-1)
        return two_keys and bool(spread[..., seen].max() > 1)
    return two_keys                                      # dq_unscaled, dk_head (kv head 0 of batch 0)


def run(case, bug=None):
    """The kernel on the case: crosscheck's arrays (inputs, options, out, lse, dq, dk, dv).
    In the campaign's own process only (see the module docstring)."""
    from triton_attention import flash_attention
    dtype = DTYPES[case["precision"]]
    t = {n: torch.from_numpy(case[n]).to(dtype).requires_grad_(n != "dout")
         for n in ("q", "k", "v", "dout")}
    out, lse = flash_attention(t["q"], t["k"], t["v"], causal=case["causal"], scale=case["scale"], bug=bug)
    out.backward(t["dout"])
    arrays = {n: t[n].detach() for n in ("q", "k", "v", "dout")}
    arrays.update(out=out.detach(), lse=lse, dq=t["q"].grad, dk=t["k"].grad, dv=t["v"].grad,
                  precision=case["precision"])
    if case["causal"] is not False:
        arrays["causal"] = case["causal"]
    if case["scale"] is not None:
        arrays["scale"] = case["scale"]
    return arrays


def flash_rule(arrays, report):
    """FlashAttention's own test rule on the same results: each of out, dq, dk, dv passes iff
    max|x - ref| <= 2 max|x_pt - ref| + atol, atol = 2 max|(ref + 0.3 - 0.3) - ref| in x's dtype;
    ref is our float64 oracle, max|x_pt - ref| the report's baseline error (its same-precision
    reference). Returns the tensors that fail it, as "name: err > bound" (empty: a PASS)."""
    inputs = {n: arrays[n].float().numpy().astype(np.float64) for n in ("q", "k", "v", "dout")}
    options = {n: arrays[n] for n in ("causal", "scale") if n in arrays}
    ref = reference(inputs, options, np.float64)
    low = STORAGE[arrays["precision"]]
    failed = []
    for row in report.rows:
        if row.name in ("out", "dq", "dk", "dv"):
            r = ref[row.name].astype(low)
            atol = 2 * float(np.max(np.abs((r + 0.3 - 0.3) - r).astype(np.float64)))
            if not row.max_abs_err <= 2 * row.baseline_err + atol:
                failed.append(f"{row.name}: {row.max_abs_err:.2e} > 2 * {row.baseline_err:.2e} + {atol:.2e}")
    return failed


def save_failure(arrays, index):
    """The failing case as an .npz (16-bit tensors as float32 values, with the precision)."""
    os.makedirs(FAILURES, exist_ok=True)
    path = os.path.join(FAILURES, f"{arrays['precision']}_{index}.npz")
    save_case(path, **{n: x.detach().float().numpy() if torch.is_tensor(x) else np.asarray(x)
                       for n, x in arrays.items()})
    return path


def run_campaign():
    """Every case of every precision, honest and with each bug it changes (run in a process
    started with TRITON_INTERPRET=1). Returns a JSON-able dict: interpreted (whether the kernels
    and tl.zeros are interpreted functions), honest [{precision, variant, causal, shapes, passed,
    flash_failed (FlashAttention's rule's failures), report and saved (its .npz; failing only)}],
    planted {"precision bug": [{passed, flash_passed, changed (some result differs from the
    honest one), ratios {tensor: [max-abs, L2, row ratio]}}, ...]} and seconds."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    import triton_attention
    assert set(triton_attention.BUGS) == set(BUGS), sorted(triton_attention.BUGS)
    torch.set_num_threads(1)
    threadpool_limits(1)            # the interpreter's NumPy products: one BLAS thread, same bits
    start = time.perf_counter()
    honest, planted = [], {}
    for p, precision in enumerate(PRECISIONS):
        rng = np.random.default_rng([SEED, p])
        for i, variant in enumerate(VARIANTS):
            case = random_case(rng, precision, variant)
            bugs = [bug for bug in BUGS if bug != BACKWARD_BUGS[i % 2]]   # one of the two, by turns
            arrays = run(case)
            report = crosscheck(**arrays)
            row = {"precision": precision, "variant": variant, "causal": case["causal"],
                   "shapes": [list(case[n].shape) for n in ("q", "k")], "passed": bool(report),
                   "flash_failed": flash_rule(arrays, report)}
            if not report:
                row.update(report=str(report), saved=save_failure(arrays, len(honest)))
            honest.append(row)
            for bug in bugs:
                if plants(case, bug):
                    bad = run(case, bug)
                    bad_report = crosscheck(**bad)
                    changed = any(not torch.equal(bad[n], arrays[n])
                                  for n in ("out", "lse", "dq", "dk", "dv"))
                    ratios = {r.name: [r.ratio, r.l2_ratio, r.row_ratio] for r in bad_report.rows}
                    planted.setdefault(f"{precision} {bug}", []).append(
                        {"passed": bool(bad_report), "flash_passed": not flash_rule(bad, bad_report),
                         "changed": changed, "ratios": ratios})
    interpreted = all(isinstance(f, InterpretedFunction) for f in (triton_attention._attn_fwd, tl.zeros))
    return {"interpreted": interpreted, "honest": honest, "planted": planted,
            "seconds": time.perf_counter() - start}


@pytest.fixture(scope="module")
def campaign():
    """run_campaign's results, from this file run as a script in a fresh Python with
    TRITON_INTERPRET=1 (the module docstring says why)."""
    pytest.importorskip("triton", reason=TRITON_REASON)
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=here, capture_output=True,
                          text=True, timeout=CAMPAIGN_TIMEOUT, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_ran_interpreted(campaign):
    """The campaign's kernels, and triton.language's own helpers, were interpreted functions."""
    assert campaign["interpreted"]


def test_no_false_failure(campaign):
    """Every honest case passes crosscheck; a failing one is saved for the rule's owner."""
    honest = campaign["honest"]
    assert len(honest) == len(PRECISIONS) * len(VARIANTS)
    failed = [row for row in honest if not row["passed"]]
    print(f"\nhonest cases: crosscheck failed {len(failed)} of {len(honest)}, FlashAttention's rule "
          f"{sum(bool(row['flash_failed']) for row in honest)}; campaign {campaign['seconds']:.1f} s")
    for row in honest:
        if row["flash_failed"]:
            print(f"  FlashAttention's rule fails {row['precision']} {row['variant']} causal={row['causal']} "
                  f"q, k {row['shapes']}: {'; '.join(row['flash_failed'])}")
    assert not failed, [(row["precision"], row["variant"], row["saved"], row["report"]) for row in failed[:2]]


def test_planted_bugs_are_caught(campaign):
    """Every planted bug changes the results; the gross ones fail in every case, in every
    precision; the 16-bit running sum in at least the measured number of cases (of as many
    planted). Both rules' counts are printed."""
    counts = {}
    print("\nplanted bug, precision: crosscheck caught / FlashAttention's rule caught / planted")
    for key, verdicts in sorted(campaign["planted"].items()):
        assert all(v["changed"] for v in verdicts), key
        ours = sum(not v["passed"] for v in verdicts)
        theirs = sum(not v["flash_passed"] for v in verdicts)
        counts[key] = (ours, len(verdicts))
        print(f"  {key:<28}{ours:>3} / {theirs:>3} / {len(verdicts)}")
    for precision in PRECISIONS:
        for bug in GROSS:
            caught, total = counts[f"{precision} {bug}"]
            assert total >= 3 and caught == total, (precision, bug, caught, total)
    for precision, (caught, total) in LOW_SUM_CAUGHT.items():
        assert counts[f"{precision} low_sum"][1] == total, (precision, counts[f"{precision} low_sum"])
        assert counts[f"{precision} low_sum"][0] >= caught, (precision, counts[f"{precision} low_sum"])
    assert "float32 low_sum" not in counts                     # a float32 sum is the honest one


if __name__ == "__main__":          # the campaign's own process (the fixture above starts it)
    print(json.dumps(run_campaign()))
