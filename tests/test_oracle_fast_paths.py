"""crosscheck's fast paths give its plain paths' bits: the rounding to bfloat16 and float16
on float32 arithmetic (precision.round_to) is the dtype conversions', the naive baseline's
tiled sums over the head width (naive.recursive_matmul) are the textbook loop's, and a report computed on
threads is the one computed on one thread with the plain forms: on a fixed set of cases
(report_cases.py), every field of every row and every diagnosis line."""
import importlib

import ml_dtypes
import numpy as np
import pytest

from report_cases import report_cases, report_record
from numpy_attention.oracle import naive, precision
from numpy_attention.oracle.precision import round_to

BF16, F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
CHECK = importlib.import_module("numpy_attention.oracle.check")      # the package's crosscheck is a function


def converted(x, dtype):
    """round_to's plain form: the dtype conversions."""
    return np.asarray(x, np.float32).astype(dtype).astype(np.float32)


def plain_recursive_matmul(a, b):
    """recursive_matmul's plain form, its docstring's loop."""
    acc = np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                   dtype=np.result_type(a, b))
    for i in range(a.shape[-1]):
        acc = acc + a[..., :, i:i + 1] * b[..., i:i + 1, :]
    return acc


def hard_float32_values(dtype):
    """float32 values where rounding to dtype is hardest: every value of dtype, the halfway
    points between neighbours and the float32 values next to them (ties to even both ways),
    the subnormals and the overflow threshold, infinities, NaNs with any payload, and random
    bit patterns."""
    info = ml_dtypes.finfo(dtype)
    bits = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    values = np.sort(bits[np.isfinite(bits)].astype(np.float32))
    halfway = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(halfway, np.float32(np.inf)), np.nextafter(halfway, -np.float32(np.inf))])
    top = np.float32(info.max) * np.float32(1 + float(info.eps) / 2)          # the overflow threshold
    edges = np.array([0.0, -0.0, np.inf, -np.inf, top, -top, np.nextafter(top, np.float32(0)),
                      float(info.smallest_normal), float(info.smallest_subnormal) / 2], np.float32)
    payloads = (np.uint32(0x7F800000) | np.arange(1, 2 ** 16, 97, dtype=np.uint32)).view(np.float32)
    rng = np.random.default_rng(0)
    random = rng.integers(0, 2 ** 32, 2 ** 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([values, halfway, near, edges, payloads, -payloads, random])


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_round_to_is_the_conversions(dtype):
    """Every hard case bitwise as the conversions round it (NaN stays NaN); x is not written.
    (Checked once over all 2^32 float32 bit patterns: the same.)"""
    x = hard_float32_values(dtype)
    kept = x.copy()
    with np.errstate(all="ignore"):
        got, want = round_to(x, dtype), converted(x, dtype)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), x[~same][:5]
    assert np.array_equal(x.view(np.uint32), kept.view(np.uint32))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_round_to_takes_a_scalar_and_an_empty_array(dtype):
    for x in (np.float32(1 / 3), np.array(np.nan, np.float32), np.float32(70000.0), np.zeros((2, 0), np.float32)):
        with np.errstate(over="ignore"):
            got, want = round_to(x, dtype), converted(x, dtype)
        assert got.shape == want.shape and np.array_equal(got, want, equal_nan=True)


def test_round_to_a_float8_converts():
    x = np.linspace(-500, 500, 1001, dtype=np.float32)
    f8 = np.dtype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(round_to(x, f8), converted(x, f8), equal_nan=True)


@pytest.mark.parametrize("a_shape, b_shape, dtype", [
    ((3, 5, 7), (3, 7, 4), np.float32),            # batched
    ((2, 1, 40, 9), (3, 9, 33), np.float32),        # broadcast batch axes, several tiles
    ((6, 300), (300, 2), np.float64),               # no batch, a long sum
    ((2, 0, 3), (2, 3, 5), np.float32),             # no rows
])
def test_recursive_matmul_is_the_loop(a_shape, b_shape, dtype, monkeypatch):
    """Bitwise the loop's, also with non-finite entries and with tiles of a few rows (a small
    SUM_TILE); neither input is written."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal(a_shape).astype(dtype), rng.standard_normal(b_shape).astype(dtype)
    a.flat[::11] = np.inf
    b.flat[::13] = np.nan
    inputs = [x.copy() for x in (a, b)]
    for tile in (naive.SUM_TILE, 64):
        monkeypatch.setattr(naive, "SUM_TILE", tile)
        with np.errstate(invalid="ignore"):
            got, want = naive.recursive_matmul(a, b), plain_recursive_matmul(a, b)
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)
    assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip((a, b), inputs))


CASES = report_cases()


@pytest.mark.parametrize("name, arrays, budget", CASES, ids=[name for name, _, _ in CASES])
def test_a_report_is_the_plain_paths_one(name, arrays, budget, monkeypatch):
    """On three threads with the fast forms, and on one thread with the plain forms."""
    fast = report_record(arrays, budget, workers=3)
    monkeypatch.setattr(precision, "round_to", converted)
    monkeypatch.setattr(CHECK, "round_to", converted)
    monkeypatch.setattr(naive, "recursive_matmul", plain_recursive_matmul)
    assert report_record(arrays, budget, workers=1) == fast


@pytest.mark.parametrize("workers, error", [(0, ValueError), (2.5, TypeError), ("2", TypeError)])
def test_workers_is_checked(workers, error):
    name, arrays, budget = CASES[0]
    with pytest.raises(error, match="workers must be a positive integer"):
        report_record(arrays, budget, workers=workers)


def test_the_command_takes_workers(tmp_path, capsys):
    """`--workers N` prints the report of one thread; `--workers 0` is a one-line error, exit 2."""
    from numpy_attention.commands.cli import main
    case = str(tmp_path / "case.npz")
    assert main(["crosscheck", "--write-example", case]) == 0
    capsys.readouterr()
    outputs = []
    for workers in ("1", "3"):
        assert main(["crosscheck", case, "--workers", workers]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "PASS" in outputs[0]
    assert main(["crosscheck", case, "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--workers" in err and "must be an integer >= 1" in err
