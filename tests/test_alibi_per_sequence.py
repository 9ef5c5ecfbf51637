"""ALiBi slopes [B, H], one row per sequence (FlashAttention's varlen and kvcache functions take
alibi_slopes of shape (nheads,) or (batch_size, nheads)), with packed sequences and with a paged
KV cache: equal to running each sequence alone with its row of slopes (out, lse, every gradient,
dalibi_slopes row by row) in every engine and on threads; against complex step; in forward mode;
in crosscheck (honest float32 and bfloat16 candidates pass, one sequence's slope altered fails);
and the refusal of a wrong shape, naming the shapes accepted and the caller's q."""
import importlib

import ml_dtypes
import numpy as np
import pytest
from layouts import CU_K, CU_Q, LEN_Q, LENGTHS, TABLE, USED, gathered, packed_inputs, paged_inputs

import numpy_attention as na
from numpy_attention.oracle.magnitudes import term_sums
from numpy_attention.oracle.precision import PRECISIONS
from numpy_attention.oracle.recipe import recipe_attention

blocked = importlib.import_module("numpy_attention.engines.blocked")
blocks = importlib.import_module("numpy_attention.oracle.row_blocks")
BF16 = np.dtype(ml_dtypes.bfloat16)

RNG = np.random.default_rng(57)
SLOPES = RNG.uniform(0.05, 1.0, (4, 4))                              # [B, H]: every entry its own
SINKS = RNG.standard_normal(4)
OPTIONS = {
    "plain": {},
    "causal bottom_right, window, sinks": {"causal": "bottom_right", "window": (2, 1), "sinks": SINKS},
}
ENGINES = {
    "textbook": {"implementation": "textbook"},
    "blocked": {"implementation": "blocked"},
    "blocked, blocks of 2 rows, 2 workers": {"implementation": "blocked", "workers": 2},
    "tiled": {"implementation": "tiled", "block_size": 3},
    "tiled, 2 workers": {"implementation": "tiled", "block_size": 2, "workers": 2},
}


@pytest.fixture
def engine(request, monkeypatch):
    """The engine's options; 'blocks of 2 rows': the blocked engine's blocks cut through sequences."""
    if "blocks of 2 rows" in request.param:
        for name in ("BLOCK_BYTES", "MIN_BLOCK_BYTES"):
            monkeypatch.setattr(blocked, name, 2 * CU_K[-1] * 8)
    return ENGINES[request.param]


def each_sequence_alone(q, k, v, dout, dlse, slopes, options):
    """out, lse, dq, dk, dv packed again, dalibi_slopes [B, H] (row b: sequence b alone with its
    slopes[b]) and dsinks (summed over the sequences), from the textbook on each sequence."""
    out, lse, dq, dk, dv = (np.zeros(x.shape, x.dtype) for x in (dout, dlse, q, k, v))
    dslopes, dsinks = np.zeros(slopes.shape, q.dtype), np.zeros(4, q.dtype)
    for b in range(len(LEN_Q)):
        rows, keys = slice(CU_Q[b], CU_Q[b + 1]), slice(CU_K[b], CU_K[b] + USED[b])
        out[:, rows], cache = na.attention_forward(q[:, rows], k[:, keys], v[:, keys], alibi_slopes=slopes[b],
                                                   implementation="textbook", **options)
        lse[:, rows] = cache.lse
        grads = na.attention_backward(dout[:, rows], cache, dlse[:, rows])
        dq[:, rows], dk[:, keys], dv[:, keys], dslopes[b] = grads.dq, grads.dk, grads.dv, grads.dalibi_slopes
        if grads.dsinks is not None:
            dsinks += grads.dsinks
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dalibi_slopes": dslopes, "dsinks": dsinks}


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
@pytest.mark.parametrize("option", OPTIONS)
def test_packed_per_sequence_slopes_equal_each_sequence_alone(engine, option):
    q, k, v, dout, dlse = packed_inputs()
    out, cache = na.attention_forward(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, seqused_k=USED,
                                      alibi_slopes=SLOPES, **engine, **OPTIONS[option])
    grads = na.attention_backward(dout, cache, dlse)
    got = {"out": out, "lse": cache.lse, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv,
           "dalibi_slopes": grads.dalibi_slopes, "dsinks": grads.dsinks}
    want = each_sequence_alone(q, k, v, dout, dlse, SLOPES, OPTIONS[option])
    assert grads.dalibi_slopes.shape == SLOPES.shape and grads.dalibi_slopes[1].tolist() == [0] * 4
    for name, x in want.items():
        if name == "dsinks" and "sinks" not in OPTIONS[option]:
            assert got[name] is None
            continue
        np.testing.assert_allclose(got[name], x, rtol=0, atol=1e-14 * max(1, np.abs(x).max()), err_msg=name)


@pytest.mark.parametrize("engine", ["textbook", "blocked", "tiled"])
def test_packed_per_sequence_slopes_equal_complex_step(engine):
    """The whole Jacobian of (out, lse) w.r.t. q, k, v and the [B, H] slopes, every upstream
    gradient (gradcheck's full mode), complex step: 1e-12 of each input's largest derivative."""
    q, k, v, _, _ = packed_inputs(1)

    def forward(q, k, v, slopes):
        out, cache = na.attention_forward(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, seqused_k=USED,
                                          alibi_slopes=slopes, causal="bottom_right", implementation=engine)
        return np.concatenate([out.ravel(), cache.lse.ravel()]), cache

    def backward(d, cache):
        n = cache.out.size
        g = na.attention_backward(d[:n].reshape(cache.out.shape), cache, d[n:].reshape(cache.lse.shape))
        return [g.dq, g.dk, g.dv, g.dalibi_slopes]
    report = na.gradcheck(forward, backward, [q, k, v, SLOPES], method="complex")
    assert report, report


PAGED_SLOPES = RNG.uniform(0.05, 1.0, (3, 4))


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_paged_per_sequence_slopes_equal_each_sequence_alone(engine):
    q, k_cache, v_cache, dout = paged_inputs()
    out, cache = na.attention_forward(q, k_cache, v_cache, page_table=TABLE, cache_seqlens=LENGTHS,
                                      alibi_slopes=PAGED_SLOPES, causal="bottom_right", **engine)
    grads = na.attention_backward(dout, cache)
    dk = np.zeros(k_cache.shape)
    for b in range(3):
        out_b, c_b = na.attention_forward(q[b], gathered(k_cache, b), gathered(v_cache, b),
                                          alibi_slopes=PAGED_SLOPES[b], causal="bottom_right")
        g = na.attention_backward(dout[b], c_b)
        np.testing.assert_allclose(out[b], out_b, rtol=0, atol=1e-15 * np.abs(out_b).max())
        np.testing.assert_allclose(grads.dq[b], g.dq, rtol=0, atol=1e-14 * np.abs(g.dq).max())
        np.testing.assert_allclose(grads.dalibi_slopes[b], g.dalibi_slopes, rtol=0,
                                   atol=1e-14 * np.abs(g.dalibi_slopes).max())
        for t in range(LENGTHS[b]):                              # each key's gradient, back to its page
            dk[TABLE[b, t // 4], :, t % 4] += g.dk[:, t]
    np.testing.assert_allclose(grads.dk, dk, rtol=0, atol=1e-14 * np.abs(dk).max())


def test_paged_per_sequence_slopes_equal_complex_step():
    q, k_cache, v_cache, _ = paged_inputs(1)
    forward = lambda q, kc, vc, slopes: na.attention_forward(q, kc, vc, page_table=TABLE, cache_seqlens=LENGTHS,
                                                             alibi_slopes=slopes, causal="bottom_right")
    backward = lambda dout, cache: (lambda g: [g.dq, g.dk, g.dv, g.dalibi_slopes])(na.attention_backward(dout, cache))
    report = na.gradcheck(forward, backward, [q, k_cache, v_cache, PAGED_SLOPES], method="complex")
    assert report, report


@pytest.mark.parametrize("implementation", ["textbook", "tiled"])
def test_forward_mode_carries_per_sequence_slope_tangents(implementation):
    """attention_jvp with [B, H] slopes and their tangent: each sequence alone's tangent, and
    complex step on q, k, v and the slopes."""
    q, k, v, _, _ = packed_inputs(2)
    rng = np.random.default_rng(3)
    q_dot, k_dot, v_dot, slopes_dot = (rng.standard_normal(x.shape) for x in (q, k, v, SLOPES))
    packing = {"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K, "seqused_k": USED, "causal": "bottom_right"}
    engine = {"implementation": "tiled", "block_size": 3} if implementation == "tiled" else {}
    _, out_dot, _, lse_dot = na.attention_jvp(q, k, v, q_dot, k_dot, v_dot, alibi_slopes=SLOPES,
                                              alibi_slopes_dot=slopes_dot, **packing, **engine)
    for b in range(len(LEN_Q)):
        rows, keys = slice(CU_Q[b], CU_Q[b + 1]), slice(CU_K[b], CU_K[b] + USED[b])
        _, out_dot_b, _, lse_dot_b = na.attention_jvp(
            q[:, rows], k[:, keys], v[:, keys], q_dot[:, rows], k_dot[:, keys], v_dot[:, keys],
            alibi_slopes=SLOPES[b], alibi_slopes_dot=slopes_dot[b], causal="bottom_right")
        np.testing.assert_allclose(out_dot[:, rows], out_dot_b, rtol=0, atol=1e-14 * max(1, np.abs(out_dot).max()))
        np.testing.assert_allclose(lse_dot[:, rows], lse_dot_b, rtol=0, atol=1e-14 * max(1, np.abs(lse_dot).max()))

    def forward(q, k, v, slopes):
        out, cache = na.attention_forward(q, k, v, alibi_slopes=slopes, **packing)
        return np.concatenate([out.ravel(), cache.lse.ravel()]), None

    def jvp(primals, tangents):
        _, out_dot, _, lse_dot = na.attention_jvp(*primals[:3], *tangents[:3], alibi_slopes=primals[3],
                                                  alibi_slopes_dot=tangents[3], **packing, **engine)
        return np.concatenate([out_dot.ravel(), lse_dot.ravel()])
    report = na.jvpcheck(forward, jvp, [q, k, v, SLOPES])
    assert report, report


def float32_candidate(q, k, v, dout, slopes, bug=None):
    """An honest float32 kernel's results with [B, H] slopes: each sequence alone in float32 with
    its own row of slopes. bug 'slope': sequence 2 computed with a slope 0.05 off on head 1;
    'dalibi summed': every row of dalibi_slopes the sum over all the sequences (an [H] gradient)."""
    f32 = lambda x: x.astype(np.float32)
    used = f32(slopes).copy()
    if bug == "slope":
        used[2, 1] += 0.05
    result = {"out": np.zeros(dout.shape, np.float32), "lse": np.zeros(dout.shape[:-1], np.float32),
              "dq": np.zeros(q.shape, np.float32), "dk": np.zeros(k.shape, np.float32),
              "dv": np.zeros(v.shape, np.float32), "dalibi_slopes": np.zeros(slopes.shape, np.float32)}
    for b in range(len(LEN_Q)):
        rows, keys = slice(CU_Q[b], CU_Q[b + 1]), slice(CU_K[b], CU_K[b + 1])
        out, cache = na.attention_forward(f32(q[:, rows]), f32(k[:, keys]), f32(v[:, keys]),
                                          alibi_slopes=used[b], causal="bottom_right")
        grads = na.attention_backward(f32(dout[:, rows]), cache)
        result["out"][:, rows], result["lse"][:, rows] = out, cache.lse
        result["dq"][:, rows], result["dk"][:, keys], result["dv"][:, keys] = grads.dq, grads.dk, grads.dv
        result["dalibi_slopes"][b] = grads.dalibi_slopes
    if bug == "dalibi summed":
        result["dalibi_slopes"][:] = result["dalibi_slopes"].sum(axis=0)
    return result


@pytest.mark.parametrize("large", [False, True], ids=["whole", "in blocks of rows"])
@pytest.mark.parametrize("bug, fails", [(None, None), ("slope", "out"), ("dalibi summed", "dalibi_slopes")])
def test_crosscheck_of_a_float32_candidate_with_per_sequence_slopes(monkeypatch, large, bug, fails):
    if large:                                      # the tiled oracle, the naive baseline in blocks
        monkeypatch.setattr(blocks, "SCORE_BUDGET", 1)
    q, k, v, dout, _ = packed_inputs(4)
    case = dict(q=q, k=k, v=v, dout=dout, alibi_slopes=SLOPES, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K,
                causal=np.array("bottom_right"))
    report = na.crosscheck(**case, **float32_candidate(q, k, v, dout, SLOPES, bug))
    failed = [row.name for row in report.rows if not row.passed]
    if bug is None:
        assert report, str(report)
    else:
        assert fails in failed, str(report)


def test_crosscheck_of_a_paged_float32_candidate_with_per_sequence_slopes():
    q, k_cache, v_cache, dout = paged_inputs(5)
    paging = {"page_table": TABLE, "cache_seqlens": LENGTHS, "causal": "bottom_right"}
    f32 = lambda x: x.astype(np.float32)
    out, cache = na.attention_forward(f32(q), f32(k_cache), f32(v_cache), alibi_slopes=f32(PAGED_SLOPES), **paging)
    grads = na.attention_backward(f32(dout), cache)
    case = dict(q=q, k=k_cache, v=v_cache, dout=dout, alibi_slopes=PAGED_SLOPES, out=out, dq=grads.dq,
                dk=grads.dk, dv=grads.dv, dalibi_slopes=grads.dalibi_slopes, **paging)
    assert na.crosscheck(**case), str(na.crosscheck(**case))
    swapped = grads.dalibi_slopes[[1, 0, 2]]                     # sequences 0 and 1's gradients swapped
    report = na.crosscheck(**{**case, "dalibi_slopes": swapped})
    assert [row.name for row in report.rows if not row.passed] == ["dalibi_slopes"], str(report)


def test_crosscheck_of_a_bfloat16_recipe_candidate_with_per_sequence_slopes():
    """The bfloat16 recipe run on each sequence alone (an honest bfloat16 kernel) passes against
    the recipe on the packed case; with one sequence's slope altered, out fails."""
    q, k, v, dout, _ = (x.astype(BF16) for x in packed_inputs(6))
    slopes = SLOPES.astype(np.float32)
    f32 = lambda x: x.astype(np.float32)

    def candidate(used):
        result = {"out": np.zeros(dout.shape, BF16), "lse": np.zeros(dout.shape[:-1], np.float32),
                  "dq": np.zeros(q.shape, BF16), "dk": np.zeros(k.shape, BF16), "dv": np.zeros(v.shape, BF16),
                  "dalibi_slopes": np.zeros(slopes.shape, BF16)}
        for b in range(len(LEN_Q)):
            rows, keys = slice(CU_Q[b], CU_Q[b + 1]), slice(CU_K[b], CU_K[b + 1])
            q3, k3, v3, record = na.attention_options(f32(q[:, rows]), f32(k[:, keys]), f32(v[:, keys]),
                                                      alibi_slopes=used[b], causal="bottom_right")
            r = recipe_attention(q3, k3, v3, record, PRECISIONS["bfloat16"], dout=f32(dout[:, rows]))
            for name in ("out", "lse", "dq"):
                result[name][:, rows] = r[name]
            for name in ("dk", "dv"):
                result[name][:, keys] = r[name]
            result["dalibi_slopes"][b] = r["dalibi_slopes"]
        return result
    case = dict(q=q, k=k, v=v, dout=dout, alibi_slopes=slopes, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K,
                causal=np.array("bottom_right"))
    report = na.crosscheck(**case, **candidate(slopes))
    assert report, str(report)
    wrong = slopes.copy()
    wrong[2, 1] += 0.25
    report = na.crosscheck(**case, **candidate(wrong))
    assert "out" in [row.name for row in report.rows if not row.passed], str(report)


def test_the_term_sums_of_per_sequence_slopes_sum_each_sequence_alone():
    """dalibi_slopes[b, h]'s atol scales with the terms of sequence b's rows alone: the largest
    per-(sequence, head) sum, below the per-head sum of [H] slopes over every sequence."""
    rng = np.random.default_rng(7)
    n_q, n_k = CU_Q[-1], CU_K[-1]
    P = rng.random((4, n_q, n_k)) / n_k
    stages = {"S": rng.standard_normal(P.shape), "P": P, "P~": P, "dP": rng.standard_normal(P.shape),
              "D": rng.standard_normal((4, n_q))}
    inputs = {"q": rng.standard_normal((4, n_q, 3)), "k": rng.standard_normal((2, n_k, 3)),
              "v": rng.standard_normal((2, n_k, 3)), "dout": rng.standard_normal((4, n_q, 3))}
    v_lengths = np.repeat(np.linalg.norm(inputs["v"], axis=-1), 2, axis=0)[:, None, :]   # [H, 1, N_k]
    dots = (np.linalg.norm(inputs["dout"], axis=-1)[..., None]                           # dP's, D's terms
            * (v_lengths + np.sum(P * v_lengths, -1, keepdims=True)))
    w = 1 + np.abs(stages["S"]) / 4                                    # each weight's rounding (no lse given)
    terms = (n_q + n_k) * np.sum(P * ((np.abs(stages["dP"]) + np.abs(stages["D"])[..., None]) * w + dots),
                                 -1)                                                       # [H, N_q]
    per_sequence = [terms[:, CU_Q[b]:CU_Q[b + 1]].sum(-1) for b in range(4)]                         # [B][H]
    whole = [((Ellipsis, slice(None), slice(None)), stages)]
    in_blocks = [((Ellipsis, rows, slice(None)), {n: x[:, rows] for n, x in stages.items()})
                 for rows in (slice(0, 4), slice(4, n_q))]
    for stage_blocks in (whole, in_blocks):
        packing = {"cu_seqlens_q": CU_Q, "cu_seqlens_k": CU_K}
        sums = term_sums(stage_blocks, inputs, {"alibi_slopes": SLOPES, **packing})["dalibi_slopes"]
        shared = term_sums(stage_blocks, inputs, {"alibi_slopes": SLOPES[0], **packing})["dalibi_slopes"]
        assert sums == pytest.approx(np.max(per_sequence))
        assert shared == pytest.approx(np.max(np.sum(per_sequence, axis=0))) and sums < 0.99 * shared


def test_a_wrong_shape_is_refused_naming_the_shapes_accepted_and_the_callers_q():
    q, k, v, _, _ = packed_inputs()
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) or \(4, 4\) \(\[H\], or \[B, H\] "
                                         r"with one row per sequence, for q \(4, 9, 3\) and B = 4 sequences\), "
                                         r"got \(3, 4\)"):
        na.attention_forward(q, k, v, cu_seqlens_q=CU_Q, cu_seqlens_k=CU_K, alibi_slopes=SLOPES[:3])
    q, k_cache, v_cache, _ = paged_inputs()
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) or \(3, 4\) \(\[H\], or \[B, H\] "
                                         r"with one row per sequence, for q \(3, 4, 2, 8\) and B = 3 sequences\), "
                                         r"got \(2, 4\)"):
        na.attention_forward(q, k_cache, v_cache, page_table=TABLE, cache_seqlens=LENGTHS,
                             alibi_slopes=PAGED_SLOPES[:2])
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) \(\[H\] or \[\.\.\., H\] for "
                                         r"q \(4, 9, 3\)\), got \(4, 4\)"):
        na.attention_forward(q=packed_inputs()[0], k=packed_inputs()[1], v=packed_inputs()[2], alibi_slopes=SLOPES)
