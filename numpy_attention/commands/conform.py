"""`numpy-attention conform MODULE:FUNCTION [--budget SECONDS] [--timeout SECONDS] [--json]
[--dtypes ...] [--options ...] [--properties ...] [--out DIR] [--seed N] [--quiet] [--kind KIND]
[--fully-masked POLICY]`: a kernel's conformance run.

Imports MODULE (from the current directory first, as `python -m` does; what it prints goes to
stderr), takes its FUNCTION (a torch, JAX or NumPy callable, or a command line as a str:
conformance/kernels.py), sweeps the case grid (conformance/run.py) with the kernel in a worker
process, writes each case's verdict to --out/conform.jsonl and each that does not pass to
stderr as it comes, checks the properties (conformance/properties.py), prints the option x dtype
table and the properties' (or --json) and saves each shrunk failing case in --out. Exit 0: the
run passed (every case and trial run passed, every role of every cell and every trial run);
1: a case or trial failed, raised, exited, died or timed out, or the run did not cover the
grid and the trials; 2: bad
arguments, a MODULE:FUNCTION that cannot be imported or loaded, an --out that cannot be
written (one line on stderr); 130 on a Ctrl-C, after the report of the cases judged so far.
"""
import argparse
import math

from ..conformance import ConformInterrupted, conform
from ..conformance.run import TIMEOUT
from ..conformance.shrink import MAX_STEPS
from ..conformance.properties import PROPERTIES, check_properties
from ..conformance.supports import (DTYPES, FULLY_MASKED, KINDS, MAX_BLOCK, OPTIONS, OUTPUTS, PROMISES, check_dtypes,
                                    check_supports)
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
  declared with numpy_attention.conformance.declare brings its dtypes and options.
  A callable runs in a worker process: a case it hangs on (--timeout), crashes, aborts or
  exits in is a TIMEOUT or ERROR row, and the sweep goes on.
dtypes:   {' '.join(DTYPES)}
options:  {' '.join(OPTIONS)}
outputs:  {' '.join(OUTPUTS)} (named among --options)
promises: {' '.join(PROMISES)} (named among --options: the properties hold them bit for bit)
properties: {' '.join(PROPERTIES)}, or none (default: all)
default:  the kernel's declaration, else every dtype and causal gqa gradients
time:     no case starts after --budget (the grid's after three quarters of it, then the
          properties' trials), a case runs at most --timeout; then each failing cell is
          shrunk, in at most {MAX_STEPS} more runs of the kernel
exit codes:
  0    the run passed: every case and property trial run passed, and it ran every role
       of every cell and every trial
  1    a case or a trial failed, raised, exited, died or timed out, or the budget left a
       role or a trial unrun
  2    bad arguments, a kernel that cannot be imported or loaded, an --out that
       cannot be written (one line on stderr)
  130  interrupted (Ctrl-C): the report of the cases judged so far, then one line"""
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
    parser.add_argument("--timeout", type=_seconds, default=TIMEOUT, metavar="SECONDS",
                        help=f"stop a case that gives no results in this many seconds: a TIMEOUT row "
                             f"(default {TIMEOUT:g})")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--dtypes", nargs="+", metavar="DTYPE",
                        help=f"the dtypes to sweep, among {', '.join(DTYPES)} (spaces or commas between)")
    parser.add_argument("--options", nargs="+", metavar="OPTION",
                        help="the options and outputs the kernel supports (spaces or commas between)")
    parser.add_argument("--properties", nargs="+", metavar="PROPERTY",
                        help=f"the properties to check, among {', '.join(PROPERTIES)}, or none "
                             f"(default: all)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"the directory for the run's record, conform.jsonl, and the shrunk failing "
                             f"cases (default {DEFAULT_OUT})")
    parser.add_argument("--seed", type=integer(0), default=0, help="the grid's seed (default 0)")
    parser.add_argument("--block-sizes", nargs="+", type=integer(2, MAX_BLOCK), metavar="N",
                        help="the kernel's block sizes along N: the lengths property also tries each, "
                             "twice each, and one either side (default: its declaration's)")
    parser.add_argument("--quiet", action="store_true",
                        help="nothing on stderr as the run goes (the plan, each case that does not pass, "
                             "the bar)")
    parser.add_argument("--kind", choices=KINDS, help="how the kernel is called (default: told from it)")
    parser.add_argument("--fully-masked", choices=FULLY_MASKED,
                        help="the kernel's output for a row with no key (default: its declaration's, else zero)")


def names(values):
    """--dtypes / --options values, split on commas too; None stays None."""
    return None if values is None else [name for value in values for name in value.split(",") if name]


def load_kernel(spec):
    """MODULE:FUNCTION's kernel (cli.import_object)."""
    return import_object(spec, "the kernel", "numpy_attention.conformance.examples:torch_sdpa")


def run(args):
    kernel = load_kernel(args.kernel)
    dtypes, options, properties = names(args.dtypes), names(args.options), names(args.properties)
    try:
        if dtypes is not None:                         # refused by the option's name
            check_dtypes(dtypes, "--dtypes")
        if options is not None:
            check_supports(options, args.fully_masked or "zero", "--options")
        if properties is not None:
            properties = () if properties == ["none"] else check_properties(properties, "--properties")
        report = conform(kernel, dtypes=dtypes, supports=options, budget=args.budget,
                         timeout=args.timeout, seed=args.seed, out_dir=args.out, kind=args.kind,
                         fully_masked=args.fully_masked, progress=not args.quiet, properties=properties,
                         block_sizes=args.block_sizes)
    except (ValueError, TypeError) as exc:         # an argument refused by name, a kernel not loaded
        raise UsageError(str(exc)) from None
    except ConformInterrupted as interrupted:      # the cases judged so far, then main's 130
        _print(interrupted.report, args.json)
        raise KeyboardInterrupt from None
    _print(report, args.json)
    if report.unsaved:
        raise UsageError(f"cannot write {report.unsaved}")
    return 0 if report else 1


def _print(report, as_json):
    print(report.to_json() if as_json else report)
