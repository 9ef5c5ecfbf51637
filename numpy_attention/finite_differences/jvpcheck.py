"""jvpcheck: compare a hand-written forward-mode derivative (a JVP) with finite differences.

    report = jvpcheck(forward, jvp, inputs)     # forward(*inputs) -> (out, cache)
                                                # jvp(inputs, tangents) -> out_dot

tangents is a list aligned with inputs (None for an input without a tangent); jvp returns
the directional derivative of out along them, J v. For each checked input x:

    full         J [out.size, x.size] column by column: analytic column j = jvp(e_j),
                 numeric column j = D_{e_j} out (differences.py), the whole Jacobian
    projection   J v for random directions v: analytic jvp(v), numeric D_v out, compared
                 entry by entry (one JVP and one to four forwards per direction)

The verdict and the table are gradcheck's (verdict_table.py): complex step is the default, since a
JVP is exactly what it computes, Im f(x + i h v) / h, with no cancellation.
"""
import numpy as np

from .calls import forward_output
from .gradient_check import prepare, report_of
from .differences import directional_derivative
from .jacobians import Derivatives, forward_evaluators, jacobian_index, numeric_jacobian


def _tangent_only(inputs, i, tangent):
    """The tangents list: `tangent` for input i, None for the others."""
    return [tangent if j == i else None for j in range(len(inputs))]


def _jvp_jacobian(jvp, inputs, i, out_size):
    """J [out.size, x.size] column by column from the JVPs of the unit tangents e_j."""
    x = np.asarray(inputs[i])
    jacobian = np.empty((out_size, x.size))
    for j in range(x.size):
        unit = np.zeros(x.size, x.real.dtype)
        unit[j] = 1.0
        jacobian[:, j] = np.real(np.ravel(jvp(inputs, _tangent_only(inputs, i, unit.reshape(x.shape)))))
    return jacobian


def _directions(forward, jvp, inputs, i, out, method, h, rng, n_projections):
    """Derivatives of n_projections random directions v: analytic jvp(v), numeric D_v out."""
    x = np.asarray(inputs[i])
    analytic, numeric = [], []
    for _ in range(n_projections):
        v = rng.standard_normal(x.shape).astype(x.real.dtype)
        moved = lambda x_moved: np.asarray(forward(*[x_moved if j == i else y for j, y in enumerate(inputs)])[0])
        numeric.append(np.real(np.ravel(directional_derivative(moved, x, v, method, h))))
        analytic.append(np.real(np.ravel(jvp(inputs, _tangent_only(inputs, i, v)))))
    index_of = lambda flat: (flat // out.size, tuple(int(a) for a in np.unravel_index(flat % out.size, out.shape)))
    return Derivatives(np.concatenate(analytic), np.concatenate(numeric), index_of,
                       float(np.max(np.abs(out), initial=0)))


def jvpcheck(forward, jvp, inputs, *, method="complex", mode="full", eps=None, atol=None, rtol=None,
             seed=0, wrt=None, names=None, n_projections=3):
    """Compare jvp's tangents with finite differences of forward (module docstring).

    Args as gradcheck's (method default 'complex'); jvp(inputs, tangents) -> out_dot.
    Returns:
        GradcheckReport: truthy iff every check passed; prints as a table.
    """
    inputs, wrt, names, settings, rng, skipped = prepare((forward, "forward"), (jvp, "jvp"), inputs, wrt,
                                                         names, seed, method, mode, eps, atol, rtol,
                                                         n_projections, False, None)
    out, _ = forward_output(forward, inputs)
    derivatives = {}
    looped = forward_evaluators(forward, inputs, wrt, names, False, rng) if settings.mode == "full" else {}
    for i in wrt:
        if settings.mode == "full":
            numeric = numeric_jacobian(forward, inputs, i, looped[i], out.size, settings.method,
                                        settings.h, False, None)[0]
            derivatives[i] = Derivatives(_jvp_jacobian(jvp, inputs, i, out.size), numeric,
                                         jacobian_index(out.shape, np.shape(inputs[i])),
                                         float(np.max(np.abs(out), initial=0)))
        else:
            derivatives[i] = _directions(forward, jvp, inputs, i, out, settings.method, settings.h,
                                         rng, settings.n_projections)
    return report_of(derivatives, names, settings, None, skipped)._replace(check="jvpcheck")
