"""The JVP of attention on the tiled engine: time and peak memory against N, next to the
textbook's materialized JVP where its [H, N, N] arrays fit.

    python3 benchmarks/bench_jvp.py [--n 1024,2048,8192] [--repeats 3]

Causal, B=1, H=8, d_k=64, float64, tiles of 256. Each configuration runs in a fresh
process that reports its own peak resident set size (VmHWM); times are the median of
--repeats calls after an untimed one. The machine is named in the header line.
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine_line  # noqa: E402

CHILD = """
import json, statistics, time
import numpy as np, numpy_attention as na
n, implementation, repeats = {n}, {implementation!r}, {repeats}
rng = np.random.default_rng(0)
q, k, v, qd, kd, vd = (rng.standard_normal((1, 8, n, 64)) for _ in range(6))
extra = dict(implementation="tiled", block_size=256) if implementation == "tiled" else {{}}
call = lambda: na.attention_jvp(q, k, v, qd, kd, vd, causal=True, **extra)
call()
times = []
for _ in range(repeats):
    start = time.perf_counter(); call(); times.append(time.perf_counter() - start)
peak = int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024
print(json.dumps({{"seconds": statistics.median(times), "peak_mib": peak}}))
"""


def machine():
    """The header line (benchmarks/_common.py): CPU model, cores, Python, numpy and its BLAS, torch."""
    return machine_line()


def run(n, implementation, repeats):
    code = CHILD.format(n=n, implementation=implementation, repeats=repeats)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="1024,2048,8192", help="sequence lengths (default 1024,2048,8192)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per configuration (default 3)")
    args = parser.parse_args()
    print(f"# {machine()}")
    print(f"{'N':>6} {'textbook s':>11} {'peak MiB':>9} {'tiled s':>8} {'peak MiB':>9}")
    for n in (int(x) for x in args.n.split(",")):
        fits = 8 * n * n * 8 * 6 < 4 << 30                   # the textbook's [8, N, N] float64 stages
        textbook = run(n, "textbook", args.repeats) if fits else None
        tiled = run(n, "tiled", args.repeats)
        cells = (f"{textbook['seconds']:>11.2f} {textbook['peak_mib']:>9.0f}" if textbook else f"{'-':>11} {'-':>9}")
        print(f"{n:>6} {cells} {tiled['seconds']:>8.2f} {tiled['peak_mib']:>9.0f}")


if __name__ == "__main__":
    main()
