"""A sweep of crosscheck over a variant's candidates, honest and with planted bugs: the loop the
variants' candidate modules share (tests/rope_kernels.py, mla_kernels.py, fp8_kernels.py,
topk_kernels.py, maxlogits_kernels.py, gate_kernels.py: each sweeps its rope_case, mla_case, ...),
and the standard normal inputs of their draws (torch_inputs)."""
import math

import numpy as np

import numpy_attention as na


def torch_inputs(rng, s, dtype):
    """(q, dout [B, H, N_q, d], k, v [B, H_kv, N_k, d], generator): standard normal tensors of the
    shapes of a draw's settings s (batch, h_kv, groups, n_q, n_k, d) in the torch dtype, drawn by a
    generator seeded from rng (which draws on, for the case's other tensors)."""
    import torch
    b, h_kv, h, n_q, n_k, d = s["batch"], s["h_kv"], s["h_kv"] * s["groups"], s["n_q"], s["n_k"], s["d"]
    gen = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    q, dout = (torch.randn(b, h, n_q, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, h_kv, n_k, d, generator=gen).to(dtype) for _ in range(2))
    return q, dout, k, v, gen


def sweep(case, bugs, cases, seed=0, dtypes=("float32", "bfloat16"), peers=False):
    """{(dtype, bug or "honest"): (cases, failed, diagnosed, not run)} over `cases` cases per dtype;
    with peers, (..., failed by PEER_RULES' each) too.

    case(rng, dtype, bug) -> the case's arrays, or None where the bug does not change it (each
    bug's case draws the honest one's settings from the same rng state); bugs: {bug: words its
    diagnosis line holds}; diagnosed: the failing cases whose diagnosis holds the bug's words."""
    counts = {}
    for index, dtype in enumerate(dtypes):
        rng = np.random.default_rng([seed, index])
        for _ in range(cases):
            state = rng.integers(2 ** 31)
            for bug in (None,) + tuple(bugs):
                arrays = case(np.random.default_rng(state), dtype, bug)
                if arrays is None:
                    continue
                report = na.crosscheck(**arrays)
                key = (dtype, bug or "honest")
                said = bug is not None and any(bugs[bug] in line for line in report.diagnosis)
                skipped = bug is not None and any(line.startswith("not run") for line in report.diagnosis)
                row = (1, int(not report), int(said), int(skipped)) + (peer_failures(arrays) if peers else ())
                counts[key] = tuple(a + b for a, b in zip(counts.get(key, (0,) * len(row)), row))
    return counts


# the peers' own tests of low-precision attention, on out against the float64 oracle's
PEER_RULES = {
    "cosine >= 0.99": lambda err, out, ref: _cosine(out, ref) < 0.99,      # FlashAttention's NVFP4 test
    "atol 0.5, RMSE 0.15": lambda err, out, ref: np.abs(err).max() > 0.5 or math.sqrt(np.mean(err ** 2)) > 0.15,
}                                                                        # TransformerEngine's FP8 test


def _cosine(x, y):
    x, y = x.ravel(), y.ravel()
    return float(x @ y / max(np.linalg.norm(x) * np.linalg.norm(y), 1e-300))


def peer_failures(arrays):
    """(1 or 0 for each of PEER_RULES): whether the rule fails the case's out, held against the
    oracle's float64 out of the values the kernel used."""
    from numpy_attention._checks import to_numpy
    from numpy_attention.oracle import split_case
    from numpy_attention.oracle.runs import reference
    case = split_case({name: to_numpy(x, name) for name, x in arrays.items()})
    ref = reference(case.inputs, case.options, np.float64, gradients=False)["out"]
    out = np.asarray(case.candidates["out"], np.float64)
    return tuple(int(rule(out - ref, out, ref)) for rule in PEER_RULES.values())
