"""Max logits (QK-clip's statistic): every engine's cache.max_logits is each row's largest score
S, and crosscheck judges a kernel's, per row or per head."""
import math
import re

import ml_dtypes
import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.conformance import examples
from numpy_attention.conformance.grid import cases
from numpy_attention.conformance.kernels import KernelError
from numpy_attention.conformance.supports import declare
from numpy_attention.oracle import CaseError
from numpy_attention.paged import unpack_rows

rng = np.random.default_rng(0)
Q, K, V = rng.standard_normal((2, 4, 9, 8)), rng.standard_normal((2, 2, 11, 8)), rng.standard_normal((2, 2, 11, 8))
MASK = rng.random((2, 1, 9, 11)) < 0.5
MASK[:, :, 3] = False                                               # a row with no key
LISTS = rng.integers(-1, 11, (2, 2, 9, 6))                          # a kv head's lists, with repeats and pads
LISTS[0, 0, 0] = [4, 4, 4, -1, -1, -1]                              # one key, listed 3 times: its score
LISTS[1, 1, 4] = -1                                                 # a row with no key

OPTIONS = {
    "plain": {},
    "causal bottom_right, softcap": {"causal": "bottom_right", "softcap": 3.0},
    "bias, ALiBi, window": {"bias": rng.standard_normal((4, 9, 11)), "alibi_slopes": rng.random(4),
                            "window": (2, 1)},
    "sinks (not a score)": {"sinks": 3 + rng.standard_normal(4)},
    "mask with an empty row": {"mask": MASK},
    "score_mod, mask_mod": {"score_mod": lambda s, b, h, i, j: 1.3 * s + np.sin(s),
                            "mask_mod": lambda b, h, i, j: (i + j) % 3 != 0},
    "top-k lists with repeats": {"topk_indices": LISTS},
}
UNTILED = ("softcap",)


def by_definition(q, k, options):
    """Each row's largest score, written from the definitions: S = scale q k^T, softcap, + bias,
    - slope |i + N_k - N_q - j|, score_mod; the max over the kept keys (a listed key once)."""
    n_q, n_k = q.shape[-2], k.shape[-2]
    s = np.einsum("bhid,bhjd->bhij", q, np.repeat(k, q.shape[1] // k.shape[1], axis=1)) / math.sqrt(q.shape[-1])
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    keep = np.ones(s.shape, bool)
    if "softcap" in options:
        s = options["softcap"] * np.tanh(s / options["softcap"])
    if "bias" in options:
        s = s + options["bias"]
    if "alibi_slopes" in options:
        s = s - options["alibi_slopes"][:, None, None] * np.abs(i + n_k - n_q - j)
    if "score_mod" in options:
        b, h = np.arange(s.shape[0])[:, None, None, None], np.arange(s.shape[1])[None, :, None, None]
        s = options["score_mod"](s, b, h, i, j)
        keep &= options["mask_mod"](b, h, i, j)
    if options.get("causal") == "bottom_right":
        keep &= j <= i + n_k - n_q
    if "window" in options:
        left, right = options["window"]
        keep &= (j >= i - left) & (j <= i + right)
    if "mask" in options:
        keep &= options["mask"]
    if "topk_indices" in options:
        lists = np.repeat(options["topk_indices"], q.shape[1] // k.shape[1], axis=1)
        listed = (lists[..., None, :] == np.arange(n_k)[:, None]).any(-1)     # [B, H, N_q, N_k]
        keep &= listed
    return np.where(keep, s, -np.inf).max(axis=-1)


def engines(options):
    found = ["textbook", "blocked"] + ([] if any(name in options for name in UNTILED) else ["tiled"])
    return found + (["sparse"] if "topk_indices" in options else [])


@pytest.mark.parametrize("name", OPTIONS)
def test_every_engine_gives_each_rows_largest_score(name):
    options = OPTIONS[name]
    want = by_definition(Q, K, options)
    assert np.isneginf(want).any() == (name in ("mask with an empty row", "top-k lists with repeats"))
    for engine in engines(options):
        block = {"block_size": 4} if engine in ("tiled", "sparse") else {}
        cache = na.attention_forward(Q, K, V, implementation=engine, **block, **options)[1]
        assert cache.max_logits.shape == Q.shape[:-1] and cache.max_logits.dtype == np.float64
        np.testing.assert_array_equal(np.isneginf(cache.max_logits), np.isneginf(want), err_msg=engine)
        finite = np.isfinite(want)
        assert np.abs(cache.max_logits[finite] - want[finite]).max() < 1e-12, engine


def test_every_engine_on_packed_sequences_and_one_heads_arrays():
    cu_q, cu_k = np.array([0, 3, 3, 9]), np.array([0, 5, 7, 7])     # an empty sequence, one with no key
    q, k, v = Q[0], K[0, :, :7], V[0, :, :7]
    want = None
    for engine in ("textbook", "blocked", "tiled"):
        cache = na.attention_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal="bottom_right",
                                     implementation=engine)[1]
        want = cache.max_logits if want is None else want
        np.testing.assert_allclose(cache.max_logits, want, rtol=0, atol=1e-12)
        assert np.isneginf(cache.max_logits[:, 3:]).all() and np.isfinite(cache.max_logits[:, :3]).all()
    single = na.attention_forward(Q[0, 0], K[0, 0], V[0, 0])[1]      # [N_q, d]: max_logits [N_q]
    np.testing.assert_allclose(single.max_logits, by_definition(Q[:1, :1], K[:1, :1], {})[0, 0], atol=1e-12)


def test_max_logits_are_real_under_complex_step():
    cache = na.attention_forward(Q + 1e-30j * rng.standard_normal(Q.shape), K, V)[1]
    assert cache.max_logits.dtype == np.float64
    np.testing.assert_allclose(cache.max_logits, by_definition(Q, K, {}), atol=1e-12)


def test_against_torch_float64(torch):
    """An independent reference: torch's scores in float64, masked, their row max."""
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))
    bias = OPTIONS["bias, ALiBi, window"]["bias"]
    s = torch.matmul(t(Q), t(np.repeat(K, 2, axis=1)).transpose(-1, -2)) / math.sqrt(Q.shape[-1]) + t(bias)
    s = s.masked_fill(~t(MASK), float("-inf"))
    want = s.amax(dim=-1).numpy()
    cache = na.attention_forward(Q, K, V, bias=bias, mask=MASK, implementation="tiled", block_size=4)[1]
    np.testing.assert_array_equal(np.isneginf(cache.max_logits), np.isneginf(want))
    finite = np.isfinite(want)
    assert np.abs(cache.max_logits[finite] - want[finite]).max() < 1e-12


# ----------------------------------------------------------------------------- crosscheck

def kernel_case(dtype, **options):
    """A case of our float64 attention on the dtype's values standing in for a kernel: out in the
    dtype, lse and max_logits in float32."""
    q, k, v = (x.astype(dtype) for x in (Q, K, V))
    out, cache = na.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), **options)
    return dict(q=q, k=k, v=v, out=out.astype(dtype), lse=cache.lse.astype(np.float32), **options), \
        cache.max_logits.astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_crosscheck_judges_max_logits_per_row_and_per_head(dtype):
    case, max_logits = kernel_case(dtype, causal=True, mask=MASK)
    report = na.crosscheck(**case, max_logits=max_logits)
    assert report and [row.name for row in report.rows] == ["out", "lse", "max_logits"], report
    heads = np.max(max_logits, axis=(0, 2))                          # TransformerEngine's [H]
    report = na.crosscheck(**case, max_logits=heads)
    assert report and report.rows[2].name == "max_logits", report
    for wrong in (max_logits + 0.05, np.where(np.isneginf(max_logits), 0, max_logits)):
        assert not na.crosscheck(**case, max_logits=wrong)
    assert not na.crosscheck(**case, max_logits=heads * (1 + 2 ** -6))


def test_a_row_max_before_the_scale_is_named():
    case, max_logits = kernel_case(np.float32, causal=True)
    for given in (max_logits, np.max(max_logits, axis=(0, 2))):
        report = na.crosscheck(**case, max_logits=(given * math.sqrt(8)).astype(np.float32))
        assert not report and "FlashAttention's row_max" in report.diagnosis[0], report


def test_a_finite_max_logit_in_a_row_with_no_key_is_named():
    case, max_logits = kernel_case(np.float32, mask=MASK)
    report = na.crosscheck(**case, max_logits=np.where(np.isneginf(max_logits), -1e30, max_logits))
    assert not report and "max_logits is finite (-1e+30) in 8 of the 8 query rows with no key" in \
        " ".join(report.diagnosis), report


def test_a_paged_and_a_sparse_case():
    page_table, seqlens = np.array([[3, 0], [1, 4]]), np.array([6, 3])
    q, k_cache, v_cache = (rng.standard_normal(shape).astype(np.float32)
                           for shape in ((2, 2, 2, 8), (5, 1, 4, 8), (5, 1, 4, 8)))
    out, cache = na.attention_forward(q, k_cache, v_cache, page_table=page_table, cache_seqlens=seqlens,
                                      causal="bottom_right")
    rows = unpack_rows(cache.max_logits, cache.paged)               # [B, H, N_q], as the caller's q
    case = dict(q=q, k=k_cache, v=v_cache, out=out, page_table=page_table, cache_seqlens=seqlens,
                causal=np.array("bottom_right"))
    assert na.crosscheck(**case, max_logits=rows) and not na.crosscheck(**case, max_logits=rows[:, ::-1])
    case, max_logits = kernel_case(np.float32, topk_indices=LISTS)
    assert na.crosscheck(**case, max_logits=max_logits)
    assert not na.crosscheck(**case, max_logits=max_logits + np.log(3) * (max_logits > 0))


def test_the_same_verdicts_on_threads():
    case, max_logits = kernel_case(np.float32, causal=True)
    one, two = (na.crosscheck(**case, max_logits=max_logits, workers=n) for n in (1, 2))
    assert one.rows == two.rows


@pytest.mark.parametrize("shape", [(2, 4, 9, 1), (4, 9), (2, 4)])
def test_a_max_logits_of_another_shape_is_refused_naming_both(shape):
    case, _ = kernel_case(np.float32)
    with pytest.raises(CaseError, match=r"max_logits must have shape \(2, 4, 9\) .* or \(4,\) .*got "
                                        + re.escape(str(shape))):
        na.crosscheck(**case, max_logits=np.zeros(shape, np.float32))


# ----------------------------------------------------------------------------- conform

def test_conform_judges_the_max_logits_a_kernel_declares():
    grid = cases(dtypes=("float32", "bfloat16"), supports=("causal", "mask", "varlen", "paged", "max_logits"))
    assert all("max_logits" in case.outputs and "+max" in case.id for case in grid)
    for case in grid[:12]:
        assert na.conform.check(examples.numpy_float32, case), case.id

    @declare(kind="numpy", supports=("causal", "max_logits"))
    def before_the_scale(q, k, v, **options):                       # FlashAttention's row_max
        results = examples.numpy_float32(q, k, v, **options)
        return {**results, "max_logits": results["max_logits"] * math.sqrt(q.shape[-1])}
    report = na.conform.check(before_the_scale, grid[1])
    assert not report and "FlashAttention's row_max" in report.diagnosis[0], report
    forward_only = lambda q, k, v, **options: {"out": examples.numpy_float32(q, k, v, **options)["out"]}
    with pytest.raises(KernelError, match="returned no max_logits; .* return \\(out, lse, max_logits\\)"):
        na.conform.check(forward_only, grid[0])


def test_a_torch_kernel_returns_max_logits_third(torch):
    def sdpa(q, k, v, causal=False, **options):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal))
        s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return out, torch.logsumexp(s, -1), s.amax(-1)
    case = cases(dtypes=("float32",), supports=("causal", "lse", "max_logits"))[1]
    assert na.conform.check(sdpa, case, kind="torch")
    with pytest.raises(KernelError, match="returned 4 values"):
        na.conform.check(lambda q, k, v, **o: (*sdpa(q, k, v, **o), q), case, kind="torch")


def test_torch_candidates_pass_honest_and_fail_with_each_bug_named(torch):
    """The peers' ways (maxlogits_kernels.py), a few cases per dtype: no honest one fails; each
    planted bug fails, named (benchmarks/variant_sweeps.py --variant maxlogits: 200 a dtype)."""
    import maxlogits_kernels
    counts = maxlogits_kernels.sweep(6, seed=1)
    for (dtype, what), (judged, failed, named, not_run) in counts.items():
        if what == "honest":
            assert judged == 6 and failed == 0, (dtype, counts)
        else:
            assert judged and failed == named == judged and not not_run, (dtype, what, counts)


def test_a_single_heads_max_logits_is_judged_per_row():
    """q [N_q, d]: max_logits [N_q] is per row (the rows' shape wins), [1] the head's."""
    q, k, v = (x.astype(np.float32) for x in (Q[0, 0], K[0, 0], V[0, 0]))
    out, cache = na.attention_forward(q, k, v)
    assert na.crosscheck(q=q, k=k, v=v, out=out, max_logits=cache.max_logits)
    assert na.crosscheck(q=q, k=k, v=v, out=out, max_logits=cache.max_logits.max(keepdims=True))
    assert not na.crosscheck(q=q, k=k, v=v, out=out, max_logits=cache.max_logits[::-1].copy())
    lse = cache.lse.copy()
    lse[3] *= 2                                                        # one row's, not a head's
    report = na.crosscheck(q=q, k=k, v=v, out=out, lse=lse)
    assert not report and not any("head" in line for line in report.diagnosis), report


def test_one_heads_wrong_max_logits_is_named_by_its_head():
    case, max_logits = kernel_case(np.float32, causal=True)
    doubled = max_logits.copy()
    doubled[:, 1] *= 2
    report = na.crosscheck(**case, max_logits=doubled)
    assert not report and "with head 1 times 2" in report.diagnosis[0], report
    heads = max_logits.max(axis=(0, 2))
    heads[2] *= math.sqrt(8)                                           # head 2's before the scale
    report = na.crosscheck(**case, max_logits=heads)
    assert not report and "with head 2 times 2.82843 = 1 / scale" in report.diagnosis[0], report
