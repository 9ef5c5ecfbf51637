"""The numpy-attention command: demo, gradcheck, and its answers to bad arguments."""
import importlib
import re
import subprocess
import sys

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.cli import main


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


def test_gradcheck_command_checks_every_op(capsys):
    assert main(["gradcheck"]) == 0
    out = capsys.readouterr().out
    for name in ("linear", "softmax", "split_heads", "merge_heads", "causal bottom_right",
                 "GQA", "window", "softcap", "dropout", "multihead"):
        assert f"== {name}" in out
    assert out.count("-> PASS") >= 15 and "FAIL" not in out


def test_python_dash_m_is_the_same_command():
    run = subprocess.run([sys.executable, "-m", "numpy_attention", "demo"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "ALL GRADIENT CHECKS PASSED" in run.stdout


@pytest.mark.parametrize("argv", [[], ["nonsense"], ["demo", "--seed", "x"], ["gradcheck", "--method", "exact"]])
def test_bad_arguments_one_line_exit_2(argv, capsys):
    assert "numpy-attention" in usage_error(argv, capsys)


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
    command = importlib.import_module("numpy_attention.crosscheck.command")    # na.crosscheck is a function

    def unreadable(path):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(command, "load_case", unreadable)
    err = usage_error(["crosscheck", "case.npz"], capsys)
    assert "crosscheck" in err and "case.npz: Permission denied" in err
