"""How a case stores its arrays, and which precision its candidate computed in.

A tensor of a case may be stored as
    a NumPy float array           float16, float32, float64
    an ml_dtypes array            bfloat16, float8_e4m3fn, float8_e5m2 (JAX's dtypes in NumPy);
                                  np.savez writes these as raw bytes (void dtypes V2 / V1)
    an ml_dtypes float4_e2m1fn    q, k or v of NVFP4's elements (their values lie in every
                                  16- or 8-bit format: read as the precision's storage)
    raw bit patterns              uint16 / uint8 (or V2 / V1) with the precision named
    float values                  float32 / float64 holding values that are exactly
                                  representable in a 16- or 8-bit precision (checked); for
                                  a float32 / float64 precision the baseline rounds them

A typed array is read as what it is: a 16- or 8-bit array of another format than the
precision's (a bfloat16 array with precision 'float16') is an error naming both.

The precision (precision.py) is the one the case names (`precision` key or keyword);
unnamed, it is q's own if q is stored in a 16- or 8-bit format, else that of the
narrowest candidate tensor (a float16 out with a float32 lse computed in float16).
"""
import ml_dtypes
import numpy as np

from .precision import PRECISIONS, precision_of

_BITS = {2: "bfloat16", 1: None}            # bytes of a raw pattern -> the precision it implies
FLOAT4 = np.dtype(ml_dtypes.float4_e2m1fn)  # NVFP4's elements: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives


class StorageError(ValueError):
    """A tensor that cannot be read in the case's precision (the message names it)."""


def is_raw(x):
    """Raw bit patterns: unsigned integers or void bytes of 1 or 2 bytes (an ml_dtypes array,
    whose kind NumPy reports as 'V' too, is typed, not raw)."""
    return (x.dtype.kind == "u" or x.dtype.type is np.void) and x.dtype.itemsize in (1, 2)


def _check_typed(name, x, precision):
    """A 16- or 8-bit typed array (float16, bfloat16, float8) is read as what it is: in a 16-
    or 8-bit precision it must be one of that precision's formats, else StorageError naming
    both (a bfloat16 array is not float16 bits)."""
    if not precision.recipe or x.dtype.itemsize > 2 or precision_of(x.dtype) is None:
        return
    formats = {precision.storage, precision.compute, precision.weights, precision.output}
    if x.dtype not in formats:
        raise StorageError(f"{name} is a {x.dtype} array but the precision is {precision.name!r}, which "
                           f"holds {' and '.join(sorted({str(d) for d in formats}))}: name the precision "
                           f"the kernel computed in, or store {name} in it")


def infer_precision(q, candidates):
    """The precision a case's candidate computed in, when the case does not name it."""
    for x in [q] + sorted(candidates.values(), key=lambda c: c.dtype.itemsize):
        if is_raw(x):
            name = _BITS[x.dtype.itemsize]
            if name is None:
                raise StorageError(f"a 1-byte raw tensor (dtype {x.dtype}) may be float8_e4m3fn or "
                                   f"float8_e5m2: name the precision")
            return PRECISIONS[name]
        found = precision_of(x.dtype)
        if found is not None and (x is not q or found.storage.itemsize < 4):
            return found
    return PRECISIONS["float64"]


def decode(name, x, precision, role):
    """The tensor `name` as an array of a float or ml_dtypes dtype.

    role: 'input' (q, k, v: stored in the precision's storage dtype), 'gradient input'
    (dout: the compute dtype) or 'result' (a candidate: any float format). Raw bits are
    viewed as the precision's dtype of their width; float values of an input are checked
    to be exactly representable in its dtype.
    """
    # float32 / float64 inputs of any float dtype are rounded to the precision by the baseline;
    # a 16- or 8-bit precision's inputs must hold exactly the values the kernel read
    wanted = {"input": precision.storage, "gradient input": precision.compute}.get(role) \
        if precision.recipe else None
    if x.dtype == FLOAT4:
        if role != "input":
            raise StorageError(f"{name} is a float4_e2m1fn array; only q, k and v may be stored in it (NVFP4's "
                               f"elements), not a {role}")
        x = x.astype(np.float32)                         # (exact: e2m1's values lie in every format)
    if is_raw(x):
        widths = {d.itemsize: d for d in (precision.output, precision.compute, precision.storage)}
        if x.dtype.itemsize not in widths:
            raise StorageError(f"{name} is {x.dtype.itemsize}-byte raw bits (dtype {x.dtype}), which "
                               f"precision {precision.name!r} does not store")
        return np.ascontiguousarray(x).view(widths[x.dtype.itemsize])
    _check_typed(name, x, precision)
    if precision_of(x.dtype) is None and x.dtype.kind != "f":
        raise StorageError(f"{name} must be a float array (float16/32/64, an ml_dtypes bfloat16 or "
                           f"float8 array, or raw bits), got dtype {x.dtype} with shape {x.shape}")
    if x.dtype.kind == "f" and x.dtype.itemsize > 8:
        raise StorageError(f"{name} must be float16, float32 or float64 (the oracle must be wider "
                           f"than the candidate), got dtype {x.dtype}")
    if wanted is not None and x.dtype != wanted:
        exact = x.astype(wanted).astype(x.dtype)
        bad = ~((exact == x) | (np.isnan(exact) & np.isnan(x.astype(np.float64))))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise StorageError(f"{name} has {int(bad.sum())} values not representable in {wanted} "
                               f"(precision {precision.name!r}), e.g. {name}{list(where)} = "
                               f"{x[where]!r}; store the values the kernel read")
    return x
