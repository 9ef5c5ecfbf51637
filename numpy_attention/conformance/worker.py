"""A Python kernel called in a worker process, so that a hang, a crash or an exit costs one
case, not the run.

    with Worker(kernel, timeout) as worker:     # kernel: a kernels.Kernel of a callable
        worker.results(arrays, outputs)         # as Kernel.results, or it raises
            KernelTimeout   no answer within `timeout` seconds: the worker was stopped
            KernelError     the worker died (a segfault, os.abort, os._exit): its signal or status
            Raised          what the kernel raised there (SystemExit too), in one line

The worker is `python -c "...serve(FD)"`, leading a session of its own (processes.py), its
stdin the null device and its stdout joined to its stderr, so that what the kernel prints
stays off the report. Through a socket (FD) it gets this process's sys.path and the Kernel,
pickled: a function or a class travels by its module and name, which the worker imports, an
object by its pickled state. It answers 'ready', then takes cases, answering each with the
kernel's results. A worker starts before the first case, and again before the case after one
that killed or hung it: the kernel's imports (torch, JAX) are paid once per start, not per
case. A kernel it cannot load (a lambda, a function defined inside another, in a script run
as __main__ or in a notebook) is a TypeError before the sweep that says what to do instead.
A worker whose sweep has gone (killed, so that it could not stop the worker) ends itself.
"""
import os
import pickle
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection

from .kernels import KernelError, KernelTimeout, Raised, describe
from .processes import ended, start, stop

STARTUP = 120.0             # seconds a worker may take to start and load the kernel (torch, JAX)
WATCH = 1.0                 # seconds between the worker's checks that its sweep is still there
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package's


class Worker:
    """A kernel in a worker process: name, kind and results(arrays, outputs) as a Kernel's."""

    def __init__(self, kernel, timeout):
        self.name, self.kind, self.timeout = kernel.name, kernel.kind, timeout
        try:
            self.pickled = pickle.dumps(kernel)
        except Exception as exc:              # pickle's errors: PicklingError, TypeError, AttributeError
            raise TypeError(_unloadable(kernel.name, describe(exc))) from None
        self.process = self.connection = None

    def __enter__(self):
        error = self._start()
        if error is not None:
            raise TypeError(_unloadable(self.name, error))
        return self

    def __exit__(self, *exc_info):
        if self.process is not None:
            self._stop()

    def results(self, arrays, outputs):
        """The kernel's results on a case, computed in the worker (started if none runs)."""
        if self.process is None:
            error = self._start()
            if error is not None:
                raise KernelError(f"a new worker process could not load the kernel: {error}")
        status, value = self._ask((arrays, outputs), self.timeout)
        if status == "raised":
            raise Raised(value)
        return value

    def _start(self):
        """Start a worker and hand it the kernel: None when it is ready, else what it said."""
        parent, child = socket.socketpair()
        with child:
            path = os.pathsep.join([p for p in [os.environ.get("PYTHONPATH")] if p] + [ROOT])
            code = f"from numpy_attention.conformance.worker import serve; serve({child.fileno()})"
            self.process = start([sys.executable, "-c", code], pass_fds=(child.fileno(),),
                                 env={**os.environ, "PYTHONPATH": path})
        self.connection = Connection(parent.detach())
        try:
            status, said = self._ask((sys.path, self.pickled), max(STARTUP, self.timeout or 0))
        except KernelError as exc:            # it died or hung while loading the kernel
            return str(exc)
        if status != "ready":
            self._stop()
            return said
        return None

    def _ask(self, message, seconds):
        """The worker's answer to `message` within `seconds` (None: no limit); KernelTimeout or
        KernelError after stopping a worker that gave none."""
        try:
            self.connection.send(message)
            if self.connection.poll(seconds):
                return self.connection.recv()
        except (EOFError, OSError):           # its end of the socket closed: it died
            raise KernelError(f"the kernel's process ended ({self._stop()})") from None
        self._stop()
        raise KernelTimeout(f"no results within {seconds:g} s: the kernel's process was stopped")

    def _stop(self):
        """Stop the worker; how it ended, in words."""
        self.connection.close()
        stop(self.process)
        status = ended(self.process.returncode)
        self.process = self.connection = None
        return status


def _unloadable(name, error):
    return (f"the kernel {name} cannot be loaded in a worker process ({error}): define it at the "
            f"top level of a module that the worker can import (not inside a function, a script "
            f"run as __main__ or a notebook), or pass isolate=False to call it in this process "
            f"(then no timeout, and a crash or exit of the kernel ends the run)")


def serve(fd):
    """The worker's side: load the kernel, then answer cases until the socket closes."""
    os.dup2(2, 1)                             # what the kernel prints goes to stderr,
    sys.stdout.reconfigure(line_buffering=True)   # a line at a time (a stopped worker loses none)
    connection = Connection(fd)
    threading.Thread(target=_watch, args=(os.getppid(),), daemon=True).start()
    path, pickled = connection.recv()
    sys.path[:] = path
    try:
        kernel = pickle.loads(pickled)
    except BaseException as exc:              # its module raised, exited, or has no such name
        connection.send(("error", describe(exc)))
        return
    connection.send(("ready", None))
    while True:
        try:
            arrays, outputs = connection.recv()
        except EOFError:                      # the sweep is done
            return
        try:
            answer = ("results", kernel.results(arrays, outputs))
        except BaseException as exc:          # SystemExit too: one case's error, not the worker's end
            answer = ("raised", describe(exc))
        try:
            connection.send(answer)           # pickled whole before a byte is sent
        except Exception as exc:
            connection.send(("raised", f"its results cannot be sent back ({describe(exc)})"))


def _watch(parent):
    """End this process once its parent, the sweep, has gone (it is adopted by another)."""
    while os.getppid() == parent:
        time.sleep(WATCH)
    os._exit(1)
