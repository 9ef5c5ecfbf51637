"""The tolerance rule that judges a candidate tensor against the float64 oracle.

FlashAttention's rule (its tests compare a kernel with a reference "at least as
accurate as PyTorch's naive implementation in the same dtype"):

    err(x)  = max |x - oracle|                         max-abs error, NaN-aware
    PASS   iff   err(candidate) <= k * err(baseline) + atol

- oracle: attention computed in a wider dtype than the candidate's (float64 for
  float32 / float16 candidates, np.longdouble for float64 candidates).
- baseline: the naive implementation (naive.py: every sum left to right) in
  the candidate's dtype, i.e. the error an honest implementation at that
  precision makes.
- k: 2 for `out` and `lse`, 3 for the gradients (FlashAttention's factors).
- atol = ATOL_ULPS * eps(dtype) * M: four units in the last place of M, the
  largest sum of absolute terms behind one entry of the tensor (check.py,
  term_magnitudes; max|oracle| when judge is called alone). It keeps a lucky
  baseline (an error of 0 where a gradient cancels to exactly 0, or 1 ulp on a
  tiny tensor) from failing a candidate that rounds once more:

      dtype      eps        atol
      float16    9.8e-04    4 * 9.8e-04 * M
      float32    1.2e-07    4 * 1.2e-07 * M
      float64    2.2e-16    4 * 2.2e-16 * M     (np.longdouble oracle)

Fully masked rows of lse: where the oracle's lse is -inf (a query row with every key
masked), a candidate lse of +inf passes as well as -inf. Both conventions exist:
log(sum of no terms) = -inf is ours and torch's, while FlashAttention 2 writes +inf
there in its non-split kernels (softmax.h: `(sum == 0.f || sum != sum) ? (Split ?
-INFINITY : INFINITY) : ...`), so that a later exp(S - lse) gives 0.

NaN-aware both ways: an entry where exactly one of (candidate, oracle) is NaN,
or where they are different infinities, has error inf; entries where both are
NaN, or both the same infinity, have error 0.
"""
import json
import math
from typing import NamedTuple

import numpy as np

K_DEFAULT = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0, "dbias": 3.0}
ATOL_ULPS = 4


class TensorVerdict(NamedTuple):
    name: str               # "out", "lse", "dq", ...
    dtype: str              # the candidate tensor's dtype
    max_abs_err: float      # err(candidate) = max |candidate - oracle|
    rel_l2_err: float       # ||candidate - oracle||_2 / ||oracle||_2
    baseline_err: float     # err(baseline) = max |baseline - oracle|
    ratio: float            # max_abs_err / baseline_err (FlashAttention compares it with k)
    k: float
    atol: float
    bound: float            # k * baseline_err + atol
    worst_index: tuple      # where |candidate - oracle| is largest
    candidate: float        # the candidate's value there
    oracle: float           # the oracle's value there
    passed: bool


class CrosscheckReport(NamedTuple):
    rows: list              # one TensorVerdict per candidate tensor
    oracle_dtype: str
    baseline_dtype: str

    def __bool__(self):
        return all(row.passed for row in self.rows)

    def __str__(self):
        head = (f"crosscheck: oracle {self.oracle_dtype}, baseline {self.baseline_dtype}; "
                f"PASS iff max abs err <= k * baseline err + atol  -> {'PASS' if self else 'FAIL'}")
        cols = (f"{'tensor':<7}{'dtype':<9}{'max abs err':>12}{'rel L2 err':>12}{'baseline':>11}"
                f"{'ratio':>9}{'k':>4}{'bound':>11}  {'worst index':<20}{'verdict'}")
        lines = [head, cols]
        for r in self.rows:
            lines.append(f"{r.name:<7}{r.dtype:<9}{r.max_abs_err:>12.3e}{r.rel_l2_err:>12.3e}"
                         f"{r.baseline_err:>11.3e}{r.ratio:>9.3g}{r.k:>4g}{r.bound:>11.3e}  "
                         f"{str(r.worst_index):<20}{'PASS' if r.passed else 'FAIL'}")
        return "\n".join(lines)

    def to_json(self):
        """The report as a JSON string (infinities as the strings "inf" / "-inf")."""
        finite = lambda x: x if not isinstance(x, float) or math.isfinite(x) else str(x)
        rows = [{key: finite(value) for key, value in row._asdict().items()} for row in self.rows]
        return json.dumps({"passed": bool(self), "oracle_dtype": self.oracle_dtype,
                           "baseline_dtype": self.baseline_dtype, "tensors": rows}, indent=2)


def abs_errors(x, ref):
    """|x - ref| entrywise in ref's precision, NaN-aware (module docstring); shapes must match."""
    x = np.asarray(x).astype(ref.dtype)
    same = (x == ref) | (np.isnan(x) & np.isnan(ref))            # also equal infinities
    with np.errstate(invalid="ignore"):
        diff = np.abs(x - ref)
    return np.where(same, 0, np.where(np.isnan(diff), np.inf, diff))


def atol_for(dtype, magnitude):
    """ATOL_ULPS * eps(dtype) * magnitude."""
    return float(ATOL_ULPS * np.finfo(dtype).eps * magnitude)


def judge(name, candidate, oracle, baseline, *, k=None, atol=None):
    """One TensorVerdict: err(candidate) <= k * err(baseline) + atol.

    Args:
        candidate, baseline: arrays of the oracle's shape (any float dtype); for "lse",
            +inf in the candidate counts as -inf where the oracle is -inf.
        oracle: the reference in a wider dtype.
        k: default K_DEFAULT[name] (3 for a name it does not know).
        atol: default atol_for(candidate's dtype, max|oracle| over its finite entries).
    """
    candidate, oracle, baseline = np.asarray(candidate), np.asarray(oracle), np.asarray(baseline)
    if not candidate.shape == oracle.shape == baseline.shape:
        raise ValueError(f"judge({name!r}): candidate, oracle and baseline must have one shape, got "
                         f"{candidate.shape}, {oracle.shape} and {baseline.shape}")
    if name == "lse":                    # FlashAttention's +inf for a fully masked row (docstring)
        candidate = np.where(np.isneginf(oracle) & np.isposinf(candidate), -np.inf, candidate)
    k = K_DEFAULT.get(name, 3.0) if k is None else float(k)
    if atol is None:
        atol = atol_for(candidate.dtype, np.max(np.abs(oracle[np.isfinite(oracle)]), initial=0))
    err = abs_errors(candidate, oracle)
    base = float(np.max(abs_errors(baseline, oracle), initial=0.0))
    worst = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else ()
    max_err = float(err[worst]) if err.size else 0.0
    ref_norm = float(np.sqrt(np.sum(np.where(np.isfinite(oracle), oracle, 0) ** 2)))
    err_norm = float(np.sqrt(np.sum(err.astype(np.float64) ** 2)))
    rel = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
    ratio = max_err / base if base > 0 else (0.0 if max_err == 0 else math.inf)
    bound = k * base + atol
    return TensorVerdict(name=name, dtype=str(candidate.dtype), max_abs_err=max_err,
                         rel_l2_err=rel, baseline_err=base, ratio=ratio, k=k, atol=atol,
                         bound=bound, worst_index=tuple(int(i) for i in worst),
                         candidate=float(candidate[worst]) if err.size else 0.0,
                         oracle=float(oracle[worst]) if err.size else 0.0,
                         passed=bool(max_err <= bound))
