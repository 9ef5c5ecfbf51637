"""Check a hand-written backward against finite differences.

Imports nothing of the package: it only calls the functions it is given.

    report = gradcheck(forward, backward, inputs)     # forward(*inputs) -> (out, cache)
    bool(report)                                      # True iff every check passed
    print(report)                                     # a table, one row per input

`backward(dout, cache)` returns gradients in the order of `inputs` (extra
trailing entries are ignored; None for an input that has no gradient).

Methods (f is the forward output, x one input, e a unit or random direction):
    central      (f(x + h e) - f(x - h e)) / 2h              error O(h^2) + O(eps_mach |f| / h)
    richardson   (4 D(h/2) - D(h)) / 3 on the central D(h)   error O(h^4) + O(eps_mach |f| / h)
    complex      Im f(x + i h e) / h                         error O(h^2) with no cancellation:
                                                             h = 1e-20 gives ~1e-16 relative.
                 Needs a forward that accepts complex input and is analytic in it.
Modes:
    full         the whole Jacobian J [out.size, x.size], entry by entry: numeric column by
                 column (perturb each entry of x), analytic row by row (backward of each unit
                 upstream gradient), so every possible upstream gradient is covered.
                 Vectorized: a chunk of perturbed copies of x (of unit upstream gradients) is
                 stacked along a new leading axis of every array input and evaluated in one
                 forward (backward) call, when a probe shows the functions broadcast over that
                 axis; one at a time otherwise (`batched`, `chunk_size`). Same numbers either way.
    projection   <u, J v> for random u (upstream gradient) and random v (direction), compared
                 with <backward(u), v>: one backward and one to four forwards per check (by
                 method), cheap at any size.

Verdict per input: max |analytic - numeric| <= atol + rtol * scale, scale = the largest
|entry| of either (a normwise criterion: one tiny entry cannot fail or pass the check).
Default tolerances, per input dtype and method (see DEFAULTS):
    complex    float64: h 1e-20, rtol 1e-12              float32: h 1e-20, rtol 1e-5
    central    float64: h 1e-6,  rtol 1e-6               float32: h 1e-3,  rtol 1e-2
    richardson float64: h 1e-3,  rtol 1e-8               float32: h 1e-2,  rtol 1e-3
    atol defaults to a roundoff floor (the report's "tol" column shows each row's bound):
    complex     0: each input is held to rtol against its own largest entry, so a small
                (vanishing) gradient is checked as strictly as a large one. The exception is
                an input whose whole gradient is below 100 * eps_mach * the largest derivative
                of any checked input in the call: a gradient that is exactly zero (a key
                bias's without softcap: softmax ignores a constant shift of a row) is computed
                as cancelling terms and lands near eps, not 0, so that floor is its atol;
    central /   10 * eps_mach * max(1, |f|) / h, below which finite differences see only noise
    richardson  (|f| is the largest |output| in full mode, sum |u * f| in projection mode).
                A step h <= eps_mach * max(1, |x|) is refused (ValueError): x + h rounds to x
                for the largest entries, so the differences would measure nothing while the
                floor let every gradient pass.
`taylor_test` is eps-free: it shows the first-order Taylor remainder shrinking as O(h^2).
"""
import math
from typing import NamedTuple, Optional

import numpy as np

METHODS = ("central", "complex", "richardson")
_CHUNK_ENTRIES = 2 ** 20           # full mode: entries per stacked tensor in one evaluation
MODES = ("full", "projection")

# (dtype, method) -> (eps, rtol); atol is 0 for complex and the roundoff floor otherwise
DEFAULTS = {
    ("float64", "complex"): (1e-20, 1e-12), ("float32", "complex"): (1e-20, 1e-5),
    ("float64", "central"): (1e-6, 1e-6), ("float32", "central"): (1e-3, 1e-2),
    ("float64", "richardson"): (1e-3, 1e-8), ("float32", "richardson"): (1e-2, 1e-3),
}


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
    atol: Optional[float]   # None: the default roundoff floor (see the module docstring)
    dtype: str

    def __bool__(self):
        return all(row.passed for row in self.rows)

    def __str__(self):
        atol = "floor" if self.atol is None else f"{self.atol:g}"
        head = (f"gradcheck  method={self.method}  mode={self.mode}  dtype={self.dtype}  "
                f"h={self.eps:g}  rtol={self.rtol:g}  atol={atol}  -> "
                f"{'PASS' if self else 'FAIL'}")
        cols = f"{'input':<14}{'check':<12}{'max abs err':>12}{'max rel err':>12}  " \
               f"{'worst index':<22}{'analytic':>13}{'numeric':>13}{'tol':>10}  ok"
        lines = [head, cols]
        for r in self.rows:
            lines.append(f"{r.name:<14}{r.check:<12}{r.max_abs_err:>12.2e}{r.max_rel_err:>12.2e}  "
                         f"{str(r.worst_index):<22}{r.analytic:>13.5e}{r.numeric:>13.5e}"
                         f"{r.tol:>10.1e}  {'yes' if r.passed else 'NO'}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- arguments
# (this module imports nothing of the package it checks, so it validates its own arguments)

def _real(value, name, *, positive):
    """value as a float, raising unless it is a finite real number > 0 (positive) or >= 0."""
    expected = f"a finite real number {'> 0' if positive else '>= 0'}"
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]                                         # a 0-d array: its scalar
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {expected}, got {value}")
    return float(value)


def _count(value, name, minimum):
    """value as an int, raising unless it is an integer >= minimum."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return int(value)


def _inputs_and_wrt(inputs, wrt, kinds, what):
    """(inputs as a list, wrt as a list of indices): the checked inputs are non-empty arrays of a
    dtype kind in `kinds`; wrt=None takes every such array."""
    if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list or tuple of the forward's arguments, "
                        f"got {type(inputs).__name__}")
    inputs = list(inputs)
    checkable = lambda x: isinstance(x, np.ndarray) and x.dtype.kind in kinds and x.size > 0
    describe = lambda x: (f"an array of {x.dtype}, shape {x.shape}" if isinstance(x, np.ndarray)
                          else type(x).__name__)
    if wrt is None:
        wrt = [i for i, x in enumerate(inputs) if checkable(x)]
        if not wrt:
            raise ValueError(f"found no non-empty {what} array among the inputs to check, got "
                             f"{'; '.join(describe(x) for x in inputs) or 'no inputs'}")
        return inputs, wrt
    if isinstance(wrt, np.ndarray) and wrt.ndim == 1 and wrt.dtype.kind in "iu":
        wrt = wrt.tolist()
    if not isinstance(wrt, (list, tuple, range)):
        raise TypeError(f"wrt must be a list of input indices, got {wrt!r} ({type(wrt).__name__})")
    if not wrt:
        raise ValueError("wrt is empty: name at least one input to check")
    for i in wrt:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"wrt must hold integer input indices, got {i!r} ({type(i).__name__}) in {wrt!r}")
        if not 0 <= i < len(inputs):
            raise ValueError(f"wrt index {i} is out of range for {len(inputs)} inputs")
        try:
            x = np.asarray(inputs[i])             # named explicitly: scalars and lists count too
        except ValueError:                        # a ragged list
            x = None
        if not checkable(x):
            raise ValueError(f"wrt index {i} must name a non-empty {what} array, got {describe(inputs[i])}")
    if len(set(wrt)) != len(wrt):
        raise ValueError(f"wrt names an input twice: {wrt!r}")
    return inputs, [int(i) for i in wrt]


def _require_step_moves(h, x, step, name):
    """ValueError unless a step h changes x: h > eps_mach * max(1, max |x|). Below that, x + h
    rounds to x (for the largest entries), and finite differences measure nothing."""
    x = np.asarray(x)
    largest = float(np.max(np.abs(x), initial=0.0))
    bound = np.finfo(x.real.dtype).eps * max(1.0, largest)
    if not h > bound:
        raise ValueError(f"{step} does not move {name} (largest |entry| {largest:.3g}): a "
                         f"finite-difference step must exceed eps_mach * max(1, |x|) = {bound:.3g}")


def _rng(seed):
    if isinstance(seed, (bool, np.bool_)):
        raise TypeError(f"seed must be a non-negative integer (or None), got {seed!r}")
    try:
        return np.random.default_rng(seed)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"seed must be a non-negative integer (or None), got {seed!r}: {exc}") from None


# ----------------------------------------------------------------------------- numerics

def _real_dtype_name(x):
    return "float32" if np.asarray(x).real.dtype == np.float32 else "float64"


def directional_derivative(f_of, x, direction, method, h):
    """d/dt f_of(x + t * direction) at t = 0 by `method` with step h; f_of returns an array.

    The finite-difference formula behind every check (see the module docstring); public
    so that studies can differentiate along their own directions with the same steps.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "complex":
        return np.imag(f_of(x.astype(np.result_type(x.dtype, np.complex64)) + 1j * h * direction)) / h
    central = lambda step: (f_of(x + step * direction) - f_of(x - step * direction)) / (2 * step)
    if method == "central":
        return central(h)
    return (4 * central(h / 2) - central(h)) / 3        # richardson


def _largest(a):
    """max |a|, NaN counted as 0."""
    return float(np.max(np.abs(np.nan_to_num(a)), initial=0.0))


def _compare(name, check, analytic, numeric, index_of, rtol, atol):
    """One report row: the normwise verdict and the worst entry."""
    analytic, numeric = np.asarray(analytic, dtype=float), np.asarray(numeric, dtype=float)
    nan_mismatch = np.isnan(analytic) != np.isnan(numeric)
    err = np.where(np.isnan(analytic) & np.isnan(numeric), 0.0, np.abs(analytic - numeric))
    err = np.where(nan_mismatch, np.inf, err)
    scale = max(np.max(np.abs(np.nan_to_num(analytic)), initial=0.0),
                np.max(np.abs(np.nan_to_num(numeric)), initial=0.0))
    exact = err.size and not np.max(err) > 0              # no error at all: show the largest entry
    worst = int(np.argmax(np.abs(np.nan_to_num(numeric)) if exact else err)) if err.size else 0
    max_abs = float(err.flat[worst]) if err.size else 0.0
    tol = atol + rtol * scale
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    return CheckRow(name, check, max_abs, rel, index_of(worst),
                    float(analytic.flat[worst]) if err.size else 0.0,
                    float(numeric.flat[worst]) if err.size else 0.0, tol, bool(max_abs <= tol))


def _forward(forward, inputs):
    """(out as an array, cache) of the unperturbed inputs; an empty output has nothing to check."""
    result = forward(*inputs)
    if isinstance(result, np.ndarray):
        raise TypeError(f"forward must return a pair (out, cache), got an array of shape {result.shape}")
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(f"forward must return a pair (out, cache), got {type(result).__name__} "
                        f"{result!r:.60}")
    out, cache = result
    out = np.asarray(out)
    if out.size == 0:
        raise ValueError(f"the forward's output is empty (shape {out.shape}): there is no "
                         f"derivative to check")
    return out, cache


def _stack(inputs, i, xs):
    """The inputs with a leading axis of len(xs): input i is the stack xs (None: no input is),
    every other array input is repeated (a read-only view, no copy); non-arrays pass unchanged."""
    return [xs if j == i else np.broadcast_to(x, (len(xs),) + x.shape) if isinstance(x, np.ndarray) else x
            for j, x in enumerate(inputs)]


# Full mode evaluates two kinds of stacks, each one entry at a time ("looped": works for any
# forward) or in one call over the whole stack ("vectorized": needs a forward and backward
# that broadcast over a new leading axis of every array input):
#     f(xs [C, *x_i]) -> [C, out.size]                the outputs, input i perturbed
#     g(us [C, *out]) -> [[C, x_i.size] for i in wrt] every checked input's gradient

def _looped_f(forward, inputs, i):
    return lambda xs: np.stack([np.ravel(forward(*inputs[:i], xi, *inputs[i + 1:])[0]) for xi in xs])


def _vectorized_f(forward, inputs, i):
    return lambda xs: np.asarray(forward(*_stack(inputs, i, xs))[0]).reshape(len(xs), -1)


def _looped_g(backward, cache, inputs, wrt, names):
    def g(us):
        grads = [_gradients(backward, u, cache, inputs, wrt, names) for u in us]
        return [np.stack([np.ravel(per_u[n]) for per_u in grads]) for n in range(len(wrt))]
    return g


def _vectorized_g(forward, backward, inputs, wrt, names):
    def g(us):
        stacked = _stack(inputs, None, us)                       # every input repeated len(us) times
        _, cache = forward(*stacked)
        grads = _gradients(backward, us, cache, stacked, wrt, names)
        return [d.reshape(len(us), -1) for d in grads]
    return g


def _gradients(backward, dout, cache, inputs, wrt, names):
    """backward(dout, cache)[i] for each i in wrt, as arrays of inputs[i]'s shape (zeros for None)."""
    grads = backward(dout, cache)
    return [_gradient(grads, i, np.shape(inputs[i]), names[i]) for i in wrt]


def _gradient(grads, i, shape, name):
    """grads[i], the gradient backward returned for input i, as an array of `shape` (zeros for None)."""
    if isinstance(grads, np.ndarray):
        raise TypeError(f"backward must return a sequence of gradients in input order (e.g. [dx] "
                        f"for one input), got an array of shape {grads.shape}")
    try:
        g = grads[i]
    except (IndexError, KeyError, TypeError) as exc:
        raise ValueError(f"backward must return the gradients in input order, but its result "
                         f"({type(grads).__name__}) has no entry {i} for {name}: {exc}") from None
    if g is None:
        return np.zeros(shape)
    if np.shape(g) != shape:
        raise ValueError(f"backward's gradient for {name} has shape {np.shape(g)}, "
                         f"expected the input's shape {shape}")
    return np.asarray(g)


def _choose(vectorized, looped, probe, batched, dtype):
    """The vectorized evaluator when `batched` allows it and it agrees with the looped one on a
    two-entry probe (to sqrt(eps) of the largest value); the looped one otherwise.

    batched: True (vectorized, ValueError if the probe fails), False (looped) or None (auto:
    vectorized if the probe passes, else looped; the numbers agree to rounding either way).
    """
    if batched is False:
        return looped
    try:
        a, b = vectorized(probe), looped(probe)
        agree = all(_close(x, y, dtype) for x, y in zip(_as_list(a), _as_list(b), strict=True))
    except Exception as exc:            # the forward rejects the extra axis: shape checks and the like
        if batched:
            raise ValueError(f"batched=True, but the forward/backward fail on inputs stacked along "
                             f"a new leading axis: {type(exc).__name__}: {exc}") from exc
        return looped
    if batched and not agree:
        raise ValueError("batched=True, but the forward/backward give different numbers on inputs "
                         "stacked along a new leading axis than one at a time")
    if not agree:
        return looped
    return vectorized if batched else _or_else(vectorized, looped)


def _as_list(a):
    return a if isinstance(a, list) else [a]


def _or_else(vectorized, looped):
    """vectorized(xs), or looped(xs) if it raises: a stack of another size than the probe's
    can still trip a forward (a stack of 2 may align with an axis of size 2 by chance)."""
    def evaluate(xs):
        try:
            return vectorized(xs)
        except Exception:
            return looped(xs)
    return evaluate


def _close(a, b, dtype):
    scale = max(np.max(np.abs(b), initial=0.0), np.finfo(dtype).tiny)
    return a.shape == b.shape and bool(np.max(np.abs(a - b), initial=0.0) <= np.sqrt(np.finfo(dtype).eps) * scale)


def _chunks(n, inputs, out_size, chunk_size):
    """Index chunks of range(n); by default each stacks at most ~2^20 entries of any one tensor."""
    if chunk_size is None:
        largest = max([out_size] + [np.size(x) for x in inputs if isinstance(x, np.ndarray)])
        chunk_size = max(1, _CHUNK_ENTRIES // max(1, largest))
    return [np.arange(a, min(a + chunk_size, n)) for a in range(0, n, chunk_size)]


def _full_jacobians(forward, backward, inputs, wrt, names, method, h, batched, chunk_size, rng):
    """{i: (analytic J, numeric J, index_of(flat) -> (out index, in index), max |out|)} for i in wrt.

    Numeric J of each input column by column (perturb each entry of x_i). Analytic J row by
    row (backward of each unit upstream gradient), for all inputs at once, since one backward
    returns every input's gradient. Both a chunk of columns / rows per evaluation.
    """
    out, cache = _forward(forward, inputs)
    xs = {i: np.asarray(inputs[i]) for i in wrt}
    numeric = {}
    for i, x in xs.items():
        probe = x + rng.standard_normal((2,) + x.shape).astype(x.dtype) * 1e-3
        f = _choose(_vectorized_f(forward, inputs, i), _looped_f(forward, inputs, i), probe,
                    batched, x.real.dtype)
        numeric[i] = np.empty((out.size, x.size))
        for cols in _chunks(x.size, inputs, out.size, chunk_size):     # unit directions e_j, stacked
            e = np.zeros((len(cols), x.size), dtype=x.real.dtype)
            e[np.arange(len(cols)), cols] = 1.0
            directions = e.reshape((-1,) + x.shape)
            numeric[i][:, cols] = np.real(directional_derivative(f, x, directions, method, h)).T
    probe = rng.standard_normal((2,) + out.shape).astype(out.real.dtype)
    g = _choose(_vectorized_g(forward, backward, inputs, wrt, names),
                _looped_g(backward, cache, inputs, wrt, names), probe, batched, out.real.dtype)
    analytic = {i: np.empty_like(numeric[i]) for i in wrt}
    for rows in _chunks(out.size, inputs, out.size, chunk_size):       # unit upstream gradients, stacked
        u = np.zeros((len(rows), out.size), dtype=out.real.dtype)
        u[np.arange(len(rows)), rows] = 1.0
        for i, rows_of_i in zip(wrt, g(u.reshape((-1,) + out.shape))):
            analytic[i][rows] = np.real(rows_of_i)

    def index_of(x):                            # flat index of J -> (out index, x index)
        return lambda flat: (tuple(int(a) for a in np.unravel_index(flat // x.size, out.shape)),
                             tuple(int(a) for a in np.unravel_index(flat % x.size, x.shape)))
    out_max = np.max(np.abs(out), initial=0)
    return {i: (analytic[i], numeric[i], index_of(x), out_max) for i, x in xs.items()}


def _projections(forward, backward, inputs, i, name, method, h, rng, n):
    """(analytic <backward(u), v>, numeric <u, J v>, index_of, max sum |u * out|) for n pairs."""
    x = np.asarray(inputs[i])
    out, cache = _forward(forward, inputs)
    analytic, numeric, floors = [], [], []
    for _ in range(n):
        u = rng.standard_normal(out.shape).astype(out.real.dtype)                  # upstream gradient
        v = rng.standard_normal(x.shape).astype(x.real.dtype)                      # direction
        L_of = lambda xi: np.sum(u * np.asarray(forward(*inputs[:i], xi, *inputs[i + 1:])[0]))
        numeric.append(float(np.real(directional_derivative(L_of, x, v, method, h))))
        analytic.append(float(np.real(np.sum(_gradient(backward(u, cache), i, x.shape, name) * v))))
        floors.append(np.sum(np.abs(u * out)))
    return np.array(analytic), np.array(numeric), lambda k: (k,), max(floors)


def gradcheck(forward, backward, inputs, *, method="central", mode="full", eps=None, atol=None,
              rtol=None, seed=0, raise_on_failure=False, wrt=None, names=None, n_projections=3,
              batched=None, chunk_size=None):
    """Compare backward's gradients with finite differences of forward.

    Args:
        forward: forward(*inputs) -> (out, cache); out an array.
        backward: backward(dout, cache) -> gradients in input order.
        inputs: sequence of inputs; the floating (or complex) arrays among them are checked.
        method: 'central', 'complex' (complex step) or 'richardson'.
        mode: 'full' (whole Jacobian) or 'projection' (<u, J v> for random u, v).
        eps: step h; default per dtype and method (module docstring).
        atol, rtol: tolerances; defaults per dtype and method.
        seed: seeds the random upstream gradients and directions.
        raise_on_failure: raise GradcheckError (an AssertionError) with the table.
        wrt: indices of the inputs to check (default: every floating array).
        names: display names of the inputs (default "input 0", ...).
        n_projections: random (u, v) pairs per input in projection mode.
        batched: full mode only. None (default): evaluate a chunk of perturbations (and of
            unit upstream gradients) in one forward (backward) call, stacked along a new
            leading axis of every array input, if a two-entry probe shows the functions
            broadcast over that axis (same numbers as one at a time); one at a time
            otherwise. True: require the stacked evaluation (ValueError if the probe fails);
            False: always one at a time. The verdict does not depend on it.
        chunk_size: perturbations per stacked call (default: ~2^20 entries per tensor).
    Returns:
        GradcheckReport: truthy iff every check passed; prints as a table.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not callable(forward) or not callable(backward):
        raise TypeError("forward and backward must be callables")
    inputs, wrt = _inputs_and_wrt(inputs, wrt, "fc", "floating-point (or complex)")
    names = names or [f"input {i}" for i in range(len(inputs))]
    if len(names) != len(inputs):
        raise ValueError(f"names has {len(names)} entries for {len(inputs)} inputs")
    dtype = _real_dtype_name(inputs[wrt[0]])
    default_eps, default_rtol = DEFAULTS[(dtype, method)]
    h = default_eps if eps is None else _real(eps, "eps", positive=True)
    rtol = default_rtol if rtol is None else _real(rtol, "rtol", positive=False)
    atol = None if atol is None else _real(atol, "atol", positive=False)
    n_projections = _count(n_projections, "n_projections", 1)
    rng = _rng(seed)
    if method != "complex":
        for i in wrt:
            _require_step_moves(h, inputs[i], f"eps={h:g}", names[i])
    if batched not in (None, True, False):
        raise TypeError(f"batched must be None, True or False, got {batched!r}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
    if mode == "full":
        results = _full_jacobians(forward, backward, inputs, wrt, names, method, h, batched,
                                  chunk_size, rng)
    else:
        results = {i: _projections(forward, backward, inputs, i, names[i], method, h, rng, n_projections)
                   for i in wrt}
    eps_mach = np.finfo(np.float32 if dtype == "float32" else np.float64).eps
    size = {i: max(_largest(a), _largest(n)) for i, (a, n, _, _) in results.items()}
    zero_floor = 100 * eps_mach * max(size.values())
    rows = []
    for i, (analytic, numeric, index_of, f_size) in results.items():
        if atol is not None:
            row_atol = atol
        elif method == "complex":            # rtol alone, unless the gradient is zero to rounding
            row_atol = zero_floor if size[i] <= zero_floor else 0.0
        else:                                # the roundoff floor of finite differences of f
            row_atol = 10 * eps_mach * max(1.0, f_size) / h
        rows.append(_compare(names[i], "jacobian" if mode == "full" else "projection",
                             analytic, numeric, index_of, rtol, row_atol))
    report = GradcheckReport(rows, method, mode, h, rtol, atol, dtype)
    if raise_on_failure and not report:
        raise GradcheckError("\n" + str(report))
    return report


# ----------------------------------------------------------------------------- eps-free check

class TaylorReport(NamedTuple):
    steps: np.ndarray       # h, halving
    r0: np.ndarray          # |L(x + h v) - L(x)|                  ~ O(h)
    r1: np.ndarray          # |L(x + h v) - L(x) - h <g, v>|       ~ O(h^2) iff g is right
    orders: np.ndarray      # log2(r1(h) / r1(h/2)) for consecutive steps
    order: float            # median observed order of r1 (inf: exact to rounding; nan: inconclusive)
    passed: bool            # order >= 1.8

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


def taylor_test(forward, backward, inputs, *, wrt=None, seed=0, h0=1e-1, n_steps=8):
    """Eps-free gradient check: the first-order Taylor remainder of L = <u, forward(x)>.

    With a random upstream gradient u and a random direction v over the checked inputs,
        r1(h) = |L(x + h v) - L(x) - h <backward(u), v>|
    falls as O(h^2) (order 2: each halving of h divides r1 by 4) if and only if the
    gradient is right; a wrong gradient leaves an O(h) remainder (order 1). No step
    size has to be chosen well: the order is read off a whole sweep h0, h0/2, ...
    The roundoff floor is 1e3 * eps_mach * sum |u * forward(x)| (the size of L's terms).
    Steps whose remainder sinks to it are left out of the order: if every step's does, the
    linear model is exact to rounding (order inf, a pass); if some remainder is above it
    but no pair of steps is, the sweep is inconclusive (order nan, a fail).

    Args:
        forward, backward, inputs: as for `gradcheck`; the real floating arrays are checked.
        wrt: indices of the inputs to perturb (default: every real floating array).
        seed: seeds u and v.
        h0: the largest step, > eps_mach * max(1, |x|) for every checked x; n_steps: how
            many steps, >= 2.
    Returns:
        TaylorReport: truthy iff the observed order is >= 1.8.
    """
    inputs, wrt = _inputs_and_wrt(inputs, wrt, "f", "real floating-point")
    h0 = _real(h0, "h0", positive=True)
    n_steps = _count(n_steps, "n_steps", 2)
    rng = _rng(seed)
    for i in wrt:
        _require_step_moves(h0, inputs[i], f"h0={h0:g}", f"input {i}")
    out, cache = _forward(forward, inputs)
    u = rng.standard_normal(out.shape)
    grads = backward(u, cache)
    dirs = {i: rng.standard_normal(np.shape(inputs[i])) for i in wrt}
    slope = sum(float(np.sum(_gradient(grads, i, dirs[i].shape, f"input {i}") * dirs[i])) for i in wrt)

    def L(h):
        moved = [x + h * dirs[i] if i in dirs else x for i, x in enumerate(inputs)]
        return float(np.sum(u * forward(*moved)[0]))

    L0 = L(0.0)
    steps = h0 / 2.0 ** np.arange(n_steps)
    r0 = np.array([abs(L(h) - L0) for h in steps])
    r1 = np.array([abs(L(h) - L0 - h * slope) for h in steps])
    floor = 1e3 * np.finfo(float).eps * float(np.sum(np.abs(u * out)))
    with np.errstate(divide="ignore", invalid="ignore"):
        orders = np.log2(r1[:-1] / r1[1:])
    usable = orders[(r1[1:] > floor) & np.isfinite(orders)]
    if usable.size:
        order = float(np.median(usable))
    else:                                   # all at the floor: exact; some above it: inconclusive
        order = math.inf if np.all(r1 <= floor) else math.nan
    return TaylorReport(steps, r0, r1, orders, order, bool(order >= 1.8))
