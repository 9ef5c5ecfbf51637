"""The cross-check: the .npz format, the tolerance rule and the command.

Its verdicts on torch (honest SDPA results pass, planted bugs fail): test_torch_crosscheck.py.
"""
import json
import re

import numpy as np
import pytest

from numpy_attention import attention_backward, attention_forward, attention_options
from numpy_attention.commands.cli import main
from numpy_attention.oracle import (CaseError, crosscheck, judge, load_case, save_case,
                                        write_example_case)
from numpy_attention.oracle.magnitudes import term_sums
from numpy_attention.oracle.rule import CrosscheckReport
from numpy_attention.oracle.naive import naive_attention, recursive_matmul
from test_cli import usage_error


# ----------------------------------------------------------------------------- the rule

def test_rule_is_nan_aware_both_ways():
    oracle = np.array([1.0, np.nan, np.inf, 2.0])
    base = oracle.astype(np.float32)
    assert judge("out", base, oracle, base).passed                  # NaN = NaN, inf = inf
    for bad in ([np.nan, np.nan, np.inf, 2.0], [1.0, 0.0, np.inf, 2.0], [1.0, np.nan, -np.inf, 2.0]):
        verdict = judge("out", np.array(bad, np.float32), oracle, base)
        assert not verdict.passed and verdict.max_abs_err == np.inf


def test_rule_bound_is_k_times_baseline_plus_atol():
    oracle = np.zeros(4)
    base = np.array([0, 1e-3, 0, 0], np.float32)
    assert judge("dq", np.array([0, 3e-3, 0, 0], np.float32), oracle, base, atol=0).passed
    verdict = judge("dq", np.array([0, 3.1e-3, 0, 0], np.float32), oracle, base, atol=0)
    assert not verdict.passed and verdict.worst_index == (1,) and verdict.k == 3
    assert not judge("out", np.array([0, 2.1e-3, 0, 0], np.float32), oracle, base, atol=0).passed


def test_naive_baseline_matches_the_oracle_in_float64():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 5, 4))
    left_to_right = np.zeros((2, 3, 4))
    for i in range(5):                                 # ((a0 b0 + a1 b1) + a2 b2) + ...
        left_to_right = left_to_right + a[..., :, i, None] * b[..., i, None, :]
    assert np.array_equal(recursive_matmul(a, b), left_to_right)
    q, k, v = rng.standard_normal((2, 4, 3, 5)), rng.standard_normal((2, 2, 6, 5)), rng.standard_normal((2, 2, 6, 3))
    dout, bias = rng.standard_normal((2, 4, 3, 3)), rng.standard_normal((4, 3, 6))
    opts = dict(bias=bias, causal="bottom_right", window=(2, 0), softcap=2.0,
                dropout_mask=rng.random((2, 4, 3, 6)) < 0.8, dropout_p=0.2)
    out, cache = attention_forward(q, k, v, scale=0.3, **opts)
    g = attention_backward(dout, cache)
    naive = naive_attention(*attention_options(q, k, v, scale=0.3, **opts), dout=dout)
    for name, want in dict(out=out, lse=cache.lse, dq=g.dq, dk=g.dk, dv=g.dv, dbias=g.dbias).items():
        np.testing.assert_allclose(naive[name], want, rtol=1e-12, atol=1e-13, err_msg=name)


# ----------------------------------------------------------------------------- format and command

def test_example_case_round_trips_and_passes(tmp_path, capsys):
    path = tmp_path / "case.npz"
    assert main(["crosscheck", "--write-example", str(path)]) == 0
    arrays = load_case(path)
    assert {"q", "k", "v", "dout", "bias", "causal", "out", "lse", "dq", "dk", "dv", "dbias"} <= set(arrays)
    capsys.readouterr()
    assert main(["crosscheck", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "oracle float64" in lines[0] and lines[0].endswith("-> PASS")
    assert [line.split()[-1] for line in lines[3:9]] == ["PASS"] * 6      # the first table's rows
    assert main(["crosscheck", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and [r["name"] for r in report["tensors"]] == ["out", "lse", "dq", "dk", "dv", "dbias"]


def test_command_exit_1_on_a_wrong_result(tmp_path, capsys):
    arrays = write_example_case(tmp_path / "good.npz")
    arrays["dk"] = arrays["dk"] * 1.01
    save_case(tmp_path / "bad.npz", **arrays)
    assert main(["crosscheck", str(tmp_path / "bad.npz")]) == 1
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()[3:9]}
    assert rows["dk"] == "FAIL" and rows["dq"] == "PASS"


@pytest.mark.parametrize("change, message", [
    (lambda a: [a.pop(name) for name in ("out", "lse", "dq", "dk", "dv", "dbias")], "missing key 'out'"),
    (lambda a: a.pop("dout"), "missing key 'dout'"),
    (lambda a: a.update(dq=a["dq"][..., :3]), "dq must have shape (2, 4, 6, 8), got (2, 4, 6, 3)"),
    (lambda a: a.update(causal=np.array(2.0)), "causal must be a 0-d bool"),
    (lambda a: a.update(extra=np.zeros(1)), "unknown key 'extra'"),
    (lambda a: a.update(bias=np.zeros((5, 9)), dbias=np.zeros((5, 9))), "bias of shape (5, 9) does not broadcast"),
])
def test_command_exit_2_on_a_malformed_case(tmp_path, capsys, change, message):
    arrays = write_example_case(tmp_path / "good.npz")
    change(arrays)
    np.savez(tmp_path / "bad.npz", **arrays)                # np.savez: save_case refuses bad cases
    assert main(["crosscheck", str(tmp_path / "bad.npz")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_command_exit_2_on_a_file_that_is_not_a_case(tmp_path, capsys):
    (tmp_path / "x.npz").write_text("not a zip file")
    assert "not an .npz archive" in usage_error(["crosscheck", str(tmp_path / "x.npz")], capsys)
    assert main(["crosscheck", str(tmp_path / "x.npz")]) == 2
    assert main(["crosscheck", str(tmp_path / "missing.npz")]) == 2
    assert capsys.readouterr().err.count("\n") == 2
    with pytest.raises(CaseError, match="missing key 'q'"):
        crosscheck(k=np.zeros((2, 3)), v=np.zeros((2, 3)), out=np.zeros((2, 3)))


def test_command_exit_2_on_a_npy_file(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros(3))                  # np.load gives an ndarray, not an archive
    assert "not an .npz archive" in usage_error(["crosscheck", str(tmp_path / "x.npy")], capsys)


def test_command_exit_2_when_the_example_cannot_be_written(tmp_path, capsys):
    path = str(tmp_path / "no-such-dir" / "x.npz")
    assert path in usage_error(["crosscheck", "--write-example", path], capsys)


def _small_case(**options):
    """A float32 case from our own attention: q [1, 2, 4, 8], k, v [1, 2, 5, 8], with out and lse."""
    rng = np.random.default_rng(0)
    arrays = {"q": rng.standard_normal((1, 2, 4, 8)), "k": rng.standard_normal((1, 2, 5, 8)),
              "v": rng.standard_normal((1, 2, 5, 8)), **options}
    out, cache = attention_forward(*(arrays[n].astype(np.float32) for n in "qkv"), **options)
    return {**arrays, "out": out, "lse": cache.lse}


@pytest.mark.parametrize("key, shape", [("q", ()), ("k", (8,)), ("v", ()), ("out", (8,))])
def test_case_with_too_few_axes_names_the_key_and_shape(key, shape, tmp_path, capsys):
    arrays = {**_small_case(), key: np.zeros(shape, np.float32)}
    with pytest.raises(CaseError, match=rf"{key} must .*{re.escape(str(shape))}"):
        crosscheck(**arrays)
    np.savez(tmp_path / "bad.npz", **arrays)
    assert key in usage_error(["crosscheck", str(tmp_path / "bad.npz")], capsys)


@pytest.mark.parametrize("key, value", [
    ("scale", np.nan), ("scale", -1.0), ("scale", 0.0), ("scale", np.inf), ("scale", 0),
    ("softcap", np.nan), ("softcap", -2.0), ("dropout_p", 1.0), ("dropout_p", -0.1),
    ("window", np.array([-2, 3])), ("causal", np.array("diagonal")),
    ("align", np.array("top_right")), ("fully_masked", np.array("one")),
])
def test_case_options_are_checked_like_attention_forward(key, value, tmp_path, capsys):
    arrays = {**_small_case(), key: np.asarray(value)}
    with pytest.raises(CaseError, match=key):
        crosscheck(**arrays)
    np.savez(tmp_path / "bad.npz", **arrays)
    assert key in usage_error(["crosscheck", str(tmp_path / "bad.npz")], capsys)


def test_case_causal_contradicting_align_is_refused():
    with pytest.raises(CaseError, match="contradicts align"):
        crosscheck(**_small_case(), causal=np.array("top_left"), align=np.array("bottom_right"))


def test_a_valid_scale_is_used():
    arrays = _small_case(scale=0.5)
    assert crosscheck(**arrays)
    assert not crosscheck(**{**arrays, "scale": np.array(0.25)})


def test_lse_of_a_fully_masked_row_may_be_plus_or_minus_inf():
    # FlashAttention 2 (non-split) writes +inf where every key is masked, we and torch -inf
    mask = np.ones((4, 5), bool)
    mask[2] = False
    arrays = _small_case(mask=mask)
    assert np.isneginf(arrays["lse"][..., 2]).all()
    plus = arrays["lse"].copy()
    plus[..., 2] = np.inf
    for lse in (arrays["lse"], plus):
        assert crosscheck(**{**arrays, "lse": lse})
        assert judge("lse", lse, arrays["lse"].astype(np.float64), arrays["lse"]).passed
    wrong = arrays["lse"].copy()
    wrong[..., 1] = np.inf                                    # a row with keys: +inf is wrong
    assert not crosscheck(**{**arrays, "lse": wrong})
    finite = arrays["lse"].copy()
    finite[..., 2] = 0.0                                      # a masked row: finite is wrong
    assert not crosscheck(**{**arrays, "lse": finite})


def test_a_case_without_keys_is_judged():
    """N_k = 0: out is 0 (fully_masked 'zero'), lse -inf; a nonzero out fails, no traceback."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3, 4)), np.zeros((2, 0, 4)), np.zeros((2, 0, 5))
    zeros, lse = np.zeros((2, 3, 5), np.float32), np.full((2, 3), -np.inf, np.float32)
    assert crosscheck(q=q, k=k, v=v, out=zeros, lse=lse)
    assert not crosscheck(q=q, k=k, v=v, out=zeros + 1, lse=lse)


UNJUDGEABLE = [({"scale": np.array(1e300)}, "scale=1e+300 is not finite in the candidate's compute dtype float32")]
if np.finfo(np.longdouble).eps < np.finfo(np.float64).eps:        # a longdouble wider than float64
    UNJUDGEABLE.append(({"out": np.zeros((1, 2, 4, 8), np.longdouble)}, "out must be float16, float32 or float64"))


@pytest.mark.parametrize("change, message", UNJUDGEABLE)
def test_cases_the_oracle_cannot_judge_are_refused(change, message, tmp_path, capsys):
    arrays = {**_small_case(), **change}
    with pytest.raises(CaseError, match=re.escape(message)):
        crosscheck(**arrays)
    np.savez(tmp_path / "bad.npz", **arrays)
    err = usage_error(["crosscheck", str(tmp_path / "bad.npz")], capsys)
    assert message in err and "Warning" not in err


def test_every_tensor_is_held_to_the_baseline_of_the_case_precision():
    """FlashAttention returns a float32 lse with a float16 out: the case's precision is float16,
    and the lse, computed from float16 scores, is held to the float16 recipe's lse (errors
    ~1e-3 |S|, not a float32 baseline's ~1e-7), while the report names its own dtype."""
    arrays = {name: x.astype(np.float16) for name, x in _small_case().items() if name in "qkv"}
    out, cache = attention_forward(*(arrays[n].astype(np.float32) for n in "qkv"))
    arrays.update(out=out.astype(np.float16), lse=cache.lse)
    report = crosscheck(**arrays)
    rows = {r.name: r for r in report.rows}
    assert report, str(report)
    assert rows["out"].dtype == "float16" and rows["lse"].dtype == "float32"
    assert rows["lse"].baseline_err > 1e-5                      # float16 scores, not float32 ones
    assert report.baseline_dtype.startswith("float16")


@pytest.mark.parametrize("kwargs, exc, message", [
    ({"k_factors": [1]}, TypeError, "k_factors must be a mapping"),
    ({"k_factors": {"out": "x"}}, TypeError, "k_factors['out'] must be a finite real number > 0"),
    ({"k_factors": {"out": 0}}, ValueError, "k_factors['out'] must be a finite real number > 0"),
    ({"k_factors": {"dx": 2}}, ValueError, "k_factors has the key 'dx'"),
    ({"atol": "x"}, TypeError, "atol must be a finite real number >= 0"),
    ({"atol": -1}, ValueError, "atol must be a finite real number >= 0, got -1"),
])
def test_crosscheck_keyword_arguments_are_checked(kwargs, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        crosscheck(**_small_case(), **kwargs)


def test_atol_is_four_ulps_of_the_largest_sum_of_terms():
    """atol = 4 eps(float32) M, M computed here independently (float64, no mask), each weight
    P_ij counted with its own rounding, w_ij = 1 + (|S_ij| + |lse_i|) / 4 (one ulp of its
    argument's terms): for out max_i sum_j P_ij w_ij max|v|; for dq scale max|k| max_i sum_j
    P_ij ((|dP_ij| + |D_i|) w_ij + ||dout_i|| (||v_j|| + ||out_i||)), the products' terms bounded
    by the rows' lengths; for lse max|S| + scale max||q_i|| max||k_j|| + log N_k."""
    rng = np.random.default_rng(7)
    q, k, v, dout = (rng.standard_normal((1, 2, 4, 8)) for _ in range(4))
    out, cache = attention_forward(*(x.astype(np.float32) for x in (q, k, v)))
    dq = attention_backward(dout.astype(np.float32), cache).dq
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(8)
    P = np.exp(s - s.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    D = np.sum(dout * (P @ v), -1, keepdims=True)
    length = lambda x: np.linalg.norm(x, axis=-1)
    dots = length(dout)[..., None] * (length(v)[..., None, :] + (P @ length(v)[..., None]))
    lse = np.log(np.sum(np.exp(s), -1, keepdims=True))
    w = 1 + (np.abs(s) + np.abs(lse)) / 4
    M = {"out": np.max(np.sum(P * w, -1)) * np.abs(v).max(),
         "dq": np.max(np.sum(P * ((np.abs(dout @ np.swapaxes(v, -1, -2)) + np.abs(D)) * w + dots), -1))
         * np.abs(k).max() / np.sqrt(8),
         "lse": np.abs(s).max() + length(q).max() * length(k).max() / np.sqrt(8) + np.log(4)}
    rows = {r.name: r for r in crosscheck(q=q, k=k, v=v, dout=dout, out=out, dq=dq, lse=cache.lse).rows}
    for name in M:
        assert rows[name].atol == pytest.approx(4 * np.finfo(np.float32).eps * M[name], rel=1e-9), name


def test_judge_refuses_shapes_that_differ():
    with pytest.raises(ValueError, match=re.escape("(2, 3), (2, 4) and (2, 3)")):
        judge("out", np.zeros((2, 3)), np.zeros((2, 4)), np.zeros((2, 3)))


def test_a_huge_ratio_keeps_to_its_column():
    oracle = np.array([1.0, 2.0])
    row = judge("out", oracle + 1e60, oracle, oracle + 1e-13, atol=0.0)
    line = str(CrosscheckReport(rows=[row], oracle_dtype="float64", baseline_dtype="float64")).splitlines()[3]
    assert len(line.split()) == 9 and line.split()[5] == f"{row.ratio:.3g}" == "1e+73"


@pytest.mark.parametrize("slopes_shape", [(3,), (2, 3)])
def test_per_head_term_sums_add_up_over_the_batch_where_the_vector_broadcasts(slopes_shape):
    """dsinks[h] (sinks [H]) sums over the batch and the rows, and so do the terms its atol
    scales with: the largest per-head sum, not the largest per-batch-index one. ALiBi slopes
    [..., H] with a batch axis sum over the rows (and columns) only."""
    rng = np.random.default_rng(0)
    B, H, N = 2, 3, 4
    P = rng.random((B, H, N, N)) / N                  # rows sum below 1: the rest is the sink's
    stages = {"S": rng.standard_normal((B, H, N, N)), "P": P, "P~": P,
              "dP": rng.standard_normal((B, H, N, N)), "D": rng.standard_normal((B, H, N))}
    inputs = {name: rng.standard_normal((B, H, N, 8)) for name in ("q", "k", "v", "dout")}
    options = {"sinks": np.zeros(H), "alibi_slopes": np.ones(slopes_shape)}
    sums = term_sums([((Ellipsis, slice(None), slice(None)), stages)], inputs, options)
    sink_terms = np.sum((1 - P.sum(-1)) * np.abs(stages["D"]), -1)             # [B, H]
    assert sums["dsinks"] == pytest.approx(sink_terms.sum(0).max())           # summed over B
    assert sums["dsinks"] > sink_terms.max() * 1.01                          # more than one b's
    v_lengths, dout_lengths = (np.linalg.norm(inputs[name], axis=-1) for name in ("v", "dout"))
    dots = dout_lengths[..., None] * (v_lengths[..., None, :] + P @ v_lengths[..., None])
    w = 1 + np.abs(stages["S"]) / 4                                           # each weight's rounding (no lse given)
    terms = P * ((np.abs(stages["dP"]) + np.abs(stages["D"])[..., None]) * w + dots)
    per_head = 2 * N * terms.sum((-2, -1))                                     # reach = N_q + N_k
    expected = per_head.sum(0).max() if slopes_shape == (H,) else per_head.max()
    assert sums["dalibi_slopes"] == pytest.approx(expected)
