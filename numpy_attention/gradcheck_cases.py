"""Small random cases of every op and attention variant, as (forward, backward, inputs, names),
for gradient checks (`numpy-attention gradcheck` runs them; so do the tests); their forward
mode as (forward, jvp, inputs, names) for jvpcheck; and the identities between derivatives.

    forward(*inputs) -> (out, cache)          backward(dout, cache) -> gradients in input order

Inputs are float64 draws from the given numpy Generator; names label the table's rows.
"""
from functools import partial

import numpy as np

from .attention import attention_backward, attention_forward
from .forward_mode import attention_hvp, attention_jvp
from .heads import merge_heads, split_heads
from .linear import linear_backward, linear_forward, linear_jvp
from .multihead import MultiHeadAttention, multihead_backward, multihead_forward
from .options import OPTIONS, Sizes
from .softmax import softmax_backward, softmax_forward, softmax_jvp

MHA_INPUTS = ("query", "key", "value")
GRADIENT_OF = {row.name: row.gradient for row in OPTIONS if row.gradient}   # an option -> its gradient


def mha_functions(mha, **attention_options):
    """(forward, backward, parameter keys): the module `mha` as a function of
    (query, key, value, *params), params in state_dict order, for gradcheck."""
    keys = list(mha.params)

    def forward(query, key, value, *params):
        out, _, cache = multihead_forward(query, key, value, dict(zip(keys, params)),
                                          mha.num_heads, **attention_options)
        return out, cache

    def backward(dout, cache):
        grads = multihead_backward(dout, cache)
        return [grads[name] for name in MHA_INPUTS + tuple(keys)]

    return forward, backward, keys


def attention_case(rng, shape_q=(2, 2, 3, 4), shape_kv=(2, 2, 5, 4), d_v=3, **options):
    """(forward, backward, [q, k, v(, bias)], names) for attention with `options`:
    q [*shape_q], k [*shape_kv], v [*shape_kv[:-1], d_v].

    A `bias` option given as a shape becomes a random bias input that is checked too.
    """
    qkv = [rng.standard_normal(shape) for shape in (shape_q, shape_kv, shape_kv[:-1] + (d_v,))]
    bias_shape = options.pop("bias", None)
    return _checked_case(qkv, options, {} if bias_shape is None else {"bias": rng.standard_normal(bias_shape)})


def _checked_case(qkv, fixed, checked, names=None):
    """(forward, backward, inputs, names) of attention on q, k, v = qkv with the options `fixed`
    and `checked` ({keyword: value}: inputs too, their gradients checked beside dq, dk, dv);
    names default to the inputs' keywords."""
    wrt = ("q", "k", "v") + tuple(checked)
    grads = ("dq", "dk", "dv") + tuple(GRADIENT_OF[name] for name in checked)
    return (partial(_forward_of, wrt, fixed), partial(_gradients_of, grads), list(qkv) + list(checked.values()),
            list(wrt) if names is None else names)


def _op_cases(rng):
    """name -> case of linear, softmax and the head reshapes."""
    return {
        "linear": (linear_forward, linear_backward,
                   [rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)],
                   ["x", "W", "b"]),
        "softmax": (softmax_forward, lambda dp, cache: [softmax_backward(dp, cache)],
                    [3 * rng.standard_normal((3, 6))], ["z"]),
        "split_heads": (lambda x: (split_heads(x, 2), None), lambda dxh, _: [merge_heads(dxh)],
                        [rng.standard_normal((2, 3, 8))], ["x"]),
        "merge_heads": (lambda xh: (merge_heads(xh), None), lambda dx, _: [split_heads(dx, 2)],
                        [rng.standard_normal((2, 2, 3, 4))], ["xh"]),
    }


def _masks(rng):
    """(mask [2, 1, 3, 5] with no fully masked row, dead [2, 2, 3, 5] with two)."""
    mask = rng.random((2, 1, 3, 5)) < 0.7
    mask[..., 0] = True
    dead = np.ones((2, 2, 3, 5), bool)
    dead[0, 1, 2] = dead[1, 0, 0] = False
    return mask, dead


def _attention_cases(rng, mask, dead):
    """name -> case of every attention variant; `mask` and `dead` as _masks gives them."""
    return {
        "attention": attention_case(rng),
        "attention mask": attention_case(rng, mask=mask),
        "attention bias": attention_case(rng, bias=(1, 2, 3, 5)),
        "causal top_left": attention_case(rng, causal="top_left"),
        "causal bottom_right": attention_case(rng, causal="bottom_right"),
        "GQA 4q/2kv heads": attention_case(rng, shape_q=(1, 4, 3, 4), shape_kv=(1, 2, 5, 4)),
        "unscaled d_k=256": attention_case(rng, (1, 1, 3, 256), (1, 1, 4, 256), scale=1.0),
        "fully masked rows, zero": attention_case(rng, mask=dead),
        "fully masked rows, uniform": attention_case(rng, mask=dead, fully_masked="uniform"),
        "one head, [N, d] arrays": attention_case(rng, (3, 4), (5, 4)),
        "tiled, causal, bias, GQA": attention_case(rng, shape_q=(1, 4, 5, 4), shape_kv=(1, 2, 7, 4),
                                                   bias=(4, 5, 7), causal="bottom_right", block_size=3),
        "packed sequences, causal": attention_case(rng, (2, 6, 4), (1, 7, 4), cu_seqlens_q=[0, 2, 6],
                                                   cu_seqlens_k=[0, 3, 7], causal="bottom_right"),
        "paged KV cache": attention_case(rng, (2, 2, 2, 4), (3, 1, 4, 4), page_table=[[0, 2], [1, 0]],
                                         cache_seqlens=[6, 3], causal="bottom_right"),
    }


def _option_cases(rng):
    """name -> case of each option the table draws (options.OPTIONS' draw), by its conform name:
    q [2, 2, 3, 4], k, v [2, 2, 5, 4], the option's value checked too where it has a gradient."""
    shapes = ((2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4))
    sizes = Sizes(batch=2, heads=2, n_q=3, n_k=5, d=4, q_shape=shapes[0])
    cases = {}
    for row in (row for row in OPTIONS if row.draw is not None):
        fixed = row.draw(rng, sizes)
        qkv = [rng.standard_normal(shape) for shape in shapes]
        checked = {row.name: fixed.pop(row.name)} if row.gradient else {}
        names = ["q", "k", "v"] + [row.conform] * len(checked)          # (short: the report's column)
        cases[row.conform] = _checked_case(qkv, fixed, checked, names)
    return cases


def _forward_of(wrt, fixed, *inputs):
    """attention_forward of the inputs named `wrt` (q, k, v first) and the options `fixed`."""
    named = dict(zip(wrt, inputs))
    return attention_forward(named.pop("q"), named.pop("k"), named.pop("v"), **named, **fixed)


def _gradients_of(grads, dout, cache):
    """attention_backward's gradients named `grads`, in their order."""
    g = attention_backward(dout, cache)
    return [getattr(g, name) for name in grads]


def _multihead_case(rng):
    """The module MultiHeadAttention(8, 2): query [2, 3, 8], key and value [2, 4, 8], every parameter."""
    mha = MultiHeadAttention(8, 2, seed=1)
    forward, backward, keys = mha_functions(mha)
    inputs = [rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 4, 8))]
    return forward, backward, inputs + [mha.params[k] for k in keys], list(MHA_INPUTS) + keys


def jvp_cases(rng):
    """name -> (forward, jvp, inputs, names) for jvpcheck: jvp(inputs, tangents) -> out_dot."""
    q, k, v = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 1, 5, 4)), rng.standard_normal((2, 1, 5, 3))
    sizes = Sizes(batch=2, heads=2, n_q=3, n_k=5, d=3, q_shape=(2, 2, 3, 3))     # (d: v's, for a gate)

    def attention(**options):
        forward = lambda q, k, v: (attention_forward(q, k, v, **options)[0], None)
        return forward, lambda xs, ts: attention_jvp(*xs, *ts, **options)[1], [q, k, v], ["q", "k", "v"]
    return {
        "linear": (lambda x, W, b: (linear_forward(x, W, b)[0], None), lambda xs, ts: linear_jvp(*xs, *ts)[1],
                   [rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)],
                   ["x", "W", "b"]),
        "softmax": (lambda z: (softmax_forward(z)[0], None), lambda zs, ts: softmax_jvp(zs[0], ts[0])[1],
                    [3 * rng.standard_normal((3, 6))], ["z"]),
        "attention, GQA": attention(),
        "attention, causal bottom_right": attention(causal="bottom_right"),
        **{f"attention, {row.conform}": attention(**row.draw(rng, sizes)) for row in OPTIONS if row.draw is not None},
    }


def identity_gaps(rng):
    """name -> relative gap of an identity between derivatives, for a causal GQA case with each
    score step the table draws (its rows that act on the scores): the JVP is the adjoint of the
    VJP, <u, J v> = <J^T u, v>, and the Hessian of <dout, out> is symmetric, <a, H b> = <b, H a>.
    Both are 0 up to rounding."""
    q, k, v = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 1, 5, 4)), rng.standard_normal((2, 1, 5, 3))
    options, sizes = {"causal": True}, Sizes(batch=2, heads=2, n_q=3, n_k=5, d=4, q_shape=q.shape)
    for row in OPTIONS:
        if row.acts == "score" and row.draw is not None:
            options.update(row.draw(rng, sizes))
    a, b = ([rng.standard_normal(x.shape) for x in (q, k, v)] for _ in range(2))
    u = rng.standard_normal((2, 2, 3, 3))
    inner = lambda xs, ys: sum(float(np.sum(x * y)) for x, y in zip(xs, ys))
    forward_mode = float(np.sum(u * attention_jvp(q, k, v, *a, **options)[1]))
    reverse_mode = inner(attention_backward(u, attention_forward(q, k, v, **options)[1])[:3], a)
    Ha, Hb = (attention_hvp(q, k, v, u, *t, **options)[1][:3] for t in (a, b))
    gap = lambda x, y: abs(x - y) / max(abs(x), abs(y), 1e-300)
    return {"adjoint: <u, J v> = <J^T u, v>": gap(forward_mode, reverse_mode),
            "Hessian symmetry: <a, H b> = <b, H a>": gap(inner(a, Hb), inner(b, Ha))}


def cases(rng):
    """name -> (forward, backward, inputs, names), every op and attention variant."""
    mask, dead = _masks(rng)                             # drawn first: the cases' numbers stay put
    return {**_op_cases(rng), **_attention_cases(rng, mask, dead), **_option_cases(rng),
            "multihead": _multihead_case(rng)}
