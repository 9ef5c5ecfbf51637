"""The naive baseline's long sums in chunks (numpy_attention/oracle/naive.py, CHUNK = 32)
against the same sums left to right (CHUNK = 1: each product rounded to float32 and added
in float32, one term at a time): each tensor's max-abs error from the float64 oracle, the
ratio chunked / left to right, its median, min and max over random float32 cases (sharp
and soft softmax rows, causal or not, grouped-query heads or not).

    python3 benchmarks/naive_chunks.py [--cases 20] [--seed 7]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine_line  # noqa: E402
import numpy_attention as na  # noqa: E402
from numpy_attention.oracle import naive  # noqa: E402

NAMES = ("out", "lse", "dq", "dk", "dv")


def errors(q, k, v, dout, opts, truth, chunk):
    """{tensor: max |naive - truth|} with the long sums in chunks of `chunk` terms."""
    naive.CHUNK, kept = chunk, naive.CHUNK
    try:
        got = naive.naive_attention(*na.attention_options(q, k, v, **opts), dout=dout)
    finally:
        naive.CHUNK = kept
    return {name: np.max(np.abs(got[name] - truth[name])) for name in NAMES}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    ratios = {name: [] for name in NAMES}
    for case in range(args.cases):
        n, h_kv, sharp = int(rng.choice([64, 128, 256])), int(rng.choice([1, 2, 4])), float(rng.choice([1, 3, 10]))
        q = (rng.standard_normal((1, 4, n, 64)) * sharp).astype(np.float32)
        k, v = (rng.standard_normal((1, h_kv, n, 64)).astype(np.float32) for _ in range(2))
        dout = rng.standard_normal((1, 4, n, 64)).astype(np.float32)
        opts = {"causal": bool(case % 2)}
        out, cache = na.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), **opts)
        g = na.attention_backward(dout.astype(np.float64), cache)
        truth = dict(out=out, lse=cache.lse, dq=g.dq, dk=g.dk, dv=g.dv)
        chunked, left_to_right = (errors(q, k, v, dout, opts, truth, c) for c in (naive.CHUNK, 1))
        for name in NAMES:
            ratios[name].append(chunked[name] / left_to_right[name])
    print(machine_line())
    print(f"max-abs error, chunks of {naive.CHUNK} / left to right, over {args.cases} cases (seed {args.seed}):")
    for name, r in ratios.items():
        print(f"  {name:4s} median {np.median(r):.2f}   min {np.min(r):.2f}   max {np.max(r):.2f}")


if __name__ == "__main__":
    main()
