"""Attention in forward mode and to second order: the textbook's steps carrying tangents.

Shape legend as in textbook.py; a dot marks a tangent (a direction of the inputs), of its
primal's shape: q_dot [..., H, N_q, d_k], k_dot, v_dot like k, v.

attention_jvp: the directional derivative of (out, lse) along (q_dot, k_dot, v_dot) (and the
tangents of the options with a gradient, OPTION_TANGENTS: bias_dot, ...), the forward's steps
differentiated in order:

    1. S_dot = scale (q_dot k^T + q k_dot^T)
    2. S_dot = (1 - tanh^2(S / c)) S_dot                           a soft cap c
    3. S_dot = S_dot + bias_dot - slope_dot |i + N_k - N_q - j|    bias, ALiBi
    4. S_dot = 0 where masked
    5. P_dot = P * (S_dot - <P, S_dot>),  lse_dot = <P, S_dot>     rows with the sink's column
    6. P~_dot = P_dot * keep / (1 - p)                             dropout's keep-mask
    7. out_dot = P~_dot v + P~ v_dot
    8. out_dot = out_dot sigmoid(g) + out sigmoid'(g) g_dot          an output gate (gate.py)
With rope, q and k are turned first (rope.py) and so are their tangents, rope being linear:
q_dot <- R_q q_dot, k_dot <- R_k k_dot.

attention_hvp: forward over reverse. The backward's steps (textbook.py) differentiated along
the same tangents give the tangents of (dq, dk, dv) for a fixed dout: Hessian-vector
products of <dout, out> (torch's double backward, JAX's jvp of grad):

    7. dv_dot = P~_dot^T dout,   dP_dot = dout v_dot^T (* dropout)
    5. dS = P (dP - D), D = rowsum(P dP):
       dS_dot = P_dot (dP - D) + P (dP_dot - D_dot),  D_dot = rowsum(P_dot dP + P dP_dot)
    4. 0 where masked
    2. dS0 = dS (1 - t^2):  dS0_dot = dS_dot (1 - t^2) - 2 dS t t_dot,  t_dot = (1 - t^2) S0_dot / c
    1. dq_dot = scale (dS0_dot k + dS0 k_dot),  dk_dot = scale (dS0_dot^T q + dS0^T q_dot)
    (rope: the turned q, k and tangents above; dq, dq_dot turned back by R_q^T, dk, dk_dot by R_k^T)

Derivations: docs/derivations.md, "Forward mode and second order".
"""
import inspect

import numpy as np

from ._checks import as_float_array
from ._layout import grouped_matmul, grouped_sum_matmul, scaled, with_head_axis
from .textbook import textbook_forward
from .caches import AttentionGrads
from .engines.plan import attention_plan
from .engines.sparse import sparse_jvp
from .engines.tiled import tiled_jvp
from .gate import gate_jvp
from . import scores
from .options import OPTIONS, attention_options
from .rope import rope_apply, rope_backward, rope_qk
from .softmax_row import softmax_row_tangent, with_sink_weight


def _t(x):
    return np.swapaxes(x, -1, -2)


def _tangent(x, like, name, dtype):
    """A tangent of `like`'s shape as an array of the computation's dtype; None is zeros."""
    if x is None:
        return np.zeros(like.shape, dtype)
    x = as_float_array(x, name)
    if x.shape != like.shape:
        raise ValueError(f"{name} must have its primal's shape {like.shape}, got {x.shape}")
    return x.astype(np.result_type(dtype, x.dtype), copy=False)


# attention_jvp's tangent of each option with a gradient (bias_dot, ...) -> the step it acts in
OPTION_TANGENTS = {f"{row.name}_dot": row.acts for row in OPTIONS if row.gradient}


def _at_step(dot, acts):
    """The tangents in `dot` of the options that act in `acts` ('score', 'row' or 'output')."""
    return {name: dot[name] for name, where in OPTION_TANGENTS.items() if where == acts}


def _scores_tangent(q, k, o, q_dot, k_dot, saved, score_dots):
    """Steps 1-4 in forward mode: S_dot [..., H, N_q, N_k] (saved: the forward's scores.Saved;
    score_dots: the score steps' option tangents, scores.tangent's)."""
    S_dot = scaled(grouped_matmul(q_dot, _t(k)) + grouped_matmul(q, _t(k_dot)), o.scale)   # 1.
    return scores.tangent(S_dot, o, saved=saved, **score_dots)   # 2-4.


def _primal_and_tangents(q, k, v, tangents, options, engines=("textbook",)):
    """(q, k, v, options record, plan, textbook cache (None for the tiled and sparse engines),
    dict of tangents, rope caches or None) checked, the tangents in the computation's dtype (a
    tangent left None: zeros for q, k, v; None for the others); with rope, q, k and their
    tangents turned. engines: the implementations this call runs (default: textbook; the
    sparse engine, where it is one, for topk_indices without an implementation)."""
    if options.get("implementation") in ("blocked", "tiled", "sparse") and options["implementation"] not in engines:
        named = engines[0] if len(engines) == 1 else f"{', '.join(engines[:-1])} or {engines[-1]}"
        raise ValueError(f"this runs on the {named} engine, not "
                         f"implementation={options['implementation']!r}")
    if options.get("page_table") is not None or options.get("cache_seqlens") is not None:
        raise ValueError("forward mode takes packed sequences (cu_seqlens), not a paged KV cache")
    rope = options.get("rope")
    options = {name: x for name, x in options.items() if name not in ("page_table", "cache_seqlens", "rope")}
    implementation = options.pop("implementation", None)
    if implementation is None:
        implementation = ("sparse" if options.get("topk_indices") is not None and "sparse" in engines else
                          "tiled" if options.get("block_size") is not None and "tiled" in engines else "textbook")
    if implementation == "textbook" and options.get("block_size") is not None:
        raise ValueError("this runs on the textbook engine; block_size belongs to the tiled and sparse ones")
    planned = {name: options.pop(name) for name in ("block_size", "workers", "scheduler") if name in options}
    q, k, v, o = attention_options(q, k, v, **options)
    plan = attention_plan(o, q.shape, k.shape, implementation=implementation, **planned)
    turned = None
    if rope is not None:                               # q, k turned by their positions
        q, k, turned = rope_qk(q, k, rope, o)
    cache = textbook_forward(q, k, v, o, plan)[1] if implementation == "textbook" else None
    primals = {"q_dot": q, "k_dot": k, "v_dot": v,                    # and each option with a gradient
               **{f"{row.name}_dot": getattr(o, row.name) for row in OPTIONS if row.gradient}}
    checked = {}
    for name, x in tangents.items():
        if x is None and name in ("q_dot", "k_dot", "v_dot"):
            checked[name] = np.zeros(primals[name].shape, q.dtype)
        elif x is not None:
            if primals[name] is None:
                raise ValueError(f"{name} is the tangent of an option this call does not have")
            checked[name] = _tangent(x, primals[name], name, q.dtype)
        else:
            checked[name] = None
    if turned is not None:                             # rope is linear: the tangents turn alike
        checked["q_dot"], checked["k_dot"] = (rope_apply(checked[name], at)
                                              for name, at in zip(("q_dot", "k_dot"), turned))
    return q, k, v, o, plan, cache, checked, turned


def _with_tangents(function):
    """function, taking the option tangents in its **options, with a __signature__ that names them."""
    params = list(inspect.signature(function).parameters.values())
    tangents = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in OPTION_TANGENTS]
    function.__signature__ = inspect.Signature(params[:-1] + tangents + params[-1:])
    return function


@_with_tangents
def attention_jvp(q, k, v, q_dot=None, k_dot=None, v_dot=None, **options):
    """(out, out_dot, lse, lse_dot): attention and its tangent along the inputs' tangents.

    options: attention_forward's (options.OPTIONS, rope, the keep steps); computed by the
    textbook, or with implementation='tiled' (or a block_size) by the tiled engine's online
    softmax carrying the tangents (engines/tiled.py, tiled_jvp: O(N) memory), or with
    topk_indices by the sparse engine (engines/sparse.py, sparse_jvp; implementation='textbook'
    computes it densely). An option with a gradient takes a tangent of its shape under its name
    and '_dot' (OPTION_TANGENTS: bias_dot, ...). A tangent left None is 0. With a gate, out and
    out_dot are the gated ones (gate.py), lse and lse_dot the attention's.
    """
    dots = {name: options.pop(name, None) for name in OPTION_TANGENTS}
    q, k, v, o, plan, cache, dot, _ = _primal_and_tangents(q, k, v, dict(
        q_dot=q_dot, k_dot=k_dot, v_dot=v_dot, **dots), options, engines=("textbook", "tiled", "sparse"))
    if cache is None:                                  # the tiled or sparse engine: O(N) memory
        jvp = tiled_jvp if plan.implementation == "tiled" else sparse_jvp
        out, out_dot, lse, lse_dot = jvp(q, k, v, o, plan, dot["q_dot"], dot["k_dot"], dot["v_dot"],
                                         _at_step(dot, "score"), _at_step(dot, "row"))
    else:
        out, out_dot, lse, lse_dot = _textbook_jvp(q, k, v, o, cache, dot)
    if o.gate is not None:                             # 8. out = O * sigmoid(gate)
        out, out_dot = gate_jvp(out, out_dot, o.gate, dot["gate_dot"])
    return out, out_dot, lse, lse_dot


def _textbook_jvp(q, k, v, o, cache, dot):
    """(O, O_dot, lse, lse_dot) on the textbook's cache: steps 1-7 carrying the tangents."""
    S_dot = _scores_tangent(q, k, o, dot["q_dot"], dot["k_dot"], cache.saved, _at_step(dot, "score"))   # 1-4.
    P_dot, lse_dot = softmax_row_tangent(cache.weights, cache.lse, S_dot, o, **_at_step(dot, "row"))   # 5.
    P_dot = P_dot[..., :S_dot.shape[-1]]              # (the sink's column multiplies no value)
    drop = 1 if o.dropout_scale is None else o.dropout_scale
    out_dot = grouped_matmul(P_dot * drop, v) + grouped_matmul(cache.weights * drop, dot["v_dot"])   # 6-7.
    return cache.out.copy(), out_dot, cache.lse, lse_dot


def attention_hvp(q, k, v, dout, q_dot=None, k_dot=None, v_dot=None, **options):
    """(grads, grads_dot): attention's gradients for the upstream gradient dout, and their
    tangents along (q_dot, k_dot, v_dot): AttentionGrads of dq_dot, dk_dot, dv_dot, the
    Hessian of <dout, out> times the tangent (forward over reverse; module docstring).

    options as attention_jvp's (the options' own values are constants here), but no score_mod
    (its second derivative would be needed) and no gate.
    """
    if options.get("score_mod") is not None:
        raise ValueError("attention_hvp takes no score_mod: the Hessian needs its second derivative, which "
                         "the oracle does not take; mask_mod is accepted")
    if options.get("gate") is not None:
        raise ValueError("attention_hvp takes no gate: its Hessian is of attention alone (steps 1-7)")
    q, k, v, o, _, cache, dot, turned = _primal_and_tangents(q, k, v, dict(q_dot=q_dot, k_dot=k_dot,
                                                                           v_dot=v_dot), options)
    if dout is None:
        raise TypeError("attention_hvp needs dout, the upstream gradient the Hessian is of <dout, out>")
    dout = _tangent(dout, cache.out, "dout", q.dtype)
    h_kv, n_k = with_head_axis(k).shape[-3], cache.weights.shape[-1]
    drop = 1 if o.dropout_scale is None else o.dropout_scale
    S_dot = _scores_tangent(q, k, o, dot["q_dot"], dot["k_dot"], cache.saved, {})   # 1-4., no option's tangent
    P_row = with_sink_weight(cache.weights, cache.lse, o)
    P_dot_row = softmax_row_tangent(cache.weights, cache.lse, S_dot, o)[0]
    pad = lambda x: x if P_row.shape[-1] == n_k else np.concatenate(                     # the sink's
        [x, np.zeros(x.shape[:-1] + (P_row.shape[-1] - n_k,), x.dtype)], -1)               # column: 0
    dP, dP_dot = (pad(grouped_matmul(dout, _t(x)) * drop) for x in (v, dot["v_dot"]))     # 7.
    dv = grouped_sum_matmul(cache.weights * drop, dout, h_kv)
    dv_dot = grouped_sum_matmul(P_dot_row[..., :n_k] * drop, dout, h_kv)
    D = np.sum(P_row * dP, axis=-1, keepdims=True)                                       # 5.
    D_dot = np.sum(P_dot_row * dP + P_row * dP_dot, axis=-1, keepdims=True)
    dS = (P_row * (dP - D))[..., :n_k]
    dS_dot = (P_dot_row * (dP - D) + P_row * (dP_dot - D_dot))[..., :n_k]
    dS, dS_dot = scores.backward_tangent(dS, dS_dot, S_dot, o, cache.saved)   # 4-2.
    q_dot, k_dot = dot["q_dot"], dot["k_dot"]
    grads = AttentionGrads(dq=scaled(grouped_matmul(dS, k), o.scale), dk=scaled(grouped_sum_matmul(dS, q, h_kv), o.scale),
                           dv=dv, dbias=None)
    grads_dot = AttentionGrads(                                                          # 1.
        dq=scaled(grouped_matmul(dS_dot, k) + grouped_matmul(dS, k_dot), o.scale),
        dk=scaled(grouped_sum_matmul(dS_dot, q, h_kv) + grouped_sum_matmul(dS, q_dot, h_kv), o.scale),
        dv=dv_dot, dbias=None)
    if turned is not None:                                                               # rope: back
        back = lambda g: g._replace(dq=rope_backward(g.dq, turned[0]), dk=rope_backward(g.dk, turned[1]))
        grads, grads_dot = back(grads), back(grads_dot)
    return grads, grads_dot
