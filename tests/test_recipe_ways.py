"""The recipe's ways of computing a 16- or 8-bit case (runs.case_ways): the ways that share a
forward compute it once (runs.ways_by_forward, recipe.recipe_backwards), bitwise what each way
computed on its own gives."""
import importlib

import ml_dtypes
import numpy as np
import pytest

from numpy_attention import attention_forward
from numpy_attention.oracle import crosscheck, rule, runs, split_case, verdicts
from numpy_attention.oracle.precision import PRECISIONS, round_to
from numpy_attention.oracle.recipe import recipe_attention

recipe_module = importlib.import_module("numpy_attention.oracle.recipe")
blocks = importlib.import_module("numpy_attention.oracle.row_blocks")

SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])
CASES = {                                         # q [2, 4, 70, 16] over k, v [2, 2, 90, 16] (GQA)
    "plain": {},
    "causal": {"causal": True},
    "bias per head, scale": {"bias": np.random.default_rng(1).standard_normal((4, 70, 90)), "scale": 0.4},
    "dropout, softcap": {"dropout_mask": np.random.default_rng(2).random((2, 4, 70, 90)) < 0.8,
                         "dropout_p": 0.2, "softcap": 3.0},
    "ALiBi, causal bottom_right": {"alibi_slopes": SLOPES, "causal": "bottom_right"},
    "sinks, window": {"sinks": np.array([0.3, -1.0, 0.0, 2.0]), "window": (20, 5)},
}


def inputs(precision, gqa=True):
    """q, k, v, dout stored in the precision (dout None in float8: forward only)."""
    rng = np.random.default_rng(0)
    storage = PRECISIONS[precision].storage
    h_kv = 2 if gqa else 4
    q, k, v, dout = (rng.standard_normal(shape).astype(storage) for shape in
                     ((2, 4, 70, 16), (2, h_kv, 90, 16), (2, h_kv, 90, 16), (2, 4, 70, 16)))
    if PRECISIONS[precision].forward_only:
        return dict(q=q, k=k, v=v, out=q.astype(ml_dtypes.bfloat16))
    return dict(q=q, k=k, v=v, dout=dout, out=q)


def way_alone(case, way, gradients, block_rows):
    """The baseline of one way (runs.case_ways) by recipe_attention alone: what check computed
    way by way, each way with its own forward."""
    p = case.precision
    q, k, v, dout, record, back = runs.recipe_case_in(case)
    backward, reorder, reads, mlx, scores = runs.case_ways(case, gradients)[way][1]
    saved = round_to(case.candidates["out"], p.compute) if reads else None
    gradients = gradients and backward is not None
    result = recipe_attention(q, k, v, record, p, dout=dout if gradients else None, backward=backward or "eager",
                              reorder=reorder, block_rows=block_rows, saved_out=saved, mlx=mlx, scores=scores)
    if back is not None and "dq" in result:
        result["dq"], result["dk"] = back(result["dq"], result["dk"])
    return result


def forwards_counted(monkeypatch):
    """A list that grows by one for each block of rows the recipe's forward computes."""
    calls = []
    forward = recipe_module._forward_rows
    monkeypatch.setattr(recipe_module, "_forward_rows", lambda *args: calls.append(1) or forward(*args))
    return calls


FORWARD_ONLY_OPTIONS = [name for name in CASES if name != "dropout, softcap"]   # float8's (case.py)


@pytest.mark.parametrize("gqa", [True, False])
@pytest.mark.parametrize("precision, name", [(p, name) for p in ("bfloat16", "float16") for name in CASES]
                         + [("float8_e4m3fn", name) for name in FORWARD_ONLY_OPTIONS])
def test_the_ways_that_share_a_forward_compute_it_once_with_each_ways_bits(precision, name, gqa, monkeypatch):
    """baselines: one forward for the ways that share it (scale on k with the eager backward,
    the flash one and the flash one reading the kernel's out), each way's results bitwise its
    own; the same in blocks of 32 rows (as on a large case)."""
    case = split_case({**inputs(precision, gqa), **CASES[name], "precision": precision})
    gradients = "dout" in case.inputs
    ways = runs.case_ways(case, gradients)
    assert len(runs.ways_by_forward(ways)) == len(ways) - 2 * gradients      # two ways fewer with gradients
    calls = forwards_counted(monkeypatch)
    for block_rows in (None, 32):                                      # whole, and in blocks of rows
        calls.clear()
        together = runs.baselines(case, gradients, block_rows)
        rows = len(blocks.row_slices(70, block_rows))
        assert len(calls) == len(runs.ways_by_forward(ways)) * rows
        for way, result in enumerate(together):
            alone = way_alone(case, way, gradients, block_rows)
            assert result.keys() == alone.keys()
            for tensor, want in alone.items():
                assert result[tensor].dtype == want.dtype
                assert np.array_equal(result[tensor], want, equal_nan=True), (ways[way][0], tensor, block_rows)


def test_baselines_gives_the_ways_asked_for_in_their_order():
    """ways=[...]: those ways' baselines only, in the order asked, each the one of all ways."""
    case = split_case({**inputs("bfloat16"), **CASES["causal"]})
    every = runs.baselines(case)
    asked = [4, 0, 6]
    for way, result in zip(asked, runs.baselines(case, ways=asked)):
        assert all(np.array_equal(result[t], every[way][t], equal_nan=True) for t in every[way])


# ----------------------------------------------------------------------------- the envelope, lazily

def scaled_case(precision="bfloat16"):
    """A case with scale 0.3, its candidate our float64 attention rounded to the precision."""
    rng = np.random.default_rng(3)
    storage = PRECISIONS[precision].storage
    q, k, v, dout = (rng.standard_normal((1, 4, 64, 32)).astype(storage) for _ in range(4))
    arrays = dict(q=q, k=k, v=v, dout=dout, scale=0.3)
    case = split_case(dict(arrays, out=q))
    return arrays, case


def recorded(calls):
    """rule.judge, each call's (tensor, the baselines' way names, passed) appended to calls."""
    def judge(name, *args, **kwargs):
        verdict = rule.judge(name, *args, **kwargs)
        calls.append((name, tuple(kwargs["baseline_names"]), verdict.passed))
        return verdict
    return judge


def ways_asked(monkeypatch):
    """A list of the way numbers each call of verdicts.baselines computes."""
    asked, baselines = [], verdicts.baselines
    def counted(case, *args, ways=None, **kwargs):
        asked.append(list(range(len(runs.case_ways(case, args[0])))) if ways is None else list(ways))
        return baselines(case, *args, ways=ways, **kwargs)
    monkeypatch.setattr(verdicts, "baselines", counted)
    return asked


def candidate_of_way(case, way):
    """The case's baseline of a way, as a candidate's tensors in the precision."""
    base = runs.baselines(case, ways=[way])[0]
    storage = case.precision.storage
    return {**{name: base[name].astype(storage) for name in ("out", "dq", "dk", "dv")}, "lse": base["lse"]}


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_a_candidate_that_passes_the_first_forwards_ways_is_judged_by_them_alone(precision, monkeypatch):
    """An honest candidate passes against the scale on k's ways (eager, flash, D of its out):
    the other ways are not computed, every tensor's bound is from those ways."""
    arrays, case = scaled_case(precision)
    candidate = candidate_of_way(case, 0)
    asked, calls = ways_asked(monkeypatch), []
    report = crosscheck(**arrays, **candidate, judge=recorded(calls))
    assert report
    first = list(runs.ways_by_forward(runs.case_ways(case, True))[0])
    assert asked == [first] and first == [0, 3, 6]
    assert all(row.baseline_way.startswith("scale on k") for row in report.rows)
    assert {name for name, _, _ in calls} == set(candidate)


def test_a_candidate_that_fails_the_first_forwards_ways_is_judged_by_every_way(monkeypatch):
    """A candidate computed with the scale on S fails the scale on k's row check on out, and
    passes against every way: the other ways are computed, each tensor judged again against
    all of them (out and lse against all but the one that reads the kernel's out)."""
    arrays, case = scaled_case()
    ways = runs.case_ways(case, True)
    candidate = candidate_of_way(case, 1)
    asked, calls = ways_asked(monkeypatch), []
    report = crosscheck(**arrays, **candidate, judge=recorded(calls))
    assert report
    assert asked == [[0, 3, 6], [1, 2, 4, 5]]
    assert ("out", ("scale on k", "scale on k"), False) in calls         # ways 0 and 3's forward
    last = {name: names for name, names, _ in calls}                     # each tensor's final verdict
    forward = [ways[i][0][0] for i in range(6)]
    assert last["out"] == tuple(forward) and last["lse"] == tuple(forward)
    gradients = tuple(ways[i][0][1] for i in range(7) if ways[i][1][0] is not None)
    assert last["dq"] == last["dk"] == last["dv"] == gradients


def test_a_failing_candidates_report_is_the_one_against_every_way(monkeypatch):
    """A wrong out (a scale 1% off) fails: the report, its verdicts and diagnosis are those of
    judging against every way at once (runs.ways_by_forward as one group for the verdicts)."""
    arrays, case = scaled_case()
    candidate = candidate_of_way(case, 0)
    wrong = runs.baselines(split_case(dict(arrays, scale=0.303, out=arrays["q"])), ways=[0])[0]
    candidate["out"] = wrong["out"].astype(case.precision.storage)
    report = crosscheck(**arrays, **candidate)
    assert not report
    monkeypatch.setattr(verdicts, "ways_by_forward", lambda ways: [tuple(range(len(ways)))])   # crosscheck's first: all
    every_way = crosscheck(**arrays, **candidate)
    assert str(report) == str(every_way) and report.to_json() == every_way.to_json()


def overflowing_case():
    """A float16 case whose unscaled products q . k (about 64 * 40^2 = 1e5) overflow float16's
    65504 though the scaled scores do not: the recipe's way with the scale on S cannot compute
    it. The candidate is our float64 attention rounded to float16 (lse in float32)."""
    rng = np.random.default_rng(3)
    q, k = ((40 + 3 * rng.standard_normal((1, 2, 16, 64))).astype(np.float16) for _ in range(2))
    v, dout = (rng.standard_normal((1, 2, 16, 64)).astype(np.float16) for _ in range(2))
    out, cache = attention_forward(*(x.astype(np.float64) for x in (q, k, v)), scale=1e-3)
    return dict(q=q, k=k, v=v, scale=1e-3, out=out.astype(np.float16), lse=cache.lse.astype(np.float32))


def test_a_way_whose_scores_overflow_computes_nan_not_weights_made_up():
    """The scale on S overflows to +inf in every row: its out and lse are NaN there (a row with
    an infinite score was once taken for a fully masked one, its weights made 0, and out 0)."""
    case = split_case(overflowing_case())
    ways = runs.case_ways(case, False)
    on_s = [number for number, (names, _) in enumerate(ways) if names[0] == "scale on S"]
    base = runs.baselines(case, gradients=False, ways=on_s)[0]
    assert np.isnan(base["out"]).all() and np.isnan(base["lse"]).all()


def test_a_way_that_overflows_is_left_out_and_cannot_excuse_zeros():
    """The honest candidate passes against the ways that compute the case, lazily or not, and
    an all-zero out fails: the overflowing way neither refuses the case nor widens the bound."""
    arrays = overflowing_case()
    report = crosscheck(**arrays)
    assert report, str(report)
    assert all("scale on S" not in row.baseline_way for row in report.rows)
    zeros = crosscheck(**{**arrays, "out": np.zeros_like(arrays["out"])})
    assert not zeros and not zeros.rows[0].passed, str(zeros)
