"""Check every op's hand-written backward (`numpy-attention gradcheck`).

`cases(rng)` lists, for each op and attention variant, a (forward, backward,
inputs, names) tuple on small random float64 inputs; the command runs
`gradcheck` in full mode (the whole Jacobian) on each and prints the tables.
The tests run the same cases.
"""
import numpy as np

from .attention import attention_backward, attention_forward
from .gradcheck import METHODS, gradcheck, taylor_test
from .heads import merge_heads, split_heads
from .linear import linear_backward, linear_forward
from .demo import mha_functions
from .multihead import MultiHeadAttention
from .softmax import softmax_backward, softmax_forward


def attention_case(rng, shape_q=(2, 2, 3, 4), shape_kv=(2, 2, 5, 4), d_v=3, **options):
    """(forward, backward, [q, k, v(, bias)], names) for attention with `options`.

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


def cases(rng):
    """name -> (forward, backward, inputs, names), every op and attention variant."""
    mask = rng.random((2, 1, 3, 5)) < 0.7
    mask[..., 0] = True                                  # no fully masked row here
    dead = np.ones((2, 2, 3, 5), bool)
    dead[0, 1, 2] = dead[1, 0, 0] = False                # two fully masked rows
    mha = MultiHeadAttention(8, 2, seed=1)
    mha_forward, mha_backward, keys = mha_functions(mha)
    return {
        "linear": (linear_forward, linear_backward,
                   [rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)],
                   ["x", "W", "b"]),
        "softmax": (softmax_forward, lambda d, c: [softmax_backward(d, c)],
                    [3 * rng.standard_normal((3, 6))], ["z"]),
        "split_heads": (lambda x: (split_heads(x, 2), None), lambda d, c: [merge_heads(d)],
                        [rng.standard_normal((2, 3, 8))], ["x"]),
        "merge_heads": (lambda x: (merge_heads(x), None), lambda d, c: [split_heads(d, 2)],
                        [rng.standard_normal((2, 2, 3, 4))], ["xh"]),
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
        "multihead": (mha_forward, mha_backward,
                      [rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 8)),
                       rng.standard_normal((2, 4, 8))] + [mha.params[k] for k in keys],
                      ["query", "key", "value"] + keys),
    }


def add_arguments(parser):
    parser.add_argument("--method", choices=METHODS, default="complex",
                        help="finite-difference method (default complex)")
    from .cli import integer
    parser.add_argument("--seed", type=integer(0), default=0, help="seed of the random inputs (default 0)")


def run(args):
    ok = True
    for name, (forward, backward, inputs, names) in cases(np.random.default_rng(args.seed)).items():
        report = gradcheck(forward, backward, inputs, method=args.method, names=names)
        taylor = taylor_test(forward, backward, inputs)
        print(f"== {name}   (taylor remainder order {taylor.order:.2f})\n{report}\n")
        ok &= bool(report) and bool(taylor)
    print("ALL GRADIENT CHECKS PASSED" if ok else "SOME GRADIENT CHECK FAILED")
    return 0 if ok else 1
