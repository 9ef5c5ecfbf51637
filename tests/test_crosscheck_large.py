"""crosscheck of a large case in O(N) memory (oracle/row_blocks.py): the tiled oracle and the
baselines in blocks of query rows give the results of whole arrays.

The budget is forced small (blocks.SCORE_BUDGET = 1: every case is large, blocks of
TILE_ROWS = 32 rows), so that small cases run through the blocked path and can be
compared with the whole-array one. The memory itself is measured in a subprocess.
"""
import importlib
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.oracle import CaseError, crosscheck
from numpy_attention.oracle.precision import PRECISIONS
from numpy_attention.oracle.recipe import TILE_ROWS, recipe_attention

blocks = importlib.import_module("numpy_attention.oracle.row_blocks")
BF16 = np.dtype(ml_dtypes.bfloat16)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def forced_blocks(monkeypatch):
    """Every case is large: crosscheck takes the O(N) path, in blocks of TILE_ROWS rows."""
    monkeypatch.setattr(blocks, "SCORE_BUDGET", 1)


def shapes(gqa=True, n_q=70, n_k=90, d=16):
    """q, k (= v), dout shapes: two batches, 4 query heads over 2 kv heads (or 4)."""
    h_kv = 2 if gqa else 4
    return (2, 4, n_q, d), (2, h_kv, n_k, d), (2, 4, n_q, d)


def random_inputs(rng, gqa=True, n_q=70, n_k=90):
    q_shape, k_shape, dout_shape = shapes(gqa, n_q, n_k)
    return (rng.standard_normal(q_shape), rng.standard_normal(k_shape), rng.standard_normal(k_shape),
            rng.standard_normal(dout_shape))


def every_option(rng, n_q=70, n_k=90):
    """attention options (all that the baselines have), each with its own name."""
    mask = rng.random((n_q, n_k)) < 0.7
    mask[3] = False                                                   # a fully masked row
    return {
        "none": {},
        "causal top_left": {"causal": True},
        "causal bottom_right, window": {"causal": "bottom_right", "window": (20, 0)},
        "window top_left": {"window": (5, 7)},
        "mask, uniform rows": {"mask": mask, "fully_masked": "uniform"},
        "mask, nan rows": {"mask": mask[None, None], "fully_masked": "nan"},
        "bias per head, scale": {"bias": rng.standard_normal((4, n_q, n_k)), "scale": 0.4},
        "bias broadcast over rows": {"bias": rng.standard_normal((2, 1, 1, n_k))},
        "bias with -inf, mask": {"bias": np.where(rng.random((n_q, n_k)) < 0.2, -np.inf, 0.0),
                                 "mask": mask},
        "softcap, dropout": {"softcap": 3.0, "dropout_mask": rng.random((2, 4, n_q, n_k)) < 0.8,
                             "dropout_p": 0.2},
    }


# ----------------------------------------------------------------------------- the baselines

def _record(q, k, v, dtype, opts):
    cast = lambda x: x.astype(dtype)
    opts = {name: cast(x) if name == "bias" else x for name, x in opts.items()}
    return na.attention_options(cast(q), cast(k), cast(v), **opts)


@pytest.mark.parametrize("name", list(every_option(np.random.default_rng(0))))
@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_the_recipe_in_blocks_is_the_whole_array_one(name, precision):
    """Forward and both backwards bitwise, on any processor: the recipe takes every product
    and every sum over rows in tiles of TILE_ROWS rows, whatever rows it holds."""
    rng = np.random.default_rng(2)
    p = PRECISIONS[precision]
    q, k, v, dout = (x.astype(p.compute).astype(np.float32) for x in random_inputs(rng))
    record = _record(q, k, v, np.float32, every_option(rng)[name])
    for backward, reorder in (("eager", True), ("eager", False), ("flash", True)):
        whole = recipe_attention(*record, p, dout=dout, backward=backward, reorder=reorder)
        blocked = recipe_attention(*record, p, dout=dout, backward=backward, reorder=reorder,
                                   block_rows=TILE_ROWS)
        for tensor, want in whole.items():
            assert np.array_equal(blocked[tensor], want, equal_nan=True), (backward, reorder, tensor)


# ----------------------------------------------------------------------------- crosscheck

def candidate_case(rng, precision, opts, gqa=True, n_q=70, n_k=90, head_axis=True):
    """Inputs stored in the precision and our float64 attention's results rounded to it."""
    dtype = PRECISIONS[precision].storage
    q, k, v, dout = (x.astype(dtype) for x in random_inputs(rng, gqa, n_q, n_k))
    if not head_axis:                                                  # [N, d] arrays
        q, k, v, dout = (x[0, 0] for x in (q, k, v, dout))
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    out, cache = na.attention_forward(*wide[:3], **opts)
    g = na.attention_backward(wide[3], cache)
    wider = np.result_type(np.float32, np.float64 if precision == "float64" else np.float32)
    arrays = dict(q=q, k=k, v=v, dout=dout, out=out.astype(dtype), lse=cache.lse.astype(wider),
                  dq=g.dq.astype(dtype), dk=g.dk.astype(dtype), dv=g.dv.astype(dtype))
    options = {name: np.array(x) for name, x in opts.items()}
    if g.dbias is not None:
        arrays["dbias"] = g.dbias.astype(wider)
    return {**arrays, **options}


def large_options(rng):
    """The options the O(N) path supports (no softcap, dropout, 'uniform' / 'nan' rows)."""
    return {name: opts for name, opts in every_option(rng).items()
            if not {"softcap", "dropout_mask", "fully_masked"} & set(opts)}


def _same_reports(whole, blocked, precision):
    """The verdicts equal; the errors and bounds equal but for the oracle's rounding (the tiled
    engine's, far below the bound), the recipe's eager dk, dv, dbias to an ulp of their entries
    (a flipped rounding may be the worst one)."""
    assert bool(whole) == bool(blocked), (str(whole), str(blocked))
    for a, b in zip(whole.rows, blocked.rows):
        assert (a.name, a.passed) == (b.name, b.passed), (str(whole), str(blocked))
        np.testing.assert_allclose(b.max_abs_err, a.max_abs_err, rtol=1e-6, atol=1e-3 * a.bound,
                                   err_msg=a.name)
        eager_sums = precision == "bfloat16" and a.name in ("dk", "dv", "dbias")
        np.testing.assert_allclose(b.baseline_err, a.baseline_err, rtol=0.5 if eager_sums else 1e-6,
                                   atol=1e-3 * a.bound, err_msg=a.name)
        np.testing.assert_allclose(b.atol, a.atol, rtol=1e-9, err_msg=a.name)


@pytest.mark.parametrize("name", list(large_options(np.random.default_rng(0))))
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_crosscheck_in_blocks_gives_the_whole_array_report(name, precision, monkeypatch):
    rng = np.random.default_rng(3)
    arrays = candidate_case(rng, precision, large_options(rng)[name])
    whole = crosscheck(**arrays)
    monkeypatch.setattr(blocks, "SCORE_BUDGET", 1)
    blocked = crosscheck(**arrays)
    assert whole, str(whole)
    _same_reports(whole, blocked, precision)


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("setting", ["own_forward", "lse base 2", "[N, d] arrays"])
def test_crosscheck_settings_in_blocks(setting, precision, monkeypatch):
    """The candidate's own forward, an lse in base 2, a single head's arrays, and the float64
    precision (a long double oracle, the naive baseline in float64)."""
    rng = np.random.default_rng(4)
    opts = {"causal": "bottom_right", "bias": rng.standard_normal((70, 90))}
    arrays = candidate_case(rng, precision, opts, head_axis=setting != "[N, d] arrays")
    kwargs = {"own_forward": True} if setting == "own_forward" else {}
    if setting == "lse base 2":
        arrays["lse"], kwargs["lse_base"] = arrays["lse"] / np.log(2), "2"
    whole = crosscheck(**arrays, **kwargs)
    monkeypatch.setattr(blocks, "SCORE_BUDGET", 1)
    _same_reports(whole, crosscheck(**arrays, **kwargs), precision)


def test_a_wrong_candidate_fails_in_blocks_without_a_diagnosis(forced_blocks):
    rng = np.random.default_rng(5)
    arrays = candidate_case(rng, "float32", {"causal": True})
    arrays["dk"] = arrays["dk"] * np.float32(1.01)
    report = crosscheck(**arrays)
    assert [row.name for row in report.rows if not row.passed] == ["dk"]
    assert len(report.diagnosis) == 1 and "too large to rerun the oracle" in report.diagnosis[0]


@pytest.mark.parametrize("option, value", [("softcap", 3.0), ("dropout_mask", "mask"),
                                           ("fully_masked", "uniform"), ("fully_masked", "nan")])
def test_options_the_tiled_oracle_lacks_are_refused_on_a_large_case(option, value, forced_blocks):
    rng = np.random.default_rng(6)
    arrays = candidate_case(rng, "float32", {})
    arrays[option] = np.array(rng.random((2, 4, 70, 90)) < 0.8 if value == "mask" else value)
    with pytest.raises(CaseError, match=rf"{option}.* not supported on a case this large: "
                                        rf"its scores \(2, 4, 70, 90\) have 50,400 entries"):
        crosscheck(**arrays)


def test_block_rows_follow_the_budget(monkeypatch):
    assert blocks.block_rows((1, 4, 2048, 2048), TILE_ROWS) is None        # 2**24 scores: whole
    assert blocks.block_rows((1, 4, 8192, 8192), TILE_ROWS) == 64          # 2**21 / (4 * 8192)
    assert blocks.block_rows((16, 16384, 16384), TILE_ROWS) == TILE_ROWS   # at least one tile
    monkeypatch.setattr(blocks, "SCORE_BUDGET", 1)
    assert blocks.block_rows((2, 3), 1) == 1
    assert blocks.row_slices(70, 32) == [slice(0, 32), slice(32, 64), slice(64, 70)]


# ----------------------------------------------------------------------------- memory

MEDIUM = """
import importlib, numpy as np, ml_dtypes
import numpy_attention as na
from numpy_attention.oracle import crosscheck
blocks = importlib.import_module("numpy_attention.oracle.row_blocks")
blocks.SCORE_BUDGET = {budget}
def peak_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
bf16 = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, 2, {n}, 32)).astype(bf16) for _ in range(4))
wide = [x.astype(np.float64) for x in (q, k, v, dout)]
out, cache = na.attention_forward(*wide[:3], causal=True, implementation="tiled")
g = na.attention_backward(wide[3], cache)
arrays = dict(q=q, k=k, v=v, dout=dout, causal=np.array(True), out=out.astype(bf16),
              lse=cache.lse.astype(np.float32), dq=g.dq.astype(bf16), dk=g.dk.astype(bf16),
              dv=g.dv.astype(bf16))
before = peak_mib()
report = crosscheck(**arrays)
print("PASS" if report else "FAIL", before, peak_mib())
"""


@pytest.mark.slow
def test_a_medium_case_runs_in_blocks_far_below_the_whole_arrays_memory():
    """(1, 2, 2048, 32) bfloat16 with gradients, 8.4e6 scores: whole arrays hold float64
    [1, 2, 2048, 2048] stages of 64 MiB each (S, P, P~, dP, dS, the terms; measured: the peak
    grows by 560 MiB); in blocks of 32 rows (SCORE_BUDGET = 2**20) crosscheck's peak grows by
    less than one of them (measured: 26 MiB). BLAS on one thread: small products, and a
    shared machine's other processes stall a multithreaded BLAS (measured: 1.2 s, not 6 s)."""
    n = 2048
    env = dict(os.environ, PYTHONPATH=REPO, OPENBLAS_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", MEDIUM.format(budget=2 ** 20, n=n)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    verdict, before, after = res.stdout.split()
    one_stage = 2 * n * n * 8 / 2 ** 20                                # one float64 [1, 2, N, N]: 64 MiB
    assert verdict == "PASS"
    assert float(after) - float(before) < one_stage, (before, after)
