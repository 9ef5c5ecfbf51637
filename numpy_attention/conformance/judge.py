"""One case judged: the kernel's results on it, held to the oracle by crosscheck.

    report = check(kernel, case)            # a CrosscheckReport; what the kernel raises propagates
    result, arrays = evaluate(kernel, case) # a CaseResult: PASS, FAIL, or ERROR (the kernel raised)

The judged arrays are the case's (grid.draw) with the kernel's results: crosscheck's keyword
arguments, what save_case writes and `numpy-attention crosscheck FILE.npz` re-judges.
"""
import math
import time
from typing import NamedTuple

from ..oracle import CaseError, crosscheck
from .grid import ConformCase
from .kernels import as_kernel


class CaseResult(NamedTuple):
    case: ConformCase
    status: str             # 'PASS', 'FAIL' or 'ERROR' (the kernel raised, or its results are malformed)
    report: object          # the CrosscheckReport; None for ERROR
    error: str              # ERROR: the exception's type and first line; else ''
    seconds: float          # the kernel's call and crosscheck

    @property
    def worst(self):
        """(err / bound, tensor): the tensor closest to its bound (1: at it; above: a max-abs
        failure); (nan, '') for an ERROR."""
        if self.report is None:
            return math.nan, ""
        row = max(self.report.rows, key=_share_of_bound)
        return _share_of_bound(row), row.name


def _share_of_bound(row):
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
    str() its table): one test of a pytest parametrize over the grid. kernel: a callable or a
    command line, its kind told from it unless given (kernels.py)."""
    if not isinstance(case, ConformCase):
        raise TypeError(f"case must be a ConformCase (one of conform.cases(...)), got {type(case).__name__}")
    return judged(as_kernel(kernel, kind), case)[1]


def evaluate(kernel, case):
    """(CaseResult, arrays): the case judged, as judged() does. What the kernel raises, and
    crosscheck's refusal of its results (CaseError: a wrong shape, a dtype it cannot read), is an
    ERROR result with the exception's first line, and arrays None; crosscheck's own errors
    propagate (they are not the kernel's)."""
    start = time.perf_counter()
    arrays = case.arrays()
    try:
        arrays.update(kernel.results(arrays, case.outputs))
    except Exception as exc:                  # anything the kernel raises: a row of the report
        return _error(case, exc, start), None
    try:
        report = crosscheck(**arrays)
    except CaseError as exc:                  # results that are not a case: the kernel's too
        return _error(case, exc, start), None
    status = "PASS" if report else "FAIL"
    return CaseResult(case, status, report, "", time.perf_counter() - start), arrays


def _error(case, exc, start):
    """The ERROR CaseResult of an exception: its type and the first line of its message."""
    said = (str(exc).strip().splitlines() or [""])[0]
    error = f"{type(exc).__name__}: {said}" if said else type(exc).__name__
    return CaseResult(case, "ERROR", None, error, time.perf_counter() - start)
