"""`numpy-attention gradcheck`: check every op's hand-written backward.

Runs `gradcheck` in full mode (the whole Jacobian, by --method) and `taylor_test` on every
case of numpy_attention.examples (each op and attention variant, small random float64
inputs) and prints one table per case.
"""
import numpy as np

from ..examples import cases
from ..gradcheck import METHODS, gradcheck, taylor_test
from .cli import integer

HELP = "check every op's backward against finite differences"
DESCRIPTION = """\
Check the backward of every op and attention variant on small random inputs
(numpy_attention.examples): the whole Jacobian against finite differences
(--method: complex step by default, central or richardson differences), and a
Taylor test. Exit codes: 0 every check passed, 1 a check failed, 2 bad arguments."""


def add_arguments(parser):
    parser.add_argument("--method", choices=METHODS, default="complex",
                        help="finite-difference method: complex step (default), central or richardson "
                             "differences")
    parser.add_argument("--seed", type=integer(0), default=0, help="seed of the random inputs (default 0)")


def run(args):
    passed = True
    for name, (forward, backward, inputs, names) in cases(np.random.default_rng(args.seed)).items():
        report = gradcheck(forward, backward, inputs, method=args.method, names=names)
        taylor = taylor_test(forward, backward, inputs)
        print(f"== {name}   (taylor remainder order {taylor.order:.2f})\n{report}\n")
        passed &= bool(report) and bool(taylor)
    print("ALL GRADIENT CHECKS PASSED" if passed else "SOME GRADIENT CHECK FAILED")
    return 0 if passed else 1
