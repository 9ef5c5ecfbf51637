"""The precisions a kernel computes in, and the baseline the rule holds each one to.

A case names the precision its candidate computed in (`precision`): float64, float32,
float16, bfloat16, and for forward-only checks float8_e4m3fn and float8_e5m2 with
FlashAttention-3's per-(batch, kv head) descales. The baseline the rule holds a
candidate to is an honest implementation at that precision:

    float64, float32   naive.py: the textbook's steps in that dtype, the head-width sums left
                       to right, the long ones in float64 chunks added in that dtype
    float16, bfloat16  the recipe (recipe.py), like FlashAttention's own same-precision reference
                       (attention_ref(..., upcast=False, reorder_ops=True))
    float8_*           the same recipe computing in bfloat16, with P rounded to float8 before
                       P v (attention_ref's intermediate_dtype); out is bfloat16

The recipe: recipe.py. Storage: bfloat16 and float8 arrays are ml_dtypes arrays (the dtypes
JAX gives NumPy).
"""
from typing import NamedTuple

import ml_dtypes
import numpy as np

from .rounding import FORMATS, round_float32

ACCUMULATOR_BITS = (10, 32)   # a narrow accumulator: float32's sign and exponent, bits - 9 of its mantissa


class Precision(NamedTuple):
    name: str
    storage: np.dtype       # the dtype the inputs are stored in
    compute: np.dtype       # T: every intermediate is rounded to it
    weights: np.dtype       # P is rounded to it before P v
    output: np.dtype        # the dtype of out (and of the gradients)
    forward_only: bool      # no recipe for a backward (float8)
    recipe: bool            # False: the naive baseline in `compute` (float32, float64)
    accumulator: int = 32   # the forward's products accumulate in this many bits (the case's accumulator_bits)


_F8E4, _F8E5, _BF16 = (np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
                                                ml_dtypes.bfloat16))
PRECISIONS = {
    "float64": Precision("float64", np.dtype(np.float64), np.dtype(np.float64), np.dtype(np.float64),
                         np.dtype(np.float64), False, False),
    "float32": Precision("float32", np.dtype(np.float32), np.dtype(np.float32), np.dtype(np.float32),
                         np.dtype(np.float32), False, False),
    "float16": Precision("float16", np.dtype(np.float16), np.dtype(np.float16), np.dtype(np.float16),
                         np.dtype(np.float16), False, True),
    "bfloat16": Precision("bfloat16", _BF16, _BF16, _BF16, _BF16, False, True),
    "float8_e4m3fn": Precision("float8_e4m3fn", _F8E4, _BF16, _F8E4, _BF16, True, True),
    "float8_e5m2": Precision("float8_e5m2", _F8E5, _BF16, _F8E5, _BF16, True, True),
}
# raw bit patterns of a precision, as a case may store them (or as np.savez stores ml_dtypes)
BITS = {2: (np.dtype(np.uint16), np.dtype("V2")), 1: (np.dtype(np.uint8), np.dtype("V1"))}


def eps(dtype):
    """Machine epsilon of a NumPy or ml_dtypes float dtype."""
    return float(ml_dtypes.finfo(dtype).eps)


def round_to(x, dtype):
    """x (float32 values) rounded to `dtype`, held in float32: the bits of
    x.astype(dtype).astype(np.float32). bfloat16, float16 and float8 without the conversions,
    on float32 and integer arithmetic (rounding.py: round to nearest, ties to even; NaN as
    ml_dtypes' quiet NaN); other dtypes (float32, float64) convert. A new array; x is not
    written."""
    x = np.asarray(x, np.float32)
    if np.dtype(dtype) in FORMATS:
        return round_float32(x, dtype)
    return x.astype(dtype).astype(np.float32)


def precision_of(dtype):
    """The precision whose storage dtype is `dtype` (None when there is none)."""
    for p in PRECISIONS.values():
        if np.dtype(dtype) == p.storage:
            return p
    return None
