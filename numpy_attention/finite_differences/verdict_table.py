"""The verdict and the table: one row per checked input, then one per input not checked.

Verdict per input: max |analytic - numeric| <= atol + rtol * scale, scale = the largest
|entry| of either (a normwise criterion: one tiny entry cannot fail or pass the check).
A NaN on one side only is an infinite error; NaN on both sides agrees.

    print(report)       gradcheck  method=complex  mode=full  dtype=float64  ...  -> PASS
                        note: the forward took one perturbed input at a time ...  if so (batched=None)
                        input  max abs err max rel err  worst index (out, in)        analytic ...
                        x         1.27e-10    9.53e-11  ((4,1),(4,0))             -5.2920e-01 ...
                        index  skipped: an array of int64, not floating-point (or complex)
    bool(report)        True iff every checked row passed

The worst index is (output index, input index) of the Jacobian entry in full mode and
(projection number,) in projection mode. Every line fits in WIDTH columns (a longer note or
hint wraps), unless an input's name or index is too long for its column.
"""
import math
import textwrap
from typing import NamedTuple, Optional

import numpy as np

WORST_INDEX_LABELS = {"full": "worst index (out, in)", "projection": "worst index (projection)"}
WIDTH = 100                 # the widest line of a report


class GradcheckError(AssertionError):
    """Raised by gradcheck(..., raise_on_failure=True); its message is the report table."""


class CheckRow(NamedTuple):
    name: str               # which input
    check: str              # "jacobian" (full mode) or "projection"
    max_abs_err: float      # max |analytic - numeric|
    max_rel_err: float      # max_abs_err / scale
    worst_index: tuple      # (output index, input index) in full mode, (projection number,) otherwise
    analytic: float         # the analytic value at worst_index
    numeric: float          # the numeric value at worst_index
    tol: float              # atol + rtol * scale: the bound max_abs_err was held to
    passed: bool


class GradcheckReport(NamedTuple):
    rows: list
    method: str
    mode: str
    eps: float
    rtol: float
    atol: Optional[float]   # None: the default roundoff floor (differences.py)
    dtype: str
    batching: Optional[str] = None   # full mode: "vectorized", "looped" (batched=False), or which
                                     # functions took one entry at a time as they take no stack, the
                                     # note under the header (batching.summary); None in projection mode
    hints: tuple = ()                # lines printed under the table: likely causes of a failure
    check: str = "gradcheck"         # which check made it: "gradcheck" or "jvpcheck"
    skipped: tuple = ()              # (name, why) of each input not checked, e.g. an integer array

    def __bool__(self):
        return all(row.passed for row in self.rows)

    def _header(self):
        """The settings and the verdict; then, if some function took one entry at a time though the
        caller let the check stack them, that."""
        atol = "floor" if self.atol is None else f"{self.atol:g}"
        head = (f"{self.check}  method={self.method}  mode={self.mode}  dtype={self.dtype}  "
                f"h={self.eps:g}  rtol={self.rtol:g}  atol={atol}  -> {'PASS' if self else 'FAIL'}")
        said = self.batching not in (None, "vectorized", "looped")
        return [head] + ([f"note: {self.batching}"] if said else [])

    def __str__(self):
        first = max([len("input")] + [len(row.name) for row in self.rows] +
                    [len(name) for name, _ in self.skipped]) + 2            # the width of the names
        label = WORST_INDEX_LABELS[self.mode]
        table = [f"{'input':<{first}}{'max abs err':>11}{'max rel err':>12}  {label:<25}"
                 f"{'analytic':>12}{'numeric':>12}{'tol':>8}  ok"]
        for row in self.rows:
            index = str(row.worst_index).replace(" ", "")                        # ((0,1,2),(0,1))
            table.append(f"{row.name:<{first}}{row.max_abs_err:>11.2e}{row.max_rel_err:>12.2e}  {index:<25}"
                         f"{row.analytic:>12.4e}{row.numeric:>12.4e}{row.tol:>8.1e}  "
                         f"{'yes' if row.passed else 'NO'}")
        table += [f"{name:<{first}}skipped: {why}" for name, why in self.skipped]
        return "\n".join(wrapped(self._header()) + table + wrapped(f"hint: {hint}" for hint in self.hints))


def wrapped(texts):
    """The lines of each text, wrapped at WIDTH columns."""
    return [line for text in texts for line in textwrap.wrap(text, WIDTH, break_on_hyphens=False)]


def largest(a):
    """max |a| of a float64 array, NaN counted as 0 (np.fmax skips it) and inf as the largest
    float64 (as np.nan_to_num would count them)."""
    return min(float(np.fmax.reduce(np.abs(a), axis=None, initial=0.0)), float(np.finfo(float).max))


def compare(name, check, analytic, numeric, index_of, rtol, atol):
    """One report row: the normwise verdict max |analytic - numeric| <= atol + rtol * scale, and
    the worst entry (or, when there is no error at all, the largest numeric entry)."""
    analytic, numeric = np.asarray(analytic, dtype=float), np.asarray(numeric, dtype=float)
    err = np.abs(analytic - numeric)
    if np.isnan(err).any():                  # NaN on both sides agrees (0), on one side is inf
        nan_mismatch = np.isnan(analytic) != np.isnan(numeric)
        err = np.where(np.isnan(analytic) & np.isnan(numeric), 0.0, err)
        err = np.where(nan_mismatch, np.inf, err)
    scale = max(largest(analytic), largest(numeric))
    exact = not np.max(err) > 0                                   # (err is never empty)
    worst = int(np.argmax(np.abs(np.nan_to_num(numeric)) if exact else err))
    max_abs = float(err.flat[worst])
    tol = atol + rtol * scale
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return CheckRow(name, check, max_abs, rel, index_of(worst), float(analytic.flat[worst]),
                    float(numeric.flat[worst]), tol, bool(max_abs <= tol))


def non_analytic_hint(row, method, analytic, numeric):
    """A hint for a failed complex-step row whose numeric derivative is exactly 0 everywhere while
    the (finite) analytic one is not: Im f(x + i h e) = 0 means the forward dropped the imaginary
    part. None otherwise (a gradient that is zero, to rounding, passes and needs no hint)."""
    if method != "complex" or row.passed or np.any(numeric != 0) or not np.all(np.isfinite(analytic)):
        return None
    return (f"{row.name}: complex step saw a derivative of exactly 0 everywhere, the backward did not "
            f"(up to {largest(analytic):.1e}). Either the forward is not analytic in {row.name}: it "
            f"drops the imaginary part of x + i h e (np.abs, .real, a float cast, np.maximum, a "
            f"comparison), so check it with method='central' or 'richardson'; or the true derivative "
            f"is 0 and the backward's is rounding: give an atol above it.")
