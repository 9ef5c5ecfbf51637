"""A PASS that cannot be fooled: crosscheck refuses what it cannot judge (a CaseError, the command's
exit 2) instead of passing it: non-finite inputs and bounds, a precision whose honest result is
noise, bad descales and positions; and it reads each array as what it is."""
import ml_dtypes
import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.oracle import CaseError, judge

RNG = np.random.default_rng(44)


def _case(shape=(1, 2, 4, 8), n_k=None, dtype=np.float32):
    """q, k, v and our own float64 result of them, in `dtype`."""
    b, h, n, d = shape
    n_k = n if n_k is None else n_k
    q = RNG.standard_normal(shape).astype(dtype)
    k, v = (RNG.standard_normal((b, h, n_k, d)).astype(dtype) for _ in range(2))
    out, _ = na.attention_forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    return q, k, v, out


def test_an_infinite_input_is_refused_not_passed():
    """One inf in v made every bound infinite, and garbage passed; q, k, v, dout, a NaN or +inf in
    bias or sinks, a non-finite slope: refused, naming the key. -inf in bias masks and is judged."""
    q, k, v, out = _case()
    garbage = (RNG.standard_normal(out.shape) * 100).astype(np.float32)
    bad_v = v.copy()
    bad_v[0, 0, 1, 2] = np.inf
    with pytest.raises(CaseError, match=r"v holds 1 value.*not finite.*v\[0, 0, 1, 2\] = inf"):
        na.crosscheck(q=q, k=k, v=bad_v, out=garbage)
    for name, value, shape in (("bias", np.inf, (4, 4)), ("bias", np.nan, (4, 4)), ("sinks", np.inf, (2,)),
                               ("sinks", np.nan, (2,)), ("alibi_slopes", -np.inf, (2,))):
        option = np.zeros(shape, np.float32)
        option.reshape(-1)[1] = value
        with pytest.raises(CaseError, match=rf"^{name} holds 1 value"):
            na.crosscheck(q=q, k=k, v=v, out=garbage, **{name: option})
    dout = RNG.standard_normal(out.shape).astype(np.float32)
    dout[0, 1, 3, 0] = -np.inf
    with pytest.raises(CaseError, match="^dout holds"):
        na.crosscheck(q=q, k=k, v=v, dout=dout, out=garbage, dv=v)
    masked = np.where(np.triu(np.ones((4, 4), bool), 1), -np.inf, 0).astype(np.float32)
    honest, _ = na.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), bias=masked.astype(np.float64))
    assert na.crosscheck(q=q, k=k, v=v, bias=masked, out=honest.astype(np.float32))
    assert not na.crosscheck(q=q, k=k, v=v, bias=masked, out=garbage)


def test_descales_that_are_not_finite_positive_or_overflow_are_refused():
    """v_descale inf, 1e308 (v times it overflows), NaN, 0 or negative: bad input naming the key,
    never a PASS of garbage, nor a FAIL blamed on the kernel."""
    e4m3 = ml_dtypes.float8_e4m3fn
    q, k, v = (RNG.standard_normal((1, 2, 4, 8)).astype(e4m3) for _ in range(3))
    v[0, 0, 0, 0] = 4                                  # 4e308 overflows float64
    garbage = (RNG.standard_normal((1, 2, 4, 8)) * 100).astype(ml_dtypes.bfloat16)
    for descale, said in ((np.inf, "v_descale must hold finite values > 0"), (np.nan, "v_descale must"),
                          (0.0, "v_descale must"), (-1.0, "v_descale must"),
                          (1e308, r"v times v_descale holds \d+ value"),
                          (1e300, "out cannot be judged: the float8_e4m3fn baseline is NaN or infinite.*overflow bfloat16")):
        with pytest.raises(CaseError, match=said):
            na.crosscheck(q=q, k=k, v=v, v_descale=np.float64(descale), out=garbage, precision="float8_e4m3fn")


def test_scores_that_overflow_the_precision_cannot_be_judged():
    """Scores of 1e40 overflow float32: the float32 baseline is NaN where the oracle is finite, the
    bound infinite; an all-zero out passed. Now: cannot be judged, naming the tensor and why."""
    q, k, v, _ = _case()
    big_q, big_k = (x * np.float32(1e20) for x in (q, k))
    with pytest.raises(CaseError, match="out cannot be judged: the float32 baseline is NaN or infinite"):
        na.crosscheck(q=big_q, k=big_k, v=v, out=np.zeros((1, 2, 4, 8), np.float32))


def test_judge_alone_never_passes_an_infinite_bound():
    """rule.judge with a baseline NaN where the oracle is finite: FAIL 'cannot judge', whatever
    the candidate; where the oracle is not finite the candidate must match it entry for entry."""
    oracle = np.array([1.0, 2.0, -np.inf, np.nan])
    baseline = np.array([1.0, np.nan, -np.inf, np.nan], np.float32)
    verdict = judge("out", np.float32([5, 6, -np.inf, np.nan]), oracle, baseline)
    assert not verdict.passed and verdict.failed[0].startswith("cannot judge: the bound is inf")
    honest = judge("out", np.float32([1, 2, -np.inf, np.nan]), oracle, np.float32([1, 2, -np.inf, np.nan]))
    assert honest.passed
    for wrong in ([1, 2, np.inf, np.nan], [1, 2, -1e30, np.nan], [1, 2, -np.inf, 0]):
        assert not judge("out", np.float32(wrong), oracle, np.float32([1, 2, -np.inf, np.nan])).passed


def test_float32_results_stored_as_float64_keep_float32s_atol(torch):
    """A torch float32 kernel's results saved as float64 with precision='float32' were held to
    float64's atol (dq and dk of single-key rows: exactly 0 in the oracle, rounding noise in the
    kernel); they pass as their float32 originals do."""
    for seed in (1, 4, 22):                      # cases whose float64 copies failed
        g = torch.Generator().manual_seed(seed)
        n_q, n_k = [(1, 1), (3, 1), (2, 5), (7, 3)][seed % 4]
        q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (n_q, n_k, n_k))
        dout = torch.randn(1, 2, n_q, 16, generator=g)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves)
        out.backward(dout)
        inputs = dict(q=q.numpy(), k=k.numpy(), v=v.numpy(), dout=dout.numpy())
        results = dict(out=out.detach().numpy(), dq=leaves[0].grad.numpy(), dk=leaves[1].grad.numpy(),
                       dv=leaves[2].grad.numpy())
        assert na.crosscheck(**inputs, **results)
        as_float64 = {name: x.astype(np.float64) for name, x in results.items()}
        report = na.crosscheck(**inputs, **as_float64, precision="float32")
        assert report, str(report)
        assert report.rows[0].atol == na.crosscheck(**inputs, **results).rows[0].atol


def test_typed_low_precision_arrays_are_read_as_what_they_are():
    """An ml_dtypes float8 array was refused as ambiguous raw bits, and one of the other float8
    format (or bfloat16 against float16) was re-read bit for bit: [1.5, -3] became [1, -4]."""
    e4m3, e5m2, bf16 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.bfloat16
    q, k, v = (RNG.standard_normal((1, 1, 3, 4)).astype(e4m3) for _ in range(3))
    out, _ = na.attention_forward(*(x.astype(np.float64) for x in (q, k, v)))
    report = na.crosscheck(q=q, k=k, v=v, out=out.astype(bf16))        # no precision named: q's own
    assert report and report.baseline_dtype.startswith("float8_e4m3fn")
    with pytest.raises(CaseError, match=r"q is a float8_e4m3fn array but the precision is 'float8_e5m2'"):
        na.crosscheck(q=q, k=k, v=v, out=out.astype(bf16), precision="float8_e5m2")
    halves = [x.astype(np.float32).astype(bf16) for x in (q, k, v)]
    with pytest.raises(CaseError, match=r"q is a bfloat16 array but the precision is 'float16'"):
        na.crosscheck(q=halves[0], k=halves[1], v=halves[2], out=out.astype(np.float16), precision="float16")
    # raw bits still read in the named precision
    raw = [np.asarray(x).view(np.uint8) for x in (q, k, v)]
    assert na.crosscheck(q=raw[0], k=raw[1], v=raw[2], out=out.astype(bf16), precision="float8_e4m3fn")
    assert np.array_equal(np.float32([1.5, -3]).astype(e4m3).view(np.uint8).view(e4m3).astype(np.float32),
                          [1.5, -3])


def test_rope_positions_where_float32_angles_are_noise_cannot_be_judged(torch):
    """At positions near 2^24 and beyond, float32 angles are off by radians: the float32 baseline's
    error is as large as the result and an all-zero candidate passed. Now the case is refused, the
    reason named; at 2^20 the same case is judged and zeros fail."""
    import rope_kernels

    rng = np.random.default_rng(3)
    draw = rope_kernels.draw
    try:
        for offset, judged in ((2 ** 20, True), (2 ** 24, False), (2 ** 30, False)):
            rope_kernels.draw = lambda r, offset=offset: {**draw(r), "offset": offset, "scaling": None}
            arrays, _ = rope_kernels.rope_case(rng, "float32")
            zeros = {**arrays, **{n: torch.zeros_like(arrays[n]) for n in ("out", "dq", "dk", "dv")}}
            if judged:
                assert na.crosscheck(**arrays) and not na.crosscheck(**zeros)
                continue
            for candidate in (arrays, zeros):
                with pytest.raises(CaseError, match=r"cannot be judged in float32.*an all-zero \w+ would pass"
                                                    r".*rope angles in float32 are off by up to"):
                    na.crosscheck(**candidate)
    finally:
        rope_kernels.draw = draw


def test_non_finite_rope_positions_are_bad_input():
    q, k, v, out = _case()
    for bad in (np.nan, np.inf):
        positions = np.arange(4.0)
        positions[2] = bad
        with pytest.raises(CaseError, match=r"rope_positions_k must hold finite positions.*\[2\]"):
            na.crosscheck(q=q, k=k, v=v, out=out.astype(np.float32), rope_layout=np.array("half"),
                          rope_positions_k=positions)


def test_unknown_keywords_are_refused_even_set_to_none():
    """crosscheck dropped None before checking names: attn_mask=None (torch's) or a typo passed
    unread. Now the name is refused, with torch's advice where it has one."""
    q, k, v, out = _case()
    with pytest.raises(CaseError, match="unknown key 'attn_mask': a boolean attn_mask is mask="):
        na.crosscheck(q=q, k=k, v=v, out=out, attn_mask=None)
    with pytest.raises(CaseError, match="unknown key 'bogus'"):
        na.crosscheck(q=q, k=k, v=v, out=out, bogus=None)
    assert na.crosscheck(q=q, k=k, v=v, out=out.astype(np.float32), lse=None, bias=None)


def test_layout_bnhd_on_a_bhnd_case_says_to_drop_it():
    """--layout bnhd on a case already in [..., H, N, d] quoted transposed shapes and advised a
    transpose; now it quotes the stored shapes and says they fit the default layout."""
    q, k, v, out = _case((1, 4, 6, 8), n_k=9)
    k, v = k[:, :2], v[:, :2]
    with pytest.raises(CaseError, match=r"q \(1, 4, 6, 8\), k \(1, 2, 9, 8\), v \(1, 2, 9, 8\) do not fit "
                                        r"\[\.\.\., N, H, d\] \(layout 'bnhd'\); as stored they fit"):
        na.crosscheck(q=q, k=k, v=v, out=out, layout="bnhd")
    with pytest.raises(CaseError, match=r"q \(1, 4, 6, 8\), k \(1, 3, 9, 8\).* as stored, read as \[\.\.\., N, H, d\]"):
        na.crosscheck(q=q, k=k[:, :1].repeat(3, 1), v=v[:, :1].repeat(3, 1), out=out, layout="bnhd")


def test_a_case_too_large_for_this_machine_is_refused_before_its_scores_are_allocated(monkeypatch):
    """A 13 MB top-k case of 2^28 scores was refused only by a MemoryError after gigabytes were
    allocated. The peak is estimated from the shapes first (oracle/memory.py): here against an
    available memory set to 256 MiB. Its lists count by their entries, not by the scores (they
    are never a dense keep-mask): DeepSeek's sizes, 2^30 scores and 2048 listed keys a row, are
    estimated below the 9 GiB that their dense keep-mask alone took."""
    import tracemalloc

    from numpy_attention.oracle import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 2 ** 28)
    q = RNG.standard_normal((1, 1, 4096, 8)).astype(np.float32)
    k = RNG.standard_normal((1, 1, 65536, 8)).astype(np.float32)
    indices = RNG.integers(0, 65536, (1, 1, 4096, 4)).astype(np.int32)
    tracemalloc.start()
    try:
        with pytest.raises(CaseError, match=r"the case needs about \d+\.\d GiB \(its arrays 0\.00 GiB, "
                                            r"268,435,456 scores in blocks of rows on \d+ threads, top-k lists of "
                                            r"16,384 entries\); this machine has 0\.2 GiB available"):
            na.crosscheck(q=q, k=k, v=k, out=q, topk_indices=indices)
        assert tracemalloc.get_traced_memory()[1] < 64 * 2 ** 20           # nothing of the scores' size
    finally:
        tracemalloc.stop()
    whole_q, whole_k = (RNG.standard_normal((1, 8, 1024, 8)).astype(np.float32) for _ in range(2))
    with pytest.raises(CaseError, match=r"8,388,608 scores formed whole.*0\.2 GiB available"):
        na.crosscheck(q=whole_q, k=whole_k, v=whole_k, out=whole_q)
    deepseek = memory.peak_bytes(2 ** 28, (1, 1, 32768, 32768), tokens=32768 * 2048, threads=2)[0]
    assert deepseek < 9 * 2 ** 30
    monkeypatch.setattr(memory, "available_bytes", lambda: 4 * 2 ** 30)
    small_q, small_k, small_v, small_out = _case()
    assert na.crosscheck(q=small_q, k=small_k, v=small_v, out=small_out.astype(np.float32))


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_sixteen_bit_baselines_follow_the_fully_masked_policy(precision):
    """The 16-bit recipe filled a row with no key with 0 whatever the policy: with 'uniform' (MLX's,
    JAX's) its error was the whole mean of v, the bound as large, and a kernel that zeroes those
    rows passed. Now the baseline averages v there too: honest passes, zeros in those rows fail."""
    dtype = ml_dtypes.bfloat16 if precision == "bfloat16" else np.float16
    rng = np.random.default_rng(8)
    q, dout = (rng.standard_normal((1, 2, 9, 16)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 3, 16)).astype(dtype) for _ in range(2))
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    for policy, wrong in (("uniform", 0.0), ("nan", 0.0)):
        out, cache = na.attention_forward(*wide[:3], causal="bottom_right", fully_masked=policy)
        grads = na.attention_backward(wide[3], cache)
        honest = dict(out=out, dq=grads.dq, dk=grads.dk, dv=grads.dv)
        arrays = dict(q=q, k=k, v=v, dout=dout, causal=np.array("bottom_right"), fully_masked=np.array(policy))
        report = na.crosscheck(**arrays, **{n: x.astype(dtype) for n, x in honest.items()})
        assert report, str(report)
        assert report.rows[0].bound < 0.05
        zeroed = out.copy()
        zeroed[..., :6, :] = wrong                               # the rows with no key, as 'zero' fills them
        assert not na.crosscheck(**arrays, **{**{n: x.astype(dtype) for n, x in honest.items()},
                                              "out": zeroed.astype(dtype)})


def test_cases_with_no_key_and_gradients_are_judged():
    """N_k = 0 with gradients (dense, MLA, packed sequences that are all empty, a paged cache
    with no cached key) raised 'cannot reshape array of size 0'; now judged: zeros pass (the
    'zero' policy), ones fail."""
    rng = np.random.default_rng(19)
    q = rng.standard_normal((1, 2, 3, 12)).astype(np.float32)
    zeros_out = np.zeros((1, 2, 3, 8), np.float32)
    cases = {
        "dense": dict(q=q[..., :8], k=np.zeros((1, 2, 0, 8), np.float32), v=np.zeros((1, 2, 0, 8), np.float32),
                      dq=np.zeros_like(q[..., :8]), dk=np.zeros((1, 2, 0, 8), np.float32),
                      dv=np.zeros((1, 2, 0, 8), np.float32)),
        "mla": dict(q=q, kv=np.zeros((1, 1, 0, 12), np.float32), head_dim_v=np.array(8), dq=np.zeros_like(q),
                    dkv=np.zeros((1, 1, 0, 12), np.float32)),
        "varlen": dict(q=q[0, :, :, :8], k=np.zeros((2, 0, 8), np.float32), v=np.zeros((2, 0, 8), np.float32),
                       cu_seqlens_q=np.array([0, 1, 3], np.int32), cu_seqlens_k=np.array([0, 0, 0], np.int32),
                       dq=np.zeros((2, 3, 8), np.float32), dk=np.zeros((2, 0, 8), np.float32),
                       dv=np.zeros((2, 0, 8), np.float32)),
        "paged": dict(q=q[..., :1, :8].repeat(2, 0), k=np.ones((2, 2, 4, 8), np.float32),
                      v=np.ones((2, 2, 4, 8), np.float32), page_table=np.array([[0], [1]], np.int32),
                      cache_seqlens=np.array([0, 0], np.int32), dq=np.zeros((2, 2, 1, 8), np.float32),
                      dk=np.zeros((2, 2, 4, 8), np.float32), dv=np.zeros((2, 2, 4, 8), np.float32)),
    }
    for name, arrays in cases.items():
        out = np.zeros(arrays["q"].shape[:-1] + (8,), np.float32) if name != "dense" else zeros_out
        dout = rng.standard_normal(out.shape).astype(np.float32)
        assert na.crosscheck(**arrays, dout=dout, out=out), name
        assert not na.crosscheck(**arrays, dout=dout, out=out + 1), name
