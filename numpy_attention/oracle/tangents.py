"""Forward mode in the oracle: a candidate's tangents out_dot, lse_dot along q_dot, k_dot, v_dot.

    oracle     attention_jvp (forward_mode.py) in float64 (np.longdouble for a float64 case)
    baseline   the same in the candidate's precision (float32 or float64), its scale one ulp
               off like the naive baseline's (verdicts.py)
A tangent left out of the case is 0. With rope, q, k, q_dot and k_dot are turned alike, in
the precision's way (rotary.py: float32 angles for a float32 baseline). The rule is the same
(rule.py).
"""
import numpy as np

from ..forward_mode import attention_jvp
from ..options import attention_options
from .schema import FLOAT_OPTIONS, CaseError
from .rotary import turn_qk

TANGENTS = ("q_dot", "k_dot", "v_dot")


def jvp_results(inputs, options, dtype, scale_factor=1.0):
    """{out_dot, lse_dot} of the case in `dtype`: inputs and tangents rounded to it, the scale
    (times scale_factor) applied to q and q_dot (attention_jvp then runs with scale 1, so
    an np.longdouble oracle keeps its digits)."""
    work = np.result_type(dtype, np.float32)
    cast = lambda x: None if x is None else x.astype(dtype).astype(work)
    q, k, v, q_dot, k_dot, v_dot = (cast(inputs.get(name)) for name in ("q", "k", "v") + TANGENTS)
    options = {name: cast(x) if name in FLOAT_OPTIONS else x for name, x in options.items()}
    given, rope = options.pop("scale", None), options.pop("rope", None)
    options.pop("implementation", None)
    scale = (1 / np.sqrt(work.type(q.shape[-1])) if given is None else work.type(given)) * work.type(scale_factor)
    try:
        if rope is not None:                           # q, k and their tangents turned alike
            record = attention_options(q, k, v, **options)[3]
            q_dot, k_dot = (np.zeros_like(x) if x_dot is None else x_dot for x, x_dot in ((q, q_dot), (k, k_dot)))
            (q, k, _), (q_dot, k_dot, _) = (turn_qk(a, b, rope, record, work) for a, b in ((q, k), (q_dot, k_dot)))
        q_dot = None if q_dot is None else q_dot * scale
        _, out_dot, _, lse_dot = attention_jvp(q * scale, k, v, q_dot, k_dot, v_dot, scale=1.0,
                                               implementation="textbook", **options)   # (top-k: dense)
    except (ValueError, TypeError) as exc:
        raise CaseError(str(exc)) from None
    return {"out_dot": out_dot, "lse_dot": np.where(np.isneginf(lse_dot), 0, lse_dot)}


def add_tangents(case, truth, bases, wide):
    """Put the oracle's and the baseline's out_dot, lse_dot into truth and each baseline dict."""
    truth.update(jvp_results(case.inputs, case.options, wide))
    work = case.precision.compute
    baseline = jvp_results(case.inputs, case.options, work, 1 + np.finfo(work).eps)
    for base in bases:
        base.update(baseline)
