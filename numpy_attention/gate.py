"""The output gate (Qwen3-Next's gated attention): attention's output times sigmoid(gate).

    O = P V                      [..., H, N_q, d_v], the attention (every engine's out)
    out = O * sigmoid(g)         g broadcastable to O: [..., H, N_q, 1] one gate a head and
                                 query (headwise), or [..., H, N_q, d_v] (elementwise)

    backward  dO = dout * sigmoid(g)
              dg = sum over g's broadcast axes of dout * O * sigmoid(g) (1 - sigmoid(g))
    tangent   out_dot = O_dot * sigmoid(g) + O * sigmoid(g) (1 - sigmoid(g)) g_dot

lse is the attention's, unchanged by the gate. attention.py applies the gate around every
engine (an engine's cache holds O).
"""
import numpy as np

from ._layout import unbroadcast


def _exp_minus_abs(x):
    """(e, negative): e = exp(-|x|) (of x's real part's sign: exp(x) where Re x < 0, else
    exp(-x); complex for a complex x, for complex step), never overflowing."""
    x = np.asarray(x)
    negative = x.real < 0
    return np.exp(np.where(negative, x, -x)), negative


def sigmoid(x):
    """s(x) = 1 / (1 + exp(-x)), as 1 / (1 + e) for x >= 0 and e / (1 + e) below, e = exp(-|x|):
    no overflow, and each side to a few ulps relatively (1 + tanh(x / 2) would lose them)."""
    e, negative = _exp_minus_abs(x)
    return np.where(negative, e, 1) / (1 + e)


def sigmoid_slope(x):
    """s'(x) = s(x) (1 - s(x)) = e / (1 + e)^2, e = exp(-|x|) (1 - s would cancel for a large x)."""
    e, _ = _exp_minus_abs(x)
    return e / (1 + e) ** 2


def gate_forward(o, gate):
    """out = O * sigmoid(gate): o [..., H, N_q, d_v], gate broadcastable to it."""
    return o * sigmoid(gate)


def gate_backward(dout, o, gate):
    """(dO, dgate): dO = dout * sigmoid(g) of o's shape, dgate of gate's shape."""
    return dout * sigmoid(gate), unbroadcast(dout * o * sigmoid_slope(gate), np.shape(gate))


def gate_jvp(o, o_dot, gate, gate_dot=None):
    """(out, out_dot) along O's tangent o_dot and the gate's gate_dot (None: 0)."""
    s = sigmoid(gate)
    out_dot = o_dot * s
    if gate_dot is not None:
        out_dot = out_dot + o * (sigmoid_slope(gate) * gate_dot)
    return o * s, out_dot
