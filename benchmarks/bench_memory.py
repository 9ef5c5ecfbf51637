"""crosscheck's peak memory beside the estimate it refuses a case by (oracle/memory.py).

    python3 benchmarks/bench_memory.py [--deepseek]

Each case runs in a fresh child process: it makes the case (float32, or bfloat16, inputs, the
candidate's out, lse and gradients from our own float64 attention, or sparse attention for
top-k lists, rounded), resets its peak RSS (/proc/self/clear_refs), runs crosscheck on 2
threads, and reports the peak's growth over the RSS before the call (VmHWM), with the time.
The estimate is memory.peak_bytes for the case's arrays, scores and list entries on 2 threads:
it must not be below the growth. Top-k lists are judged from the lists (topk.py), never as a
dense keep-mask: their cases grow by about what the same scores without lists take (the
tiled oracle's tiles and the baselines' blocks of rows), plus the lists.
--deepseek adds DeepSeek Sparse Attention's size: N_q = N_k = 32768, K = 2048 keys a query,
one head of width 64 (2^30 scores; minutes).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, run_child, table  # noqa: E402

CHILD = """
import time
import ml_dtypes, numpy as np
import numpy_attention as na
from numpy_attention.oracle import memory
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
T = {{"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}}[{precision!r}]
rng = np.random.default_rng(0)
q, dout = (rng.standard_normal(({heads}, {n_q}, {d})).astype(T)[None] for _ in range(2))
k, v = (rng.standard_normal((1, {n_k}, {d})).astype(T)[None] for _ in range(2))
wide = [x.astype(np.float64) for x in (q, k, v, dout)]
case = {{}}
if {top}:
    limit = -(-{n_k} // {block}) if {block} else {n_k}
    lists = rng.integers(-1, limit, (1, 1, {n_q}, {top})).astype(np.int32)
    lists[..., 1] = lists[..., 0]                            # a key (or block) listed twice
    tokens = na.block_indices(lists, {block}, {n_k}) if {block} else lists
    case = {{"topk_indices": lists, **({{"topk_block_size": np.array({block})}} if {block} else {{}})}}
    out, lse, _, cache = na.sparse_attention_forward(*wide[:3], tokens)
    g = na.sparse_attention_backward(wide[3], cache)
else:
    case = {{"causal": np.array(True)}}
    out, cache = na.attention_forward(*wide[:3], causal=True, implementation="tiled")
    lse, g = cache.lse, na.attention_backward(wide[3], cache)
del cache
arrays = dict(q=q, k=k, v=v, dout=dout, out=out.astype(T), lse=lse.astype(np.float32), dq=g.dq.astype(T),
              dk=g.dk.astype(T), dv=g.dv.astype(T), **case)
entries = 0 if not {top} else lists.size * (min({block}, {n_k}) if {block} else 1)
estimate = memory.peak_bytes(sum(np.asarray(x).nbytes for x in arrays.values()), (1, {heads}, {n_q}, {n_k}),
                             entries, threads=2)[0]
open("/proc/self/clear_refs", "w").write("5")                # VmHWM from here on
before = status("VmRSS")
start = time.perf_counter()
report = na.crosscheck(**arrays, workers=2)
print("RESULT", "PASS" if report else "FAIL", entries, estimate, status("VmHWM") - before,
      time.perf_counter() - start)
"""

# (case, precision, heads, N_q, N_k, d, keys a query (0: causal, no lists), key block size (0: tokens))
CASES = [("causal, no lists", "float32", 1, 32768, 4096, 16, 0, 0),
         ("64 keys a row", "float32", 1, 32768, 4096, 16, 64, 0),
         ("1024 keys a row", "float32", 1, 32768, 4096, 16, 1024, 0),
         ("16 blocks of 64", "float32", 1, 32768, 4096, 16, 16, 64),
         ("16 blocks of 64", "bfloat16", 1, 32768, 4096, 16, 16, 64),
         ("64 keys a row", "float32", 4, 1024, 4096, 16, 64, 0)]
DEEPSEEK = [("2048 keys a row", "float32", 1, 32768, 32768, 64, 2048, 0)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepseek", action="store_true", help="add DeepSeek Sparse Attention's size (minutes)")
    args = parser.parse_args()
    load = OtherLoad()
    print(machine_line())
    rows = []
    for name, precision, heads, n_q, n_k, d, top, block in CASES + (DEEPSEEK if args.deepseek else []):
        _, out = run_child(CHILD.format(precision=precision, heads=heads, n_q=n_q, n_k=n_k, d=d, top=top,
                                        block=block))
        verdict, entries, estimate, grown, seconds = next(line.split()[1:] for line in out.splitlines()
                                                          if line.startswith("RESULT"))
        scores = heads * n_q * n_k
        rows.append([name, precision, f"{heads} x {n_q} x {n_k}", f"{int(entries):,}",
                     f"{int(estimate) / 2 ** 20:.0f}", f"{int(grown) / 2 ** 20:.0f}", f"{int(grown) / scores:.2f}",
                     f"{float(seconds):.0f}", verdict])
    print(table(["case", "precision", "H x N_q x N_k", "listed", "estimate MiB", "growth MiB", "B/score", "s",
                 "verdict"], rows))
    print("\n" + load.line())


if __name__ == "__main__":
    main()
