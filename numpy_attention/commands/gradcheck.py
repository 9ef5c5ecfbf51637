"""`numpy-attention gradcheck`: check every op's hand-written backward.

Runs `gradcheck` in full mode (the whole Jacobian, by --method) and `taylor_test` on every
case of numpy_attention.gradcheck_cases (each op and attention variant, small random float64
inputs) and prints one table per case; then `jvpcheck` on the forward-mode cases, and the
identities between derivatives (the JVP is the VJP's adjoint; the Hessian is symmetric).
"""
import numpy as np

from ..gradcheck_cases import cases, identity_gaps, jvp_cases
from ..finite_differences import METHODS, gradcheck, jvpcheck, taylor_test
from .cli import integer

HELP = "check every op's backward against finite differences"
DESCRIPTION = """\
Check the backward of every op and attention variant on small random inputs
(numpy_attention.gradcheck_cases): the whole Jacobian against finite differences
(--method: complex step by default, central or richardson differences), and a
Taylor test; the forward-mode derivatives (JVPs) the same way; and the adjoint
identity <u, J v> = <J^T u, v> and the Hessian's symmetry to 1e-12.
Exit codes: 0 every check passed, 1 a check failed, 2 bad arguments."""
IDENTITY_RTOL = 1e-12
# The cases whose functions take no stack of inputs along a new leading axis: packed sequences
# [H, total, d] and pages [num_pages, H_kv, page, d] by their contract, and any case with an
# input of fewer axes than its first (W [d_in, d_out] beside x, a bias [H, N_q, N_k] or a per-head
# vector beside q, the module's parameters: a stack axis in front lands on another axis).
# gradcheck takes them one entry at a time from the start (batched=False); every other case, stacked.
ONE_AT_A_TIME = ("packed sequences, causal", "paged KV cache")


def one_at_a_time(name, inputs):
    """Whether gradcheck takes the case `name` one entry at a time (ONE_AT_A_TIME's comment)."""
    return name in ONE_AT_A_TIME or any(np.ndim(x) < np.ndim(inputs[0]) for x in inputs[1:])


def add_arguments(parser):
    parser.add_argument("--method", choices=METHODS, default="complex",
                        help="finite-difference method: complex step (default), central or richardson "
                             "differences")
    parser.add_argument("--seed", type=integer(0), default=0, help="seed of the random inputs (default 0)")


def run(args):
    passed = True
    for name, (forward, backward, inputs, names) in cases(np.random.default_rng(args.seed)).items():
        report = gradcheck(forward, backward, inputs, method=args.method, names=names,
                           batched=False if one_at_a_time(name, inputs) else None)
        taylor = taylor_test(forward, backward, inputs)
        print(f"== {name}   (taylor remainder order {taylor.order:.2f})\n{report}\n")
        passed &= bool(report) and bool(taylor)
    for name, (forward, jvp, inputs, names) in jvp_cases(np.random.default_rng(args.seed)).items():
        report = jvpcheck(forward, jvp, inputs, method=args.method, names=names)
        print(f"== forward mode: {name}\n{report}\n")
        passed &= bool(report)
    for name, gap in identity_gaps(np.random.default_rng(args.seed)).items():
        print(f"== {name}: relative gap {gap:.1e} (<= {IDENTITY_RTOL:g}: {'yes' if gap <= IDENTITY_RTOL else 'NO'})")
        passed &= gap <= IDENTITY_RTOL
    print("ALL GRADIENT CHECKS PASSED" if passed else "SOME GRADIENT CHECK FAILED")
    return 0 if passed else 1
