"""What crosscheck cannot always see: a bfloat16 kernel that keeps its softmax row sum in
bfloat16 (tests/row_sum_kernels.py), on the real-kernel campaigns' bfloat16 cases. Per kernel
(the tensors that kernel returns) and way of summing: the cases where the bug changes the row
sum, how many crosscheck fails, and of those it passes, how many have an out no farther from
the oracle than the honest baseline's (the recipe's largest error: its max abs and L2 ratios
at most 1): what no rule can fail without failing an honest bfloat16 kernel.

    python3 benchmarks/row_sum_bf16.py [--cases 40] [--seed 60] [--kernels sdpa_math,flash_lse]
"""
import argparse
import importlib.util
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, table  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

MODULES = {"torch": "torch", "jax": "jax", "mlx": "mlx.core"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=40, help="cases per kernel (default 40)")
    parser.add_argument("--seed", type=int, default=60, help="seed (default 60)")
    parser.add_argument("--kernels", default=None, help="comma-separated kernels (default all)")
    args = parser.parse_args()
    import torch
    import real_kernels as rk
    import row_sum_kernels as rs
    from numpy_attention import crosscheck
    from numpy_attention._checks import to_numpy
    torch.set_num_threads(1)
    load = OtherLoad()
    print(f"# {machine_line()}")
    rows, totals = [], {}
    for index, kernel in enumerate(args.kernels.split(",") if args.kernels else list(rk.KERNELS)):
        if importlib.util.find_spec(MODULES[rk.KERNELS[kernel].library]) is None:
            continue
        rng = np.random.default_rng([args.seed, index])
        counts = {variant: [0, 0, 0] for variant in rs.VARIANTS}     # changed, caught, passed within honest
        for i in range(args.cases):
            variant_of_case = rk.KERNELS[kernel].variants[i % len(rk.KERNELS[kernel].variants)]
            layout = rk.random_layout(rng, variant_of_case, kernel)
            case = rk.random_case(rng, "bfloat16", variant_of_case, kernel, layout)
            plain = {n: x for n, x in case.items() if not n.startswith("_")}
            for variant in rs.VARIANTS:
                bug = rs.row_sum_attention(case, kernel, variant)
                control = rs.row_sum_attention(case, kernel, variant + "_f32")
                if torch.equal(bug["out"], control["out"]) and all(
                        torch.equal(bug[n], control[n]) for n in bug):
                    continue                                           # the row sum held exactly
                report = crosscheck(**plain, **{n: np.array(to_numpy(x, n)) for n, x in bug.items()})
                counts[variant][0] += 1
                counts[variant][1] += not report
                out = report.rows[0]
                counts[variant][2] += bool(report) and out.ratio <= 1 and out.l2_ratio <= 1
        spec = rk.KERNELS[kernel]
        returns = "out" + (", lse" if spec.lse else "") + (", grads" if spec.gradients else "")
        for variant, (changed, caught, hidden) in counts.items():
            rows.append([kernel, returns, variant, str(changed), f"{caught} ({caught / max(changed, 1):.0%})",
                         str(hidden)])
            total = totals.setdefault(variant, [0, 0, 0])
            totals[variant] = [a + b for a, b in zip(total, (changed, caught, hidden))]
        print(f"# done {kernel}", file=sys.stderr, flush=True)
    print("bfloat16 cases the bug changes; failed by crosscheck; passed with an out no farther from the "
          "oracle than the honest baseline's (max abs and L2)")
    print(table(["kernel", "returns", "row sum", "changed", "caught", "within honest"], rows))
    for variant, (changed, caught, hidden) in totals.items():
        print(f"all, {variant}: {changed} changed, {caught} caught ({caught / max(changed, 1):.0%}), "
              f"{hidden} of the {changed - caught} passed within the honest baseline's error")
    print(load.line())


if __name__ == "__main__":
    main()
