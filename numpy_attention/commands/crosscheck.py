"""`numpy-attention crosscheck CASE.npz [--json]`: judge another attention's results.

Reads a case (crosscheck/case.py), computes the oracle and the baseline, prints one row per
candidate tensor (crosscheck/rule.py) and exits 0 if every tensor passes, 1 if any fails,
2 for a malformed case (one line on stderr naming the key or the shape).
`--write-example CASE.npz` writes an example case instead.
"""
from ..crosscheck import CaseError, crosscheck, load_case, write_example_case
from ..crosscheck.case import CANDIDATES, INPUTS, KEYS, OPTIONS
from .cli import UsageError

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
  (see numpy_attention/crosscheck/case.py, or --write-example for a complete case)
exit codes:
  0  every tensor passed
  1  a tensor failed
  2  bad input: a malformed case or a file that cannot be read (one line on stderr)"""


def add_arguments(parser):
    parser.add_argument("case", metavar="CASE.npz", help="the case and the candidate's results")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--write-example", action="store_true",
                        help="write an example case to CASE.npz and exit")


def run(args):
    if args.write_example:
        try:
            write_example_case(args.case)
        except OSError as exc:
            raise UsageError(f"cannot write {args.case}: {exc.strerror or exc}") from None
        print(f"wrote an example case to {args.case}")
        return 0
    try:
        report = crosscheck(**load_case(args.case))
    except CaseError as exc:
        raise UsageError(f"{args.case}: {exc}") from None
    print(report.to_json() if args.json else report)
    return 0 if report else 1
