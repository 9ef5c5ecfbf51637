"""The conformance run's report: a table of option x dtype, the shrunk failures, JSON.

    conform: module:function (torch), seed 0
    336 of 336 cases of the grid run in 107 s (budget 600 s, a case at most 60 s) -> PASS
    coverage: every role of every cell run (7 of 7)
    option        dtype     cases  roles  passed  failed  errors  timeouts  worst err/bound
    plain         float32      14    7/7      14       0       0         0       0.12 dq
    causal        bfloat16     14    7/7      13       1       0         0         38 out

One row per cell (grid.py): its cases run, how many of its roles (ROLES) they cover, how many
passed, failed, raised or died (ERROR) or were stopped (TIMEOUT), and the worst share of its
bound any tensor used (max abs err / bound: 1 is at the bound; a failure of a 16-bit
precision's other checks may fail below 1). Under the table, each failing cell's smallest
failing case, shrunk (shrink.py), with the tensors it failed and the diagnosis (crosscheck's, of
the failing case before it was shrunk, or of the shrunk case where that has none),
and where it was saved; then each cell's first error. Every line is at most WIDTH columns.

The verdict: PASS when every case run passed and the run covered every role of every cell;
FAIL when a case did not pass (FAIL, ERROR or TIMEOUT); INCOMPLETE otherwise (a budget too
short, an interrupted run): a kernel is not passed on cases it was not given.
"""
import json
import math
import os
import textwrap
from typing import NamedTuple

from .properties import NEEDS
from .supports import PLAIN

WIDTH = 100                 # the longest line of the report
DRAWN = {"lengths": "its trials' errors against N_k", "batch_invariance": "each sequence's error, judged alone,"}
WIDTH_OPTION, WIDTH_DTYPE = 14, 10
COLUMNS = (("cases", 5), ("roles", 7), ("passed", 8), ("failed", 8), ("errors", 8), ("timeouts", 10),
           ("worst err/bound", 17))


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
    roles_run: int          # of its roles (grid.ROLES), those a case run covered
    roles: int              # its roles in the grid
    passed: int
    failed: int
    errors: int             # ERROR results: the kernel raised, exited or died
    timeouts: int           # TIMEOUT results: the kernel gave no results in time
    worst: float            # the largest max abs err / bound of its tensors (nan: none judged)
    worst_tensor: str
    failure: object         # Failure, or None
    error: str              # its first ERROR's or TIMEOUT's case id and line, or ''


class PropertyRow(NamedTuple):
    property: str
    dtype: str
    tried: int              # trials run
    trials: int             # trials of the run
    passed: int
    failed: int
    errors: int             # ERROR and TIMEOUT results
    smallest: object        # the smallest trial that did not pass (a PropertyResult), or None
    shrunk: object = None   # (the smallest failing trial shrunk: a PropertyResult, the runs it took), or None
    picture: object = None  # the .png its failures are drawn in, or None


class ConformReport(NamedTuple):
    kernel: str             # 'module:function' or the command line
    kind: str               # 'torch', 'jax', 'numpy', 'command'
    seed: int
    dtypes: tuple
    supports: tuple         # the options and outputs swept, and the promises held
    fully_masked: str
    budget: object          # seconds, or None
    timeout: object         # a case's seconds, or None (no limit: the kernel ran in this process)
    grid: tuple             # the grid's cases (grid.cases); results may hold fewer
    results: tuple          # judge.CaseResult of each case run, in the sweep's order
    failures: tuple         # Failure of each cell that failed
    seconds: float          # the sweep's time (the budget bounds it)
    shrink_seconds: float   # the shrinks' time, after the sweep
    interrupted: bool = False   # a Ctrl-C stopped the run: the report holds what was done
    unsaved: str = ""       # a file that could not be written, and why ('' if none)
    trials: tuple = ()      # the properties' trials (properties.py); property_results may hold fewer
    property_results: tuple = ()   # properties.PropertyResult of each trial run, in order
    saved: tuple = ()       # (trial id, .npz path) of each failing trial saved
    properties: tuple = ()  # the properties asked for (properties.PROPERTIES names)
    pictures: tuple = ()    # (property, dtype, .png path) of each property's failures drawn
    shrunk_trials: tuple = ()   # (smallest failing PropertyResult, the shrunk one, runs) of each
                                # property and dtype whose trials shrink (shrink.shrink_trial)

    @property
    def grid_size(self):
        return len(self.grid)

    @property
    def status(self):
        """'PASS', 'FAIL' or 'INCOMPLETE' (the module's docstring)."""
        if any(r.status != "PASS" for r in self.results + self.property_results):
            return "FAIL"
        covered = self.results and all(c.roles_run == c.roles for c in self.cells())
        tried = len(self.property_results) == len(self.trials)
        return "PASS" if covered and tried and not self.interrupted else "INCOMPLETE"

    def __bool__(self):
        return self.status == "PASS"

    def cells(self):
        """A Cell per (option, dtype) of the grid, in the grid's order."""
        present = {(case.cell, case.dtype) for case in self.grid}
        keys = [(cell, dtype) for cell in (PLAIN,) + self.supports for dtype in self.dtypes
                if (cell, dtype) in present]
        failures = {(f.option, f.dtype): f for f in self.failures}
        cells = []
        for option, dtype in keys:
            mine = [r for r in self.results if (r.case.cell, r.case.dtype) == (option, dtype)]
            judged = [r for r in mine if r.report is not None]
            worst, tensor = max((r.worst for r in judged), default=(math.nan, ""), key=lambda w: w[0])
            count = lambda status: sum(r.status == status for r in mine)
            errors = [r for r in mine if r.status in ("ERROR", "TIMEOUT")]
            roles = {c.role for c in self.grid if (c.cell, c.dtype) == (option, dtype)}
            cells.append(Cell(option, dtype, len(mine), len({r.case.role for r in mine}), len(roles),
                              count("PASS"), count("FAIL"), count("ERROR"), count("TIMEOUT"), worst,
                              tensor, failures.get((option, dtype)),
                              f"{errors[0].case.id}: {errors[0].error}" if errors else ""))
        return cells

    def property_rows(self):
        """A PropertyRow per (property, dtype) of the trials, in their first round's order."""
        keys = list(dict.fromkeys((t.property, t.dtype) for t in self.trials))
        rows = []
        for key in keys:
            mine = [r for r in self.property_results if (r.trial.property, r.trial.dtype) == key]
            failing = [r for r in mine if r.status != "PASS"]
            smallest = min(failing, key=lambda r: r.trial.case.scores, default=None)
            count = lambda *statuses: sum(r.status in statuses for r in mine)
            shrunk = next(((found, runs) for first, found, runs in self.shrunk_trials
                           if (first.trial.property, first.trial.dtype) == key), None)
            picture = next((path for name, dtype, path in self.pictures if (name, dtype) == key), None)
            rows.append(PropertyRow(*key, len(mine), sum((t.property, t.dtype) == key for t in self.trials),
                                    count("PASS"), count("FAIL"), count("ERROR", "TIMEOUT"), smallest, shrunk,
                                    picture))
        return rows

    def untried(self):
        """The properties asked for that have no trial for this kernel: [(name, what it needs)]."""
        tried = {t.property for t in self.trials}
        return [(name, NEEDS[name]) for name in self.properties if name not in tried]

    def coverage(self):
        """One line: how many roles of every cell the run covered."""
        cells = self.cells()
        least, roles = min(c.roles_run for c in cells), max(c.roles for c in cells)
        why = "the run was interrupted" if self.interrupted else "a larger budget runs more"
        trials = len(self.property_results), len(self.trials)
        unrun = "" if trials[0] == trials[1] else \
            f"; {trials[0]} of {trials[1]} property trials run: not enough to pass ({why})"
        if least == roles:
            return f"coverage: every role of every cell run ({roles} of {roles}){unrun}"
        return f"coverage: {least} of {roles} roles run in every cell: not enough to pass ({why})"

    def __str__(self):
        cells = self.cells()
        limits = [f"budget {self.budget:g} s"] if self.budget is not None else []
        limits += [f"a case at most {self.timeout:g} s"] if self.timeout is not None else []
        shrunk = f", {len(self.failures)} shrunk in {self.shrink_seconds:.0f} s" if self.failures else ""
        lines = wrapped(f"conform: {self.kernel} ({self.kind}), seed {self.seed}")
        trials = f" and {len(self.property_results)} of {len(self.trials)} property trials" if self.trials else ""
        lines += wrapped(f"{len(self.results)} of {self.grid_size} cases of the grid{trials} run in {self.seconds:.0f} s"
                         + (f" ({', '.join(limits)})" if limits else "") + f"{shrunk} -> {self.status}")
        lines += wrapped(self.coverage())
        lines.append(f"{'option':<{WIDTH_OPTION}}{'dtype':<{WIDTH_DTYPE}}"
                     + "".join(f"{name:>{width}}" for name, width in COLUMNS))
        for c in cells:
            worst = "" if math.isnan(c.worst) else f"{c.worst:.2g} {c.worst_tensor}"
            values = (c.cases, f"{c.roles_run}/{c.roles}", c.passed, c.failed, c.errors, c.timeouts, worst)
            lines.append((f"{c.option:<{WIDTH_OPTION}}{c.dtype:<{WIDTH_DTYPE}}"
                          + "".join(f" {value:>{width - 1}}" for value, (_, width) in zip(values, COLUMNS))).rstrip())
        failing = [c.failure for c in cells if c.failure]
        if failing:
            lines.append("failures, each shrunk to its smallest failing case:")
        for failure in failing:
            shrunk = failure.shrunk
            lines += wrapped(f"{failure.option} {failure.dtype}: {shrunk.case.id}", "  ")
            lines += wrapped(f"shrunk from {shrunk.original.id} in {shrunk.steps} runs", "    ")
            for row in shrunk.report.rows:
                if not row.passed:
                    lines += wrapped(f"{row.name} FAIL: {'; '.join(row.failed)}", "    ")
            said, before = shrunk.diagnosis()
            for line in said:
                lines += wrapped(f"diagnosis{' (before shrinking)' * before}: {line}", "    ")
        saved = [f for f in failing if f.file]
        if saved:
            pictures = ", its error maps as <id>.png" if any(f.picture for f in saved) else ""
            lines += wrapped(f"saved in {os.path.dirname(saved[0].file) or '.'}: each case as <id>.npz "
                             f"(re-judge it: numpy-attention crosscheck FILE.npz){pictures}")
        errors = [c for c in cells if c.error]
        if errors:
            lines.append("errors (the kernel raised, exited, died or hung, or gave what crosscheck cannot judge):")
        for c in errors:
            lines += wrapped(f"{c.option} {c.dtype}: {c.errors + c.timeouts} of {c.cases} cases, e.g. "
                             f"{c.error}", "  ")
        lines += self._property_lines()
        if self.unsaved:
            lines += wrapped(f"not saved: {self.unsaved}")
        return "\n".join(lines)

    def _property_lines(self):
        """The properties' table (properties.py), then what each failing one's smallest trial did."""
        rows = self.property_rows()
        untried = [f"{name} (it needs {needs})" for name, needs in self.untried()]
        lines = wrapped(f"no trial for this kernel's supports: {'; '.join(untried)}") if untried else []
        if not rows:
            return lines
        lines += [f"{'property':<18}{'dtype':<{WIDTH_DTYPE}}{'trials':>8}{'passed':>8}{'failed':>8}{'errors':>8}"]
        for r in rows:
            lines.append(f"{r.property:<18}{r.dtype:<{WIDTH_DTYPE}}{f'{r.tried}/{r.trials}':>8}{r.passed:>8}"
                         f"{r.failed:>8}{r.errors:>8}")
        failing = [r for r in rows if r.smallest is not None]
        if failing:
            lines.append("properties that did not hold, each on its smallest trial:")
        saved = dict(self.saved)
        for r in failing:
            result = r.smallest
            lines += wrapped(f"{r.property} {r.dtype}: {result.status} {result.trial.case.id}: {result.detail}", "  ")
            if r.shrunk is not None:
                found, runs = r.shrunk
                lines += wrapped(f"shrunk to {found.trial.case.id} in {runs} runs" + (
                    f": {found.detail}" if found is not result else ": no smaller case fails"), "    ")
                result = found
            if str(result.trial) in saved:
                lines += wrapped(f"saved as {saved[str(result.trial)]} (numpy-attention crosscheck FILE.npz "
                                 f"re-judges it)", "    ")
            if r.picture is not None:
                lines += wrapped(f"{DRAWN[r.property]} drawn in {r.picture}", "    ")
        return lines

    def to_json(self):
        """The report as a JSON string: the settings, the verdict, one object per cell and one
        per case run. A number JSON cannot hold (NaN, an infinite ratio) is null."""
        cells = self.cells()
        return json.dumps({
            "passed": bool(self), "status": self.status, "kernel": self.kernel, "kind": self.kind,
            "seed": self.seed, "dtypes": list(self.dtypes), "supports": list(self.supports),
            "fully_masked": self.fully_masked, "budget": self.budget, "timeout": self.timeout,
            "grid_cases": self.grid_size, "cases_run": len(self.results),
            "roles": max(c.roles for c in cells), "least_roles_run": min(c.roles_run for c in cells),
            "interrupted": self.interrupted, "unsaved": self.unsaved or None,
            "seconds": self.seconds, "shrink_seconds": self.shrink_seconds,
            "cells": [_cell_json(c) for c in cells],
            "cases": [case_json(r) for r in self.results],
            "properties": [{"property": r.property, "dtype": r.dtype, "tried": r.tried, "trials": r.trials,
                            "passed": r.passed, "failed": r.failed, "errors": r.errors,
                            "smallest_failing": None if r.smallest is None else trial_json(r.smallest),
                            "shrunk": None if r.shrunk is None else {**trial_json(r.shrunk[0]), "runs": r.shrunk[1]},
                            "picture": r.picture}
                           for r in self.property_rows()],
            "property_trials": [trial_json(r) for r in self.property_results],
            "properties_without_trials": [{"property": name, "needs": needs} for name, needs in self.untried()],
        }, indent=2)


def case_line(result):
    """One line for a case that did not pass: its status, id and what happened."""
    worst, tensor = result.worst
    said = result.error or f"{tensor} at {worst:.2g} times its bound"
    return "\n".join(wrapped(f"{result.status} {result.case.id}: {said}"))


def case_json(result):
    """A CaseResult as a JSON object (what to_json's "cases" and the run's record hold)."""
    return {"id": result.case.id, "cell": result.case.cell, "dtype": result.case.dtype,
            "role": result.case.role, "status": result.status, "worst_ratio": _number(result.worst[0]),
            "worst_tensor": result.worst[1] or None, "error": result.error or None,
            "seconds": result.seconds}


def trial_json(result):
    """A PropertyResult as a JSON object (what to_json's "property_trials" and the record hold)."""
    return {"id": str(result.trial), "property": result.trial.property, "dtype": result.trial.dtype,
            "case": result.trial.case.id, "status": result.status, "detail": result.detail or None,
            "seconds": result.seconds, "worst_over_bound": _number(result.worst),
            "by_entry": [_number(x) for x in result.by_entry] or None}


def wrapped(text, indent=""):
    """text as lines of at most WIDTH columns, the first indented by `indent`, the others by
    two more spaces; ids stay whole (no break at their hyphens)."""
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False)


def _number(x):
    """A float for JSON: NaN and the infinities as None."""
    return x if math.isfinite(x) else None


def _cell_json(c):
    failure = None
    if c.failure:
        shrunk = c.failure.shrunk
        failure = {"case": shrunk.case.id, "shrunk_from": shrunk.original.id, "runs": shrunk.steps,
                   "tensors": [{"name": row.name, "failed": list(row.failed)}
                               for row in shrunk.report.rows if not row.passed],
                   "diagnosis": shrunk.diagnosis()[0], "diagnosis_before_shrinking": shrunk.diagnosis()[1],
                   "file": c.failure.file, "picture": c.failure.picture}
    return {"option": c.option, "dtype": c.dtype, "cases": c.cases, "roles_run": c.roles_run,
            "roles": c.roles, "passed": c.passed, "failed": c.failed, "errors": c.errors,
            "timeouts": c.timeouts, "worst_ratio": _number(c.worst), "worst_tensor": c.worst_tensor or None,
            "smallest_failing": failure, "error": c.error or None}
