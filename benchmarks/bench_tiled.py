"""Tiled (block_size) against materialized attention: time and peak memory against N.

    python3 benchmarks/bench_tiled.py [--lengths 1024 2048 8192 32768] [--block 256]

Causal self-attention, 1 batch, 8 heads, d_k = 64, float64, forward + backward with a
random upstream gradient. Every configuration runs in a fresh child process that
reports its time and its own peak RSS (VmHWM), so one run's peak cannot hide another's.
Time: the median of 3 calls after an untimed one (a process's first large allocations
can stall on huge-page compaction: one cold call at N=2048 measured 0.8 s in one run and
1.5 s in the next); a single call where that call alone takes over 10 s.
The materialized path is skipped where one [8, N, N] array alone would pass --max-gib
(default 2 GiB; at N=8192 it is 4 GiB and the path peaks near 21 GiB).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine_line, run_child, table  # noqa: E402

HEADS, D_K = 8, 64

CHILD = """
import statistics, time, numpy as np
from numpy_attention import attention_forward, attention_backward
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, {h}, {n}, {d})) for _ in range(4))

def timed_step():
    t0 = time.perf_counter()
    out, cache = attention_forward(q, k, v, causal=True, block_size={block})
    attention_backward(dout, cache)
    return time.perf_counter() - t0

first = timed_step()
print('SECONDS', first if first > 10 else statistics.median(timed_step() for _ in range(3)))
"""


def run(n, block):
    """(seconds, peak MiB) of one causal forward + backward in a fresh process."""
    mib, stdout = run_child(CHILD.format(h=HEADS, n=n, d=D_K, block=block))
    seconds = [float(line.split()[1]) for line in stdout.splitlines() if line.startswith("SECONDS")][0]
    return seconds, mib


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 32768],
                    help="sequence lengths N (default 1024 2048 4096 8192 32768)")
    ap.add_argument("--block", type=int, default=256, help="the tiled path's block_size (default 256)")
    ap.add_argument("--max-gib", type=float, default=2.0,
                    help="skip the materialized path where one [H, N, N] array exceeds this (default 2)")
    args = ap.parse_args()
    print(machine_line())
    print(f"\ncausal attention, B=1, H={HEADS}, d_k={D_K}, float64, forward + backward, "
          f"tiled block_size={args.block}")
    rows = []
    for n in args.lengths:
        t_tiled, m_tiled = run(n, args.block)
        if HEADS * n * n * 8 / 2 ** 30 <= args.max_gib:
            t_mat, m_mat = run(n, None)
            rows.append([n, f"{t_mat:.2f}", f"{m_mat:.0f}", f"{t_tiled:.2f}", f"{m_tiled:.0f}",
                         f"{t_tiled / t_mat:.2f}"])
        else:
            rows.append([n, "-", "-", f"{t_tiled:.2f}", f"{m_tiled:.0f}", "-"])
    print(table(["N", "materialized s", "peak MiB", "tiled s", "peak MiB", "tiled/materialized time"], rows))


if __name__ == "__main__":
    main()
