"""Rounding float32 to bfloat16, float16 and float8 on float32 and integer arithmetic
(oracle/rounding.py, precision.round_to) gives the bits of the dtype conversions,
x.astype(dtype).astype(np.float32): ml_dtypes' for bfloat16 and float8, NumPy's for float16.
NaN: ml_dtypes' quiet NaN 0x7FC00000 with x's sign, bit for bit; NumPy's float16 cast keeps
payload bits (as its build does), so there a NaN with x's sign. (benchmarks/check_rounding.py
checks all 2^32 float32 bit patterns.)"""
import ml_dtypes
import numpy as np
import pytest

from numpy_attention.oracle.precision import round_to
from numpy_attention.oracle.rounding import FORMATS

DTYPES = [np.dtype(t) for t in (ml_dtypes.bfloat16, np.float16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)]
IDS = [d.name for d in DTYPES]


def converted(x, dtype):
    """round_to's plain form: the dtype conversions."""
    with np.errstate(all="ignore"):
        return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


def boundary_mantissas():
    """23-bit mantissas at every rounding position d (d low bits dropped, 1 <= d <= 23): the
    tie 2^(d-1) with the last kept bit 0 (even) and 1 (odd), under kept bits all 0 or all 1,
    and one below and above each; 0, 1 and the largest mantissa."""
    m = {0, 1, 0x7FFFFF}
    for d in range(1, 24):
        for kept in (0, 1 << d, 0x7FFFFF & ~((1 << d) - 1), 0x7FFFFF & ~((2 << d) - 1)):
            tie = kept | (1 << (d - 1))
            m |= {tie - 1, tie, tie + 1}
    return np.array(sorted(v for v in m if 0 <= v <= 0x7FFFFF), np.uint32)


def enumerated(dtype):
    """float32 values where rounding is hardest: every float32 exponent field (subnormals,
    infinities and NaNs with their payloads among them) with each boundary mantissa, both
    signs; every finite value of dtype, the halfway points between neighbours (the overflow
    threshold among them: halfway from the largest to the next power of 2) and the float32
    values next to them."""
    fields = np.arange(256, dtype=np.uint32)[:, None] << 23
    positive = (fields | boundary_mantissas()[None, :]).ravel()
    bits = np.concatenate([positive, positive | np.uint32(0x80000000)]).view(np.float32)
    count, info = 2 ** (8 * dtype.itemsize), ml_dtypes.finfo(dtype)
    every = np.arange(count, dtype=np.uint32).astype(np.uint16 if count > 256 else np.uint8).view(dtype)
    beyond = float(info.max) + 2.0 ** (np.floor(np.log2(float(info.max))) - info.nmant)   # the next power of 2
    values = np.sort(np.concatenate([every[np.isfinite(every)].astype(np.float64), [beyond, -beyond]]))
    halfway = ((values[:-1] + values[1:]) / 2).astype(np.float32)   # exact; the overflow thresholds among them
    values = values[1:-1].astype(np.float32)
    near = np.concatenate([np.nextafter(halfway, np.float32(np.inf)), np.nextafter(halfway, -np.float32(np.inf))])
    return np.concatenate([bits, values, halfway, near])


def random_bits(count=2 ** 20, seed=0):
    """`count` random float32 bit patterns."""
    return np.random.default_rng(seed).integers(0, 2 ** 32, count, dtype=np.uint64).astype(np.uint32).view(np.float32)


def assert_rounds_alike(x, dtype):
    """round_to(x, dtype) bitwise the conversions' (float16's NaN: a NaN of x's sign); x unwritten."""
    kept = x.copy()
    got, want = round_to(x, dtype), converted(x, dtype)
    assert got.dtype == np.float32 and got.shape == x.shape
    same = got.view(np.uint32) == want.view(np.uint32)
    if dtype == np.float16:
        same |= np.isnan(got) & np.isnan(want) & (np.signbit(got) == np.signbit(want))
    assert same.all(), [hex(b) for b in x[~same][:5].view(np.uint32)]
    assert np.array_equal(x.view(np.uint32), kept.view(np.uint32))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_enumerated_values_round_as_the_conversions(dtype):
    assert_rounds_alike(enumerated(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_random_bit_patterns_round_as_the_conversions(dtype):
    assert_rounds_alike(random_bits(), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_nan_is_the_quiet_nan_with_the_sign(dtype):
    """Every NaN (any payload, signaling or quiet, either sign) becomes 0x7FC00000 with its
    sign, as ml_dtypes' conversions give; no warning (a signaling NaN's add would raise one)."""
    payloads = np.array([1, 2, 0x1000, 0x1FFF, 0x2000, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF], np.uint32)
    nans = np.concatenate([0x7F800000 | payloads, 0xFF800000 | payloads]).view(np.float32)
    with np.errstate(all="raise"):
        got = round_to(nans, dtype).view(np.uint32)
    assert np.array_equal(got, np.uint32(0x7FC00000) | (nans.view(np.uint32) & np.uint32(0x80000000)))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_formats_are_ml_dtypes_finfo(dtype):
    """The table's mantissa bits, smallest normal and largest finite value are finfo's."""
    fmt, info = FORMATS[dtype], ml_dtypes.finfo(dtype)
    assert (fmt.mantissa, 2.0 ** fmt.min_exponent, fmt.largest) == (info.nmant, float(info.smallest_normal),
                                                                    float(info.max))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_shapes_scalars_and_strided_arrays(dtype):
    """A scalar gives a 0-d array, an empty array an empty one, a strided view and a float64
    array (rounded to float32 first) their shapes and the conversions' bits."""
    wide = np.linspace(-600, 600, 4001).reshape(1, 4001)
    for x in (np.float32(1 / 3), np.array(np.nan, np.float32), np.float32(70000.0), np.zeros((2, 0), np.float32),
              random_bits(64 * 48).reshape(64, 48)[::3, 1::2].T, wide):
        got, want = round_to(x, dtype), converted(x, dtype)
        assert got.shape == np.shape(x) and np.array_equal(got, want, equal_nan=True)
