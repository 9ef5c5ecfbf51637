"""One case judged: the kernel's results on it, held to the oracle by crosscheck.

    report = check(kernel, case)            # a CrosscheckReport; what the kernel raises propagates
    result, arrays = evaluate(kernel, case) # a CaseResult: PASS, FAIL, ERROR (the kernel raised,
                                            # exited or died), TIMEOUT (it was stopped)
    other_bits(first, second, where)        # '' where two calls' results hold the same bits

The judged arrays are the case's (grid.draw) with the kernel's results: crosscheck's keyword
arguments, what save_case writes and `numpy-attention crosscheck FILE.npz` re-judges.
"""
import math
import time
from typing import NamedTuple

import numpy as np

from ..oracle import CaseError, crosscheck
from .grid import ConformCase
from .kernels import KernelTimeout, as_kernel, describe


class CaseResult(NamedTuple):
    case: ConformCase
    status: str             # 'PASS', 'FAIL', 'ERROR' (the kernel raised, exited or died, or its
                            # results are malformed) or 'TIMEOUT' (no results within the timeout)
    report: object          # the CrosscheckReport; None for ERROR and TIMEOUT
    error: str              # ERROR, TIMEOUT: what happened, in one line; else ''
    seconds: float          # the kernel's call and crosscheck

    @property
    def worst(self):
        """(err / bound, tensor): the tensor closest to its bound (1: at it; above: a max-abs
        failure); (nan, '') for an ERROR or a TIMEOUT."""
        if self.report is None:
            return math.nan, ""
        row = max(self.report.rows, key=share_of_bound)
        return share_of_bound(row), row.name


def share_of_bound(row):
    """max_abs_err / bound of a TensorVerdict (0 / 0 = 0, x / 0 = inf)."""
    return row.max_abs_err / row.bound if row.bound > 0 else (0.0 if row.max_abs_err == 0 else math.inf)


def judged(kernel, case):
    """(arrays, report): the case's arrays with the kernel's results (a Kernel, kernels.py),
    and crosscheck's CrosscheckReport on them. What the kernel raises propagates."""
    arrays = case.arrays()
    arrays.update(kernel.results(arrays, case.outputs))
    return arrays, crosscheck(**arrays)


def check(kernel, case, kind=None):
    """crosscheck's CrosscheckReport of a kernel on one case of grid.cases (truthy iff it passes;
    str() its table): one test of a pytest parametrize over the grid. kernel: a callable, called
    in this process, or a command line, its kind told from it unless given (kernels.py)."""
    if not isinstance(case, ConformCase):
        raise TypeError(f"case must be a ConformCase (one of conform.cases(...)), got {type(case).__name__}")
    return judged(as_kernel(kernel, kind), case)[1]


def evaluate(kernel, case):
    """(CaseResult, arrays): the case judged, as judged() does, with the case's arrays drawn
    here (what the kernel was given were copies). What the kernel raises (SystemExit too),
    its death in a worker (worker.py), and crosscheck's refusal of its results (CaseError: a
    wrong shape, a dtype it cannot read), is an ERROR result with one line saying what, and
    arrays None; KernelTimeout is a TIMEOUT result. crosscheck's own errors propagate (they
    are not the kernel's), and so does a KeyboardInterrupt."""
    start = time.perf_counter()
    arrays = case.arrays()
    try:
        arrays.update(kernel.results(arrays, case.outputs))
    except (Exception, SystemExit) as exc:    # anything the kernel raises: a row of the report
        return error_result(case, exc, start), None
    try:
        report = crosscheck(**arrays)
    except CaseError as exc:                  # results that are not a case: the kernel's too
        return error_result(case, exc, start), None
    status = "PASS" if report else "FAIL"
    return CaseResult(case, status, report, "", time.perf_counter() - start), arrays


def error_result(case, exc, start):
    """The ERROR (TIMEOUT) CaseResult of an exception (a KernelTimeout), told in one line;
    start: time.perf_counter() when the case began."""
    status = "TIMEOUT" if isinstance(exc, KernelTimeout) else "ERROR"
    error = str(exc) if status == "TIMEOUT" else describe(exc)
    return CaseResult(case, status, None, error, time.perf_counter() - start)


def differing(a, b):
    """'' where a and b hold the same bits (any NaN where a NaN: its payload aside), else what
    differs: the dtype, the shape, or how many entries and the first (-0.0 is not +0.0)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {a.shape} and {b.dtype} {b.shape}"
    bits = lambda x: x.view(f"u{x.dtype.itemsize}") if x.dtype.kind not in "biu" else x
    nan = lambda x: np.isnan(x.astype(np.float64)) if x.dtype.kind not in "biu" else np.zeros(x.shape, bool)
    same = (bits(a) == bits(b)) | (nan(a) & nan(b))
    if same.all():
        return ""
    first = tuple(int(i) for i in np.argwhere(~same)[0])
    return f"{int((~same).sum())} of {a.size} entries differ, the first at {first}"


def other_bits(first, second, where):
    """'' where two calls' results hold the same names and bits, else what differs, `where`."""
    if set(first) != set(second):
        return f"results {sorted(first)} and {sorted(second)} {where}"
    for name in first:
        differ = differing(first[name], second[name])
        if differ:
            return f"{name}: {differ} {where}"
    return ""
