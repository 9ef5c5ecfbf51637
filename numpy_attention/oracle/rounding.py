"""Rounding float32 values to a narrower float format (bfloat16, float16, float8), round to
nearest, ties to even, with the result held in float32: the bits of
x.astype(dtype).astype(np.float32), on float32 and integer arithmetic over whole arrays.

A float32 is 32 bits, sign | exponent | mantissa = 1 | 8 | 23:

    bits = s eeeeeeee mmmmmmmmmmmmmmmmmmmmmmm      x = (-1)^s 1.m * 2^(e - 127)   (0 < e < 255)
                                                   x = (-1)^s 0.m * 2^-126        (e = 0: subnormal)
                                                   e = 255: +-inf (m = 0), NaN (m != 0)

A narrower format keeps M of the 23 mantissa bits and a smaller exponent range:

    format          M   normal from    largest finite           overflow   (ml_dtypes.finfo)
    bfloat16        7   2^-126         (2 - 2^-7) 2^127         +-inf
    float16        10   2^-14          65504 = (2 - 2^-10) 2^15 +-inf
    float8_e4m3fn   3   2^-6           448 = 1.75 * 2^8         NaN (no inf: its top code is NaN)
    float8_e5m2     2   2^-14          57344 = 1.75 * 2^15      +-inf

Below its smallest normal 2^emin a format has subnormals: the multiples of 2^(emin - M).
Rounding x to it is rounding x to a grid, of spacing 2^(E - M) in x's binade [2^E, 2^(E+1))
and 2^(emin - M) below 2^emin, halfway cases to the even multiple.

Same exponent range (bfloat16), on the integer bits. With S = 23 - M dropped bits, adding
2^(S-1) - 1 plus the last kept bit, then clearing the S low bits, rounds the magnitude to
nearest with ties to even:

    bits + 0x7FFF + ((bits >> 16) & 1), low 16 bits cleared      (bfloat16: S = 16)

below a tie the sum stays in the kept bits, above it carries one into them; a tie carries
only when the last kept bit is 1 (odd), making it even. A carry out of the mantissa raises
the exponent (the next binade, or the largest finite value to inf), as rounding must; the
sign bit is untouched, and float32's subnormals round as bfloat16's, both multiples of
2^-133 there. Only NaN must be set apart: the carry could turn it into inf or a number.

Narrower exponent range (float16, float8), on float32 additions. Adding to |x| a power of
two sigma = 2^(E' + S) with E' = max(E, emin) puts the sum in sigma's binade, whose spacing is
2^(E' + S - 23) = 2^(E' - M): the addition itself, rounding to nearest with ties to even,
rounds |x| to the format's grid (in x's binade, and the subnormals' fixed spacing below
2^emin), and subtracting sigma again is exact:

    r = (|x| + sigma) - sigma,       sigma = 2^(max(E, emin) + S),   then x's sign put back

(the sum's last bit has the weight of the format's last mantissa bit, so even is even). sigma
is computed on the bits: |x|'s exponent field, clipped to [emin, the largest's exponent]
(the upper clip keeps sigma finite; the values it touches overflow anyway), plus S in the
exponent field. A result above the largest finite value is an overflow: +-inf, or NaN for
float8_e4m3fn. Overflow, +-inf and NaN inputs are the rare path, found by the largest |r|.

NaN: ml_dtypes gives its quiet NaN with x's sign, 0x7FC00000 | sign in float32; so does this
module, for every format. (NumPy's float16 cast keeps some of a NaN's payload bits, by its
build: the float16 results are NaN with x's sign, their payload bits may differ.)
"""
from typing import NamedTuple

import ml_dtypes
import numpy as np

SIGN, MAGNITUDE, EXPONENT = np.uint32(0x80000000), np.uint32(0x7FFFFFFF), np.uint32(0x7F800000)
QUIET_NAN, INF = np.uint32(0x7FC00000), np.uint32(0x7F800000)


class Format(NamedTuple):
    mantissa: int          # M: mantissa bits kept
    min_exponent: int      # emin: the smallest normal is 2^emin; below it the multiples of 2^(emin - M)
    largest: float         # the largest finite value
    overflow: np.uint32    # the float32 bits of an overflow's magnitude: inf, or NaN (no inf)


FORMATS = {
    np.dtype(ml_dtypes.bfloat16): Format(7, -126, (2 - 2 ** -7) * 2.0 ** 127, INF),
    np.dtype(np.float16): Format(10, -14, 65504.0, INF),
    np.dtype(ml_dtypes.float8_e4m3fn): Format(3, -6, 448.0, QUIET_NAN),
    np.dtype(ml_dtypes.float8_e5m2): Format(2, -14, 57344.0, INF),
}


def round_float32(x, dtype):
    """x (a float32 array) rounded to `dtype` (a key of FORMATS), held in float32: a new
    array of x's shape, bitwise x.astype(dtype).astype(np.float32) (NaN: the quiet NaN
    0x7FC00000 with x's sign). x is not written."""
    fmt = FORMATS[np.dtype(dtype)]
    flat = np.asarray(x, np.float32).reshape(-1)          # a 1-d view (a copy if x is strided)
    if flat.size == 0:
        return flat.copy().reshape(np.shape(x))
    same_range = fmt.min_exponent == -126                   # float32's exponent range: bfloat16
    rounded = _round_bits(flat, fmt) if same_range else _round_by_adding(flat, fmt)
    return rounded.view(np.float32).reshape(np.shape(x))


def _round_bits(x, fmt):
    """The uint32 bits of x (1-d float32) rounded to M mantissa bits on the bits (float32's
    exponent range): bits + 2^(S-1) - 1 + last kept bit, the S = 23 - M low bits cleared."""
    bits = x.view(np.uint32)
    dropped = 23 - fmt.mantissa
    rounded = bits >> dropped
    rounded &= np.uint32(1)                                 # the last kept bit: ties to even
    rounded += np.uint32((1 << (dropped - 1)) - 1)
    rounded += bits
    rounded &= ~np.uint32((1 << dropped) - 1)
    if np.isnan(x.max()):                                   # (a NaN is the max)
        nan = np.isnan(x)
        rounded[nan] = (bits[nan] & SIGN) | QUIET_NAN
    return rounded


def _round_by_adding(x, fmt):
    """The uint32 bits of x (1-d float32) rounded to `fmt` by (|x| + sigma) - sigma, sigma =
    2^(max(E, emin) + S) (the module docstring), overflow and NaN set apart, x's sign put back."""
    bits = x.view(np.uint32)
    dropped = 23 - fmt.mantissa
    size = bits & MAGNITUDE                                 # |x|, rounded in place below
    sigma = size & EXPONENT
    top = np.float32(fmt.largest).view(np.uint32) & EXPONENT
    np.clip(sigma, np.uint32((fmt.min_exponent + 127) << 23), top, out=sigma)
    sigma += np.uint32(dropped << 23)                       # 2^(E' + S)
    magnitude, step = size.view(np.float32), sigma.view(np.float32)
    with np.errstate(invalid="ignore"):                     # a signaling NaN's add
        magnitude += step                                   # rounds to the format's grid
        magnitude -= step
    largest = np.float32(fmt.largest).view(np.uint32)
    if size.max() > largest:                                # overflow, inf or NaN (NaN's bits are larger)
        special = size > largest
        size[special] = np.where(np.isnan(x[special]), QUIET_NAN, fmt.overflow)
    np.bitwise_and(bits, SIGN, out=sigma)
    size |= sigma
    return size
