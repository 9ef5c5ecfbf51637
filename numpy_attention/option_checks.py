"""The checks of attention's options, one function each: attention_options (options.py) runs
them, so an engine only computes. Each raises ValueError / TypeError naming the argument and
the shapes. Shape legend as in textbook.py.
"""
import numpy as np

from ._checks import SHOWN, as_float_array, as_mask, offenders, read_only_copy, require_choice
from .positions import sequence_lengths
from .score_mods import numpy_mod
from .topk import topk_lists

FULLY_MASKED_POLICIES = ("zero", "uniform", "nan")


def check_fully_masked(fully_masked, k, v):
    """fully_masked checked: one of FULLY_MASKED_POLICIES, and 'zero' where k [..., N_k, d_k] has
    no key (every row is fully masked, P is [N_q, 0]: only 'zero' defines the output)."""
    require_choice(fully_masked, "fully_masked", FULLY_MASKED_POLICIES)
    if fully_masked != "zero" and k.shape[-2] == 0:
        raise ValueError(f"fully_masked={fully_masked!r} needs at least one key; with N_k = 0 "
                         f"only 'zero' defines the output: k {k.shape}, v {v.shape}")


def check_packed_sequences(q, k, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """(cu_seqlens_q, cu_seqlens_k, seqused_k) checked as int64 arrays, or Nones.

    Packed sequences (positions.py): q [H, total_q, d_k], k and v [H_kv, total_k, d]
    (no batch axes), cu_seqlens_* [B + 1] non-decreasing from 0 to the total length,
    seqused_k [B] with 0 <= seqused_k[b] <= sequence b's key length.
    """
    if cu_seqlens_q is None and cu_seqlens_k is None:
        if seqused_k is not None:
            raise ValueError("seqused_k needs cu_seqlens_q and cu_seqlens_k (packed sequences)")
        return None, None, None
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("packed sequences need both cu_seqlens_q and cu_seqlens_k")
    if q.ndim > 3:
        raise ValueError(f"with cu_seqlens, q, k, v are packed [H, total, d] with no batch axes, "
                         f"got q {q.shape}, k {k.shape}")
    checked = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[-2]), ("cu_seqlens_k", cu_seqlens_k, k.shape[-2])):
        cu = _int_array(cu, name)
        if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or cu[-1] != total or (np.diff(cu) < 0).any():
            raise ValueError(f"{name} must be [B + 1] non-decreasing offsets from 0 to the packed "
                             f"length {total}, got {cu.tolist() if cu.size <= 16 else cu.shape}")
        checked.append(cu)
    if checked[0].size != checked[1].size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must count the same B + 1 sequences, "
                         f"got {checked[0].size} and {checked[1].size}")
    if seqused_k is not None:
        seqused_k = _int_array(seqused_k, "seqused_k")
        lengths = sequence_lengths(checked[1])
        if seqused_k.shape != lengths.shape:
            raise ValueError(f"seqused_k must be [B] = {lengths.shape}, one entry per sequence of "
                             f"cu_seqlens_k, got shape {seqused_k.shape}")
        bad = (seqused_k < 0) | (seqused_k > lengths)
        if bad.any():
            raise ValueError(f"seqused_k must have 0 <= seqused_k[b] <= sequence b's key length, got "
                             f"{offenders('seqused_k', seqused_k, bad)} where the sequences hold "
                             f"{', '.join(map(str, lengths[bad][:SHOWN]))} keys")
    return checked[0], checked[1], seqused_k


def _int_array(x, name):
    """x as an int64 array; TypeError for anything but integers."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {arr.dtype} with shape {arr.shape}")
    return arr.astype(np.int64)


def check_head_vector(q_shape, name, x, batched, sequences=None):
    """x, the option `name` (an OPTIONS row of shape 'heads'), as a float (or complex) array, or
    None, checked against the caller's q [..., H, N_q, d_k] (a single head's [N, d]: H = 1): [H];
    where the row is `batched`, also [..., H] (q's leading axes), or with B = `sequences` packed
    sequences (or a paged KV cache's batch) [B, H], one row per sequence (FlashAttention's varlen
    and kvcache). ValueError naming the shapes accepted and q's.
    """
    if x is None:
        return None
    heads = q_shape[-3] if len(q_shape) >= 3 else 1
    if not batched:
        shapes, legend = [(heads,)], f"[H] for q {tuple(q_shape)}"
    elif sequences is None:
        shapes, legend = [(heads,), tuple(q_shape[:-2])], f"[H] or [..., H] for q {tuple(q_shape)}"
    else:
        shapes, legend = [(heads,), (sequences, heads)], (f"[H], or [B, H] with one row per sequence, "
                                                          f"for q {tuple(q_shape)} and B = {sequences} sequences")
    x = as_float_array(x, name)
    shapes = list(dict.fromkeys(shapes))                 # [..., H] of q [H, N, d] is [H]
    if x.shape not in shapes:
        raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))} ({legend}), got {x.shape}")
    return x


def check_qkv(q, k, v):
    """q [..., H, N_q, d_k], k [..., H_kv, N_k, d_k], v [..., H_kv, N_k, d_v] as float (or complex)
    arrays checked against each other (H_kv divides H, d_k >= 1; each may be the caller's own:
    a cache copies them). ValueError / TypeError naming the arrays and their shapes."""
    q, k, v = as_float_array(q, "q"), as_float_array(k, "k"), as_float_array(v, "v")
    shapes = f"q {q.shape}, k {k.shape}, v {v.shape}"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 axes [..., N, d], got shape {x.shape}")
    if not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"q, k, v must have the same number of axes, got shapes {shapes}")
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-3] != v.shape[:-3]:
        raise ValueError(f"q, k, v must share their leading batch axes, got shapes {shapes}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same width d_k, got q {q.shape}, k {k.shape}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same heads and length [..., H_kv, N_k], "
                         f"got k {k.shape}, v {v.shape}")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k must have a width d_k >= 1, got q {q.shape}, k {k.shape}")
    if q.ndim >= 3 and min(q.shape[-3], k.shape[-3]) == 0:
        raise ValueError(f"q and k must have at least one head (H >= 1, H_kv >= 1), "
                         f"got q {q.shape}, k {k.shape}")
    if q.ndim >= 3 and q.shape[-3] % k.shape[-3]:
        raise ValueError(f"k's heads H_kv={k.shape[-3]} must divide q's heads H={q.shape[-3]} "
                         f"(grouped-query attention), got q {q.shape}, k {k.shape}; the layout is "
                         f"[..., H, N, d] (torch's and FlashAttention's [B, N, H, d] need a transpose)")
    return q, k, v


def check_topk(topk_indices, topk_length, q_shape, k_shape):
    """The TopkLists of each query's listed keys (topk.py), or None without topk_indices."""
    if topk_indices is None:
        if topk_length is not None:
            raise ValueError("topk_length counts entries of topk_indices: pass topk_indices too")
        return None
    return topk_lists(topk_indices, topk_length, q_shape, k_shape)


def check_mods(score_mod, mask_mod, score_mod_params):
    """(score_mod, mask_mod, score_mod_params): the mods callables or None (one written with
    torch's operations wrapped to take NumPy arrays: score_mods.numpy_mod); the parameters
    {str: float array} as read-only copies, or None, only with a score_mod."""
    for name, f in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if f is not None and not callable(f):
            raise TypeError(f"{name} must be a function or None, got {type(f).__name__}")
    score_mod, mask_mod = (None if f is None else numpy_mod(f) for f in (score_mod, mask_mod))
    if score_mod_params is None:
        return score_mod, mask_mod, None
    if score_mod is None:
        raise ValueError("score_mod_params are score_mod's parameters: pass a score_mod too")
    if not isinstance(score_mod_params, dict) or not all(isinstance(n, str) for n in score_mod_params):
        raise TypeError(f"score_mod_params must be a dict of name -> array, got "
                        f"{type(score_mod_params).__name__}")
    return score_mod, mask_mod, {name: read_only_copy(as_float_array(x, f"score_mod_params[{name!r}]"))
                                 for name, x in score_mod_params.items()}


def check_vjps(score_mod_vjps, score_mod_params):
    """{name: callable} for parameters among score_mod_params, or None."""
    if score_mod_vjps is None:
        return None
    if not isinstance(score_mod_vjps, dict):
        raise TypeError(f"score_mod_vjps must be a dict of parameter name -> function, got "
                        f"{type(score_mod_vjps).__name__}")
    for name, vjp in score_mod_vjps.items():
        if name not in (score_mod_params or {}):
            raise ValueError(f"score_mod_vjps[{name!r}] is a VJP of a parameter score_mod_params does not "
                             f"have (it has {sorted(score_mod_params or {})})")
        if not callable(vjp):
            raise TypeError(f"score_mod_vjps[{name!r}] must be a function, got {type(vjp).__name__}")
    return dict(score_mod_vjps)


def require_finite(name, x, allow_neginf=False):
    bad = np.isnan(x) | (np.isposinf(x.real) if allow_neginf else ~np.isfinite(x))
    if bad.any():
        raise ValueError(f"{name} (shape {x.shape}) has {int(bad.sum())} non-finite entries "
                         f"(check_finite=True)")


def dropout_scale(dropout_mask, dropout_p, score_shape, legend):
    """dropout_mask / (1 - dropout_p), checked; None when there is no dropout."""
    if dropout_mask is None:
        if dropout_p > 0:
            raise ValueError("dropout_p > 0 needs an explicit dropout_mask (keep = True); "
                             "attention_forward draws no random numbers")
        return None
    keep = as_mask(dropout_mask, "dropout_mask", score_shape, legend,
                   hint="; a dropout mask scaled by 1 / (1 - p) is dropout_mask != 0 with dropout_p=p")
    return keep / (1.0 - dropout_p)
