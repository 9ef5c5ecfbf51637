"""Check a hand-written backward against finite differences.

Imports nothing of the package but its argument checks (`_checks`): it only calls the
functions it is given.

    report = gradcheck(forward, backward, inputs)     # forward(*inputs) -> (out, cache)
    bool(report)                                      # True iff every check passed
    print(report)                                     # a table, one row per input (checked or
                                                      # skipped, with why)

`backward(dout, cache)` returns gradients in the order of `inputs` (extra trailing entries
are ignored; None for an input that has no gradient). One concept per module:

    differences.py    the numeric derivative: central, richardson, complex step (METHODS),
                      default steps and tolerances (DEFAULTS), the roundoff floor, step checks
    calls.py          which inputs are checked; what forward and backward must return
    jacobians.py      the two modes: whole Jacobians (full), random projections <u, J v>
    batching.py       a chunk of perturbations in one call, stacked along a new leading axis
    verdict_table.py  the verdict max |analytic - numeric| <= atol + rtol * scale, and the table
    gradient_check.py gradcheck itself
    taylor.py         taylor_test: eps-free, the Taylor remainder shrinking as O(h^2)
    restricted.py     block_functions: a forward/backward pair restricted to blocks
    jvpcheck.py       jvpcheck: a forward-mode derivative (JVP) against finite differences
"""
from .differences import DEFAULTS, METHODS, directional_derivative
from .gradient_check import MODES, gradcheck
from .jvpcheck import jvpcheck
from .restricted import block_functions
from .taylor import TaylorReport, taylor_test
from .verdict_table import CheckRow, GradcheckError, GradcheckReport

__all__ = ["gradcheck", "jvpcheck", "taylor_test", "directional_derivative", "block_functions",
           "GradcheckReport", "GradcheckError", "CheckRow", "TaylorReport", "METHODS", "MODES", "DEFAULTS"]
