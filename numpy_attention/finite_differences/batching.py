"""Batching: evaluate a chunk of perturbations in one call, when the functions allow it.

Full mode evaluates two kinds of stacks (C entries stacked along a new leading axis):

    outputs_of({i: xs_i [C, *x_i]}) -> [C, out.size]           forward, the inputs i perturbed
    gradients_of(us [C, *out]) -> [[C, x_i.size] for i in wrt] backward of C upstream gradients

each either "looped" (one entry at a time: works for any function) or "vectorized" (one
call on inputs stacked along a new leading axis, every other array input repeated: needs a
forward and a backward that broadcast over that axis). A numeric Jacobian perturbs one input
at a time (`over`); a probe may perturb several at once. `choose` picks the vectorized one
when a two-entry probe gives the looped numbers to sqrt(eps_mach); `evaluate_chunk` falls
back to looped when a real chunk trips a vectorized function the probe did not (a stack of 2
may align with an axis of size 2 by chance). `summary` says in the report's `batching` which
functions took one entry at a time when the caller left it to the probe (batched=None), and
the report prints it as a note: a fallback that worked is no error, so it names no exception;
batched=True raises the one a stacked call met. batched=False, the caller's own choice, is
"looped" and needs no note.

Only STACKING_ERRORS count as "does not broadcast": any other exception (a NameError, an
AttributeError, a TypeError) is a bug of the function and propagates.
"""
from typing import Callable, NamedTuple

import numpy as np

from .calls import gradients

CHUNK_ENTRIES = 2 ** 20                 # entries per stacked tensor in one evaluation (default)

# What a forward or backward written for unstacked inputs raises on a stack. A new leading
# axis shifts every axis counted from the front: numpy's broadcasting and matmul mismatches,
# reshape and tuple-unpacking of a shape, a function's own shape checks and a gradient of the
# unstacked shape all raise ValueError; an index meant for the first axis that lands on a
# shorter one raises IndexError (numpy's AxisError is both). Nothing else is a sign of it.
STACKING_ERRORS = (ValueError, IndexError)


class Evaluator(NamedTuple):
    evaluate: Callable                  # stack -> values, vectorized or looped
    what: str                           # which function, e.g. "forward over q", "backward"
    vectorized: bool                    # False: one entry per call


def stack(inputs, stacks, n):
    """The inputs with a leading axis of n: input i is stacks[i] [n, *x_i] for each i in the
    mapping `stacks`, every other array input is repeated (a read-only view, no copy);
    non-arrays pass."""
    return [stacks[j] if j in stacks else
            np.broadcast_to(x, (n,) + x.shape) if isinstance(x, np.ndarray) else x for j, x in enumerate(inputs)]


def looped_outputs(forward, inputs):
    """{i: xs_i [C, *x_i]} -> [C, out.size], one forward per entry (input i its entry of xs_i)."""
    def outputs_of(stacks):
        n = len(next(iter(stacks.values())))
        entry = lambda c: [stacks[j][c] if j in stacks else x for j, x in enumerate(inputs)]   # entry c's inputs
        return np.stack([np.ravel(forward(*entry(c))[0]) for c in range(n)])
    return outputs_of


def vectorized_outputs(forward, inputs):
    """{i: xs_i [C, *x_i]} -> [C, out.size], one forward on the stacked inputs."""
    def outputs_of(stacks):
        n = len(next(iter(stacks.values())))
        return np.asarray(forward(*stack(inputs, stacks, n))[0]).reshape(n, -1)
    return outputs_of


def over(outputs_of, i):
    """xs [C, *x_i] -> outputs_of({i: xs}): the outputs of a stack of input i alone."""
    return lambda xs: outputs_of({i: xs})


def looped_gradients(backward, cache, inputs, wrt, names):
    """us [C, *out] -> [[C, x_i.size] for i in wrt], one backward per upstream gradient."""
    def gradients_of(us):
        per_upstream = [gradients(backward, u, cache, inputs, wrt, names) for u in us]
        return [np.stack([np.ravel(grads[position]) for grads in per_upstream]) for position in range(len(wrt))]
    return gradients_of


def vectorized_gradients(forward, backward, inputs, wrt, names):
    """us [C, *out] -> [[C, x_i.size] for i in wrt], one forward and one backward on the stack
    (every input repeated len(us) times, so the cache matches the stacked upstream gradients)."""
    def gradients_of(us):
        stacked = stack(inputs, {}, len(us))
        _, cache = forward(*stacked)
        return [grad.reshape(len(us), -1) for grad in gradients(backward, us, cache, stacked, wrt, names)]
    return gradients_of


def _as_list(values):
    return values if isinstance(values, list) else [values]


def _close(stacked, one_at_a_time, dtype):
    """Same shape, and max |stacked - one_at_a_time| <= sqrt(eps_mach) * max |one_at_a_time|."""
    scale = max(np.max(np.abs(one_at_a_time), initial=0.0), np.finfo(dtype).tiny)
    return stacked.shape == one_at_a_time.shape and \
        bool(np.max(np.abs(stacked - one_at_a_time), initial=0.0) <= np.sqrt(np.finfo(dtype).eps) * scale)


def _one_line(exc):
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def choose(vectorized, looped, probe, batched, dtype, what):
    """The Evaluator of a stack: vectorized when `batched` allows it and it agrees with the
    looped one on the two-entry `probe`, looped otherwise (`what` names the function).

    batched: True (vectorized, ValueError if the probe fails), False (looped) or None (auto:
    vectorized if the probe passes, else looped; the numbers agree to rounding either way).
    """
    if batched is False:
        return Evaluator(looped, what, False)
    expected = looped(probe)                      # outside the try: its errors are the function's
    try:
        agree = all(_close(stacked, one_at_a_time, dtype) for stacked, one_at_a_time
                    in zip(_as_list(vectorized(probe)), _as_list(expected), strict=True))
    except STACKING_ERRORS as exc:                # the function rejects the extra axis
        if batched:
            raise ValueError(f"batched=True, but the forward/backward fail on inputs stacked along "
                             f"a new leading axis (the {what}): {_one_line(exc)}") from exc
        return Evaluator(looped, what, False)
    if agree:
        return Evaluator(vectorized, what, True)
    if batched:
        raise ValueError(f"batched=True, but the forward/backward give different numbers on inputs "
                         f"stacked along a new leading axis than one at a time (the {what})")
    return Evaluator(looped, what, False)


def evaluate_chunk(evaluator, looped, compute, batched):
    """(compute(evaluator.evaluate), the evaluator for the next chunks).

    A vectorized evaluation that raises STACKING_ERRORS on this chunk (of another size than the
    probe's) is redone looped, and looped it stays; with batched=True it is a ValueError.
    """
    try:
        return compute(evaluator.evaluate), evaluator
    except STACKING_ERRORS as exc:
        if not evaluator.vectorized:               # a looped evaluation's errors are the function's own
            raise
        if batched:
            raise ValueError(f"batched=True, but the {evaluator.what} fails on a chunk of inputs "
                             f"stacked along a new leading axis: {_one_line(exc)}") from exc
        return compute(looped), Evaluator(looped, evaluator.what, False)


def chunks(n, inputs, out_size, chunk_size):
    """Index chunks of range(n), chunk_size each; by default each stacks at most CHUNK_ENTRIES
    entries of any one tensor (the output or an array input)."""
    if chunk_size is None:
        largest = max([out_size] + [np.size(x) for x in inputs if isinstance(x, np.ndarray)])
        chunk_size = max(1, CHUNK_ENTRIES // max(1, largest))
    return [np.arange(start, min(start + chunk_size, n)) for start in range(0, n, chunk_size)]


def summary(forward_over, backward, names, batched):
    """The report's `batching`: "vectorized" if every function took stacks; "looped" for
    batched=False (one entry per call, as asked); else which functions took one entry per call
    because they take no stack (the same numbers, only slower), e.g. "the forward took one
    perturbed W at a time: it takes no stack ...", the note the report prints.

    forward_over: {i: the Evaluator of the forward over input i}; backward: the backward's.
    """
    if batched is False:
        return "looped"
    inputs = [names[i] for i, evaluator in forward_over.items() if not evaluator.vectorized]
    if not inputs and backward.vectorized:
        return "vectorized"
    perturbed = "input" if len(inputs) == len(forward_over) else " or ".join(inputs)
    parts = [f"the forward took one perturbed {perturbed} at a time"] if inputs else []
    if not backward.vectorized:
        parts.append("the backward one upstream gradient" if parts else
                     "the backward took one upstream gradient at a time")
    they = "they take" if len(parts) == 2 else "it takes"
    return (f"{', '.join(parts)}: {they} no stack along a new leading axis (batched=True shows why); "
            f"the same numbers, only slower")
