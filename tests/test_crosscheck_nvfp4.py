"""crosscheck of NVFP4 attention: q and k stored as e2m1 (ml_dtypes' float4_e2m1fn) with a scale
a block of 16 elements of a row (NVFP4's e4m3 scales times the tensor's float32 scale), v in
bfloat16 or e4m3 (FlashAttention's NVFP4+BF16 and NVFP4+FP8 modes); the dequantization held to
the formats' specifications, torch candidates honest and with planted bugs
(tests/nvfp4_kernels.py; the longer sweep: benchmarks/variant_sweeps.py --variant nvfp4), the
diagnosis naming the scales' mix-ups, and what a case cannot hold refused by name."""
import ml_dtypes
import numpy as np
import pytest
from optional import TORCH_REASON

import numpy_attention as na
from numpy_attention._checks import to_numpy
from numpy_attention.oracle import CaseError, split_case
from numpy_attention.oracle.runs import reference

pytest.importorskip("torch", reason=TORCH_REASON)
import fp8_kernels  # noqa: E402  (needs torch)
import nvfp4_kernels  # noqa: E402


def _e2m1_values(x):
    """float4_e2m1fn elements as float64 by the OCP MX specification's bits: sign, two exponent bits
    of bias 1, one mantissa bit; exponent 0 is subnormal (0 or 0.5)."""
    bits = x.view(np.uint8).astype(np.int64) & 0xF
    sign, e, m = np.where(bits >> 3, -1.0, 1.0), (bits >> 1) & 3, bits & 1
    return sign * np.where(e == 0, 0.5 * m, np.exp2(e - 1) * (1 + 0.5 * m))


def _e4m3_values(x):
    """float8_e4m3fn as float64 by its bits: four exponent bits of bias 7, three of mantissa,
    exponent 0 subnormal; S.1111.111 is NaN."""
    bits = x.view(np.uint8).astype(np.int64)
    sign, e, m = np.where(bits >> 7, -1.0, 1.0), (bits >> 3) & 15, bits & 7
    value = np.where(e == 0, np.exp2(-6) * m / 8, np.exp2(e - 7) * (1 + m / 8))
    return np.where((bits & 0x7F) == 0x7F, np.nan, sign * value)


def _case(seed, mode, bug=None):
    rng = np.random.default_rng(seed)
    return next(a for a in (nvfp4_kernels.nvfp4_case(rng, mode, bug) for _ in range(30))
                if a is not None and a["q"].shape[-1] > 16 and a["q"].shape[-2] > 1)


def test_the_specifications_decode_every_e2m1_and_e4m3_value_as_ml_dtypes_does():
    every = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(_e2m1_values((every & 0xF).view(ml_dtypes.float4_e2m1fn)),
                                  (every & 0xF).view(ml_dtypes.float4_e2m1fn).astype(np.float64))
    np.testing.assert_array_equal(_e4m3_values(every.view(ml_dtypes.float8_e4m3fn)),
                                  every.view(ml_dtypes.float8_e4m3fn).astype(np.float64))


@pytest.mark.parametrize("mode", list(nvfp4_kernels.MODES))
def test_nvfp4_inputs_dequantize_each_16_elements_of_a_row(mode):
    """The oracle's q and k are each e2m1 element, read by the specification's bits, times its
    block's scale (its e4m3 scale, by its bits, times the tensor's float32 scale); its out is
    torch's float64 attention of them to 1e-12."""
    arrays = {name: to_numpy(x, name) for name, x in _case(3, mode).items()}
    case = split_case(arrays)
    for name in "qk":
        stored, descale, d = arrays[name], arrays[f"{name}_descale"], arrays[name].shape[-1]
        assert stored.dtype == ml_dtypes.float4_e2m1fn and descale.shape == stored.shape[:-1] + (d // 16,)
        g = descale.max() / 448                                           # the largest block's s: e4m3's 448
        s = descale / g
        assert g == np.float32(g) and np.array_equal(_e4m3_values(s.astype(ml_dtypes.float8_e4m3fn)), s)
        want = _e2m1_values(stored) * np.repeat(descale, 16, axis=-1)
        np.testing.assert_array_equal(case.inputs[name], want)
    got = reference(case.inputs, case.options, np.float64, gradients=False)["out"]
    assert np.abs(got - fp8_kernels.torch_float64_out(case.inputs, "causal" in arrays)).max() < 1e-12


def test_nvfp4_candidates_pass_honest_and_fail_with_each_bug():
    """nvfp4_kernels.sweep, a few cases a mode (benchmarks/variant_sweeps.py --variant nvfp4: 200)."""
    counts = nvfp4_kernels.sweep(6, seed=2)
    assert {what for _, what in counts} == {"honest", *nvfp4_kernels.BUGS}
    for (_, what), (judged, failed, named, not_run) in counts.items():
        if what == "honest":
            assert (judged, failed) == (6, 0), counts
        else:
            assert judged and failed == judged and named >= judged // 2 and not not_run, (what, counts)


@pytest.mark.parametrize("bug, said", [
    ("blocks_of_32", "q_descale's blocks of 16 read as blocks of 32 (MXFP8's)"),
    ("transposed", "q_descale's [N, d / 16] scales read transposed"),
    ("next_block", "q_descale's blocks one over along d"),
])
def test_the_diagnosis_names_the_block_scales_mixup(bug, said):
    rng = np.random.default_rng(7)
    for _ in range(40):
        state = rng.integers(2 ** 31)
        arrays = nvfp4_kernels.nvfp4_case(np.random.default_rng(state), "nvfp4_bf16", bug)
        if arrays is not None and nvfp4_kernels.draw(np.random.default_rng(state))["culprit"] == "q":
            break
    report = na.crosscheck(**arrays)
    assert not report and any(said in line for line in report.diagnosis), report.diagnosis


def test_an_e2m1_array_is_an_input_and_a_descale_makes_a_case_forward_only():
    arrays = _case(4, "nvfp4_bf16")
    out = arrays["out"]
    with pytest.raises(CaseError, match="out is a float4_e2m1fn array; only q, k and v may be stored in it"):
        na.crosscheck(**{**arrays, "out": to_numpy(out, "out").astype(np.float32).astype(ml_dtypes.float4_e2m1fn)})
    with pytest.raises(CaseError, match=r"judged forward only \(out, lse\); it has dout"):
        na.crosscheck(**{**arrays, "dout": np.ones(out.shape, np.float32)})
    with pytest.raises(CaseError, match=r"per 16 \(NVFP4\)"):
        na.crosscheck(**{**arrays, "q_descale": arrays["q_descale"][..., :1].repeat(3, axis=-1)})
    with pytest.raises(CaseError, match="q_descale belongs to a 16- or 8-bit precision"):
        na.crosscheck(**{**arrays, "precision": "float32", "v": to_numpy(arrays["v"], "v").astype(np.float32)})


@pytest.mark.parametrize("mode", ["nvfp4_fp8", "mxfp8"])
def test_a_saved_case_of_e2m1_inputs_or_e8m0_scales_reads_back_as_the_same_values(tmp_path, mode):
    """A file's raw bytes cannot tell e2m1 or e8m0 from e4m3: save_case writes them as their float32
    values, which read back as the same case (the verdict and every input the same)."""
    rng = np.random.default_rng(6)
    arrays = fp8_kernels.fp8_case(rng, "mxfp8", mx=True) if mode == "mxfp8" else _case(6, mode)
    arrays = {name: to_numpy(x, name) for name, x in arrays.items()}
    path = tmp_path / "case.npz"
    na.oracle.save_case(path, **arrays)
    loaded = na.oracle.load_case(path)
    with np.load(path) as raw:
        widened = ("q", "k") if mode != "mxfp8" else ("q_descale", "k_descale", "v_descale")
        assert {raw[name].dtype for name in widened} == {np.dtype(np.float32)}
    before, after = split_case(arrays), split_case(loaded)
    for name in "qkv":
        np.testing.assert_array_equal(before.inputs[name], after.inputs[name])
    assert bool(na.crosscheck(**arrays)) and bool(na.crosscheck(**loaded))


def test_flashinfers_nvfp4_kv_cache_q_in_bfloat16_and_k_v_in_e2m1_is_a_case():
    """q bfloat16 and k, v in NVFP4 (FlashInfer's NVFP4 KV cache): out of the dequantized values,
    rounded to bfloat16, passes; with v's scales dropped it fails, and the diagnosis says so."""
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 2, 5, 32)).astype(np.float32).astype(ml_dtypes.bfloat16)
    (k4, k_descale), (v4, v_descale) = (nvfp4_kernels.quantize(rng.standard_normal((1, 2, 40, 32)).astype(np.float32))
                                        for _ in range(2))
    used = lambda x4, descale: x4 * np.repeat(descale, 16, axis=-1)
    out, cache = na.attention_forward(q.astype(np.float64), used(k4, k_descale), used(v4, v_descale))
    case = dict(q=q, k=k4.astype(ml_dtypes.float4_e2m1fn), v=v4.astype(ml_dtypes.float4_e2m1fn), k_descale=k_descale,
                v_descale=v_descale, out=out.astype(ml_dtypes.bfloat16), lse=cache.lse.astype(np.float32))
    assert na.crosscheck(**case)
    dropped = na.attention_forward(q.astype(np.float64), used(k4, k_descale), v4)[0]
    report = na.crosscheck(**{**case, "out": dropped.astype(ml_dtypes.bfloat16)})
    assert not report and any("v_descale dropped" in line for line in report.diagnosis), report.diagnosis


def test_a_saved_1_byte_result_reads_back_in_its_format_and_keeps_its_verdict(tmp_path):
    """An out stored in e4m3 is written as raw bytes beside the precision: the reloaded case is
    judged as the original, bound for bound."""
    e4m3 = ml_dtypes.float8_e4m3fn
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 2, n, 32)).astype(e4m3) for n in (6, 50, 50))
    out = na.attention_forward(*(x.astype(np.float64) for x in (q, k, v)))[0]
    for wrong in (1.0, 1.05):
        arrays = dict(q=q, k=k, v=v, out=(out * wrong).astype(e4m3))
        na.oracle.save_case(tmp_path / "case.npz", **arrays)
        before, after = na.crosscheck(**arrays), na.crosscheck(**na.oracle.load_case(tmp_path / "case.npz"))
        assert bool(before) == bool(after) == (wrong == 1.0)
        assert [(r.dtype, r.bound) for r in before.rows] == [(r.dtype, r.bound) for r in after.rows]


def test_descales_per_block_of_tokens_go_with_a_16_bit_precision_too():
    """A bfloat16 kernel reading k and v dequantized by blocks of 16 tokens (descale_block): the
    case's values are the stored ones times their block's descale."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 2, 4, 16)).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((1, 2, 40, 16)).astype(ml_dtypes.bfloat16) for _ in range(2))
    k_descale = np.exp2(rng.integers(-2, 3, (1, 2, 3))).astype(np.float32)          # [B, H, ceil(40 / 16)]
    used = k.astype(np.float64) * np.repeat(k_descale, 16, axis=-1)[..., :40, None]
    out, cache = na.attention_forward(q.astype(np.float64), used, v.astype(np.float64))
    case = dict(q=q, k=k, v=v, k_descale=k_descale, descale_block=16, out=out.astype(ml_dtypes.bfloat16),
                lse=cache.lse.astype(np.float32))
    assert na.crosscheck(**case)
    plain = na.attention_forward(*(x.astype(np.float64) for x in (q, k, v)))[0]        # the descale dropped
    assert not na.crosscheck(**{**case, "out": plain.astype(ml_dtypes.bfloat16)})
    with pytest.raises(CaseError, match=r"k_descale of shape \(1, 2, 3\) is none of the shapes"):
        na.crosscheck(**{**case, "descale_block": 8})                               # 5 blocks of 8, not 3
