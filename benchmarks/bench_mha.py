"""Forward + backward of MultiHeadAttention: ours against PyTorch CPU autograd, one run.

    python3 benchmarks/bench_mha.py [--rounds 4] [--no-memory] [--dtypes float64 float32]
                                    [--numpy-hugepages on|off]

For each (B, N, d_model, heads) and dtype: the median time of one forward + backward
(inputs query, key, value distinct; random upstream gradient) in steady state, ours, plain
numpy's (below) and torch's each timed alone in its own process, the processes alternating
(_common.median_times_apart), its % of numpy's own matmul GFLOP/s measured in the same run,
the time ratio torch / ours (> 1: ours is faster), and the peak RSS of a child process that
runs one forward + backward. torch runs the seed's class with the same weights and thread
count.

The floor: "matmuls" times the step's 18 matrix products by themselves, as numpy runs them
(the same shapes, every head in one batched call, outputs allocated once); "softmax" the
fewest element-wise passes the softmax and its backward need over the scores [B, H, N, N],
by themselves (forward: max, subtract, exp, sum, divide; backward: rowsum(dP * P),
subtract, multiply; in place, on the blocked engine's blocks of rows and its threads). No
copies, no allocation, nothing else: about the least any numpy implementation of the step
can take on this machine, since numpy runs one ufunc at a time. "floor % peak" is the most
such an implementation can reach, and "torch/floor" the largest torch/ours it can show here.

"same bits" times the same products under the rule that gives the same bits for every worker
count (engines/parallel.py): each on one BLAS thread, shared over the threads workers=None
gives the module (the projections' for theirs, the attention's for its own), in the groups of
products that do not need each other (the step's three input projections at once, say), cut
as the library cuts them (the projections' blocks of rows, heads for the attention's). The
time includes handing the products to the threads, as any threaded numpy step must: about
the least a step that keeps the rule can take for its products alone, and "torch/same bits"
(torch over same bits plus softmax) about the largest torch/ours such a step can show here.

"plain" is the same step written plainly in numpy (plain_step): the textbook formulas on
whole arrays in about the fewest numpy calls, products on BLAS's threads, no checks, no
copies kept for the backward. Timed like ours, it is what numpy itself takes for the step,
its per-call costs included, which the floor leaves out. At the smallest shape they are most
of the step, and plain numpy is then close to the least a numpy step takes: "torch/plain"
is about the largest torch/ours one can show there.

FLOPs counted (matmuls only): forward 8 B N D^2 (four projections) + 4 B N^2 D
(q k^T and P v); backward twice that.
"""
import argparse
import importlib.util
import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]         # the package; tests/seed_model.py
from benchmarks._common import (OtherLoad, machine_line, matmul_gflops, median_time,  # noqa: E402
                                median_times_apart, run_child, set_numpy_hugepages, softmax_passes, table)
from numpy_attention import MultiHeadAttention  # noqa: E402
from numpy_attention.engines import projections  # noqa: E402
from numpy_attention.engines.parallel import blas_on_one_thread, run_tasks  # noqa: E402
from numpy_attention.engines.plan import resolve_workers  # noqa: E402

SHAPES = [(2, 10, 512, 8), (4, 256, 512, 8), (2, 1024, 512, 8), (1, 2048, 512, 8)]


def flops(B, N, D):
    return 3 * (8 * B * N * D * D + 4 * B * N * N * D)


def fresh_memory_ms_per_mib(mib=8, arrays=8, repeats=5):
    """ms per MiB to fill arrays that are new to the process (their pages first touched, so the
    kernel maps and zeroes them) minus the same fill into arrays it already has."""
    n = mib * 2 ** 20 // 8
    kept = [np.empty(n) for _ in range(arrays)]

    def fresh():
        return [np.ones(n) for _ in range(arrays)]     # all alive at once: freed together after

    def reused():
        for x in kept:
            x.fill(1.0)
    return (median_time(fresh, repeats) - median_time(reused, repeats)) * 1e3 / (mib * arrays)


def make_inputs(B, N, D, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, N, D)).astype(dtype) for _ in range(4)]   # query, key, value, dout


def step_products(B, N, D, H, dtype):
    """The step's 18 matrix products as (a, b, out) triples, out = a @ b, in groups of products
    that do not need each other, in the step's order (inputs random, outputs allocated once)."""
    rng = np.random.default_rng(0)
    d = D // H
    draw = lambda *shape: rng.standard_normal(shape).astype(dtype)
    T = lambda a: np.swapaxes(a, -1, -2)
    x, W = [draw(B * N, D) for _ in range(4)], [draw(D, D) for _ in range(4)]    # inputs, weights
    q, k, v, dout = (draw(B * H, N, d) for _ in range(4))                          # heads
    y, dx = [np.empty((B * N, D), dtype) for _ in range(4)], [np.empty((B * N, D), dtype) for _ in range(4)]
    dW = [np.empty((D, D), dtype) for _ in range(4)]
    S, dP = np.empty((B * H, N, N), dtype), np.empty((B * H, N, N), dtype)
    o, dq, dkT, dvT = (np.empty(shape, dtype) for shape in [(B * H, N, d)] * 2 + [(B * H, d, N)] * 2)
    return [[(x[i], W[i], y[i]) for i in range(3)],                    # Q, K, V = x W
            [(q, T(k), S)],                                            # S = q k^T
            [(S, v, o)],                                               # out = P v
            [(x[3], W[3], y[3])],                                      # output projection
            [(y[3], W[3].T, dx[3])],                                   # its dx = dy W^T
            [(T(dout), S, dvT), (dout, T(v), dP)],                     # dv^T = dout^T P, dP = dout v^T
            [(dP, k, dq), (T(q), dP, dkT)],                            # dq = dS k, dk^T = q^T dS
            [(x[3].T, y[3], dW[3])] + [product for i in range(3) for product in   # its dW = x^T dy,
                                       ((x[i].T, y[i], dW[i]), (y[i], W[i].T, dx[i]))]]   # the inputs'


def matmuls_alone(B, N, D, H, dtype):
    """The step's matrix products by themselves, one after another as numpy runs them (see the
    module docstring): a callable."""
    products = [product for group in step_products(B, N, D, H, dtype) for product in group]

    def step():
        for a, b, out in products:
            np.matmul(a, b, out=out)
    return step


def matmuls_same_bits(B, N, D, H, dtype):
    """The step's matrix products under the rule that gives the same bits for every worker
    count (see the module docstring): a callable."""
    scores = B * H * N * N
    projection_workers = resolve_workers(None, "blocked", scores, 4 * B * N * D * D)
    attention_workers = resolve_workers(None, "blocked", scores)
    groups = []
    for group in step_products(B, N, D, H, dtype):
        projecting = group[0][0].ndim == 2        # [B N, D] operands; the attention's are [B H, N, d]
        workers, tasks = projection_workers if projecting else attention_workers, []
        for a, b, out in group:
            if projecting:                        # the projections' blocks of rows
                blocks = projections._blocks(a.shape[0], a.shape[1] * b.shape[1])
                tasks += [(a[rows], b, out[rows]) for rows in blocks]
            else:                                 # heads, shared evenly
                edges = [len(a) * i // workers for i in range(workers + 1)]
                tasks += [(a[i:j], b[i:j], out[i:j]) for i, j in zip(edges, edges[1:])]
        groups.append((tasks, workers))

    def step():
        with blas_on_one_thread():
            for tasks, workers in groups:
                run_tasks(_matmul, tasks, workers)
    return step


def _matmul(a, b, out):
    np.matmul(a, b, out=out)


def softmax_alone(B, N, D, H, dtype):
    """The fewest element-wise passes of the step's softmax and its backward, by themselves
    (see the module docstring; _common.softmax_passes): a callable, on the threads workers=None
    gives the attention."""
    shape = (B, H, N, N)
    return softmax_passes(shape, dtype, resolve_workers(None, "blocked", math.prod(shape)))


def ours_step(B, N, D, H, dtype):
    mha = MultiHeadAttention(D, H, seed=0, dtype=dtype)
    query, key, value, dout = make_inputs(B, N, D, dtype)

    def step():
        mha(query, key, value)
        return mha.backward(dout)
    return mha, step


def plain_step(B, N, D, H, dtype):
    """The same step written plainly in numpy, in about the fewest calls: whole arrays, products
    on BLAS's threads, no checks, no copies kept for the backward, no threads of its own."""
    mha, _ = ours_step(B, 1, D, H, dtype)
    W = {n: mha.params[f"W_{n}.weight"].T for n in "qkvo"}                      # math layout
    b = {n: mha.params[f"W_{n}.bias"] for n in "qkvo"}
    query, key, value, dout = (a.reshape(B * N, D) for a in make_inputs(B, N, D, dtype))
    x, dy = {"q": query, "k": key, "v": value}, dout
    d, scale = D // H, np.dtype(dtype).type(1 / math.sqrt(D // H))
    split = lambda a: a.reshape(B, N, H, d).transpose(0, 2, 1, 3)            # [B, H, N, d], a view
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B * N, D)               # [B N, D]
    T = lambda a: np.swapaxes(a, -1, -2)

    def step():
        q, k, v = (split(x[n] @ W[n] + b[n]) for n in "qkv")
        S = (q @ T(k)) * scale
        P = np.exp(S - S.max(axis=-1, keepdims=True))
        P /= P.sum(axis=-1, keepdims=True)
        concat = merge(P @ v)
        out = concat @ W["o"] + b["o"]
        grads = {"W_o": concat.T @ dy, "b_o": dy.sum(axis=0)}
        do = split(dy @ W["o"].T)
        dP = do @ T(v)
        dS = P * (dP - (dP * P).sum(axis=-1, keepdims=True))
        for n, g in (("q", (dS @ k) * scale), ("k", (T(dS) @ q) * scale), ("v", T(P) @ do)):
            g = merge(g)
            grads[n], grads["W_" + n], grads["b_" + n] = g @ W[n].T, x[n].T @ g, g.sum(axis=0)
        return out, P, grads
    return step


def torch_step(B, N, D, H, dtype, threads):
    import torch
    torch.set_num_threads(threads)
    mha, _ = ours_step(B, 1, D, H, dtype)
    from seed_model import SeedMultiHeadAttention
    model = SeedMultiHeadAttention(D, H).to(getattr(torch, np.dtype(dtype).name))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in mha.state_dict().items()})
    query, key, value, dout = (torch.from_numpy(x) for x in make_inputs(B, N, D, dtype))
    for x in (query, key, value):
        x.requires_grad_(True)

    def step():
        for p in [query, key, value, *model.parameters()]:
            p.grad = None
        out, _ = model(query, key, value)
        out.backward(dout)
    return step


def step_code(which, B, N, D, H, dtype, threads, hugepages):
    """A snippet that defines step(): one forward + backward of `which` ('ours', 'plain' or
    'torch')."""
    return (f"import numpy as np\nfrom benchmarks._common import set_numpy_hugepages\n"
            f"set_numpy_hugepages({hugepages})\nfrom benchmarks.bench_mha import {which}_step\n"
            f"step = {which}_step({B}, {N}, {D}, {H}, np.{dtype}"
            + {"torch": f", {threads})\n", "plain": ")\n", "ours": ")[1]\n"}[which])


def memory(*step_args):
    """Peak RSS (MiB) of a fresh process that runs one forward + backward."""
    return run_child(step_code(*step_args) + "step()\n")[0]


def blas_threads():
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return os.cpu_count()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4,
                    help="fresh processes per contender, 3 timed calls each")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory columns")
    ap.add_argument("--dtypes", nargs="+", default=["float64", "float32"], help="default float64 float32")
    ap.add_argument("--shapes", type=int, nargs="+",
                    help="indices of the (B, N, D, H) to run, default all: "
                         + ", ".join(f"{i} = {s}" for i, s in enumerate(SHAPES)))
    ap.add_argument("--numpy-hugepages", choices=("on", "off"), default="on",
                    help="numpy's madvise of huge pages for large arrays (default on, numpy's own "
                         "default; see _common.set_numpy_hugepages)")
    args = ap.parse_args()
    load = OtherLoad()
    on = args.numpy_hugepages == "on"
    hugepages = set_numpy_hugepages(on)
    have_torch = importlib.util.find_spec("torch") is not None   # torch runs in child processes only
    threads = blas_threads()
    print(machine_line() + f"\nthreads: {threads} for numpy's BLAS and for torch; {hugepages}")
    print(f"fresh memory: {fresh_memory_ms_per_mib():.2f} ms per MiB to first touch (on top of writing it); "
          f"each timed process first frees a 16 MiB array (_common.SETTLE_ALLOCATOR)")
    for dtype in args.dtypes:
        peak = matmul_gflops(np.dtype(dtype))
        print(f"\n{dtype}: numpy matmul peak (2048^3) {peak:.1f} GFLOP/s")
        rows = []
        for idx in args.shapes or range(len(SHAPES)):
            B, N, D, H = SHAPES[idx]
            contenders = ["ours", "plain", "torch"] if have_torch else ["ours", "plain"]
            codes = [step_code(which, B, N, D, H, dtype, threads, on) for which in contenders]
            times = median_times_apart(codes, args.rounds)
            t_ours, t_plain, t_torch = times[0], times[1], times[2] if have_torch else None
            # the floors: up to 25 calls a round, at most half a second each round; the products on
            # BLAS's threads last, since its idle threads then spin on the cores for about 0.1 s
            floor_time = lambda fn: median_time(fn, repeats=25 * args.rounds, budget=0.5 * args.rounds)
            t_same_bits = floor_time(matmuls_same_bits(B, N, D, H, dtype))
            t_softmax = floor_time(softmax_alone(B, N, D, H, dtype))
            t_matmuls = floor_time(matmuls_alone(B, N, D, H, dtype))
            t_floor = t_matmuls + t_softmax
            percent = lambda t: f"{100 * flops(B, N, D) / t / 1e9 / peak:.0f}%"     # of the matmul peak
            row = [f"({B},{N},{D},{H})", f"{t_ours * 1e3:.2f}", percent(t_ours), f"{t_plain * 1e3:.2f}",
                   f"{t_matmuls * 1e3:.2f}", f"{t_same_bits * 1e3:.2f}", f"{t_softmax * 1e3:.2f}",
                   percent(t_floor)]
            row += ([f"{t_torch * 1e3:.2f}", f"{t_torch / t_ours:.2f}x", f"{t_torch / t_plain:.2f}x",
                     f"{t_torch / t_floor:.2f}x", f"{t_torch / (t_same_bits + t_softmax):.2f}x"]
                    if have_torch else ["-"] * 5)
            if not args.no_memory:
                row.append(f"{memory('ours', B, N, D, H, dtype, threads, on):.0f}")
                row.append(f"{memory('torch', B, N, D, H, dtype, threads, on):.0f}" if have_torch else "-")
            rows.append(row)
        header = ["(B,N,D,H)", "ours ms", "% peak", "plain ms", "matmuls ms", "same bits ms", "softmax ms",
                  "floor % peak", "torch ms", "torch/ours", "torch/plain", "torch/floor", "torch/same bits"]
        header += [] if args.no_memory else ["ours MiB", "torch MiB"]
        print(table(header, rows))
    print("\n" + load.line())


if __name__ == "__main__":
    main()
