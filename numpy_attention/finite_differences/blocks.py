"""Restrict a forward/backward pair to blocks of its inputs and of its output.

A full-mode check costs a forward per input entry and a backward per output entry; on a
large function, check the whole Jacobian between a few entries instead:

    f(*blocks)        = forward(*inputs with inputs[i][in_blocks[i]] = blocks[i])[0][out_block]
    b(dblock, cache)  = [g[in_blocks[i]] for g in backward(dout, cache)],
                        dout = zeros of the output's shape with dout[out_block] = dblock

so f's Jacobian is the (out_block, in_blocks[i]) block of forward's, and b its backward.
"""
import numpy as np


def block_functions(forward, backward, inputs, in_blocks, out_block):
    """(f, b, blocks): (forward, backward) restricted to a block of every input and of the output.

    in_blocks[i] / out_block are tuples of slices (module docstring). f writes each block into a
    copy of its input, runs forward and returns (out[out_block], cache); b scatters the block's
    upstream gradient into zeros of the output's shape and returns each input's gradient at its
    block; blocks are the inputs' blocks, copied, the point to check f at.
    """
    full_out_shape = np.shape(forward(*inputs)[0])

    def forward_of_blocks(*blocks):
        moved = []
        for x, block, where in zip(inputs, blocks, in_blocks):
            x = np.array(x, dtype=np.result_type(x, block))          # a copy
            x[where] = block
            moved.append(x)
        out, cache = forward(*moved)
        return out[out_block], cache

    def backward_of_blocks(dblock, cache):
        dout = np.zeros(full_out_shape, dtype=np.result_type(dblock, float))
        dout[out_block] = dblock
        return [grad[where] for grad, where in zip(backward(dout, cache), in_blocks)]

    return forward_of_blocks, backward_of_blocks, [np.array(x[where]) for x, where in zip(inputs, in_blocks)]
