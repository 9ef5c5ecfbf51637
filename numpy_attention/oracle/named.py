"""The mix-ups a diagnosis names from the candidate and the oracle's results alone, before any
rerun of the oracle (diagnosis.py reruns it under the others):

    lse_base       lse in base 2 where the case says base e, or the reverse
    empty_rows     split-KV merges' mix-ups in the rows with no key (the oracle's lse -inf): NaN
                   there and only there (two empty states merged), a finite lse there (an empty
                   split's sentinel), lse +inf in rows that have keys (an empty split's +inf
                   merged); a finite max_logits there
    sink_in_max    max_logits the largest of the scores and the sink (a running max started at it)
    gate_mixups    out without its output gate, or with the gate in place of sigmoid(gate)
    p_saturation   a float8 out whose P saturated e4m3 in an online softmax with an offset and
                   a lazy rescale (p_range.py), with the rows where it did
    latent_parts   MLA's dkv missing one use
    written_once   a sparse top-k backward that writes each use's dk, dv to its key instead of
                   adding it (a key several queries list, or one lists twice, keeps one use's)

Each takes the judge of diagnosis.py (judge.explains, judge.near: whether an error is near
enough to name).
"""
import math

import numpy as np

from .._layout import with_head_axis
from ..gate import sigmoid
from ..options import OPTIONS, attention_options
from ..scores import attention_scores
from ..topk import counts, topk_lists
from .p_range import SETTINGS, lazy_out

UNMODELLED = ("rope",) + tuple(row.name for row in OPTIONS   # what p_saturation's softmax does not hold: rope,
                               if row.acts in ("row", "output") and row.default is None)   # sinks, dropout, a gate


def rel_l2(x, ref):
    """||x - ref|| / ||ref|| over the finite entries (inf where their non-finite entries differ)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.array_equal(np.isfinite(x), np.isfinite(ref)):
        return math.inf
    finite = np.isfinite(ref)
    norm = float(np.linalg.norm(np.where(finite, ref, 0)))
    err = float(np.linalg.norm(np.where(finite, x - ref, 0)))
    return err / norm if norm > 0 else (0.0 if err == 0 else math.inf)


def named_directly(candidates, truth, case, judge):
    """The lines of the first of these mix-ups the candidate matches; [] when none does."""
    return (lse_base(candidates, truth, case, judge) or empty_rows(candidates, truth)
            or sink_in_max(candidates, truth, case, judge) or gate_mixups(candidates, truth, case, judge)
            or p_saturation(candidates, case, judge)
            or latent_parts(candidates, truth, case, judge) or written_once(candidates, truth, case, judge))


def lse_base(candidates, truth, case, judge):
    """The line when the candidate's lse is in the other base than the case says: base 2 read
    as base e (lse / ln 2), or base e read as base 2 (lse ln 2); else []."""
    if "lse" not in candidates:
        return []
    other, factor = ("2", math.log(2)) if case.lse_base == "e" else ("e", 1 / math.log(2))
    err = rel_l2(candidates["lse"] * factor, truth["lse"])
    if not judge.explains(err, "lse"):
        return []
    said = {"e": "base e", "2": "base 2"}
    return [f"lse matches lse in {said[other]} (rel L2 {err:.1e}); the case says {said[case.lse_base]} "
            f"(lse_base={other!r} reads it)"]


def sink_in_max(candidates, truth, case, judge):
    """The line when the candidate's max_logits is each row's (or head's) largest of its scores
    and its sink, a running max that started at the sink; else []."""
    sinks = case.options.get("sinks")
    if "max_logits" not in candidates or sinks is None:
        return []
    want = truth["max_logits"]
    with_sink = np.maximum(want, np.asarray(sinks, np.float64).reshape((-1,) + (1,) * (want.ndim > 1)))
    err = rel_l2(candidates["max_logits"], with_sink)
    if np.array_equal(with_sink, want) or not judge.explains(err, "max_logits"):
        return []
    return [f"max_logits matches the largest of the scores and the sink (rel L2 {err:.1e}): a running max "
            f"started at the sink; the sink is not a score, and max_logits is the scores' alone"]


def gate_mixups(candidates, truth, case, judge):
    """The line when the candidate's out is the attention's without its output gate (out = P V),
    or with the gate itself in place of sigmoid(gate); else []."""
    gate = case.options.get("gate")
    if "out" not in candidates or gate is None:
        return []
    inner = truth["out"] / sigmoid(np.asarray(gate, np.float64))
    for wrong, said in ((inner, "the attention P V without its output gate: the gate not applied"),
                        (inner * gate, "(P V) * gate: the gate applied without its sigmoid")):
        err = rel_l2(candidates["out"], wrong)
        if judge.explains(err, "out"):
            return [f"out matches {said} (rel L2 {err:.1e}); out = (P V) * sigmoid(gate)"]
    return []


def p_saturation(candidates, case, judge):
    """The line when a float8 candidate's out is that of an online softmax whose P~ saturated
    e4m3's 448 (p_range.py), under the first of p_range.SETTINGS that explains it, naming the
    rows it saturated in; else [] (also for a case it does not model: sinks, dropout, rope, MLA,
    a paged cache)."""
    o = case.options
    if ("out" not in candidates or not case.precision.forward_only or case.paged is not None
            or case.latent is not None or any(o.get(name) is not None for name in UNMODELLED)):
        return []
    q, k, v, record = attention_options(*(case.inputs[name] for name in "qkv"), **o)
    s = attention_scores(q, k, record)[0]
    v = with_head_axis(v)
    v = np.repeat(v, with_head_axis(q).shape[-3] // v.shape[-3], axis=-3)
    for offset, threshold, tile in SETTINGS:
        out, saturated = lazy_out(s, v, offset, threshold, tile)
        err = rel_l2(candidates["out"], out.reshape(candidates["out"].shape))
        if saturated.any() and judge.explains(err, "out"):
            rows = [tuple(int(i) for i in at) for at in np.argwhere(saturated)[:3]]
            return [f"out matches float8 P saturated at e4m3's 448 in {int(saturated.sum())} of {saturated.size} "
                    f"query rows, e.g. [..., head, row] {', '.join(map(str, rows))} (rel L2 {err:.1e}): P = "
                    f"exp(S - m) 2^{offset:g} with the row max m moved only past {threshold:g} (log2) in tiles "
                    f"of {tile} keys reaches 2^{offset + threshold:g}; e4m3 holds 2^8.8 (rescale past "
                    f"{8.8 - offset:.1f}, or a smaller offset)"]
    return []


def empty_rows(candidates, truth):
    """Lines for the split-KV merges' mix-ups around rows with no key (the oracle's lse -inf),
    which no rerun shows: NaN in those rows alone (two empty states merged, exp(-inf - (-inf)));
    a finite lse there (an empty split's finite sentinel carried through); lse +inf in rows that
    have keys (an empty split's +inf, FlashAttention's lse of a row with no key, merged as a
    score); a finite max_logits there. [] when none of them."""
    lse = truth.get("lse")
    if lse is None:
        return []
    dead = np.isneginf(lse)                                      # [..., H, N_q]
    rows = lambda x: x if x.ndim == dead.ndim else np.any(x, axis=-1)   # out's entries -> rows
    lines = []
    nan = [n for n in ("out", "lse") if n in candidates and np.isnan(candidates[n]).any()]
    if nan and dead.any() and all(not (rows(np.isnan(candidates[n])) & ~dead).any() for n in nan):
        count = int(np.sum(np.any([rows(np.isnan(candidates[n])) for n in nan], axis=0)))
        lines.append(f"{', '.join(nan)} {'is' if len(nan) == 1 else 'are'} NaN in {count} of the "
                     f"{int(dead.sum())} query rows with no key, and only there: a merge of two empty "
                     f"states (lse -inf each) computed exp(-inf - (-inf)); such a row's out is 0 and "
                     f"its lse -inf (a merge takes a largest lse of -inf as empty)")
    if "lse" in candidates:
        cand = candidates["lse"]
        finite = dead & np.isfinite(cand)
        if finite.any():
            lines.append(f"lse is finite ({float(cand[finite].min()):.3g}) in {int(finite.sum())} of the "
                         f"{int(dead.sum())} query rows with no key, where -inf is expected (or "
                         f"FlashAttention's +inf): an empty split's finite sentinel carried through a merge")
        infinite = ~dead & np.isfinite(lse) & np.isposinf(cand)
        if infinite.any():
            lines.append(f"lse is +inf in {int(infinite.sum())} query rows that have keys: an empty "
                         f"split's +inf (FlashAttention's lse of a row with no key) merged as a score, "
                         f"where a merge must read it as -inf")
    if "max_logits" in candidates and candidates["max_logits"].shape == dead.shape:
        finite = dead & np.isfinite(candidates["max_logits"])
        if finite.any():
            lines.append(f"max_logits is finite ({float(candidates['max_logits'][finite].min()):.3g}) in "
                         f"{int(finite.sum())} of the {int(dead.sum())} query rows with no key, where -inf "
                         f"is expected (the largest of no score; a kernel's running max starts there)")
    return lines


def latent_parts(candidates, truth, case, judge):
    """The line when an MLA candidate's dkv is one use's gradient alone: the keys' dk (the
    values' gradient not added into kv's first columns) or the values' [dv ; 0]; else []."""
    if "dkv" not in candidates or "dk" not in truth:
        return []
    values = np.zeros_like(truth["dk"])
    values[..., :case.latent] = truth["dv"]
    for alone, did in ((truth["dk"], "the keys' gradient dk alone (the values' dv not added)"),
                       (values, "the values' gradient [dv ; 0] alone (the keys' dk not added)")):
        err = rel_l2(candidates["dkv"], alone)
        if judge.explains(err, "dkv"):
            return [f"dkv matches {did} (rel L2 {err:.1e}); kv serves as the keys and as the values, and "
                    f"its gradient is the sum of both"]
    return []


def written_once(candidates, truth, case, judge):
    """The line when a sparse top-k candidate's dk and dv are, entry by entry, the gradient of
    one of its key's uses (its scatter writes where it should add, and a scatter of rows with
    repeated indices may keep each column from another write): the nearest use's for each
    entry, a use u = (query head h, row i) with c > 0 copies of key j in its list giving
        dv_j = P_hij / c dout_hi,   dk_j = dS_hij / c (scale q_hi)     (one copy's share)
    from the oracle's stages P, dS; else []."""
    named = [n for n in ("dk", "dv") if n in candidates]
    if case.topk is None or not named or "dout" not in case.inputs or "P" not in truth or "dS" not in truth:
        return []
    q, dout = (np.asarray(case.inputs[n], np.float64) for n in ("q", "dout"))
    if case.options.get("gate") is not None:                                     # the attention's dO
        dout = dout * sigmoid(np.asarray(case.options["gate"], np.float64))
    k_shape = case.inputs["k"].shape
    scale = case.options.get("scale") or 1 / math.sqrt(q.shape[-1])
    shape = q.shape[:-3] + (k_shape[-3], q.shape[-3] // k_shape[-3], q.shape[-2], k_shape[-2])
    lists = topk_lists(case.topk[0], case.topk[1], q.shape, k_shape)
    copies = counts(lists, q.shape[:-1] + k_shape[-2:-1]).reshape(shape)        # [..., H_kv, G, N_q, N_k]
    uses = np.nonzero(copies)                                                    # (..., g, h of g, i, j)
    at = lambda x: np.reshape(x, shape)[uses]                                    # each use's
    rows = lambda x: x.reshape(shape[:-1] + x.shape[-1:])[uses[:-1]]             # its query row's
    share = {"dv": (at(truth["P"]) / at(copies))[:, None] * rows(dout),
             "dk": (at(truth["dS"]) / at(copies))[:, None] * rows(q * scale)}
    keys = uses[:-3] + uses[-1:]                                                 # its key: (..., g, j)
    parts = []
    for name in named:
        cand = candidates[name]
        nearest = np.full(cand.shape, np.inf)
        np.minimum.at(nearest, keys, (cand[keys] - share[name]) ** 2)
        unused = np.isinf(nearest)
        nearest[unused] = cand[unused] ** 2                                      # a key no query lists: 0
        err = math.sqrt(nearest.sum()) / max(float(np.linalg.norm(cand)), 1e-300)
        if not judge.near(err, name):
            return []
        parts.append((name, err))
    if not any(judge.explains(err, name) for name, err in parts):
        return []
    return [f"{', '.join(n for n, _ in parts)} {'matches' if len(parts) == 1 else 'match'} one use's gradient "
            f"for each key (rel L2 {max(e for _, e in parts):.1e}): the backward writes each use's gradient to "
            f"its key; a key that several queries list, or one lists twice, gets the sum of all its uses"]
