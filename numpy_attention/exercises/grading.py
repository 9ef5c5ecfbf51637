"""exercises.check (grading.py): run a learner's function against the truth and say, in words, what is wrong.

For a backward exercise the truth is the gradient of the exercise's forward (solutions.py) by
complex step, Im <dout, f(x + i h e_j)> / h for every entry x_j (finite_differences'
directional_derivative), under a random upstream gradient dout: exact to rounding, and
independent of any hand-written backward. For split_heads / merge_heads it is the reference
output. Every exercise runs on two cases: a square one (N_q = N_k, d_in = d_out), where a
transposed product has the right shape and shows as wrong numbers, then a rectangular one.

When the function is wrong, the verdict says why, trying in this order:
    1. it raised (NotImplementedError: not written yet; the error a known mistake raises, as
       x.T of a batched x does: that mistake's message), returned the wrong kind of thing, or
       wrote into its arguments;
    2. it computes exactly what a known mistake computes (mistakes.py): that mistake's message;
    3. its result does not change with the upstream gradient: the gradient of sum();
    4. otherwise each wrong output: its shape (transposed, or one per batch entry: a sum
       missing), a constant factor, or its largest error; and for the module's backward, the
       step where the error enters.
"""
from typing import Callable, NamedTuple

import numpy as np

from .._checks import require_choice
from ..finite_differences import directional_derivative
from . import solutions as ref
from .mistakes import MISTAKES

RTOL = 1e-9         # a result passes within RTOL * max |truth| of the truth, entry by entry,
ZERO = 1e-13        # or within ZERO * the case's largest gradient where the truth is 0 (the
                    # key bias's gradient: a shift of a softmax row changes nothing)
SEED = 0            # the cases are the same at every call: a verdict can be repeated
PARAMS = ("W_q", "b_q", "W_k", "b_k", "W_v", "b_v", "W_o", "b_o")


class ExerciseResult(NamedTuple):
    """What check() found: truthy iff the function is right; str() says why, in words."""
    name: str
    passed: bool
    message: str

    def __bool__(self):
        return self.passed

    def __str__(self):
        return f"{self.name}: {'correct' if self.passed else 'not yet'}: {self.message}"

    __repr__ = __str__


class Case(NamedTuple):
    args: dict              # the learner's arguments, in order (called positionally)
    truth: list             # what it must return, in the exercise's output order
    upstream: str           # the upstream gradient's argument ('' for a forward)
    other: dict             # args with another random upstream gradient (None for a forward)


class Exercise(NamedTuple):
    signature: str          # what the learner writes
    outputs: tuple          # the names of what it returns, in order (one name: a bare array)
    cases: Callable         # rng -> [square case, rectangular case]


def complex_step_vjp(forward, inputs, dout, h=1e-20):
    """[d <dout, forward(*inputs)> / d x for x in inputs]: one complex-step directional
    derivative (Im f(x + i h e_j) / h) per entry x_j, exact to rounding for an analytic forward."""
    grads = []
    for i, x in enumerate(inputs):
        f_of = lambda z: forward(*inputs[:i], z, *inputs[i + 1:])
        g = np.empty(x.shape)
        for j in np.ndindex(x.shape):
            unit = np.zeros(x.shape)
            unit[j] = 1.0
            g[j] = np.sum(dout * directional_derivative(f_of, x, unit, "complex", h))
        grads.append(g)
    return grads


def _backward_case(rng, upstream, forward, inputs, args):
    """A backward exercise's case: the learner's arguments are the upstream gradient (random),
    then args(*inputs); the truth is the gradient of forward(*inputs) w.r.t. each input."""
    dout, other = (rng.standard_normal(forward(*inputs).shape) for _ in range(2))
    rest = args(*inputs)
    return Case(args={upstream: dout, **rest}, truth=complex_step_vjp(forward, inputs, dout),
                upstream=upstream, other={upstream: other, **rest})


def _linear_cases(rng):
    return [_backward_case(rng, "dy", lambda x, W, b: x @ W + b,
                           [rng.standard_normal((2, 3, d_in)), rng.standard_normal((d_in, d_out)),
                            rng.standard_normal(d_out)], lambda x, W, b: {"x": x, "W": W})
            for d_in, d_out in ((4, 4), (4, 5))]


def _softmax_cases(rng):
    return [_backward_case(rng, "dp", ref.softmax, [2 * rng.standard_normal(shape)],
                           lambda z: {"p": ref.softmax(z)})
            for shape in ((2, 4, 4), (3, 7))]


def _attention_cases(rng):
    return [_backward_case(rng, "dout", lambda q, k, v: ref.attention(q, k, v)[0],
                           [rng.standard_normal((2, n_q, d_k)), rng.standard_normal((2, n_k, d_k)),
                            rng.standard_normal((2, n_k, d_v))],
                           lambda q, k, v: {"q": q, "k": k, "v": v, "p": ref.attention(q, k, v)[1]})
            for n_q, n_k, d_k, d_v in ((4, 4, 4, 4), (3, 5, 8, 6))]


def _multihead_cases(rng):
    cases = []
    for n_q, n_k, d_model, heads in ((3, 3, 4, 2), (3, 5, 6, 3)):
        def forward(query, key, value, *params, heads=heads):
            return ref.multihead_forward(query, key, value, dict(zip(PARAMS, params)), heads)
        inputs = [rng.standard_normal((2, n, d_model)) for n in (n_q, n_k, n_k)]
        inputs += [rng.standard_normal((d_model, d_model) if name[0] == "W" else d_model) for name in PARAMS]
        cases.append(_backward_case(rng, "dout", lambda *x, f=forward: f(*x)[0], inputs,
                                    lambda *x, f=forward: {"cache": f(*x)[1]}))
    return cases


def _split_cases(rng):
    return [Case({"x": x, "num_heads": h}, [ref.split_heads(x, h)], "", None)
            for x, h in ((rng.standard_normal((2, 3, 4)), 2), (rng.standard_normal((2, 5, 6)), 3))]


def _merge_cases(rng):
    return [Case({"xh": xh}, [ref.merge_heads(xh)], "", None)
            for xh in (rng.standard_normal((2, 2, 3, 2)), rng.standard_normal((2, 3, 5, 2)))]


EXERCISES = {
    "linear_backward": Exercise("linear_backward(dy, x, W) -> (dx, dW, db), for y = x W + b",
                                ("dx", "dW", "db"), _linear_cases),
    "softmax_backward": Exercise("softmax_backward(dp, p) -> dz, for p = softmax(z) over the last axis",
                                 ("dz",), _softmax_cases),
    "attention_backward": Exercise("attention_backward(dout, q, k, v, p) -> (dq, dk, dv), for "
                                   "out = p v, p = softmax(q k^T / sqrt(d_k))",
                                   ("dq", "dk", "dv"), _attention_cases),
    "split_heads": Exercise("split_heads(x, num_heads) -> xh, [B, N, D] -> [B, H, N, D / H]",
                            ("xh",), _split_cases),
    "merge_heads": Exercise("merge_heads(xh) -> x, [B, H, N, d_k] -> [B, N, H d_k]", ("x",), _merge_cases),
    "multihead_backward": Exercise("multihead_backward(dout, cache) -> {name: gradient}, for "
                                   "(out, cache) = exercises.multihead_forward(query, key, value, params, H)",
                                   ("query", "key", "value") + PARAMS, _multihead_cases),
}


# ----------------------------------------------------------------------------- the verdict

def check(name, function):
    """Run `function`, a learner's version of exercise `name`, and say whether it is right.

    name: one of EXERCISES (their signatures: exercises' module docstring).
    Returns an ExerciseResult: truthy iff every output agrees with the truth to RTOL on both
    cases; its text says, when not, which line is wrong and what the error looks like.
    """
    require_choice(name, "name", tuple(EXERCISES))
    if not callable(function):
        raise TypeError(f"function must be your {name} function, got {type(function).__name__}")
    exercise = EXERCISES[name]
    cases = exercise.cases(np.random.default_rng(SEED))
    errors = []
    for number, case in enumerate(cases):
        got, problem = _run(function, case, exercise)
        if problem is not None:
            problem = _known_error(name, exercise, case, problem)
        if problem is None and _same(got, case.truth, case.truth):
            largest = max(float(np.max(np.abs(t), initial=0)) for t in case.truth)
            errors += [float(np.max(np.abs(g - t), initial=0)) / largest for g, t in zip(got, case.truth)]
            continue
        if problem is None:
            problem = _diagnosis(name, exercise, case, function, got)
        if number == 1:
            problem += " (on the rectangular case; the square one passes: a length or width is mixed up)"
        return ExerciseResult(name, False, f"{problem}. Shapes: {_shapes(case)}.")
    what = "the complex-step gradient" if cases[0].upstream else "the reference"
    verb = "agrees" if len(exercise.outputs) == 1 else "agree"
    return ExerciseResult(name, True, f"{', '.join(exercise.outputs)} {verb} with {what} to "
                                      f"{max(errors):.1e} of the largest entry, on two cases "
                                      f"({_shapes(cases[0])}; {_shapes(cases[1])}).")


def _run(function, case, exercise, args=None):
    """(outputs as a list of arrays in the exercise's order, None) or (None, what went wrong)."""
    args = case.args if args is None else args
    before = {n: np.copy(x) for n, x in _arrays(args).items()}
    try:
        returned = function(*args.values())
    except NotImplementedError:
        return None, "not written yet (it raises NotImplementedError): write its body, then check again"
    except Exception as exc:            # the learner's code: any error is reported, not raised
        return None, f"it raised {type(exc).__name__}: {exc}"
    changed = [n for n, x in _arrays(args).items() if not np.array_equal(x, before[n], equal_nan=True)]
    if changed:
        return None, (f"it wrote into its argument {changed[0]}: a backward returns new arrays and leaves "
                      f"its inputs unchanged (x -= ... writes into the caller's array; x = x - ... does not)")
    outputs = exercise.outputs
    if isinstance(returned, dict):
        missing = [n for n in outputs if n not in returned]
        if missing:
            return None, f"it returned a dict without {', '.join(missing)}: return {{{', '.join(outputs)}}}"
        returned = [returned[n] for n in outputs]
    elif len(outputs) == 1:
        returned = [returned]
    elif not isinstance(returned, (tuple, list)) or len(returned) != len(outputs):
        return None, f"it must return {len(outputs)} arrays, ({', '.join(outputs)}), got {type(returned).__name__}"
    try:
        return [np.asarray(x, dtype=np.complex128) for x in returned], None
    except (TypeError, ValueError):
        return None, f"it must return arrays of numbers ({', '.join(outputs)})"


def _known_error(name, exercise, case, problem):
    """A known mistake's message, then `problem`, if that mistake meets `problem` too (_run's
    text of what went wrong: an error raised, the same one); else `problem` as it is."""
    for mistake, message in MISTAKES[name]:
        if _run(mistake, case, exercise)[1] == problem:
            return f"{message} ({problem})"
    return problem


def _relative_error(got, truth):
    """max |got - truth| / max |truth| (inf for another shape)."""
    if got.shape != truth.shape:
        return np.inf
    return float(np.max(np.abs(got - truth), initial=0) / max(np.max(np.abs(truth), initial=0), 1e-300))


def _arrays(args, prefix=""):
    """{name: array} of the arguments' arrays, inside dicts too (the module's cache and its
    params): cache['P'] names the cache's P."""
    found = {}
    for name, x in args.items():
        label = f"{prefix}[{name!r}]" if prefix else name
        if isinstance(x, np.ndarray):
            found[label] = x
        elif isinstance(x, dict):
            found.update(_arrays(x, label))
    return found


def _same(got, other, truth):
    """Whether two results agree entry by entry, within RTOL of the truth's largest entry (or
    ZERO of the case's largest gradient)."""
    largest = max(float(np.max(np.abs(t), initial=0)) for t in truth)
    return all(g.shape == o.shape and np.max(np.abs(g - o), initial=0)
               <= max(RTOL * np.max(np.abs(t), initial=0), ZERO * largest)
               for g, o, t in zip(got, other, truth))


def _diagnosis(name, exercise, case, function, got):
    """Why `got` is wrong (module docstring, steps 2-4)."""
    for mistake, message in MISTAKES[name]:
        planted, problem = _run(mistake, case, exercise)
        if problem is None and _same(got, planted, case.truth):
            return message
    if case.other is not None:
        again, problem = _run(function, case, exercise, case.other)
        if problem is None and _same(got, again, case.truth):
            return (f"it returns the same for two different upstream gradients {case.upstream}: it does not use "
                    f"{case.upstream} (the gradient of sum(), an upstream of ones, is what a function "
                    f"computes that ignores it); multiply by {case.upstream} where the chain rule says")
    wrong = [(n, g, t) for n, g, t in zip(exercise.outputs, got, case.truth)
             if not _same([g], [t], case.truth)]
    lines = "; ".join(_what_is_wrong(n, g, t, case) for n, g, t in wrong)
    right = [n for n in exercise.outputs if n not in {w[0] for w in wrong}]
    said = lines + (f"; right: {', '.join(right)}" if right else "")
    return said + (_multihead_step(right) if name == "multihead_backward" else "")


def _what_is_wrong(name, got, truth, case):
    """One wrong output, in words: its shape, 0, a constant factor, or its largest error."""
    if got.shape != truth.shape:
        extra = got.ndim - truth.ndim
        if extra > 0 and got.shape[extra:] == truth.shape:
            why = (f" (one per entry of the leading axes {got.shape[:extra]}: every entry used the same "
                   f"parameter, so its gradient sums over them)")
        elif extra == 0 and got.ndim >= 2 and got.shape[:-2] + got.shape[-2:][::-1] == truth.shape:
            why = " (transposed: a product's operands in the wrong order?)"
        else:
            why = ""
        return f"{name} has shape {got.shape}, expected {truth.shape}{why}"
    if not np.any(got):
        return f"{name} is 0 everywhere"
    factor = np.vdot(truth, got) / np.vdot(truth, truth)
    if abs(factor - 1) > 1e-6 and _relative_error(got, factor * truth) <= RTOL:
        said = f"{name} is {factor.real:.4g} times the right gradient"
        d_k = case.args["q"].shape[-1] if "q" in case.args else None
        if d_k and any(abs(factor.real - s) < 1e-9 for s in (np.sqrt(d_k), 1 / np.sqrt(d_k), d_k, 1 / d_k)):
            said += f" (sqrt(d_k) = {np.sqrt(d_k):.4g}: the scale 1 / sqrt(d_k) belongs in this gradient once)"
        return said
    return f"{name} is off by up to {_relative_error(got, truth):.2g} of its largest entry"


def _multihead_step(right):
    """Where the module's backward goes wrong, from the gradients that are right."""
    if "W_o" not in right or "b_o" not in right:
        return ". Step 5, the output projection's linear_backward, is wrong: start there"
    if not {"query", "key", "value"} & set(right):
        return (". Step 5's gradients (W_o, b_o) are right, so the error enters later in the backward: "
                "split_heads of dconcat (4), the attention backward (3), merge_heads of dQh, dKh, dVh "
                "(2) or the input projections (1)")
    return ". The error is in step 1, the input projections' linear_backward"


def _shapes(case):
    """The case's arguments' shapes, for the verdict's last line."""
    shapes = []
    for n, x in case.args.items():
        if isinstance(x, dict):
            x = {k: v for k, v in x.items() if isinstance(v, np.ndarray) and k in ("query", "key")}
            shapes += [f"{k} {v.shape}" for k, v in x.items()]
        elif isinstance(x, np.ndarray):
            shapes.append(f"{n} {x.shape}")
        else:
            shapes.append(f"{n} = {x}")
    return ", ".join(shapes)
