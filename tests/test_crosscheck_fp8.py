"""crosscheck of FP8 attention with scales: descales per tensor, per (batch, kv head), per head, per
token of a head and per block of tokens (descale_of), P rounded to float8 or kept in bfloat16
(intermediate_dtype), the products accumulated in fewer bits (accumulator_bits), torch
candidates honest and with planted bugs (tests/fp8_kernels.py; the longer sweep:
benchmarks/variant_sweeps.py --variant fp8), the diagnosis naming a descale dropped, applied
twice or one scale used for every head, and bad keys refused by name."""
import math

import ml_dtypes
import numpy as np
import pytest
from optional import TORCH_REASON

import numpy_attention as na
from numpy_attention.oracle.schema import CaseError
from numpy_attention.oracle.transforms import descale_of

torch = pytest.importorskip("torch", reason=TORCH_REASON)
import fp8_kernels  # noqa: E402  (needs torch)

CASES = 40


@pytest.fixture(scope="module")
def counts():
    return fp8_kernels.sweep(CASES, seed=1)


@pytest.mark.slow
def test_honest_torch_candidates_pass(counts):
    judged, failed, _, _ = counts[("float8", "honest")]
    assert judged == CASES and failed == 0, counts


@pytest.mark.slow
@pytest.mark.parametrize("bug", fp8_kernels.BUGS)
def test_each_planted_bug_is_caught_and_mostly_named(counts, bug):
    """Caught in every case; named in most (not where the bug makes the softmax so sharp that the
    candidate's bfloat16 scores round beyond the diagnosis's reach: q's or k's descale dropped in
    a kernel that dequantizes to bfloat16)."""
    judged, failed, named, _ = counts[("float8", bug)]
    least = 1 if bug == "p_saturates" else CASES // 2     # P saturates where a later tile's scores rise
    assert judged >= least and failed == judged and named >= 0.6 * judged, counts


@pytest.mark.parametrize("shape, block, expected", [
    ((), None, "tensor"), ((2, 2), None, "batch, kv head"), ((2, 4), None, "batch, head"),
    ((2, 4, 10), None, "token"), ((2, 4, 3), 4, "block"),
])
def test_each_descale_shape_broadcasts_as_named(shape, block, expected):
    """q [2, 4, 10, d] (two query heads a kv head): the descale of each granularity lands on the
    entries of its group."""
    rng = np.random.default_rng(0)
    descale = rng.uniform(0.5, 2, shape)
    full = descale_of(descale, (2, 4, 10, 8), (2, 2, 10, 8), block, "q_descale")
    full = np.broadcast_to(full, (2, 4, 10, 1))[..., 0]
    want = {"tensor": lambda: np.full((2, 4, 10), descale),
            "batch, kv head": lambda: np.repeat(descale, 2, axis=1)[..., None].repeat(10, -1),
            "batch, head": lambda: descale[..., None].repeat(10, -1),
            "token": lambda: descale,
            "block": lambda: np.repeat(descale, 4, axis=-1)[..., :10]}[expected]()
    np.testing.assert_array_equal(full, want)


def _fp8_case(**change):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn) for shape in
               [(1, 2, 5, 16), (1, 2, 9, 16), (1, 2, 9, 16)])
    descales = {f"{n}_descale": rng.uniform(0.5, 2, (1, 2, 9 if n != "q" else 5)).astype(np.float32) for n in "qkv"}
    real = {n: x.astype(np.float64) * descales[f"{n}_descale"][..., None] for n, x in zip("qkv", (q, k, v))}
    out, cache = na.attention_forward(real["q"], real["k"], real["v"], causal="bottom_right")
    arrays = dict(q=q, k=k, v=v, **descales, out=out.astype(ml_dtypes.bfloat16), lse=cache.lse.astype(np.float32),
                  causal="bottom_right", precision="float8_e4m3fn")
    return {**arrays, **change}


def test_per_token_descales_and_p_kept_in_bfloat16():
    """A float64 result of the dequantized values passes with per-token descales, P in float8 or
    bfloat16; the same with k's descale dropped fails, and the diagnosis says so."""
    for intermediate in ("float8_e4m3fn", "bfloat16"):
        assert na.crosscheck(**_fp8_case(intermediate_dtype=intermediate))
    arrays = _fp8_case()
    real = {n: arrays[n].astype(np.float64) * (arrays[f"{n}_descale"][..., None] if n != "k" else 1) for n in "qkv"}
    out, cache = na.attention_forward(real["q"], real["k"], real["v"], causal="bottom_right")
    report = na.crosscheck(**{**arrays, "out": out.astype(ml_dtypes.bfloat16), "lse": cache.lse.astype(np.float32)})
    assert not report and any("k_descale dropped" in line for line in report.diagnosis), report


def test_a_narrow_accumulator_keeps_bits_minus_9_mantissa_bits_truncated_every_32_products():
    """_narrow_matmul against a loop written here, on integers (every step's sum exact): after
    each 32 products the accumulator keeps its leading bits - 8 significant bits, truncated."""
    from numpy_attention.oracle.recipe import _narrow_matmul
    rng = np.random.default_rng(5)
    x, y = (rng.integers(-60, 61, shape).astype(np.float32) for shape in [(2, 3, 4, 100), (2, 1, 100, 5)])
    for bits in (12, 22):
        expected = np.zeros((2, 3, 4, 5))
        for t in range(0, 100, 32):
            expected += np.einsum("bhia,bjac->bhic", x[..., t:t + 32].astype(np.float64), y[..., t:t + 32, :])
            mantissa, exponent = np.frexp(expected)                    # |mantissa| in [0.5, 1)
            expected = np.ldexp(np.trunc(mantissa * 2.0 ** (bits - 8)), exponent - (bits - 8))
        np.testing.assert_array_equal(_narrow_matmul(x, y, bits), expected)
    assert not np.array_equal(_narrow_matmul(x, y, 12), np.matmul(x, np.repeat(y, 3, axis=1)))


def test_the_baseline_follows_the_accumulator_the_case_names():
    """A kernel accumulating its products in 12 bits (3 of mantissa) fails a case that says nothing
    of its accumulator; with accumulator_bits=12 the baseline accumulates so too and its out error
    grows with it (the bound follows the recipe). Hopper's 22 bits are in the honest sweep above."""
    rng = np.random.default_rng(2)
    plain = fp8_kernels.draw
    try:
        fp8_kernels.draw = lambda r: {**plain(r), "how": "fa3", "accumulator": 12}
        cases = [fp8_kernels.fp8_case(rng, "float8") for _ in range(4)]
    finally:
        fp8_kernels.draw = plain
    for arrays in cases:
        stated = na.crosscheck(**arrays)
        unstated = na.crosscheck(**{n: x for n, x in arrays.items() if n != "accumulator_bits"})
        assert not unstated, unstated
        assert stated.rows[0].baseline_err > 2 * unstated.rows[0].baseline_err, (stated, unstated)


@pytest.mark.parametrize("change, words", [
    ({"k_descale": np.ones((1, 2, 7), np.float32)}, r"k_descale of shape \(1, 2, 7\) is none of the shapes"),
    ({"descale_block": 4, "k_descale": np.ones((1, 2, 2), np.float32)}, r"\[\.\.\., H, ceil\(N / 4\)\] = \(1, 2, 3\)"),
    ({"descale_block": 0}, "descale_block must be a positive number of tokens"),
    ({"intermediate_dtype": "float16"}, "intermediate_dtype must be one of"),
    ({"precision": "bfloat16", "intermediate_dtype": "bfloat16"}, "intermediate_dtype belongs to a float8 precision"),
    ({"accumulator_bits": 33}, "accumulator_bits must be from 10 to 32"),
    ({"accumulator_bits": 22.0}, "accumulator_bits must be a 0-d integer"),
])
def test_bad_fp8_keys_are_refused_by_name(change, words):
    arrays = _fp8_case(**change)
    if change.get("precision") == "bfloat16":
        arrays = {n: x for n, x in arrays.items() if not n.endswith("descale")}
        arrays.update({n: arrays[n].astype(ml_dtypes.bfloat16) for n in "qkv"})
    with pytest.raises(CaseError, match=words):
        na.crosscheck(**arrays)


# ----------------------------------------------------------------------------- MXFP8

def _e8m0_values(scales):
    """e8m0 scales as float64 by the OCP MX specification: the byte e is 2^(e - 127), 0xFF NaN."""
    e = scales.view(np.uint8).astype(np.float64)
    return np.where(e == 255, np.nan, np.exp2(e - 127))


def test_mxfp8_scales_dequantize_each_32_elements_of_a_row():
    """An MXFP8 case (fp8_kernels.fp8_case with mx): the oracle's inputs are each element times
    its block's e8m0 scale, read here by the specification's bytes, and its out is torch's
    float64 attention of them to 1e-12."""
    from numpy_attention._checks import to_numpy
    from numpy_attention.oracle import split_case
    from numpy_attention.oracle.runs import reference
    rng = np.random.default_rng(5)
    arrays = next(a for a in (fp8_kernels.fp8_case(rng, "mxfp8", mx=True) for _ in range(20)) if a["q"].shape[-1] > 32)
    arrays = {name: to_numpy(x, name) for name, x in arrays.items()}
    case = split_case(arrays)
    for name in "qkv":
        scales, d = arrays[f"{name}_descale"], arrays[name].shape[-1]
        assert scales.dtype == ml_dtypes.float8_e8m0fnu and scales.shape[-1] == -(-d // 32)
        want = arrays[name].astype(np.float64) * np.repeat(_e8m0_values(scales), 32, axis=-1)[..., :d]
        np.testing.assert_array_equal(case.inputs[name], want)
    got = reference(case.inputs, case.options, np.float64, gradients=False)["out"]
    assert np.abs(got - fp8_kernels.torch_float64_out(case.inputs, "causal" in arrays)).max() < 1e-12


def test_mxfp8_candidates_pass_honest_and_fail_with_each_bug():
    """fp8_kernels.mx_sweep, a few cases (benchmarks/variant_sweeps.py --variant mxfp8: 200)."""
    counts = fp8_kernels.mx_sweep(6, seed=2)
    for (_, what), (judged, failed, named, not_run) in counts.items():
        if what == "honest":
            assert (judged, failed) == (6, 0), counts
        else:
            assert judged and failed == judged and named >= judged // 2 and not not_run, (what, counts)


def test_an_mx_scale_of_another_width_or_nan_is_refused():
    arrays = _fp8_case()
    with pytest.raises(CaseError, match=r"per 32 elements of a row \(MXFP8\)"):
        na.crosscheck(**{**arrays, "q_descale": np.ones((1, 2, 5, 3), np.float32)})
    nan = np.full((1, 2, 5, 1), 255, np.uint8).view(ml_dtypes.float8_e8m0fnu)   # e8m0's NaN
    with pytest.raises(CaseError, match="q_descale must hold finite values > 0"):
        na.crosscheck(**{**arrays, "q_descale": nan})


def test_flashattention_issue_2716s_saturated_p_is_caught_and_named():
    """Scores that rise by 1.3 to 2.1 (natural log; 1.9 to 3 in log2) after the first tile of 128
    keys: FlashAttention-3's online softmax with offset 8 and a lazy rescale past 4 (log2) puts P~
    at up to 2^(8 + 3) > 448, saturated in e4m3; eager rescaling (threshold 0) keeps it below 2^8
    and passes."""
    gen = torch.Generator().manual_seed(11)
    n_k, d = 300, 64
    q = torch.randn(1, 1, 4, d, generator=gen)
    k = torch.randn(1, 1, n_k, d, generator=gen) * 0.3
    k[0, 0, 200:204] = 0.25 * q[0, 0]                                   # each query's own later key
    v = torch.randn(1, 1, n_k, d, generator=gen)
    s = dict(groups=1, d=d, how="fa3", causal=False, accumulator=32, intermediate="float8_e4m3fn")
    stored = {name: fp8_kernels.quantize(x, "tensor", 16, "float8_e4m3fn") for name, x in zip("qkv", (q, k, v))}
    used = {name: descale for name, (_, descale) in stored.items()}
    scores = (stored["q"][0].float() * used["q"]) @ (stored["k"][0].float() * used["k"]).transpose(-1, -2) / 8
    rise = (scores[..., 128:].amax(-1) - scores[..., :128].amax(-1)) * math.log2(math.e)   # log2 units
    assert 8.8 - 8 < float(rise.min()) and float(rise.max()) < 4        # P~ past 448, m not moved
    arrays = {name: stored[name][0] for name in "qkv"}
    arrays.update({f"{name}_descale": stored[name][1].numpy() for name in "qkv"}, precision=np.array("float8_e4m3fn"))
    (out, saturated), lse = fp8_kernels.attend(stored, used, s, lazy=True)
    assert saturated
    report = na.crosscheck(**arrays, out=out, lse=lse)
    assert not report and "saturated at e4m3's 448 in 4 of 4 query rows" in report.diagnosis[0], report
    assert "2^8 with the row max m moved only past 4 (log2) in tiles of 128 keys" in report.diagnosis[0]
    v8 = stored["v"][0].float() * used["v"]
    eager, saturated = fp8_kernels.lazy_softmax_pv(scores, v8, threshold=0.0)
    assert not saturated and na.crosscheck(**arrays, out=eager, lse=lse)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_16_bit_case_names_its_accumulator_too(precision):
    """accumulator_bits for any 16- or 8-bit precision: a bfloat16 (float16) kernel whose forward
    products accumulate in 14 bits (narrow_matmul, torch) fails a case that says nothing of its
    accumulator and passes one that says so; float32 has no recipe to narrow and refuses it."""
    dtype = getattr(torch, precision)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 256, generator=gen).to(dtype) for n in (8, 96, 96))
    narrow = lambda a, b: fp8_kernels.narrow_matmul(a.float(), b.float(), 14).to(dtype)
    s = narrow(q, k.transpose(-1, -2)) * (1 / 16)                           # in the dtype, as eager code
    p = torch.softmax(s.float(), dim=-1).to(dtype)
    out = narrow(p, v)
    case = dict(q=q, k=k, v=v, out=out)
    assert not na.crosscheck(**case)
    assert na.crosscheck(**case, accumulator_bits=np.array(14))
    with pytest.raises(CaseError, match="accumulator_bits belongs to a 16- or 8-bit precision"):
        na.crosscheck(**{name: x.float() for name, x in case.items()}, accumulator_bits=np.array(14))


def test_mxfp8s_next_block_mixup_moves_whole_blocks_of_a_short_last_one():
    """d = 48: blocks of 32 and 16; the mix-up puts each row's scale of block b on block b + 1
    (the last block's on the first), a block at a time."""
    from numpy_attention.oracle.mixups import _block_mixups
    from numpy_attention.oracle.transforms import descale_of
    compact = np.exp2(np.arange(2 * 3 * 2).reshape(1, 2, 3, 2) - 3.0)         # [B, H, N, ceil(48 / 32)]
    stored = np.ones((1, 2, 3, 48))
    descale = descale_of(compact, stored.shape, stored.shape, None, "q_descale")
    shifted, = [m for m in _block_mixups("q", stored, descale, 32, "") if "one over" in m.did]
    want = np.concatenate([np.repeat(compact[..., 1:], 32, -1), np.repeat(compact[..., :1], 16, -1)], -1)
    np.testing.assert_array_equal(shifted.inputs["q"], want)
