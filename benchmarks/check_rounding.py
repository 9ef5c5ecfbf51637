"""Every float32 bit pattern rounded by precision.round_to against the conversions it stands
for, x.astype(dtype).astype(np.float32) (ml_dtypes' bfloat16 and float8, NumPy's float16):
per dtype, the count of results whose bits differ, of those that are not both NaN of the same
sign (NaN payloads: ml_dtypes gives its one quiet NaN, NumPy's float16 cast keeps payload
bits), and the time of each side over all 2^32 patterns, taken in chunks.

    python3 benchmarks/check_rounding.py [--dtypes bfloat16 float16 float8_e4m3fn float8_e5m2]
                                         [--chunk-bits 24]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, table  # noqa: E402
from numpy_attention.oracle.precision import round_to  # noqa: E402
from numpy_attention.oracle.rounding import FORMATS  # noqa: E402

DTYPES = {dtype.name: dtype for dtype in FORMATS}


def check(dtype, chunk_bits):
    """(bit mismatches, mismatches that are not NaN of the same sign, round_to's seconds,
    the conversions' seconds) over all 2^32 float32 bit patterns."""
    differ = wrong = 0
    ours = theirs = 0.0
    step = 1 << chunk_bits
    for start in range(0, 1 << 32, step):
        x = np.arange(start, start + step, dtype=np.uint32).view(np.float32)
        t0 = time.perf_counter()
        got = round_to(x, dtype)
        t1 = time.perf_counter()
        with np.errstate(all="ignore"):
            want = x.astype(dtype).astype(np.float32)
        t2 = time.perf_counter()
        ours, theirs = ours + t1 - t0, theirs + t2 - t1
        bad = got.view(np.uint32) != want.view(np.uint32)
        nan = np.isnan(got) & np.isnan(want) & (np.signbit(got) == np.signbit(want))
        differ, wrong = differ + int(bad.sum()), wrong + int((bad & ~nan).sum())
    return differ, wrong, ours, theirs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--chunk-bits", type=int, default=24, help="2^bits patterns a chunk (default 24)")
    args = parser.parse_args()
    load = OtherLoad()
    rows = []
    for name in args.dtypes:
        differ, wrong, ours, theirs = check(DTYPES[name], args.chunk_bits)
        rows.append([name, f"{differ:,}", f"{wrong:,}", f"{ours:.1f}", f"{theirs:.1f}"])
    print(machine_line())
    print(table(["dtype", "bits differ", "not NaN alike", "round_to s", "astype s"], rows))
    print(load.line())


if __name__ == "__main__":
    main()
