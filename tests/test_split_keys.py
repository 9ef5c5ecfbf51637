"""Results over the keys in parts, merged by lse, judged against all the keys' oracle
(oracle/split_keys.py): the merge is attention over all the keys; the bound is the baselines'
parts merged the same way; what a split case cannot hold is refused."""
import ml_dtypes
import numpy as np
import pytest
from optional import TORCH_REASON

import numpy_attention as na
from numpy_attention.conformance import examples
from numpy_attention.oracle import CaseError, baselines, crosscheck, split_case
from numpy_attention.oracle.split_keys import crosscheck_merged, key_parts, merged

BF16 = ml_dtypes.bfloat16


def inputs(seed, dtype=np.float64, n_q=4, n_k=120, d=32):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((1, 2, n, d)).astype(dtype) for name, n in (("q", n_q), ("k", n_k), ("v", n_k))}


def test_parts_merged_by_lse_are_attention_over_all_the_keys():
    arrays, at = inputs(0), (1, 40, 41, 100)
    parts = []
    for part in key_parts(arrays, at):
        out, cache = na.attention_forward(part["q"], part["k"], part["v"])
        parts.append({"out": out, "lse": cache.lse})
    out, cache = na.attention_forward(arrays["q"], arrays["k"], arrays["v"])
    whole = merged(parts)
    np.testing.assert_allclose(whole["out"], out, rtol=0, atol=1e-14)
    np.testing.assert_allclose(whole["lse"], cache.lse, rtol=0, atol=1e-14)
    assert [part["k"].shape[-2] for part in key_parts(arrays, at)] == [1, 39, 1, 59, 20]


def _baseline_parts(arrays, at, lse_dtype):
    """The bfloat16 recipe's first way on each part: out in bfloat16, lse in lse_dtype."""
    parts = []
    for part in key_parts(arrays, at):
        case = split_case({**part, "out": np.zeros(part["q"].shape, BF16)})
        base = baselines(case, False)[0]
        parts.append({"out": base["out"].astype(BF16), "lse": base["lse"].astype(lse_dtype)})
    return parts


def test_an_honest_kernel_with_a_bfloat16_lse_passes_its_merge_where_one_calls_bound_does_not():
    """An lse kept in bfloat16 (JAX's) moves each part's weight by its rounding: eight parts merged
    are held to the baselines merged alike, which such parts pass; one call's bound fails some."""
    at = tuple(range(15, 120, 15))
    single = []
    for seed in range(10):
        arrays = inputs(seed, BF16)
        parts = _baseline_parts(arrays, at, BF16)
        assert crosscheck_merged(arrays, at, parts), seed
        single.append(bool(crosscheck(**arrays, **merged(parts))))
    assert not all(single)


def test_a_wrong_part_fails_its_merge():
    arrays, at = inputs(1, BF16), (30, 70)
    parts = _baseline_parts(arrays, at, np.float32)
    assert crosscheck_merged(arrays, at, parts)
    for name, wrong in (("lse", lambda x: x + np.float32(0.05)), ("out", lambda x: (x.astype(np.float32) * 1.02).astype(BF16))):
        bad = [dict(part) for part in parts]
        bad[1][name] = wrong(bad[1][name])
        report = crosscheck_merged(arrays, at, bad)
        assert not report and name in [row.name for row in report.rows if not row.passed]


@pytest.mark.parametrize("policy", ["zero", "uniform"])         # (JAX's and MLX's 'uniform': no row needs it)
def test_the_split_trial_of_an_example_kernel_passes_and_names_its_cuts(policy):
    trial, = na.conform.properties(names=("layout",), dtypes=("bfloat16",), supports=("gqa", "lse"),
                                   fully_masked=policy)
    assert str(trial).startswith("layout-split-bfloat16") and (trial.case.n_q, trial.case.n_k) == (19, 96)
    result = na.conform.check_property(examples.numpy_float32, trial)
    assert result.status == "PASS", result.detail


def _kernel_parts(arrays, at):
    """numpy_float32's out and lse on each part of the keys (bfloat16 values in float32 arrays)."""
    return [examples.numpy_float32(p["q"].astype(BF16), p["k"].astype(BF16), p["v"].astype(BF16))
            for p in key_parts(arrays, at)]


def test_the_settings_are_crosschecks_a_base_2_lse_fa_s_layout_a_named_precision_torch_tensors():
    """An honest merge passes in every way crosscheck takes a case: lse in base 2, FlashAttention's
    [B, N, H, d] layout, the precision named for bfloat16 values stored as float32, torch tensors;
    one at given as an int."""
    arrays = {name: x.astype(BF16).astype(np.float32) for name, x in inputs(3, np.float32, n_k=50).items()}
    parts = _kernel_parts(arrays, (20,))
    assert crosscheck_merged(arrays, 20, parts, precision="bfloat16")
    base2 = [{"out": p["out"], "lse": p["lse"] / np.float32(np.log(2))} for p in parts]
    assert crosscheck_merged(arrays, (20,), base2, precision="bfloat16", lse_base="2")
    assert not crosscheck_merged(arrays, (20,), base2, precision="bfloat16")       # read as base e: wrong
    laid = lambda x: np.swapaxes(x, -2, -3)
    bnhd = {name: laid(x) for name, x in arrays.items()}
    assert crosscheck_merged({**bnhd, "layout": "bnhd"}, (20,), [{"out": laid(p["out"]), "lse": p["lse"]} for p in parts],
                             precision="bfloat16")
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    as_torch = lambda x: torch.tensor(np.asarray(x, np.float32)).to(torch.bfloat16 if x.dtype == BF16 else torch.float32)
    assert crosscheck_merged({name: as_torch(x) for name, x in arrays.items()}, (20,),
                             [{name: as_torch(x) for name, x in p.items() if name in ("out", "lse")} for p in parts],
                             precision="bfloat16")


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "causal": True}, "a split case holds q, k, v, scale, precision, fully_masked, layout, lse_base; it has causal"),
    (lambda a: {**a, "at": (0, 5)}, r"at must cut N_k = 120 keys at increasing indices in \(0, 120\), got \(0, 5\)"),
    (lambda a: {**a, "at": (50, 50)}, r"got \(50, 50\)"),
    (lambda a: {**a, "at": (120,)}, r"got \(120,\)"),
    (lambda a: {**a, "at": ()}, r"got \(\)"),
    (lambda a: {**a, "results": a["results"][:1]}, r"results has 1 parts for the 2 that at = \(60,\) cuts"),
    (lambda a: {**a, "results": [{"out": r["out"]} for r in a["results"]]}, r"results\[0\] has no lse"),
    (lambda a: {**a, "results": [a["results"][0], {**a["results"][1], "lse": np.full(a["results"][1]["lse"].shape, np.nan)}]},
     r"results\[1\]'s lse holds NaN or \+inf, which no merge can weigh"),
    (lambda a: {**a, "at": "middle"}, r"at must be key indices \(ints\), got 'middle'"),
    (lambda a: {**a, "at": (20.5,)}, r"at must be key indices \(ints\), got \(20.5,\)"),
    (lambda a: {**a, "arrays": {n: x for n, x in a["arrays"].items() if n != "k"}}, "missing key 'k'"),
])
def test_what_a_split_case_cannot_hold_is_refused_by_name(change, message):
    arrays = inputs(2, np.float32)
    given = {"arrays": arrays, "at": (60,),
             "results": [{"out": p["q"], "lse": np.zeros(p["q"].shape[:-1], np.float32)} for p in key_parts(arrays, (60,))]}
    given = change(given) if "causal" not in message else {**given, "arrays": change(arrays)}
    with pytest.raises(CaseError, match=message):
        crosscheck_merged(given["arrays"], given["at"], given["results"])
