"""Exercises: write the backward passes yourself, and be told which line is wrong.

    from numpy_attention import exercises
    def softmax_backward(dp, p):
        return p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    print(exercises.check("softmax_backward", softmax_backward))   # truthy iff right

The functions to write (each with NumPy alone; shapes as in solutions.py):
    linear_backward(dy, x, W) -> (dx, dW, db)           y = x W + b, x [..., d_in], W [d_in, d_out]
    softmax_backward(dp, p) -> dz                       p = softmax(z) over the last axis
    attention_backward(dout, q, k, v, p) -> (dq, dk, dv)   out = p v, p = softmax(q k^T / sqrt(d_k))
    split_heads(x, num_heads) -> xh                     [B, N, D] -> [B, H, N, D / H]
    merge_heads(xh) -> x                                [B, H, N, d_k] -> [B, N, H d_k]
    multihead_backward(dout, cache) -> {name: gradient}   the five steps of multihead_forward in
                                                        reverse: "query", "key", "value", "W_q",
                                                        "b_q", ..., "W_o", "b_o" (math layout)

check() runs each on two cases against the truth (for a backward: the forward's gradient by
complex step under a random upstream gradient) and says what is wrong in words: a known
mistake (mistakes.py: a transposed product, .T on an array with a batch axis, a sum over the
batch left out or over the wrong axis, a missing rowsum term, a missing 1 / sqrt(d_k), the
gradient of sum() instead of the upstream gradient, heads merged without the transpose, ...),
a result that ignores the upstream gradient, a wrong shape or factor, the step where a
module's backward goes wrong. solutions.py holds the reference solutions, and
multihead_forward, the forward whose cache multihead_backward receives.
"""
from .grading import EXERCISES, ExerciseResult, check
from .solutions import multihead_forward

__all__ = ["check", "EXERCISES", "ExerciseResult", "multihead_forward"]
