"""The conformance run's report: a table of option x dtype, the shrunk failures, JSON.

    conform: module:function (torch), seed 0: 216 of 216 cases of the grid run in 312 s -> PASS
    option        dtype     cases  passed  errors  worst err/bound  smallest failing case
    plain         float32       7       7       0        0.12 dq
    causal        bfloat16      7       6       0        38 out     bfloat16-causal-b1h1kv1-q2k2-d8-out

One row per cell (grid.py): its cases run, how many passed, how many raised (ERROR), the
worst share of its bound any tensor used (max abs err / bound: 1 is at the bound; a failure
of a 16-bit precision's other checks may fail below 1), and the smallest failing case, shrunk
(shrink.py). Under the table, each failure's tensors with what they failed and the diagnosis
(crosscheck's), and the file it was saved to; then each cell's first error.
"""
import json
import math
from typing import NamedTuple

from .supports import PLAIN

WIDTH_OPTION, WIDTH_DTYPE = 14, 10


class Failure(NamedTuple):
    option: str             # the cell: 'plain' or an option
    dtype: str
    shrunk: object          # shrink.Shrunk: the smallest failing case and its report
    file: object            # the .npz it was saved to, or None
    picture: object         # its error maps' .png, or None


class Cell(NamedTuple):
    option: str
    dtype: str
    cases: int              # run
    passed: int
    errors: int             # ERROR results: the kernel raised
    worst: float            # the largest max abs err / bound of its tensors (nan: none judged)
    worst_tensor: str
    failure: object         # Failure, or None
    error: str              # its first ERROR's case id and line, or ''


class ConformReport(NamedTuple):
    kernel: str             # 'module:function' or the command line
    kind: str               # 'torch', 'jax', 'numpy', 'command'
    seed: int
    dtypes: tuple
    supports: tuple         # the options and outputs swept
    fully_masked: str
    budget: object          # seconds, or None
    grid_size: int          # the grid's cases; results may hold fewer (the budget)
    results: tuple          # judge.CaseResult of each case run, in the sweep's order
    failures: tuple         # Failure of each cell that failed
    seconds: float          # the sweep's time (the budget bounds it)
    shrink_seconds: float   # the shrinks' time, after the sweep

    def __bool__(self):
        return bool(self.results) and all(r.status == "PASS" for r in self.results)

    def cells(self):
        """A Cell per (option, dtype) with a case run, in the grid's order."""
        present = {(r.case.cell, r.case.dtype) for r in self.results}
        keys = [(cell, dtype) for cell in (PLAIN,) + self.supports for dtype in self.dtypes
                if (cell, dtype) in present]
        failures = {(f.option, f.dtype): f for f in self.failures}
        cells = []
        for option, dtype in keys:
            mine = [r for r in self.results if (r.case.cell, r.case.dtype) == (option, dtype)]
            judged = [r for r in mine if r.report is not None]
            worst, tensor = max((r.worst for r in judged), default=(math.nan, ""), key=lambda w: w[0])
            errors = [r for r in mine if r.status == "ERROR"]
            cells.append(Cell(option, dtype, len(mine), sum(r.status == "PASS" for r in mine), len(errors),
                              worst, tensor, failures.get((option, dtype)),
                              f"{errors[0].case.id}: {errors[0].error}" if errors else ""))
        return cells

    def __str__(self):
        cells = self.cells()
        budget = "" if self.budget is None else f" (budget {self.budget:g} s)"
        shrunk = f", {len(self.failures)} shrunk in {self.shrink_seconds:.0f} s" if self.failures else ""
        lines = [f"conform: {self.kernel} ({self.kind}), seed {self.seed}: {len(self.results)} of "
                 f"{self.grid_size} cases of the grid run in {self.seconds:.0f} s{budget}{shrunk} -> "
                 f"{'PASS' if self else 'FAIL'}",
                 f"{'option':<{WIDTH_OPTION}}{'dtype':<{WIDTH_DTYPE}}{'cases':>5}{'passed':>8}{'errors':>8}"
                 f"{'worst err/bound':>17}  smallest failing case"]
        for c in cells:
            worst = "" if math.isnan(c.worst) else f"{c.worst:.2g} {c.worst_tensor}"
            failing = c.failure.shrunk.case.id if c.failure else ""
            lines.append(f"{c.option:<{WIDTH_OPTION}}{c.dtype:<{WIDTH_DTYPE}}{c.cases:>5}{c.passed:>8}"
                         f"{c.errors:>8}{worst:>17}  {failing}".rstrip())
        failing = [c for c in cells if c.failure]
        if failing:
            lines.append("failures, each shrunk to its smallest failing case "
                         "(re-judge one: numpy-attention crosscheck FILE.npz):")
        for c in failing:
            shrunk = c.failure.shrunk
            lines.append(f"  {c.option} {c.dtype}: {shrunk.case.id}  (from {shrunk.original.id}, "
                         f"{shrunk.steps} runs)")
            lines += [f"    {row.name} FAIL: {'; '.join(row.failed)}" for row in shrunk.report.rows
                      if not row.passed]
            lines += [f"    diagnosis: {line}" for line in shrunk.report.diagnosis]
            saved = [path for path in (c.failure.file, c.failure.picture) if path]
            if saved:
                lines.append(f"    saved: {', '.join(saved)}")
        errors = [c for c in cells if c.errors]
        if errors:
            lines.append("errors (the kernel raised, or returned what crosscheck cannot judge):")
        lines += [f"  {c.option} {c.dtype}: {c.errors} of {c.cases} cases, e.g. {c.error}" for c in errors]
        return "\n".join(lines)

    def to_json(self):
        """The report as a JSON string: the settings, one object per cell and one per case run
        (infinities as the strings "inf" / "-inf", NaN as null)."""
        return json.dumps({
            "passed": bool(self), "kernel": self.kernel, "kind": self.kind, "seed": self.seed,
            "dtypes": list(self.dtypes), "supports": list(self.supports), "fully_masked": self.fully_masked,
            "budget": self.budget, "grid_cases": self.grid_size, "cases_run": len(self.results),
            "seconds": self.seconds, "shrink_seconds": self.shrink_seconds,
            "cells": [_cell_json(c) for c in self.cells()],
            "cases": [{"id": r.case.id, "cell": r.case.cell, "dtype": r.case.dtype, "status": r.status,
                       "worst_ratio": _number(r.worst[0]), "worst_tensor": r.worst[1] or None,
                       "error": r.error or None, "seconds": r.seconds} for r in self.results],
        }, indent=2)


def _number(x):
    """A float for JSON: NaN as None, infinities as strings."""
    return None if math.isnan(x) else x if math.isfinite(x) else str(x)


def _cell_json(c):
    failure = None
    if c.failure:
        shrunk = c.failure.shrunk
        failure = {"case": shrunk.case.id, "shrunk_from": shrunk.original.id, "runs": shrunk.steps,
                   "tensors": [{"name": row.name, "failed": list(row.failed)}
                               for row in shrunk.report.rows if not row.passed],
                   "diagnosis": list(shrunk.report.diagnosis),
                   "file": c.failure.file, "picture": c.failure.picture}
    return {"option": c.option, "dtype": c.dtype, "cases": c.cases, "passed": c.passed,
            "failed": c.cases - c.passed - c.errors, "errors": c.errors,
            "worst_ratio": _number(c.worst), "worst_tensor": c.worst_tensor or None,
            "smallest_failing": failure, "error": c.error or None}
