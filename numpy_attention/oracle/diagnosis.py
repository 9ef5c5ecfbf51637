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

Before any rerun, the mix-ups named from the candidate and the oracle's results alone
(named.py).
"""
import math

import numpy as np

from .mixups import Mixup, case_mixups, combined, rerun_oracle
from .named import named_directly, rel_l2
from .schema import GRADIENTS, ROWS

CLOSER = 100.0          # a rerun explains a tensor this much nearer than the oracle,
NEAR = 1e-2             # and within this rel L2 of it;
NOISE = 3.0             # or within this many times the baseline's rel L2 (the rule's k),
NOISY = 0.1             # up to this rel L2,
CLEARLY = 2.0           # and this much nearer than the oracle
PAIR_SCORES = 2 ** 20   # pairs of mix-ups are tried on cases of at most this many scores,
PAIRED = 6              # of the mix-ups that bring the candidate nearest, this many
FIT_STEPS = 4           # Gauss-Newton steps of the scale fitted to the failing tensors,
FIT_STEP = 2.0 ** -20   # each one's directions by a difference of log(scale) this large


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
    found = named_directly(candidates, truth, case, judge)
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


def _known_factors(case, name):
    """{factor: its name} of the constants a kernel may multiply the result `name` by wrongly."""
    d_k, given = case.inputs["q"].shape[-1], case.options.get("scale")
    scale = given if given is not None else 1 / math.sqrt(d_k)
    unscaled = ("the largest q k^T before the softmax scale (FlashAttention's row_max): max_logits is "
                "after it, row_max * scale" if name == "max_logits" else "a backward without the scale")
    known = {-1.0: "negated", 2.0: "times 2", 0.5: "times 1/2",
             1 / scale: f"times {1 / scale:g} = 1 / scale: {unscaled}",
             **({math.log2(math.e): "times log2(e) = 1.4427: in base 2 (a kernel's exp2 units, S log2 e)"}
                if name == "max_logits" else {}),
             scale: f"times {scale:g}: the scale applied once more"}
    p = float(case.options.get("dropout_p", 0) or 0)
    if "dropout_mask" in case.options and 0 < p < 1:
        known[1 - p] = f"times (1 - p) = {1 - p:g}: dropout without the 1 / (1 - p) rescaling"
    return known


def _factor(cand, ref, case, name, judge):
    """(how, rel L2) where cand is a known constant times ref (known_factors), over the whole
    tensor or head by head (heads on axis -3; -2 for lse and max_logits, -1 for a max_logits
    given per head), the other heads equal; else None."""
    known = _known_factors(case, name)
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
    per_head = name == "max_logits" and ref.ndim == 1 and case.inputs["q"].ndim >= 3   # [H]: max_logits'
    axis = -1 if per_head else -2 if name in ROWS else -3                # the heads' axis
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
    """(how, rel L2) where cand is ref with its rows (the query axis: -2, -1 for lse and
    max_logits) moved by one, as a kernel that stores each row one place off; else None."""
    if name not in ("out",) + ROWS or name == "max_logits" and ref.ndim < 2:   # (not [H], per head)
        return None
    axis = -1 if name in ROWS else -2
    if ref.ndim < -axis or ref.shape[axis] < 2:
        return None
    for shift in (1, -1):
        err = rel_l2(cand, np.roll(ref, shift, axis=axis))
        if judge.explains(err, name):
            return f"with each query row moved {'down' if shift > 0 else 'up'} by one", err
    return None
