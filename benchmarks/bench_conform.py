"""What a conformance run's worker process costs: a Python kernel's whole grid in the worker
(isolate=True, the default) and in this process (isolate=False).

    python3 benchmarks/bench_conform.py [--kernel numpy_float32] [--dtypes float32]
                                        [--options causal gradients] [--rounds 3]

The kernel is one of numpy_attention/conformance/examples.py. Each round runs na.conform on
the whole grid both ways, alternating (the machine is shared and noisy), and starts a worker
alone (a fresh Python, this package, the kernel loaded; the kernel's own imports, torch or
JAX, come with its first case). Printed: the median of each, and the difference per case,
what the worker adds to a case (the arrays and results through its socket).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, table  # noqa: E402

import numpy_attention as na  # noqa: E402
from numpy_attention.conformance import as_kernel, examples  # noqa: E402
from numpy_attention.conformance.worker import Worker  # noqa: E402


def seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def start_worker(kernel):
    """Start a worker with the kernel loaded, and stop it."""
    with Worker(as_kernel(kernel), None):
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default="numpy_float32", help="a kernel of conformance/examples.py")
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--options", nargs="+", default=["causal", "gradients"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    kernel = getattr(examples, args.kernel)
    load = OtherLoad()
    run = lambda isolate: na.conform(kernel, dtypes=args.dtypes, supports=args.options, isolate=isolate,
                                     progress=False)
    cases = len(run(False).results)                       # and a warm-up of this process
    times = {True: [], False: [], "start": []}
    for _ in range(args.rounds):
        for isolate in (True, False):
            times[isolate].append(seconds(lambda: run(isolate)))
        times["start"].append(seconds(lambda: start_worker(kernel)))
    worker, here, start = (statistics.median(times[key]) for key in (True, False, "start"))
    print(machine_line())
    print(f"{args.kernel}, {' '.join(args.dtypes)}, {' '.join(args.options)}: {cases} cases, "
          f"median of {args.rounds} rounds")
    print(table(["run", "seconds", "per case"],
                [["in a worker (isolate=True)", f"{worker:.1f}", f"{worker / cases * 1e3:.0f} ms"],
                 ["in this process (isolate=False)", f"{here:.1f}", f"{here / cases * 1e3:.0f} ms"],
                 ["the worker's start", f"{start:.2f}", ""],
                 ["worker - this process, per case", "", f"{(worker - here - start) / cases * 1e3:.0f} ms"]]))
    print(load.line())


if __name__ == "__main__":
    main()
