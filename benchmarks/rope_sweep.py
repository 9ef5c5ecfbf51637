"""crosscheck on torch attention with rotary embeddings: per dtype, the honest cases and how many
failed, and per planted bug the cases, how many failed (the catch rate) and how many of those the
diagnosis named.

    python3 benchmarks/rope_sweep.py [--cases 200] [--seed 0]

The cases (tests/rope_kernels.py): float32 and bfloat16 torch candidates, Hugging Face's turn or
FlashAttention's, then SDPA and autograd's backward (out, dq, dk, dv); 1-2 batches, 1-2 kv heads
with 1-2 queries each, N_k of 8-159, N_q of 1, N_k or N_k / 3, d of 32 or 64, whole or half
rotary, base 10000 or 500000, no, linear or YaRN scaling, positions from 0 or from an offset
below 8192, causal or not. The bugs: the other layout; the queries' positions from 0 (cases with
N_q < N_k only).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, table  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="cases per dtype, each honest and with each "
                                                                 "bug (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="the cases' seed (default 0)")
    args = parser.parse_args()
    import rope_kernels
    load = OtherLoad()
    print(machine_line())
    counts = rope_kernels.sweep(args.cases, args.seed)
    rows = [[dtype, what, judged, failed, "-" if what == "honest" else named]
            for (dtype, what), (judged, failed, named) in sorted(counts.items())]
    print(table(["dtype", "candidate", "cases", "crosscheck failed", "diagnosis named it"], rows))
    print("\n" + load.line())


if __name__ == "__main__":
    main()
