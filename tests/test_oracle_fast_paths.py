"""crosscheck's fast paths give its plain paths' bits: the naive baseline's tiled sums over the
head width (naive.recursive_matmul) are the textbook loop's, and a report computed on threads is
the one computed on one thread with the plain forms (the rounding to a 16- or 8-bit dtype by the
dtype conversions: test_rounding.py holds precision.round_to to them), on a fixed set of cases
(report_cases.py): every field of every row and every diagnosis line."""
import importlib

import numpy as np
import pytest

from report_cases import report_cases, report_record
from test_rounding import converted
from numpy_attention.oracle import naive, recipe

RUNS = importlib.import_module("numpy_attention.oracle.runs")


def plain_recursive_matmul(a, b):
    """recursive_matmul's plain form, its docstring's loop."""
    acc = np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                   dtype=np.result_type(a, b))
    for i in range(a.shape[-1]):
        acc = acc + a[..., :, i:i + 1] * b[..., i:i + 1, :]
    return acc


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


@pytest.mark.slow
@pytest.mark.parametrize("name, arrays, budget", CASES, ids=[name for name, _, _ in CASES])
def test_a_report_is_the_plain_paths_one(name, arrays, budget, monkeypatch):
    """On three threads with the fast forms, and on one thread with the plain forms."""
    fast = report_record(arrays, budget, workers=3)
    monkeypatch.setattr(recipe, "round_to", converted)
    monkeypatch.setattr(RUNS, "round_to", converted)
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
