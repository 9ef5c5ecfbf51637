"""What a crosscheck report says (rule.py: CrosscheckReport, TensorVerdict.failed): a failing
tensor names each check it failed, with its numbers; a candidate's NaN and infinite entries
are counted, not hidden by the norms (which leave them out); every line fits in 100
characters. Candidates: our float64 attention rounded to the case's dtype, the bfloat16
recipe (test_crosscheck_precisions.bf16_case), each perturbed; and judge on plain arrays."""
import json
import re

import ml_dtypes
import numpy as np
import pytest
from test_crosscheck_precisions import bf16_case

import numpy_attention as na
from numpy_attention.oracle import CrosscheckReport, crosscheck, judge, write_example_case
from numpy_attention.options import GRADIENTS

BF16 = np.dtype(ml_dtypes.bfloat16)


def every_tensor_case(dtype, kernel_scale=None):
    """A causal case with bias, sinks and ALiBi slopes, every candidate tensor from out to
    dalibi_slopes: our float64 attention (at kernel_scale, None: the case's) rounded to dtype."""
    rng = np.random.default_rng(0)
    x = lambda *shape: rng.standard_normal(shape).astype(dtype).astype(np.float64)
    inputs = dict(q=x(1, 2, 6, 8), k=x(1, 2, 9, 8), v=x(1, 2, 9, 8), dout=x(1, 2, 6, 8))
    options = dict(bias=x(1, 2, 6, 9), sinks=x(2), alibi_slopes=np.abs(x(2)))
    out, cache = na.attention_forward(inputs["q"], inputs["k"], inputs["v"], causal=True,
                                      scale=kernel_scale, **options)
    grads = na.attention_backward(inputs["dout"], cache)
    results = dict(out=out, lse=cache.lse, dq=grads.dq, dk=grads.dk, dv=grads.dv, dbias=grads.dbias,
                   dsinks=grads.dsinks, dalibi_slopes=grads.dalibi_slopes)
    return dict(causal=True, **{name: a.astype(dtype) for name, a in {**inputs, **options}.items()},
                **{name: r.astype(np.float32 if name == "lse" else dtype) for name, r in results.items()})


def rows(report):
    return {r.name: r for r in report.rows}


def lines_of(report, name):
    """The report's lines that begin with the tensor's name: its row in each table, then the
    first line of its failure if it fails."""
    return [line for line in str(report).splitlines() if line.split()[0] == name]


def failure(report, name):
    """The tensor's failure, its continuation lines joined on ("" if it passes)."""
    text = str(report).replace("\n    ", " ")
    return next((line for line in text.splitlines() if line.startswith(f"{name} FAIL: ")), "")


# ----------------------------------------------------------------------------- each check names itself

def test_a_max_abs_failure_names_the_error_the_bound_and_the_factor(tmp_path):
    arrays = write_example_case(tmp_path / "case.npz")                 # float32
    arrays["dk"] = arrays["dk"] * 1.01
    report = crosscheck(**arrays)
    dk = rows(report)["dk"]
    expected = f"max abs err {dk.max_abs_err:.2e} > bound {dk.bound:.2e} ({dk.max_abs_err / dk.bound:.3g}x)"
    assert dk.failed == (expected,) and not dk.passed
    assert lines_of(report, "dk")[-1] == failure(report, "dk") == f"dk FAIL: {expected}"
    assert all(r.failed == () for r in report.rows if r.name != "dk")


def test_the_normwise_check_names_its_l2_ratio():
    """Every entry off by 1.5 is within 2 * the baseline's one error of 1 (max-abs passes),
    but its norm, 1.5 * 20 over 400 entries, is 30 times the baseline's."""
    oracle = np.random.default_rng(0).standard_normal(400)
    baseline = oracle + np.where(np.arange(400) == 0, 1.0, 0.0)
    verdict = judge("out", oracle + 1.5, oracle, baseline, atol=0, l2_k=2.0)
    assert verdict.failed == ("L2 ratio 30 > 2",) and not verdict.passed


def test_the_row_check_names_its_row_ratio_in_a_bfloat16_report():
    """One dq entry off by 2% of max|dq|: within the tensor's bound, 5 times its row's (the
    largest row error of the recipe's ways, here MLX's, whose softmax backward rounds each op)."""
    arrays = bf16_case(n=(32, 32), d=32)
    dq = arrays["dq"].astype(np.float32)
    dq[0, 1, 7, 4] += 0.02 * np.abs(dq).max()
    report = crosscheck(**{**arrays, "dq": dq.astype(BF16)})
    verdict = rows(report)["dq"]
    assert verdict.failed == (f"row ratio {verdict.row_ratio:.3g} > k 3",) and verdict.row_ratio > 4.5
    assert failure(report, "dq") == f"dq FAIL: row ratio {verdict.row_ratio:.3g} > k 3"
    assert [r.name for r in report.rows if r.failed] == ["dq"]


def test_the_scale_check_names_the_scale_error_and_its_bound():
    report = crosscheck(**bf16_case(n=(32, 32), d=32, kernel_scale=1.01 / np.sqrt(32)))
    for r in report.rows:
        check = f"scale err {r.scale_err:+.2e} beyond ±{r.scale_bound:.2e}"
        assert check in r.failed and abs(r.scale_err - 0.01) < 0.002           # +1%
        assert check in failure(report, r.name)


def test_a_tensor_failing_every_check_names_all_four_in_order():
    arrays = bf16_case()
    arrays["out"] = (arrays["out"].astype(np.float32) * 1.05).astype(BF16)
    out = rows(crosscheck(**arrays))["out"]
    assert [check.split()[0] for check in out.failed] == ["max", "L2", "row", "scale"]


def test_a_passing_report_names_no_failure(tmp_path):
    for report in (crosscheck(**write_example_case(tmp_path / "case.npz")), crosscheck(**bf16_case()),
                   crosscheck(**every_tensor_case(BF16))):
        assert report and "FAIL" not in str(report), str(report)
        assert all(r.failed == () and r.nans == r.infs == 0 for r in report.rows)


# ----------------------------------------------------------------------------- NaN and inf

def test_an_all_nan_candidate_reports_its_nan_count_and_fails():
    """dq all NaN: the norms (over finite errors) would say 0; the report counts the NaN."""
    arrays = bf16_case()
    arrays["dq"] = np.full_like(arrays["dq"], np.nan)
    report = crosscheck(**arrays)
    dq, size = rows(report)["dq"], arrays["dq"].size
    assert not report and not dq.passed and dq.max_abs_err == np.inf
    assert (dq.nans, dq.infs) == (size, 0)
    assert dq.failed[0] == f"{size} of {size} entries NaN where the oracle is finite"
    max_abs, low_precision, worst, failed = lines_of(report, "dq")
    assert max_abs.split()[3:5] == [str(size), "NaN"] and "0.000e+00" not in max_abs   # rel L2 err
    assert low_precision.split()[1:3] == [str(size), "NaN"]                            # L2 ratio
    assert worst.split()[1] == "nan"
    assert failed.startswith(f"dq FAIL: {size} of {size} entries NaN")


def test_infinite_entries_are_counted_and_nan_where_the_oracle_is_nan_is_not():
    oracle = np.linspace(-1, 1, 20)
    candidate = oracle.copy()
    candidate[:3], candidate[3:5] = np.nan, [np.inf, -np.inf]
    verdict = judge("out", candidate, oracle, oracle)
    assert (verdict.nans, verdict.infs) == (3, 2) and not verdict.passed
    assert verdict.failed == ("3 of 20 entries NaN where the oracle is finite",
                              "2 of 20 entries inf where the oracle is finite")
    line = str(CrosscheckReport([verdict], "float64", "float64")).splitlines()[3]
    assert "5 NaN/inf" in line and line.endswith("FAIL")
    oracle[:3] = np.nan                                  # NaN on both sides: error 0
    candidate[3:5] = oracle[3:5]
    verdict = judge("out", candidate, oracle, oracle)
    assert verdict.passed and (verdict.nans, verdict.infs, verdict.failed) == (0, 0, ())


# ----------------------------------------------------------------------------- width

@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kernel_scale", [None, 1.0], ids=["passing", "wrong scale"])
def test_every_line_fits_in_100_characters(dtype, kernel_scale):
    case = every_tensor_case(dtype, kernel_scale)
    report = crosscheck(**case)
    given = [name for name in GRADIENTS if name in case]                  # the table's order
    assert [r.name for r in report.rows] == ["out", "lse", "dq", "dk", "dv", *given]
    assert set(given) == {"dbias", "dsinks", "dalibi_slopes"}
    assert bool(report) == (kernel_scale is None)
    if kernel_scale is not None:                      # every tensor fails, and a diagnosis says why
        assert all(failure(report, r.name) for r in report.rows)
        assert report.diagnosis and "scale 1" in str(report)
    text = str(report)
    assert max(len(line) for line in text.splitlines()) <= 100, text


def test_the_widest_row_and_a_long_diagnosis_fit():
    """A float8 dtype, the longest tensor name, a 5-d index, NaN and inf counts in four digits,
    every check failing, and a diagnosis of 400 characters: wrapped, not a word lost."""
    rng = np.random.default_rng(1)
    oracle = rng.standard_normal((2, 3, 4, 130, 9))
    candidate = oracle * 1.2
    candidate.reshape(-1)[:1200] = np.nan
    candidate.reshape(-1)[1200:2400] = np.inf
    verdict = judge("dalibi_slopes", candidate, oracle, oracle + 1e-3, dtype=ml_dtypes.float8_e4m3fn,
                    l2_k=2.0, rows=True, scale_direction=oracle)
    assert len(verdict.failed) == 5                  # the NaN, the inf, L2, row, scale
    diagnosis = " ".join(f"dq, dk, dv match causal='bottom_right' (rel L2 {i}.1e-17);" for i in range(8))
    text = str(CrosscheckReport([verdict], "float64", "float8_e4m3fn (recipe)", (diagnosis,)))
    assert max(len(line) for line in text.splitlines()) <= 100, text
    wrapped = text.split("\ndiagnosis: ")[1]
    assert wrapped.split() == diagnosis.split() and len(wrapped.splitlines()) > 1
    assert all(check in " ".join(text.split()) for check in verdict.failed)


# ----------------------------------------------------------------------------- JSON

def test_to_json_has_the_failed_checks_and_the_counts():
    arrays = bf16_case()
    arrays["dq"] = np.full_like(arrays["dq"], np.nan)
    arrays["out"] = (arrays["out"].astype(np.float32) * 1.05).astype(BF16)
    report = crosscheck(**arrays)
    tensors = {t["name"]: t for t in json.loads(report.to_json())["tensors"]}
    for r in report.rows:
        assert tensors[r.name]["failed"] == list(r.failed)
        assert (tensors[r.name]["nans"], tensors[r.name]["infs"]) == (r.nans, r.infs)
    assert tensors["dq"]["max_abs_err"] == "inf" and tensors["dq"]["nans"] == arrays["dq"].size
    assert len(tensors["out"]["failed"]) == 4 and tensors["lse"]["failed"] == []


def test_to_json_is_standard_json_with_null_for_a_check_not_applied():
    """A float32 report has no normwise, row or scale check (NaN fields): null, not "nan"."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 4, 8)).astype(np.float32) for _ in range(3))
    out, _ = na.attention_forward(q, k, v)
    text = crosscheck(q=q, k=k, v=v, out=out).to_json()
    row = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON {name}"))["tensors"][0]
    assert [row[key] for key in ("l2_k", "row_ratio", "scale_err", "scale_bound")] == [None] * 4
    assert "nan" not in text.lower().replace('"nans"', "")


# ----------------------------------------------------------------------------- the baseline's way

def test_the_verdict_names_the_baseline_whose_error_is_the_bound():
    rng = np.random.default_rng(2)
    oracle = rng.standard_normal((2, 5, 8))
    near, far = oracle + 1e-3 * rng.standard_normal(oracle.shape), oracle + 1e-2
    verdict = judge("out", oracle + 1e-3, oracle, [near, far], baseline_names=["near", "far"])
    assert verdict.baseline_way == "far" and verdict.baseline_err == pytest.approx(1e-2)
    assert judge("out", oracle, oracle, [far, near], baseline_names=["far", "near"]).baseline_way == "far"
    assert judge("out", oracle, oracle, near).baseline_way == ""


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["float32", "bfloat16"])
def test_the_report_says_which_way_of_the_baseline_bounds_each_tensor(dtype):
    report = crosscheck(**every_tensor_case(dtype, None))
    ways = {r.name: r.baseline_way for r in report.rows}
    if dtype == np.float32:
        assert set(ways.values()) == {"naive, head-width sums left to right"}
        return
    scales = ("scale on k", "scale on S", "scale on q (MLX)")
    assert ways["out"] in scales and ways["lse"] in scales
    assert all(ways[n].startswith(scales) and ways[n].endswith(("eager backward", "flash backward", "D of its out"))
               for n in ("dq", "dk", "dv"))
    assert "baseline way" in str(report) and all(way in str(report) for way in ways.values())


def test_a_baseline_ways_own_scale_error_does_not_widen_the_scale_check():
    """A way that holds the scale in T (MLX's) is off along u by its offset on purpose: the
    scale check measures its a(baseline) from that offset, and the bound stays the noise's."""
    rng = np.random.default_rng(4)
    oracle, u = rng.standard_normal((2, 64, 16)), rng.standard_normal((2, 64, 16))
    noise = lambda: 1e-4 * rng.standard_normal(oracle.shape)
    honest, rounded_scale = oracle + noise(), oracle + 3e-3 * u + noise()
    settings = dict(scale_direction=u, scale_tol=0.0)
    wide = judge("out", oracle, oracle, [honest, rounded_scale], **settings)
    kept = judge("out", oracle, oracle, [honest, rounded_scale], scale_offsets=[0.0, 3e-3], **settings)
    assert wide.scale_bound > 2 * 3e-3 * 0.9 and kept.scale_bound < 1e-3      # k times the noise


# ----------------------------------------------------------------------------- progress

def test_a_large_case_reports_its_stages_and_a_small_one_is_quiet(monkeypatch, tmp_path, capsys):
    """A case of PROGRESS_SCORES scores or more (minutes of work) says each stage on stderr, with
    the seconds since the command started; a smaller one prints nothing but the report."""
    from numpy_attention.commands.cli import main
    from numpy_attention.oracle import verdicts

    path = str(tmp_path / "case.npz")
    write_example_case(path)
    assert main(["crosscheck", path]) == 0
    assert capsys.readouterr().err == ""
    said = []
    write = {name: np.asarray(x) for name, x in np.load(path).items()}
    monkeypatch.setattr(verdicts, "PROGRESS_SCORES", 2 * 4 * 6 * 9)           # the example's scores
    assert crosscheck(**write, progress=said.append)
    assert said == ["a case of 432 scores: the oracle in float64", "the float32 baselines (1 way)",
                    "the term magnitudes", "the verdicts"]
    assert main(["crosscheck", path]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [re.sub(r" \(\d+ s\)$", "", line) for line in lines] == [f"numpy-attention crosscheck: {s}" for s in said]
