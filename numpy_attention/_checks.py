"""Argument checks shared by every public entry point.

A leaf module: it imports nothing of the package, so the one-way import rule of
DESIGN.md still holds (every module may use it; it uses none of them).

It also holds the rule for the arrays a cache may keep without copying them (frozen, kept).

Every failure is a ValueError (wrong value or shape) or a TypeError (wrong kind
of object), and its message names the argument and the shapes involved.

dtype rule (DESIGN.md): float32 stays float32, float64 stays float64, complex
stays complex (for complex-step gradient checks), float16 computes in float32,
integers are cast to float64. Booleans, strings and objects are rejected. The 16- and
8-bit floats NumPy lacks (bfloat16, float8: ml_dtypes arrays, or torch or MLX arrays of them)
compute in float32, like float16.
"""
import math
import reprlib
import sys
from collections.abc import Mapping

import ml_dtypes
import numpy as np


def as_float_array(x, name):
    """Return `x` as a floating (or complex) ndarray under the dtype rule.

    The result may share memory with `x`; callers never write into it.
    """
    try:
        arr = to_numpy(x, name)
    except NoConversion:      # an MLX array of a dtype NumPy cannot read: already names x
        raise
    except Exception as exc:  # ragged nested lists and the like
        raise TypeError(f"{name} must be a numeric array, got {type(x).__name__}: {exc}") from None
    kind = arr.dtype.kind
    if is_float_dtype(arr.dtype):
        return arr.astype(np.float32) if arr.dtype.itemsize < 4 else arr
    if kind == "c":
        return arr
    if kind in "iu":
        return arr.astype(np.float64)
    raise TypeError(f"{name} must be a numeric (integer, float or complex) array, "
                    f"got dtype {arr.dtype} with shape {arr.shape}")


def frozen(a):
    """Whether nothing can write into the ndarray `a`: it is read-only, and so is every array
    its memory comes from, down to the array that owns it (MultiHeadAttention's parameters,
    say). A read-only view of a writeable array is not frozen: its owner can still write. An
    owner made read-only is trusted to stay so: numpy lets its holder set it writeable again,
    and leaves writeable the views of it made before it became read-only.
    """
    while isinstance(a, np.ndarray):
        if a.flags.writeable:
            return False
        a = a.base
    return a is None


def read_only_copy(x, dtype=None):
    """A read-only copy of x (in `dtype` if given; None stays None): frozen, nothing can change it."""
    if x is None:
        return None
    x = np.array(x, dtype)
    x.flags.writeable = False
    return x


def kept(a, dtype=None):
    """The array a cache keeps of `a`, in `dtype` (default a's): `a` itself if frozen and of that
    dtype, else a copy in a's memory order (a transposed view copies as a plain memcpy, not a
    transpose). None stays None."""
    if a is None or (frozen(a) and (dtype is None or a.dtype == dtype)):
        return a
    return a.astype(a.dtype if dtype is None else dtype, order="K")


SHOWN = 3          # an error message names this many offending entries, then how many there are


def brief(value):
    """repr(value) cut to SHOWN entries and 60 characters (reprlib): an error message's quote of
    what it got, of bounded length whatever was passed (a list of 10^5 scales, a string of 10^5
    letters)."""
    short = reprlib.Repr()
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = short.maxarray = SHOWN
    short.maxstring = short.maxother = 60
    return short.repr(value)


def offenders(name, x, bad):
    """The first SHOWN entries of the array x where the bool array `bad` (x's shape) holds, as
    'name[i, j] = value', and how many there are: an error message's list of what is wrong, of
    bounded length however large x is."""
    flat = np.flatnonzero(bad)
    shown = ", ".join(f"{name}[{', '.join(map(str, at))}] = {x[at].item()!r}"
                      for at in zip(*np.unravel_index(flat[:SHOWN], x.shape)))
    return shown if flat.size <= SHOWN else f"{shown}, ... ({flat.size} entries)"


def result_dtype(*arrays):
    """The dtype a computation over `arrays` runs in (None entries ignored)."""
    return np.result_type(*[a for a in arrays if a is not None])


def require_ndim(x, name, min_ndim, legend):
    """Raise ValueError unless x.ndim >= min_ndim; `legend` names the axes."""
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} axes {legend}, got shape {x.shape}")


def require_positive_int(value, name, minimum=1):
    """Return `value` as an int, raising unless it is an integer >= minimum (default 1)."""
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be {what}, got {brief(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be {what}, got {value}")
    return int(value)


def require_bool(value, name):
    """Return `value` as a bool, raising TypeError unless it is True or False."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {brief(value)}")
    return bool(value)


def _real_number(value, name, expected):
    """`value` as a float, raising TypeError unless it is a Python or NumPy real scalar (not a
    bool), and ValueError for an integer too large for a float (10**400 is not finite)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be {expected}, got {brief(value)} ({type(value).__name__})")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be {expected}, got an integer of {len(str(value))} digits") from None


def require_positive_real(value, name):
    """Return `value` as a float, raising unless it is a finite real number > 0."""
    number = _real_number(value, name, "a finite real number > 0")
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a finite real number > 0, got {value}")
    return number


def require_nonnegative_real(value, name):
    """Return `value` as a float, raising unless it is a finite real number >= 0."""
    number = _real_number(value, name, "a finite real number >= 0")
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{name} must be a finite real number >= 0, got {value}")
    return number


def require_probability(value, name):
    """Return `value` as a float, raising unless it is a real number in [0, 1)."""
    number = _real_number(value, name, "a real number in [0, 1)")
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{name} must be a real number in [0, 1), got {value}")
    return number


def require_mapping(value, name):
    """Raise TypeError unless `value` is a dict-like mapping of names to arrays."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping of names to arrays (a dict), "
                        f"got {type(value).__name__}")


def require_keys(mapping, name, expected):
    """Raise ValueError naming every missing and unexpected key of `mapping`."""
    missing, unexpected = sorted(set(expected) - set(mapping)), sorted(set(mapping) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{name} keys do not match: missing {missing}, unexpected {unexpected}")


def require_shapes(arrays, name, shapes):
    """Raise ValueError naming the first entry arrays[key] whose shape is not shapes[key]."""
    for key, shape in shapes.items():
        if np.shape(arrays[key]) != tuple(shape):
            raise ValueError(f"{name}[{key!r}] must have shape {tuple(shape)}, "
                             f"got {np.shape(arrays[key])}")


def require_choice(value, name, choices):
    """Raise ValueError unless `value` is one of `choices`."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {brief(value)}")
    return value


def require_same_shape(grad, expected_shape, name):
    """Check an upstream gradient against the forward output it belongs to."""
    try:
        shape = np.shape(grad)
    except ValueError:                                  # a ragged nested list has no shape
        raise TypeError(f"{name} must be a numeric array of the forward output's shape "
                        f"{tuple(expected_shape)}, got a ragged nested {type(grad).__name__}") from None
    if shape != tuple(expected_shape):
        raise ValueError(f"{name} must have the forward output's shape {tuple(expected_shape)}, "
                         f"got {shape}")


def require_cache(cache, cache_type, function, arrays=()):
    """Raise TypeError unless `cache` is the NamedTuple the matching forward returned and its
    fields named in `arrays` hold arrays (a cache edited by hand may not)."""
    if not isinstance(cache, cache_type):
        raise TypeError(f"{function} needs the {cache_type.__name__} returned by its forward, "
                        f"got {type(cache).__name__}")
    for field in arrays:
        if not isinstance(getattr(cache, field), np.ndarray):
            raise TypeError(f"{function} needs the {cache_type.__name__} returned by its forward; "
                            f"its {field} is {type(getattr(cache, field)).__name__}, not an array")


def broadcast_shape_to(x, name, target_shape, legend,
                       example="per-batch, per-key values [B, N_k] are given as [B, 1, 1, N_k]"):
    """Raise ValueError unless array `x` broadcasts to `target_shape`; the message ends with how
    numpy aligns the axes and `example`."""
    try:
        shape = np.broadcast_shapes(x.shape, tuple(target_shape))
    except ValueError:
        shape = None
    if shape != tuple(target_shape):
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to {legend} "
                         f"{tuple(target_shape)} (numpy broadcasting aligns the trailing axes: {example})")


def as_mask(mask, name, target_shape, legend, hint=""):
    """A keep-mask (True/nonzero = attend) as a bool array broadcastable to target_shape; a
    float one holds 0 and 1 only (require_keep_mask, whose message ends with `hint`)."""
    arr = to_numpy(mask, name)
    if is_float_dtype(arr.dtype) and arr.dtype.itemsize < 4:
        arr = arr.astype(np.float32)                 # float16, bfloat16, float8: exactly
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be a bool, integer or float array (nonzero = attend), "
                        f"got dtype {arr.dtype} with shape {arr.shape}")
    require_keep_mask(arr, name, hint)
    broadcast_shape_to(arr, name, target_shape, legend)
    return arr != 0


def require_keep_mask(x, name, hint=""):
    """x itself, raising ValueError naming `bias=` (then `hint`) if x is a float array holding
    anything but 0 and 1: torch's additive float mask (0 and -inf, or -1e9) read as a keep-mask
    would attend exactly the keys it masks."""
    if not is_float_dtype(x.dtype):
        return x
    bad = (x != 0) & (x != 1)
    if bad.any():
        what = "NaN" if np.isnan(x[bad].astype(np.float64)).any() else "entries other than 0 and 1"
        raise ValueError(f"{name} of shape {x.shape} and dtype {x.dtype} holds {what} ({offenders(name, x, bad)}): "
                         f"a float {name} is a keep-mask of 0 and 1 (1 = keep); a float mask of 0 and -inf (or "
                         f"-1e9) is an additive bias: pass it as bias={hint}")
    return x


_TORCH_LOW_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")   # no NumPy dtype: ml_dtypes'

# MLX's dtypes (mlx.core.<name>) and the NumPy dtype each is read as. bfloat16, which NumPy
# lacks (its buffer format is no PEP 3118 one), becomes an ml_dtypes array through float32
# (exact: bfloat16 is a subset of float32); the rest through NumPy's buffer protocol. A dtype
# not listed (one a later MLX adds) is refused rather than read: NumPy could take its bits as
# another type's (a float8 exported as uint8 bytes).
_MLX_DTYPES = {"bool": np.bool_, "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32,
               "uint64": np.uint64, "int8": np.int8, "int16": np.int16, "int32": np.int32,
               "int64": np.int64, "float16": np.float16, "float32": np.float32,
               "float64": np.float64, "complex64": np.complex64,
               "bfloat16": ml_dtypes.bfloat16}


class NoConversion(TypeError):
    """An array of a dtype NumPy cannot read (its message names the argument, dtype and shape)."""


def to_numpy(value, name="the array"):
    """A torch tensor (detached, on the CPU), an MLX array or array-like -> ndarray. torch's
    bfloat16 and float8 tensors and MLX's bfloat16 arrays, which have no NumPy dtype, become
    ml_dtypes arrays (through float32, exactly). An MLX array is read-only (MLX arrays are
    immutable; the result may share its memory); one of a dtype with no NumPy reading raises
    NoConversion (a TypeError) naming `name`, its dtype and shape."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
        if dtype in _TORCH_LOW_FLOATS:
            return value.detach().cpu().float().numpy().astype(getattr(ml_dtypes, dtype))
        return value.detach().cpu().numpy()
    if is_mlx_array(value):
        return _mlx_to_numpy(value, name)
    return np.asarray(value)


def is_mlx_array(value):
    """Whether `value` is an mlx.core.array (or a subclass), told without importing MLX: the
    type is MLX's only if MLX is imported already."""
    mx = sys.modules.get("mlx.core")
    return mx is not None and isinstance(value, getattr(mx, "array", ()))


def _mlx_to_numpy(value, name):
    """An MLX array as an ndarray of the dtype _MLX_DTYPES gives it (see to_numpy)."""
    mx = sys.modules["mlx.core"]
    dtype = str(value.dtype).removeprefix("mlx.core.")
    want = _MLX_DTYPES.get(dtype)
    what = f"{name} is an MLX array of dtype {dtype} with shape {tuple(value.shape)}"
    if want is None:
        raise NoConversion(f"{what}, which has no NumPy or ml_dtypes reading; "
                           f"cast it first (x.astype(mx.float32))")
    if want is ml_dtypes.bfloat16:
        arr = np.array(value.astype(mx.float32)).astype(want)
    else:
        arr = np.asarray(value)
        if arr.dtype != want:     # never read one type's bits as another's
            raise NoConversion(f"{what}, which NumPy reads as {arr.dtype}, not {np.dtype(want)}")
    arr.flags.writeable = False
    return arr


def is_float_dtype(dtype):
    """Whether dtype is a real floating dtype: NumPy's, or ml_dtypes' bfloat16 and float8."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return True
    try:
        return dtype.kind == "V" and ml_dtypes.finfo(dtype) is not None
    except ValueError:
        return False


def as_scalar(value):
    """A 0-d array as its scalar (np.array(1e-6) is read as 1e-6); any other value unchanged."""
    if isinstance(value, np.ndarray) and value.shape == ():
        return value[()]
    return value


def rng_from_seed(seed, name="seed"):
    """numpy.random.default_rng(seed), raising TypeError / ValueError that name `name` unless
    seed is a non-negative integer (or None: fresh entropy). A bool is refused, not read as 0/1."""
    expected = f"{name} must be a non-negative integer (or None), got {brief(seed)}"
    if isinstance(seed, (bool, np.bool_)):
        raise TypeError(expected)
    try:
        return np.random.default_rng(seed)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{expected}: {exc}") from None
