"""Finite differences: the numeric side of every check, its default steps and its error floors.

A directional derivative of f (the forward's output) at x along a direction e, step h:

    central      D(h) = (f(x + h e) - f(x - h e)) / 2h     error O(h^2) + O(eps_mach |f| / h)
    richardson   (4 D(h/2) - D(h)) / 3                     error O(h^4) + O(eps_mach |f| / h)
    complex      Im f(x + i h e) / h                       error O(h^2), no cancellation:
                                                           h = 1e-20 gives ~1e-16 relative.
                 Needs a forward that accepts complex input and is analytic in it (no np.abs,
                 .real, float cast or np.maximum on the path from x to f).

Default step h and rtol per input dtype and method (DEFAULTS):
    complex    float64: h 1e-20, rtol 1e-12              float32: h 1e-20, rtol 1e-5
    central    float64: h 1e-6,  rtol 1e-6               float32: h 1e-3,  rtol 1e-2
    richardson float64: h 1e-3,  rtol 1e-8               float32: h 1e-2,  rtol 1e-3

Default atol, a roundoff floor (default_atol):
    complex     0: each input is held to rtol against its own largest entry, so a small
                (vanishing) gradient is checked as strictly as a large one. The exception is
                an input whose whole gradient is below 100 * eps_mach * the largest derivative
                of any checked input in the call: a gradient that is exactly zero (a bias
                constant along a row's keys: softmax ignores a constant shift of a row) is computed
                as cancelling terms and lands near eps, not 0, so that floor is its atol;
    central /   10 * eps_mach * max(1, |f|) / h, below which finite differences see only noise.
    richardson  A step h <= eps_mach * max(1, |x|) is refused (require_step_moves): x + h
                rounds to x for the largest entries, so the differences would measure nothing
                while the floor let every gradient pass.
"""
import numpy as np

from .._checks import require_choice

METHODS = ("central", "complex", "richardson")

# (dtype, method) -> (h, rtol); atol is the roundoff floor of default_atol
DEFAULTS = {
    ("float64", "complex"): (1e-20, 1e-12), ("float32", "complex"): (1e-20, 1e-5),
    ("float64", "central"): (1e-6, 1e-6), ("float32", "central"): (1e-3, 1e-2),
    ("float64", "richardson"): (1e-3, 1e-8), ("float32", "richardson"): (1e-2, 1e-3),
}


def directional_derivative(f_of, x, direction, method, h):
    """d/dt f_of(x + t * direction) at t = 0 by `method` with step h; f_of returns an array.

    The finite-difference formula behind every check (module docstring); public so that
    studies can differentiate along their own directions with the same steps. `direction`
    may carry a leading stack axis ([C, *x.shape]) when f_of evaluates a stack at once.
    """
    require_choice(method, "method", METHODS)
    if method == "complex":                                      # Im f(x + i h e) / h
        return np.imag(f_of(x.astype(np.result_type(x.dtype, np.complex64)) + 1j * h * direction)) / h

    def central(step):                                           # (f(x + h e) - f(x - h e)) / 2h
        return (f_of(x + step * direction) - f_of(x - step * direction)) / (2 * step)
    if method == "central":
        return central(h)
    return (4 * central(h / 2) - central(h)) / 3                 # richardson


def real_dtype_name(x):
    """'float32' for float32 / complex64 input, else 'float64': the row of DEFAULTS it uses."""
    return "float32" if np.asarray(x).real.dtype == np.float32 else "float64"


def machine_epsilon(dtype_name):
    """eps_mach of 'float32' or 'float64'."""
    return float(np.finfo(np.dtype(dtype_name)).eps)


def require_step_moves(h, x, step, name):
    """ValueError unless a step h changes x: h > eps_mach * max(1, max |x|). Below that, x + h
    rounds to x (for the largest entries), and finite differences measure nothing."""
    x = np.asarray(x)
    largest = float(np.max(np.abs(x), initial=0.0))
    bound = np.finfo(x.real.dtype).eps * max(1.0, largest)
    if not h > bound:
        raise ValueError(f"{step} does not move {name} (largest |entry| {largest:.3g}): a "
                         f"finite-difference step must exceed eps_mach * max(1, |x|) = {bound:.3g}")


def default_atol(method, dtype_name, h, output_size, gradient_size, largest_gradient_size):
    """The atol one input's check is held to when the caller gives none (module docstring).

    output_size: |f|, the size of the differenced function; gradient_size: the largest entry of
    this input's derivatives; largest_gradient_size: the largest over every checked input.
    """
    eps_mach = machine_epsilon(dtype_name)
    if method == "complex":                     # rtol alone, unless the gradient is zero to rounding
        zero_floor = 100 * eps_mach * largest_gradient_size
        return zero_floor if gradient_size <= zero_floor else 0.0
    return 10 * eps_mach * max(1.0, output_size) / h             # the roundoff floor of f's differences
