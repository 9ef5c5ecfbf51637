"""A fixed set of crosscheck cases, for tests that hold crosscheck's fast paths to its plain
ones: the same verdicts and the same figures, every bit (test_oracle_fast_paths.py).

The cases: the conformance grid's smaller cases (every option, float32, bfloat16, float16)
judged on this package's own float32 attention (conform.examples.numpy_float32) and on
planted bugs (conform_bugs.py); float64 cases; cases run in blocks of rows (a small
blocks.SCORE_BUDGET); and cases large enough for crosscheck to cut them in slices for its
threads. A report is recorded as each row's fields, floats by repr, and its diagnosis lines.
"""
import ml_dtypes
import numpy as np

from conform_bugs import causal_shifted, dk_negated, scale_off

import numpy_attention as na
from numpy_attention.conformance import cases
from numpy_attention.conformance.examples import numpy_float32
from numpy_attention.conformance.kernels import as_kernel
from numpy_attention.conformance.supports import OPTIONS, OUTPUTS
from numpy_attention.oracle import row_blocks as blocks

MAX_SCORES = 2 ** 16            # the grid's cases up to this size (B H N_q N_k)
BLOCKED_BUDGET = 2 ** 12        # blocks.SCORE_BUDGET for the cases run in blocks of rows
BUGS = {"scale_off": scale_off, "causal_shifted": causal_shifted, "dk_negated": dk_negated}


def _grid():
    """(name, arrays, None) of the grid's small cases on the honest kernel, and of the bugs'."""
    grid = [case for case in cases(supports=OPTIONS + OUTPUTS)
            if case.scores <= MAX_SCORES]
    honest = as_kernel(numpy_float32)
    for case in grid[::3]:
        arrays = case.arrays()
        arrays.update(honest.results(arrays, case.outputs))
        yield f"numpy_float32/{case}", arrays, None
    bug_grid = [case for case in cases(supports=("causal", "gqa", "gradients"))
                if case.scores <= MAX_SCORES]
    for i, (name, bug) in enumerate(BUGS.items()):
        for case in bug_grid[i::7]:
            arrays = case.arrays()
            arrays.update(as_kernel(bug).results(arrays, case.outputs))
            yield f"{name}/{case}", arrays, None


def _float64():
    """(name, arrays, budget) of float64 cases (np.longdouble oracle), honest and one off."""
    rng = np.random.default_rng(64)
    q, k, v, dout = (rng.standard_normal((2, 3, 37, 16)) for _ in range(4))
    out, cache = na.attention_forward(q, k, v, causal=True)
    g = na.attention_backward(dout, cache)
    arrays = dict(q=q, k=k, v=v, dout=dout, causal=True, out=out, lse=cache.lse, dq=g.dq, dk=g.dk, dv=g.dv)
    yield "float64/causal", arrays, None
    yield "float64/dv-off", {**arrays, "dv": g.dv * (1 + 1e-12)}, None


def _blocked():
    """(name, arrays, budget) of grid cases judged in blocks of rows: the tiled oracle."""
    grid = [case for case in cases(dtypes=("float32", "bfloat16"), supports=("causal", "gqa", "gradients"))
            if 2 * BLOCKED_BUDGET < case.scores <= MAX_SCORES]
    honest = as_kernel(numpy_float32)
    for case in grid[::2]:
        arrays = case.arrays()
        arrays.update(honest.results(arrays, case.outputs))
        yield f"blocked/{case}", arrays, BLOCKED_BUDGET


def _sliced():
    """(name, arrays, budget) of cases of PARALLEL_SCORES scores and more: cut in (batch index,
    kv head) slices for threads (float32's one way; on blocks of rows, the term magnitudes)."""
    rng = np.random.default_rng(19)
    for precision, storage, budget in (("float32", np.float32, None), ("bfloat16", ml_dtypes.bfloat16, 2 ** 18)):
        q = rng.standard_normal((2, 4, 256, 16)).astype(storage)
        k, v = (rng.standard_normal((2, 2, 256, 16)).astype(storage) for _ in range(2))
        dout = rng.standard_normal(q.shape).astype(storage)
        wide = [x.astype(np.float64) for x in (q, k, v, dout)]
        out, cache = na.attention_forward(*wide[:3], causal=True)
        g = na.attention_backward(wide[3], cache)
        arrays = dict(q=q, k=k, v=v, dout=dout, causal=True, out=out.astype(storage), dq=g.dq.astype(storage),
                      dk=g.dk.astype(storage), dv=(g.dv * (1 + 3e-3)).astype(storage))
        yield f"sliced/{precision}", arrays, budget


def report_cases():
    """[(name, arrays, SCORE_BUDGET or None)]: the fixed set, in order."""
    return list(_grid()) + list(_float64()) + list(_blocked()) + list(_sliced())


def _value(x):
    """A report field as a plain value: floats by repr (nan, inf too), tuples as lists."""
    if isinstance(x, (bool, str)) or x is None:
        return x
    if isinstance(x, (tuple, list)):
        return [_value(item) for item in x]
    if isinstance(x, (int, np.integer)):
        return int(x)
    return repr(float(x))


def report_record(arrays, budget, **settings):
    """The report of crosscheck(**arrays, **settings) (blocks.SCORE_BUDGET = budget when
    given) as a dict of plain values, and its text."""
    saved = blocks.SCORE_BUDGET
    blocks.SCORE_BUDGET = budget or saved
    try:
        report = na.crosscheck(**arrays, **settings)
    finally:
        blocks.SCORE_BUDGET = saved
    return {"passed": bool(report), "oracle_dtype": report.oracle_dtype,
            "baseline_dtype": report.baseline_dtype, "diagnosis": list(report.diagnosis),
            "rows": [{field: _value(value) for field, value in row._asdict().items()} for row in report.rows],
            "text": str(report)}
