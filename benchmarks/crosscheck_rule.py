"""The crosscheck rule's record on torch's own CPU kernels: false failures of honest results and
the share of planted bugs caught, per precision, with how many of those caught the diagnosis
names (the table of docs/crosscheck.md).

    python3 benchmarks/crosscheck_rule.py [--cases 20] [--seed 11]

Candidates: SDPA (its default CPU kernel), SDPA's math backend, the CPU flash kernel with its
float32 lse, attention written as torch ops; every variant each computes, lengths up to 200
(tests/torch_kernels.py, the same campaign tests/test_torch_precisions.py asserts on). Takes
a few minutes; needs torch.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine_line  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def machine():
    """The header line (benchmarks/_common.py): CPU model, cores, Python, numpy and its BLAS, torch."""
    return machine_line()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=20, help="cases per kernel and variant (default 20)")
    parser.add_argument("--seed", type=int, default=11, help="seed of the cases (default 11, the tests')")
    args = parser.parse_args()
    import torch
    from torch_kernels import BUGS, campaign
    torch.set_num_threads(1)
    print(f"# {machine()}")
    rows = {}
    for precision in ("float16", "bfloat16", "float32"):
        honest, planted = campaign(precision, args.cases, args.seed)
        caught = {bug: (sum(not r for r in reports), len(reports), sum(bool(r.diagnosis) for r in reports if not r))
                  for bug, reports in planted.items()}
        rows[precision] = (sum(not r for _, _, r in honest), len(honest), caught)
    print("| | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    print("| honest results failed | " + " | ".join(f"{f} of {n}" for f, n, _ in rows.values()) + " |")
    for bug in BUGS:
        cells = [f"{c}/{n} = {c / n:.0%}, {named} named" for _, _, caught in rows.values()
                 for c, n, named in [caught[bug]]]
        print(f"| planted: {bug} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
