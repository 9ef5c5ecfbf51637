"""crosscheck on torch's flex_attention with FlexAttention's score_mod and mask_mod: per dtype,
the honest cases and how many failed, and per planted bug the cases and how many failed (the
catch rate).

    python3 benchmarks/flex_mods.py [--cases 300] [--seed 0] [--compiled]

The cases (tests/flex_mods.py): float32 and bfloat16 flex_attention, eager, forward (out and
lse), 1-2 batches, 1-4 heads, N of 8-96, d of 16, 32 or 64; with --compiled, torch.compile's
flex_attention (out alone: torch compiles it on CPU for inference only, without lse) on one
shape, [1, 2, 64, 32], so that each mod compiles once per dtype; the variants in turn: a
relative-position table, a tanh softcap, Llama 4's chunked attention, documents with a
bidirectional prefix, a sliding window. The bugs: the table read one entry over, the softcap
applied after the mask, the diagonal dropped from the mask. Each case is judged honest and
with its variant's bug.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, table  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="cases per dtype, each honest and with its bug "
                                                                 "(default 300)")
    parser.add_argument("--seed", type=int, default=0, help="the cases' seed (default 0)")
    parser.add_argument("--compiled", action="store_true", help="torch.compile's flex_attention instead "
                                                               "of the eager one")
    args = parser.parse_args()
    import flex_mods
    load = OtherLoad()
    print(machine_line())
    counts = flex_mods.sweep(args.cases, args.seed, compiled=args.compiled)
    rows = [[dtype, what, judged, failed] for (dtype, what), (judged, failed) in sorted(counts.items())]
    print(table(["dtype", "candidate", "cases", "crosscheck failed"], rows))
    print("\n" + load.line())


if __name__ == "__main__":
    main()
