"""Sparse top-k attention's memory and time: per (N_q = N_k, K), forward and backward on one head
of width 64 in float64 with int32 indices, each configuration in a fresh process. Memory over
the bytes of q, k, v and the indices themselves, two ways: the inputs plus the peak of the
arrays the computation holds at once (tracemalloc, which NumPy reports to: its outputs and
gradients included), and the peak resident memory above the interpreter's with the library
imported, reset once the inputs are made (drawing them takes memory of its own; the allocator
also keeps freed blocks). A dense [N_q, N_k] score matrix alone is printed beside them.

    python3 benchmarks/bench_sparse.py [--sizes 32768:2048,8192:512] [--block-rows N] [--workers N]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, run_child, table  # noqa: E402

CHILD = """
import time
import tracemalloc
import numpy as np
import numpy_attention as na
import numpy_attention.sparse_attention          # the library's imports (numpy, scipy) before the base
rss = lambda: [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')][0] / 1024
base = rss()
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, {n}, 64)) for _ in range(3))
indices = rng.integers(0, {n}, (1, 1, {n}, {k}), dtype=np.int32)
own = sum(x.nbytes for x in (q, k, v, indices)) / 2 ** 20
with open('/proc/self/clear_refs', 'w') as f:      # the peak from here on: not making the inputs
    f.write('5')
tracemalloc.start()
t0 = time.perf_counter()
out, lse, top, cache = na.sparse_attention_forward(q, k, v, indices, block_rows={block}, workers={workers})
t1 = time.perf_counter()
grads = na.sparse_attention_backward(out, cache)
t2 = time.perf_counter()
traced = tracemalloc.get_traced_memory()[1] / 2 ** 20
print('RESULT', base, own, t1 - t0, t2 - t1, traced)
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="32768:2048,8192:512", help="N:K pairs (default 32768:2048,8192:512)")
    parser.add_argument("--block-rows", type=int, default=None,
                        help="query rows a block (default: the library's, sparse.GATHER_ROWS keys a block)")
    parser.add_argument("--workers", type=int, default=None,
                        help="threads (default: the library's, every core at these sizes)")
    args = parser.parse_args()
    load = OtherLoad()
    print(machine_line())
    rows = []
    for pair in args.sizes.split(","):
        n, k = (int(x) for x in pair.split(":"))
        peak, stdout = run_child(CHILD.format(n=n, k=k, block=args.block_rows, workers=args.workers))
        base, own, forward, backward, traced = (float(x) for x in next(
            line for line in stdout.splitlines() if line.startswith("RESULT")).split()[1:])
        rows.append([n, k, f"{own:.0f}", f"{(own + traced) / own:.2f}", f"{(peak - base) / own:.2f}",
                     f"{n * n * 8 / 2 ** 20:.0f}", f"{forward:.1f}", f"{backward:.1f}"])
    print(table(["N", "K", "inputs MiB", "(inputs + arrays) / inputs", "RSS / inputs", "dense S MiB",
                 "forward s", "backward s"], rows))
    print("\n" + load.line())


if __name__ == "__main__":
    main()
