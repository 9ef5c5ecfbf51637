"""The numpy-attention command: demo, gradcheck, and its answers to bad arguments."""
import importlib
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.commands.cli import main
from numpy_attention.finite_differences import METHODS


def test_demo_prints_the_seeds_output_and_passes(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "input shape:             (2, 10, 512)" in out
    assert "output shape:            (2, 10, 512)" in out
    assert "attention weights shape: (2, 8, 10, 10)" in out
    row_sum = re.search(r"sum of the first attention row .*: ([0-9.]+) ", out).group(1)
    assert abs(float(row_sum) - 1.0) <= 4 * np.finfo(np.float64).eps    # 1 to rounding, either side
    for name in ("query", "key", "value", "W_q.weight", "W_o.bias"):
        assert name in out
    assert "ALL GRADIENT CHECKS PASSED" in out


@pytest.mark.slow
def test_gradcheck_command_checks_every_op(capsys):
    assert main(["gradcheck"]) == 0
    out = capsys.readouterr().out
    for name in ("linear", "softmax", "split_heads", "merge_heads", "causal bottom_right",
                 "GQA", "window", "softcap", "dropout", "multihead"):
        assert f"== {name}" in out
    assert out.count("-> PASS") >= 15 and "FAIL" not in out


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["demo"], ["gradcheck"]])
def test_the_package_checks_its_own_functions_without_a_note(argv, capsys):
    """A note on how gradcheck evaluated the functions is for a user's functions: the demo and
    gradcheck check the package's own, some of which take no stack of inputs by their
    contract (batched=False there)."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "stacked" not in out and "batched" not in out


def test_the_cases_gradcheck_takes_one_at_a_time_are_cases():
    from numpy_attention.commands.gradcheck import ONE_AT_A_TIME
    from numpy_attention.gradcheck_cases import cases
    assert set(ONE_AT_A_TIME) <= set(cases(np.random.default_rng(0)))


@pytest.mark.slow
def test_python_dash_m_is_the_same_command():
    run = subprocess.run([sys.executable, "-m", "numpy_attention", "demo"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "ALL GRADIENT CHECKS PASSED" in run.stdout


@pytest.mark.parametrize("argv", [["nonsense"], ["demo", "--seed", "x"], ["gradcheck", "--method", "exact"]])
def test_bad_arguments_one_line_exit_2(argv, capsys):
    assert "numpy-attention" in usage_error(argv, capsys)


def test_no_command_prints_the_usage_the_commands_and_a_hint(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert lines[0].startswith("usage: numpy-attention")
    for name, description in (("demo", "the seed's example"), ("gradcheck", "finite differences"),
                              ("crosscheck", "oracle"), ("vanishing", "1/sqrt(d_k)")):
        assert any(line.split()[:1] == [name] and description in line for line in lines), name
    assert lines[-1].startswith("numpy-attention: no command given") and "numpy-attention demo" in lines[-1]


def bad_input_of_every_command(tmp_path):
    """command -> an argv it refuses: a parser error, a bad case file, an option of the other mode."""
    (tmp_path / "x.npz").write_text("not a zip file")
    return {"demo": ["demo", "--seed", "-1"],
            "gradcheck": ["gradcheck", "--method", "exact"],
            "crosscheck": ["crosscheck", str(tmp_path / "x.npz")],
            "vanishing": ["vanishing", "--lr", "0.1"]}


@pytest.mark.parametrize("command", ["demo", "gradcheck", "crosscheck", "vanishing"])
def test_every_command_answers_bad_input_in_one_style(command, tmp_path, capsys):
    """`numpy-attention <command>: <message>`, one line on stderr, exit 2."""
    err = usage_error(bad_input_of_every_command(tmp_path)[command], capsys)
    assert err.startswith(f"numpy-attention {command}: ") and f"{command}: {command}:" not in err, err


@pytest.mark.parametrize("argv, prefix", [
    (["vanishing", "--json", "-", "--csv", "-"], "numpy-attention vanishing: --json and --csv"),
    (["vanishing", "--train", "--d-k", "4"], "numpy-attention vanishing: --d-k belongs"),
    (["vanishing", "--plot", "-"], "numpy-attention vanishing: --plot:"),
    (["crosscheck", "--write-example", "no-such-dir/x.npz"], "numpy-attention crosscheck: cannot write")])
def test_errors_raised_inside_a_command_get_its_prefix_once(argv, prefix, capsys):
    assert usage_error(argv, capsys).startswith(prefix)


def help_text(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_gradcheck_help_names_every_method_it_accepts(capsys):
    text = help_text(["gradcheck"], capsys)
    assert "by complex step" not in text                  # it was, while accepting --method central
    for method in METHODS:
        assert method in text
    assert "complex step (default)" in text and "Taylor test" in text


def test_crosscheck_help_lists_the_case_keys_and_the_exit_codes(capsys):
    from numpy_attention.oracle.schema import KEYS
    text = help_text(["crosscheck"], capsys)
    for key in KEYS:
        assert f" {key} " in text, key
    for code in ("0 every tensor passed", "1 a tensor failed", "2 bad input"):
        assert code in text


@pytest.mark.parametrize("option", ["--d-k", "--n-keys", "--trials", "--alpha-d-k", "--steps", "--lr",
                                    "--optimizer"])
def test_vanishing_help_gives_the_defaults_it_uses(option, capsys):
    from numpy_attention.commands.vanishing import SWEEP_OPTIONS, TRAINING_OPTIONS
    name = option[2:].replace("-", "_")
    default = {**SWEEP_OPTIONS, **TRAINING_OPTIONS}[name]
    shown = default if isinstance(default, (int, str)) else ",".join(f"{x:g}" for x in default)
    options = help_text(["vanishing"], capsys).split("options:", 1)[1]
    assert f"default {shown})" in options.split(f"{option} ", 1)[1].split(" --", 1)[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"numpy-attention {na.__version__}\n"


def usage_error(argv, capsys):
    """Run main(argv); assert exit 2, one line on stderr, no traceback; return that line."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["demo", "gradcheck", "vanishing"])
@pytest.mark.parametrize("seed", ["-1", "1.5", "x"])
def test_seed_must_be_a_non_negative_integer(command, seed, capsys):
    # default_rng(-1) raises ValueError: argparse must answer before the command runs
    assert "--seed" in usage_error([command, "--seed", seed], capsys)


def test_an_oserror_from_a_command_is_one_line_exit_2(monkeypatch, capsys):
    # the last safety net: a file that cannot be read or written is bad input, not a crash
    command = importlib.import_module("numpy_attention.commands.crosscheck")

    def unreadable(path):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(command, "load_case", unreadable)
    err = usage_error(["crosscheck", "case.npz"], capsys)
    assert "crosscheck" in err and "case.npz: Permission denied" in err


def test_a_closed_output_pipe_ends_quietly_with_141(monkeypatch, capsys):
    """`numpy-attention gradcheck | head -1`: when the reader closes the pipe, the command stops
    with the shell's 128 + SIGPIPE and no message (not exit 2 and "Broken pipe")."""
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

        def fileno(self):                       # main points it at the null device
            return self.fd

    closed = ClosedPipe()
    closed.fd = os.open(os.devnull, os.O_WRONLY)
    try:
        monkeypatch.setattr(sys, "stdout", closed)
        assert main(["gradcheck"]) == 141
    finally:
        monkeypatch.undo()
        os.close(closed.fd)
    assert capsys.readouterr().err == ""
