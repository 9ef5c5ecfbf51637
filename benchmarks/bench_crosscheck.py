"""crosscheck's wall time and peak memory on a causal bfloat16 case with gradients.

    python3 benchmarks/bench_crosscheck.py [--lengths 2048 8192] [--heads 4] [--d 64]
                                           [--budget N]

The case: q, k, v, dout [1, H, N, d] in bfloat16 (random normal), causal; the candidate is
our own float64 attention (the tiled engine, O(N) memory) rounded to bfloat16: out, lse
(float32), dq, dk, dv. It is written to a .npz file by one child process; a fresh child
then loads it and runs crosscheck, as `numpy-attention crosscheck CASE.npz` does, and
reports crosscheck's wall time and its own peak RSS (VmHWM), so that neither the case's
making nor another size's run can hide in it. "import" is the peak of a child that only
imports numpy_attention and loads the case: what any check of that case costs at least.

Scores [1, H, N, N] over blocks.SCORE_BUDGET (2**24) entries run in O(N) memory (the
tiled oracle, the baselines in blocks of query rows); smaller ones on whole arrays.
--budget sets blocks.SCORE_BUDGET in the child, to run a small case in blocks (or a large
one whole: mind the memory, one float64 P at N=8192 with 4 heads is 2 GiB).
"""
import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine_line, run_child, table  # noqa: E402

MAKE_CASE = """
import numpy as np, ml_dtypes
from numpy_attention import attention_backward, attention_forward
from numpy_attention.crosscheck import save_case
bf16 = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, {h}, {n}, {d})).astype(bf16) for _ in range(4))
wide = [x.astype(np.float64) for x in (q, k, v, dout)]
out, cache = attention_forward(*wide[:3], causal=True, implementation="tiled")
g = attention_backward(wide[3], cache)
save_case({path!r}, q=q, k=k, v=v, dout=dout, causal=np.array(True), out=out.astype(bf16),
          lse=cache.lse.astype(np.float32), dq=g.dq.astype(bf16), dk=g.dk.astype(bf16),
          dv=g.dv.astype(bf16))
"""

CHECK = """
import importlib, time
from numpy_attention.crosscheck import crosscheck, load_case
blocks = importlib.import_module("numpy_attention.crosscheck.blocks")
blocks.SCORE_BUDGET = {budget}
arrays = load_case({path!r})
rows = blocks.block_rows((1, {h}, {n}, {n}), 32)
print("PATH", "whole arrays" if rows is None else f"blocks of {{rows}} rows")
if {run}:
    t0 = time.perf_counter()
    report = crosscheck(**arrays)
    print("SECONDS", time.perf_counter() - t0)
    print("VERDICT", "PASS" if report else "FAIL")
"""


def measure(n, heads, d, budget, directory):
    """(path, seconds, peak MiB, import-only peak MiB, verdict) of crosscheck on one case."""
    path = os.path.join(directory, f"case_{n}.npz")
    run_child(MAKE_CASE.format(h=heads, n=n, d=d, path=path))
    fields = dict(h=heads, n=n, path=path, budget=budget)
    base_mib, _ = run_child(CHECK.format(run=False, **fields))
    mib, stdout = run_child(CHECK.format(run=True, **fields))
    said = dict(line.split(" ", 1) for line in stdout.splitlines() if " " in line)
    return said["PATH"], float(said["SECONDS"]), mib, base_mib, said["VERDICT"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192],
                    help="sequence lengths N (default 2048 8192)")
    ap.add_argument("--heads", type=int, default=4, help="heads H (default 4)")
    ap.add_argument("--d", type=int, default=64, help="head width d (default 64)")
    ap.add_argument("--budget", type=int, default=2 ** 24,
                    help="blocks.SCORE_BUDGET in the child (default 2**24 = 16777216, the library's)")
    args = ap.parse_args()
    print(machine_line())
    print(f"crosscheck of a causal bfloat16 case with gradients, [1, {args.heads}, N, {args.d}]; "
          f"SCORE_BUDGET = {args.budget:,} scores; peak = the child's VmHWM")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for n in args.lengths:
            path, seconds, mib, base_mib, verdict = measure(n, args.heads, args.d, args.budget, directory)
            p_gib = args.heads * n * n * 8 / 2 ** 30
            rows.append([str(n), path, f"{seconds:.1f}", f"{mib:.0f}", f"{base_mib:.0f}",
                         f"{p_gib:.3g}", verdict])
    print(table(["N", "path", "seconds", "peak MiB", "import MiB", "one float64 P GiB", "verdict"], rows))


if __name__ == "__main__":
    main()
