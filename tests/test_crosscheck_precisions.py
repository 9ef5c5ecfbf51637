"""crosscheck's precisions (float16, bfloat16, float8 recipes), how a case stores low-precision
arrays, and the settings a kernel author needs (layout, lse base, None, causal 0/1).
Candidates here are built from the recipe itself or from our float64 attention; torch's
kernels as candidates are in test_torch_precisions.py."""
import ml_dtypes
import re

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.commands.cli import main
from numpy_attention.oracle import CaseError, crosscheck, judge, load_case, save_case, split_case
from numpy_attention.oracle.precision import PRECISIONS
from numpy_attention.oracle.recipe import recipe_attention

BF16, E4M3 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)


def bf16_case(seed=0, causal=True, gradients=True, n=(6, 9), d=8, scale=None, kernel_scale=None):
    """A bfloat16 case whose candidate is the bfloat16 recipe (an honest kernel), N_q, N_k = n.
    scale: the case's scale (None: 1/sqrt(d)); kernel_scale: the one the candidate used."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal(shape).astype(BF16) for shape in
                     ((1, 2, n[0], d), (1, 2, n[1], d), (1, 2, n[1], d), (1, 2, n[0], d)))
    f32 = lambda x: x.astype(np.float32)
    used = scale if kernel_scale is None else kernel_scale
    q3, k3, v3, record = na.attention_options(f32(q), f32(k), f32(v), causal=causal, scale=used)
    result = recipe_attention(q3, k3, v3, record, PRECISIONS["bfloat16"],
                              dout=f32(dout) if gradients else None)
    arrays = {"q": q, "k": k, "v": v, "causal": np.array(causal), "out": result["out"].astype(BF16),
              "lse": result["lse"]}
    if scale is not None:
        arrays["scale"] = np.array(scale)
    if gradients:
        arrays.update(dout=dout, **{n: result[n].astype(BF16) for n in ("dq", "dk", "dv")})
    return arrays


def test_a_bfloat16_recipe_candidate_passes_and_the_report_says_bfloat16():
    report = crosscheck(**bf16_case())
    assert report, str(report)
    assert report.baseline_dtype.startswith("bfloat16")
    assert {r.dtype for r in report.rows} == {"bfloat16", "float32"}
    assert all(r.l2_k == 2 for r in report.rows)                # the normwise check applies


def test_a_wrong_bfloat16_candidate_fails():
    arrays = bf16_case()
    arrays["out"] = (arrays["out"].astype(np.float32) * 1.05).astype(BF16)
    assert not crosscheck(**arrays)


def test_a_scale_off_by_1_percent_fails_and_reads_as_plus_1_percent():
    report = crosscheck(**bf16_case(n=(32, 32), d=32, kernel_scale=1.01 / np.sqrt(32)))
    assert not report
    assert all(abs(r.scale_err - 0.01) < 0.002 and r.scale_err > r.scale_bound and not r.passed
               for r in report.rows)
    assert "scale err" in str(report)


def test_the_scale_check_sees_an_error_along_u_that_norm_and_entries_do_not():
    """Baseline and candidate round by +-1 at random (norm 20 over 400 entries); the candidate
    also moves by 0.5 u, u = 1 (norm 10): max-abs (1.5 <= 2 * 1) and normwise (about 22 <=
    2 * 20) pass, a = 0.5 fails the bound k * max(|a(baseline)|, s(baseline)), s = 20 / 400."""
    rng = np.random.default_rng(0)
    oracle = rng.standard_normal(400) * 100
    u = np.ones(400)
    baseline = oracle + rng.choice([-1.0, 1.0], 400)
    candidate = oracle + rng.choice([-1.0, 1.0], 400) + 0.5 * u
    plain = judge("out", candidate, oracle, baseline, atol=0, l2_k=2.0)
    assert plain.passed
    verdict = judge("out", candidate, oracle, baseline, atol=0, l2_k=2.0, scale_direction=u)
    assert not verdict.passed and verdict.scale_err == pytest.approx(np.mean(candidate - oracle))
    assert verdict.scale_bound == pytest.approx(2 * max(abs(np.mean(baseline - oracle)), 0.05))
    assert judge("out", candidate, oracle, baseline, atol=0, l2_k=2.0, scale_direction=u,
                 scale_tol=0.6).passed                      # what scale_tol allows


def test_a_scale_held_in_bfloat16_passes():
    """JAX multiplies bfloat16 scores by the scale in bfloat16: 0.125 + 0.45 ulp rounds to 0.125,
    0.35% off, within the scale check's eps(bfloat16) / 2 allowance."""
    scale = 0.125 + 0.45 * 2.0 ** -10                       # bfloat16's ulp at 0.125 is 2^-10
    assert float(np.float32(scale).astype(BF16)) == 0.125
    report = crosscheck(**bf16_case(n=(32, 32), d=32, scale=scale, kernel_scale=0.125))
    assert report, str(report)
    assert all(-0.0045 < r.scale_err < -0.0025 for r in report.rows)


def test_the_row_check_sees_one_entry_the_tensors_worst_rounding_hides():
    """Row 0 of 100 rounds badly (baseline error 0.1), the others well (0.001): an error of
    0.05 in row 1 is under the tensor-wide bound 3 * 0.1, not under its row's, floored at the
    baseline's rms error sqrt((3 * 0.1^2 + 297 * 0.001^2) / 300) = 0.01005."""
    oracle = np.tile([1.0, -1.0, 1.0], (100, 1))
    baseline = oracle + np.where(np.arange(100)[:, None] == 0, 0.1, 0.001) * np.array([1, -1, 1])
    candidate = baseline.copy()
    candidate[1, 0] += 0.05
    assert judge("dq", candidate, oracle, baseline, atol=0).passed
    verdict = judge("dq", candidate, oracle, baseline, atol=0, rows=True)
    assert not verdict.passed and verdict.row_ratio == pytest.approx(0.051 / 0.01005, rel=1e-3)
    candidate[1, 0] -= 0.025                                # 0.026 <= 3 * 0.01005: passes
    assert judge("dq", candidate, oracle, baseline, atol=0, rows=True).passed


@pytest.mark.parametrize("storage", ["ml_dtypes", "raw uint16", "void bytes (np.savez)", "float32 values"])
def test_bfloat16_arrays_in_every_storage_give_the_same_report(storage, tmp_path):
    arrays = bf16_case()
    reference = crosscheck(**arrays)
    converted = {}
    for name, x in arrays.items():
        if isinstance(x, np.ndarray) and x.dtype == BF16:
            x = {"ml_dtypes": x, "raw uint16": x.view(np.uint16), "void bytes (np.savez)": x.view("V2"),
                 "float32 values": x.astype(np.float32)}[storage]
        converted[name] = x
    precision = None if storage in ("ml_dtypes", "void bytes (np.savez)") else "bfloat16"
    report = crosscheck(precision=precision, **converted)
    if storage == "float32 values":                              # results in float32: reported so
        assert [r.max_abs_err for r in report.rows] == [r.max_abs_err for r in reference.rows]
        assert report and [r.atol for r in report.rows] == [r.atol for r in reference.rows]
    else:
        assert report == reference
    save_case(tmp_path / "case.npz", **arrays)                  # np.savez writes bfloat16 as V2
    assert crosscheck(**load_case(tmp_path / "case.npz")) == reference


def test_float32_values_that_bfloat16_cannot_hold_are_refused():
    arrays = bf16_case()
    arrays["q"] = arrays["q"].astype(np.float32) + np.float32(1e-3)
    with pytest.raises(CaseError, match=r"q has \d+ values not representable in bfloat16"):
        crosscheck(precision="bfloat16", **arrays)


def test_a_float16_out_with_a_float32_lse_is_a_float16_case():
    """FlashAttention's float32 lse from float16 scores is judged against the float16 recipe:
    its baseline error is that of float16 scores, far above a float32 computation's."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((1, 2, 5, 16), (1, 2, 7, 16), (1, 2, 7, 16)))
    out, cache = na.attention_forward(*(x.astype(np.float64) for x in (q, k, v)))
    report = crosscheck(q=q, k=k, v=v, out=out.astype(np.float16), lse=cache.lse.astype(np.float32))
    rows = {r.name: r for r in report.rows}
    assert report and report.baseline_dtype.startswith("float16")
    assert rows["lse"].dtype == "float32" and rows["lse"].baseline_err > 1e-5


def test_float8_forward_with_descales():
    rng = np.random.default_rng(2)
    q, k, v = (rng.uniform(-2, 2, s).astype(E4M3) for s in ((2, 4, 5, 16), (2, 2, 7, 16), (2, 2, 7, 16)))
    descales = {name: rng.uniform(0.5, 2.0, (2, 2)).astype(np.float32) for name in ("q_descale", "k_descale", "v_descale")}
    g = np.repeat(descales["q_descale"], 2, axis=-1)[..., None, None]          # query head h: kv head h // 2
    real = {"q": q.astype(np.float64) * g, "k": k.astype(np.float64) * descales["k_descale"][..., None, None],
            "v": v.astype(np.float64) * descales["v_descale"][..., None, None]}
    bf = lambda x: x.astype(BF16).astype(np.float32)
    q3, k3, v3, record = na.attention_options(bf(real["q"]), bf(real["k"]), bf(real["v"]), causal=True)
    result = recipe_attention(q3, k3, v3, record, PRECISIONS["float8_e4m3fn"])
    arrays = dict(q=q, k=k, v=v, causal=True, out=result["out"].astype(BF16), lse=result["lse"], **descales)
    report = crosscheck(precision="float8_e4m3fn", **arrays)
    assert report, str(report)
    assert report.rows[0].dtype == "bfloat16"
    undescaled = {**arrays, "out": na.attention_forward(*(x.astype(np.float64) for x in (q, k, v)),
                                                        causal=True)[0].astype(BF16)}
    assert not crosscheck(precision="float8_e4m3fn", **undescaled)   # descales forgotten: caught


@pytest.mark.parametrize("change, precision, message", [
    ({"dq": np.zeros((1, 2, 6, 8), BF16)}, "float8_e4m3fn", "is checked forward only"),
    ({"q_descale": np.ones((1, 2), np.float32)}, "float32", "q_descale belongs to a 16- or 8-bit precision"),
    ({"q_descale": np.ones((1, 2), np.float32), "dout": np.ones((1, 2, 6, 8), BF16)}, None,
     r"a case with q_descale is judged forward only \(out, lse\); it has dout"),
])
def test_float8_and_descale_misuse_is_refused(change, precision, message):
    arrays = {**bf16_case(gradients=False), **change}
    if precision == "float8_e4m3fn":
        arrays = {n: (x.astype(np.float32).astype(E4M3) if n in "qkv" else x) for n, x in arrays.items()}
    with pytest.raises(CaseError, match=message):
        crosscheck(precision=precision, **arrays)


def test_layout_bnhd_reads_flashattention_tensors():
    arrays = bf16_case()
    swapped = {n: (np.swapaxes(x, -2, -3) if n in ("q", "k", "v", "dout", "out", "dq", "dk", "dv") else x)
               for n, x in arrays.items()}
    assert crosscheck(layout="bnhd", **swapped) == crosscheck(**arrays)
    assert crosscheck(**{**swapped, "layout": np.array("bnhd")}) == crosscheck(**arrays)   # as a key
    with pytest.raises(CaseError, match="layout='bhnd' contradicts the case's layout 'bnhd'"):
        split_case({**swapped, "layout": np.array("bnhd")}, layout="bhnd")     # --layout vs the key


def test_lse_in_base_2():
    arrays = bf16_case(gradients=False)
    base2 = {**arrays, "lse": (arrays["lse"].astype(np.float64) / np.log(2)).astype(np.float32)}
    assert crosscheck(lse_base="2", **base2)
    assert not crosscheck(**base2)                               # read as natural log: wrong


def test_none_means_absent_and_causal_may_be_0_or_1():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
    out, cache = na.attention_forward(q, k, v, causal=True)
    assert crosscheck(q=q, k=k, v=v, out=out, lse=cache.lse, mask=None, bias=None, dq=None, causal=np.array(1))
    assert not crosscheck(q=q, k=k, v=v, out=out, causal=np.array(0))


def test_a_bad_q_is_blamed_on_q_not_on_out():
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((2, 5, 4, 8)), rng.standard_normal((2, 3, 4, 8)), rng.standard_normal((2, 3, 4, 8))
    with pytest.raises(CaseError, match=r"k's heads H_kv=3 must divide q's heads H=5"):
        crosscheck(q=q, k=k, v=v, out=np.zeros((2, 5, 4, 8)))


def test_where_the_oracle_is_zero_the_relative_error_is_finite():
    q = k = v = np.zeros((1, 1, 3, 4))
    report = crosscheck(q=q, k=k, v=v, out=np.ones((1, 1, 3, 4), np.float32))
    assert not report and report.rows[0].rel_l2_err == 1.0


# ----------------------------------------------------------------------------- diagnosis

def _diagnosis(case_options, candidate_options=None, gqa=False, interleave=False, lse_scale=1.0,
               transform=None):
    """crosscheck's diagnosis of a float64 candidate computed with other options than the case's."""
    rng = np.random.default_rng(5)
    h_kv = 2 if gqa else 4
    q, dout = rng.standard_normal((1, 4, 5, 8)), rng.standard_normal((1, 4, 5, 8))
    k, v = rng.standard_normal((1, h_kv, 7, 8)), rng.standard_normal((1, h_kv, 7, 8))
    kc, vc = (np.concatenate([x, x], axis=-3) for x in (k, v)) if interleave else (k, v)
    out, cache = na.attention_forward(q, kc, vc, **(case_options if candidate_options is None else candidate_options))
    grads = na.attention_backward(dout, cache)
    dk, dv = (x.reshape(1, 2, 2, 7, 8).sum(1) for x in (grads.dk, grads.dv)) if interleave else (grads.dk, grads.dv)
    arrays = dict(q=q, k=k, v=v, dout=dout, out=out, lse=cache.lse * lse_scale, dq=grads.dq, dk=dk, dv=dv,
                  **case_options)
    report = crosscheck(**(transform(arrays) if transform else arrays))
    assert not report
    return " ".join(report.diagnosis)


@pytest.mark.parametrize("case_options, candidate_options, expected", [
    ({"causal": "top_left"}, {"causal": "bottom_right"}, "causal='bottom_right'"),
    ({"causal": True}, {}, "no causal mask"),
    ({}, {"causal": True}, "causal='top_left'"),
    ({}, {"scale": 1.0}, "scale 1"),
    ({}, {"scale": np.sqrt(8)}, "scale sqrt(d_k)"),
    ({"mask": np.arange(7) % 3 != 0}, {"mask": np.arange(7) % 3 == 0}, "the mask inverted"),
    ({"window": np.array([2, 1])}, {"window": (2, 1), "align": "bottom_right"}, "the window aligned bottom_right"),
    ({"dropout_mask": np.arange(35).reshape(5, 7) % 4 != 0, "dropout_p": np.array(0.25)},
     {"dropout_mask": np.arange(35).reshape(5, 7) % 4 != 0, "dropout_p": 0.0}, "without the 1 / (1 - p)"),
])
def test_the_diagnosis_names_the_mixup(case_options, candidate_options, expected):
    diagnosis = _diagnosis(case_options, candidate_options)
    assert expected in diagnosis and "rel L2" in diagnosis


def test_the_diagnosis_names_interleaved_gqa_heads():
    assert "interleaved grouped-query heads" in _diagnosis({}, gqa=True, interleave=True)


@pytest.mark.parametrize("judged", [("out", "lse"), ("out", "dq", "dk", "dv")])
def test_the_diagnosis_names_softcap_after_the_bias(judged):
    """A kernel that caps S after adding the bias: its results written out here, in float64,
    the forward by hand and the gradients of <dout, out> by complex step where judged."""
    bias = np.random.default_rng(6).standard_normal((5, 7)) * 3
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((1, 4, 5, 8)), rng.standard_normal((1, 4, 7, 8)), rng.standard_normal((1, 4, 7, 8))
    dout = rng.standard_normal((1, 4, 5, 8))
    def forward(q, k, v):                                   # S = 1.5 tanh((q k^T / sqrt(8) + bias) / 1.5)
        s = 1.5 * np.tanh((q @ np.swapaxes(k, -1, -2) / np.sqrt(8) + bias) / 1.5)
        e = np.exp(s - s.real.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True) @ v, np.log(np.exp(s).sum(axis=-1))
    out, lse = forward(q, k, v)
    wrong = {"out": out, "lse": lse}
    if "dq" in judged:                                      # <dout, out>'s gradients by complex step
        for name, x in zip("qkv", (q, k, v)):
            grad = np.zeros(x.shape)
            for j in np.ndindex(x.shape):
                z = x.astype(complex)
                z[j] += 1e-30j
                args = [z if n == name else y for n, y in zip("qkv", (q, k, v))]
                grad[j] = np.sum(dout * forward(*args)[0]).imag / 1e-30
            wrong["d" + name] = grad
    report = crosscheck(q=q, k=k, v=v, bias=bias, softcap=np.array(1.5), dout=dout,
                        **{name: wrong[name] for name in judged})
    assert not report and "softcap applied after the bias" in " ".join(report.diagnosis), report


def test_the_diagnosis_names_an_lse_in_base_2():
    assert "lse in base 2" in _diagnosis({}, lse_scale=1 / np.log(2))


def test_the_diagnosis_names_the_bnhd_layout():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 4, 4, 8)) for _ in range(3))       # [B, N, H, d], N = H = 4
    out = np.swapaxes(na.attention_forward(*(np.swapaxes(x, -2, -3) for x in (q, k, v)))[0], -2, -3)
    report = crosscheck(q=q, k=k, v=v, out=out)
    assert not report and "match the [..., N, H, d] layout" in " ".join(report.diagnosis)
    assert crosscheck(q=q, k=k, v=v, out=out, layout="bnhd")


def _scaled(names, factor, heads=slice(None)):
    """A transform of the case's arrays: the tensors `names` times `factor` in `heads`."""
    def transform(arrays):
        arrays = dict(arrays)
        for name in names:
            x = arrays[name].copy()
            x[:, heads] *= factor
            arrays[name] = x
        return arrays
    return transform


def test_the_diagnosis_names_a_backward_without_the_scale():
    diagnosis = _diagnosis({}, transform=_scaled(("dq", "dk"), np.sqrt(8)))
    assert diagnosis.startswith("dq, dk match the oracle times 2.82843 = 1 / scale: a backward without")


def test_the_diagnosis_names_one_heads_dk_negated():
    diagnosis = _diagnosis({}, transform=_scaled(("dk",), -1, heads=2))
    assert diagnosis.startswith("dk matches the oracle with head 2 negated (rel L2")


@pytest.mark.parametrize("shift, expected", [(-1, "the diagonal excluded"), (1, "one key of the future kept")])
def test_the_diagnosis_names_causal_masking_off_by_one(shift, expected):
    keep = np.arange(7)[None, :] <= np.arange(5)[:, None] + shift
    diagnosis = _diagnosis({"causal": True}, {"mask": keep})
    assert f"out, lse, dq, dk, dv match causal masking off by one ({expected})" in diagnosis


def test_the_diagnosis_names_a_missing_softcap_and_the_scale_applied_twice():
    assert "match no softcap" in _diagnosis({"softcap": np.array(2.0)}, {})
    assert "match scale 1/d_k = 0.125 (the scale applied twice)" in _diagnosis({}, {"scale": 1 / 8})


def test_the_diagnosis_names_two_mixups_at_once():
    diagnosis = _diagnosis({"causal": "top_left"}, {"causal": "bottom_right", "scale": 1.0})
    assert diagnosis.startswith("out, lse, dq, dk, dv match causal='bottom_right' and scale 1 (rel L2")
    assert "the case says causal='top_left'; the case's is 1/sqrt(d_k)" in diagnosis


def test_the_diagnosis_names_lse_rows_moved_by_one():
    diagnosis = _diagnosis({}, transform=lambda a: {**a, "lse": np.roll(a["lse"], 1, axis=-1)})
    assert diagnosis.startswith("lse matches the oracle with each query row moved down by one")


def test_the_diagnosis_names_mlx_causal_where_rows_are_fully_masked():
    """More queries than keys: MLX's bottom-right causal leaves the first rows with no key and
    makes them the mean of v (fully_masked='uniform'); the case says top-left."""
    rng = np.random.default_rng(9)
    q, dout = rng.standard_normal((1, 2, 6, 8)), rng.standard_normal((1, 2, 6, 8))
    k, v = rng.standard_normal((1, 2, 4, 8)), rng.standard_normal((1, 2, 4, 8))
    out, cache = na.attention_forward(q, k, v, causal="bottom_right", fully_masked="uniform")
    g = na.attention_backward(dout, cache)
    report = crosscheck(q=q, k=k, v=v, dout=dout, out=out, dq=g.dq, dk=g.dk, dv=g.dv, causal=True)
    assert not report
    assert " ".join(report.diagnosis).startswith(
        "out, dq, dk, dv match causal='bottom_right' with fully masked rows the mean of v (MLX's causal)")


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_the_diagnosis_names_a_scale_one_percent_off_in_16_bits(precision):
    """A 16-bit kernel whose scale is 1% off: its results rounded to the precision, the
    rerun at the fitted scale as near as the rounding allows."""
    rng = np.random.default_rng(12)
    storage = {"bfloat16": BF16, "float16": np.float16}[precision]
    rounded = lambda x: x.astype(storage).astype(np.float64)
    q, k, v, dout = (rounded(2 * rng.standard_normal((1, 2, 64, 32))) for _ in range(4))
    out, cache = na.attention_forward(q, k, v, scale=1.01 / np.sqrt(32))
    g = na.attention_backward(dout, cache)
    report = crosscheck(q=q, k=k, v=v, dout=dout, precision=precision,
                        **{n: rounded(x) for n, x in (("out", out), ("dq", g.dq), ("dk", g.dk), ("dv", g.dv))})
    assert not report
    assert re.search(r"match scale 0\.1785\d* \(1\.01 times the case's\)", " ".join(report.diagnosis))


def test_no_diagnosis_for_a_plain_wrong_result():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
    report = crosscheck(q=q, k=k, v=v, out=rng.standard_normal((1, 2, 4, 8)))
    assert not report and report.diagnosis == ()


# ----------------------------------------------------------------------------- the command's options

def test_the_command_takes_precision_layout_lse_base_k_and_atol(tmp_path, capsys):
    arrays = bf16_case()
    swapped = {n: (np.swapaxes(x, -2, -3) if n in ("q", "k", "v", "dout", "out", "dq", "dk", "dv") else x)
               for n, x in arrays.items()}
    swapped["lse"] = (arrays["lse"].astype(np.float64) / np.log(2)).astype(np.float32)
    np.savez(tmp_path / "flash.npz", **swapped)
    path = str(tmp_path / "flash.npz")
    assert main(["crosscheck", path, "--layout", "bnhd", "--lse-base", "2", "--precision", "bfloat16"]) == 0
    assert main(["crosscheck", path, "--layout", "bnhd", "--lse-base", "2", "--k", "out=1e-9",
                 "--atol", "0"]) == 1                            # a k too small to pass
    capsys.readouterr()
    np.savez(tmp_path / "keyed.npz", **swapped, layout=np.array("bnhd"))
    assert main(["crosscheck", str(tmp_path / "keyed.npz"), "--layout", "bhnd"]) == 2
    assert "--layout bhnd contradicts the case's layout 'bnhd'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--k", "x=2"], "argument --k: must be TENSOR=K pairs"),
    (["--k", "out=-1"], "argument --k: must be TENSOR=K pairs"),
    (["--atol", "nan"], "argument --atol: must be a finite number >= 0"),
    (["--precision", "int8"], "argument --precision: invalid choice"),
])
def test_bad_command_options_exit_2_with_one_line(argv, message, tmp_path, capsys):
    np.savez(tmp_path / "case.npz", **bf16_case())
    assert main(["crosscheck", str(tmp_path / "case.npz")] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- the backward on its own

def _flash_kernel_with_a_forward_bug():
    """float32 results of a kernel whose forward writes one wrong row of out, and whose
    (correct) flash backward then uses that out: D = rowsum(dout * out) is off in that row."""
    rng = np.random.default_rng(9)
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32) for s in
                     ((1, 2, 6, 8), (1, 2, 9, 8), (1, 2, 9, 8), (1, 2, 6, 8)))
    out, cache = na.attention_forward(q, k, v, implementation="textbook")
    out = out.copy()
    out[0, 1, 3] += 0.05
    grads = na.attention_backward(dout, cache._replace(out=out), method="flash")
    return dict(q=q, k=k, v=v, dout=dout, out=out, lse=cache.lse, dq=grads.dq, dk=grads.dk, dv=grads.dv)


def test_own_forward_tells_a_forward_bug_from_a_backward_bug():
    arrays = _flash_kernel_with_a_forward_bug()
    report = {r.name: r.passed for r in crosscheck(**arrays).rows}
    assert not report["out"] and not report["dq"]               # the forward's error reaches dq
    own = {r.name: r.passed for r in crosscheck(own_forward=True, **arrays).rows}
    assert own == {"out": False, "lse": True, "dq": True, "dk": True, "dv": True}
    wrong_dq = arrays["dq"].copy()
    wrong_dq[0, 0, 2, 5] += 0.05 * np.abs(wrong_dq).max()
    assert not {r.name: r.passed for r in crosscheck(own_forward=True, **{**arrays, "dq": wrong_dq}).rows}["dq"]


def test_own_forward_needs_out_lse_and_a_gradient():
    arrays = _flash_kernel_with_a_forward_bug()
    del arrays["lse"]
    with pytest.raises(CaseError, match="needs out, lse and a gradient"):
        crosscheck(own_forward=True, **arrays)


def test_the_command_takes_own_forward(tmp_path):
    np.savez(tmp_path / "case.npz", **_flash_kernel_with_a_forward_bug())
    assert main(["crosscheck", str(tmp_path / "case.npz"), "--own-forward", "--json"]) == 1   # out still fails


def test_float8_with_sinks_and_alibi():
    """The float8 recipe's baseline (forward only) with a sink logit and ALiBi per head: the
    recipe itself passes; a kernel that drops the sink, or ALiBi, fails on out and lse."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.uniform(-2, 2, s).astype(E4M3) for s in ((1, 4, 6, 16), (1, 2, 9, 16), (1, 2, 9, 16)))
    heads = {"sinks": rng.standard_normal(4).astype(np.float32),
             "alibi_slopes": rng.uniform(0.05, 1.0, 4).astype(np.float32)}
    bf = lambda x: x.astype(np.float32).astype(BF16).astype(np.float32)

    def candidate(**options):
        q3, k3, v3, record = na.attention_options(bf(q), bf(k), bf(v), causal=True, **options)
        result = recipe_attention(q3, k3, v3, record, PRECISIONS["float8_e4m3fn"])
        return {"out": result["out"].astype(BF16), "lse": result["lse"]}
    arrays = dict(q=q, k=k, v=v, causal=True, **heads)
    report = crosscheck(precision="float8_e4m3fn", **arrays, **candidate(**heads))
    assert report, str(report)
    for dropped in heads:
        kept = {name: x for name, x in heads.items() if name != dropped}
        failed = crosscheck(precision="float8_e4m3fn", **arrays, **candidate(**kept))
        assert [r.name for r in failed.rows if not r.passed] == ["out", "lse"], dropped


def as_float32(arrays):
    """A case as a kernel author without bfloat16 in NumPy saves it: every tensor as float32,
    no precision key."""
    return {n: x.astype(np.float32) if isinstance(x, np.ndarray) and x.dtype.itemsize <= 2
            and x.dtype != bool else x for n, x in arrays.items()}


def recipe_case(precision, seed=0, kernel_scale=None):
    """A case whose candidate is the recipe of `precision` (float16 or bfloat16), stored in it."""
    p = PRECISIONS[precision]
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal(shape).astype(p.storage) for shape in
                     ((1, 2, 6, 8), (1, 2, 9, 8), (1, 2, 9, 8), (1, 2, 6, 8)))
    f32 = lambda x: x.astype(np.float32)
    q3, k3, v3, record = na.attention_options(f32(q), f32(k), f32(v), causal=True, scale=kernel_scale)
    result = recipe_attention(q3, k3, v3, record, p, dout=f32(dout))
    return {"q": q, "k": k, "v": v, "dout": dout, "causal": np.array(True), "lse": result["lse"],
            **{n: result[n].astype(p.storage) for n in ("out", "dq", "dk", "dv")}}


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_16_bit_kernel_saved_as_float32_fails_with_a_hint_naming_its_precision(precision):
    report = crosscheck(**as_float32(recipe_case(precision)))
    assert not report and report.baseline_dtype.startswith("float32")
    assert report.diagnosis == (f"the results hold only {precision} values, as a {precision} kernel's "
                                f"do; judged with precision={precision!r} (a keyword, or the .npz "
                                f"key), the case gives PASS",)
    assert crosscheck(**as_float32(recipe_case(precision)), precision=precision)


def test_the_hint_gives_the_verdict_in_that_precision():
    """A bfloat16 kernel with its scale off by 1% fails in bfloat16 too, and the hint says so."""
    wrong = as_float32(recipe_case("bfloat16", kernel_scale=1.01 / np.sqrt(8)))
    assert crosscheck(**wrong).diagnosis[0].endswith("the case gives FAIL")


def test_the_hint_says_what_stops_judging_in_that_precision():
    """Results of bfloat16 values from inputs bfloat16 cannot hold: the hint names the input."""
    arrays = as_float32(recipe_case("bfloat16"))
    arrays["q"] = arrays["q"] * np.float32(1 + 2 ** -12)
    line, = crosscheck(**arrays).diagnosis
    assert line.startswith("the results hold only bfloat16 values, as a bfloat16 kernel's do; "
                           "precision='bfloat16' would judge them, but: q has ")


def test_no_hint_for_float32_results_or_too_few_values():
    """A wrong float32 result (off the oracle by 1e-3), and a bfloat16 one of 4 values: no hint."""
    arrays = as_float32(recipe_case("bfloat16"))
    truth = na.attention_forward(*(arrays[n].astype(np.float64) for n in "qkv"), causal=True)[0]
    wrong = {n: x for n, x in arrays.items() if n not in ("lse", "dq", "dk", "dv")}
    wrong["out"] = (truth + 1e-3).astype(np.float32)
    assert not crosscheck(**wrong) and crosscheck(**wrong).diagnosis == ()
    small = {"q": arrays["q"][:, :1, :2], "k": arrays["k"][:, :1, :2], "v": arrays["v"][:, :1, :2, :2]}
    out = na.attention_forward(*(small[n].astype(np.float64) for n in "qkv"))[0]      # [1, 1, 2, 2]
    report = crosscheck(**small, out=out.astype(BF16).astype(np.float32))
    assert not report and report.diagnosis == ()


def flash_kernel_reading_its_out(seed=0):
    """A bfloat16 decoding case (one query row, 8 keys) whose candidate is the recipe's flash
    backward reading the kernel's own out for D = rowsum(dout * out), as FlashAttention's does,
    and that out rounded toward dout's signs (each entry within an ulp of the exact out): the
    largest shift of D an out of that accuracy gives, one D per head, in every entry of dq."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal(shape).astype(BF16).astype(np.float32) for shape in
                     ((1, 2, 1, 64), (1, 2, 8, 64), (1, 2, 8, 64), (1, 2, 1, 64)))
    exact = na.attention_forward(*(x.astype(np.float64) for x in (q, k, v)))[0]
    near = exact.astype(BF16).astype(np.float64)                   # one of its two bfloat16 neighbours
    step = np.abs(np.nextafter(near.astype(BF16), np.sign(dout) * np.inf).astype(np.float64) - near)
    toward = np.where((near - exact) * dout >= 0, near, near + np.sign(dout) * step)
    out = toward.astype(BF16).astype(np.float32)
    q3, k3, v3, record = na.attention_options(q, k, v)
    grads = recipe_attention(q3, k3, v3, record, PRECISIONS["bfloat16"], dout=dout, backward="flash",
                             saved_out=out)
    return {"q": q, "k": k, "v": v, "dout": dout, "out": out, "precision": "bfloat16",
            **{n: grads[n] for n in ("dq", "dk", "dv")}}


def test_a_flash_backward_reading_its_own_out_passes():
    report = crosscheck(**flash_kernel_reading_its_out())
    assert report, str(report)


def test_an_out_that_fails_does_not_excuse_the_gradients_it_reads():
    """The gradients are held to the backward that reads the kernel's out only when that out
    passes: out off by 5% fails, and so does the dq made from it."""
    arrays = flash_kernel_reading_its_out()
    wrong = arrays["out"] * np.float32(1.05)
    q3, k3, v3, record = na.attention_options(arrays["q"], arrays["k"], arrays["v"])
    grads = recipe_attention(q3, k3, v3, record, PRECISIONS["bfloat16"], dout=arrays["dout"],
                             backward="flash", saved_out=wrong)
    report = crosscheck(**{**arrays, "out": wrong, "dq": grads["dq"], "dk": grads["dk"]})
    assert {r.name for r in report.rows if not r.passed} >= {"out", "dq"}, str(report)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_an_lse_may_be_off_by_half_an_ulp_of_the_compute_dtype(precision):
    """A kernel that sums its softmax weights rounded to T has an lse off by up to eps(T) / 2
    however small the lse: here two keys k = +-e_1 and scores +-scale 2^-8, where the recipe's
    lse is exact to float32's rounding. Off by 0.9 of that passes, by 8 eps(T) fails."""
    p = PRECISIONS[precision]
    q = np.zeros((1, 1, 1, 8), np.float32)
    q[..., 0], q[..., 1] = 2.0 ** -8, 1.0
    k = np.zeros((1, 1, 2, 8), np.float32)
    k[..., 0, 0], k[..., 1, 0] = 1.0, -1.0
    v = np.random.default_rng(0).standard_normal((1, 1, 2, 8)).astype(p.storage).astype(np.float32)
    q3, k3, v3, record = na.attention_options(q, k, v)
    result = recipe_attention(q3, k3, v3, record, p)
    half = float(ml_dtypes.finfo(p.compute).eps) / 2
    for shift, passes in ((0.9 * half, True), (16 * half, False)):
        report = crosscheck(q=q, k=k, v=v, out=result["out"], lse=result["lse"] + np.float32(shift),
                            precision=precision)
        assert report.rows[1].passed == passes, str(report)


def test_the_scale_check_is_not_applied_where_rounding_along_u_hides_a_scale_error():
    """Where the baseline's rounding along u alone, s(baseline), exceeds scale_tol (a result
    the scale barely moves), a(e) is rounding noise: no scale check. Where u is large, the same
    errors are checked."""
    rng = np.random.default_rng(3)
    oracle = rng.standard_normal(16)
    baseline, candidate = (oracle + 1e-3 * rng.standard_normal(16) for _ in range(2))
    for u, applied in ((np.full(16, 1e-4), False), (np.ones(16), True)):
        verdict = judge("out", candidate, oracle, baseline, scale_direction=u, scale_tol=3.9e-3)
        assert np.isnan(verdict.scale_bound) != applied and verdict.passed, verdict


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_kernel_that_scales_q_in_the_compute_dtype_passes(precision):
    """MLX's order, S = round(round(scale q) k^T), is one of the recipe's ways: 60 honest cases
    of it pass (widths whose scale 1/sqrt(d) is not a power of two; some causal)."""
    p = PRECISIONS[precision]
    failed = []
    for seed in range(60):
        rng = np.random.default_rng(seed)
        n_q, n_k, d = int(rng.integers(1, 100)), int(rng.integers(1, 100)), int(rng.choice([24, 40, 96]))
        q, k, v, dout = (rng.standard_normal(shape).astype(p.storage).astype(np.float32) for shape in
                         ((1, 2, n_q, d), (1, 2, n_k, d), (1, 2, n_k, d), (1, 2, n_q, d)))
        causal = bool(rng.random() < 0.5) and n_k >= n_q
        q3, k3, v3, record = na.attention_options(q, k, v, causal=causal)
        result = recipe_attention(q3, k3, v3, record, p, dout=dout, mlx=True)
        report = crosscheck(q=q, k=k, v=v, dout=dout, causal=causal, precision=precision,
                            **{name: result[name] for name in ("out", "lse", "dq", "dk", "dv")})
        failed += [] if report else [(seed, str(report))]
    assert not failed, failed[:1]
