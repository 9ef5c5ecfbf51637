"""Helpers shared by the benchmark scripts: timing, matmul peak, peak memory, environment.

Timing: the median of repeats; contenders from different libraries each timed alone in
its own process, the processes alternating (the machine is shared and noisy); compare
ratios measured in the same run, not absolute times across runs.
Peak memory: each configuration runs in a fresh child process that reports its own peak
resident set size (VmHWM), so one configuration's peak cannot hide another's.
"""
import importlib.metadata
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

from numpy_attention.engines.blocked import row_blocks
from numpy_attention.engines.parallel import run_tasks

BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OPENBLAS_THREAD_TIMEOUT",
            "OMP_NUM_THREADS")


def median_time(fn, repeats=5, budget=20.0):
    """Median wall time of fn() over `repeats` runs (fewer if one run exceeds budget / repeats)."""
    fn()                                                 # warm-up (allocator, BLAS threads)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if sum(times) > budget and len(times) >= 3:
            break
    return statistics.median(times)


def median_times_apart(codes, rounds=4, calls=3, warmups=2, failures=False):
    """Median wall time of each contender's step(), each one timed alone in its own process.

    `codes` are Python snippets that each define step(). Per round, every contender runs in
    a fresh interpreter (allocator settled: SETTLE_ALLOCATOR): `warmups` untimed calls (BLAS
    threads, caches), then `calls` timed
    ones; the rounds alternate the contenders, spreading a shared machine's noise over all
    alike. Alone, because two libraries in one process slow each other: after a call each
    one's idle threads keep spinning on the cores (OpenMP's for up to 200 ms, OpenBLAS's
    too), so whoever runs next is measured against them. Timed in one process, torch's
    step at the seed's shape varied 2.5x from run to run (and favoured us); alone, +-20%.
    failures: a contender whose child fails (ChildFailed) runs no more, and its entry is the
    failure's one-line reason (a str) instead of a time; False: the failure is raised.
    """
    times = [[] for _ in codes]
    for _ in range(rounds):
        for i, code in enumerate(codes):
            if isinstance(times[i], str):
                continue
            try:
                times[i] += child_times(code, calls, warmups)
            except ChildFailed as failure:
                if not failures:
                    raise
                times[i] = failure.reason
    return [ts if isinstance(ts, str) else statistics.median(ts) for ts in times]


# Run first in every timed child: numpy allocates and frees one 16 MiB array. glibc serves an
# array above its mmap threshold (128 KiB at start) with fresh pages from the kernel, zeroed on
# first touch, and raises the threshold to the size of any such array freed (up to 32 MiB). A
# long-running process has long since freed a large array, so arrays up to that size then come
# from memory it already has; a fresh one pays first-touch faults on every step until some
# step frees one. Which one happens first depends on each library's allocations (here, at the
# blog's shape, a step of ours took 4.7 ms or 3.2 ms, torch's float64 step 4.6 ms or 3.2 ms),
# so every contender starts from the long-running state.
SETTLE_ALLOCATOR = "import numpy\nnumpy.ones(2 << 20)\n"


def child_times(code, calls, warmups=2):
    """The wall times of `calls` calls of the step() that `code` defines, in a fresh
    interpreter (its allocator settled first: SETTLE_ALLOCATOR), after `warmups` untimed calls."""
    code = SETTLE_ALLOCATOR + code
    timing = (f"\nimport time\nfor _ in range({warmups}):\n    step()\nfor _ in range({calls}):\n"
              f"    t0 = time.perf_counter()\n    step()\n    print('TIME', time.perf_counter() - t0)\n")
    out = run_child(code + timing)[1]
    return [float(line.split()[1]) for line in out.splitlines() if line.startswith("TIME")]


def matmul_gflops(dtype, n=2048, repeats=5):
    """The machine's ceiling: GFLOP/s of one n x n matmul in numpy, `dtype`."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    return 2 * n ** 3 / median_time(lambda: a @ b, repeats) / 1e9


def softmax_passes(shape, dtype, workers, fresh_p=False):
    """The fewest element-wise passes of attention's softmax and its backward over scores of
    `shape` [B, H, N_q, N_k], by themselves: a callable. Forward max, subtract, exp, sum,
    divide; backward rowsum(dP * P), subtract, multiply; in place, on the blocked engine's
    blocks of rows, on `workers` threads (engines.parallel.run_tasks).

    fresh_p: P goes into a new array at every call, as in an engine that returns P (the
    kernel maps and zeroes its pages at their first touch, work that threads share less well
    than the passes); else into one array allocated once."""
    rng = np.random.default_rng(0)
    s, dp = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    p, ds = np.empty(shape, dtype), np.empty(shape, dtype)
    blocks = [(block + (slice(None),),) for block in row_blocks(shape, 1, p.itemsize)]

    def passes(index, p):
        s_, p_, dp_, ds_ = s[index], p[index], dp[index], ds[index]
        np.subtract(s_, s_.max(axis=-1, keepdims=True), out=p_)          # P = exp(S - max) / sum
        np.exp(p_, out=p_)
        p_ /= p_.sum(axis=-1, keepdims=True)
        np.subtract(dp_, np.einsum("...i,...i->...", dp_, p_)[..., None], out=ds_)   # dS = P (dP - rowsum(P dP))
        ds_ *= p_
    return lambda: run_tasks(passes, blocks, workers,
                             shared={"p": np.empty(shape, dtype) if fresh_p else p})


class ChildFailed(RuntimeError):
    """A child process that failed; .reason says why in one line: its error's last line, or
    the signal that killed it (SIGKILL: most likely the kernel's out-of-memory killer)."""

    def __init__(self, returncode, stderr):
        lines = stderr.strip().splitlines()
        if returncode < 0:
            name = signal.Signals(-returncode).name
            self.reason = f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
        else:
            self.reason = lines[-1] if lines else f"exit status {returncode}"
        super().__init__(f"child failed: {self.reason}\n{stderr[-2000:]}")


def run_child(code, env=None):
    """Run `code` (a Python snippet) in a fresh interpreter; return (peak RSS in MiB, stdout).
    env: environment variables for the child over this process's (a None value: unset).
    Raises ChildFailed if it fails."""
    probe = ("\nfor line in open('/proc/self/status'):\n"
             "    if line.startswith('VmHWM'):\n"
             "        print('VMHWM', int(line.split()[1]))\n")
    env = {name: value for name, value in {**os.environ, **(env or {})}.items() if value is not None}
    env["PYTHONPATH"] = os.pathsep.join([repo_root()] + sys.path)
    res = subprocess.run([sys.executable, "-c", code + probe], capture_output=True, text=True, env=env)
    if res.returncode:
        raise ChildFailed(res.returncode, res.stderr)
    kib = [int(l.split()[1]) for l in res.stdout.splitlines() if l.startswith("VMHWM")][0]
    return kib / 1024, res.stdout


def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine_line():
    """One line naming what made a table: CPU model, cores, Python, numpy (and its BLAS),
    torch (if installed; read from its metadata, not imported) and any BLAS variables."""
    cpu = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        numpy = f"numpy {np.__version__} ({blas['name']} {blas.get('version', '')})".replace(" )", ")")
    except (KeyError, TypeError):                        # an older numpy's show_config
        numpy = f"numpy {np.__version__}"
    try:
        torch = f"torch {importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        torch = "torch not installed"
    env = ", ".join(f"{k}={os.environ[k]}" for k in BLAS_ENV if k in os.environ) or "no BLAS env vars"
    return (f"machine: {cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, "
            f"{numpy}, {torch}; {env}")


def _cpu_seconds_busy():
    """CPU-seconds the whole machine has spent busy since boot (/proc/stat; steal included:
    time the hypervisor gave to other machines), or None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """How much CPU the rest of the machine used while a benchmark ran: the line it prints
    last, so that a table measured while other jobs competed for the cores says so.

        load = OtherLoad(); ...; print(load.line())
    Other = the machine's busy CPU-seconds minus this process's and its children's.
    """

    def __init__(self):
        self.busy, self.own, self.wall = _cpu_seconds_busy(), self._own(), time.perf_counter()

    @staticmethod
    def _own():
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def line(self):
        wall = time.perf_counter() - self.wall
        busy = _cpu_seconds_busy()
        if busy is None or self.busy is None:
            return f"other processes: not measured here (no /proc/stat); run took {wall:.0f} s"
        other = max(0.0, (busy - self.busy) - (self._own() - self.own))
        cores = os.cpu_count() or 1
        return (f"other processes used {other:.0f} CPU-s of the {wall * cores:.0f} available "
                f"({100 * other / (wall * cores):.0f}%) during this {wall:.0f} s run")


def set_numpy_hugepages(enabled):
    """Turn numpy's madvise(MADV_HUGEPAGE) on large arrays on or off; return a line saying so.

    numpy asks the kernel to back arrays of 4 MiB and more with transparent huge pages. Where
    the kernel's THP defrag setting is "madvise", every such page fault may compact memory
    synchronously: a large allocation then stalls, erratically (seen here: one forward +
    backward of MultiHeadAttention varying from 0.66 s to 1.9 s, the spread in system time).
    torch's CPU allocator asks for no huge pages. Uses numpy's private switch; a process-wide
    setting, so only the benchmarks touch it, never the library.
    """
    np._core.multiarray._set_madvise_hugepage(enabled)
    thp = {}
    for name in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                thp[name] = next(w[1:-1] for w in f.read().split() if w.startswith("["))
        except (OSError, StopIteration):
            thp[name] = "unknown"
    return (f"numpy huge pages {'on' if enabled else 'off'} "
            f"(kernel THP enabled={thp['enabled']}, defrag={thp['defrag']})")


def table(header, rows):
    """A plain-text table: header and rows of already formatted strings."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).rjust(w) for c, w in zip(r, widths))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])

