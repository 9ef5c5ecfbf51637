"""The textbook: scaled dot-product attention and its hand-written backward, the module to read first.

First the blog's attention in plain NumPy, each line under the formula it computes
(plain_attention_forward, plain_attention_backward):

    forward                                backward (the gradients of <dout, out>)
    S = q k^T / sqrt(d_k)                  dv = P^T dout,  dP = dout v^T
    P = softmax(S)                         dS = P * (dP - rowsum(P * dP))
    out = P v                              dq = dS k / sqrt(d_k),  dk = dS^T q / sqrt(d_k)

Then the same steps with every option in its place (textbook_forward, textbook_backward):
the spec, on whole arrays, which every engine (attention.py's dispatcher runs them) is
tested equal to. Derivations: docs/derivations.md.

Shape legend:
    ...   leading batch axes (any number, the same for q, k and v)
    H     query heads,  H_kv key/value heads (H_kv divides H; G = H / H_kv queries share a kv head)
    N_q   query length,  N_k key length,  d_k query/key width,  d_v value width

    q [..., H, N_q, d_k]   k [..., H_kv, N_k, d_k]   v [..., H_kv, N_k, d_v]   ->   out [..., H, N_q, d_v]

Arrays with two axes ([N, d]) are a single head.

Forward, in this order (the blog's, with every option in its place):
    1. S = scale * q k^T                    scale defaults to 1 / sqrt(d_k)
    2. S = softcap * tanh(S / softcap)      only when softcap is set
    3. S = S + bias + log c + alibi         bias broadcasts to [..., H, N_q, N_k]; c > 1 the times
                                            a top-k list names the key (topk_indices, a constant);
                                            alibi = -slope |i + N_k - N_q - j|, each row's slope
                                            its head's, or its sequence's with [B, H] slopes
       S = score_mod(S, b, h, q_idx, kv_idx)   FlexAttention's, when given
    4. S = -inf where not kept              keep = mask & causal & window & mask_mod & listed
                                            (True = attend)
    (steps 2-4 are scores.py's, the score pipeline every engine applies to its blocks;
     max_logits = each row's largest S, QK-clip's statistic: scores.row_max)
    5. P = softmax(S), lse = logsumexp(S)   rows of all -inf: the `fully_masked` policy;
                                            sinks: one more logit per row, with no value
                                            (softmax_row.py, forward, backward and tangent)
    6. P~ = P * dropout_mask / (1 - dropout_p)
    7. out = P~ v
    8. out = out * sigmoid(gate)            only with an output gate: gate.py, which attention.py
                                            applies around every engine (the cache keeps step 7's)

Backward, the same steps in reverse (derivations in docs/derivations.md):
    8. dgate = dout * out_7 * sigmoid'(gate) summed to gate's shape,  dout = dout * sigmoid(gate)
    7. dv = P~^T dout,  dP~ = dout v^T
    6. dP = dP~ * dropout_mask / (1 - dropout_p)
    5. dS = P * (dP - rowsum(P * dP))       = P * (dP - D),  D = rowsum(dout * out)
       (+ P * dlse for a gradient of lse;  dsink = P_sink * (dlse - D) summed over rows)
    4. dS = 0 where S = -inf                 (masked scores do not depend on anything)
    3. score_mod: dS = dS * score_mod'(S) (complex step), and its parameters' gradients;
       dbias = dS summed to bias's shape;  dalibi_slopes = -sum dS * |i + N_k - N_q - j|
       over each slope's rows (its head's; with [B, H] slopes, its sequence's)
    2. dS = dS * (1 - tanh^2(S / softcap))
    1. dq = scale * dS k,  dk = scale * dS^T q   (dk, dv summed over each query group)
"""
import numpy as np

from ._checks import as_float_array
from ._layout import grouped_matmul, grouped_sum_matmul, scaled, with_head_axis
from .caches import TEXTBOOK, AttentionCache, AttentionGrads, AttentionStages
from . import scores
from .score_grads import ScoreGrads
from .scores import WHOLE, attention_scores
from .softmax import plain_softmax
from .softmax_row import softmax_row, softmax_row_backward, with_sink


def _t(x):
    """x^T: the transpose of the last two axes (a view)."""
    return np.swapaxes(x, -1, -2)


# ----------------------------------------------------------------------------- the blog's attention

def plain_attention_forward(q, k, v):
    """out = softmax(q k^T / sqrt(d_k)) v, and P: q [..., N_q, d_k], k [..., N_k, d_k],
    v [..., N_k, d_v] -> out [..., N_q, d_v], P [..., N_q, N_k] (the same heads in q, k, v)."""
    q, k, v = _plain_checked(q=q, k=k, v=v)
    S = q @ _t(k) / np.sqrt(q.shape[-1])                # S = q k^T / sqrt(d_k)       [..., N_q, N_k]
    P = plain_softmax(S)                                # P = softmax(S), each row sums to 1
    return P @ v, P                                     # out = P v                   [..., N_q, d_v]


def plain_attention_backward(dout, q, k, v, P):
    """The gradients of <dout, out> for plain_attention_forward's out (P its weights):
    dq [..., N_q, d_k], dk [..., N_k, d_k], dv [..., N_k, d_v]."""
    dout, q, k, v, P = _plain_checked(dout=dout, q=q, k=k, v=v, P=P)
    dv = _t(P) @ dout                                   # out = P v:        dv = P^T dout
    dP = dout @ _t(v)                                   #                   dP = dout v^T
    dS = P * (dP - np.sum(P * dP, axis=-1, keepdims=True))   # P = softmax(S): dS = P * (dP - rowsum(P * dP))
    dq = dS @ k / np.sqrt(q.shape[-1])                  # S = q k^T / sqrt(d_k): dq = dS k / sqrt(d_k)
    dk = _t(dS) @ q / np.sqrt(q.shape[-1])              #                        dk = dS^T q / sqrt(d_k)
    return dq, dk, dv


def _plain_checked(**arrays):
    """The plain form's arrays as float (or complex) arrays, checked against each other: q
    [..., N_q, d_k], k [..., N_k, d_k], v [..., N_k, d_v], dout [..., N_q, d_v], P [..., N_q, N_k]
    (the same leading axes). ValueError / TypeError naming them and their shapes."""
    x = {name: as_float_array(value, name) for name, value in arrays.items()}
    shapes = ", ".join(f"{name} {a.shape}" for name, a in x.items())
    if any(a.ndim < 2 for a in x.values()):
        raise ValueError(f"each array needs at least two axes [..., N, d]: {shapes}")
    q, k, v = x["q"], x["k"], x["v"]
    want = {"k": q.shape[:-2] + (k.shape[-2], q.shape[-1]), "v": q.shape[:-2] + (k.shape[-2], v.shape[-1]),
            "dout": q.shape[:-1] + (v.shape[-1],), "P": q.shape[:-1] + (k.shape[-2],)}
    for name, a in x.items():
        if name in want and a.shape != want[name]:
            raise ValueError(f"{name} must be {want[name]} for q {q.shape} (q [..., N_q, d_k], k [..., N_k, d_k], "
                             f"v [..., N_k, d_v], dout [..., N_q, d_v], P [..., N_q, N_k]): {shapes}")
    return tuple(x.values())


# ----------------------------------------------------------------------------- every option

def textbook_forward(q, k, v, options, plan=TEXTBOOK):
    """out = softmax(scale q k^T [+ options]) v on whole arrays, the steps of the module docstring.

    q, k, v and options as `attention_options` returns them; the plan is the textbook's.
    Returns out [..., H, N_q, d_v] and an AttentionCache.
    """
    o = options
    S, saved = attention_scores(q, k, o)            # 1-4.                    [..., H, N_q, N_k]
    max_logits = scores.row_max(S, o)               #    each row's largest score  [..., H, N_q]
    P, lse, top = softmax_row(S, o)                 # 5. P = softmax(S), lse = logsumexp(S)  (S is
                                                    #    used up); sinks, fully masked rows: softmax_row.py
    P_drop = P if o.dropout_scale is None else P * o.dropout_scale   # 6. dropout
    out = grouped_matmul(P_drop, v)                 # 7. out = P~ v           [..., H, N_q, d_v]
    return out, AttentionCache(options=o, q=q, k=k, v=v, out=out.copy(), weights=P, lse=lse,
                               top=top[..., 0], saved=saved, plan=plan, max_logits=max_logits)


def textbook_backward(dout, cache, dlse=None, *, method="vjp", return_stages=False):
    """Gradients of `textbook_forward`: its steps in reverse on whole arrays.

    dout [..., H, N_q, d_v] and dlse [..., H, N_q] or None (checked by attention_backward).
    method: how step 5 is differentiated (see attention_backward). Returns AttentionGrads.
    """
    o, q, k, v, P = cache.options, cache.q, cache.k, cache.v, cache.weights
    h_kv = with_head_axis(k).shape[-3]
    P_drop = P if o.dropout_scale is None else P * o.dropout_scale
    dv = grouped_sum_matmul(P_drop, dout, h_kv)     # 7. out = P~ v:  dv = P~^T dout   [..., H_kv, N_k, d_v]
    dP = grouped_matmul(dout, _t(v))                #                 dP~ = dout v^T  [..., H, N_q, N_k]
    if o.dropout_scale is not None:                 # 6. dP = dP~ * dropout_mask / (1 - p)
        dP = dP * o.dropout_scale
    D = np.sum(dout * cache.out, axis=-1)           # 5. D = rowsum(dout * out) = rowsum(P * dP)
    recompute = lambda: with_sink(attention_scores(q, k, o)[0], o)   # S_row again, for 'flash'
    dS, dsink = softmax_row_backward(method, dP, D, P, cache.lse, cache.top[..., None], dlse, o,
                                     scores=recompute)   # dS = P * (dP - D) (+ P * dlse)
    params = ScoreGrads(o, P.shape, dS.dtype)       #    the parameters' gradients (the sink's, then
    if dsink is not None:                           #    4-2. score_mod's, the bias's, ALiBi's)
        params.add_sink(np.sum(dsink, axis=-1), WHOLE)
    dS_softcap, dS = scores.backward(dS, o, saved=cache.saved, grads=params, stage=True)   # 4-2.
    dq = scaled(grouped_matmul(dS_softcap, k), o.scale)   # 1. S = scale q k^T:  dq = scale dS k
    dk = scaled(grouped_sum_matmul(dS_softcap, q, h_kv), o.scale)   #    dk = scale dS^T q
    stages = AttentionStages(dP=dP, dS=dS, D=D) if return_stages else None
    return AttentionGrads(dq=dq, dk=dk, dv=dv, stages=stages, **ScoreGrads.total([params], o, P.shape, dS.dtype))
