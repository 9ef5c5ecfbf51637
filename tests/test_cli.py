"""The numpy-attention command: demo, gradcheck, and its answers to bad arguments."""
import subprocess
import sys

import pytest

from numpy_attention.cli import main


def test_demo_prints_the_seeds_output_and_passes(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "input shape:             (2, 10, 512)" in out
    assert "output shape:            (2, 10, 512)" in out
    assert "attention weights shape: (2, 8, 10, 10)" in out
    assert "1.0000000000000" in out
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
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "numpy-attention" in err and "Traceback" not in err
