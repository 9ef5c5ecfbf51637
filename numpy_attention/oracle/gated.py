"""A baseline's output gate (gate.py), applied as a kernel applies it after its attention:
each op rounded to the baseline's precision (naive.py's dtype, the recipe's T).

    dO = dout * sigmoid(g)              the attention's upstream gradient (gated_dout)
    out = O * sigmoid(g)                dgate = sum over g's broadcast axes of dout * O * s (1 - s)

and the term magnitudes for the rule's atol under a gate (attention_case, gated_magnitudes).
"""
import numpy as np

from .._layout import unbroadcast
from ..gate import sigmoid


def gated_dout(dout, gate, rnd=lambda x: x):
    """The attention's upstream gradient under an output gate (gate.py): dO = dout * sigmoid(gate),
    each op rounded by rnd (a baseline's precision); dout itself without a gate (or dout None)."""
    return dout if dout is None or gate is None else rnd(dout * rnd(sigmoid(gate)))


def gated(result, dout, gate, rnd=lambda x: x):
    """A baseline's result with the output gate applied after its attention O = result["out"],
    as a kernel applies it (each op rounded by rnd): out = O * sigmoid(gate), and with dout
    dgate = the sum over gate's broadcast axes of dout * O * s (1 - s), s = sigmoid(gate)."""
    if gate is None:
        return result
    o, s = result["out"], rnd(sigmoid(gate))
    result = {**result, "out": rnd(o * s)}
    if dout is not None:
        result["dgate"] = rnd(unbroadcast(rnd(rnd(dout * o) * rnd(s * (1 - s))), np.shape(gate)))
    return result


def attention_case(case, truth):
    """(case, truth) of the attention under a case's output gate, for its term magnitudes: dout
    times sigmoid(gate) (the attention's upstream gradient) and out over it (O = P V); the two
    as they are without a gate."""
    gate = case.options.get("gate")
    if gate is None:
        return case, truth
    s = sigmoid(np.asarray(gate, np.float64))
    inputs = {**case.inputs, **({"dout": case.inputs["dout"] * s} if "dout" in case.inputs else {})}
    return case._replace(inputs=inputs), {**truth, "out": truth["out"] / s}


def gated_magnitudes(mags, case, truth):
    """The term magnitudes of the attention (attention_case's) as the gated results': out's
    times the largest sigmoid(gate) (each entry's terms times its own), and dgate's, the sums
    of |dout * O * s (1 - s)| over gate's broadcast axes (from the oracle's out = O * s)."""
    gate = case.options.get("gate")
    if gate is None:
        return mags
    s = sigmoid(np.asarray(gate, np.float64))
    mags = {**mags, "out": mags["out"] * float(np.max(s))}
    if "dout" in case.inputs:
        mags["dgate"] = float(np.max(unbroadcast(np.abs(case.inputs["dout"] * truth["out"] * (1 - s)),
                                                 np.shape(gate)), initial=0))
    return mags
