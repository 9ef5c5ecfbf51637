"""How a kernel is called on a case: a torch, JAX or NumPy callable, or a command line.

    kind     the call (options: the case's option keys)          its gradients
    torch    fn(q, k, v, **options) -> out, (out, lse) or          out.backward(dout); q.grad, ...
             (out, lse, max_logits)
             torch tensors of the case's dtype
    jax      fn(q, k, v, **options) -> as torch's                   jax.vjp, cotangent (dout, 0[, 0])
             jax arrays of the case's dtype, under jax.jit (the forward and the vjp one
             compilation; q, k, v and the float options traced, the others constants)
    numpy    fn(q, k, v, **options, dout=dout) -> {"out": ...,     the kernel's own dq, dk, dv
             "lse": ..., "max_logits": ..., "dq": ...}, arrays      (dout given with 'gradients')
             of the case's dtype
             (ml_dtypes.bfloat16 for bfloat16)
    command  "prog --in {in} --out {out}" (without the two          the dq, dk, dv it writes
             placeholders, the two paths are appended): reads the
             case .npz at {in}, writes its results .npz at {out}

The options are crosscheck's case keys (oracle/schema.py), as Python values where they are
scalars (causal True or 'bottom_right', the scale, a probability), a pair (PAIRS: the sliding
band's sides) as a tuple (left, right), and arrays or tensors otherwise: keep-masks bool, the
float options (schema.FLOAT_OPTIONS) in the dtype (with gradients, torch tensors that require
grad: their .grad is judged too, by GRADIENT_OF's names), the sequences' offsets and a page
table int32. A command's input file is the case itself: q, k, v, dout as float32
arrays holding values of the dtype that its `precision` key names (float32, bfloat16,
float16); its output file holds out and any of lse, max_logits, dq, dk, dv and the options'
gradients (options.GRADIENTS), in any float dtype crosscheck reads (storage.py).

The kernel cannot change the case it is judged on. Every array it is given is a copy (NumPy
arrays read-only ones, torch tensors and JAX arrays made from copies), held against the
case byte for byte after the call: a write into one is a KernelError naming it. Of what it
returns, only RESULTS are read (a returned 'mask' or 'q' is not): the case is judged as
drawn. A command's files are its own; it runs with stdin the null device, stdout and stderr
captured (stderr read as UTF-8, any other byte replaced), and, given a timeout, is stopped
with everything it started when it runs longer (KernelTimeout).

The kind is told from the kernel when not given: a str is a command; a callable declared
with supports.declare(kind=...) is that; else 'torch' or 'jax' if its code names torch or JAX
(the modules of its function, its class, the global names its code uses and the variables it
closes over), else 'numpy'.
A kernel's results are those its declaration asks for: lse with 'lse', max_logits with
'max_logits' (KernelError if it returns none), dq, dk, dv with 'gradients'; what it returns
beyond them is not judged.
"""
import functools
import inspect
import os
import shlex
import subprocess
import tempfile
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from .._checks import to_numpy
from .._exits import exit_line
from ..oracle.case import load_case
from ..options import OPTIONS
from ..oracle.schema import FLOAT_OPTIONS
from ..oracle.precision import PRECISIONS
from .processes import ended, start, stop
from .supports import check_kind, declaration_of

GRADIENT_OF = {"q": "dq", "k": "dk", "v": "dv",                 # an input -> its gradient's key
               **{row.name: row.gradient for row in OPTIONS if row.gradient}}
FLOAT_INPUTS = ("q", "k", "v", "dout") + FLOAT_OPTIONS  # cast to the case's dtype for the kernel
NOT_OPTIONS = ("q", "k", "v", "dout", "precision", "fully_masked")  # the case keys a kernel is not given
PAIRS = tuple(row.name for row in OPTIONS if row.case == "pair")    # given as a tuple (left, right)
ROW_RESULTS = ("lse", "max_logits")                 # what a torch or JAX kernel returns after out
RESULTS = ("out",) + ROW_RESULTS + tuple(GRADIENT_OF.values())  # what is read of a kernel's results
LIBRARIES = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "flax": "jax"}   # package -> kind


class KernelError(Exception):
    """A kernel's results that cannot be judged (no lse where it declares one, no gradient), a
    write into its arguments, or a kernel process that died."""


class KernelTimeout(KernelError):
    """No results within the timeout: the kernel's process was stopped."""


class Raised(KernelError):
    """What the kernel raised in its worker process, as describe() told it there."""


class Kernel(NamedTuple):
    """A kernel ready to call: results(arrays, outputs) -> its results as NumPy arrays."""
    name: str               # 'module:function', or the command line
    kind: str               # 'torch', 'jax', 'numpy' or 'command'
    fn: object              # the callable, or the command line's arguments (a list)
    timeout: object = None  # a command's seconds (None: no limit); a callable's: worker.py

    def results(self, arrays, outputs):
        """The kernel's results on a case (grid.draw's arrays): {"out": ..., "lse": ...,
        "dq": ...} as NumPy / ml_dtypes arrays, those that `outputs` asks for."""
        if self.kind == "command":
            returned = _command(self.fn, arrays, outputs, self.timeout)
        else:
            call = {"torch": _torch, "jax": _jax, "numpy": _numpy}[self.kind]
            given, returned = call(self.fn, arrays, outputs)
            _unwritten(given, arrays)
        return {name: to_numpy(x, name) for name, x in _wanted(returned, outputs).items()}


def as_kernel(kernel, kind=None, timeout=None):
    """The Kernel of a callable or a command line; kind overrides the one told from it;
    timeout: a command's seconds (None: no limit)."""
    kind = check_kind(kind) or kind_of(kernel)
    if kind == "command":
        if not isinstance(kernel, str):
            raise TypeError(f"kind='command' takes a command line (a str), got {type(kernel).__name__}")
        return Kernel(kernel, kind, command_args(kernel), timeout)
    if not callable(kernel):
        raise TypeError(f"kernel must be a callable or a command line (a str), got {kernel!r}")
    return Kernel(_name(kernel), kind, kernel)


def describe(exc):
    """What a kernel raised, in one line: its type and its message's first line; a SystemExit
    with where it was raised (_exits.py); a Raised as told in the worker."""
    if isinstance(exc, Raised):
        return str(exc)
    if isinstance(exc, SystemExit):
        return exit_line(exc)
    said = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def kind_of(kernel):
    """'command' for a str; the declared kind; 'torch' or 'jax' if the kernel's code names it;
    else 'numpy'. TypeError for a kernel that is neither callable nor a str."""
    if isinstance(kernel, str):
        return "command"
    if not callable(kernel):
        raise TypeError(f"kernel must be a callable or a command line (a str), got {kernel!r}")
    declared = declaration_of(kernel).kind
    if declared is not None:
        return declared
    named = {LIBRARIES.get(module.split(".")[0]) for module in _modules(kernel)}
    return "torch" if "torch" in named else "jax" if "jax" in named else "numpy"


def _modules(kernel):
    """The modules a kernel is made of: its function's (unwrapped from functools.partial and
    decorators), its class's, and those of the global names its function's code uses and of
    the variables it closes over."""
    fn = kernel
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = inspect.unwrap(fn)
    found = [cls.__module__ for cls in type(fn).__mro__]        # a torch.nn.Module, a jitted function
    code_of = getattr(fn, "__func__", fn)                       # a bound method's function
    if not inspect.isfunction(code_of):
        code_of = getattr(type(fn).__call__, "__func__", type(fn).__call__)     # a callable object
    found.append(getattr(code_of, "__module__", None) or "")
    names = getattr(getattr(code_of, "__code__", None), "co_names", ())
    values = [getattr(code_of, "__globals__", {}).get(name) for name in names]
    values += [cell.cell_contents for cell in getattr(code_of, "__closure__", None) or ()]
    found += [value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None) or ""
              for value in values]
    return found


def _name(kernel):
    """'module:qualname' of a function, else its type's name."""
    module, qualname = getattr(kernel, "__module__", None), getattr(kernel, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else type(kernel).__name__


def command_args(line):
    """A command line's arguments, split as a POSIX shell would, with '{in}' and '{out}' where
    the paths go (both or neither: then the two paths are appended)."""
    args = shlex.split(line)
    has_in, has_out = "{in}" in line, "{out}" in line
    if not args or has_in != has_out:
        raise ValueError(f"kernel: a command line names a program, and where its input and output "
                         f"files go with both {{in}} and {{out}} (or neither: the two paths are "
                         f"appended); got {line!r}")
    return args if has_in else args + ["{in}", "{out}"]


def _arguments(arrays, gradients):
    """(q, k, v, options, dout): the case's arrays as a kernel takes them, still NumPy: the
    float inputs in the case's dtype, 0-d options as Python values, a pair (PAIRS) a tuple; each
    array a read-only copy."""
    storage = PRECISIONS[str(arrays["precision"])].storage

    def value(name, x):
        if name in PAIRS:
            return tuple(int(w) for w in x)
        if x.ndim == 0:
            return x.item()
        copy = x.astype(storage) if name in FLOAT_INPUTS else x.copy()
        copy.flags.writeable = False
        return copy

    given = {name: value(name, np.asarray(x)) for name, x in arrays.items()}
    options = {name: x for name, x in given.items() if name not in NOT_OPTIONS}
    return given["q"], given["k"], given["v"], options, given.get("dout") if gradients else None


def _unwritten(given, arrays):
    """KernelError naming the first argument the kernel wrote into: each array or tensor it was
    given ({name: value}) held against the case's own array, byte for byte (a float input in
    the case's float32, which holds its dtype's values exactly; a NaN as any NaN: a 16-bit
    NaN's payload and sign do not survive the trip through float32 alike)."""
    for name, x in given.items():
        if x is None or isinstance(x, (bool, int, float, str, tuple)):
            continue
        seen, case = to_numpy(x, name), np.asarray(arrays[name])
        seen = seen.astype(case.dtype) if seen.shape == case.shape else None
        nan_at = lambda a: np.isnan(a) if a.dtype.kind == "f" else np.zeros(a.shape, bool)
        if seen is None or not np.array_equal(nan_at(seen), nan_at(case)) \
                or seen[~nan_at(case)].tobytes() != case[~nan_at(case)].tobytes():
            raise KernelError(f"the kernel wrote into its argument {name} (a copy of the case's "
                              f"{name}, which is judged as drawn)")


def _returned(returned):
    """{"out": out, "lse": lse or None, "max_logits": ... or None} from a kernel that returns
    out, (out, lse) or (out, lse, max_logits)."""
    if not isinstance(returned, (tuple, list)):
        return {"out": returned}
    if not 2 <= len(returned) <= 1 + len(ROW_RESULTS):
        raise KernelError(f"the kernel returned {len(returned)} values; it returns out, (out, lse) or "
                          f"(out, lse, max_logits)")
    return dict(zip(("out",) + ROW_RESULTS, returned))


def _torch(fn, arrays, outputs):
    import torch
    gradients = "gradients" in outputs
    dtype = getattr(torch, str(arrays["precision"]))

    def tensor(name, x):                          # a copy of the kernel's own
        if name in FLOAT_INPUTS:
            t = torch.tensor(x.astype(np.float32)).to(dtype)
            return t.requires_grad_(gradients and name in GRADIENT_OF)
        return torch.tensor(x) if isinstance(x, np.ndarray) else x

    q, k, v, options, dout = _arguments(arrays, gradients)
    q, k, v = (tensor(name, x) for name, x in zip("qkv", (q, k, v)))
    options = {name: tensor(name, x) for name, x in options.items()}
    given = {"q": q, "k": k, "v": v, **options}
    results = _returned(fn(q, k, v, **options))
    if gradients:
        given["dout"] = tensor("dout", dout)
        results["out"].backward(given["dout"])
        results.update({GRADIENT_OF[name]: given[name].grad for name in GRADIENT_OF
                        if name in given and given[name].grad is not None})
    return given, results


def _jax(fn, arrays, outputs):
    """The kernel under jax.jit, forward and vjp in one compilation: q, k, v and the float
    options traced (and differentiated), the others constants of the trace."""
    import jax
    import jax.numpy as jnp
    gradients = "gradients" in outputs
    q, k, v, options, dout = _arguments(arrays, gradients)
    options = {name: jnp.array(x) if isinstance(x, np.ndarray) else x for name, x in options.items()}
    names = ["q", "k", "v"] + [name for name in GRADIENT_OF if name in options]   # differentiated
    fixed = {name: x for name, x in options.items() if name not in names}
    primals = [jnp.array(q), jnp.array(k), jnp.array(v)] + [options[name] for name in names[3:]]
    given = {**dict(zip(names, primals)), **fixed}            # JAX arrays: immutable, checked alike

    def call(*xs):
        given = dict(zip(names, xs))
        return fn(given.pop("q"), given.pop("k"), given.pop("v"), **given, **fixed)

    def forward_and_back(primals, dout):
        returned, vjp = jax.vjp(call, *primals)
        out = _returned(returned)["out"]
        cotangent = dout.astype(out.dtype)
        if isinstance(returned, (tuple, list)):   # no loss on lse, max_logits: their cotangents are 0
            cotangent = type(returned)((cotangent, *(jnp.zeros_like(x) for x in returned[1:])))
        return returned, vjp(cotangent)

    if not gradients:
        return given, _returned(jax.jit(call)(*primals))
    returned, grads = jax.jit(forward_and_back)(primals, jnp.asarray(dout))
    return given, {**_returned(returned), **{GRADIENT_OF[name]: g for name, g in zip(names, grads)}}


def _numpy(fn, arrays, outputs):
    q, k, v, options, dout = _arguments(arrays, "gradients" in outputs)
    extra = {} if dout is None else {"dout": dout}
    given = {"q": q, "k": k, "v": v, **options, **extra}
    try:
        returned = fn(q, k, v, **options, **extra)
    except ValueError as exc:                 # NumPy's word for a write into a read-only array
        if "read-only" not in str(exc):
            raise
        raise KernelError(f"the kernel wrote into one of its arguments, read-only copies of the "
                          f"case ({describe(exc)})") from exc
    if not isinstance(returned, Mapping) or "out" not in returned:
        raise KernelError(f"a numpy kernel returns a dict with 'out' (and 'lse', 'dq', ...), "
                          f"got {type(returned).__name__}")
    return given, dict(returned)


def _command(args, arrays, outputs, timeout):
    """The command's results: the case written to its {in} file, the program run (stopped with
    its process group after `timeout` seconds), its {out} file read."""
    with tempfile.TemporaryDirectory(prefix="conform-") as directory:
        paths = {"{in}": os.path.join(directory, "case.npz"), "{out}": os.path.join(directory, "results.npz")}
        with open(paths["{in}"], "wb") as f:
            np.savez(f, **{name: x for name, x in arrays.items()
                           if name != "dout" or "gradients" in outputs})
        line = [functools.reduce(lambda a, p: a.replace(p, paths[p]), paths, arg) for arg in args]
        process = start(line, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _, stderr = process.communicate(timeout=timeout)
        except BaseException as exc:          # the timeout, or a Ctrl-C: nothing of it left running
            stop(process)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise KernelTimeout(f"no results within {timeout:g} s: {args[0]} was stopped") from None
            raise
        if process.returncode != 0:
            said = (stderr.decode("utf-8", "replace").strip().splitlines() or ["(nothing on stderr)"])[-1]
            raise KernelError(f"{args[0]} {ended(process.returncode)}: {said}")
        if not os.path.exists(paths["{out}"]):
            raise KernelError(f"{args[0]} exited 0 but wrote no results file")
        return load_case(paths["{out}"])


def _wanted(results, outputs):
    """The results that `outputs` asks for (None is absent; names not in RESULTS are not read);
    KernelError for one it lacks."""
    results = {name: x for name, x in results.items() if x is not None and name in RESULTS}
    for name in ROW_RESULTS:
        if name in outputs and name not in results:
            raise KernelError(f"the kernel returned no {name}; its declaration says it returns one "
                              f"({name!r} in supports): return (out, lse{', max_logits' * (name != 'lse')}), "
                              f"or a dict with {name!r} (numpy)")
    missing = [name for name in ("dq", "dk", "dv") if name not in results]
    if "gradients" in outputs and missing:
        raise KernelError(f"the kernel gave no {missing[0]}; its declaration says it has gradients "
                          f"('gradients' in supports)")
    dropped = tuple(name for name in ROW_RESULTS if name not in outputs) + \
        (() if "gradients" in outputs else tuple(GRADIENT_OF.values()))
    return {name: x for name, x in results.items() if name not in dropped}
