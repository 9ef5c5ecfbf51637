"""crosscheck's record on real attention kernels nobody here wrote, beside FlashAttention's own
test rule on the same results: per kernel and precision, the honest cases (and those with one
query row or one key), how many of them each rule failed, and per planted bug the share each
rule caught; then the totals.

    python3 benchmarks/real_kernels.py [--cases 60] [--seed 20] [--kernels flex,jax_xla]
                                       [--large 1] [--one-bug] [--bugs scale,window|none] [--save DIR]

Kernels (tests/real_kernels.py): torch SDPA's math and flash backends, torch's CPU flash op with
its lse, flex_attention eager and compiled, jax.nn.dot_product_attention (xla), MLX's fast SDPA;
those whose library is missing are listed as not run. FlashAttention's rule: max|x - ref| <=
2 * max|x_pt - ref| + 2 * max|(ref + 0.3 - 0.3) - ref| (in the tensor's dtype), ref in float64,
x_pt crosscheck's baseline. Every bug a case can show is planted in it (--one-bug: the one
planted least so far, as the tests do). Honest cases that fail crosscheck are saved (--save,
default real_kernels.FAILURES_DIR) as <kernel>_<dtype>_<n>.npz with their report as .txt.
Takes several minutes; torch.compile's flex takes 5-15 s per dtype to compile.
"""
import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, table  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

MODULES = {"torch": "torch", "jax": "jax", "mlx": "mlx.core"}


def cell(outcomes):
    """'caught/n crosscheck | FA' for a bug's planted outcomes ('-' where it was not planted)."""
    import real_kernels as rk
    n, caught, fa = rk.shares(outcomes)
    return f"{caught}/{n} | {fa}/{n}" if n else "-"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=60, help="cases per kernel and precision (default 60)")
    parser.add_argument("--seed", type=int, default=20, help="seed of the first campaign (default 20)")
    parser.add_argument("--kernels", default=None, help="comma-separated kernels (default all)")
    parser.add_argument("--large", type=int, default=1,
                        help="cases with a length of 1024 or 2048 per campaign (default 1)")
    parser.add_argument("--one-bug", action="store_true", help="plant one bug per case, as the tests do")
    parser.add_argument("--bugs", default=None, help="comma-separated bugs to plant, or 'none' (default all)")
    parser.add_argument("--save", default=None, help="directory for the honest failures")
    args = parser.parse_args()
    import torch
    import real_kernels as rk
    torch.set_num_threads(1)
    load = OtherLoad()
    print(f"# {machine_line()}")
    kernels = args.kernels.split(",") if args.kernels else list(rk.KERNELS)
    rows, times, not_run, saved = [], [], [], []
    totals = [0, 0, 0, 0]               # honest, one row or key, failed by crosscheck, by FA's rule
    for index, kernel in enumerate(kernels):
        library = rk.KERNELS[kernel].library
        if importlib.util.find_spec(MODULES[library]) is None:
            not_run.append(f"{kernel}: {library} is not installed")
            continue
        for p_index, precision in enumerate(rk.PRECISIONS):
            bugs = (rk.BUGS if args.bugs is None else () if args.bugs == "none"
                    else tuple(args.bugs.split(",")))
            result = rk.campaign(kernel, precision, args.cases, seed=args.seed + 3 * index + p_index,
                                 bugs=bugs, large=args.large, plant_all=not args.one_bug)
            honest = result.honest
            failed = rk.false_failures(honest)
            saved += rk.save_failures(honest, args.save or rk.FAILURES_DIR) if failed else []
            counts = (len(honest), sum(1 in (o.layout.n_q, o.layout.n_k) for o in honest), len(failed),
                      sum(not o.fa_passed for o in honest))
            totals = [total + n for total, n in zip(totals, counts)]
            unjudged = sum(isinstance(o.report, str) for o in failed)        # refused: cannot be judged
            cells = [str(n) for n in counts]
            cells[2] += f" ({unjudged} unjudged)" if unjudged else ""
            rows.append([kernel, precision] + cells
                        + [cell(result.planted.get(bug, [])) for bug in rk.BUGS])
            times.append(f"{kernel} {precision}: {result.seconds:.0f} s "
                         f"(first call {result.first_call:.1f} s)")
            print(f"# done {times[-1]}", file=sys.stderr, flush=True)
    print("honest: cases, those with one query row or one key, failed by crosscheck (of them refused "
          "as unjudgeable), failed by FlashAttention's rule; planted bugs: caught by crosscheck | by "
          "FlashAttention's rule, of the cases the bug changes")
    print(table(["kernel", "dtype", "honest", "1 row/key", "xc fail", "FA fail"] + list(rk.BUGS), rows))
    print("all: {} honest, {} with one row or key, {} failed by crosscheck, {} by FlashAttention's "
          "rule".format(*totals))
    print("\n".join(["", "time per campaign (the first call compiles where the kernel does):"] + times))
    for line in not_run:
        print(f"not run: {line}")
    if saved:
        print(f"honest failures saved: {len(saved)} in {os.path.dirname(saved[0])}")
    print(load.line())


if __name__ == "__main__":
    main()
