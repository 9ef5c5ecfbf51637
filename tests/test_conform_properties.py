"""The conformance properties (conformance/properties.py): an honest kernel holds every one; each
faulty kernel of tests/property_bugs.py breaks exactly the property it was written to break
(the lengths: exactly at the lengths it is wrong at); conform reports them (table, JSON, saved
cases) and the command picks them by name."""
import importlib.util
import json

import numpy as np
import pytest

import numpy_attention as na
import property_bugs
from numpy_attention.commands.cli import main
from numpy_attention.conformance import examples
from numpy_attention.conformance.kernels import as_kernel
from numpy_attention.conformance.properties import LENGTHS, PROPERTIES
from numpy_attention.conformance.shrink import MAX_STEPS
from numpy_attention.conformance.supports import declaration_of, promises

DTYPES = ("float32", "bfloat16")


def failing(kernel, dtypes=DTYPES, names=None):
    """{(property, dtype): [trial, ...]} of the trials the kernel does not pass."""
    declared = declaration_of(kernel).supports or ("gqa", "lse", "gradients")
    found = {}
    for trial in na.conform.properties(names=names, dtypes=dtypes, supports=declared):
        result = na.conform.check_property(as_kernel(kernel), trial, promises(declared))
        if result.status != "PASS":
            found.setdefault((trial.property, trial.dtype), []).append((trial, result))
    return found


def test_the_trials_are_named_once_and_the_first_round_tries_every_property_and_dtype():
    trials = na.conform.properties(dtypes=DTYPES, supports=("gqa", "mask", "varlen", "gradients"))
    assert len({str(t) for t in trials}) == len(trials)
    first = trials[:len(PROPERTIES) * len(DTYPES)]
    assert {(t.property, t.dtype) for t in first} == {(p, d) for p in PROPERTIES for d in DTYPES}
    lengths = {(t.case.n_q, t.case.n_k) for t in trials if t.property == "lengths" and t.dtype == "float32"}
    assert lengths == {(n_q, n) for n in LENGTHS for n_q in (n, 1)}
    assert set(LENGTHS) == {n for m in range(16, 257, 16) for n in (m - 1, m, m + 1)}


@pytest.mark.slow
def test_an_honest_kernel_holds_every_property():
    assert failing(examples.numpy_float32) == {}


@pytest.mark.parametrize("name, broken", [
    ("cached_by_shape", "honesty"), ("wrong_at_one_length", "lengths"), ("partial_block_dropped", "lengths"),
    ("partial_block_doubled", "lengths"), ("noisy", "determinism"), ("batch_dependent", "batch_invariance"), ("batch_leak", "batch_invariance"),
    ("unshifted_softmax", "range"), ("sink_leak", "empty_rows"), ("nan_swallowed", "nan_keys"),
    ("paged_tail_read", "nan_keys"), ("page_size_16", "layout"),
    ("lse_rows_by_keys", "layout"), ("packed_order_dependent", "layout batch_invariance")])     # (its bits move with its place in a pack)
def test_each_faulty_kernel_breaks_exactly_its_property(name, broken):
    names = None if broken != "lengths" else ("lengths",)          # (the others: in the slow test)
    dtype = "float16" if name == "unshifted_softmax" else "float32"
    found = failing(getattr(property_bugs, name), dtypes=(dtype,), names=names)
    assert set(found) == {(one, dtype) for one in broken.split()}, found
    if name == "unshifted_softmax":
        assert [trial.case.role for trial, _ in found[broken, dtype]] == ["saturated"]
    if name == "wrong_at_one_length":
        assert {trial.case.n_k for trial, _ in found[broken, "float32"]} == {144}
    if name in ("partial_block_dropped", "partial_block_doubled"):
        assert {trial.case.n_k for trial, _ in found[broken, "float32"]} == {n for n in LENGTHS if n % 16 and n > 16}


def test_a_norm_preserving_wrong_forward_fails_every_judged_trial():
    """rows_rotated's out has the honest out's norm in every head, to the bit, and fails each
    property trial crosscheck judges (all but nan_keys' NaN, which still reaches every row; the
    layout's split trial among them: its parts' outs are rotated too)."""
    q, k, v = (np.random.default_rng(3).standard_normal((1, 2, 9, 8)).astype(np.float32) for _ in range(3))
    honest, rotated = examples.numpy_float32(q, k, v)["out"], property_bugs.rows_rotated(q, k, v)["out"]
    assert np.array_equal(np.linalg.norm(honest, axis=(-2, -1)), np.linalg.norm(rotated, axis=(-2, -1)))
    names = tuple(p for p in PROPERTIES if p != "lengths")
    found = failing(property_bugs.rows_rotated, dtypes=("float32",), names=names)
    assert set(found) == {(p, "float32") for p in names if p not in ("empty_rows", "nan_keys")}, found


@pytest.mark.slow                                   # lengths up to 641: about 18 s
def test_declared_block_sizes_add_lengths_that_find_a_fault_past_256():
    """partial_block_of_320 passes the lengths of 16 to 256; its declared block adds 319, 320, 321,
    639, 640, 641 (N_q = N_k and N_q = 1), and it fails at 321, 639 and 641 alone."""
    kernel = property_bugs.partial_block_of_320
    trials = na.conform.properties(names=("lengths",), dtypes=("float32",), supports=("gqa",), block_sizes=(320,))
    added = {t.case.n_k for t in trials} - set(LENGTHS)
    assert added == {319, 320, 321, 639, 640, 641} and len(trials) == 2 * (len(LENGTHS) + 6)
    found = [trial for trial in trials[-12:]                           # (the added ones: last)
             if na.conform.check_property(as_kernel(kernel), trial).status != "PASS"]
    assert sorted({t.case.n_k for t in found}) == [321, 639, 641] and len(found) == 6
    assert failing(kernel, names=("lengths",), dtypes=("float32",)) == {}     # undeclared: not found
    report = na.conform(kernel, dtypes=("float32",), properties=("lengths",), isolate=False, progress=False)
    row, = report.property_rows()                                      # conform reads the declaration
    assert (row.trials, row.failed) == (2 * (len(LENGTHS) + 6), 6)
    with pytest.raises(ValueError, match="block_sizes must hold integers from 2 to 4096"):
        na.conform.properties(block_sizes=(1,))
    with pytest.raises(ValueError, match="block_sizes must hold integers from 2 to 4096"):
        na.conform.declare(kernel, block_sizes=(8192,))


@pytest.mark.parametrize("name, passes", [("zeros_in_low_precision", ""),
                                          ("one_row_repeated", "nan_keys")])    # (row 0's NaN, repeated)
def test_degenerate_outputs_fail_every_trial_of_their_dtype_and_no_other(name, passes):
    """Zeros, or one row repeated, in bfloat16: crosscheck's rule fails them on each property's
    trial of that dtype (none of the trials is nearly uniform attention); float32, honest, passes."""
    names = tuple(p for p in PROPERTIES if p != "lengths")             # (96 trials a dtype: the slow test's)
    found = failing(getattr(property_bugs, name), dtypes=("float32", "bfloat16"), names=names)
    untried = ("empty_rows",)                                          # (no mask, varlen or paged)
    assert set(found) == {(p, "bfloat16") for p in names if p not in untried + (passes,)}, found


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wrong_at_one_length", "partial_block_dropped", "partial_block_doubled"])
def test_the_length_faults_break_no_other_property(name):
    assert set(failing(getattr(property_bugs, name), dtypes=("float32",))) == {("lengths", "float32")}


def test_what_fails_and_why_is_said():
    said = {name: failing(getattr(property_bugs, name), dtypes=("float32",), names=(prop,))[prop, "float32"][0][1]
            for name, prop in (("cached_by_shape", "honesty"), ("noisy", "determinism"),
                               ("batch_dependent", "batch_invariance"), ("batch_leak", "batch_invariance"))}
    assert said["cached_by_shape"].detail.startswith("returned the first call's out")
    assert "between two calls on the same inputs" in said["noisy"].detail
    assert said["batch_dependent"].detail.startswith("sequence 0 of 3, out:") and "in the batch and alone" in \
        said["batch_dependent"].detail
    assert said["batch_leak"].detail.startswith("sequence 2 of 3, in the batch, judged alone: out:")
    saturated = failing(property_bugs.unshifted_softmax, dtypes=("float16",), names=("range",))["range", "float16"]
    assert saturated[0][1].detail.startswith("q times 8 (saturated): out: ")
    leak = failing(property_bugs.sink_leak, dtypes=("float32",), names=("empty_rows",))["empty_rows", "float32"]
    assert leak[0][1].detail.startswith("rows whose mask is all False with sinks: dsinks: max abs err")
    swallowed = failing(property_bugs.nan_swallowed, dtypes=("float32",), names=("nan_keys",))["nan_keys", "float32"]
    assert swallowed[0][1].detail.startswith("a NaN in key 0, which every row attends to, did not reach out in 184 "
                                             "of 184 rows")
    read = failing(property_bugs.paged_tail_read, dtypes=("float32",), names=("nan_keys",))["nan_keys", "float32"]
    assert read[0][0].case.role == "unread" and "reached the results: out:" in read[0][1].detail
    pages = failing(property_bugs.page_size_16, dtypes=("float32",), names=("layout",))["layout", "float32"]
    assert pages[0][1].detail.startswith("in pages of twice the size: out: max abs err")
    order = failing(property_bugs.packed_order_dependent, dtypes=("float32",), names=("layout", "batch_invariance"))
    assert order["layout", "float32"][0][1].detail.endswith("as drawn and packed in reverse order")
    assert [trial.case.role for trial, _ in order["batch_invariance", "float32"]] == ["packed"]
    assert all(result.status == "FAIL" for result in said.values())


def test_a_promise_not_declared_is_held_by_the_oracles_rule_alone():
    """batch_dependent's other bits in a batch are right to rounding: without the promise its
    batch rows pass as the lone sequence's results; noisy's ulp passes the rule too."""
    for kernel, name in ((property_bugs.batch_dependent, "batch_invariance"), (property_bugs.noisy, "determinism")):
        undeclared = lambda q, k, v, dout=None, _kernel=kernel, **options: _kernel(q, k, v, dout=dout, **options)
        na.conform.declare(undeclared, kind="numpy", supports=("gqa", "lse", "gradients"))
        assert failing(undeclared, dtypes=("float32",), names=(name,)) == {}


def test_conform_reports_a_broken_property_and_saves_its_case(tmp_path):
    report = na.conform(property_bugs.wrong_at_one_length, dtypes=("float32",), supports=("lse",),
                        properties=("lengths", "honesty"), out_dir=tmp_path, isolate=False, progress=False)
    assert report.status == "FAIL" and all(r.status == "PASS" for r in report.results)
    rows = {row.property: row for row in report.property_rows()}
    assert (rows["lengths"].tried, rows["lengths"].trials, rows["lengths"].failed) == (96, 96, 2)
    assert rows["honesty"].failed == 0 and rows["lengths"].smallest.trial.case.n_q == 1
    text = str(report)
    assert "\nlengths           float32      96/96      94       2       0\n" in text
    assert "\n  lengths float32: FAIL float32-plain-b1h2kv2-q1k144-d64-out+lse: N_q = 1, N_k = 144: out: max abs" \
        in text
    data = json.loads(report.to_json())
    assert data["passed"] is False and len(data["property_trials"]) == 97
    lengths = next(p for p in data["properties"] if p["property"] == "lengths")
    assert lengths["failed"] == 2 and lengths["smallest_failing"]["case"].endswith("q1k144-d64-out+lse")
    saved = dict(report.saved)
    assert len(saved) == 2
    with np.load(saved[str(rows["lengths"].smallest.trial)]) as case:
        assert not na.crosscheck(**dict(case))                        # the saved case re-judges as failing
    ratios = {r.trial.case.n_k: r.worst for r in report.property_results if r.trial.property == "lengths"}
    assert ratios[144] > 1 and max(w for n, w in ratios.items() if n != 144) < 1   # what the picture draws
    picture = tmp_path / "lengths-float32.png"
    drawn = importlib.util.find_spec("matplotlib") is not None          # (the optional plot extra)
    assert report.pictures == ((("lengths", "float32", str(picture)),) if drawn else ())
    assert picture.exists() == drawn and (f"its trials' errors against N_k drawn in {picture}" in " ".join(text.split())) == drawn
    assert lengths["picture"] == (str(picture) if drawn else None)


def test_a_failing_property_trial_is_shrunk_to_a_few_tokens_and_saved(tmp_path):
    """batch_leak's batch trial (3 sequences of 33 queries and 48 keys, 4 heads of width 64) shrinks
    to one query and one key a sequence, still failing as it did; the shrunk trial is reported,
    in the JSON and saved for crosscheck. A lengths trial is not shrunk: it names its length."""
    report = na.conform(property_bugs.batch_leak, dtypes=("float32",), supports=("lse",), out_dir=tmp_path,
                        properties=("batch_invariance",), isolate=False, progress=False)
    (first, found, runs), = report.shrunk_trials
    case = found.trial.case
    assert first.status == found.status == "FAIL" and 0 < runs <= MAX_STEPS
    assert (case.batch, case.n_q, case.n_k) == (3, 1, 1) and case.tokens < first.trial.case.tokens
    assert found.detail.startswith("sequence 2 of 3, in the batch, judged alone: out:")
    assert f"shrunk to {case.id} in {runs} runs: sequence 2 of 3" in " ".join(str(report).split())
    row = json.loads(report.to_json())["properties"][0]
    assert (row["shrunk"]["case"], row["shrunk"]["runs"], row["shrunk"]["status"]) == (case.id, runs, "FAIL")
    with np.load(dict(report.saved)[str(found.trial)]) as saved:
        assert not na.crosscheck(**dict(saved))
    ratios = first.by_entry                                            # each sequence judged alone
    assert len(ratios) == 3 and max(ratios[:2]) < 1 < ratios[2] and row["smallest_failing"]["by_entry"][2] > 1
    picture = tmp_path / "batch_invariance-float32.png"                # drawn: a bar a sequence
    drawn = importlib.util.find_spec("matplotlib") is not None
    assert picture.exists() == drawn and row["picture"] == (str(picture) if drawn else None)
    assert (f"each sequence's error, judged alone, drawn in {picture}" in " ".join(str(report).split())) == drawn
    lengths = na.conform(property_bugs.wrong_at_one_length, dtypes=("float32",), supports=("lse",),
                         properties=("lengths",), isolate=False, progress=False)
    assert not lengths and lengths.shrunk_trials == ()


def test_the_properties_budget_runs_each_property_once_at_least(clock):
    report = na.conform(examples.numpy_float32, dtypes=("float32",), supports=("gqa",), budget=0.5,
                        isolate=False, progress=False)                 # (no lse: no split trial)
    tried = {(r.trial.property, r.trial.dtype) for r in report.property_results}
    assert tried == {(p, "float32") for p in PROPERTIES if p not in ("empty_rows", "layout")}
    assert report.status == "INCOMPLETE"
    assert report.untried() == [("empty_rows", "one of the options mask, bottom_right, varlen, paged"),
                                ("layout", "one of the options varlen, paged or the output lse")]
    assert "no trial for this kernel's supports: empty_rows (it needs one of the options mask, bottom_right, " \
           "varlen, paged)" in " ".join(str(report).split())                # (a wrapped line read whole)
    assert json.loads(report.to_json())["properties_without_trials"] == [
        {"property": "empty_rows", "needs": "one of the options mask, bottom_right, varlen, paged"},
        {"property": "layout", "needs": "one of the options varlen, paged or the output lse"}]


def test_the_split_trial_shrinks_to_a_few_keys_and_names_the_part_that_failed(tmp_path):
    """lse_rows_by_keys' split trial (19 queries, 96 keys in calls of 16, 32 and 48) shrinks while
    a part still has fewer keys than the queries; a part judged alone is saved for crosscheck."""
    report = na.conform(property_bugs.lse_rows_by_keys, dtypes=("float32",), properties=("layout",),
                        out_dir=tmp_path, isolate=False, progress=False)
    (first, found, runs), = report.shrunk_trials
    assert str(first.trial).startswith("layout-split-float32") and first.detail.startswith("keys 0 to 15 alone (of 96): lse:")
    case = found.trial.case
    assert found.status == "FAIL" and case.n_q * case.n_k <= 8 and case.n_q > 1, case
    assert found.detail.startswith(f"keys 0 to 0 alone (of {case.n_k}): lse:")
    with np.load(dict(report.saved)[str(found.trial)]) as saved:
        assert not na.crosscheck(**dict(saved)) and saved["k"].shape[-2] == 1


def test_unknown_properties_are_refused_by_name(capsys):
    with pytest.raises(ValueError, match="properties has the unknown name 'honest' .*honesty"):
        na.conform(examples.numpy_float32, properties=("honest",))
    assert main(["conform", "conform_bugs:scale_off", "--properties", "lenghts"]) == 2
    assert "--properties has the unknown name 'lenghts'" in capsys.readouterr().err
    assert main(["conform", "conform_bugs:scale_off", "--block-sizes", "8192"]) == 2
    assert "--block-sizes: must be an integer in [2, 4096], got '8192'" in capsys.readouterr().err
