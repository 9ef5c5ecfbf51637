"""The seed's example run in NumPy, with every gradient verified (`numpy-attention demo`).

The seed builds MultiHeadAttention(512, 8), feeds X [2, 10, 512] as query, key
and value, and prints the shapes and the sum of the first attention row. We do
the same, then check the gradient of every input and parameter by complex step:

- projection mode on every whole tensor: <u, J v> for random u, v (cheap at any size);
- full mode on a sampled block: the whole Jacobian between a few entries of the
  tensor and a few entries of the output.
"""
import numpy as np

from .gradcheck import gradcheck
from .multihead import MultiHeadAttention, multihead_backward, multihead_forward

INPUTS = ("query", "key", "value")


def mha_functions(mha, **attention_options):
    """(forward, backward, parameter keys): the module as a function of
    (query, key, value, *params) in state_dict order, for gradcheck."""
    keys = list(mha.params)

    def forward(query, key, value, *params):
        out, _, cache = multihead_forward(query, key, value, dict(zip(keys, params)),
                                          mha.num_heads, **attention_options)
        return out, cache

    def backward(dout, cache):
        grads = multihead_backward(dout, cache)
        return [grads[name] for name in INPUTS + tuple(keys)]

    return forward, backward, keys


def block_functions(forward, backward, inputs, in_blocks, out_block):
    """Restrict (forward, backward) to a block of every input and a block of the output.

    in_blocks[i] / out_block are tuples of slices. The block function takes the input
    blocks, writes each into a copy of its input, runs forward and returns out[out_block];
    its backward scatters the block's upstream gradient into zeros of the output's shape
    and returns each input's gradient at its block.
    """
    full_out_shape = np.shape(forward(*inputs)[0])

    def f(*blocks):
        xs = []
        for x, block, where in zip(inputs, blocks, in_blocks):
            x = np.array(x, dtype=np.result_type(x, block))          # a copy
            x[where] = block
            xs.append(x)
        out, cache = forward(*xs)
        return out[out_block], cache

    def b(dblock, cache):
        dout = np.zeros(full_out_shape, dtype=np.result_type(dblock, float))
        dout[out_block] = dblock
        return [g[where] for g, where in zip(backward(dout, cache), in_blocks)]

    return f, b, [np.array(x[where]) for x, where in zip(inputs, in_blocks)]


def run_demo(seed=0, out=print):
    """Print the seed's example and a gradient table; return True iff every check passed."""
    batch_size, seq_len, d_model, num_heads = 2, 10, 512, 8
    mha = MultiHeadAttention(d_model, num_heads, seed=seed)
    X = np.random.default_rng(seed).standard_normal((batch_size, seq_len, d_model))
    output, weights = mha(X, X, X)                       # self-attention: Q = K = V = X
    out(f"input shape:             {X.shape}")
    out(f"output shape:            {output.shape}")
    out(f"attention weights shape: {weights.shape}")
    out(f"sum of the first attention row (batch 0, head 0, query 0): "
        f"{weights[0, 0, 0].sum():.17f} (should be close to 1.0)")

    forward, backward, keys = mha_functions(mha)
    inputs = [X, X, X] + [mha.params[k] for k in keys]
    names = list(INPUTS) + keys
    out("\nGradients of every input and parameter, by complex step (float64):")
    out("projection mode on every whole tensor, <u, J v> with random u, v:")
    proj = gradcheck(forward, backward, inputs, method="complex", mode="projection", names=names)
    out(str(proj))
    out("\nfull mode on a sampled block: the whole Jacobian between a block of every tensor"
        "\n(1x2x2 of each input, 2x2 of each weight, 2 of each bias) and a 1x2x3 block of the output:")
    in_blocks = [(slice(1, 3),) if np.ndim(x) == 1 else
                 tuple(slice(1, 3) for _ in range(np.ndim(x) - 1)) + (slice(7, 9),) for x in inputs]
    out_block = (slice(1, 2), slice(1, 3), slice(0, 3))     # batch 1, queries 1-2, features 0-2
    f, b, blocks = block_functions(forward, backward, inputs, in_blocks, out_block)
    full = gradcheck(f, b, blocks, method="complex", mode="full", names=names)
    out(str(full))
    out("(W_k.bias's gradient is exactly zero: adding b_k to every key adds the same q.b_k to a"
        "\nwhole row of scores, and softmax ignores that; what is left is rounding)")
    ok = bool(proj) and bool(full)
    out("\nself-attention: the gradient w.r.t. X is grads['query'] + grads['key'] + grads['value']")
    out(f"\n{'ALL GRADIENT CHECKS PASSED' if ok else 'SOME GRADIENT CHECK FAILED'}")
    return ok


def add_arguments(parser):
    from .cli import integer
    parser.add_argument("--seed", type=integer(0), default=0, help="seeds the weights and X (default 0)")


def run(args):
    return 0 if run_demo(seed=args.seed) else 1
