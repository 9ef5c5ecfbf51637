"""How long `numpy-attention crosscheck` takes to refuse a file from a stranger, and what of that
time is the interpreter importing numpy, scipy and ml_dtypes: median wall time of fresh
processes over the hostile files of tests/test_hostile_files.py.

    python3 benchmarks/bench_refusals.py [--repeats 5]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, table  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

IMPORTS = {"python alone": "pass", "import numpy": "import numpy",
           "import numpy, scipy.sparse, ml_dtypes": "import numpy, scipy.sparse, ml_dtypes"}


def wall(argv, repeats):
    """Median wall time of running argv `repeats` times (each a fresh process)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of each (default 5)")
    args = parser.parse_args()
    from test_hostile_files import KINDS, _hostile
    load = OtherLoad()
    print(f"# {machine_line()}")
    rows = [[name, f"{wall([sys.executable, '-c', code], args.repeats):.2f}"] for name, code in IMPORTS.items()]
    with tempfile.TemporaryDirectory() as directory:
        for kind in KINDS:
            path = _hostile(kind, Path(directory))
            argv = [sys.executable, "-m", "numpy_attention", "crosscheck", str(path)]
            rows.append([f"crosscheck refuses: {kind}", f"{wall(argv, args.repeats):.2f}"])
    print(table(["command", "median s"], rows))
    print(load.line())


if __name__ == "__main__":
    main()
