"""A baseline's output gate (gate.py), applied as a kernel applies it after its attention:
each op rounded to the baseline's precision (naive.py's dtype, the recipe's T).

    dO = dout * sigmoid(g)              the attention's upstream gradient (gated_dout)
    out = O * sigmoid(g)                dgate = sum over g's broadcast axes of dout * O * s (1 - s)

and dgate's term magnitude for the rule's atol (dgate_magnitude).
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


def dgate_magnitude(dout, out, gate):
    """dgate's largest sum of |terms| (magnitudes.py), |dout * O * s (1 - s)| summed over gate's
    broadcast axes, from the oracle's out = O * s."""
    s = sigmoid(np.asarray(gate, np.float64))
    return float(np.max(unbroadcast(np.abs(dout * out * (1 - s)), np.shape(gate)), initial=0))
