"""Hostile kernels for the conformance run's guards (tests/test_conform_guards.py): numpy
kernels that are examples.numpy_float32 until they meet the case they attack, the causal
cell's single key (N_k = 1), where they hang, crash, exit, or write into their arguments.
They live at a module's top level, so that the worker process can import them.
"""
import ctypes
import os
import sys
import time

import numpy as np

from numpy_attention.conformance import declare
from numpy_attention.conformance.examples import numpy_float32

SUPPORTS = ("causal",)


def attacked(k, options):
    """Whether a kernel attacks this case: the causal cell's single key."""
    return bool(options.get("causal")) and k.shape[-2] == 1


def _attacking(attack):
    """A kernel that calls attack() on the attacked case, and is numpy_float32 otherwise."""
    @declare(kind="numpy", supports=SUPPORTS, dtypes=("float32",))
    def kernel(q, k, v, **options):
        if attacked(k, options):
            attack()
        return numpy_float32(q, k, v, **options)
    kernel.__qualname__ = kernel.__name__ = attack.__name__.lstrip("_")
    return kernel


def _hangs():
    time.sleep(3600)


def _segfaults():
    ctypes.string_at(0)                         # reads address 0: SIGSEGV


def _aborts():
    os.abort()


def _exits():
    sys.exit(0)


def _exits_3():
    sys.exit(3)


def _exits_at_once():
    os._exit(0)


hangs, segfaults, aborts, exits, exits_3, exits_at_once = (
    _attacking(attack) for attack in (_hangs, _segfaults, _aborts, _exits, _exits_3, _exits_at_once))


@declare(kind="numpy", supports=(), dtypes=("float32",))
def tells_and_hangs(q, k, v, **options):
    """Writes its process id to the file worker.pid (whole, renamed onto it), then hangs."""
    with open("worker.pid.part", "w") as f:
        f.write(str(os.getpid()))
    os.replace("worker.pid.part", "worker.pid")
    time.sleep(3600)


@declare(kind="numpy", supports=("causal",), dtypes=("float32",))
def slow(q, k, v, **options):
    """numpy_float32, a fifth of a second late: a sweep long enough to interrupt."""
    time.sleep(0.2)
    return numpy_float32(q, k, v, **options)


@declare(kind="numpy", supports=(), dtypes=("float32",))
def prints(q, k, v, **options):
    """numpy_float32, talking on stdout: through Python and through the file descriptor."""
    print("the kernel says hello")
    os.write(1, b"the kernel's C code says hello\n")
    return numpy_float32(q, k, v, **options)


@declare(kind="numpy", supports=(), dtypes=("float32",))
def returns_nan(q, k, v, **options):
    results = numpy_float32(q, k, v, **options)
    return {**results, "out": np.full_like(results["out"], np.nan)}


@declare(kind="numpy", supports=("mask",), dtypes=("float32",))
def drops_mask(q, k, v, mask=None, **options):
    """A kernel without the mask, that makes its mask say so: every key kept."""
    if mask is not None:
        mask[...] = True
    return numpy_float32(q, k, v, **options)


def writes(name, sneaky=False):
    """A kernel that overwrites its argument `name`: a mask with True (every key kept, as if it
    had none), anything else with zeros. It writes before it computes; sneaky: after, its
    argument made writeable again first."""
    def overwrite(x):
        x[...] = True if name == "mask" else 0

    def kernel(q, k, v, **options):
        given = {"q": q, "k": k, "v": v, **options}
        if not sneaky:
            overwrite(given[name])
        results = numpy_float32(q, k, v, **options)
        if sneaky:
            given[name].flags.writeable = True
            overwrite(given[name])
        return results
    return kernel


class Unloadable:
    """A kernel that pickles here but cannot be unpickled in the worker (its module is there;
    its reconstruction raises)."""

    def __call__(self, q, k, v, **options):
        return numpy_float32(q, k, v, **options)

    def __reduce__(self):
        return (_refuse, ())


def _refuse():
    raise RuntimeError("this kernel is not to be unpickled")
