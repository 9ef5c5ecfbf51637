"""Diagnosis: which common convention mix-up a failing candidate matches instead.

When a tensor fails, the oracle is run again (float64) under each mix-up that applies to
the case, and the failing tensors are compared with each rerun; where no mix-up alone
explains them, the pairs of the PAIRED that bring it nearest. A rerun explains
the failing tensors when the candidate is near it in each, either CLOSER times nearer than
to the oracle and within NEAR (rel L2) or as near as the rounding of the case's precision
lets an honest kernel be (NOISE times the baseline's rel L2: float8's P rounds to 12%), or
within that rounding, at most NOISY, and nearer than to the oracle (a bfloat16 dk of one
query row rounds to 10%); and CLEARLY nearer in one of them at least. A tensor may also be
a known constant times the rerun's, over the whole tensor or head by head (a backward
without the scale, one head's dk negated):

    out, dq match causal='bottom_right' (rel L2 3.1e-08); the case says causal='top_left'
    dq, dk match the oracle times 8 = 1 / scale (rel L2 2.0e-16): a backward without the scale

The mix-ups: causal alignment swapped (a bottom-right one also with fully masked rows the
mean of v: MLX's mask="causal"); causal masking missing, or added, or off by one (the
diagonal excluded, one key of the future kept); scale 1, sqrt(d_k) or 1/d_k (the scale
applied twice) instead of 1/sqrt(d_k), or off by a few percent (the scale fitted to the
candidate's out); softcap missing, or applied after the bias; mask polarity inverted; the
window's alignment swapped, or each side off by one; grouped-query heads interleaved
(query head h with kv head h % H_kv, not h // G); rotary embeddings in the other layout
(interleaved for half-split or the reverse), missing, over the whole head where they are
partial, or with the queries' positions from 0; MLA's values read from kv's last columns,
or its rotary columns' scores unscaled; a float8 descale dropped, applied twice, or the
first head's used for every head; sparse top-k's indices read one key over, -1 read as the
last key, a key listed twice counted once, the block size doubled or halved. The factors:
-1, 2, 1/2, 1 / scale and scale, 1 - p (dropout not rescaled by 1 / (1 - p)); and rows of
out or lse shifted by one (check.py adds: the [..., N, H, d] layout read as [..., H, N, d]).

Named from the candidate alone, before any rerun: lse in base 2 where the case says base e,
or the reverse; and split-KV merges' mix-ups in the rows with no key (the oracle's lse
-inf): NaN there and only there (two empty states merged), a finite lse there (an empty
split's sentinel), or lse +inf in rows that have keys (an empty split's +inf merged); MLA's
dkv missing one use; and a sparse top-k backward that writes each use's dk, dv to its key
instead of adding it (a key several queries list, or one lists twice, keeps one use's).
"""
import math
from typing import NamedTuple

import numpy as np

from ..attention import attention_backward, attention_forward
from ..score_mods import numpy_mod
from ..topk import block_indices, counts, listed, topk_lists
from .schema import GRADIENTS

CLOSER = 100.0          # a rerun explains a tensor this much nearer than the oracle,
NEAR = 1e-2             # and within this rel L2 of it;
NOISE = 3.0             # or within this many times the baseline's rel L2 (the rule's k),
NOISY = 0.1             # up to this rel L2,
CLEARLY = 2.0           # and this much nearer than the oracle
PAIR_SCORES = 2 ** 20   # pairs of mix-ups are tried on cases of at most this many scores,
PAIRED = 6              # of the mix-ups that bring the candidate nearest, this many
FIT_STEPS = 4           # Gauss-Newton steps of the scale fitted to the failing tensors,
FIT_STEP = 2.0 ** -20   # each one's directions by a difference of log(scale) this large


class Mixup(NamedTuple):
    """One convention mix-up: what the candidate did, what the case says, and the rerun's
    option changes (a value of None removes the option)."""
    did: str
    said: str
    change: dict
    interleaved: bool = False           # query head h meets kv head h % H_kv
    latent: str = None                  # MLA: 'values_last' (v = kv's last r columns) or
                                        # 'rope_unscaled' (q's rotary columns times 1 / scale)
    inputs: dict = None                 # q, k or v replaced (float8: dequantized otherwise)


def rel_l2(x, ref):
    """||x - ref|| / ||ref|| over the finite entries (inf where their non-finite entries differ)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.array_equal(np.isfinite(x), np.isfinite(ref)):
        return math.inf
    finite = np.isfinite(ref)
    norm = float(np.linalg.norm(np.where(finite, ref, 0)))
    err = float(np.linalg.norm(np.where(finite, x - ref, 0)))
    return err / norm if norm > 0 else (0.0 if err == 0 else math.inf)


def _rerun(inputs, options, gradients, mixup, latent=None):
    """The float64 oracle's results for these inputs and the options changed by `mixup` (a
    dict like runs.reference's); with MLA's latent r, also dkv."""
    options = {name: x for name, x in {**options, **mixup.change}.items() if x is not None}
    q, k, v = ({**inputs, **(mixup.inputs or {})}[n].astype(np.float64) for n in "qkv")
    groups = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    if mixup.interleaved:
        k, v = (np.concatenate([x] * groups, axis=-3) for x in (k, v))
        lists = options.get("topk_indices")
        if lists is not None and lists.shape[-3] != q.shape[-3]:     # a kv head's list, for its queries
            options["topk_indices"] = np.repeat(lists, groups, axis=-3)
    unscaled = 1.0
    if mixup.latent == "values_last":
        v = k[..., k.shape[-1] - latent:]
    elif mixup.latent == "rope_unscaled":                # the rotary columns' scores without the scale
        unscaled = options.get("scale") or 1 / math.sqrt(q.shape[-1])
        q = np.concatenate([q[..., :latent], q[..., latent:] / unscaled], axis=-1)
    out, cache = attention_forward(q, k, v, **options)
    result = {"out": out, "lse": cache.lse}
    if gradients and "dout" in inputs:
        grads = attention_backward(inputs["dout"].astype(np.float64), cache)
        dk, dv = grads.dk, grads.dv
        if mixup.interleaved:                        # each kv head's copies summed back
            fold = lambda x: x.reshape(x.shape[:-3] + (groups, -1) + x.shape[-2:]).sum(axis=-4)
            dk, dv = fold(dk), fold(dv)
        dq = grads.dq
        if unscaled != 1.0:
            dq = np.concatenate([dq[..., :latent], dq[..., latent:] / unscaled], axis=-1)
        result.update(dq=dq, dk=dk, dv=dv, dbias=grads.dbias, dsinks=grads.dsinks,
                      dalibi_slopes=grads.dalibi_slopes)
        if latent is not None:                       # MLA: kv's gradient, from both of its uses
            dkv = dk.copy()
            at = slice(None, latent) if mixup.latent != "values_last" else slice(dk.shape[-1] - latent, None)
            dkv[..., at] += dv
            result["dkv"] = dkv
    return result


def _softcap_last(softcap, score_mod=None):
    """A score_mod that applies the softcap after the bias and ALiBi (and after the case's own
    score_mod): S = softcap tanh(S / softcap) as the pipeline's last step before the masks."""
    inner = None if score_mod is None else numpy_mod(score_mod)
    def mod(score, *indices):
        s = score if inner is None else inner(score, *indices)
        return softcap * np.tanh(s / softcap)
    return mod


def _mixups(case):
    """The mix-ups that apply to the case (Mixup), the scale fitted to the candidate aside."""
    o, q, k = case.options, case.inputs["q"], case.inputs["k"]
    n_q, n_k = q.shape[-2], k.shape[-2]
    causal = o.get("causal", False)
    align = causal if isinstance(causal, str) else o.get("align") or "top_left"
    other = {"top_left": "bottom_right", "bottom_right": "top_left"}[align]
    if causal:
        said = f"the case says causal={align!r}"
        yield Mixup(f"causal={other!r}", said, {"causal": other, "align": None})
        if other == "bottom_right" and n_q > n_k and o.get("fully_masked", "zero") != "uniform":
            yield Mixup(f"causal={other!r} with fully masked rows the mean of v (MLX's causal)", said,
                        {"causal": other, "align": None, "fully_masked": "uniform"})
        yield Mixup("no causal mask", said, {"causal": None, "align": o.get("align")})
        for shift, did in ((-1, "the diagonal excluded"), (1, "one key of the future kept")):
            keep = _causal_keep(n_q, n_k, align, shift)
            mask = keep if "mask" not in o else keep & (np.asarray(o["mask"]) != 0)
            yield Mixup(f"causal masking off by one ({did})", said,
                        {"causal": None, "align": align if "window" in o else None, "mask": mask})
    else:
        for alignment in ("top_left", "bottom_right"):
            yield Mixup(f"causal={alignment!r}", "the case has no causal mask",
                        {"causal": alignment, "align": None})
    d_k, scale = q.shape[-1], o.get("scale")
    case_scale = f"the case's is {scale:g}" if scale is not None else "the case's is 1/sqrt(d_k)"
    for value, name in ((1.0, "1"), (math.sqrt(d_k), f"sqrt(d_k) = {math.sqrt(d_k):g}"),
                        (1 / d_k, f"1/d_k = {1 / d_k:g} (the scale applied twice)")):
        if scale is None or not math.isclose(scale, value):
            yield Mixup(f"scale {name}", case_scale, {"scale": value})
    if "softcap" in o:
        yield Mixup("no softcap", f"the case's softcap is {o['softcap']:g}", {"softcap": None})
        if "bias" in o:
            yield Mixup("softcap applied after the bias", "the case applies it before",
                        {"softcap": None, "score_mod": _softcap_last(o["softcap"], o.get("score_mod"))})
    if "mask" in o:
        yield Mixup("the mask inverted (True = ignore)", "the case's mask is True = attend",
                    {"mask": np.asarray(o["mask"]) == 0})
    if "window" in o:
        if not causal:
            yield Mixup(f"the window aligned {other}", f"the case aligns it {align}", {"align": other})
        left, right = o["window"]
        for change, did in (((1, 1), "both sides + 1"), ((-1, -1), "both sides - 1"),
                            ((1, 0), "left + 1"), ((-1, 0), "left - 1"), ((0, 1), "right + 1"),
                            ((0, -1), "right - 1")):
            moved = tuple(w + c if w >= 0 else w for w, c in zip((left, right), change))
            if moved != (left, right) and all(m >= 0 for m, w in zip(moved, (left, right)) if w >= 0):
                yield Mixup(f"window={moved} ({did})", f"the case's window is {(left, right)}",
                            {"window": moved})
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        yield Mixup("interleaved grouped-query heads (query head h with kv head h % H_kv)",
                    "the case groups them (h // G)", {}, interleaved=True)
    if "rope" in o:
        yield from _rope_mixups(o["rope"], o, n_q, n_k, d_k)
    if case.scales:
        yield from _descale_mixups(case.scales)
    if case.topk is not None:
        yield from _topk_mixups(case, q.shape, k.shape)
    if case.latent is not None and case.latent < d_k:
        said = f"the case's values are kv's first head_dim_v = {case.latent} columns"
        yield Mixup(f"the values read from kv's last {case.latent} columns", said, {}, latent="values_last")
        yield Mixup(f"the scores of the rotary columns (past {case.latent}) not scaled",
                    "the case scales every column's", {}, latent="rope_unscaled")


def _descale_mixups(scales):
    """float8's mix-ups, each a rerun on inputs dequantized otherwise: one scale a tensor (the
    first head's, where the case's vary) for all of them, or for one; each descale dropped, or
    applied twice."""
    varying = {name: (stored, descale) for name, (stored, descale) in scales.items() if np.ptp(descale) > 0}
    if varying:
        yield Mixup("the first head's descale of each tensor for every head and batch entry (one scale a "
                    "tensor)", "the case's descales vary", {},
                    inputs={name: stored * np.ravel(descale)[0] for name, (stored, descale) in varying.items()})
    for name, (stored, descale) in scales.items():
        said = f"the case's values of {name} are its float8 values times {name}_descale"
        yield Mixup(f"{name}_descale dropped", said, {}, inputs={name: stored})
        yield Mixup(f"{name}_descale applied twice", said, {}, inputs={name: stored * descale * descale})
        if name in varying and len(varying) > 1:
            first = np.ravel(descale)[0]
            yield Mixup(f"the first head's {name}_descale ({first:.4g}) for every head and batch entry",
                        said, {}, inputs={name: stored * first})


def _rope_mixups(rope, o, n_q, n_k, d_k):
    """The rotary embeddings' mix-ups: the other layout (the one peers report most), no rope,
    the rotary width the whole head's, the queries at the first N_q keys' positions (top-left,
    from 0 without an offset) where they are not already."""
    layout = rope.get("layout", "half")
    other = {"half": "interleaved", "interleaved": "half"}[layout]
    names = {"half": "half-split pairs (GPT-NeoX, rotate_half)", "interleaved": "interleaved pairs (GPT-J)"}
    changed = lambda **change: {"rope": {**rope, **change}}
    yield Mixup(f"rope_layout={other!r}, {names[other]}", f"the case says rope_layout={layout!r}",
                changed(layout=other))
    yield Mixup("no rotary embedding", f"the case turns q and k (rope_layout={layout!r})", {"rope": None})
    if rope.get("rotary_dim") not in (None, d_k):
        yield Mixup(f"rope_rotary_dim={d_k} (the whole head)", f"the case's is {rope['rotary_dim']}",
                    changed(rotary_dim=None))
    keys = np.asarray(rope.get("positions_k", np.arange(n_k)))
    first, given = keys[:n_q], rope.get("positions_q")
    now = np.arange(n_k - n_q, n_k) if given is None else given
    if n_q < n_k and o.get("cu_seqlens_q") is None and not np.array_equal(first, now):
        yield Mixup("the queries' rope positions from 0 (top-left: the first keys' positions)",
                    "the case's queries have the last keys' positions" if given is None else
                    "the case gives rope_positions_q", changed(positions_q=first))


def _topk_mixups(case, q_shape, k_shape):
    """Sparse top-k's mix-ups: each index read one key over, -1 read as the last key (Python's and
    torch's negative indexing), a key listed twice counted once; with key blocks, the block size
    twice or half the case's."""
    indices, length, blocks = case.topk
    said = "the case's queries attend to the keys topk_indices list"
    valid = indices >= 0
    yield Mixup("the indices read one key over (index + 1)", said, {"topk_indices": np.where(valid, indices + 1, -1)})
    if (indices == -1).any():
        yield Mixup("-1 read as the last key (negative indexing)", said,
                    {"topk_indices": np.where(indices == -1, k_shape[-2] - 1, indices)})
    if topk_lists(indices, length, q_shape, k_shape).repeats:          # some row lists a key more than once
        yield Mixup("a key listed twice counted once", said,
                    {"topk_indices": _once(indices, length, k_shape[-2]), "topk_length": None})
    if blocks is not None:
        chosen, size = blocks
        for other in (2 * size, size // 2):
            if other >= 1 and other != size:
                yield Mixup(f"topk_block_size={other}", f"the case's is {size}",
                            {"topk_indices": block_indices(chosen, other, k_shape[-2])})


def _once(indices, length, n_k):
    """The lists [..., N_q, K] (and topk_length, or None) with each row's keys listed once: sorted,
    -1 for each repeat and for each entry that names no key (listed)."""
    ordered = np.sort(np.where(listed(indices, length, n_k), indices, -1), axis=-1)
    again = np.zeros(ordered.shape, bool)
    again[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    return np.where(again, -1, ordered)


def _causal_keep(n_q, n_k, align, shift):
    """[N_q, N_k] the causal keep-mask of `align` with its diagonal moved by `shift` keys."""
    offset = n_k - n_q if align == "bottom_right" else 0
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + offset + shift


def _both(first, second):
    """The two mix-ups at once, or None where they change one option (or both regroup heads,
    or both change MLA's inputs, or the same input)."""
    if set(first.change) & set(second.change) or (first.interleaved and second.interleaved) \
            or (first.latent and second.latent) or set(first.inputs or {}) & set(second.inputs or {}):
        return None
    return Mixup(f"{first.did} and {second.did}", f"{first.said}; {second.said}",
                 {**first.change, **second.change}, first.interleaved or second.interleaved,
                 first.latent or second.latent, {**(first.inputs or {}), **(second.inputs or {})} or None)


def diagnose(case, truth, failing, noise=None, laid_out=None):
    """Lines naming the mix-up the failing tensors match; [] when none does.

    case: the split case; truth: the oracle's results; failing: the names of the tensors
    that failed (their candidates are in case.candidates); noise: {name: rel L2 of the
    baseline} (the rounding of the case's precision; default 0); laid_out: a rerun's results
    (of case.inputs) in the candidate's layout (a paged KV cache's: runs.unpaged), or None
    where they are laid out alike.
    """
    candidates = {n: np.asarray(case.candidates[n]).astype(np.float64) for n in failing}
    if case.lse_base == "2" and "lse" in candidates:
        candidates["lse"] = candidates["lse"] * math.log(2)
    noise = {n: (noise or {}).get(n, 0.0) for n in candidates}
    distance = {n: rel_l2(candidates[n], truth[n]) for n in candidates}
    judge = _Judge(candidates, distance, noise)
    found = (_lse_base(candidates, truth, case, judge) or _empty_rows(candidates, truth)
             or _latent_parts(candidates, truth, case, judge) or _written_once(candidates, truth, case, judge))
    if found:
        return found
    gradients = any(n in candidates for n in GRADIENTS)
    rerun = lambda mixup: (laid_out or (lambda x: x))(_rerun(case.inputs, case.options, gradients, mixup,
                                                                case.latent))
    helpful = []
    with np.errstate(all="ignore"):
        found = judge.match(truth, case)                # a known factor of the oracle's
        if found:
            return [found]
        singles = list(_mixups(case))
        for index, mixup in enumerate(singles + _fitted_scale(case, candidates, truth, rerun)):
            alternative = _tried(rerun, mixup)
            if alternative is None:
                continue
            found = judge.match(alternative, case, mixup)
            if found:
                return [found]
            gain = judge.gain(alternative)
            if gain > 1 and index < len(singles):       # the fitted scale was fitted alone
                helpful.append((gain, index))
        if _scores(case) <= PAIR_SCORES:
            helpful = [singles[i] for i in sorted(i for _, i in sorted(helpful, reverse=True)[:PAIRED])]
            for i, first in enumerate(helpful):
                for second in helpful[i + 1:]:
                    both = _both(first, second)
                    alternative = None if both is None else _tried(rerun, both)
                    found = alternative is not None and judge.match(alternative, case, both)
                    if found:
                        return [found]
    return []


def _lse_base(candidates, truth, case, judge):
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


def _empty_rows(candidates, truth):
    """Lines for the split-KV merges' mix-ups around rows with no key (the oracle's lse -inf),
    which no rerun shows: NaN in those rows alone (two empty states merged, exp(-inf - (-inf)));
    a finite lse there (an empty split's finite sentinel carried through); lse +inf in rows that
    have keys (an empty split's +inf, FlashAttention's lse of a row with no key, merged as a
    score). [] when none of them."""
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
    return lines


def _latent_parts(candidates, truth, case, judge):
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


def _written_once(candidates, truth, case, judge):
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


def _tried(rerun, mixup):
    """rerun(mixup), or None where the mix-up makes no valid case."""
    try:
        return rerun(mixup)
    except (ValueError, TypeError):
        return None


def _scores(case):
    """The number of scores of the case (the cost of one rerun)."""
    q, k = case.inputs["q"], case.inputs["k"]
    return q.size // q.shape[-1] * k.shape[-2]


def _fitted_scale(case, candidates, truth, rerun):
    """[Mixup] of the scale that fits the failing candidates best, when it is off the case's
    by more than 1e-4 relatively: Gauss-Newton on log(scale) over the tensors together, each
    weighted by 1 / ||oracle||^2, each step's directions u = d result / d log(scale) by a
    difference of the oracle rerun (rerun(mixup): diagnose's, None for an invalid case)."""
    d_k, given = case.inputs["q"].shape[-1], case.options.get("scale")
    scale = given if given is not None else 1 / math.sqrt(d_k)
    at = lambda s: _tried(rerun, Mixup("", "", {"scale": s}))
    clean = lambda x: np.nan_to_num(x, nan=0, posinf=0, neginf=0)
    weights = {n: float(np.sum(clean(truth[n]) ** 2)) for n in candidates
               if n in ("out", "lse", *GRADIENTS) and truth.get(n) is not None}
    weights = {n: 1 / w for n, w in weights.items() if w > 0}
    if not weights:
        return []
    factor, now = 1.0, truth
    for _ in range(FIT_STEPS):
        shifted = at(scale * factor * (1 + FIT_STEP))
        if shifted is None:
            return []
        eu = uu = 0.0
        for name, w in weights.items():
            u = clean((shifted[name] - now[name]) / FIT_STEP)
            eu += w * float(np.sum(clean(candidates[name] - now[name]) * u))
            uu += w * float(np.sum(u * u))
        if uu == 0:
            return []
        factor *= math.exp(float(np.clip(eu / uu, -1, 1)))
        now = at(scale * factor)
        if now is None:
            return []
    if abs(factor - 1) <= 1e-4:
        return []
    said = f"the case's is {given:g}" if given is not None else f"the case's is 1/sqrt(d_k) = {scale:.6g}"
    return [Mixup(f"scale {scale * factor:.6g} ({factor:.4g} times the case's)", said,
                  {"scale": scale * factor})]


class _Judge:
    """Whether a rerun explains the failing candidates (module docstring)."""

    def __init__(self, candidates, distance, noise):
        self.candidates, self.distance, self.noise = candidates, distance, noise

    def explains(self, err, name):
        """Whether a rerun at rel L2 `err` from the candidate explains it (module docstring)."""
        return self.near(err, name) and err * CLEARLY <= self.distance[name]

    def near(self, err, name):
        """Whether the candidate is as near a rerun as rounding lets it be, and nearer than
        to the oracle: one of the tensors a rerun explains, if another is clearly nearer."""
        dist, noise = self.distance[name], NOISE * self.noise[name]
        return (err <= max(NEAR, noise) and err * CLOSER <= dist) or (err <= min(noise, NOISY) and err <= dist)

    def gain(self, alternative):
        """How many times nearer the rerun is than the oracle, in the tensor it brings nearest."""
        gains = [self.distance[n] / max(rel_l2(x, alternative[n]), 1e-300)
                 for n, x in self.candidates.items() if alternative.get(n) is not None]
        return max(gains, default=0.0)

    def match(self, alternative, case, mixup=None):
        """The diagnosis line if the rerun (the oracle itself when mixup is None) explains
        every failing tensor, directly or as a factor of it; else ''."""
        parts = []
        for name, cand in self.candidates.items():
            ref = alternative.get(name)
            if ref is None:                 # a forward-only rerun says nothing of the gradients
                continue
            err = rel_l2(cand, ref)
            if mixup is not None and self.near(err, name):
                parts.append((name, "", err))
                continue
            fitted = _factor(cand, ref, case, name, self)
            if fitted is None and mixup is None:
                fitted = _shifted_rows(cand, ref, name, self)
            if fitted is None:
                return ""
            parts.append((name, *fitted))
        if not any(self.explains(err, name) for name, _, err in parts):
            return ""
        direct = [n for n, how, _ in parts if not how]
        lines = []
        if direct:
            err = max(e for n, how, e in parts if not how)
            verb = "matches" if len(direct) == 1 else "match"
            lines.append(f"{', '.join(direct)} {verb} {mixup.did} (rel L2 {err:.1e}); {mixup.said}")
        by_how = {}
        for name, how, err in parts:
            if how:
                by_how.setdefault(how, []).append((name, err))
        for how, named in by_how.items():
            where = f"the oracle under {mixup.did}" if mixup is not None else "the oracle"
            err = max(e for _, e in named)
            verb = "matches" if len(named) == 1 else "match"
            lines.append(f"{', '.join(n for n, _ in named)} {verb} {where} {how} (rel L2 {err:.1e})"
                         + (f"; {mixup.said}" if mixup is not None and not direct else ""))
        return "; ".join(lines)


def _known_factors(case):
    """{factor: its name} of the constants a kernel may multiply a result by wrongly."""
    d_k, given = case.inputs["q"].shape[-1], case.options.get("scale")
    scale = given if given is not None else 1 / math.sqrt(d_k)
    known = {-1.0: "negated", 2.0: "times 2", 0.5: "times 1/2",
             1 / scale: f"times {1 / scale:g} = 1 / scale: a backward without the scale",
             scale: f"times {scale:g}: the scale applied once more"}
    p = float(case.options.get("dropout_p", 0) or 0)
    if "dropout_mask" in case.options and 0 < p < 1:
        known[1 - p] = f"times (1 - p) = {1 - p:g}: dropout without the 1 / (1 - p) rescaling"
    return known


def _factor(cand, ref, case, name, judge):
    """(how, rel L2) where cand is a known constant times ref (known_factors), over the whole
    tensor or head by head (heads on axis -3; -2 for lse), the other heads equal; else None."""
    known = _known_factors(case)
    near = lambda c: next((f for f in known if math.isclose(c, f, rel_tol=1e-2)), None)
    finite = np.isfinite(ref) & np.isfinite(cand)
    if not finite.all():
        return None
    dot = lambda a, b, axes=None: np.sum(a * b, axis=axes)
    whole = float(dot(ref, ref))
    if whole == 0:
        return None
    factor = near(float(dot(cand, ref)) / whole)
    if factor is not None:
        err = rel_l2(cand, factor * ref)
        if judge.explains(err, name):
            return known[factor], err
    axis = -2 if name == "lse" else -3
    if ref.ndim < -axis or ref.shape[axis] < 2:
        return None
    others = tuple(a for a in range(ref.ndim) if a != ref.ndim + axis)
    norms = dot(ref, ref, others)
    fits = np.divide(dot(cand, ref, others), norms, out=np.ones_like(norms), where=norms > 0)
    factors = [1.0 if math.isclose(c, 1, rel_tol=1e-2) else near(c) for c in fits]
    if None in factors or all(f == 1.0 for f in factors):
        return None
    shape = [1] * ref.ndim
    shape[axis] = len(factors)
    err = rel_l2(cand, np.reshape(factors, shape) * ref)
    if not judge.explains(err, name):
        return None
    wrong = [h for h, f in enumerate(factors) if f != 1.0]
    hows = {known[factors[h]] for h in wrong}
    heads = f"head{'s' if len(wrong) > 1 else ''} {', '.join(map(str, wrong))}"
    return f"with {heads} {' / '.join(sorted(hows))}", err


def _shifted_rows(cand, ref, name, judge):
    """(how, rel L2) where cand is ref with its rows (the query axis: -2, -1 for lse) moved by
    one, as a kernel that stores each row one place off; else None."""
    if name not in ("out", "lse"):
        return None
    axis = -1 if name == "lse" else -2
    if ref.ndim < -axis or ref.shape[axis] < 2:
        return None
    for shift in (1, -1):
        err = rel_l2(cand, np.roll(ref, shift, axis=axis))
        if judge.explains(err, name):
            return f"with each query row moved {'down' if shift > 0 else 'up'} by one", err
    return None
