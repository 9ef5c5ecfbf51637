"""Full-mode gradient checks: ours (looped and vectorized) against torch.autograd.gradcheck.

    python3 benchmarks/bench_gradcheck.py [--rounds 4]

The same function and shapes on both sides: causal scaled dot-product attention of
q, k, v [1, 2, 16, 8], float64, the whole Jacobian w.r.t. each of q, k, v by central
differences (torch: torch.nn.functional.scaled_dot_product_attention(is_causal=True)
under torch.autograd.gradcheck). Also projection mode of MultiHeadAttention at
d_model=512, which stays cheap at any size. Prints the median time, the verdict and the
ratio torch / ours (> 1: ours is faster). Each check is timed alone in its own process,
the processes alternating (_common.median_times_apart, as in bench_mha.py).

The "floor" row times only the evaluations no full-mode check can skip: the forwards that
central differences need (two per entry of q, k and v), stacked as the vectorized check
evaluates them, and the analytic side's one backward of the 256 unit upstream gradients
stacked, with the forward that makes its cache (on the inputs repeated 256 times: the
backward needs a cache of the stacked shape). Without the probes, the differences or the
report: torch / floor is the most a check built on these functions can gain over torch.
"""
import argparse
import importlib.util
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, median_time, median_times_apart, run_child, table  # noqa: E402
from numpy_attention import MultiHeadAttention, attention_backward, attention_forward, gradcheck  # noqa: E402
from numpy_attention.gradcheck_cases import mha_functions  # noqa: E402
from numpy_attention.finite_differences.batching import vectorized_gradients, vectorized_outputs  # noqa: E402
from numpy_attention.finite_differences.differences import DEFAULTS  # noqa: E402

SHAPE = (1, 2, 16, 8)


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE) for _ in range(3)]


def causal(q, k, v):
    """The checked function: causal attention -> (out, cache)."""
    return attention_forward(q, k, v, causal=True)


def ours(batched):
    return lambda: bool(gradcheck(causal, attention_backward, qkv(), batched=batched))


def floor():
    """The floor of full mode: the 2 x 768 perturbed forwards that central differences need,
    stacked per input and sign as the vectorized check runs them (one call per chunk), and
    one stacked forward and backward of the 256 unit upstream gradients (the analytic side)."""
    inputs, h = qkv(), DEFAULTS[("float64", "central")][0]      # gradcheck's default step
    out = causal(*inputs)[0]
    upstream = np.eye(out.size).reshape((out.size,) + out.shape)       # [256, *out]
    forwards = vectorized_outputs(causal, inputs)
    analytic = vectorized_gradients(causal, attention_backward, inputs, [0, 1, 2], ["q", "k", "v"])

    def step():
        for i, x in enumerate(inputs):
            directions = np.eye(x.size).reshape((x.size,) + x.shape)      # [768 / 3, *x]
            for sign in (1, -1):
                forwards({i: x + sign * h * directions})
        analytic(upstream)
        return True
    return step


def theirs():
    import torch
    torch.set_num_threads(os.cpu_count())
    q, k, v = (torch.from_numpy(x).requires_grad_(True) for x in qkv())
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return lambda: bool(torch.autograd.gradcheck(sdpa, (q, k, v), raise_exception=False))


def projection_mha(d_model=512, heads=8, B=2, N=10):
    mha = MultiHeadAttention(d_model, heads, seed=0)
    forward, backward, keys = mha_functions(mha)     # the module as a function of its tensors
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((B, N, d_model)) for _ in range(3)] + [mha.params[k] for k in keys]
    return lambda: bool(gradcheck(forward, backward, inputs, mode="projection", method="complex"))


def verdict(code):
    """PASS or FAIL: one call of the check that `code` defines as step(), in a fresh process."""
    return "PASS" if "VERDICT True" in run_child(code + "print('VERDICT', step())\n")[1] else "FAIL"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="fresh processes per check, 3 timed calls each")
    args = ap.parse_args()
    load = OtherLoad()
    have_torch = importlib.util.find_spec("torch") is not None    # torch runs in child processes only
    print(machine_line() + "\neach timed process first frees a 16 MiB array (_common.SETTLE_ALLOCATOR)")
    runs = {"ours, full, one at a time (batched=False)": "ours(False)",
            "ours, full, vectorized (default)": "ours(None)",
            "floor: 2 x 768 forwards, 1 analytic pass": "floor()"}
    if have_torch:
        runs["torch.autograd.gradcheck on SDPA"] = "theirs()"
    codes = [f"from benchmarks.bench_gradcheck import floor, ours, theirs\nstep = {call}\n"
             for call in runs.values()]
    times = median_times_apart(codes, args.rounds)
    verdicts = ["-" if name.startswith("floor") else verdict(code) for name, code in zip(runs, codes)]
    ref = times[-1] if have_torch else None
    print(f"\nfull Jacobian of causal attention, q, k, v {SHAPE}, float64, central differences")
    rows = [[name, f"{t * 1e3:.1f}", ok, f"{ref / t:.1f}x" if ref else "-"]
            for name, t, ok in zip(runs, times, verdicts)]
    print(table(["check", "median ms", "verdict", "torch/this"], rows))
    t = median_time(projection_mha(), 3 * args.rounds)
    print(f"\nprojection mode (complex step, 3 projections per tensor), MultiHeadAttention(512, 8), "
          f"inputs [2, 10, 512] and all 8 parameters: {t * 1e3:.0f} ms, "
          f"{'PASS' if projection_mha()() else 'FAIL'}")
    print("\n" + load.line())


if __name__ == "__main__":
    main()
