"""torch's flex_attention with score_mods and mask_mods as candidates for crosscheck, honest or
with a planted bug, and a sweep of them (tests/test_flex_mods.py; the longer one,
benchmarks/flex_mods.py). flex_attention runs eager, its dense decomposition without dynamo's
trace (torch's _FLEX_ATTENTION_DISABLE_COMPILE_DEBUG switch: the same bits, faster; see
tests/real_kernels.py), forward only (flex_attention has no backward on CPU): out and lse.

Each case draws a variant, each written twice: with torch's operations for flex_attention and
with NumPy's for crosscheck, which gets the candidate's score_mod and mask_mod as keywords.
"""
import math
import warnings

import numpy as np
import torch
from torch.nn.attention import flex_attention as fa

import numpy_attention as na

VARIANTS = ("relative_table", "softcap", "chunked", "document_prefix", "sliding_window")
BUGS = {"relative_table": "table_off_by_one", "softcap": "score_mod_after_mask",
        "chunked": "diagonal_dropped", "document_prefix": "diagonal_dropped",
        "sliding_window": "diagonal_dropped"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def flex(q, k, v, score_mod, mask_mod):
    """flex_attention's (out, lse), eager, without dynamo's trace."""
    block_mask = None if mask_mod is None else fa.create_block_mask(mask_mod, None, None, q.shape[-2],
                                                                     k.shape[-2], device="cpu")
    debug = fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)        # "called without torch.compile()"
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        try:
            out, aux = fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                         return_aux=fa.AuxRequest(lse=True))
        finally:
            fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = debug
    return out, aux.lse


def variant(name, rng, n, heads, bug=False):
    """(torch score_mod, torch mask_mod, numpy options for crosscheck) of a variant at length n;
    bug: the candidate's mods get the variant's planted bug (BUGS)."""
    causal_t, causal = (lambda b, h, i, j: j <= i), (lambda b, h, i, j: j <= i)
    if name == "relative_table":
        rel = rng.standard_normal((heads, 2 * n - 1)).astype(np.float32)
        rel_t = torch.from_numpy(rel)
        shift = 1 if bug else 0                             # rel[h, q_idx - kv_idx] read one entry over
        return (lambda s, b, h, i, j: s + rel_t[h, (i - j + n - 1 + shift) % (2 * n - 1)], causal_t,
                {"score_mod": lambda s, b, h, i, j, p: s + p["rel"][h, i - j + n - 1],
                 "score_mod_params": {"rel": rel.astype(np.float64)}, "mask_mod": causal})
    if name == "softcap":
        cap = float(rng.uniform(0.5, 3))
        mod = {"score_mod": lambda s, b, h, i, j: cap * np.tanh(s / cap), "mask_mod": causal}
        if bug:                                             # the mask first, then the softcap: -inf -> -cap
            return (lambda s, b, h, i, j: cap * torch.tanh(torch.where(j <= i, s, -math.inf) / cap), None, mod)
        return lambda s, b, h, i, j: cap * torch.tanh(s / cap), causal_t, mod
    diagonal = (lambda b, h, i, j: j != i) if bug else (lambda b, h, i, j: j >= 0)
    if name == "chunked":                                   # Llama 4: causal within chunks
        chunk = int(rng.integers(2, 9))
        keep = lambda b, h, i, j: (i // chunk == j // chunk) & (j <= i)
    elif name == "document_prefix":                         # documents, each with a bidirectional prefix
        doc = np.sort(rng.integers(0, 3, n))
        doc[0] = 0
        start = np.searchsorted(doc, doc)                   # each position's document start
        doc_t, start_t = torch.from_numpy(doc), torch.from_numpy(start)
        prefix = int(rng.integers(1, 4))
        keep = lambda b, h, i, j: (doc[i] == doc[j]) & ((j <= i) | (j - start[j] < prefix))
        keep_t = lambda b, h, i, j: (doc_t[i] == doc_t[j]) & ((j <= i) | (j - start_t[j] < prefix))
        return None, lambda b, h, i, j: keep_t(b, h, i, j) & diagonal(b, h, i, j), {"mask_mod": keep}
    else:                                                   # a sliding window
        window = int(rng.integers(1, 9))
        keep = lambda b, h, i, j: (j <= i) & (j > i - window)
    return None, lambda b, h, i, j: keep(b, h, i, j) & diagonal(b, h, i, j), {"mask_mod": keep}


def case(rng, dtype, name, bug=False):
    """One crosscheck report: flex_attention in `dtype` with the variant (and its bug) judged."""
    heads, n, d = int(rng.integers(1, 5)), int(rng.integers(8, 97)), int(rng.choice([16, 32, 64]))
    batch = int(rng.integers(1, 3))
    q, k, v = (torch.from_numpy(rng.standard_normal((batch, heads, n, d)).astype(np.float32)).to(DTYPES[dtype])
               for _ in range(3))
    score_mod, mask_mod, options = variant(name, rng, n, heads, bug)
    out, lse = flex(q, k, v, score_mod, mask_mod)
    return na.crosscheck(q=q, k=k, v=v, out=out, lse=lse, **options)


def sweep(cases, seed=0):
    """{(dtype, bug or "honest"): (cases, failed)} over `cases` cases per dtype, each variant in
    turn, honest and with its bug."""
    counts = {}
    for dtype in DTYPES:
        rng = np.random.default_rng([seed, list(DTYPES).index(dtype)])
        for c in range(cases):
            name = VARIANTS[c % len(VARIANTS)]
            for bug in (False, True):
                key = (dtype, BUGS[name] if bug else "honest")
                judged, failed = counts.get(key, (0, 0))
                counts[key] = (judged + 1, failed + (not case(rng, dtype, name, bug)))
    return counts

