"""Shrinking a failing case (or a property's failing trial: shrink_trial) to the smallest shape
and the fewest options that still fail.

Greedy, like the shrinkers of QuickCheck and Hypothesis. Each move makes the case smaller:

    halve the batch, the kv heads, the query heads per kv head (gqa keeps 2), N_k, N_q, the width
    drop one option (the cell's own too: a failure may need only a companion)
    drop one output (lse, then the gradients: a forward that fails alone says so)
    N_k - 1, N_q - 1 (after halving: 3 keys may fail where 1 passes)

and is kept while the kernel still FAILs crosscheck on the new case (a PASS, an ERROR or a
TIMEOUT undoes it); a kept move is tried again at once (halving until it stops failing), and the passes over
all moves repeat until none is kept, within MAX_STEPS runs of the kernel (a case once undone
is not run again). The new case's arrays are drawn anew (grid.draw): the shrunk case is a
case of the grid's kind, with its id.
"""
from typing import NamedTuple

from .grid import ConformCase, make_case
from .judge import evaluate

MAX_STEPS = 64              # runs of the kernel a shrink may spend
MIN_GROUPS = 2              # query heads per kv head of a case that keeps gqa


class Shrunk(NamedTuple):
    original: ConformCase   # the sweep's failing case
    case: ConformCase       # the smallest failing case found
    report: object          # its CrosscheckReport
    arrays: dict            # its arrays with the kernel's results (crosscheck's keywords, save_case's)
    steps: int              # runs of the kernel spent
    original_report: object = None   # the failing case's CrosscheckReport

    def diagnosis(self):
        """(the diagnosis lines to show, whether they are the failing case's): the failing case's
        before it was shrunk, which explain the bug as the sweep met it; the shrunk case's where
        that one has none. A case of a few tokens matches more than the bug: a causal mask off
        by one key is, on one query row and two keys, also bottom-right causal."""
        original = self.original_report.diagnosis if self.original_report is not None else ()
        return list(original or self.report.diagnosis), bool(original) and self.case != self.original


def _remade(case, **changes):
    """The case with `changes` to its fields, and its new id."""
    fields = case._asdict()
    fields.update(changes)
    del fields["id"]
    return make_case(**fields)


def _without(name):
    """The move that drops option or output `name` (with gqa: one query head per kv head)."""
    def move(case):
        if name in case.options:
            return _remade(case, options=tuple(o for o in case.options if o != name),
                           groups=1 if name == "gqa" else case.groups)
        if name in case.outputs:
            return _remade(case, outputs=tuple(o for o in case.outputs if o != name))
        return None
    return move


def _smaller(field, step):
    """The move that makes `field` step(value), if that is at least its least (else None)."""
    def move(case):
        least = MIN_GROUPS if field == "groups" and "gqa" in case.options else 1
        value = getattr(case, field)
        return _remade(case, **{field: step(value)}) if step(value) >= least and value > least else None
    return move


half = lambda value: value // 2
less_one = lambda value: value - 1


def moves(case):
    """The moves, in the order they are tried: the halvings (after which every run is cheap),
    the options, the outputs, then one less."""
    return ([_smaller(field, half) for field in ("batch", "kv_heads", "groups", "n_k", "n_q", "d")]
            + [_without(name) for name in case.options + tuple(reversed(case.outputs))]
            + [_smaller(field, less_one) for field in ("n_k", "n_q")])


def shrink_trial(check, result, fits, max_steps=MAX_STEPS):
    """(the smallest failing PropertyResult found, the runs spent) from a property trial's FAIL
    `result` (properties.py): its case made smaller by the moves above whose case `fits` the
    property (fits(case) -> bool: what the property needs stays), each kept while check(trial)
    still FAILs, as shrink keeps a case's."""
    best, steps, tried = result, 0, set()
    changed = True
    while changed and steps < max_steps:
        changed = False
        for move in moves(best.trial.case):
            while steps < max_steps:
                smaller = move(best.trial.case)
                if smaller is None or not fits(smaller) or smaller.id in tried:
                    break
                found = check(best.trial._replace(case=smaller))
                steps += 1
                if found.status != "FAIL":
                    tried.add(smaller.id)
                    break
                best, changed = found, True
    return best, steps


def shrink(kernel, case, report, arrays, max_steps=MAX_STEPS):
    """A Shrunk: the smallest case found that the kernel (a kernels.Kernel) still fails, from a
    failing case with its report and judged arrays (judge.judged's)."""
    best = Shrunk(case, case, report, arrays, 0, report)
    tried = set()                               # ids of the cases that passed or raised
    changed = True
    while changed and best.steps < max_steps:
        changed = False
        for move in moves(best.case):
            while best.steps < max_steps:
                smaller = move(best.case)
                if smaller is None or smaller.id in tried:
                    break
                result, judged_arrays = evaluate(kernel, smaller)
                if result.status != "FAIL":
                    tried.add(smaller.id)
                    best = best._replace(steps=best.steps + 1)
                    break
                best = Shrunk(case, smaller, result.report, judged_arrays, best.steps + 1, report)
                changed = True
    return best
