"""gradcheck: compare a hand-written backward with finite differences of its forward.

    report = gradcheck(forward, backward, inputs)     # forward(*inputs) -> (out, cache)

The steps: check the arguments (calls.py, _checks); compute each checked input's derivatives
both ways (jacobians.py, by a finite-difference method of differences.py); hold each input
to atol + rtol * scale (verdict_table.py), atol by default the roundoff floor of the method.
"""
from typing import NamedTuple, Optional

from .._checks import (as_scalar, require_choice, require_nonnegative_real, require_positive_int,
                       require_positive_real, rng_from_seed)
from .calls import inputs_and_wrt, unchecked
from .differences import DEFAULTS, METHODS, default_atol, real_dtype_name, require_step_moves
from .jacobians import full_jacobians, projections
from .verdict_table import GradcheckError, GradcheckReport, compare, largest, non_analytic_hint

MODES = ("full", "projection")
CHECKED = ("fc", "floating-point (or complex)")     # the dtype kinds checked, and their name


class Settings(NamedTuple):
    """gradcheck's checked arguments, defaults filled in."""
    method: str
    mode: str
    h: float                # the finite-difference step
    rtol: float
    atol: Optional[float]   # None: the roundoff floor of differences.default_atol
    dtype: str              # 'float32' or 'float64': the row of DEFAULTS
    n_projections: int
    batched: Optional[bool]
    chunk_size: Optional[int]


def settings_of(inputs, wrt, names, method, mode, eps, atol, rtol, n_projections, batched, chunk_size):
    """Settings from gradcheck's keyword arguments; TypeError / ValueError naming a bad one."""
    require_choice(method, "method", METHODS)
    require_choice(mode, "mode", MODES)
    dtype = real_dtype_name(inputs[wrt[0]])
    default_h, default_rtol = DEFAULTS[(dtype, method)]
    h = default_h if eps is None else require_positive_real(as_scalar(eps), "eps")
    if method != "complex":                       # complex step has no cancellation to refuse
        for i in wrt:
            require_step_moves(h, inputs[i], f"eps={h:g}", names[i])
    if batched not in (None, True, False):
        raise TypeError(f"batched must be None, True or False, got {batched!r}")
    return Settings(method, mode, h,
                    default_rtol if rtol is None else require_nonnegative_real(as_scalar(rtol), "rtol"),
                    None if atol is None else require_nonnegative_real(as_scalar(atol), "atol"),
                    dtype, require_positive_int(n_projections, "n_projections"), batched,
                    None if chunk_size is None else require_positive_int(chunk_size, "chunk_size"))


def prepare(first, second, inputs, wrt, names, seed, *settings):
    """The checked arguments of gradcheck and jvpcheck: (inputs, wrt, names, Settings, rng,
    skipped), skipped the report's (name, why) of each input not checked.

    first, second: (function, its name) pairs that must be callables; settings: settings_of's
    arguments from method on.
    """
    for function, name in (first, second):
        if not callable(function):
            raise TypeError(f"{first[1]} and {second[1]} must be callables, got {name} = {function!r:.60}")
    wrt_given = wrt is not None
    inputs, wrt = inputs_and_wrt(inputs, wrt, *CHECKED)
    names = names_of(names, inputs)
    skipped = tuple((names[i], why) for i, why in unchecked(inputs, wrt, wrt_given, *CHECKED).items())
    return inputs, wrt, names, settings_of(inputs, wrt, names, *settings), rng_from_seed(seed), skipped


def names_of(names, inputs):
    names = names or [f"input {i}" for i in range(len(inputs))]
    if len(names) != len(inputs):
        raise ValueError(f"names has {len(names)} entries for {len(inputs)} inputs")
    return names


def report_of(derivatives, names, settings, batching, skipped):
    """The GradcheckReport of {i: Derivatives}: one row per input, atol by default_atol; the
    inputs not checked listed as skipped, (name, why) each."""
    size = {i: max(largest(d.analytic), largest(d.numeric)) for i, d in derivatives.items()}
    rows, hints = [], []
    for i, d in derivatives.items():
        atol = settings.atol
        if atol is None:
            atol = default_atol(settings.method, settings.dtype, settings.h, d.output_size, size[i],
                                max(size.values()))
        rows.append(compare(names[i], "jacobian" if settings.mode == "full" else "projection",
                            d.analytic, d.numeric, d.index_of, settings.rtol, atol))
        hints.append(non_analytic_hint(rows[-1], settings.method, d.analytic, d.numeric))
    return GradcheckReport(rows, settings.method, settings.mode, settings.h, settings.rtol,
                           settings.atol, settings.dtype, batching, tuple(hint for hint in hints if hint),
                           skipped=skipped)


def gradcheck(forward, backward, inputs, *, method="central", mode="full", eps=None, atol=None,
              rtol=None, seed=0, raise_on_failure=False, wrt=None, names=None, n_projections=3,
              batched=None, chunk_size=None):
    """Compare backward's gradients with finite differences of forward.

    For each checked input x: full mode compares the whole Jacobian J = d out / d x, projection
    mode <u, J v> for random u, v (jacobians.py); each passes iff
    max |analytic - numeric| <= atol + rtol * max(|analytic|, |numeric|) (verdict_table.py).

    Args:
        forward: forward(*inputs) -> (out, cache); out an array.
        backward: backward(dout, cache) -> gradients in input order.
        inputs: sequence of inputs; the floating (or complex) arrays among them are checked,
            the report lists each other one as skipped, with why.
        method: 'central' (default), 'complex' (complex step) or 'richardson' (differences.py).
        mode: 'full' (whole Jacobian) or 'projection' (<u, J v> for random u, v).
        eps: step h; default per dtype and method (differences.DEFAULTS).
        atol, rtol: tolerances; defaults per dtype and method (atol: a roundoff floor).
        seed: seeds the random upstream gradients and directions.
        raise_on_failure: raise GradcheckError (an AssertionError) with the table.
        wrt: indices of the inputs to check (default: every floating array).
        names: display names of the inputs (default "input 0", ...).
        n_projections: random (u, v) pairs per input in projection mode.
        batched: full mode only (batching.py). None (default): evaluate a chunk of perturbations
            (and of unit upstream gradients) in one forward (backward) call, stacked along a new
            leading axis of every array input, if a two-entry probe shows the functions
            broadcast over that axis; one at a time otherwise, and the report's note says which.
            True: require the stacked evaluation (ValueError with what it met, if it fails);
            False: always one at a time. The numbers agree to rounding either way.
        chunk_size: perturbations per stacked call (default: ~2^20 entries per tensor).
    Returns:
        GradcheckReport: truthy iff every check passed; prints as a table.
    """
    inputs, wrt, names, settings, rng, skipped = prepare(
        (forward, "forward"), (backward, "backward"), inputs, wrt, names, seed,
        method, mode, eps, atol, rtol, n_projections, batched, chunk_size)
    if settings.mode == "full":
        derivatives, batching = full_jacobians(forward, backward, inputs, wrt, names, settings.method,
                                               settings.h, settings.batched, settings.chunk_size, rng)
    else:
        derivatives = {i: projections(forward, backward, inputs, i, names[i], settings.method,
                                      settings.h, rng, settings.n_projections) for i in wrt}
        batching = None
    report = report_of(derivatives, names, settings, batching, skipped)
    if raise_on_failure and not report:
        raise GradcheckError("\n" + str(report))
    return report
