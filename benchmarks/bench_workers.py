"""The blocked engine on threads: attention forward + backward with workers=1 against
workers=2, float64, causal, in one process, alternating; and whether the bits agree.

    python3 benchmarks/bench_workers.py [--shapes 1x8x2048x64,2x8x1024x64] [--repeats 5]

The ratio (1 worker's median time / 2 workers') is the result; absolute times on a shared
machine are noise. The header names the machine.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

import numpy_attention as na

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine_line  # noqa: E402


def machine():
    """The header line (benchmarks/_common.py): CPU model, cores, Python, numpy and its BLAS, torch."""
    return machine_line()


def step(q, k, v, dout, workers):
    out, cache = na.attention_forward(q, k, v, causal=True, workers=workers)
    return out, na.attention_backward(dout, cache)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x8x2048x64,2x8x1024x64", help="B x H x N x d_k shapes")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per worker count (default 5)")
    args = parser.parse_args()
    print(f"# {machine()}")
    print(f"{'shape (B, H, N, d_k)':<22}{'1 worker ms':>12}{'2 workers ms':>14}{'ratio':>7}  same bits")
    for text in args.shapes.split(","):
        shape = tuple(int(x) for x in text.split("x"))
        rng = np.random.default_rng(0)
        q, k, v, dout = (rng.standard_normal(shape) for _ in range(4))
        times = {1: [], 2: []}
        results = {w: step(q, k, v, dout, w) for w in (1, 2)}          # untimed: warm-up
        for _ in range(args.repeats):
            for workers in (1, 2):
                start = time.perf_counter()
                step(q, k, v, dout, workers)
                times[workers].append(time.perf_counter() - start)
        same = np.array_equal(results[1][0], results[2][0]) and all(
            np.array_equal(a, b) for a, b in zip(results[1][1][:3], results[2][1][:3]))
        one, two = (statistics.median(times[w]) * 1e3 for w in (1, 2))
        print(f"{str(shape):<22}{one:>12.1f}{two:>14.1f}{one / two:>7.2f}  {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
