"""`numpy-attention crosscheck CASE.npz [--json] [--precision P] [--layout bnhd] [--lse-base 2]
[--own-forward] [--k out=2,dq=3] [--atol A] [--scheduler ADDRESS] [--workers N] [--plot FILE.png]`: judge
another attention's results.

Reads a case (oracle/case.py), computes the oracle and the baseline, prints one row per
candidate tensor (oracle/rule.py) and exits 0 if every tensor passes, 1 if any fails,
2 for a malformed case (one line on stderr naming the key or the shape). `--plot` also writes
each tensor's error over its bound by head and row (oracle/errormap.py), the exit code
the same; no matplotlib, or a figure that cannot be written, is bad input (2).
`--write-example CASE.npz` writes an example case instead.
"""
import argparse
import contextlib
import importlib.util
import math
import sys
import time

from ..oracle import CaseError, crosscheck, load_case, write_example_case
from ..oracle.schema import CANDIDATES, INPUTS, KEYS, LAYOUTS, LSE_BASES, OPTIONS
from ..oracle.errormap import crosscheck_errors, draw_error_maps, require_matplotlib
from ..oracle.precision import PRECISIONS
from .cli import PROG, UsageError, import_object, integer

HELP = "judge another attention's results against the oracle"
DESCRIPTION = """\
Judge another attention's results, given as a .npz case, against the oracle
(float64 or wider): one row per tensor, which passes if
err <= k * err(baseline) + atol, the baseline a naive attention computed in the
candidate's precision."""
EPILOG = f"""\
case keys (a .npz written by numpy.savez; shapes [..., H, N, d] as in attention_forward):
  inputs     {' '.join(INPUTS)}
             q [..., H, N_q, d_k], k [..., H_kv, N_k, d_k], v [..., H_kv, N_k, d_v],
             dout [..., H, N_q, d_v] (needed when a gradient is given)
  options    {' '.join(OPTIONS)}
  results    {' '.join(CANDIDATES)}
             the candidate's, each judged in its own dtype; out is required
  settings   {' '.join(key for key in KEYS if key not in INPUTS + OPTIONS + CANDIDATES) or '(none)'}
             how to read the candidate's tensors
  (see numpy_attention/oracle/schema.py, or --write-example for a complete case)
exit codes:
  0  every tensor passed
  1  a tensor failed
  2  bad input: a malformed case, a file that cannot be read, or --plot without
     matplotlib or with a file it cannot write (one line on stderr)"""


def _k_factors(text):
    """An argparse type: 'out=2,dq=3' -> {'out': 2.0, 'dq': 3.0}, each a tensor's k > 0."""
    factors = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = math.nan
        if name not in CANDIDATES or not (math.isfinite(factor) and factor > 0):
            raise argparse.ArgumentTypeError(f"must be TENSOR=K pairs with K > 0 and TENSOR one of "
                                             f"{', '.join(CANDIDATES)}, e.g. out=2,dq=3; got {text!r}")
        factors[name] = factor
    return factors


def _atol(text):
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def add_arguments(parser):
    parser.add_argument("case", metavar="CASE.npz", help="the case and the candidate's results")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--precision", choices=tuple(PRECISIONS),
                        help="what the candidate computed in (default: the case's precision key, "
                             "else inferred from its dtypes)")
    parser.add_argument("--layout", choices=LAYOUTS,
                        help="bhnd: [..., H, N, d] (default); bnhd: FlashAttention's [..., N, H, d]")
    parser.add_argument("--lse-base", choices=LSE_BASES, help="the base of the candidate's lse (default e)")
    parser.add_argument("--own-forward", action="store_true",
                        help="judge the gradients against the backward of the candidate's own out "
                             "and lse (tells a backward bug from the forward's error)")
    parser.add_argument("--k", type=_k_factors, metavar="TENSOR=K,...",
                        help="the rule's factor k per tensor (default out=2,lse=2, 3 for gradients)")
    parser.add_argument("--atol", type=_atol, help="one absolute tolerance for every tensor "
                                                   "(default: per tensor, see the rule)")
    parser.add_argument("--scheduler", metavar="ADDRESS",
                        help="a Dask scheduler (e.g. tcp://host:8786): a large case's oracle and "
                             "baselines run their slices on that cluster (needs the extra 'dask')")
    parser.add_argument("--workers", type=integer(1), metavar="N",
                        help="threads for the oracle's runs and the baselines (default: every core "
                             "from 2^19 scores up, else 1); the same report for any number")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also write a PNG of each tensor's |err| / bound by head and row "
                             "(key rows for dk, dv), red where it fails (needs matplotlib)")
    parser.add_argument("--score-mod", metavar="MODULE:NAME",
                        help="the FlexAttention score_mod(score, b, h, q_idx, kv_idx) the candidate used, "
                             "an importable Python function (NumPy's or torch's operations; a .npz "
                             "holds no function)")
    parser.add_argument("--mask-mod", metavar="MODULE:NAME",
                        help="the FlexAttention mask_mod(b, h, q_idx, kv_idx) -> bool the candidate "
                             "used, an importable Python function (NumPy's or torch's operations)")
    parser.add_argument("--write-example", action="store_true",
                        help="write an example case to CASE.npz and exit")


def _cluster(address):
    """--scheduler's address as crosscheck takes it; a missing dask is bad input (exit 2)."""
    if address is None:
        return None
    if importlib.util.find_spec("distributed") is None:          # crosscheck opens a Client on it
        raise UsageError(f"--scheduler {address}: needs dask.distributed (the extra 'dask': "
                         f"pip install 'numpy-attention[dask]')")
    return address


def _progress():
    """crosscheck's progress: each stage of a large case as a line on stderr, with the seconds
    since the command started, so that minutes of work are not silent."""
    start = time.perf_counter()
    return lambda text: print(f"{PROG} crosscheck: {text} ({time.perf_counter() - start:.0f} s)",
                              file=sys.stderr, flush=True)


def run(args):
    if args.write_example:
        try:
            write_example_case(args.case)
        except OSError as exc:
            raise UsageError(f"cannot write {args.case}: {exc.strerror or exc}") from None
        print(f"wrote an example case to {args.case}")
        return 0
    if args.plot is not None:                       # before the work, not after it
        try:
            require_matplotlib()
        except ImportError as exc:
            raise UsageError(str(exc)) from None
    try:
        arrays = load_case(args.case)
        for name in ("precision", "layout", "lse_base"):             # the options, or the case's keys
            given = getattr(args, name)
            if given is not None and name in arrays and str(arrays[name]) != given:
                raise CaseError(f"--{name.replace('_', '-')} {given} contradicts the case's "
                                f"{name} {str(arrays[name])!r}")
            if given is not None:
                arrays[name] = given
        settings = {"own_forward": args.own_forward, "k_factors": args.k, "atol": args.atol,
                    "scheduler": _cluster(args.scheduler), "workers": args.workers,
                    "progress": _progress()}
        for name in ("score_mod", "mask_mod"):
            spec = getattr(args, name)
            if spec is not None:
                settings[name] = import_object(spec, f"--{name.replace('_', '-')}", "mymods:rel_bias")
        with contextlib.redirect_stdout(sys.stderr):   # what a --score-mod prints is not the report
            if args.plot is None:
                report, ratios = crosscheck(**arrays, **settings), None
            else:                                      # the same verdicts, and each entry's ratio
                report, ratios = crosscheck_errors(**arrays, **settings)
    except (ValueError, TypeError) as exc:             # CaseError, and any argument refused by name
        raise UsageError(f"{args.case}: {exc}") from None
    if args.plot is not None:
        try:
            draw_error_maps(args.plot, report, ratios)
        except OSError as exc:
            raise UsageError(f"--plot: cannot write {args.plot}: {exc.strerror or exc}") from None
    print(report.to_json() if args.json else report)
    return 0 if report else 1
