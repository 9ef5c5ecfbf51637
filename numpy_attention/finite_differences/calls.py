"""Calling the functions under check: which inputs are checked, and what forward and backward return.

    out, cache = forward(*inputs)             out an array (the function whose derivative is checked)
    grads = backward(dout, cache)             grads[i] the gradient of input i (None: none), in
                                              input order; extra trailing entries are ignored

The inputs checked are those named in wrt, by default every non-empty floating-point array;
`unchecked` says why each other input is not (the report lists it as skipped).
"""
import numpy as np


def _describe(x):
    return f"an array of {x.dtype}, shape {x.shape}" if isinstance(x, np.ndarray) else type(x).__name__


def _checkable(x, kinds):
    """A non-empty array of a dtype kind in `kinds` ('f' real floating, 'c' complex)."""
    return isinstance(x, np.ndarray) and x.dtype.kind in kinds and x.size > 0


def _as_array(x):
    """np.asarray(x), or None for what makes no array (a ragged list)."""
    try:
        return np.asarray(x)
    except ValueError:
        return None


def _require_sequence(inputs):
    if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
        raise TypeError(f"inputs must be a list or tuple of the forward's arguments, "
                        f"got {type(inputs).__name__}")


def _every_checkable(inputs, kinds, what):
    """The indices of every checkable input; ValueError if there is none."""
    wrt = [i for i, x in enumerate(inputs) if _checkable(x, kinds)]
    if not wrt:
        raise ValueError(f"found no non-empty {what} array among the inputs to check, got "
                         f"{'; '.join(_describe(x) for x in inputs) or 'no inputs'}")
    return wrt


def _require_index(i, inputs, wrt, kinds, what):
    """TypeError / ValueError unless wrt's entry i names a checkable input."""
    if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
        raise TypeError(f"wrt must hold integer input indices, got {i!r} ({type(i).__name__}) in {wrt!r}")
    if not 0 <= i < len(inputs):
        raise ValueError(f"wrt index {i} is out of range for {len(inputs)} inputs")
    if not _checkable(_as_array(inputs[i]), kinds):      # named explicitly: scalars and lists count too
        raise ValueError(f"wrt index {i} must name a non-empty {what} array, got {_describe(inputs[i])}")


def inputs_and_wrt(inputs, wrt, kinds, what):
    """(inputs as a list, wrt as a list of indices): the checked inputs are non-empty arrays of a
    dtype kind in `kinds` ('f', 'fc'), described as `what` in errors; wrt=None takes every one."""
    _require_sequence(inputs)
    inputs = list(inputs)
    if wrt is None:
        return inputs, _every_checkable(inputs, kinds, what)
    if isinstance(wrt, np.ndarray) and wrt.ndim == 1 and wrt.dtype.kind in "iu":
        wrt = wrt.tolist()
    if not isinstance(wrt, (list, tuple, range)):
        raise TypeError(f"wrt must be a list of input indices, got {wrt!r} ({type(wrt).__name__})")
    if not wrt:
        raise ValueError("wrt is empty: name at least one input to check")
    for i in wrt:
        _require_index(i, inputs, wrt, kinds, what)
    if len(set(wrt)) != len(wrt):
        raise ValueError(f"wrt names an input twice: {wrt!r}")
    return inputs, [int(i) for i in wrt]


def _why_not_checkable(x, i, kinds, what):
    """Why input i, x, is not checked by default: it is no non-empty array of `what`."""
    if isinstance(x, np.ndarray):
        return f"an empty array, shape {x.shape}" if x.size == 0 else f"an array of {x.dtype}, not {what}"
    named = f": wrt=[{i}] checks it" if _checkable(_as_array(x), kinds) else ""   # a scalar, a list
    return f"not an array ({'None' if x is None else type(x).__name__}){named}"


def unchecked(inputs, wrt, wrt_given, kinds, what):
    """{i: why input i is not checked} for each input not in wrt: "not in wrt" if wrt was
    given (wrt_given), else why it is not a non-empty array of a dtype kind in `kinds`."""
    return {i: "not in wrt" if wrt_given else _why_not_checkable(x, i, kinds, what)
            for i, x in enumerate(inputs) if i not in wrt}


def replaced(inputs, i, x):
    """inputs with entry i replaced by x (a new list)."""
    return [*inputs[:i], x, *inputs[i + 1:]]


def forward_output(forward, inputs):
    """(out as an array, cache) of forward(*inputs); an empty output has nothing to check."""
    result = forward(*inputs)
    if isinstance(result, np.ndarray):
        raise TypeError(f"forward must return a pair (out, cache), got an array of shape {result.shape}")
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(f"forward must return a pair (out, cache), got {type(result).__name__} "
                        f"{result!r:.60}")
    out, cache = result
    out = np.asarray(out)
    if out.size == 0:
        raise ValueError(f"the forward's output is empty (shape {out.shape}): there is no "
                         f"derivative to check")
    return out, cache


def gradient(grads, i, shape, name):
    """grads[i], the gradient backward returned for input i, as an array of `shape` (zeros for None)."""
    if isinstance(grads, np.ndarray):
        raise TypeError(f"backward must return a sequence of gradients in input order (e.g. [dx] "
                        f"for one input), got an array of shape {grads.shape}")
    try:
        grad = grads[i]
    except (IndexError, KeyError, TypeError) as exc:
        raise ValueError(f"backward must return the gradients in input order, but its result "
                         f"({type(grads).__name__}) has no entry {i} for {name}: {exc}") from None
    if grad is None:
        return np.zeros(shape)
    if np.shape(grad) != shape:
        raise ValueError(f"backward's gradient for {name} has shape {np.shape(grad)}, "
                         f"expected the input's shape {shape}")
    return np.asarray(grad)


def gradients(backward, dout, cache, inputs, wrt, names):
    """backward(dout, cache)[i] for each i in wrt, as arrays of inputs[i]'s shape (zeros for None)."""
    grads = backward(dout, cache)
    return [gradient(grads, i, np.shape(inputs[i]), names[i]) for i in wrt]
