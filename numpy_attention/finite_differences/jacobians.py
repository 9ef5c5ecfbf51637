"""The two modes: whole Jacobians (full) and random projections <u, J v> (projection).

For one checked input x (shape legend: out the forward's output, C a chunk):

    full         J [out.size, x.size], J[r, j] = d out_r / d x_j, entry by entry:
                   numeric   column by column, column j = D_{e_j} out (the directional
                             derivative along the unit direction e_j, differences.py);
                   analytic  row by row, row r = backward(e_r)[x] (the gradient for the unit
                             upstream gradient e_r), every checked input from one backward;
                 so every possible upstream gradient is covered. A chunk of C columns (rows)
                 is one stacked evaluation when the functions broadcast (batching.py).
    projection   <u, J v> for random u [out] (upstream gradient) and v [x] (direction):
                   numeric   D_v L, L(x) = sum(u * forward(x))
                   analytic  sum(backward(u)[x] * v)
                 one backward and one to four forwards per pair (by method), cheap at any size.
"""
from typing import Callable, NamedTuple

import numpy as np

from .batching import (Evaluator, chunks, choose, evaluate_chunk, looped_gradients, looped_outputs, over,
                       summary, vectorized_gradients, vectorized_outputs)
from .calls import forward_output, gradient, replaced
from .differences import directional_derivative


class Derivatives(NamedTuple):
    """One input's derivatives, both ways, and what the report needs to judge them."""
    analytic: np.ndarray    # full: J [out.size, x.size] from backward; projection: [n] <backward(u), v>
    numeric: np.ndarray     # the same by finite differences
    index_of: Callable      # flat index into analytic -> the report's worst index
    output_size: float      # |f|, the size of the differenced function: max |out| in full mode,
                            # max over pairs of sum |u * out| in projection mode


def _unit_vectors(indices, n, dtype):
    """[len(indices), n]: row k is the unit vector e_{indices[k]}."""
    units = np.zeros((len(indices), n), dtype=dtype)
    units[np.arange(len(indices)), indices] = 1.0
    return units


def _probe(x, rng):
    """[2, *x]: two random entries near x, which `choose` evaluates both ways."""
    return x + rng.standard_normal((2,) + x.shape).astype(x.dtype) * 1e-3


def forward_evaluators(forward, inputs, wrt, names, batched, rng):
    """{i: the Evaluator of the forward over input i, perturbed alone} (batching.choose).

    Several checked inputs are probed first all at once, each stacked with its own two random
    entries. A forward that gives the one-at-a-time numbers there also does so with one input
    stacked and the others repeated (a stack whose entries are equal), so that one probe
    stands for all. If it does not (it raises, or its numbers differ), each input is probed
    alone: one that does not broadcast leaves the others vectorized, and is named.
    """
    looped, vectorized = looped_outputs(forward, inputs), vectorized_outputs(forward, inputs)
    what = {i: f"forward over {names[i]}" for i in wrt}
    if len(wrt) > 1 and batched is not False:
        dtype = np.result_type(*(np.asarray(inputs[i]).real.dtype for i in wrt))
        joint = choose(vectorized, looped, {i: _probe(np.asarray(inputs[i]), rng) for i in wrt}, None,
                       dtype, "forward")
        if joint.vectorized:
            return {i: Evaluator(over(vectorized, i), what[i], True) for i in wrt}
    return {i: choose(over(vectorized, i), over(looped, i), _probe(np.asarray(inputs[i]), rng), batched,
                      np.asarray(inputs[i]).real.dtype, what[i]) for i in wrt}


def numeric_jacobian(forward, inputs, i, evaluator, out_size, method, h, batched, chunk_size):
    """(J [out.size, x.size] by finite differences, column by column; its Evaluator, which starts
    as `evaluator` (forward_evaluators) and turns looped if a chunk trips it)."""
    x = np.asarray(inputs[i])
    looped = over(looped_outputs(forward, inputs), i)
    jacobian = np.empty((out_size, x.size))
    for columns in chunks(x.size, inputs, out_size, chunk_size):
        directions = _unit_vectors(columns, x.size, x.real.dtype).reshape((-1,) + x.shape)  # [C, *x]

        def columns_of(outputs_of):                  # [C, out.size] -> [out.size, C]
            return np.real(directional_derivative(outputs_of, x, directions, method, h)).T
        jacobian[:, columns], evaluator = evaluate_chunk(evaluator, looped, columns_of, batched)
    return jacobian, evaluator


def _analytic_jacobians(forward, backward, inputs, wrt, names, out, cache, batched, chunk_size, rng):
    """({i: J [out.size, x_i.size] from backward, row by row}, its Evaluator)."""
    looped = looped_gradients(backward, cache, inputs, wrt, names)
    probe = rng.standard_normal((2,) + out.shape).astype(out.real.dtype)
    evaluator = choose(vectorized_gradients(forward, backward, inputs, wrt, names), looped, probe,
                       batched, out.real.dtype, "backward")
    jacobians = {i: np.empty((out.size, np.size(inputs[i]))) for i in wrt}
    for rows in chunks(out.size, inputs, out.size, chunk_size):
        upstream = _unit_vectors(rows, out.size, out.real.dtype).reshape((-1,) + out.shape)   # [C, *out]
        per_input, evaluator = evaluate_chunk(evaluator, looped, lambda gradients_of: gradients_of(upstream),
                                              batched)
        for i, block in zip(wrt, per_input):                                  # block [C, x_i.size]
            jacobians[i][rows] = np.real(block)
    return jacobians, evaluator


def jacobian_index(out_shape, x_shape):
    """flat index of J [out.size, x.size] -> (output index, input index)."""
    x_size = int(np.prod(x_shape))
    return lambda flat: (tuple(int(a) for a in np.unravel_index(flat // x_size, out_shape)),
                         tuple(int(a) for a in np.unravel_index(flat % x_size, x_shape)))


def full_jacobians(forward, backward, inputs, wrt, names, method, h, batched, chunk_size, rng):
    """({i: Derivatives of the whole Jacobian} for i in wrt, the report's `batching`).

    batched, chunk_size: as for gradcheck (batching.py); rng draws the batching probes.
    """
    out, cache = forward_output(forward, inputs)
    numeric, forward_over = {}, {}
    for i, evaluator in forward_evaluators(forward, inputs, wrt, names, batched, rng).items():
        numeric[i], forward_over[i] = numeric_jacobian(forward, inputs, i, evaluator, out.size, method, h,
                                                       batched, chunk_size)
    analytic, backward_evaluator = _analytic_jacobians(forward, backward, inputs, wrt, names, out, cache,
                                                       batched, chunk_size, rng)
    largest_output = float(np.max(np.abs(out), initial=0))
    derivatives = {i: Derivatives(analytic[i], numeric[i], jacobian_index(out.shape, np.shape(inputs[i])),
                                  largest_output) for i in wrt}
    return derivatives, summary(forward_over, backward_evaluator, names, batched)


def projections(forward, backward, inputs, i, name, method, h, rng, n_projections):
    """Derivatives of n_projections random pairs (u, v): analytic <backward(u), v>, numeric <u, J v>."""
    x = np.asarray(inputs[i])
    out, cache = forward_output(forward, inputs)
    analytic, numeric, output_sizes = [], [], []
    for _ in range(n_projections):
        u = rng.standard_normal(out.shape).astype(out.real.dtype)        # upstream gradient [out]
        v = rng.standard_normal(x.shape).astype(x.real.dtype)            # direction [x]

        def loss(x_moved):                                                # L = sum(u * f(x))
            return np.sum(u * np.asarray(forward(*replaced(inputs, i, x_moved))[0]))
        numeric.append(float(np.real(directional_derivative(loss, x, v, method, h))))
        analytic.append(float(np.real(np.sum(gradient(backward(u, cache), i, x.shape, name) * v))))
        output_sizes.append(np.sum(np.abs(u * out)))
    return Derivatives(np.array(analytic), np.array(numeric), lambda k: (k,), max(output_sizes))
