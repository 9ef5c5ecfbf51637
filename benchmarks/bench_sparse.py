"""Sparse top-k attention's memory and time: per (N_q = N_k, K), forward and backward on one head
of width 64 in float64 with int32 indices, each configuration in a fresh process; the peak
resident memory above the interpreter's, over the bytes of q, k, v and the indices themselves
(what a dense [N_q, N_k] score matrix would add is printed beside it).

    python3 benchmarks/bench_sparse.py [--sizes 32768:2048,8192:512] [--block-rows 64]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, run_child, table  # noqa: E402

CHILD = """
import time
import numpy as np
import numpy_attention as na
rss = lambda: [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')][0] / 1024
base = rss()
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, {n}, 64)) for _ in range(3))
indices = rng.integers(0, {n}, (1, 1, {n}, {k}), dtype=np.int32)
own = sum(x.nbytes for x in (q, k, v, indices)) / 2 ** 20
t0 = time.perf_counter()
out, lse, top, cache = na.sparse_attention_forward(q, k, v, indices, block_rows={block})
t1 = time.perf_counter()
grads = na.sparse_attention_backward(out, cache)
t2 = time.perf_counter()
print('RESULT', base, own, t1 - t0, t2 - t1)
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="32768:2048,8192:512", help="N:K pairs (default 32768:2048,8192:512)")
    parser.add_argument("--block-rows", type=int, default=64, help="query rows a block (default 64)")
    args = parser.parse_args()
    load = OtherLoad()
    print(machine_line())
    rows = []
    for pair in args.sizes.split(","):
        n, k = (int(x) for x in pair.split(":"))
        peak, stdout = run_child(CHILD.format(n=n, k=k, block=args.block_rows))
        base, own, forward, backward = (float(x) for x in next(
            line for line in stdout.splitlines() if line.startswith("RESULT")).split()[1:])
        rows.append([n, k, f"{own:.0f}", f"{peak - base:.0f}", f"{(peak - base) / own:.2f}",
                     f"{n * n * 8 / 2 ** 20:.0f}", f"{forward:.1f}", f"{backward:.1f}"])
    print(table(["N", "K", "inputs MiB", "peak MiB", "peak / inputs", "dense S MiB", "forward s", "backward s"], rows))
    print("\n" + load.line())


if __name__ == "__main__":
    main()
