"""Small random cases of every op and attention variant, as (forward, backward, inputs, names),
for gradient checks (`numpy-attention gradcheck` runs them; so do the tests).

    forward(*inputs) -> (out, cache)          backward(dout, cache) -> gradients in input order

Inputs are float64 draws from the given numpy Generator; names label the table's rows.
"""
import numpy as np

from .attention import attention_backward, attention_forward
from .heads import merge_heads, split_heads
from .linear import linear_backward, linear_forward
from .multihead import MultiHeadAttention, multihead_backward, multihead_forward
from .softmax import softmax_backward, softmax_forward

MHA_INPUTS = ("query", "key", "value")


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
    q = rng.standard_normal(shape_q)
    k = rng.standard_normal(shape_kv)
    v = rng.standard_normal(shape_kv[:-1] + (d_v,))
    bias_shape = options.pop("bias", None)
    if bias_shape is None:
        forward = lambda q, k, v: attention_forward(q, k, v, **options)
        return forward, attention_backward, [q, k, v], ["q", "k", "v"]
    forward = lambda q, k, v, bias: attention_forward(q, k, v, bias=bias, **options)
    return forward, attention_backward, [q, k, v, rng.standard_normal(bias_shape)], ["q", "k", "v", "bias"]


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
        "window (1, 1)": attention_case(rng, window=(1, 1)),
        "softcap 1.5": attention_case(rng, softcap=1.5),
        "dropout": attention_case(rng, dropout_mask=rng.random((2, 2, 3, 5)) < 0.8, dropout_p=0.2),
        "unscaled d_k=256": attention_case(rng, (1, 1, 3, 256), (1, 1, 4, 256), scale=1.0),
        "fully masked rows, zero": attention_case(rng, mask=dead),
        "fully masked rows, uniform": attention_case(rng, mask=dead, fully_masked="uniform"),
        "one head, [N, d] arrays": attention_case(rng, (3, 4), (5, 4)),
        "tiled, causal, bias, GQA": attention_case(rng, shape_q=(1, 4, 5, 4), shape_kv=(1, 2, 7, 4),
                                                   bias=(4, 5, 7), causal="bottom_right", block_size=3),
    }


def _multihead_case(rng):
    """The module MultiHeadAttention(8, 2): query [2, 3, 8], key and value [2, 4, 8], every parameter."""
    mha = MultiHeadAttention(8, 2, seed=1)
    forward, backward, keys = mha_functions(mha)
    inputs = [rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 8)), rng.standard_normal((2, 4, 8))]
    return forward, backward, inputs + [mha.params[k] for k in keys], list(MHA_INPUTS) + keys


def cases(rng):
    """name -> (forward, backward, inputs, names), every op and attention variant."""
    mask, dead = _masks(rng)                             # drawn first: the cases' numbers stay put
    return {**_op_cases(rng), **_attention_cases(rng, mask, dead), "multihead": _multihead_case(rng)}
