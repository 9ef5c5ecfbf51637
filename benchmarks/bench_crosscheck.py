"""crosscheck's time against a float64 reference's, and its peak memory on long cases.

    python3 benchmarks/bench_crosscheck.py [--lengths 128 512 2048 8192] [--precisions ...]
                                           [--rounds 3] [--heads 8] [--d 64]
    python3 benchmarks/bench_crosscheck.py --memory [--lengths 2048 8192] [--budget N]

Time (the default): what a kernel author's alternative costs, a float64 torch forward and
backward of the same case (scaled_dot_product_attention on float64 tensors, then
torch.autograd.grad of out with dout: dq, dk, dv), against one crosscheck call judging
out, dq, dk, dv (and lse) of a candidate in the precision: q, k, v, dout [1, H, N, d]
random normal values of the precision, the candidate our float64 attention rounded to
it. Per N, precision and causal or not: the median time of each, timed alone in its own
process, the processes alternating (_common.median_times_apart), and the ratio
crosscheck / torch (the figure to read: the machine is shared and noisy). Without torch,
crosscheck's times alone. Up to N = ROUNDS_MAX_N, --rounds rounds of two untimed calls and
one timed; above, where one call takes from a minute to several, one round of one call. A
contender that cannot run a size (out of memory, say) has why in its cell. torch picks its
kernel as its users get it: on the CPU, float64 goes to its flash kernel (O(N) memory).

Memory (--memory): crosscheck's wall time and peak RSS on a causal bfloat16 case with
gradients and lse. It is written to a .npz file by one child process; a fresh child then
loads it and runs crosscheck, as `numpy-attention crosscheck CASE.npz` does, and reports
crosscheck's wall time and its own peak RSS (VmHWM), so that neither the case's making
nor another size's run can hide in it. "import" is the peak of a child that only imports
numpy_attention and loads the case: what any check of that case costs at least. Scores
[1, H, N, N] over row_blocks.SCORE_BUDGET (2**24) entries run in O(N) memory (the tiled
oracle, the baselines in blocks of query rows); smaller ones on whole arrays. --budget
sets row_blocks.SCORE_BUDGET in the child, to run a small case in blocks (or a large one
whole: mind the memory, one float64 P at N=8192 with 4 heads is 2 GiB).
"""
import argparse
import importlib.util
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, median_times_apart, run_child, table  # noqa: E402

PRECISIONS = ("float32", "bfloat16", "float16")
ROUNDS_MAX_N = 2048          # above: one round of one call, no untimed ones

CROSSCHECK_STEP = """
import numpy as np, ml_dtypes
from numpy_attention import attention_backward, attention_forward, crosscheck
T = {{"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}}[{precision!r}]
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, {h}, {n}, {d})).astype(T) for _ in range(4))
wide = [x.astype(np.float64) for x in (q, k, v, dout)]
out, cache = attention_forward(*wide[:3], causal={causal}, implementation="tiled")
g = attention_backward(wide[3], cache)
case = dict(q=q, k=k, v=v, dout=dout, causal={causal}, out=out.astype(T), lse=cache.lse.astype(np.float32),
            dq=g.dq.astype(T), dk=g.dk.astype(T), dv=g.dv.astype(T))
def step():
    assert crosscheck(**case), "an honest candidate failed"
"""

TORCH_STEP = """
import torch
g = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(1, {h}, {n}, {d}, dtype=torch.float64, generator=g) for _ in range(4))
def step():
    q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal={causal})
    torch.autograd.grad(out, (q_, k_, v_), dout)
"""

MAKE_CASE = """
import numpy as np, ml_dtypes
from numpy_attention import attention_backward, attention_forward
from numpy_attention.oracle import save_case
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
from numpy_attention.oracle import crosscheck, load_case
blocks = importlib.import_module("numpy_attention.oracle.row_blocks")
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


def time_table(args):
    """The time table: crosscheck and torch's float64 forward + backward, and their ratio."""
    has_torch = importlib.util.find_spec("torch") is not None
    print(f"crosscheck of out, lse, dq, dk, dv [1, {args.heads}, N, {args.d}] against torch's float64 "
          f"SDPA forward + backward of the same case (median of {args.rounds} rounds up to "
          f"N = {ROUNDS_MAX_N}, one call above; each alone in its own process)")
    rows = []
    for n in args.lengths:
        few = n > ROUNDS_MAX_N
        for precision in args.precisions:
            for causal in (False, True):
                fields = dict(h=args.heads, n=n, d=args.d, causal=causal)
                codes = [CROSSCHECK_STEP.format(precision=precision, **fields)]
                codes += [TORCH_STEP.format(**fields)] if has_torch else []
                times = median_times_apart(codes, rounds=1 if few else args.rounds, calls=1,
                                           warmups=0 if few else 2, failures=True)
                cells = [t if isinstance(t, str) else f"{t:.3f}" for t in times]     # a str: why it failed
                cells += [] if has_torch else ["-"]
                timed = has_torch and not any(isinstance(t, str) for t in times)
                ratio = f"{times[0] / times[1]:.1f}" if timed else "-"
                rows.append([str(n), precision, "yes" if causal else "no", *cells, ratio])
    print(table(["N", "precision", "causal", "crosscheck s", "torch float64 s", "ratio"], rows))


def memory_table(args):
    """The memory table: crosscheck's time and peak RSS on long causal bfloat16 cases."""
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--memory", action="store_true", help="the memory table instead of the time table")
    ap.add_argument("--lengths", type=int, nargs="+",
                    help="sequence lengths N (default 128 512 2048 8192; --memory: 2048 8192)")
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                    help="the candidates' precisions (time table; default all three)")
    ap.add_argument("--rounds", type=int, default=3,
                    help=f"rounds of the time table up to N = {ROUNDS_MAX_N} (default 3; one above)")
    ap.add_argument("--heads", type=int, help="heads H (default 8; --memory: 4)")
    ap.add_argument("--d", type=int, default=64, help="head width d (default 64)")
    ap.add_argument("--budget", type=int, default=2 ** 24,
                    help="row_blocks.SCORE_BUDGET in the child (--memory; default 2**24 = 16777216, the library's)")
    args = ap.parse_args()
    args.lengths = args.lengths or ([2048, 8192] if args.memory else [128, 512, 2048, 8192])
    args.heads = args.heads or (4 if args.memory else 8)
    print(machine_line())
    load = OtherLoad()
    (memory_table if args.memory else time_table)(args)
    print(load.line())


if __name__ == "__main__":
    main()
