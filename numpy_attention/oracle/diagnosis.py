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

The mix-ups and their reruns are mixups.py's. The factors: -1, 2, 1/2, 1 / scale and scale,
1 - p (dropout not rescaled by 1 / (1 - p)); and rows of out or lse shifted by one (verdicts.py
adds: the [..., N, H, d] layout read as [..., H, N, d]).

Named from the candidate alone, before any rerun: lse in base 2 where the case says base e,
or the reverse; and split-KV merges' mix-ups in the rows with no key (the oracle's lse
-inf): NaN there and only there (two empty states merged), a finite lse there (an empty
split's sentinel), or lse +inf in rows that have keys (an empty split's +inf merged); MLA's
dkv missing one use; and a sparse top-k backward that writes each use's dk, dv to its key
instead of adding it (a key several queries list, or one lists twice, keeps one use's).
"""
import math

import numpy as np

from ..topk import counts, topk_lists
from .mixups import Mixup, case_mixups, combined, rerun_oracle
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


def rel_l2(x, ref):
    """||x - ref|| / ||ref|| over the finite entries (inf where their non-finite entries differ)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.array_equal(np.isfinite(x), np.isfinite(ref)):
        return math.inf
    finite = np.isfinite(ref)
    norm = float(np.linalg.norm(np.where(finite, ref, 0)))
    err = float(np.linalg.norm(np.where(finite, x - ref, 0)))
    return err / norm if norm > 0 else (0.0 if err == 0 else math.inf)


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
    rerun = lambda mixup: (laid_out or (lambda x: x))(rerun_oracle(case.inputs, case.options, gradients, mixup,
                                                                case.latent))
    helpful = []
    with np.errstate(all="ignore"):
        found = judge.match(truth, case)                # a known factor of the oracle's
        if found:
            return [found]
        singles = list(case_mixups(case))
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
                    both = combined(first, second)
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
