"""benchmarks/bench_blas_kernels.py's bookkeeping: which configurations it runs, and how it
compares a configuration's reports with the default's (no child process, no timing)."""
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_blas_kernels as bench  # noqa: E402


def test_configurations_one_name_per_other_kernel():
    found = [(None, "Haswell", ""), ("SkylakeX", None, "killed by SIGILL"), ("Zen", "Haswell", ""),
             ("Excavator", "Sandybridge", ""), ("Sandybridge", "Sandybridge", ""), ("Prescott", "Katmai", "")]
    names = [name for name, threads, workers in bench.configurations(found) if (threads, workers) == (1, 1)]
    assert names == [None, "Sandybridge", "Prescott"]          # its own name first, else the first
    assert len(bench.configurations(found)) == 3 * 4


def test_compare_counts_flipped_verdicts_and_relative_differences():
    row = {"name": "out", "passed": True, "baseline_err": 1e-3, "max_abs_err": 5e-4, "bound": 2e-3,
           "atol": 1e-6}
    default = {"a": {"tensors": [row, {**row, "name": "dq"}]}}
    same = bench.compare(default, default)
    assert same == (0, 2, 0.0, "-")
    moved = {"a": {"tensors": [row, {**row, "name": "dq", "passed": False, "bound": 2.2e-3}]}}
    differ, total, largest, where = bench.compare(moved, default)
    assert (differ, total, where) == (1, 2, "a dq bound")
    assert math.isclose(largest, 0.2e-3 / 2.2e-3)


def test_relative_of_json_figures():
    assert bench.relative(None, None) == 0.0 and bench.relative("inf", "inf") == 0.0    # NaN, inf in JSON
    assert bench.relative(None, 1.0) == math.inf
    assert bench.relative(0.0, 0.0) == 0.0 and bench.relative(2.0, 1.0) == 0.5
