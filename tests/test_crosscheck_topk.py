"""crosscheck of sparse top-k attention: the case keys topk_indices (tokens, or key blocks with
topk_block_size) and topk_length, judged as the keep-mask (or log-multiplicity bias) they
make; torch candidates honest and with planted bugs (tests/topk_kernels.py; the longer sweep:
benchmarks/variant_sweeps.py --variant topk); bad keys refused by name."""
import numpy as np
import pytest
from optional import TORCH_REASON

import numpy_attention as na
from numpy_attention.oracle.schema import CaseError

torch = pytest.importorskip("torch", reason=TORCH_REASON)
import topk_kernels  # noqa: E402  (needs torch)

CASES = 20


@pytest.fixture(scope="module")
def counts():
    return topk_kernels.sweep(CASES, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", topk_kernels.DTYPES)
def test_honest_torch_candidates_pass(counts, dtype):
    judged, failed, _, _ = counts[(dtype, "honest")]
    assert judged == CASES and failed == 0, counts


@pytest.mark.slow
@pytest.mark.parametrize("bug", topk_kernels.BUGS)
@pytest.mark.parametrize("dtype", topk_kernels.DTYPES)
def test_each_planted_bug_is_caught_and_named(counts, dtype, bug):
    judged, failed, named, _ = counts[(dtype, bug)]
    assert judged >= 2 and failed == judged and named == judged, counts


def test_a_repeated_key_is_a_log_multiplicity_bias_and_ours_passes():
    """Key 2 listed twice in row 0: the case is attention with log 2 on it (-inf on the keys not
    listed); our sparse attention's float64 results pass to a few ulps."""
    rng = np.random.default_rng(4)
    q, k, v, dout = (rng.standard_normal(shape) for shape in [(1, 2, 3, 8), (1, 1, 6, 8), (1, 1, 6, 8), (1, 2, 3, 8)])
    indices = np.array([[[[2, 2, 0], [1, -1, 5], [-1, -1, -1]]]])
    bias = np.full((3, 6), -np.inf)
    bias[0, [2, 0]], bias[1, [1, 5]] = [np.log(2), 0], 0
    listed, biased = (na.attention_forward(q, k, v, **option)[0]
                      for option in ({"topk_indices": indices}, {"bias": bias}))
    np.testing.assert_allclose(listed, biased, rtol=0, atol=1e-15)
    out, lse, _, cache = na.sparse_attention_forward(q, k, v, indices)
    g = na.sparse_attention_backward(dout, cache)
    report = na.crosscheck(q=q, k=k, v=v, dout=dout, topk_indices=indices, out=out, lse=lse, dq=g.dq, dk=g.dk, dv=g.dv)
    assert report and max(row.max_abs_err for row in report.rows) < 1e-14, report


@pytest.mark.parametrize("change, words", [
    ({"topk_length": np.array([[3, 3, 3]])}, "topk_length is given but topk_indices is not"),
    ({"topk_indices": np.zeros((1, 3, 3, 2), int)}, r"topk_indices must be \[\.\.\., H_kv or H, N_q, K\]"),
    ({"topk_indices": np.zeros((1, 1, 3, 2))}, "topk_indices must be integers, got dtype float64"),
    ({"topk_indices": np.zeros((1, 1, 3, 2), int), "page_table": np.array([[0]]), "cache_seqlens": np.array([6])},
     "takes no paged KV cache"),
    ({"topk_indices": np.zeros((1, 1, 3, 2), int), "topk_length": np.zeros((1, 2), int)},
     r"topk_length must be integers \[\.\.\., N_q\] = \(1, 3\)"),
    ({"topk_indices": np.zeros((1, 1, 3, 2), int), "topk_block_size": 0}, "topk_block_size must be a positive"),
])
def test_bad_topk_keys_are_refused_by_name(change, words):
    rng = np.random.default_rng(5)
    arrays = dict(q=rng.standard_normal((1, 2, 3, 8)), k=rng.standard_normal((1, 1, 6, 8)),
                  v=rng.standard_normal((1, 1, 6, 8)), out=np.zeros((1, 2, 3, 8)), **change)
    with pytest.raises(CaseError, match=words):
        na.crosscheck(**arrays)


def test_a_backward_that_writes_each_use_instead_of_adding_is_named():
    """Grouped heads, keys listed by several queries and key 2 twice in one row: dk, dv written use
    by use (the last write kept, as a scatter by assignment does) are named; dk, dv doubled are
    not that mix-up."""
    rng = np.random.default_rng(7)
    q, dout = rng.standard_normal((1, 2, 3, 8)), rng.standard_normal((1, 2, 3, 8))
    k, v = rng.standard_normal((1, 1, 6, 8)), rng.standard_normal((1, 1, 6, 8))
    indices = np.array([[[[2, 2, 0], [1, 2, 5], [0, -1, 4]]]])
    out, lse, _, cache = na.sparse_attention_forward(q, k, v, indices)
    grads = na.sparse_attention_backward(dout, cache)
    scale = 1 / np.sqrt(8)
    written = {"dk": np.zeros_like(k), "dv": np.zeros_like(v)}
    for h in range(2):
        for i in range(3):
            listed = indices[0, 0, i][indices[0, 0, i] >= 0]
            s = scale * k[0, 0, listed] @ q[0, h, i]
            p = np.exp(s - lse[0, h, i])                                  # each copy's own weight
            ds = p * (v[0, 0, listed] @ dout[0, h, i] - dout[0, h, i] @ out[0, h, i])
            for key, p_t, ds_t in zip(listed, p, ds):                     # written, not added
                written["dv"][0, 0, key] = p_t * dout[0, h, i]
                written["dk"][0, 0, key] = ds_t * scale * q[0, h, i]
    case = dict(q=q, k=k, v=v, dout=dout, out=out, lse=lse, dq=grads.dq, topk_indices=indices)
    report = na.crosscheck(**case, **written)
    assert not report and "dk, dv match one use's gradient for each key" in report.diagnosis[0], report
    doubled = na.crosscheck(**case, dk=2 * grads.dk, dv=2 * grads.dv)
    assert not doubled and not any("one use's gradient" in line for line in doubled.diagnosis), doubled


def test_with_key_blocks_topk_length_counts_blocks():
    """topk_block_size 4 over 10 keys, blocks [0, 2, 1] and topk_length 2: the query keeps blocks 0
    and 2 (keys 0-3 and 8-9), not block 1."""
    from numpy_attention.oracle.case import split_case
    rng = np.random.default_rng(6)
    arrays = dict(q=rng.standard_normal((1, 1, 1, 8)), k=rng.standard_normal((1, 1, 10, 8)),
                  v=rng.standard_normal((1, 1, 10, 8)), out=np.zeros((1, 1, 1, 8)),
                  topk_indices=np.array([[[[0, 2, 1]]]]), topk_block_size=np.array(4), topk_length=np.array([[2]]))
    tokens = split_case(arrays).options["topk_indices"]
    np.testing.assert_array_equal(np.sort(tokens[tokens >= 0]), [0, 1, 2, 3, 8, 9])
