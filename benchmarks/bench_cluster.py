"""The tiled engine on a Dask cluster against the same engine here: time against N, whether
the bits agree, and the cost model of a long-context oracle.

    python3 benchmarks/bench_cluster.py [--lengths 4096 8192 16384 32768] [--heads 8] [--d 64]
                                        [--workers 2] [--scheduler ADDRESS]

Causal attention [1, H, N, d] in float64, forward + backward (what crosscheck's oracle
computes for a large case), once here (the engine's default threads) and once on the
cluster: a LocalCluster of --workers processes of one thread each, started by the script,
or the running scheduler at --scheduler. One call each, alternating: "cluster / here" is
the overhead of shipping the slices on this machine, where both use the same cores.

The cost model: the tiled engine's work grows as H * N^2 * d (causal: half of the N^2
scores), so the largest measured time t scales to a case (H', N', d') as
t * (H'/H) * (N'/N)^2 * (d'/d) on the same cores, divided among the machines a cluster adds.
Printed for (1, 32, 131072, 128), extrapolated, not measured. --crosscheck also times
crosscheck on a causal bfloat16 case here and on the cluster, and compares the reports.
"""
import argparse
import os
import sys
import time

import numpy as np

import numpy_attention as na

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, table  # noqa: E402

TARGET = (32, 131072, 128)          # (H, N, d) of the long-context case the model extrapolates to


def step(q, k, v, dout, scheduler):
    """(seconds, results) of one causal tiled forward + backward, here or on the cluster."""
    start = time.perf_counter()
    out, cache = na.attention_forward(q, k, v, causal=True, implementation="tiled", scheduler=scheduler)
    grads = na.attention_backward(dout, cache)
    return time.perf_counter() - start, (out, cache.lse, grads.dq, grads.dk, grads.dv)


def crosscheck_case(heads, n, d):
    """A causal bfloat16 case with gradients [1, heads, n, d], the candidate our float64
    attention rounded to bfloat16 (float32 lse)."""
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, heads, n, d)).astype(bf16) for _ in range(4))
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    out, cache = na.attention_forward(*wide[:3], causal=True, implementation="tiled")
    g = na.attention_backward(wide[3], cache)
    return dict(q=q, k=k, v=v, dout=dout, causal=True, out=out.astype(bf16), lse=cache.lse.astype(np.float32),
                dq=g.dq.astype(bf16), dk=g.dk.astype(bf16), dv=g.dv.astype(bf16))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the LocalCluster")
    parser.add_argument("--scheduler", default=None, help="a running scheduler's address instead")
    parser.add_argument("--crosscheck", type=int, nargs="*", default=[8192], metavar="N",
                        help="also time crosscheck of a causal bfloat16 case [1, 4, N, 64] with "
                             "gradients here and on the cluster (default 8192; none: skip)")
    args = parser.parse_args()
    from distributed import Client, LocalCluster
    load = OtherLoad()
    print(machine_line())
    if args.scheduler is None:
        cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                               dashboard_address=None)
        where = f"a LocalCluster of {args.workers} processes x 1 thread"
    else:
        cluster, where = args.scheduler, f"the scheduler at {args.scheduler}"
    with Client(cluster) as client:
        print(f"\ncausal tiled attention [1, {args.heads}, N, {args.d}], float64, forward + backward; "
              f"here: the engine's default threads ({os.cpu_count()} cores); cluster: {where}")
        rows, largest = [], None
        for n in args.lengths:
            rng = np.random.default_rng(0)
            q, k, v, dout = (rng.standard_normal((1, args.heads, n, args.d)) for _ in range(4))
            here, local = step(q, k, v, dout, None)
            there, remote = step(q, k, v, dout, client)
            same = all(np.array_equal(a, b) for a, b in zip(local, remote))
            rows.append([n, f"{here:.2f}", f"{there:.2f}", f"{there / here:.2f}", "yes" if same else "NO"])
            largest = (n, here, there)
        print(table(["N", "here s", "cluster s", "cluster / here", "same bits"], rows))
        if args.crosscheck:
            print("\ncrosscheck of a causal bfloat16 case [1, 4, N, 64] with gradients (oracle, "
                  "baselines, scale check); the same report?")
            rows = []
            for n in args.crosscheck:
                arrays = crosscheck_case(4, n, 64)
                start = time.perf_counter()
                local = na.crosscheck(**arrays)
                here = time.perf_counter() - start
                start = time.perf_counter()
                remote = na.crosscheck(**arrays, scheduler=client)
                there = time.perf_counter() - start
                same = "yes" if remote.to_json() == local.to_json() else "NO"
                rows.append([n, f"{here:.2f}", f"{there:.2f}", f"{there / here:.2f}", same,
                             "PASS" if local else "FAIL"])
            print(table(["N", "here s", "cluster s", "cluster / here", "same report", "verdict"], rows))
    if args.scheduler is None:
        cluster.close()
    n, here, there = largest
    h, n_target, d = TARGET
    factor = (h / args.heads) * (n_target / n) ** 2 * (d / args.d)
    print(f"\nextrapolated (not measured) to [1, {h}, {n_target}, {d}]: x{factor:,.0f} the work of N = {n}: "
          f"{here * factor / 3600:.1f} h here, {there * factor / 3600:.1f} h on this cluster; "
          f"on M such machines about 1/M of it")
    print("\n" + load.line())


if __name__ == "__main__":
    main()
