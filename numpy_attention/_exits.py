"""A SystemExit that a user's code raised (sys.exit in a kernel, a score_mod, or a module imported
by MODULE:NAME) told in one line: its code and where it was raised. The commands answer with
their own exit codes: a user's exit is an error of that code, never the command's verdict."""
import os


def exit_line(exc):
    """'SystemExit(3) raised in my_kernel (kernel.py:12)': the innermost Python frame of its
    traceback (sys.exit itself is not one), or no place when it has no traceback."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return f"SystemExit({exc.code!r}) raised"
    code = tb.tb_frame.f_code
    return f"SystemExit({exc.code!r}) raised in {code.co_name} ({os.path.basename(code.co_filename)}:{tb.tb_lineno})"
