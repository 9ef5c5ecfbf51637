"""`numpy-attention conform MODULE:FUNCTION [--budget SECONDS] [--json] [--dtypes ...] [--options ...]
[--out DIR] [--seed N] [--quiet] [--kind KIND] [--fully-masked POLICY]`: a kernel's conformance run.

Imports MODULE (from the current directory first, as `python -m` does), takes its FUNCTION (a
torch, JAX or NumPy callable, or a command line as a str: conformance/kernels.py), sweeps the case
grid (conformance/run.py), prints the option x dtype table (or --json) and saves each shrunk failing
case in --out. Exit 0: every case run passed; 1: a case failed or raised; 2: bad arguments,
or a MODULE:FUNCTION that cannot be imported (one line on stderr).
"""
import argparse
import math

from ..conformance import conform
from ..conformance.supports import DTYPES, FULLY_MASKED, KINDS, OPTIONS, OUTPUTS, check_dtypes, check_supports
from .cli import UsageError, import_object, integer

HELP = "sweep a kernel over the case grid, judge each case, shrink each failure"
DESCRIPTION = """\
Run an attention kernel on the kernel test suites' case grid (lengths 1 to 2048,
N_q != N_k, one key, decoding, odd head widths, grouped-query heads, each option
it supports in each dtype), judge every case against the oracle (crosscheck),
shrink each failing case to the smallest that still fails, and print a table of
option x dtype."""
EPILOG = f"""\
the kernel, MODULE:FUNCTION:
  a callable fn(q, k, v, **options) of torch tensors or JAX arrays -> out or (out, lse),
  or of NumPy arrays (with dout=) -> dict of out, lse, dq, dk, dv; or a str, a command line
  with {{in}} and {{out}} (the case .npz it reads, the results .npz it writes); a kernel
  declared with numpy_attention.conformance.declare brings its dtypes and options
dtypes:   {' '.join(DTYPES)}
options:  {' '.join(OPTIONS)}
outputs:  {' '.join(OUTPUTS)} (named among --options)
default:  the kernel's declaration, else every dtype and causal gqa gradients
exit codes:
  0  every case run passed
  1  a case failed, or the kernel raised on one
  2  bad arguments, or a kernel that cannot be imported (one line on stderr)"""
DEFAULT_OUT = "conform-failures"


def _seconds(text):
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def add_arguments(parser):
    parser.add_argument("kernel", metavar="MODULE:FUNCTION",
                        help="the kernel, e.g. numpy_attention.conformance.examples:torch_sdpa")
    parser.add_argument("--budget", type=_seconds, metavar="SECONDS",
                        help="start no case after this many seconds (default: the whole grid)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--dtypes", nargs="+", metavar="DTYPE",
                        help=f"the dtypes to sweep, among {', '.join(DTYPES)} (spaces or commas between)")
    parser.add_argument("--options", nargs="+", metavar="OPTION",
                        help="the options and outputs the kernel supports (spaces or commas between)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"the directory for the shrunk failing cases (default {DEFAULT_OUT})")
    parser.add_argument("--seed", type=integer(0), default=0, help="the grid's seed (default 0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--kind", choices=KINDS, help="how the kernel is called (default: told from it)")
    parser.add_argument("--fully-masked", choices=FULLY_MASKED,
                        help="the kernel's output for a row with no key (default: its declaration's, else zero)")


def _names(values):
    """--dtypes / --options values, split on commas too; None stays None."""
    return None if values is None else [name for value in values for name in value.split(",") if name]


def load_kernel(spec):
    """MODULE:FUNCTION's kernel (cli.import_object)."""
    return import_object(spec, "the kernel", "numpy_attention.conformance.examples:torch_sdpa")


def run(args):
    kernel = load_kernel(args.kernel)
    dtypes, options = _names(args.dtypes), _names(args.options)
    try:
        if dtypes is not None:                         # refused by the option's name
            check_dtypes(dtypes, "--dtypes")
        if options is not None:
            check_supports(options, args.fully_masked or "zero", "--options")
        report = conform(kernel, dtypes=dtypes, supports=options,
                         budget=args.budget, seed=args.seed, out_dir=args.out, kind=args.kind,
                         fully_masked=args.fully_masked, progress=False if args.quiet else None)
    except (ValueError, TypeError) as exc:         # an argument refused by name
        raise UsageError(str(exc)) from None
    print(report.to_json() if args.json else report)
    return 0 if report else 1
