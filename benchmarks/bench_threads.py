"""Attention forward + backward on two cores: what splitting the heads over threads would buy.

    python3 benchmarks/bench_threads.py [--rounds 3]

numpy runs its element-wise passes (the softmax and its backward) on one core; only the
matrix products use both, through OpenBLAS's threads. This measures, for float64 attention
[B, 8, N, 64] without options, in processes of their own:

    default      attention_forward + attention_backward as the library runs them
    1 BLAS       the same with OpenBLAS held to one thread (OPENBLAS_NUM_THREADS=1)
    2 x heads    the heads split in two halves, each half's forward + backward in its
                 own Python thread, OpenBLAS held to one thread

"2 x heads" uses only the public API (heads are independent); its results are checked
equal to the default's. numpy cannot set OpenBLAS's thread count at run time, so the
library does not do this itself: the environment variable must be set before numpy loads.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine_line, median_times_apart, run_child, table  # noqa: E402

SHAPES = [(2, 8, 1024, 64), (1, 8, 2048, 64)]

SETUP = """{env}import numpy as np
from concurrent.futures import ThreadPoolExecutor
from numpy_attention import attention_backward, attention_forward
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal({shape}) for _ in range(4))

def whole():
    out, cache = attention_forward(q, k, v)
    return [out, *attention_backward(dout, cache)[:3]]

def half(h):
    out, cache = attention_forward(q[:, h], k[:, h], v[:, h])
    return [out, *attention_backward(dout[:, h], cache)[:3]]

pool = ThreadPoolExecutor(2)
halves = [slice(0, {H} // 2), slice({H} // 2, {H})]

def two_threads():
    parts = list(pool.map(half, halves))
    return [np.concatenate(arrays, axis=1) for arrays in zip(*parts)]

step = {step}
"""

VARIANTS = {"default": ("", "whole"),
            "1 BLAS": ("import os\nos.environ['OPENBLAS_NUM_THREADS'] = '1'\n", "whole"),
            "2 x heads": ("import os\nos.environ['OPENBLAS_NUM_THREADS'] = '1'\n", "two_threads")}

SAME = ("\nbase = whole()\n"
        "print('MAXDIFF', max(float(np.max(np.abs(a - b))) for a, b in zip(two_threads(), base)))\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per variant, 3 timed calls each")
    args = ap.parse_args()
    print(machine_line())
    rows = []
    for shape in SHAPES:
        codes = [SETUP.format(env=env, shape=shape, H=shape[1], step=step) for env, step in VARIANTS.values()]
        times = median_times_apart(codes, args.rounds)
        out = run_child(codes[-1] + SAME)[1]
        diff = float(next(line.split()[1] for line in out.splitlines() if line.startswith("MAXDIFF")))
        rows.append([str(shape)] + [f"{t * 1e3:.0f}" for t in times]
                    + [f"{times[0] / times[-1]:.2f}x", f"{diff:.1e}"])
    print("\nattention forward + backward, float64, no options; median ms")
    print(table(["[B, H, N, d]", *VARIANTS, "default / 2 x heads", "max |2 x heads - 1 BLAS|"], rows))


if __name__ == "__main__":
    main()
