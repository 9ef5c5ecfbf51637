"""The three attention engines against N: time and peak memory of forward + backward.

    python3 benchmarks/bench_tiled.py [--lengths 1024 2048 8192 32768] [--block 256]
                                      [--engines textbook blocked tiled] [--max-gib 2]
                                      [--workers 1] [--causal-by option mask_mod]

Causal self-attention, 1 batch, 8 heads, d_k = 64, float64, forward + backward with a
random upstream gradient, for each engine of attention_forward(implementation=...):
'textbook' (whole arrays), 'blocked' (the default: blocks of query rows, P stored whole)
and 'tiled' (FlashAttention's online softmax, no [N, N] array). Every configuration
runs in a fresh child process that reports its time and its own peak RSS (VmHWM), so
one run's peak cannot hide another's. Time: the median of 3 calls after an untimed one
(a process's first large allocations can stall on huge-page compaction); a single call
where that call alone takes over 10 s. The textbook and blocked engines are skipped
where one [8, N, N] array alone would pass --max-gib (default 2 GiB; at N=8192 it is
4 GiB, and those engines hold several such arrays at once). --workers: the engines' threads
(default: theirs, every core from 2^19 scores on, plan.PARALLEL_SCORES). --causal-by: the
causal mask given as the option causal=True (default), as FlexAttention's
mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx (scores.py), or both, each way timed in
its own processes, with the ratios mask_mod / option of time and of peak memory.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, run_child, table  # noqa: E402

HEADS, D_K = 8, 64
ENGINES = ("textbook", "blocked", "tiled")

CHILD = """
import statistics, time, numpy as np
from numpy_attention import attention_forward, attention_backward
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, {h}, {n}, {d})) for _ in range(4))

def timed_step():
    t0 = time.perf_counter()
    out, cache = attention_forward(q, k, v, {causal}, implementation={engine!r}, block_size={block},
                                   workers={workers})
    attention_backward(dout, cache)
    return time.perf_counter() - t0

first = timed_step()
print('SECONDS', first if first > 10 else statistics.median(timed_step() for _ in range(3)))
"""


CAUSAL_BY = {"option": "causal=True", "mask_mod": "mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx"}


def run(n, engine, block, workers, causal_by="option"):
    """(seconds, peak MiB) of one causal forward + backward in a fresh process."""
    code = CHILD.format(h=HEADS, n=n, d=D_K, engine=engine, block=block if engine == "tiled" else None,
                        workers=None if engine == "textbook" else workers, causal=CAUSAL_BY[causal_by])
    mib, stdout = run_child(code)
    seconds = [float(line.split()[1]) for line in stdout.splitlines() if line.startswith("SECONDS")][0]
    return seconds, mib


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 32768],
                    help="sequence lengths N (default 1024 2048 4096 8192 32768)")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES),
                    help="engines to run (default all: textbook blocked tiled)")
    ap.add_argument("--block", type=int, default=256, help="the tiled engine's block_size (default 256)")
    ap.add_argument("--workers", type=int, default=None,
                    help="threads of the blocked and tiled engines (default: theirs)")
    ap.add_argument("--max-gib", type=float, default=2.0,
                    help="skip textbook and blocked where one [H, N, N] array exceeds this (default 2)")
    ap.add_argument("--causal-by", nargs="+", choices=list(CAUSAL_BY), default=["option"],
                    help="the causal mask as the option causal=True, as a mask_mod, or both (default option)")
    args = ap.parse_args()
    load = OtherLoad()
    print(machine_line())
    print(f"\ncausal attention, B=1, H={HEADS}, d_k={D_K}, float64, forward + backward; "
          f"seconds and peak MiB per engine (tiled block_size={args.block}; workers "
          f"{args.workers or 'the default'}; -: skipped, "
          f"one [H, N, N] array > {args.max_gib:g} GiB)")
    rows, both = [], len(args.causal_by) == 2
    for n in args.lengths:
        row = [n]
        for engine in args.engines:
            if engine != "tiled" and HEADS * n * n * 8 / 2 ** 30 > args.max_gib:
                row += ["-", "-"] * len(args.causal_by) + (["-", "-"] if both else [])
                continue
            runs = [run(n, engine, args.block, args.workers, way) for way in args.causal_by]
            row += [f"{x:.2f}" if i == 0 else f"{x:.0f}" for r in runs for i, x in enumerate(r)]
            if both:
                row += [f"{runs[1][0] / runs[0][0]:.2f}x", f"{runs[1][1] / runs[0][1]:.2f}x"]
        rows.append(row)
    label = lambda engine, way: engine if args.causal_by == ["option"] else f"{engine} {way}"
    header = ["N"] + [f"{label(engine, way)} {what}" for engine in args.engines
                      for way in args.causal_by + (["mask_mod/option"] if both else [])
                      for what in ("s", "MiB")]
    print(table(header, rows))
    print("\n" + load.line())


if __name__ == "__main__":
    main()
