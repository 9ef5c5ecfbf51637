"""The sweep's child processes (the worker of a Python kernel, a command line kernel): each
leads a session of its own, so that a Ctrl-C at the terminal reaches the sweep alone, which
then stops them; stopping one kills its whole process group, whatever it started too.

    process = start(args, **popen_arguments)    # subprocess.Popen, in a new session
    stop(process)                               # its group killed, the process reaped
    ended(process.returncode)                   # 'exited with status 3', 'killed by SIGSEGV'
"""
import os
import signal
import subprocess


def start(args, **popen_arguments):
    """subprocess.Popen(args) in a new session, its stdin the null device (a kernel that
    reads it gets end of file at once, instead of waiting on the terminal)."""
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True, **popen_arguments)


def stop(process):
    """Kill the process's group (SIGKILL: a hung kernel may ignore anything milder) and reap
    the process."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):      # the group is gone already
        pass
    process.wait()


def ended(returncode):
    """How a process ended, in words: its exit status or the signal that killed it."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"
