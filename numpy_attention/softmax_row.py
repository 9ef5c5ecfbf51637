"""Step 5 of attention: the softmax of each row of scores, with the row's options (the sink,
the fully masked row's policy) and the row's log-sum-exp; forward, backward and tangent.

    P, lse, top = softmax_row(S, options)                          5.  P = softmax(S), lse
    dS, dsink = softmax_row_backward("vjp", dP, D, P, lse, top, dlse, options)
    P_dot, lse_dot = softmax_row_tangent(P, lse, S_dot, options)

On the whole scores S [..., H, N_q, N_k] (the textbook) or on a block of rows and columns
S[index] of the scores' score_shape (the blocked engine):

    forward    S_row = [S, sink_h]                 sinks: one more logit per row, with no value
               P_row = softmax(S_row),  lse = logsumexp(S_row)
               P = P_row without the sink's column (its weight multiplies nothing)
               a row whose scores are all -inf: P = the fully_masked policy's weight
               ('zero' 0, 'uniform' 1 / N_k, 'nan' NaN), lse = -inf (the sink, with sinks)
    backward   dS_row = P_row * (dP_row - rowsum(P_row * dP_row))   (+ P_row * dlse)
               dP_row = [dP, 0]: the sink has no value;  dS = dS_row but the last column,
               dsink = the last column (each row's; the sink's gradient sums them per head)
    tangent    lse_dot = <P_row, S_dot_row>,  P_dot = P_row * (S_dot_row - lse_dot)
               S_dot_row = [S_dot, sink_dot]

The backward's `method` (attention_backward's): 'vjp' the formula above, shifted at the row's
largest weight (softmax.py: exact for saturated rows); 'jacobian' J dP with J = diag(P) - P P^T;
'flash' P recomputed as exp(S - lse) and D = rowsum(dout * out) for rowsum(P * dP), as
FlashAttention's backward. The tiled engine's online softmax is its own form of this step
(engines/tiled.py, tested equal); the oracle's baselines compute it with a kernel's rounding
(oracle/naive.py, oracle/recipe.py) by row_weights, its arithmetic written out with their
exp, log and sums.
"""
import numpy as np

from .scores import WHOLE, heads_view
from .softmax import SoftmaxCache, softmax_and_logsumexp, softmax_backward, softmax_jacobian


def masked_row_weight(policy, n_k):
    """Each weight of a row whose keys are all masked, by the fully_masked policy: 'zero' 0,
    'uniform' 1 / N_k (the mean of v), 'nan' NaN."""
    return {"zero": 0.0, "uniform": 1.0 / max(n_k, 1), "nan": np.nan}[policy]


def row_weights(S_row, fill, exp=np.exp, log=np.log, total=lambda e: np.sum(e, axis=-1, keepdims=True)):
    """Step 5's arithmetic written out, for a baseline that rounds it as a kernel does: (P_row,
    lse) of S_row [..., rows, cols] (with_sink's), in S_row's dtype:
        m = max_j S_ij,  e = exp(S - m),  t = total(e),  lse = m + log(t),  P_row = e / t
    a row of all -inf: P_row = fill (masked_row_weight's), lse = -inf; a row with a score of +inf
    (one that overflowed a narrow dtype): NaN, for no weight stands in for it. exp, log and total
    (the row sums [..., rows, 1]) are the kernel's own: in a wider type, in chunks of keys."""
    m = np.max(S_row, axis=-1, keepdims=True, initial=-np.inf)
    dead = np.isneginf(m)
    m = np.where(dead, 0, m).astype(S_row.dtype)
    with np.errstate(divide="ignore", invalid="ignore"):     # log 0 = -inf; +inf - inf: NaN, as it should
        e = exp(S_row - m)
        t = total(e)
        lse = (m + log(t))[..., 0]
        return np.where(dead, fill, e / t).astype(S_row.dtype), lse.astype(S_row.dtype)


def with_sink(S, options, score_shape=None, index=WHOLE, sinks=None):
    """S[index] [..., rows, cols], with the sink as one more column [..., rows, cols + 1] when
    the options have sinks: a logit per head in every row's softmax, with no value.
    score_shape: the whole scores' shape (default S.shape: S is all of them). sinks: the
    column's values in the sinks' place (their tangent), default options.sinks."""
    if options.sinks is None:
        return S
    sinks = options.sinks if sinks is None else sinks
    sinks = heads_view(sinks, S.shape if score_shape is None else score_shape)[index[:-2]]
    column = np.broadcast_to(sinks[..., None, None], S.shape[:-1] + (1,))
    return np.concatenate([S, column.astype(S.dtype)], axis=-1)


def with_sink_weight(P, lse, options, score_shape=None, index=WHOLE):
    """The softmax's whole row: P [..., rows, cols] with the sink's weight exp(sink - lse) as one
    more column [..., rows, cols + 1] when the options have sinks; P itself without.
    lse [..., rows]; score_shape, index: as for with_sink."""
    if options.sinks is None:
        return P
    sink = with_sink(np.zeros(P.shape[:-1] + (0,), P.dtype), options, score_shape, index)
    with np.errstate(invalid="ignore"):              # a -inf sink in a dead row: -inf - (-inf), weight 0
        weight = np.where(np.isneginf(sink.real), 0, np.exp(sink - lse[..., None]))
    return np.concatenate([P, weight.astype(P.dtype, copy=False)], axis=-1)


def softmax_row(S, options, score_shape=None, index=WHOLE, out=None):
    """Step 5 forward on S [..., rows, cols] (S[index] of score_shape; S's memory is used as
    scratch): (P [..., rows, cols], lse [..., rows], top [..., rows, 1]), top each row's largest
    weight's column (the sink's, cols, when it is the largest; 0 in a fully masked row).
    out: an array of S's shape to write P into (the blocked engine's weights)."""
    o = options
    if o.sinks is None:
        P, lse, top = softmax_and_logsumexp(S, out=out, overwrite_z=True)
    else:                                           # the sink: one more logit, its weight dropped
        P_row, lse, top = softmax_and_logsumexp(with_sink(S, o, score_shape, index), overwrite_z=True)
        if out is None:
            P = np.ascontiguousarray(P_row[..., :-1])
        else:
            P = out
            P[...] = P_row[..., :-1]
    if o.fully_masked != "zero":                    # rows with every key masked
        np.copyto(P, masked_row_weight(o.fully_masked, P.shape[-1]), where=np.isneginf(lse.real)[..., None])
    return P, lse, top


def softmax_row_backward(method, dP, D, P, lse, top, dlse, options, score_shape=None, index=WHOLE,
                         scores=None, overwrite_dp=False):
    """Step 5 backward: (dS [..., rows, cols], dsink [..., rows] or None without sinks).

    dP, P [..., rows, cols]; D, lse [..., rows] (D = rowsum(dout * out)); top [..., rows, 1]
    (softmax_row's); dlse [..., rows] or None. scores() recomputes S_row (S with the sink's
    column) for 'flash', whose P = exp(S - lse) it then is; None: P is that already (the
    caller's, recomputed from lse). overwrite_dp=True lets dS take dP's memory.
    """
    P_row = with_sink_weight(P, lse, options, score_shape, index)
    if P_row.shape != dP.shape:                     # the sink's column of dP: 0, it has no value
        dP = np.concatenate([dP, np.zeros(dP.shape[:-1] + (1,), dP.dtype)], axis=-1)
    elif not overwrite_dp:
        dP = dP.copy()
    if method == "vjp":                             # dS = P * (dP - rowsum(P * dP))
        dS = softmax_backward(dP, SoftmaxCache(p=P_row, top=top), overwrite_dp=True)
    elif method == "jacobian":                      # dS = J dP, J = diag(P) - P P^T per row
        dS = (softmax_jacobian(P_row) @ dP[..., None])[..., 0]
    elif method == "flash":                         # dS = P * (dP - D), P = exp(S - lse)
        dS = dP
        dS -= D[..., None]
        dS *= P_row if scores is None else weights_from_lse(scores(), lse)
    else:
        raise ValueError(f"method must be 'vjp', 'jacobian' or 'flash', got {method!r}")
    if dlse is not None:                            # lse = log rowsum exp(S): dS += P * dlse
        dS += P_row * dlse[..., None]
    if options.sinks is None:
        return dS, None
    return np.ascontiguousarray(dS[..., :-1]), dS[..., -1]


def weights_from_lse(S_row, lse):
    """exp(S - lse) in S_row's memory, 0 in a fully masked row (where S - lse is -inf - (-inf))."""
    with np.errstate(invalid="ignore"):
        S_row -= lse[..., None]
    P = np.exp(S_row, out=S_row)
    P[np.isneginf(lse.real)] = 0
    return P


def softmax_row_tangent(P, lse, S_dot, options, sinks_dot=None, score_shape=None, index=WHOLE):
    """Step 5 in forward mode: (P_dot_row [..., rows, cols (+ 1 with sinks)], lse_dot [..., rows]),
    the weights' tangent on the softmax's whole row (P_dot_row[..., :cols]: P's). P, lse:
    softmax_row's; S_dot the scores' tangent; sinks_dot [H] the sinks' (None: 0); score_shape,
    index: as for with_sink. A row the 'nan' policy fills has NaN tangents too."""
    o = options
    P_row = with_sink_weight(P, lse, o, score_shape, index)
    if o.sinks is not None:
        S_dot = with_sink(S_dot, o, score_shape, index,
                          sinks=np.zeros_like(o.sinks) if sinks_dot is None else sinks_dot)
    lse_dot = np.sum(P_row * S_dot, axis=-1)
    P_dot_row = P_row * (S_dot - lse_dot[..., None])
    if o.fully_masked == "nan":
        P_dot_row = np.where(np.isneginf(lse.real)[..., None], np.nan, P_dot_row)
    return P_dot_row, lse_dot
