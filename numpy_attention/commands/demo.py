"""`numpy-attention demo`: the seed's example run in NumPy, with every gradient verified.

The seed builds MultiHeadAttention(512, 8), feeds X [2, 10, 512] as query, key and value,
and prints the shapes and the sum of the first attention row. We do the same, then check
the gradient of every input and parameter by complex step:

- projection mode on every whole tensor: <u, J v> for random u, v (cheap at any size);
- full mode on a sampled block: the whole Jacobian between a few entries of the tensor
  and a few entries of the output (gradcheck.block_functions).
"""
import numpy as np

from ..gradcheck_cases import MHA_INPUTS, mha_functions
from ..finite_differences import block_functions, gradcheck
from ..multihead import MultiHeadAttention
from .cli import integer

HELP = "the seed's example, gradients verified by complex step"
DESCRIPTION = """\
The seed's example, MultiHeadAttention(512, 8) on X [2, 10, 512], with the gradient
of every input and parameter verified by complex step: projection mode on every
whole tensor, full mode (the whole Jacobian) on a sampled block.
Exit codes: 0 every check passed, 1 a check failed, 2 bad arguments."""


def _blocks(inputs):
    """The sampled blocks: 1x2x2 of each input, 2x2 of each weight, 2 of each bias, and a
    1x2x3 block of the output (batch 1, queries 1-2, features 0-2)."""
    in_blocks = [(slice(1, 3),) if np.ndim(x) == 1 else
                 tuple(slice(1, 3) for _ in range(np.ndim(x) - 1)) + (slice(7, 9),) for x in inputs]
    return in_blocks, (slice(1, 2), slice(1, 3), slice(0, 3))


def _print_forward(mha, X, out):
    output, weights = mha(X, X, X)                       # self-attention: Q = K = V = X
    out(f"input shape:             {X.shape}")
    out(f"output shape:            {output.shape}")
    out(f"attention weights shape: {weights.shape}")
    out(f"sum of the first attention row (batch 0, head 0, query 0): "
        f"{weights[0, 0, 0].sum():.17f} (should be close to 1.0)")


def run_demo(seed=0, out=print):
    """Print the seed's example and the gradient tables; return True iff every check passed."""
    mha = MultiHeadAttention(512, 8, seed=seed)
    X = np.random.default_rng(seed).standard_normal((2, 10, 512))          # [B, N, D]
    _print_forward(mha, X, out)
    forward, backward, keys = mha_functions(mha)
    inputs, names = [X, X, X] + [mha.params[k] for k in keys], list(MHA_INPUTS) + keys
    out("\nGradients of every input and parameter, by complex step (float64):")
    out("projection mode on every whole tensor, <u, J v> with random u, v:")
    projected = gradcheck(forward, backward, inputs, method="complex", mode="projection", names=names)
    out(str(projected))
    out("\nfull mode on a sampled block: the whole Jacobian between a block of every tensor"
        "\n(1x2x2 of each input, 2x2 of each weight, 2 of each bias) and a 1x2x3 block of the output:")
    block_forward, block_backward, blocks = block_functions(forward, backward, inputs, *_blocks(inputs))
    full = gradcheck(block_forward, block_backward, blocks, method="complex", mode="full", names=names,
                     batched=False)           # the module takes [B, N, D] and W [d_in, d_out]: no stack
    out(str(full))
    out("(W_k.bias's gradient is exactly zero: adding b_k to every key adds the same q.b_k to a"
        "\nwhole row of scores, and softmax ignores that; what is left is rounding)")
    passed = bool(projected) and bool(full)
    out("\nself-attention: the gradient w.r.t. X is grads['query'] + grads['key'] + grads['value']")
    out(f"\n{'ALL GRADIENT CHECKS PASSED' if passed else 'SOME GRADIENT CHECK FAILED'}")
    return passed


def add_arguments(parser):
    parser.add_argument("--seed", type=integer(0), default=0, help="seeds the weights and X (default 0)")


def run(args):
    return 0 if run_demo(seed=args.seed) else 1
