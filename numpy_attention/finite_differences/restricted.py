"""Restrict a forward/backward pair to blocks of its inputs and of its output.

A full-mode check costs a forward per input entry and a backward per output entry; on a
large function, check the whole Jacobian between a few entries instead:

    f(*blocks)        = forward(*inputs with inputs[i][in_blocks[i]] = blocks[i])[0][out_block]
    b(dblock, cache)  = [g[in_blocks[i]] for g in backward(dout, cache)],
                        dout = zeros of the output's shape with dout[out_block] = dblock

so f's Jacobian is the (out_block, in_blocks[i]) block of forward's, and b its backward.
f and b also take blocks and dblock stacked along new leading axes, as gradcheck's batching
stacks them: every input is then repeated along those axes and the blocks written into each
entry, so f and b broadcast whenever forward and backward do.
"""
import numpy as np


def block_functions(forward, backward, inputs, in_blocks, out_block):
    """(f, b, blocks): (forward, backward) restricted to a block of every input and of the output.

    in_blocks[i] / out_block are tuples of slices (module docstring). f writes each block into a
    copy of its input, runs forward and returns (out[out_block], cache); b scatters the block's
    upstream gradient into zeros of the output's shape and returns each input's gradient at its
    block; blocks are the inputs' blocks, copied, the point to check f at.
    """
    out_shape = np.shape(forward(*inputs)[0])
    block_ndim = [np.ndim(x[where]) for x, where in zip(inputs, in_blocks)]
    out_block_ndim = np.ndim(np.empty(out_shape)[out_block])

    def forward_of_blocks(*blocks):
        lead = np.shape(blocks[0])[:np.ndim(blocks[0]) - block_ndim[0]]    # stacked: the stack's axes
        moved = []
        for x, block, where in zip(inputs, blocks, in_blocks):
            x = np.array(np.broadcast_to(x, lead + np.shape(x)), dtype=np.result_type(x, block))   # a copy
            x[_after(lead, where)] = block
            moved.append(x)
        out, cache = forward(*moved)
        return out[_after(lead, out_block)], cache

    def backward_of_blocks(dblock, cache):
        lead = np.shape(dblock)[:np.ndim(dblock) - out_block_ndim]
        dout = np.zeros(lead + out_shape, dtype=np.result_type(dblock, float))
        dout[_after(lead, out_block)] = dblock
        return [grad[_after(lead, where)] for grad, where in zip(backward(dout, cache), in_blocks)]

    return forward_of_blocks, backward_of_blocks, [np.array(x[where]) for x, where in zip(inputs, in_blocks)]


def _after(lead, where):
    """The index `where` applied behind the stack's axes `lead`."""
    return (slice(None),) * len(lead) + tuple(where)
