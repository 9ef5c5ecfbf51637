"""The pytest plugin (numpy_attention/commands/pytest_plugin.py, registered under pytest11):
`pytest --attention-kernel MODULE:FUNCTION` collects the grid's cases and the properties'
trials as items named by their ids; an honest kernel passes them, a faulty one fails with the
shrunk case, or with what its property found, in the message."""
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_pytest(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                           str(tmp_path), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_plugin_is_registered_with_pytest():
    assert "numpy_attention.commands.pytest_plugin" in [e.value for e in entry_points(group="pytest11")]


@pytest.mark.slow
def test_an_honest_kernel_passes_its_items(tmp_path):
    args = ["--attention-kernel", "numpy_attention.conformance.examples:numpy_float32", "--attention-dtypes",
            "float32", "--attention-options", "causal", "gradients", "--attention-properties", "honesty"]
    listed = run_pytest(tmp_path, "--collect-only", *args)
    names = [line for line in listed.stdout.splitlines() if "::conform[" in line]
    assert len(names) == 28 + 1 and "::conform[honesty-float32-plain-b1h2kv2-q17k32-d64-out+grad]" in names
    run = run_pytest(tmp_path, *args)
    assert run.returncode == 0 and "29 passed" in run.stdout, run.stdout + run.stderr


def test_a_faulty_kernel_fails_with_the_shrunk_case(tmp_path):
    run = run_pytest(tmp_path, "--attention-kernel", "conform_bugs:scale_off", "--attention-dtypes", "float32",
                     "--attention-options", "gradients", "--attention-properties", "none", "-x")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "shrunk in" in run.stdout and "to float32-plain-b1h1kv1-" in run.stdout
    assert "diagnosis: out matches scale 1.01" in run.stdout


def test_a_broken_property_fails_its_trial(tmp_path):
    run = run_pytest(tmp_path, "--attention-kernel", "property_bugs:noisy", "--attention-dtypes", "float32",
                     "--attention-properties", "determinism")
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout + run.stderr
    assert "FAIL determinism-float32-gqa-" in run.stdout and "between two calls on the same inputs" in run.stdout
    assert ", shrunk in " in run.stdout and " runs to float32-" in run.stdout


def test_a_kernel_that_cannot_be_loaded_is_a_usage_error(tmp_path):
    run = run_pytest(tmp_path, "--attention-kernel", "nope:x")
    assert run.returncode == 4                              # pytest's usage error
    assert "--attention-kernel nope:x: cannot import nope: ModuleNotFoundError" in run.stderr
    run = run_pytest(tmp_path, "--attention-kernel", "conform_bugs:scale_off", "--attention-properties", "lenghts")
    assert run.returncode == 4 and "--attention-properties has the unknown name 'lenghts'" in run.stderr
