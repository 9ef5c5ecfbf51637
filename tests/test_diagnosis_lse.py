"""The diagnosis of lse conventions and split-KV merges: lse in the other base (both ways), and
the merges peers shipped, written here: two empty states merged into NaN, an empty split's
finite sentinel, an empty split's +inf merged as a score. Each named; the honest merge
(combine_forward) passes."""
import math

import numpy as np
import pytest

import numpy_attention as na

RNG = np.random.default_rng(11)
Q, DOUT = RNG.standard_normal((1, 2, 6, 8)), RNG.standard_normal((1, 2, 6, 8))
K, V = RNG.standard_normal((1, 2, 8, 8)), RNG.standard_normal((1, 2, 8, 8))
MASK = np.ones((6, 8), bool)
MASK[1] = MASK[4] = False            # rows 1 and 4: no key at all (in both heads: 4 rows)
MASK[2, 4:] = MASK[5, 4:] = False     # rows 2 and 5: the second split empty
SPLITS = (slice(0, 4), slice(4, 8))


def partials():
    """(outs [2, ...], lses [2, ...]): attention over each half of the keys, -inf for no key."""
    parts = [na.attention_forward(Q, K[..., s, :], V[..., s, :], mask=MASK[:, s]) for s in SPLITS]
    return np.stack([out for out, _ in parts]), np.stack([cache.lse for _, cache in parts])


def naive_merge(outs, lses):
    """The merge without a guard: m = max lse_s, w_s = exp(lse_s - m)."""
    with np.errstate(invalid="ignore"):
        m = lses.max(axis=0)
        w = np.exp(lses - m)
        total = w.sum(axis=0)
        return (w[..., None] * outs).sum(axis=0) / total[..., None], m + np.log(total)


def sentinel_merge(outs, lses):
    """An empty split's lse held as a finite sentinel, -1e30, then merged."""
    return naive_merge(outs, np.where(np.isneginf(lses), -1e30, lses))


def plus_inf_merge(outs, lses):
    """An empty split's lse as FlashAttention writes a row with no key, +inf, merged as a score
    with log-sum-exp unshifted."""
    lses = np.where(np.isneginf(lses), np.inf, lses)
    with np.errstate(invalid="ignore", over="ignore"):
        lse = np.log(np.exp(lses).sum(axis=0))
        return (np.exp(lses - lse)[..., None] * outs).sum(axis=0), lse


def judged(merge):
    out, lse = merge(*partials())
    return na.crosscheck(q=Q, k=K, v=V, mask=MASK, out=out, lse=lse)


def test_the_honest_merge_passes():
    report = judged(lambda outs, lses: na.combine_forward(outs, lses)[:2])
    assert report, report


@pytest.mark.parametrize("merge, words", [
    (naive_merge, "out, lse are NaN in 4 of the 4 query rows with no key, and only there: a merge of two empty"),
    (sentinel_merge, "lse is finite (-1e+30) in 4 of the 4 query rows with no key, where -inf is expected"),
    (plus_inf_merge, "lse is +inf in 4 query rows that have keys: an empty split's +inf"),
], ids=["two-empty-states", "finite-sentinel", "plus-inf-merged"])
def test_each_merge_mixup_is_named(merge, words):
    report = judged(merge)
    assert not report and any(words in line for line in report.diagnosis), report


@pytest.mark.parametrize("given, said, words", [
    (1 / math.log(2), "e", "lse matches lse in base 2 (rel L2 "),
    (math.log(2), "2", "lse matches lse in base e (rel L2 "),
])
def test_lse_in_the_other_base_is_named_both_ways(given, said, words):
    """A candidate lse in base 2 read as base e (lse / ln 2), and one in base e read as base 2."""
    out, cache = na.attention_forward(Q, K, V)
    report = na.crosscheck(q=Q, k=K, v=V, out=out, lse=cache.lse * (given if said == "e" else 1), lse_base=said)
    assert not report and any(words in line and f"lse_base={'2' if said == 'e' else 'e'!r}" in line
                              for line in report.diagnosis), report
