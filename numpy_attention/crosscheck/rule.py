"""The tolerance rule that judges a candidate tensor against the float64 oracle.

FlashAttention's rule (its tests compare a kernel with a reference "at least as
accurate as PyTorch's naive implementation in the same dtype"):

    err(x)  = max |x - oracle|                         max-abs error, NaN-aware
    PASS   iff   err(candidate) <= k * err(baseline) + atol
    and, in a 16- or 8-bit precision, also
                 ||candidate - oracle||_2 <= K_L2 * ||baseline - oracle||_2 + atol

- oracle: attention computed in float64 (np.longdouble for a float64 precision) on
  the values the kernel read.
- baseline: an honest implementation at the case's precision (precision.py): the
  naive one (every sum left to right) in float32 and float64, the recipe in float16,
  bfloat16 and float8 (the largest error of its ways of computing).
- k: 2 for `out` and `lse`, 3 for the gradients (FlashAttention's factors).
- the normwise check (K_L2 = 2) catches what the max-abs one cannot see in a low
  precision: an error spread over the whole tensor (a scale off by 1%) that no single
  entry shows above bfloat16's rounding.
- atol, in float32 / float64: ATOL_ULPS * eps(dtype) * M, four units in the last
  place of M, the largest sum of absolute terms behind one entry of the tensor
  (magnitudes.py, term_magnitudes; max|oracle| when judge is called alone). It keeps a
  lucky baseline (an error of 0 where a gradient cancels to exactly 0, or 1 ulp on a
  tiny tensor) from failing a candidate that rounds once more. In float16, bfloat16
  and float8, where the baseline's rounding errors are large and never lucky, half
  an ulp of the tensor's largest entry, eps(dtype) / 2 * max|oracle|:

      dtype      eps        atol
      float64    2.2e-16    4 * 2.2e-16 * M     (np.longdouble oracle)
      float32    1.2e-07    4 * 1.2e-07 * M
      float16    9.8e-04    9.8e-04 / 2 * max|oracle|
      bfloat16   7.8e-03    7.8e-03 / 2 * max|oracle|

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

import ml_dtypes
import numpy as np

K_DEFAULT = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0, "dbias": 3.0, "dsinks": 3.0,
             "dalibi_slopes": 3.0, "out_dot": 3.0, "lse_dot": 3.0}
ATOL_ULPS = 4
K_L2 = 2.0


class TensorVerdict(NamedTuple):
    name: str               # "out", "lse", "dq", ...
    dtype: str              # the candidate tensor's dtype
    max_abs_err: float      # err(candidate) = max |candidate - oracle|
    rel_l2_err: float       # ||candidate - oracle||_2 / ||oracle||_2
    l2_ratio: float         # ||candidate - oracle||_2 / ||baseline - oracle||_2
    l2_k: float             # the normwise check's factor (nan: not applied)
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
    diagnosis: tuple = ()   # lines naming the convention mix-up a failing candidate matches

    def __bool__(self):
        return all(row.passed for row in self.rows)

    def __str__(self):
        normwise = any(not math.isnan(r.l2_k) for r in self.rows)
        rule = "max abs err <= k * baseline err + atol" + (
            " and L2 err <= L2 k * baseline L2 err + atol" if normwise else "")
        head = (f"crosscheck: oracle {self.oracle_dtype}, baseline {self.baseline_dtype}; "
                f"PASS iff {rule}  -> {'PASS' if self else 'FAIL'}")
        l2 = f"{'L2 ratio':>9}" if normwise else ""
        cols = (f"{'tensor':<14}{'dtype':<9}{'max abs err':>12}{'rel L2 err':>12}{l2}{'baseline':>11}"
                f"{'ratio':>9}{'k':>4}{'bound':>11}  {'worst index':<20}{'verdict'}")
        lines = [head, cols]
        for r in self.rows:
            l2 = f"{r.l2_ratio:>9.3g}" if normwise else ""
            lines.append(f"{r.name:<14}{r.dtype:<9}{r.max_abs_err:>12.3e}{r.rel_l2_err:>12.3e}{l2}"
                         f"{r.baseline_err:>11.3e}{r.ratio:>9.3g}{r.k:>4g}{r.bound:>11.3e}  "
                         f"{str(r.worst_index):<20}{'PASS' if r.passed else 'FAIL'}")
        lines += [f"diagnosis: {line}" for line in self.diagnosis]
        return "\n".join(lines)

    def to_json(self):
        """The report as a JSON string (infinities as the strings "inf" / "-inf")."""
        finite = lambda x: x if not isinstance(x, float) or math.isfinite(x) else str(x)
        rows = [{key: finite(value) for key, value in row._asdict().items()} for row in self.rows]
        return json.dumps({"passed": bool(self), "oracle_dtype": self.oracle_dtype,
                           "baseline_dtype": self.baseline_dtype, "tensors": rows,
                           "diagnosis": list(self.diagnosis)}, indent=2)


def abs_errors(x, ref):
    """|x - ref| entrywise in ref's precision, NaN-aware (module docstring); shapes must match."""
    x = np.asarray(x).astype(ref.dtype)
    same = (x == ref) | (np.isnan(x) & np.isnan(ref))            # also equal infinities
    with np.errstate(invalid="ignore"):
        diff = np.abs(x - ref)
    return np.where(same, 0, np.where(np.isnan(diff), np.inf, diff))


def atol_for(dtype, magnitude):
    """ATOL_ULPS * eps(dtype) * magnitude."""
    return float(ATOL_ULPS * ml_dtypes.finfo(dtype).eps * magnitude)


def judge(name, candidate, oracle, baseline, *, k=None, atol=None, dtype=None, l2_k=None,
          baseline_oracle=None):
    """One TensorVerdict: err(candidate) <= k * err(baseline) + atol (and the normwise check).

    Args:
        candidate: an array of the oracle's shape (any float or ml_dtypes dtype); for
            "lse", +inf counts as -inf where the oracle is -inf.
        oracle: the reference in a wider dtype.
        baseline: an array of the oracle's shape, or a list of them: err(baseline) is then
            the largest of their errors (max-abs and L2 alike).
        k: default K_DEFAULT[name] (3 for a name it does not know).
        atol: default atol_for(dtype, max|oracle| over its finite entries).
        dtype: the candidate's dtype as reported and for atol (default candidate.dtype;
            a converted candidate, e.g. an lse in base 2, names its own).
        l2_k: the normwise check's factor (K_L2 in a 16- or 8-bit precision); None: no
            normwise check.
        baseline_oracle: what the baseline's error is measured against, when it is not the
            candidate's oracle (crosscheck's own_forward: the candidate's gradients against
            the backward of its own forward, the baseline's against the true gradients).
    """
    candidate, oracle = np.asarray(candidate), np.asarray(oracle)
    baselines = [np.asarray(b) for b in (baseline if isinstance(baseline, list) else [baseline])]
    dtype = candidate.dtype if dtype is None else np.dtype(dtype)
    if any(x.shape != oracle.shape for x in [candidate] + baselines):
        raise ValueError(f"judge({name!r}): candidate, oracle and baseline must have one shape, got "
                         f"{candidate.shape}, {oracle.shape} and {', '.join(str(b.shape) for b in baselines)}")
    if name == "lse":                    # FlashAttention's +inf for a fully masked row (docstring)
        candidate = np.where(np.isneginf(oracle) & np.isposinf(candidate.astype(np.float64)),
                             -np.inf, candidate.astype(np.float64))
    k = K_DEFAULT.get(name, 3.0) if k is None else float(k)
    if atol is None:
        atol = atol_for(dtype, np.max(np.abs(oracle[np.isfinite(oracle)]), initial=0))
    err = abs_errors(candidate, oracle)
    base_errs = [abs_errors(b, oracle if baseline_oracle is None else np.asarray(baseline_oracle))
                 for b in baselines]
    base = max(float(np.max(b, initial=0.0)) for b in base_errs)
    worst = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else ()
    max_err = float(err[worst]) if err.size else 0.0
    err_norm, base_norm = _norm(err), max(_norm(b) for b in base_errs)
    ref_norm, cand_norm = _norm(oracle), _norm(candidate.astype(np.float64))
    # relative to the oracle's norm; where the oracle is all 0, to the candidate's (1: all wrong)
    norm = ref_norm if ref_norm > 0 else cand_norm
    rel = err_norm / norm if norm > 0 else (0.0 if err_norm == 0 else math.inf)
    ratio = max_err / base if base > 0 else (0.0 if max_err == 0 else math.inf)
    l2_ratio = err_norm / base_norm if base_norm > 0 else (0.0 if err_norm == 0 else math.inf)
    bound = k * base + atol
    normwise_ok = l2_k is None or err_norm <= l2_k * base_norm + atol
    return TensorVerdict(name=name, dtype=str(dtype), max_abs_err=max_err, rel_l2_err=rel,
                         l2_ratio=l2_ratio, l2_k=math.nan if l2_k is None else float(l2_k),
                         baseline_err=base, ratio=ratio, k=k, atol=atol,
                         bound=bound, worst_index=tuple(int(i) for i in worst),
                         candidate=float(candidate[worst]) if err.size else 0.0,
                         oracle=float(oracle[worst]) if err.size else 0.0,
                         passed=bool(max_err <= bound and normwise_ok))


def _norm(x):
    """||x||_2 over the finite entries, in float64 (an infinite error shows in max_abs_err)."""
    x = np.asarray(x).astype(np.float64)
    return float(np.sqrt(np.sum(np.where(np.isfinite(x), x, 0) ** 2)))
