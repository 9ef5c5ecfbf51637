"""The engines on threads: attention forward + backward, float64, causal, under several
(workers, tile) configurations in one process, alternating; and whether the bits agree.

    python3 benchmarks/bench_workers.py [--shapes 1x8x2048x64,2x8x1024x64] [--repeats 5]
    python3 benchmarks/bench_workers.py --engine tiled --shapes 1x8x32768x64 --repeats 1 \
        --configs 1:128,1:256,2:256

A configuration is WORKERS (blocked) or WORKERS:TILE (tiled: its block_size). WORKERS threads
are all the engine uses: BLAS is on one thread for one worker too (engines/parallel.py). The
ratio is the first configuration's median time over each one's: the result, where absolute
times on a shared machine are noise. "same bits" compares a configuration's out, dq, dk, dv
with those of one worker at the same tile. The header names the machine; the last line,
other load.

"machine": the most W workers can gain over one on this machine, measured on work that
divides perfectly (`thread_gain`): the fewest element-wise passes of the softmax and its
backward, by themselves, on the blocked engine's blocks of rows (at most GAIN_N rows and
columns), one thread against W, with P in a new array at each call as the engine's forward
makes it (it returns P, in the cache). Cores that share memory bandwidth and caches (or the
cores of a virtual machine that share a host) gain less than W even there, and the kernel's
zeroing of new pages gains less than the passes.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

import numpy_attention as na

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, softmax_passes  # noqa: E402

GAIN_N = 2048           # thread_gain's largest score rows: 4 arrays of [B, H, N, N] float64
GAIN_REPEATS = 7        # thread_gain's timed calls per thread count, whatever --repeats says


def step(q, k, v, dout, engine, workers, tile):
    """One causal forward + backward: (out, dq, dk, dv)."""
    out, cache = na.attention_forward(q, k, v, causal=True, implementation=engine, workers=workers,
                                      block_size=tile)
    grads = na.attention_backward(dout, cache)
    return out, grads.dq, grads.dk, grads.dv


def timed(fn):
    """Seconds of one call of fn()."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def thread_gain(shape, workers):
    """t(1 thread) / t(`workers` threads) of the softmax's element-wise passes alone
    (_common.softmax_passes, P new at each call) on scores [B, H, n, n], n = min(N, GAIN_N),
    the blocked engine's blocks; median of GAIN_REPEATS, alternating."""
    n = min(shape[2], GAIN_N)
    runs = {w: softmax_passes((shape[0], shape[1], n, n), np.float64, w, fresh_p=True) for w in (1, workers)}
    times = {w: [] for w in runs}
    for _ in range(GAIN_REPEATS):
        for w, run in runs.items():
            times[w].append(timed(run))
    return statistics.median(times[1]) / statistics.median(times[workers])


def parse_configs(text, engine):
    """'1,2' or '1:128,2:256' -> [(workers, tile or None)]."""
    configs = []
    for item in text.split(","):
        workers, _, tile = item.partition(":")
        configs.append((int(workers), int(tile) if tile else (256 if engine == "tiled" else None)))
    return configs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("blocked", "tiled"), default="blocked")
    parser.add_argument("--shapes", default="1x8x2048x64,2x8x1024x64", help="B x H x N x d_k shapes")
    parser.add_argument("--configs", default=None,
                        help="WORKERS[:TILE] list (default 1,2 for blocked, 1:128,1:256,2:256 for tiled)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per configuration (default 5)")
    args = parser.parse_args()
    configs = parse_configs(args.configs or ("1,2" if args.engine == "blocked" else "1:128,1:256,2:256"),
                            args.engine)
    load = OtherLoad()
    print(f"# {machine_line()}")
    print(f"# {args.engine} engine, causal, float64, forward + backward; median of {args.repeats}")
    print(f"{'shape (B, H, N, d_k)':<22}{'workers':>8}{'tile':>6}{'ms':>12}{'ratio':>7}"
          f"{'machine':>9}  same bits")
    for text in args.shapes.split(","):
        shape = tuple(int(x) for x in text.split("x"))
        rng = np.random.default_rng(0)
        q, k, v, dout = (rng.standard_normal(shape) for _ in range(4))
        results = {c: step(q, k, v, dout, args.engine, *c) for c in configs}     # untimed: warm-up
        times = {c: [] for c in configs}
        gains = {w: thread_gain(shape, w) for w, _ in configs if w > 1}
        for _ in range(args.repeats):
            for c in configs:
                times[c].append(timed(lambda: step(q, k, v, dout, args.engine, *c)))
        first = statistics.median(times[configs[0]])
        for c in configs:
            one = results.get((1, c[1]))
            same = "-" if one is None or c[0] == 1 else (
                "yes" if all(np.array_equal(a, b) for a, b in zip(one, results[c])) else "NO")
            median = statistics.median(times[c])
            machine = f"{gains[c[0]]:.2f}" if c[0] > 1 else "-"
            print(f"{str(shape):<22}{c[0]:>8}{str(c[1] or '-'):>6}{median * 1e3:>12.1f}"
                  f"{first / median:>7.2f}{machine:>9}  {same}")
    print(load.line())


if __name__ == "__main__":
    main()
