"""torch's flex_attention with score_mods and mask_mods as candidates for crosscheck, honest or
with a planted bug, and a sweep of them (tests/test_flex_mods.py; the longer one,
benchmarks/flex_mods.py). flex_attention runs eager, its dense decomposition without dynamo's
trace (torch's _FLEX_ATTENTION_DISABLE_COMPILE_DEBUG switch: the same bits, faster; see
tests/real_kernels.py), forward only (flex_attention has no backward on CPU): out and lse; or
compiled by torch.compile (compiled_flex): out alone, on one shape (COMPILED_SHAPE).

Each case draws a variant, each written twice: with torch's operations for flex_attention and
with NumPy's for crosscheck, which gets the candidate's score_mod and mask_mod as keywords.
"""
import functools
import math
import warnings

import ml_dtypes
import numpy as np
import torch
from torch.nn.attention import flex_attention as fa

import numpy_attention as na

VARIANTS = ("relative_table", "softcap", "chunked", "document_prefix", "sliding_window")
BUGS = {"relative_table": "table_off_by_one", "softcap": "score_mod_after_mask",
        "chunked": "diagonal_dropped", "document_prefix": "diagonal_dropped",
        "sliding_window": "diagonal_dropped"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COMPILED_SHAPE = (1, 2, 64, 32)     # [B, H, N, d] of the compiled cases: one shape, one compile per mod
RECOMPILE_LIMIT = 64                # compiled flex_attention's graphs (a mod's code and a dtype each)


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
    bug: the candidate's mods get the variant's planted bug (BUGS). The torch mods hold their
    settings in tensors, so that a compiled flex_attention compiles each mod once, not once
    per value."""
    t = torch.tensor
    causal = lambda b, h, i, j: j <= i
    if name == "relative_table":
        rel = rng.standard_normal((heads, 2 * n - 1)).astype(np.float32)
        rel_t, last, shift = torch.from_numpy(rel), t(n - 1), t(1 if bug else 0)   # bug: one entry over
        return (lambda s, b, h, i, j: s + rel_t[h, (i - j + last + shift) % (2 * last + 1)], causal,
                {"score_mod": lambda s, b, h, i, j, p: s + p["rel"][h, i - j + n - 1],
                 "score_mod_params": {"rel": rel.astype(np.float64)}, "mask_mod": causal})
    if name == "softcap":
        cap = float(ml_dtypes.bfloat16(rng.uniform(0.5, 3)))  # a bfloat16 value: exact in either dtype
        cap_t = t(cap)
        mod = {"score_mod": lambda s, b, h, i, j: cap * np.tanh(s / cap), "mask_mod": causal}
        if bug:                                             # the mask first, then the softcap: -inf -> -cap
            return lambda s, b, h, i, j: cap_t * torch.tanh(torch.where(j <= i, s, -math.inf) / cap_t), None, mod
        return lambda s, b, h, i, j: cap_t * torch.tanh(s / cap_t), causal, mod
    if name == "chunked":                                   # Llama 4: causal within chunks
        keep = lambda chunk: lambda b, h, i, j: (i // chunk == j // chunk) & (j <= i)
        settings = (int(rng.integers(2, 9)),)
    elif name == "document_prefix":                         # documents, each with a bidirectional prefix
        doc = np.sort(rng.integers(0, 3, n))
        doc[0] = 0
        start = np.searchsorted(doc, doc)                   # each position's document start
        keep = lambda doc, start, prefix: lambda b, h, i, j: (doc[i] == doc[j]) & ((j <= i) | (j - start[j] < prefix))
        settings = (doc, start, int(rng.integers(1, 4)))
    else:                                                   # a sliding window
        keep = lambda window: lambda b, h, i, j: (j <= i) & (j > i - window)
        settings = (int(rng.integers(1, 9)),)
    keep_t, drop = keep(*(torch.from_numpy(x) if isinstance(x, np.ndarray) else t(x) for x in settings)), t(bug)
    return (None, lambda b, h, i, j: keep_t(b, h, i, j) & ((j != i) | ~drop),   # bug: the diagonal dropped
            {"mask_mod": keep(*settings)})


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    """torch.compile(flex_attention) with static shapes (tests/real_kernels.py says why)."""
    return torch.compile(fa.flex_attention, dynamic=False)


def compiled_flex(q, k, v, score_mod, mask_mod):
    """flex_attention compiled: out, and None for lse (torch 2.13 compiles it on CPU for
    inference only, without lse). A new mod's code or a new shape compiles (seconds); past
    dynamo's recompile limit it would run eager instead, which is an error here."""
    block_mask = None if mask_mod is None else fa.create_block_mask(mask_mod, None, None, q.shape[-2],
                                                                     k.shape[-2], device="cpu")
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=RECOMPILE_LIMIT), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block_mask), None


def case(rng, dtype, name, bug=False, compiled=False):
    """One crosscheck report: flex_attention in `dtype` with the variant (and its bug) judged;
    compiled: torch.compile's, on COMPILED_SHAPE (one compile per mod and dtype), out alone."""
    heads, n, d = int(rng.integers(1, 5)), int(rng.integers(8, 97)), int(rng.choice([16, 32, 64]))
    batch = int(rng.integers(1, 3))
    if compiled:
        batch, heads, n, d = COMPILED_SHAPE
    q, k, v = (torch.from_numpy(rng.standard_normal((batch, heads, n, d)).astype(np.float32)).to(DTYPES[dtype])
               for _ in range(3))
    score_mod, mask_mod, options = variant(name, rng, n, heads, bug)
    out, lse = (compiled_flex if compiled else flex)(q, k, v, score_mod, mask_mod)
    return na.crosscheck(q=q, k=k, v=v, out=out, lse=lse, **options)


def sweep(cases, seed=0, compiled=False, dtypes=tuple(DTYPES)):
    """{(dtype, bug or "honest"): (cases, failed)} over `cases` cases per dtype, each variant in
    turn, honest and with its bug; compiled: torch.compile's flex_attention."""
    counts = {}
    for dtype in dtypes:
        rng = np.random.default_rng([seed, list(DTYPES).index(dtype)])
        for c in range(cases):
            name = VARIANTS[c % len(VARIANTS)]
            for bug in (False, True):
                key = (dtype, BUGS[name] if bug else "honest")
                judged, failed = counts.get(key, (0, 0))
                counts[key] = (judged + 1, failed + (not case(rng, dtype, name, bug, compiled)))
    return counts

