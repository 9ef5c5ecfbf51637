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

A split case holds q, k, v and the scale (its precision, and a fully_masked policy that no row
of it needs): options along the keys (a mask, a bias, a diagonal) or with a row of their own
(sinks) would have to be cut with the keys, or be counted once per part.
"""
import numpy as np

from ..combine import combine_forward
from .case import split_case
from .rule import judge
from .runs import baselines, case_ways
from .schema import CaseError
from .verdicts import crosscheck

SPLITTABLE = ("q", "k", "v", "scale", "precision", "fully_masked")   # (no row without keys to apply it)
MERGED = ("out", "lse")


def key_parts(arrays, at):
    """The case's arrays on each part of its keys: k and v [..., H_kv, N_k, d] cut at the
    increasing key indices `at` (0 < at_1 < ... < N_k); CaseError for another key or cut."""
    other = sorted(set(arrays) - set(SPLITTABLE))
    if other:
        raise CaseError(f"a split case holds {', '.join(SPLITTABLE)}; it has {', '.join(other)}")
    n_k = np.shape(arrays["k"])[-2]
    at = tuple(int(i) for i in at)
    if not at or any(a >= b for a, b in zip((0,) + at, at + (n_k,))):
        raise CaseError(f"at must cut N_k = {n_k} keys at increasing indices in (0, {n_k}), got {at}")
    edges = (0,) + at + (n_k,)
    return [{**arrays, "k": np.asarray(arrays["k"])[..., a:b, :], "v": np.asarray(arrays["v"])[..., a:b, :]}
            for a, b in zip(edges, edges[1:])]


def merged(parts):
    """{out, lse}: the parts' out [..., H, N_q, d_v] and lse [..., H, N_q] merged by lse
    (combine.combine_forward) in float64, in the dtypes of the first part's."""
    wide = lambda name: np.stack([np.asarray(part[name]).astype(np.float64) for part in parts])
    out, lse, _ = combine_forward(wide("out"), wide("lse"))
    return {"out": out.astype(np.asarray(parts[0]["out"]).dtype),
            "lse": lse.astype(np.asarray(parts[0]["lse"]).dtype)}


def crosscheck_merged(arrays, at, results, **settings):
    """The CrosscheckReport of the candidate's parts merged: `results` holds each part's out
    and lse (key_parts' order), merged by lse and judged against the oracle of all the keys,
    each baseline split, stored in the parts' dtypes and merged the same way (module
    docstring). settings: crosscheck's (workers, progress, ...)."""
    parts = key_parts(arrays, at)
    if len(results) != len(parts):
        raise CaseError(f"results has {len(results)} parts for the {len(parts)} that at = {tuple(at)} cuts")
    for p, result in enumerate(results):
        missing = [name for name in MERGED if name not in result]
        if missing:
            raise CaseError(f"results[{p}] has no {', '.join(missing)}: a merge needs each part's out and lse")
    results = [{name: np.asarray(result[name]) for name in MERGED} for result in results]
    cases = [split_case({**part, **result}) for part, result in zip(parts, results)]
    ways = case_ways(cases[0], False)
    stored = [[{name: base[name].astype(result[name].dtype) for name in MERGED} for base in baselines(case, False)]
              for case, result in zip(cases, results)]
    by_way = {names[0]: merged([part[number] for part in stored]) for number, (names, _) in enumerate(ways)}

    def judge_merged(name, candidate, oracle, baseline, *, baseline_names, **kwargs):
        return judge(name, candidate, oracle, [by_way[way][name] for way in baseline_names],
                     baseline_names=baseline_names, **kwargs)

    return crosscheck(**arrays, **merged(results), judge=judge_merged, **settings)
