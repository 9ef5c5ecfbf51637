"""The tolerance rule that judges a candidate tensor against the float64 oracle.

FlashAttention's rule (its tests compare a kernel with a reference "at least as
accurate as PyTorch's naive implementation in the same dtype"):

    err(x)  = max |x - oracle|                         max-abs error, NaN-aware
    PASS   iff   err(candidate) <= k * err(baseline) + atol
    and, in a 16- or 8-bit precision, also
      normwise   ||candidate - oracle||_2 <= K_L2 * ||baseline - oracle||_2 + atol
      row-wise   err(row of candidate) <= k * max(err(row of baseline), rms(baseline - oracle)) + atol
      scale      |a(candidate)| <= k * max(|a(baseline)|, s(baseline)) + eps(T) / 2
                                   (+ eps(T) / 2 ||u||_1 / ||u||_2^2 for lse)

- oracle: attention computed in float64 (np.longdouble for a float64 precision) on
  the values the kernel read.
- baseline: an honest implementation at the case's precision (precision.py): the
  naive one (head-width sums left to right, long sums in chunks; naive.py) in float32 and
  float64, the recipe in float16, bfloat16 and float8 (the largest error of its ways of
  computing).
- several baselines: each check takes the largest of their errors (the max-abs error, the
  L2 norm, each row's error and the rms floor, the scale check's spread, and s(baseline),
  past eps(T) / 2 of which the scale check is not applied), and atol does not depend on
  them: so every bound only grows as baselines are added, and a candidate that passes
  against some of them passes against all of them (crosscheck judges against the recipe's
  first forward, runs.ways_by_forward, and computes the other ways only when a tensor fails).
  Except where an added baseline is not finite and the oracle is: its bound, infinite,
  judges nothing (below); crosscheck leaves such a way out while another computes the tensor.
- k: 2 for `out` and `lse`, 3 for the gradients (FlashAttention's factors).
- the normwise check (K_L2 = 2) catches what the max-abs one cannot see in a low
  precision: an error spread over the whole tensor that no single entry shows above
  bfloat16's rounding.
- the row-wise check holds each row (the last axis: one query's out or dq, one key's dk
  or dv) to the baseline's error in that row, floored at the baseline's root mean square
  error over the tensor (a row where the baseline happens to round exactly): one wrong
  entry then shows against its own row, not against the tensor's worst rounding.
- the scale check measures the error along the direction a wrong softmax scale moves the
  result, u = d oracle / d log(scale) (the oracle rerun at scale * (1 + 2^-20)):
      a(e) = <e, u> / ||u||^2          the relative scale error the error e amounts to
      s(e) = ||e * u||_2 / ||u||^2     what a(e) would be if e's signs were random
  A baseline way that holds the scale in T on purpose (MLX's rounds it) has a(baseline)
  measured from that scale error, which eps(T) / 2 below allows.
  A scale off by 1% is a 1% shift along u for every entry at once, about one bfloat16
  ulp, hidden in the rounding of each entry but not in a(e). eps(T) / 2 allows a kernel
  that holds the scale in its compute dtype T, rounded once (JAX multiplies bfloat16
  scores by the scale in bfloat16). An lse may be off by eps(T) / 2 in every row, what a
  kernel that sums its softmax weights rounded to T makes of the sum's log (the recipe
  sums them in float32, so its spread along u does not show it): along u that is
  eps(T) / 2 ||u||_1 / ||u||_2^2. Where s(baseline) exceeds eps(T) / 2, the rounding
  along u hides a scale error of that size and a(e) is rounding noise; the check is not
  applied there (scores near 0, that the scale barely moves: q nearly orthogonal to its keys).
- atol, in float32 / float64: ATOL_ULPS * eps(dtype) * M, four units in the last
  place of M, the largest sum of absolute terms behind one entry of the tensor
  (magnitudes.py, term_magnitudes; max|oracle| when judge is called alone). It keeps a
  lucky baseline (an error of 0 where a gradient cancels to exactly 0, or 1 ulp on a
  tiny tensor) from failing a candidate that rounds once more. In float16, bfloat16
  and float8, where the baseline's rounding errors are large and seldom lucky, half
  an ulp of the tensor's largest entry, eps(dtype) / 2 * max|oracle|, but at least
  the rounding of the kernel's float32 sums, 4 * eps(float32) * M (crosscheck, verdicts.py:
  a tensor that is exactly 0, dq and dk with one key in each row, is rounding noise in
  every kernel and exactly 0 in the baseline):

      dtype      eps        atol
      float64    2.2e-16    4 * 2.2e-16 * M     (np.longdouble oracle)
      float32    1.2e-07    4 * 1.2e-07 * M
      float16    9.8e-04    max(9.8e-04 / 2 * max|oracle|, 4 * 1.2e-07 * M)
      bfloat16   7.8e-03    max(7.8e-03 / 2 * max|oracle|, 4 * 1.2e-07 * M)

  and for a float32 lse of a 16- or 8-bit kernel max(eps(float32) / 2 * max|lse|, eps(T) / 2,
  4 * 1.2e-07 * M): a kernel that sums its softmax weights rounded to T (torch's CPU flash
  kernel in float16) has an lse off by up to eps(T) / 2, however small the lse.

Fully masked rows of lse: where the oracle's lse is -inf (a query row with every key
masked), a candidate lse of +inf passes as well as -inf. Both conventions exist:
log(sum of no terms) = -inf is ours and torch's, while FlashAttention 2 writes +inf
there in its non-split kernels (softmax.h: `(sum == 0.f || sum != sum) ? (Split ?
-INFINITY : INFINITY) : ...`), so that a later exp(S - lse) gives 0.

NaN-aware both ways: an entry where exactly one of (candidate, oracle) is NaN,
or where they are different infinities, has error inf; entries where both are
NaN, or both the same infinity, have error 0: where the oracle is not finite the
candidate must match it entry for entry. A bound that is not finite while the oracle
has finite entries (a baseline NaN or infinite where the oracle is finite, or an
infinite atol) judges nothing: the verdict fails with "cannot judge", and crosscheck
refuses such a case (a CaseError), since no kernel can be held to it.
"""
import json
import math
import textwrap
from typing import NamedTuple

import ml_dtypes
import numpy as np

from ..options import GRADIENTS

K_DEFAULT = {"out": 2.0, "lse": 2.0, "max_logits": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0, **{name: 3.0 for name in GRADIENTS},
             "out_dot": 3.0, "lse_dot": 3.0}
ATOL_ULPS = 4
K_L2 = 2.0
WIDTH = 100                     # the report's longest line


class TensorVerdict(NamedTuple):
    name: str               # "out", "lse", "dq", ...
    dtype: str              # the candidate tensor's dtype
    max_abs_err: float      # err(candidate) = max |candidate - oracle|
    rel_l2_err: float       # ||candidate - oracle||_2 / ||oracle||_2 (norms over the finite errors)
    l2_ratio: float         # ||candidate - oracle||_2 / ||baseline - oracle||_2 (the same)
    l2_k: float             # the normwise check's factor (nan: not applied)
    row_ratio: float        # max over rows of err(row) / max(err(baseline's row), rms baseline err)
    scale_err: float        # a(candidate): the relative scale error its error amounts to
    scale_bound: float      # the scale check's bound (nan: not applied)
    baseline_err: float     # err(baseline) = max |baseline - oracle|
    ratio: float            # max_abs_err / baseline_err (FlashAttention compares it with k)
    k: float
    atol: float
    bound: float            # k * baseline_err + atol
    worst_index: tuple      # where |candidate - oracle| is largest
    candidate: float        # the candidate's value there
    oracle: float           # the oracle's value there
    passed: bool
    failed: tuple = ()      # each failed check with its numbers, e.g. "row ratio 12.4 > k 3",
                            # "16 of 16 entries NaN where the oracle is finite"
    nans: int = 0           # entries NaN in the candidate where the oracle is finite
    infs: int = 0           # entries infinite in the candidate where the oracle is finite
    baseline_way: str = ""  # the baseline (of several: the recipe's ways) whose error is err(baseline)


class CrosscheckReport(NamedTuple):
    rows: list              # one TensorVerdict per candidate tensor
    oracle_dtype: str
    baseline_dtype: str
    diagnosis: tuple = ()   # lines naming the convention mix-up a failing candidate matches

    def __bool__(self):
        return all(row.passed for row in self.rows)

    def __str__(self):
        """The verdict and the rule; a table of the max-abs check, one of the low-precision
        checks (in a 16- or 8-bit precision), one of each tensor's worst entry; then what each
        failing tensor failed by, and the diagnosis, wrapped at WIDTH (the tables fit it)."""
        low = any(not math.isnan(r.l2_k) for r in self.rows)          # a 16- or 8-bit precision
        width = lambda texts: 2 + max(len(text) for text in texts)      # a column that fits them
        n = width(["tensor"] + [r.name for r in self.rows])
        d = width(["dtype"] + [r.dtype for r in self.rows])
        lines = [f"crosscheck: oracle {self.oracle_dtype}, baseline {self.baseline_dtype}"
                 f"  -> {'PASS' if self else 'FAIL'}",
                 "PASS iff max abs err <= k * baseline err + atol"
                 + ("; also by L2 norm, by row and along a scale change" if low else ""),
                 f"{'tensor':<{n}}{'dtype':<{d}}{'max abs err':>11}{'rel L2 err':>12}{'baseline':>11}"
                 f"{'ratio':>9}{'k':>4}{'bound':>11}  verdict"]
        for r in self.rows:
            rel = _nonfinite(r) or f"{r.rel_l2_err:.3e}"
            lines.append(f"{r.name:<{n}}{r.dtype:<{d}}{r.max_abs_err:>11.3e} {rel:>11}{r.baseline_err:>11.3e}"
                         f"{r.ratio:>9.3g}{r.k:>4g}{r.bound:>11.3e}  {'PASS' if r.passed else 'FAIL'}")
        if low:
            lines.append(f"{'tensor':<{n}}{'L2 ratio':>10}{'row ratio':>11}{'scale err':>11}"
                         f"{'scale bound':>13}  baseline way")
            for r in self.rows:
                l2_ratio = _nonfinite(r) or f"{r.l2_ratio:.3g}"
                lines.append(f"{r.name:<{n}}{l2_ratio:>10}{r.row_ratio:>11.3g}{r.scale_err:>+11.2e}"
                             f"{r.scale_bound:>13.2e}  {r.baseline_way}")
        lines.append(f"{'tensor':<{n}}{'candidate':>16}{'oracle':>16}  worst index")
        lines += [f"{r.name:<{n}}{r.candidate:>16.8g}{r.oracle:>16.8g}  {r.worst_index}" for r in self.rows]
        for r in self.rows:
            if r.failed:                        # its failed checks, "; " between, none split
                lines.append(f"{r.name} FAIL: {r.failed[0]}")
                for check in r.failed[1:]:
                    if len(lines[-1]) + len(f"; {check};") <= WIDTH:      # room for a ";" after it
                        lines[-1] += f"; {check}"
                    else:
                        lines[-1] += ";"
                        lines.append(f"    {check}")
        for line in self.diagnosis:
            lines += textwrap.wrap(f"diagnosis: {line}", WIDTH, subsequent_indent="    ",
                                   break_on_hyphens=False)
        return "\n".join(lines)

    def to_json(self):
        """The report as a JSON string, standard JSON: a number that is not a number (a check
        not applied: l2_k, row_ratio, scale_err, scale_bound outside a 16- or 8-bit precision;
        NaN entries) is null, infinities are the strings "inf" / "-inf"."""
        finite = lambda x: (x if not isinstance(x, float) or math.isfinite(x)
                            else None if math.isnan(x) else str(x))
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
          baseline_oracle=None, rows=False, scale_direction=None, scale_tol=0.0, scale_atol=0.0,
          baseline_names=None, scale_offsets=None):
    """One TensorVerdict: err(candidate) <= k * err(baseline) + atol (and the low-precision checks).

    Args:
        candidate: an array of the oracle's shape (any float or ml_dtypes dtype); for
            "lse", +inf counts as -inf where the oracle is -inf.
        oracle: the reference in a wider dtype.
        baseline: an array of the oracle's shape, or a list of them: err(baseline) is then
            the largest of their errors (in every check; each bound grows with the list).
        k: default K_DEFAULT[name] (3 for a name it does not know).
        atol: default atol_for(dtype, max|oracle| over its finite entries).
        dtype: the candidate's dtype as reported and for atol (default candidate.dtype;
            a converted candidate, e.g. an lse in base 2, names its own).
        l2_k: the normwise check's factor (K_L2 in a 16- or 8-bit precision); None: no
            normwise check.
        baseline_oracle: what the baseline's error is measured against, when it is not the
            candidate's oracle (crosscheck's own_forward: the candidate's gradients against
            the backward of its own forward, the baseline's against the true gradients).
        rows: apply the row-wise check (module docstring).
        scale_direction: u = d oracle / d log(scale), of the oracle's shape: apply the scale
            check, with scale_tol added to its bound (and, when > 0, the largest s(baseline) at
            which the check applies), and scale_atol's projection along u, the error it allows
            in every entry. None: no scale check.
        baseline_names: a name for each baseline: the verdict's baseline_way is the one
            whose max-abs error err(baseline) is (default: none named).
        scale_offsets: each baseline's own relative scale error, made on purpose (a way that
            holds the scale in T, which scale_tol allows): the scale check measures a(baseline)
            from it (default: all 0).
    """
    candidate, oracle = np.asarray(candidate), np.asarray(oracle)
    baselines = [np.asarray(b) for b in (baseline if isinstance(baseline, list) else [baseline])]
    dtype = candidate.dtype if dtype is None else np.dtype(dtype)
    shapes = [candidate] + baselines + ([] if scale_direction is None else [np.asarray(scale_direction)])
    if any(x.shape != oracle.shape for x in shapes):
        raise ValueError(f"judge({name!r}): candidate, oracle, baseline and scale_direction must have "
                         f"one shape, got {candidate.shape}, {oracle.shape} and "
                         f"{', '.join(str(x.shape) for x in shapes[1:])}")
    if name == "lse":                    # FlashAttention's +inf for a fully masked row (docstring)
        candidate = np.where(np.isneginf(oracle) & np.isposinf(candidate.astype(np.float64)),
                             -np.inf, candidate.astype(np.float64))
    k = K_DEFAULT.get(name, 3.0) if k is None else float(k)
    if atol is None:
        atol = atol_for(dtype, np.max(np.abs(oracle[np.isfinite(oracle)]), initial=0))
    base_oracle = oracle if baseline_oracle is None else np.asarray(baseline_oracle)
    err = abs_errors(candidate, oracle)
    base_errs = [abs_errors(b, base_oracle) for b in baselines]
    base_maxima = [float(np.max(b, initial=0.0)) for b in base_errs]
    base = max(base_maxima)
    way = "" if baseline_names is None else baseline_names[base_maxima.index(base)]
    finite, as_float = np.isfinite(oracle), candidate.astype(np.float64)
    nans, infs = int(np.sum(np.isnan(as_float) & finite)), int(np.sum(np.isinf(as_float) & finite))
    worst = np.unravel_index(int(np.argmax(err)), err.shape) if err.size else ()
    max_err = float(err[worst]) if err.size else 0.0
    base_norms = [_norm(b) for b in base_errs]
    err_norm, base_norm = _norm(err), max(base_norms)
    l2_ratio = _ratio(err_norm, base_norm)
    ref_norm, cand_norm = _norm(oracle), _norm(as_float)
    # relative to the oracle's norm; where the oracle is all 0, to the candidate's (1: all wrong)
    norm = ref_norm if ref_norm > 0 else cand_norm
    rel = err_norm / norm if norm > 0 else (0.0 if err_norm == 0 else math.inf)
    bound = k * base + atol
    row_ratio, row_ok = _row_check(err, base_errs, base_norms, k, atol) if rows else (math.nan, True)
    scale_err, scale_bound = math.nan, math.nan
    if scale_direction is not None:
        scale_err, scale_bound = _scale_check(candidate, oracle, baselines, base_oracle,
                                              np.asarray(scale_direction), k, scale_tol, scale_atol,
                                              scale_offsets or [0.0] * len(baselines))
    failed = []                          # each failed check, in words and numbers
    if not math.isfinite(bound) and finite.any():
        failed.append(unjudgeable(bound, base, atol))
    elif not max_err <= bound:           # said by its non-finite entries if it has any
        failed += [f"{count} of {err.size} entries {what} where the oracle is finite"
                   for count, what in ((nans, "NaN"), (infs, "inf")) if count] or [
                   f"max abs err {max_err:.2e} > bound {bound:.2e} ({_ratio(max_err, bound):.3g}x)"]
    if l2_k is not None and not err_norm <= l2_k * base_norm + atol:
        failed.append(f"L2 ratio {l2_ratio:.3g} > {l2_k:g}")
    if not row_ok:
        failed.append(f"row ratio {row_ratio:.3g} > k {k:g}")
    if abs(scale_err) > scale_bound:
        failed.append(f"scale err {scale_err:+.2e} beyond ±{scale_bound:.2e}")
    return TensorVerdict(name=name, dtype=str(dtype), max_abs_err=max_err, rel_l2_err=rel,
                         l2_ratio=l2_ratio,
                         l2_k=math.nan if l2_k is None else float(l2_k), row_ratio=row_ratio,
                         scale_err=scale_err, scale_bound=scale_bound,
                         baseline_err=base, ratio=_ratio(max_err, base), k=k, atol=atol,
                         bound=bound, worst_index=tuple(int(i) for i in worst),
                         candidate=float(candidate[worst]) if err.size else 0.0,
                         oracle=float(oracle[worst]) if err.size else 0.0,
                         passed=not failed, failed=tuple(failed), nans=nans, infs=infs,
                         baseline_way=way)


def unjudgeable(bound, base, atol):
    """The failed check of a tensor whose bound is not finite where its oracle is: nothing can
    be judged against it (a baseline that overflows the precision, an input too large)."""
    why = (f"the baseline's error is {base:g} where the oracle is finite" if not math.isfinite(base)
           else f"atol is {atol:g}")
    return f"cannot judge: the bound is {bound:g} ({why})"


def _ratio(err, base):
    """err / base, with 0 / 0 = 0 and x / 0 = inf."""
    return err / base if base > 0 else (0.0 if err == 0 else math.inf)


def _row_check(err, base_errs, base_norms, k, atol):
    """(the largest row ratio, whether every row passes): the row-wise check of the module
    docstring, rows along the last axis (base_norms: the baselines' _norm)."""
    if err.size == 0:
        return 0.0, True
    rows = np.max(err, axis=-1)
    base_rows = baseline_rows(base_errs, base_norms)
    ratios = np.divide(rows, base_rows, out=np.where(rows > 0, np.inf, 0.0), where=base_rows > 0)
    return float(np.max(ratios)), bool(np.all(rows <= k * base_rows + atol))


def baseline_rows(base_errs, base_norms=None):
    """[...] each row's baseline error for the row-wise check: the largest over the baselines
    of err(row of baseline), floored at rms(baseline - oracle) (module docstring); base_errs:
    the baselines' entrywise errors [..., row length], one shape; base_norms: their norms
    (_norm), if known."""
    norms = [_norm(b) for b in base_errs] if base_norms is None else base_norms
    floor = max(norm / math.sqrt(b.size) for norm, b in zip(norms, base_errs))   # rms(baseline - oracle)
    return np.maximum(np.max([np.max(b, axis=-1) for b in base_errs], axis=0), floor)


def _scale_check(candidate, oracle, baselines, base_oracle, u, k, scale_tol, scale_atol, offsets):
    """(a(candidate), its bound k * max(|a(baseline) - offset|, s(baseline)) + scale_tol + scale_atol
    ||u||_1 / ||u||_2^2, the last what an error of scale_atol in every entry amounts to along
    u): the scale
    check of the module docstring, over the entries where the oracle and u are finite (nan,
    nan where u is 0, a result the scale does not move, or where s(baseline) > scale_tol > 0)."""
    finite = np.isfinite(oracle) & np.isfinite(u) & np.isfinite(base_oracle)
    u = np.where(finite, u, 0).astype(np.float64)
    uu = float(np.sum(u * u))
    if uu == 0:
        return math.nan, math.nan

    def along(x, ref):                  # (a(e), s(e)) of e = x - ref, non-finite entries as 0
        with np.errstate(invalid="ignore", over="ignore"):
            e = np.asarray(x).astype(np.float64) - np.asarray(ref).astype(np.float64)
        e = np.where(finite & np.isfinite(e), e, 0)
        return float(np.sum(e * u)) / uu, _norm(e * u) / uu

    measured = [along(b, base_oracle) for b in baselines]
    if 0 < scale_tol < max(s for _, s in measured):      # rounding along u hides such a scale error
        return math.nan, math.nan
    spread = max(max(abs(a - offset), s) for (a, s), offset in zip(measured, offsets))
    allowed = scale_atol * float(np.sum(np.abs(u))) / uu    # an error of scale_atol in every entry
    return along(candidate, oracle)[0], k * spread + float(scale_tol) + allowed


def _nonfinite(verdict):
    """How many of the candidate's entries are NaN or infinite where the oracle is finite (the
    norms leave them out): "16 NaN", "2 inf", "5 NaN/inf" (3 NaN and 2 inf); "" if none."""
    what = "NaN/inf" if verdict.nans and verdict.infs else "NaN" if verdict.nans else "inf"
    return f"{verdict.nans + verdict.infs} {what}" if verdict.nans or verdict.infs else ""


def _norm(x):
    """||x||_2 over the finite entries, in float64 (an infinite error shows in max_abs_err)."""
    x = np.asarray(x).astype(np.float64)
    return float(np.sqrt(np.sum(np.where(np.isfinite(x), x, 0) ** 2)))
