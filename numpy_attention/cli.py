"""The `numpy-attention` command (also `python -m numpy_attention`).

    numpy-attention demo                   the seed's example, every gradient verified
    numpy-attention gradcheck              complex-step check of every op's backward
    numpy-attention vanishing [...]        the 1/sqrt(d_k) study
    numpy-attention crosscheck CASE.npz    judge another implementation against the oracle

Exit codes: 0 success, 1 a check failed, 2 bad arguments or input (one line on stderr).
Each subcommand lives in its own module, which provides add_arguments(parser)
and run(args) -> exit code.
"""
import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("numpy_attention.demo", "the seed's example, with every gradient verified"),
    "gradcheck": ("numpy_attention.selfcheck", "check every op's backward by complex step"),
    "crosscheck": ("numpy_attention.crosscheck.command",
                   "judge another attention's results against the float64 oracle"),
    "vanishing": ("numpy_attention.experiments.command", "the 1/sqrt(d_k) vanishing-gradient study"),
}


class UsageError(Exception):
    """Bad arguments or input: reported as one line, exit code 2. Subcommands raise it."""


def integer(minimum, maximum=None):
    """An argparse type: an integer >= minimum (integer(0) for seeds, integer(1) for counts),
    and <= maximum if given (a size that must fit an array axis)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            expected = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be an integer {expected}, got {text!r}")
        return value
    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def build_parser():
    from . import __version__                 # (the package imports this module while it loads)
    parser = _Parser(prog="numpy-attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module, help_text) in COMMANDS.items():
        command = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def _run(args):
    """args.run(args) as an exit code. An OSError escaping it (a file that cannot be read or
    written) is bad input too, and so is a MemoryError (sizes too large for this machine):
    the last safety net that keeps a traceback from the user."""
    try:
        return int(args.run(args))
    except OSError as exc:
        what = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else exc
        raise UsageError(f"numpy-attention {args.command}: {what}") from None
    except MemoryError as exc:
        raise UsageError(f"numpy-attention {args.command}: not enough memory for these sizes: "
                         f"{str(exc) or 'MemoryError'}") from None


def main(argv=None):
    """Run the command: exit code 0, 1, or 2 with one line on stderr for bad arguments or input."""
    try:
        return _run(build_parser().parse_args(argv))
    except UsageError as exc:
        print(" ".join(str(exc).split()), file=sys.stderr)
        return 2
