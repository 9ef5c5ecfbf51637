"""crosscheck on torch candidates of a variant: per dtype, the honest cases and how many failed,
and per planted bug the cases, how many failed (the catch rate), how many of those the
diagnosis named, and how many it did not try (a case too large to rerun the oracle).

    python3 benchmarks/variant_sweeps.py --variant rope|mla|fp8|mxfp8|nvfp4|topk|maxlogits|gate [--cases 200] [--seed 0]

rope (tests/rope_kernels.py): float32 and bfloat16 torch candidates, Hugging Face's turn or
FlashAttention's, then SDPA and autograd's backward (out, dq, dk, dv); 1-2 batches, 1-2 kv
heads with 1-2 queries each, N_k of 8-159, N_q of 1, N_k or N_k / 3, d of 32 or 64, whole or
half rotary, base 10000 or 500000, no, linear or YaRN scaling, positions from 0 or from an
offset below 8192, causal or not. The bugs: the other layout; the queries' positions from 0
(cases with N_q < N_k only).

mla (tests/mla_kernels.py): the absorbed form in float32 and bfloat16, ordered as DeepSeek's
model code (eager, in the dtype) or FlashMLA's reference (float32 inside), autograd's backward
(out, dq, dkv); r + p of 32 + 16, 64 + 16, 128 + 64 or 512 + 64, 1-16 heads, 1-4 queries,
N_k of 8-199, one in three a paged latent cache of 64-row pages, FlashMLA's default scale or
DeepSeek's 1 / sqrt(128 + p). The bugs: the values read from kv's last r columns; the rotary
columns' scores not scaled; kv's gradient the keys' alone.

fp8 (tests/fp8_kernels.py): forward (out, lse; bfloat16 out) of float8 e4m3 or e5m2 inputs
quantized by their groups' largest values, descales per tensor, per (batch, kv head), per token
of a head or per block of 16 or 64 tokens, ordered as FlashAttention-3 (float32 inside, P in
float8 or bfloat16; half of those accumulating in 22 bits, accumulator_bits=22) or as a
bfloat16 kernel reading a dequantized FP8 KV cache; 1-2 batches, 1-2 kv heads with 1-2
queries each, N_k of 8-299, d of 32, 64 or 128, causal or not. The bugs: a descale dropped
(q's, k's or v's); v's applied twice; the first head's descale for every head (where the
scales are finer than per tensor).

mxfp8 (tests/fp8_kernels.py, mx_sweep): fp8's cases with MXFP8's scales in place of the drawn
ones, an e8m0 power of two for each 32 elements of a row, products accumulated in float32. The
bugs: fp8's, and a tensor's e8m0 scales read with a bias of 128 (halved), or one block over
along d.

nvfp4 (tests/nvfp4_kernels.py): forward (out, lse; bfloat16 out) of q and k in e2m1 with an
e4m3 scale a block of 16 elements of a row and a float32 scale a tensor (NVIDIA's NVFP4 recipe),
v in bfloat16 (P rounded to bfloat16) or in e4m3 with a per-tensor descale (P rounded to e4m3),
as FlashAttention's block-scaled forward's two NVFP4 modes: the products in float32, the softmax
in float32; fp8's shapes, d of 32, 64 or 128. The bugs, in q's or k's scales: dropped; read in
blocks of 32 (MXFP8's); one block over along d; read transposed ([N, d / 16] as [d / 16, N]).

topk (tests/topk_kernels.py): sparse top-k attention in float32 and bfloat16, each query's keys
gathered and attended in float32 (FlashMLA's reference order), autograd's backward
(out, dq, dk, dv); 1-2 batches, 1-2 kv heads with 1-2 queries each, N_q of 1-39, N_k of 16-199,
4-47 keys a query (repeats and -1 among them) or, one in three, key blocks of 4, 8 or 16
with topk_block_size. The bugs: every index one key over; -1 read as the last key; a key listed
twice getting one use's gradient (the backward's scatter an assignment); the block size
doubled.

maxlogits (tests/maxlogits_kernels.py): max_logits in float32, bfloat16 and float16, as
FlashAttention's row_max (float32 scores, per row, times the scale), TransformerEngine's
return_max_logit (per head) or a model's eager scores in the dtype, with out and lse of a float32
softmax; 1-2 batches, 1-2 kv heads with 1-2 queries each, N_k of 8-199, N_q of 1, N_k or N_k / 3,
d of 32, 64 or 128, causal or not, one in three with sinks. The bugs: the max before the scale;
the max in base 2; the running max started at the sink.

gate (tests/gate_kernels.py): Qwen3-Next's output gate in float32 and bfloat16, headwise or
elementwise, as Hugging Face's eager attention (SDPA, then times sigmoid(gate), in the dtype) or
a kernel gating in float32 in its epilogue, autograd's backward (out, dq, dk, dv, dgate); 1-2
batches, 1-2 kv heads with 1-2 queries each, N_k of 8-159, N_q of 1, N_k or N_k / 3, d of 32 or
64, causal or not. The bugs: the gate not applied; the gate applied without its sigmoid.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import OtherLoad, machine_line, table  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=("rope", "mla", "fp8", "mxfp8", "nvfp4", "topk", "maxlogits",
                                                    "gate"), required=True,
                        help="the variant's candidates")
    parser.add_argument("--cases", type=int, default=200, help="cases per dtype, each honest and with each "
                                                                 "bug (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="the cases' seed (default 0)")
    parser.add_argument("--peers", action="store_true", help="also count the cases the peers' own tests fail "
                                                             "(fp8, mxfp8, nvfp4: cosine >= 0.99; atol 0.5, "
                                                             "RMSE 0.15)")
    args = parser.parse_args()
    import importlib
    from variant_sweeps import PEER_RULES
    module, sweep = {"mxfp8": ("fp8", "mx_sweep")}.get(args.variant, (args.variant, "sweep"))
    kernels = importlib.import_module(f"{module}_kernels")
    load = OtherLoad()
    print(machine_line())
    counts = getattr(kernels, sweep)(args.cases, args.seed, **({"peers": True} if args.peers else {}))
    rows = [[dtype, what, judged, failed] + (["-", "-"] if what == "honest" else [named, not_run]) + list(peers)
            for (dtype, what), (judged, failed, named, not_run, *peers) in sorted(counts.items())]
    peer_names = [f"{rule} failed" for rule in PEER_RULES] if args.peers else []
    print(table(["dtype", "candidate", "cases", "crosscheck failed", "diagnosis named it", "not tried"] + peer_names,
                rows))
    print("\n" + load.line())


if __name__ == "__main__":
    main()
