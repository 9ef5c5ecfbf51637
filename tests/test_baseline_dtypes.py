"""Every baseline array keeps the case's dtype: a float32 kernel is held to float32 rounding.

An option that leaks a wider dtype into a baseline (ALiBi's integer distances times float32
slopes made float64) makes the baseline more accurate than any kernel of that precision, and
honest kernels fail against it. Each variant, each baseline way, each tensor: float32 in a
float32 case (the naive baseline) and in a 16- or 8-bit one (the recipe, its values rounded to
the compute dtype and held in float32), float64 in a float64 case. And the flash way's sum of
a group's dk, dv over its query heads is torch's CPU flash kernel's, head by head in T.
"""
import warnings

import ml_dtypes
import numpy as np
import pytest

from numpy_attention.oracle import baselines, crosscheck, split_case

RNG = np.random.default_rng(0)
Q, K, V = (RNG.standard_normal(shape) for shape in ((2, 4, 6, 8), (2, 2, 7, 8), (2, 2, 7, 8)))
DOUT = RNG.standard_normal((2, 4, 6, 8))
VARIANTS = {
    "plain": {},
    "causal": {"causal": np.array(True)},
    "alibi [H]": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
    "alibi [B, H]": {"alibi_slopes": RNG.random((2, 4))},
    "alibi, causal, window": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]),
                              "causal": np.array(True), "window": np.array([2, 1])},
    "bias": {"bias": RNG.standard_normal((4, 6, 7))},
    "sinks": {"sinks": RNG.standard_normal(4)},
    "softcap": {"softcap": np.array(5.0)},
    "dropout": {"dropout_p": np.array(0.2), "dropout_mask": RNG.random((2, 4, 6, 7)) > 0.2},
}
HELD = {"float64": np.float64, "float32": np.float32, "bfloat16": np.float32, "float16": np.float32}


@pytest.mark.parametrize("precision", list(HELD))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_baseline_array_keeps_the_cases_dtype(variant, precision):
    dtype = np.float32 if precision != "float64" else np.float64
    arrays = {"q": Q, "k": K, "v": V, "dout": DOUT, **VARIANTS[variant]}
    arrays = {name: x.astype(dtype) if x.dtype.kind == "f" else x for name, x in arrays.items()}
    if precision in ("bfloat16", "float16"):                # the values a 16-bit kernel read
        import ml_dtypes
        low = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[precision]
        arrays = {name: x.astype(low).astype(np.float32) if x.dtype.kind == "f" else x
                  for name, x in arrays.items()}
    case = split_case({**arrays, "out": arrays["q"], "dq": arrays["q"]}, precision=precision)
    ways = baselines(case)
    assert ways
    dtypes = {(i, name): str(x.dtype) for i, way in enumerate(ways) for name, x in way.items()
              if x is not None}
    assert set(dtypes.values()) == {np.dtype(HELD[precision]).name}, dtypes


# ----------------------------------------------------------------------------- grouped heads' sums

def test_the_flash_way_adds_a_groups_dv_head_by_head_as_torchs_cpu_flash_kernel_does(torch):
    """Decoding with one key and eight query heads on one kv head: P = 1, so dv is the sum of
    the eight heads' dout rows. torch's CPU flash kernel adds them one head at a time in
    bfloat16, bit for bit the recipe's flash way; a float32 sum rounded once is another
    result, whose error is several times smaller (the rule would fail the kernel on it)."""
    rng = np.random.default_rng(0)
    q, dout = (rng.standard_normal((1, 8, 1, 128)).astype(ml_dtypes.bfloat16) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, 1, 128)).astype(ml_dtypes.bfloat16) for _ in range(2))
    t = {n: torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).requires_grad_(n != "dout")
         for n, x in (("q", q), ("k", k), ("v", v), ("dout", dout))}
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"], enable_gqa=True)
    out.backward(t["dout"])
    kernel_dv = t["v"].grad.float().numpy()
    rounded = lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    head_by_head = dout[0, 0].astype(np.float32)
    for h in range(1, 8):
        head_by_head = rounded(head_by_head + dout[0, h].astype(np.float32))
    assert np.array_equal(kernel_dv[0, 0], head_by_head)
    case = split_case({"q": q, "k": k, "v": v, "dout": dout, "out": out.detach().float().numpy(),
                       "precision": np.array("bfloat16")})
    flash = baselines(case)[3]                                # scale on k, flash backward (runs.case_ways)
    assert np.array_equal(flash["dv"], kernel_dv)
    once = rounded(np.sum(dout[0].astype(np.float32), axis=0))
    assert not np.array_equal(once, head_by_head)
    report = crosscheck(q=q, k=k, v=v, dout=dout, out=out.detach(), dq=t["q"].grad, dk=t["k"].grad,
                        dv=t["v"].grad)
    assert report, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_the_flex_way_is_flex_attentions_eager_forward(precision, torch):
    """flex_attention's eager kernel takes the scores in float32 from the product on (an ALiBi
    score_mod whose slopes are a tensor of the dtype: its distances and terms in T): the recipe's
    scores="float32" way gives its out bit for bit in bfloat16, all but a few entries (< 1%, by
    one ulp) in float16; the ways that round the scores differ in half of them."""
    from torch.nn.attention.flex_attention import flex_attention
    from numpy_attention import attention_options
    from numpy_attention.oracle.precision import PRECISIONS
    from numpy_attention.oracle.recipe import recipe_attention
    p, rng = PRECISIONS[precision], np.random.default_rng(1)
    q, k, v = (rng.standard_normal(shape).astype(p.storage).astype(np.float32)     # distances to 299:
               for shape in ((1, 2, 40, 32), (1, 2, 300, 32), (1, 2, 300, 32)))     # beyond bfloat16's 256
    slopes = np.array([0.25, 0.0247802734375], np.float32)   # far keys weigh; no power of 2
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[precision]
    tq, tk, tv, ts = (torch.from_numpy(x).to(dtype) for x in (q, k, v, slopes))
    alibi = lambda score, b, h, i, j: score - ts[h] * (i + 300 - 40 - j).abs()
    with warnings.catch_warnings():                   # flex_attention's "use torch.compile" advice
        warnings.simplefilter("ignore")
        out = flex_attention(tq, tk, tv, score_mod=alibi).float().numpy()
    q3, k3, v3, record = attention_options(q, k, v, alibi_slopes=slopes)
    ours = recipe_attention(q3, k3, v3, record, p, reorder=False, scores="float32")["out"]
    rounded_scores = recipe_attention(q3, k3, v3, record, p, reorder=False)["out"]
    finfo = ml_dtypes.finfo(p.storage)                     # one ulp of out, its subnormals' too
    ulp = np.maximum(np.abs(out) * float(finfo.eps), float(finfo.smallest_subnormal))
    assert np.mean(ours != out) <= (0 if precision == "bfloat16" else 0.01)
    assert np.all(np.abs(ours - out) <= ulp) and np.mean(rounded_scores != out) > 0.3
