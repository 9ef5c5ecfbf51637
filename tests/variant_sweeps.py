"""A sweep of crosscheck over a variant's candidates, honest and with planted bugs: the loop the
variants' candidate modules share (tests/rope_kernels.py, mla_kernels.py, fp8_kernels.py,
topk_kernels.py, maxlogits_kernels.py, gate_kernels.py: each sweeps its rope_case, mla_case, ...),
and the standard normal inputs of their draws (torch_inputs)."""
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


def sweep(case, bugs, cases, seed=0, dtypes=("float32", "bfloat16")):
    """{(dtype, bug or "honest"): (cases, failed, diagnosed, not run)} over `cases` cases per dtype.

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
                judged, failed, named, not_run = counts.get(key, (0, 0, 0, 0))
                said = bug is not None and any(bugs[bug] in line for line in report.diagnosis)
                skipped = bug is not None and any(line.startswith("not run") for line in report.diagnosis)
                counts[key] = (judged + 1, failed + (not report), named + said, not_run + skipped)
    return counts
