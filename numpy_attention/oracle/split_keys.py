"""Results computed over the keys in parts and merged by their lse (split-KV decoding, ring
attention, a KV cache read in chunks), judged against the oracle of all the keys.

    parts  = key_parts(arrays, at)                 the case on keys [0, at_1), [at_1, at_2), ...
    report = crosscheck_merged(arrays, at, results)     results: each part's out and lse

The merge is combine.py's, in float64, rounded back to the dtypes the parts came in:

    lse = log sum_p exp(lse_p)        out = sum_p exp(lse_p - lse) out_p

It compounds the parts' roundings: each part's rounded out, and its lse's error, which moves
that part's weight in the merged out by as much (d out / d lse_p = w_p (out_p - out)). One
call's baseline has neither, so its bound would hold the merge to more than an honest kernel
gives. Each baseline is split the same way instead: its parts' out and lse stored in the
dtypes of the candidate's, merged by the same formula and rounded alike, and the rule
(rule.py) holds the merged candidate to the merged baselines.

A split case holds q, k, v and the scale (its precision, layout, lse base, and a fully_masked
policy that no row of it needs): options along the keys (a mask, a bias, a diagonal) or with
a logit of their own in every row (a sink) would have to be cut with the keys, or be counted
once per part.
"""
import numpy as np

from .._checks import to_numpy
from ..combine import combine_forward
from .case import split_case
from .rule import judge
from .runs import baselines, case_ways
from .schema import CaseError
from .verdicts import crosscheck

SPLITTABLE = ("q", "k", "v", "scale", "precision", "fully_masked", "layout", "lse_base")   # (fully_masked:
MERGED = ("out", "lse")                                                   # no row without keys to apply it)


def key_parts(arrays, at, layout="bhnd"):
    """The case's arrays on each part of its keys: k and v ([..., H_kv, N_k, d], or
    [..., N_k, H_kv, d] in layout 'bnhd') cut at the increasing key indices `at` (an int or a
    sequence, 0 < at_1 < ... < N_k); CaseError for another key or cut."""
    other = sorted(set(arrays) - set(SPLITTABLE))
    if other:
        raise CaseError(f"a split case holds {', '.join(SPLITTABLE)}; it has {', '.join(other)}")
    missing = [name for name in ("q", "k", "v") if name not in arrays]
    if missing:
        raise CaseError(f"missing key {missing[0]!r}")
    axis = -3 if layout == "bnhd" else -2
    k, v = np.asarray(arrays["k"]), np.asarray(arrays["v"])
    if k.ndim < -axis or v.ndim < -axis:
        raise CaseError(f"k and v must have a key axis ({layout}), got k {k.shape}, v {v.shape}")
    n_k = k.shape[axis]
    cuts = np.atleast_1d(np.asarray(at, dtype=object))
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in cuts.ravel()):
        raise CaseError(f"at must be key indices (ints), got {at!r}")
    at = tuple(int(i) for i in cuts.ravel())
    if not at or any(a >= b for a, b in zip((0,) + at, at + (n_k,))):
        raise CaseError(f"at must cut N_k = {n_k} keys at increasing indices in (0, {n_k}), got {at}")
    edges = (0,) + at + (n_k,)
    cut = lambda x, a, b: np.take(x, np.arange(a, b), axis=axis)
    return [{**arrays, "k": cut(k, a, b), "v": cut(v, a, b)} for a, b in zip(edges, edges[1:])]


def merged(parts, lse_base="e", layout="bhnd"):
    """{out, lse}: the parts' out [..., H, N_q, d_v] (layout 'bnhd': [..., N_q, H, d_v]) and lse
    [..., H, N_q] (in base e or '2') merged by lse (combine.combine_forward) in float64, in the
    dtypes of the first part's."""
    laid = (lambda x: np.swapaxes(x, -2, -3)) if layout == "bnhd" else (lambda x: x)   # [..., H, N, d]
    wide = lambda name, f: np.stack([f(np.asarray(part[name]).astype(np.float64)) for part in parts])
    out, lse, _ = combine_forward(wide("out", laid), wide("lse", lambda x: x), base=2 if lse_base == "2" else "e")
    return {"out": laid(out).astype(np.asarray(parts[0]["out"]).dtype),
            "lse": lse.astype(np.asarray(parts[0]["lse"]).dtype)}


def crosscheck_merged(arrays, at, results, *, precision=None, layout=None, lse_base=None, **settings):
    """The CrosscheckReport of the candidate's parts merged: `results` holds each part's out
    and lse (key_parts' order; arrays as crosscheck takes them), merged by lse and judged
    against the oracle of all the keys, each baseline split, stored in the parts' dtypes and
    merged the same way (module docstring). precision, layout, lse_base: crosscheck's, or keys
    of `arrays`; settings: crosscheck's others (workers, progress, ...)."""
    arrays = {name: to_numpy(x, name) for name, x in arrays.items() if x is not None}
    read = {"precision": precision, "layout": layout, "lse_base": lse_base}
    layout, lse_base = (str(read[name] or arrays.get(name, default)) for name, default in
                        (("layout", "bhnd"), ("lse_base", "e")))
    parts = key_parts(arrays, at, layout)
    if len(results) != len(parts):
        raise CaseError(f"results has {len(results)} parts for the {len(parts)} that at = {at!r} cuts")
    for p, result in enumerate(results):
        missing = [name for name in MERGED if result.get(name) is None]
        if missing:
            raise CaseError(f"results[{p}] has no {', '.join(missing)}: a merge needs each part's out and lse")
    results = [{name: to_numpy(result[name], f"results[{p}][{name!r}]") for name in MERGED}
               for p, result in enumerate(results)]
    for p, result in enumerate(results):
        lse = np.asarray(result["lse"], np.float64)
        if np.isnan(lse).any() or np.isposinf(lse).any():
            raise CaseError(f"results[{p}]'s lse holds NaN or +inf, which no merge can weigh: judge that part "
                            f"alone (crosscheck)")
    candidate = merged(results, lse_base, layout)
    named = split_case({**arrays, **candidate}, **read).precision.name         # the whole case, checked
    cases = [split_case({**part, **result}, **{**read, "precision": named}) for part, result in zip(parts, results)]
    ways = case_ways(cases[0], False)
    stored = [[{name: base[name].astype(result[name].dtype) for name in MERGED} for base in baselines(case, False)]
              for case, result in zip(cases, results)]                        # ([..., H, N, d], base e)
    by_way = {names[0]: merged([part[number] for part in stored]) for number, (names, _) in enumerate(ways)}

    def judge_merged(name, candidate, oracle, baseline, *, baseline_names, **kwargs):
        return judge(name, candidate, oracle, [by_way[way][name] for way in baseline_names],
                     baseline_names=baseline_names, **kwargs)

    given = {name: x for name, x in read.items() if x is not None}
    return crosscheck(**arrays, **candidate, **given, judge=judge_merged, **settings)
