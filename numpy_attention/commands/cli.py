"""The `numpy-attention` command (also `python -m numpy_attention`).

    numpy-attention demo                   the seed's example, every gradient verified by complex step
    numpy-attention gradcheck [--method]   every op's backward against finite differences
    numpy-attention vanishing [...]        the 1/sqrt(d_k) study
    numpy-attention crosscheck CASE.npz    judge another implementation against the oracle
    numpy-attention conform MODULE:FUNCTION  sweep a kernel over the case grid, shrink each failure

Exit codes: 0 success, 1 a check failed, 2 bad arguments or input, or an output that cannot
be written (stdout or a file, e.g. on a full device): one line on stderr,
`numpy-attention <command>: <message>` (no command given: the usage and the command list);
130 interrupted (Ctrl-C), one line, from the moment main is called, which is at once: the
package's import loads nothing heavy (numpy_attention/__init__.py), main imports the commands;
141 when the reader of its output closes the pipe (`| head`), quietly.
Each command lives in its own module, which provides HELP (its line of the command list),
DESCRIPTION and optionally EPILOG (its --help, as written), add_arguments(parser) and
run(args) -> exit code; a command raises UsageError(message) for bad input.
"""
import argparse                                        # light imports only: a Ctrl-C before
import contextlib                                      # main runs is still the interpreter's
import importlib
import os
import signal
import sys

from .. import __version__
from .._exits import exit_line

PROG = "numpy-attention"
COMMANDS = ("demo", "gradcheck", "crosscheck", "conform", "vanishing")      # modules of this package
DESCRIPTION = ("Transformer attention in NumPy with every backward written by hand and checked "
               "against finite differences; a float64 oracle for other implementations.")
EPILOG = (f"exit codes: 0 success, 1 a check failed, 2 bad arguments or input, or an output that "
          f"cannot be written (one line on stderr), 130 interrupted, 141 output pipe closed by its "
          f"reader (no message). "
          f"'{PROG} <command> --help' for a command's options.")


class UsageError(Exception):
    """Bad arguments or input: reported as one line, exit code 2. Commands raise it."""


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


def import_object(spec, what, example):
    """MODULE:NAME's object, MODULE imported with the current directory on sys.path (as
    `python -m` does), what it prints sent to stderr (stdout is the report's); UsageError (one
    line) if it cannot be, a sys.exit at its import included. what, example: for the message,
    e.g. "the kernel", "numpy_attention.conformance.examples:torch_sdpa"."""
    module_name, colon, attribute = spec.partition(":")
    if not (colon and module_name and attribute):
        raise UsageError(f"{spec!r}: {what} is MODULE:FUNCTION, e.g. {example}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        with contextlib.redirect_stdout(sys.stderr):
            module = importlib.import_module(module_name)
    except SystemExit as exc:                 # the module's exit is not the command's
        raise UsageError(f"cannot import {module_name}: {exit_line(exc)}") from None
    except Exception as exc:                  # whatever the module raises: one line, not a traceback
        raise UsageError(f"cannot import {module_name}: {type(exc).__name__}: {exc}") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise UsageError(f"module {module_name} has no {attribute!r}") from None


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are UsageError('<prog>: <message>'), not an exit."""

    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")

    def _print_message(self, message, file=None):
        """argparse's printing, but what goes to stdout (--help, --version) is written with
        _write_out: argparse would ignore an output that cannot be written."""
        if file is sys.stdout:
            _write_out(self.prog, message)
        else:
            super()._print_message(message, file)


def build_parser():
    """The parser of every command; args.run(args) runs the one given (args.run None: none)."""
    parser = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=20))
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", parser_class=_Parser)
    for name in COMMANDS:
        command = importlib.import_module(f"{__package__}.{name}")
        sub_parser = sub.add_parser(name, help=command.HELP, description=command.DESCRIPTION,
                                    epilog=getattr(command, "EPILOG", None),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_arguments(sub_parser)
        sub_parser.set_defaults(run=command.run)
    parser.set_defaults(run=None)
    return parser


def _run(args):
    """args.run(args) as an exit code, once what it printed is written (_write_out: an output
    that cannot be written fails the command). A UsageError of the command gets the command's
    prefix. An OSError escaping it (a file that cannot be read or written) is bad input too,
    and so is a MemoryError (sizes too large for this machine): the last safety net that keeps
    a traceback from the user. The commands return their exit codes and never raise
    SystemExit: one that escapes is a user's code's (a --score-mod that calls sys.exit), an
    error named in one line, exit 2, never a verdict."""
    prefix = f"{PROG} {args.command}"
    try:
        return int(args.run(args))
    except UsageError as exc:
        raise UsageError(f"{prefix}: {exc}") from None
    except SystemExit as exc:
        raise UsageError(f"{prefix}: user code ended the command: {exit_line(exc)}") from None
    except BrokenPipeError:                            # main's, when the reader stopped reading
        raise
    except OSError as exc:
        reason = exc.strerror or exc
        what = f"{exc.filename}: {reason}" if exc.filename else reason
        raise UsageError(f"{prefix}: {what}") from None
    except MemoryError as exc:
        raise UsageError(f"{prefix}: not enough memory for these sizes: "
                         f"{str(exc) or 'MemoryError'}") from None
    finally:                                           # also after a failure: its output so far
        _write_out(prefix)


def _write_out(prefix, text=""):
    """Write text to stdout and flush it, so that a lost output is known before the exit code
    (at the interpreter's exit it would print 'Exception ignored' and exit 120): UsageError
    ('<prefix>: cannot write stdout: <reason>'), stdout pointed at the null device first so
    that exiting cannot fail again. BrokenPipeError, the reader gone, is raised as it is.
    A stdout closed before the start (`numpy-attention demo >&-`) is None in Python: the same."""
    if sys.stdout is None:
        raise UsageError(f"{prefix}: cannot write stdout: it is closed")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        _discard_stdout()
        raise UsageError(f"{prefix}: cannot write stdout: {exc.strerror or exc}") from None


def _discard_stdout():
    """Point stdout at the null device, so that flushing it at exit cannot fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):      # a stdout with no file descriptor
        pass
    finally:
        os.close(null)


def main(argv=None):
    """Run the command: exit code 0, 1, or 2 with one line on stderr for bad arguments or input
    (no command at all: the usage with the command list, and a one-line hint); 130 for Ctrl-C
    at any moment of main, the command modules' imports (numpy, scipy, ml_dtypes) included; 141
    for a closed pipe."""
    with _LostInterrupts() as lost:
        try:
            parser = build_parser()
            lost.check()
            args = parser.parse_args(argv)
            if args.run is None:
                print(f"{parser.format_help()}\n{PROG}: no command given; run one of {', '.join(COMMANDS)}, "
                      f"e.g. '{PROG} demo'", file=sys.stderr)
                return 2
            _write_out(f"{PROG} {args.command}")      # a closed stdout fails before the work
            code = _run(args)
            lost.check()
            return code
        except UsageError as exc:
            print(" ".join(str(exc).split()), file=sys.stderr)
            return 2
        except BrokenPipeError:                        # the reader stopped reading (| head): quiet,
            _discard_stdout()                          # the shell's 128 + SIGPIPE
            return 141
        except KeyboardInterrupt:                      # Ctrl-C: one line, the shell's 128 + SIGINT
            return _interrupted()
        except ImportError:                            # a Ctrl-C that an extension module's import
            if not lost.signalled:                     # turned into its own ImportError (numpy's,
                raise                                  # when it lands in PyCapsule_Import)
            return _interrupted()


def _interrupted():
    """Ctrl-C's one line; its exit code, 130."""
    print(f"{PROG}: interrupted", file=sys.stderr)
    _interrupt_handled()
    return 130


class _LostInterrupts:
    """A Ctrl-C that Python could not raise: SIGINT's KeyboardInterrupt raised inside a weakref
    callback or a __del__ (the import system's module locks have one) is only reported, as
    'Exception ignored in: ...', and the program goes on. Within this context such a
    KeyboardInterrupt is kept quiet and remembered; check() raises it again where main can
    handle it. Other unraisable exceptions go to the hook there was before. SIGINT itself is
    noted too (`signalled`), where Python's own handler would raise it, so that a
    KeyboardInterrupt an extension's import turned into an ImportError is still known."""

    def __enter__(self):
        self.previous, self.interrupted, self.signalled = sys.unraisablehook, False, False
        sys.unraisablehook = self._hook
        self.sigint = None
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # not where it is ignored
            try:
                self.sigint = signal.signal(signal.SIGINT, self._noted)
            except ValueError:                         # not the main thread
                pass
        return self

    def _noted(self, signum, frame):
        self.signalled = True
        raise KeyboardInterrupt

    def _hook(self, unraisable):
        if issubclass(unraisable.exc_type, KeyboardInterrupt):
            self.interrupted = True
        else:
            self.previous(unraisable)

    def check(self):
        """Raise KeyboardInterrupt if one was lost since the context began."""
        if self.interrupted:
            raise KeyboardInterrupt

    def __exit__(self, *exc_info):
        sys.unraisablehook = self.previous
        if self.sigint is not None:
            signal.signal(signal.SIGINT, self.sigint)


def _interrupt_handled():
    """Clear CPython's mark of an unhandled Ctrl-C. A KeyboardInterrupt that has left an exec()
    of a string (scipy's imports run some) sets it, even when caught since, and `python -m`
    then exits by SIGINT whatever main returns (CPython 3.10 to 3.13); an exec() of a string
    that completes clears it."""
    exec("")
