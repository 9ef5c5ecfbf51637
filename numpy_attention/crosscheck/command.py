"""`numpy-attention crosscheck CASE.npz [--json]`: judge another attention's results.

Reads a case (case.py), computes the oracle and the baseline, prints one row per
candidate tensor (rule.py) and exits 0 if every tensor passes, 1 if any fails,
2 for a malformed case (one line on stderr naming the key or the shape).
`--write-example CASE.npz` writes an example case instead.
"""
from ..cli import UsageError
from .case import CaseError, load_case, write_example_case
from .check import crosscheck


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
            raise UsageError(f"crosscheck: cannot write {args.case}: {exc.strerror or exc}") from None
        print(f"wrote an example case to {args.case}")
        return 0
    try:
        report = crosscheck(**load_case(args.case))
    except CaseError as exc:
        raise UsageError(f"crosscheck: {args.case}: {exc}") from None
    print(report.to_json() if args.json else report)
    return 0 if report else 1
