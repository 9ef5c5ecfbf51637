"""Full-mode gradient checks: ours (looped and vectorized) against torch.autograd.gradcheck.

    python3 benchmarks/bench_gradcheck.py [--repeats 5]

The same function and shapes on both sides: causal scaled dot-product attention of
q, k, v [1, 2, 16, 8], float64, the whole Jacobian w.r.t. each of q, k, v by central
differences (torch: torch.nn.functional.scaled_dot_product_attention(is_causal=True)
under torch.autograd.gradcheck). Also projection mode of MultiHeadAttention at
d_model=512, which stays cheap at any size. Prints the median time, the verdict and the
ratio torch / ours (> 1: ours is faster).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import machine_line, median_time, table  # noqa: E402
from numpy_attention import attention_backward, attention_forward, gradcheck  # noqa: E402
from numpy_attention.demo import mha_functions  # noqa: E402
from numpy_attention import MultiHeadAttention  # noqa: E402

SHAPE = (1, 2, 16, 8)


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE) for _ in range(3)]


def ours(batched):
    forward = lambda q, k, v: attention_forward(q, k, v, causal=True)
    return lambda: bool(gradcheck(forward, attention_backward, qkv(), batched=batched))


def theirs():
    import torch
    q, k, v = (torch.from_numpy(x).requires_grad_(True) for x in qkv())
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return lambda: bool(torch.autograd.gradcheck(sdpa, (q, k, v), raise_exception=False))


def projection_mha(d_model=512, heads=8, B=2, N=10):
    mha = MultiHeadAttention(d_model, heads, seed=0)
    forward, backward, keys = mha_functions(mha)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((B, N, d_model)) for _ in range(3)] + [mha.params[k] for k in keys]
    return lambda: bool(gradcheck(forward, backward, inputs, mode="projection", method="complex"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch
        torch.set_num_threads(os.cpu_count())
    except ImportError:
        torch = None
    print(machine_line() + (f", torch {torch.__version__}" if torch else ", torch not installed"))
    runs = [("ours, full, one at a time (batched=False)", ours(False)),
            ("ours, full, vectorized (default)", ours(None))]
    if torch:
        runs.append(("torch.autograd.gradcheck on SDPA", theirs()))
    times = {name: (median_time(fn, args.repeats), fn()) for name, fn in runs}
    ref = times.get("torch.autograd.gradcheck on SDPA", (None,))[0]
    print(f"\nfull Jacobian of causal attention, q, k, v {SHAPE}, float64, central differences")
    rows = [[name, f"{t * 1e3:.1f}", "PASS" if ok else "FAIL", f"{ref / t:.1f}x" if ref else "-"]
            for name, (t, ok) in times.items()]
    print(table(["check", "median ms", "verdict", "torch/this"], rows))
    t = median_time(projection_mha(), args.repeats)
    print(f"\nprojection mode (complex step, 3 projections per tensor), MultiHeadAttention(512, 8), "
          f"inputs [2, 10, 512] and all 8 parameters: {t * 1e3:.0f} ms, "
          f"{'PASS' if projection_mha()() else 'FAIL'}")


if __name__ == "__main__":
    main()
