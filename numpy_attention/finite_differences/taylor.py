"""taylor_test: an eps-free gradient check, the first-order Taylor remainder of L = <u, forward(x)>.

With a random upstream gradient u and a random direction v over the checked inputs,

    r0(h) = |L(x + h v) - L(x)|                         ~ O(h)
    r1(h) = |L(x + h v) - L(x) - h <backward(u), v>|    ~ O(h^2) iff the gradient is right

so each halving of h divides r1 by 4 (order 2) for a right gradient and by 2 (order 1) for a
wrong one. No step size has to be chosen well: the order is read off a whole sweep h0, h0/2, ...
"""
import math
from typing import NamedTuple

import numpy as np

from .._checks import as_scalar, require_positive_int, require_positive_real, rng_from_seed
from .calls import forward_output, gradient, inputs_and_wrt
from .differences import require_step_moves

PASSING_ORDER = 1.8         # the observed order a right gradient reaches (2 up to noise)
ROUNDOFF_FACTOR = 1e3       # the floor of r1: ROUNDOFF_FACTOR * eps_mach * sum |u * forward(x)|


class TaylorReport(NamedTuple):
    steps: np.ndarray       # h, halving
    r0: np.ndarray          # |L(x + h v) - L(x)|                  ~ O(h)
    r1: np.ndarray          # |L(x + h v) - L(x) - h <g, v>|       ~ O(h^2) iff g is right
    orders: np.ndarray      # log2(r1(h) / r1(h/2)) for consecutive steps
    order: float            # median observed order of r1 (inf: exact to rounding; nan: inconclusive)
    passed: bool            # order >= PASSING_ORDER

    def __bool__(self):
        return self.passed

    def __str__(self):
        lines = [f"taylor test: observed order of the remainder {self.order:.3f} "
                 f"(2 for a right gradient, 1 for a wrong one) -> {'PASS' if self else 'FAIL'}",
                 f"{'h':>10}{'|L(x+hv)-L(x)|':>18}{'|... - h<g,v>|':>18}{'order':>8}"]
        for j, h in enumerate(self.steps):
            order = f"{self.orders[j - 1]:8.3f}" if j else " " * 8
            lines.append(f"{h:>10.3e}{self.r0[j]:>18.3e}{self.r1[j]:>18.3e}{order}")
        return "\n".join(lines)


def _observed_order(r1, floor):
    """(log2 r1(h) / r1(h/2) per pair of steps, their median over the steps above the floor).

    If every remainder is at the floor the linear model is exact to rounding (order inf, a
    pass); if some is above it but no pair of steps is, the sweep is inconclusive (nan, a fail).
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        orders = np.log2(r1[:-1] / r1[1:])
    usable = orders[(r1[1:] > floor) & np.isfinite(orders)]
    if usable.size:
        return orders, float(np.median(usable))
    return orders, math.inf if np.all(r1 <= floor) else math.nan


def taylor_test(forward, backward, inputs, *, wrt=None, seed=0, h0=1e-1, n_steps=8):
    """Eps-free gradient check: the order of the first-order Taylor remainder r1 (module docstring).

    The roundoff floor is 1e3 * eps_mach * sum |u * forward(x)| (the size of L's terms);
    steps whose remainder falls to it are left out of the order.

    Args:
        forward, backward, inputs: as for `gradcheck`; the real floating arrays are checked.
        wrt: indices of the inputs to perturb (default: every real floating array).
        seed: seeds u and v.
        h0: the largest step, > eps_mach * max(1, |x|) for every checked x; n_steps: how
            many steps, >= 2.
    Returns:
        TaylorReport: truthy iff the observed order is >= 1.8.
    """
    inputs, wrt = inputs_and_wrt(inputs, wrt, "f", "real floating-point")
    h0 = require_positive_real(as_scalar(h0), "h0")
    n_steps = require_positive_int(n_steps, "n_steps", minimum=2)
    rng = rng_from_seed(seed)
    for i in wrt:
        require_step_moves(h0, inputs[i], f"h0={h0:g}", f"input {i}")
    out, cache = forward_output(forward, inputs)
    u = rng.standard_normal(out.shape)                                    # upstream gradient [out]
    grads = backward(u, cache)
    directions = {i: rng.standard_normal(np.shape(inputs[i])) for i in wrt}          # v, per input
    slope = sum(float(np.sum(gradient(grads, i, v.shape, f"input {i}") * v)) for i, v in directions.items())

    def loss(h):                                                          # L(x + h v) = <u, f(x + h v)>
        moved = [x + h * directions[i] if i in directions else x for i, x in enumerate(inputs)]
        return float(np.sum(u * forward(*moved)[0]))

    loss_at_x = loss(0.0)
    steps = h0 / 2.0 ** np.arange(n_steps)
    change = np.array([loss(h) for h in steps]) - loss_at_x           # L(x + h v) - L(x)
    r0, r1 = np.abs(change), np.abs(change - steps * slope)
    floor = ROUNDOFF_FACTOR * np.finfo(float).eps * float(np.sum(np.abs(u * out)))
    orders, order = _observed_order(r1, floor)
    return TaylorReport(steps, r0, r1, orders, order, bool(order >= PASSING_ORDER))
