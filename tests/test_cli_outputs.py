"""The numpy-attention command when its output is lost or it is interrupted.

A lost output (stdout or a file on a full device) fails the command: one line on stderr,
exit 2. Ctrl-C gives one line and exit 130 at any moment, the imports included.
/dev/full (Linux) is the full device: every write to it fails with ENOSPC.
"""
import os
import shutil
import signal
import subprocess
import sys
import weakref

import pytest
from optional import MATPLOTLIB_REASON

import numpy_attention
from numpy_attention.commands import cli, demo

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux: /dev/full, signals")
FULL = "No space left on device"
SMALL_SWEEP = ["vanishing", "--d-k", "4", "--n-keys", "8", "--trials", "10"]


def environment(unbuffered):
    """This process's environment with PYTHONUNBUFFERED set to `unbuffered` ('' unset: stdout
    block-buffered into a file or a pipe, as for most users)."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    return {**env, "PYTHONUNBUFFERED": unbuffered} if unbuffered else env


def one_line_error(err, command):
    """Assert err is one line, `numpy-attention <command>: ...`, no traceback; return it."""
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    assert err.startswith(f"{cli.PROG} {command}: " if command else f"{cli.PROG}: "), err
    return err


@pytest.fixture
def example_case(tmp_path):
    """The path of a case file, the one --write-example writes."""
    path = str(tmp_path / "case.npz")
    assert cli.main(["crosscheck", "--write-example", path]) == 0
    return path


@pytest.mark.parametrize("buffering", [-1, 1], ids=["block-buffered", "line-buffered"])
@pytest.mark.parametrize("argv", [
    ["demo"], ["gradcheck", "--method", "central"], ["crosscheck", "CASE"],
    ["crosscheck", "CASE", "--json"], ["crosscheck", "--write-example", "NEW"], SMALL_SWEEP,
    SMALL_SWEEP + ["--json", "-"], SMALL_SWEEP + ["--csv", "-"], ["demo", "--help"], ["--version"]],
    ids=" ".join)
def test_stdout_on_a_full_device_fails_the_command(argv, buffering, example_case, tmp_path,
                                                   monkeypatch, capsys):
    """Block-buffered, the output is lost when main flushes it; line-buffered, at the first
    print: either way one line, exit 2, and stdout is left so that exiting cannot fail again."""
    argv = [{"CASE": example_case, "NEW": str(tmp_path / "new.npz")}.get(a, a) for a in argv]
    capsys.readouterr()
    with open("/dev/full", "w", buffering=buffering) as full:
        monkeypatch.setattr(sys, "stdout", full)
        assert cli.main(argv) == 2
        full.flush()                                   # what main left behind is writable now
    monkeypatch.undo()
    command = argv[0] if argv[0] in cli.COMMANDS else None
    assert FULL in one_line_error(capsys.readouterr().err, command)


@pytest.mark.slow
@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["default", "PYTHONUNBUFFERED"])
@pytest.mark.parametrize("argv", [["demo"], ["--version"]], ids=" ".join)
def test_the_command_to_a_full_device_exits_2_with_one_line(argv, unbuffered):
    """The whole process, interpreter exit included (which would print 'Exception ignored'
    and exit 120 for an output left in the buffer)."""
    with open("/dev/full", "w") as full:
        run = subprocess.run([sys.executable, "-m", "numpy_attention", *argv], stdout=full,
                             stderr=subprocess.PIPE, text=True, env=environment(unbuffered),
                             timeout=120)
    assert run.returncode == 2
    assert FULL in one_line_error(run.stderr, "demo" if argv == ["demo"] else None)


CLOSED_STDOUT_ARGV = {"demo": ["demo"], "gradcheck": ["gradcheck"], "crosscheck": ["crosscheck", "CASE"],
                      "conform": ["conform", "numpy_attention.conformance.examples:numpy_float32"],
                      "vanishing": SMALL_SWEEP}


@pytest.mark.slow
@pytest.mark.parametrize("argv", [*CLOSED_STDOUT_ARGV.values(), ["crosscheck", "--write-example", "NEW"],
                                  ["demo", "--help"], ["--version"]], ids=" ".join)
def test_a_closed_stdout_is_one_line_and_exit_2_before_the_work(argv, example_case, tmp_path):
    """`numpy-attention demo >&-`: stdout closed when the process starts (Python's sys.stdout
    is None then). Every command answers one line and exit 2, and does none of its work (the
    example case is not written)."""
    new = tmp_path / "new.npz"
    argv = [{"CASE": example_case, "NEW": str(new)}.get(a, a) for a in argv]
    run = subprocess.run([sys.executable, "-m", "numpy_attention", *argv], stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: os.close(1), timeout=120)
    assert run.returncode == 2
    command = argv[0] if argv[0] in cli.COMMANDS else None
    assert "cannot write stdout: it is closed" in one_line_error(run.stderr, command)
    assert not new.exists()


def test_every_command_is_tested_with_a_closed_stdout():
    assert set(CLOSED_STDOUT_ARGV) == set(cli.COMMANDS)


@pytest.mark.slow
@pytest.mark.parametrize("argv, option", [
    (["crosscheck", "--write-example", "OUT"], "crosscheck"),
    (SMALL_SWEEP + ["--json", "OUT"], "--json"), (SMALL_SWEEP + ["--csv", "OUT"], "--csv"),
    (SMALL_SWEEP + ["--plot", "OUT"], "--plot")], ids=lambda x: x if isinstance(x, str) else None)
def test_a_file_on_a_full_device_fails_the_command(argv, option, tmp_path, capsys):
    """OUT is a link to /dev/full: the file is written, not replaced by a new one (which would
    report success with nothing written to the device, and replace /dev/full itself if given)."""
    if option == "--plot":
        pytest.importorskip("matplotlib", reason=MATPLOTLIB_REASON)
    out = tmp_path / "out"
    out.symlink_to("/dev/full")
    capsys.readouterr()
    assert cli.main([str(out) if a == "OUT" else a for a in argv]) == 2
    err = one_line_error(capsys.readouterr().err, argv[0])
    assert FULL in err and str(out) in err
    assert out.is_symlink() and os.path.realpath(out) == "/dev/full"


def test_a_device_path_is_written_not_replaced(tmp_path, capsys):
    """A link to /dev/null stays one: what is written goes to the device."""
    out = tmp_path / "out"
    out.symlink_to(os.devnull)
    assert cli.main(["crosscheck", "--write-example", str(out)]) == 0
    assert out.is_symlink() and os.path.realpath(out) == os.devnull


@pytest.mark.slow
@pytest.mark.parametrize("unbuffered", ["", "1"], ids=["default", "PYTHONUNBUFFERED"])
def test_a_closed_pipe_is_quiet_with_141(unbuffered):
    """`numpy-attention demo | true`: the reader has closed the pipe before the first line
    (block-buffered, the output meets it when main flushes; unbuffered, at the first print)."""
    with subprocess.Popen([sys.executable, "-m", "numpy_attention", "demo"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, env=environment(unbuffered)) as command:
        command.stdout.close()
        err = command.stderr.read()
    assert command.wait(timeout=120) == 141 and err == b""


def console_script():
    """The path of the installed `numpy-attention` script (pip's, next to this Python first),
    or None."""
    return shutil.which(cli.PROG, path=os.path.dirname(sys.executable)) or shutil.which(cli.PROG)


def interrupt(command, imported, script=None):
    """Run `python -m numpy_attention <command>` (or `<script> <command>`, the console script)
    and send it SIGINT once Python's import profile (-X importtime) has reported the module
    `imported` (None: once the command has printed its first line). Return (exit code, the
    lines of stderr but the import times). PYTHONPATH puts this checkout first, for the script.
    The command starts with SIGINT's default action, as from a terminal (a background job of
    a non-interactive shell inherits it ignored, and Python then keeps ignoring it)."""
    argv = [script] if script else [sys.executable, "-m", "numpy_attention"]
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(numpy_attention.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [checkout, os.getenv("PYTHONPATH")])))
    if imported:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    with subprocess.Popen([*argv, command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as process:
        if imported:
            for line in process.stderr:
                if line.rpartition("|")[2].strip() == imported:
                    break
            else:
                pytest.fail(f"{imported} was never imported: {process.communicate(timeout=120)}")
        else:
            process.stdout.readline()
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    return process.returncode, [line for line in err.splitlines()
                                if not line.startswith("import time:")]


MOMENTS = [
    pytest.param("numpy.version", id="numpy importing"),
    pytest.param("numpy", id="numpy imported"),
    pytest.param("ml_dtypes", id="ml_dtypes imported"),
    pytest.param("numpy_attention.gradcheck_cases", id="the commands imported"),
    pytest.param(None, id="the command running")]


@pytest.mark.slow
@pytest.mark.parametrize("imported", MOMENTS)
@pytest.mark.parametrize("command", ["demo", "gradcheck"])
def test_ctrl_c_at_any_moment_is_one_line_130(command, imported):
    """One line, exit 130, for SIGINT during the heavy imports (numpy, then ml_dtypes' extension:
    most of a second), once numpy_attention.gradcheck_cases is imported (scipy takes a good part of a
    second more), or once the command has printed its first line. All of these are inside main:
    `import numpy_attention` imports none of them, so main runs almost at once."""
    assert interrupt(command, imported) == (130, [f"{cli.PROG}: interrupted"])


@pytest.mark.slow
@pytest.mark.parametrize("imported", MOMENTS[:3])
@pytest.mark.parametrize("command", ["demo", "gradcheck"])
def test_ctrl_c_in_the_console_script_is_one_line_130(command, imported):
    """The same by the installed `numpy-attention` script, which imports the package itself
    (`from numpy_attention.commands.cli import main`) before it calls main."""
    script = console_script()
    if script is None:
        pytest.skip(f"the {cli.PROG} console script is not installed (pip install -e .)")
    assert interrupt(command, imported, script) == (130, [f"{cli.PROG}: interrupted"])


def raise_in_a_callback(error):
    """Raise `error` in a weakref callback, as SIGINT's KeyboardInterrupt is raised when the
    signal lands in one (the import system's module locks have one): Python reports it as
    unraisable and goes on. Returns the (dead) reference."""
    class Thing:
        pass

    def callback(_):
        raise error
    thing = Thing()
    reference = weakref.ref(thing, callback)
    del thing
    return reference


@pytest.mark.parametrize("where", ["importing", "running"])
def test_an_interrupt_python_could_not_raise_still_ends_in_130(where, monkeypatch, capsys):
    """A KeyboardInterrupt lost in a callback while the commands are imported or while the
    command runs: main still answers one line and 130, and no 'Exception ignored' report."""
    ran = []
    if where == "importing":
        real = cli.importlib.import_module
        monkeypatch.setattr(cli.importlib, "import_module",
                            lambda name: (raise_in_a_callback(KeyboardInterrupt), real(name))[1])
    monkeypatch.setattr(demo, "run", lambda args: (where == "running" and raise_in_a_callback(KeyboardInterrupt),
                                                   ran.append(True), 0)[2])
    hook = sys.unraisablehook
    assert cli.main(["demo"]) == 130
    assert capsys.readouterr().err == f"{cli.PROG}: interrupted\n"
    assert ran == ([True] if where == "running" else [])
    assert sys.unraisablehook is hook


def import_as_an_extension_would(name):
    """An import that SIGINT interrupts where an extension module turns the KeyboardInterrupt
    into its own ImportError (numpy's C extension, when the signal lands in its
    PyCapsule_Import of datetime)."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10 ** 6):                              # Python runs its handler between
            pass                                              # bytecodes, at once
    except KeyboardInterrupt as exc:
        raise ImportError(f'PyCapsule_Import could not import module "datetime" ({name})') from exc
    raise AssertionError("SIGINT did not arrive")


def test_an_interrupt_an_extension_turned_into_an_import_error_ends_in_130(monkeypatch, capsys):
    monkeypatch.setattr(signal, "getsignal", lambda n: signal.default_int_handler)   # pytest's is its own
    monkeypatch.setattr(cli.importlib, "import_module", import_as_an_extension_would)
    assert cli.main(["demo"]) == 130
    assert capsys.readouterr().err == f"{cli.PROG}: interrupted\n"


def test_an_import_error_without_an_interrupt_is_not_one(monkeypatch):
    def fails(name):
        raise ImportError(f"no module {name}")
    monkeypatch.setattr(cli.importlib, "import_module", fails)
    with pytest.raises(ImportError, match="no module"):
        cli.main(["demo"])


def test_other_unraisable_exceptions_are_still_reported(monkeypatch):
    """Only KeyboardInterrupt is kept: another exception of a callback is reported as before."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(demo, "run", lambda args: 0 if raise_in_a_callback(ZeroDivisionError)() is None else 1)
    assert cli.main(["demo"]) == 0
    assert [item.exc_type for item in seen] == [ZeroDivisionError]
