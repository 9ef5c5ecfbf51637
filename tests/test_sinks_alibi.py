"""Attention sinks and ALiBi: one more logit per row with no value (sinks [H]), and the bias
-slope_h |i + N_k - N_q - j| (alibi_slopes [H] or [B, H]), each with its gradient, in all
three engines; against complex step, an independent torch float64 autograd implementation,
and their definitions."""
import numpy as np
import pytest
from layouts import grouped_inputs

import numpy_attention as na

SIZES = (5, 7)                                                   # grouped_inputs' N_q, N_k
RNG = np.random.default_rng(31)
MASK = RNG.random((2, 1, 5, 7)) < 0.6
MASK[1, 0, 2] = False                                            # a fully masked row
SINKS, SLOPES = RNG.standard_normal(4), RNG.uniform(0.1, 1.0, (2, 4))
CASES = {
    "sinks": {"sinks": SINKS},
    "sinks, causal, dead row": {"sinks": SINKS, "causal": True, "mask": MASK},
    "alibi [H]": {"alibi_slopes": SLOPES[0]},
    "alibi [B, H], bottom_right": {"alibi_slopes": SLOPES, "causal": "bottom_right"},
    "sinks, alibi, bias, window": {"sinks": SINKS, "alibi_slopes": SLOPES[1], "window": (2, 1),
                                   "bias": RNG.standard_normal((5, 7))},
    "sinks, softcap, dropout": {"sinks": SINKS, "softcap": 2.0, "dropout_mask": RNG.random((2, 4, 5, 7)) < 0.8,
                                "dropout_p": 0.2},
}
TILED = [name for name, o in CASES.items() if "softcap" not in o]
ENGINE_CASES = [(engine, name) for engine in ("textbook", "blocked", "tiled")
                for name in (TILED if engine == "tiled" else CASES)]


def checked(options):
    """(forward, backward, names of the per-head inputs) with sinks and slopes as inputs."""
    names = [n for n in ("sinks", "alibi_slopes", "bias") if n in options]
    fixed = {n: x for n, x in options.items() if n not in names}
    return names, fixed


@pytest.mark.parametrize("engine, case", ENGINE_CASES)
def test_gradients_of_out_and_lse_equal_complex_step(engine, case):
    names, fixed = checked(CASES[case])
    q, k, v, _, _ = grouped_inputs(0, *SIZES)

    def forward(q, k, v, *per_head):
        out, cache = na.attention_forward(q, k, v, implementation=engine, **fixed, **dict(zip(names, per_head)))
        return np.concatenate([out.ravel(), cache.lse.ravel()]), cache

    def backward(d, cache):
        n = cache.out.size
        g = na.attention_backward(d[:n].reshape(cache.out.shape), cache, d[n:].reshape(cache.lse.shape))
        return [g.dq, g.dk, g.dv] + [getattr(g, {"bias": "dbias"}.get(n, "d" + n)) for n in names]
    report = na.gradcheck(forward, backward, [q, k, v] + [CASES[case][n] for n in names], method="complex")
    assert report, report


@pytest.mark.parametrize("engine, case", [(e, c) for e, c in ENGINE_CASES if e != "textbook"])
def test_engines_equal_the_textbook(engine, case):
    q, k, v, dout, dlse = grouped_inputs(1, *SIZES)
    results = {}
    for name in ("textbook", engine):
        out, cache = na.attention_forward(q, k, v, implementation=name, **CASES[case])
        results[name] = (out, cache.lse) + tuple(na.attention_backward(dout, cache, dlse)[i] for i in (0, 1, 2, 5, 6))
    for got, want in zip(results[engine], results["textbook"]):
        if want is None:
            assert got is None
        else:
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13 * np.abs(want).max())


def test_sinks_by_their_definition():
    """softmax over [S, sink] with the sink's column dropped; a fully masked row: out 0, lse = sink."""
    q, k, v, _, _ = grouped_inputs(2, *SIZES)
    out, cache = na.attention_forward(q, k, v, sinks=SINKS, mask=MASK)
    plain = na.attention_forward(q, k, v, mask=MASK)[1]
    S = plain.scores
    sink = np.broadcast_to(SINKS[:, None, None], S.shape[:-1] + (1,))
    lse = np.logaddexp(np.where(np.isneginf(plain.lse), -np.inf, plain.lse), sink[..., 0])
    np.testing.assert_allclose(cache.lse, lse, rtol=1e-14)
    np.testing.assert_allclose(cache.weights, np.exp(S - lse[..., None]), rtol=1e-13, atol=1e-16)
    assert (out[1, :, 2] == 0).all() and np.allclose(cache.lse[1, :, 2], SINKS)


def test_alibi_by_its_definition_in_both_alignments():
    """The slope times the distance from the bottom-right diagonal; top-left as a plain bias."""
    q, k, v, _, _ = grouped_inputs(3, *SIZES)
    i, j = np.arange(5)[:, None], np.arange(7)[None, :]
    for distance, options in ((np.abs(i + 2 - j), {"alibi_slopes": SLOPES[0]}),
                              (np.abs(i - j), {"bias": -SLOPES[0][:, None, None] * np.abs(i - j)})):
        bias = -SLOPES[0][:, None, None] * distance
        want = na.attention_forward(q, k, v, bias=bias)[0]
        np.testing.assert_allclose(na.attention_forward(q, k, v, **options)[0], want, rtol=1e-14)


def test_against_torch_float64_autograd(torch):
    q, k, v, dout, dlse = grouped_inputs(4, *SIZES)
    out, cache = na.attention_forward(q, k, v, sinks=SINKS, alibi_slopes=SLOPES, causal=True)
    grads = na.attention_backward(dout, cache, dlse)
    tq, tk, tv, ts, ta = (torch.tensor(x, requires_grad=True) for x in (q, k, v, SINKS, SLOPES))
    kk, vv = tk.repeat_interleave(2, dim=1), tv.repeat_interleave(2, dim=1)
    i, j = torch.arange(5)[:, None], torch.arange(7)[None, :]
    s = tq @ kk.transpose(-1, -2) / np.sqrt(3) - ta[..., None, None] * (i + 2 - j).abs()
    s = s.masked_fill(j > i, float("-inf"))                         # top-left causal
    s = torch.cat([s, ts[:, None, None].expand(2, 4, 5, 1)], dim=-1)  # the sink: one more logit
    p = torch.softmax(s, -1)[..., :-1]
    loss = ((p @ vv) * torch.tensor(dout)).sum() + (torch.logsumexp(s, -1) * torch.tensor(dlse)).sum()
    loss.backward()
    np.testing.assert_allclose(out, (p @ vv).detach().numpy(), rtol=1e-13, atol=1e-14)
    for ours, theirs in ((grads.dq, tq), (grads.dk, tk), (grads.dv, tv), (grads.dsinks, ts),
                         (grads.dalibi_slopes, ta)):
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("kwargs, message", [
    ({"sinks": np.zeros(3)}, r"sinks must have shape \(4,\)"),
    ({"alibi_slopes": np.zeros((3, 4))}, r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
    ({"sinks": np.zeros(4), "fully_masked": "nan"}, "fully_masked='nan' does not apply"),
])
def test_bad_sinks_and_slopes_are_refused(kwargs, message):
    q, k, v, _, _ = grouped_inputs(0, *SIZES)
    with pytest.raises(ValueError, match=message):
        na.attention_forward(q, k, v, **kwargs)


@pytest.mark.parametrize("implementation", ["textbook", "blocked", "tiled"])
def test_a_sink_of_minus_infinity_is_no_sink(implementation):
    q, k, v, dout, _ = grouped_inputs(8, *SIZES)
    with_none = na.attention_forward(q, k, v, sinks=np.array([-np.inf, 0.3, -np.inf, 1.0]),
                                     implementation=implementation)
    assert np.isfinite(with_none[0]).all()
    plain = na.attention_forward(q[:, :1], k[:, :1], v[:, :1], implementation=implementation)[0]
    np.testing.assert_allclose(with_none[0][:, :1], plain, rtol=1e-14, atol=1e-15)
    grads = na.attention_backward(dout, with_none[1])
    assert grads.dsinks[0] == 0 and np.isfinite(grads.dq).all()


def test_per_head_lists_keep_float32_and_check_finite_covers_them():
    q, k, v, _, _ = grouped_inputs(0, *SIZES)
    f32 = [x.astype(np.float32) for x in (q, k, v)]
    assert na.attention_forward(*f32, sinks=[0.1, 0.2, 0.3, 0.4], alibi_slopes=[0.5] * 4)[0].dtype == np.float32
    with pytest.raises(ValueError, match="alibi_slopes .* non-finite"):
        na.attention_forward(q, k, v, alibi_slopes=[np.nan, 0, 0, 0], check_finite=True)


@pytest.mark.parametrize("engine", ["textbook", "blocked", "tiled", "sparse"])
def test_a_sink_of_minus_inf_on_a_row_with_no_key_weighs_nothing(engine):
    """A -inf sink is no sink; on a row whose keys are all masked its weight exp(sink - lse) is
    exp(-inf - (-inf)): 0, not NaN. dsinks, out, lse and the tangents stay finite on every engine
    (the head with a finite sink too), dsinks 0 for the -inf sink."""
    rng = np.random.default_rng(5)
    q, dout = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, 3, 4))
    k, v = rng.standard_normal((1, 2, 5, 4)), rng.standard_normal((1, 2, 5, 4))
    keep = np.ones((3, 5), bool)
    keep[1] = False                                                    # row 1: no key
    sinks = np.array([-np.inf, 0.5])
    lists = np.where(keep, np.arange(5), -1)[None, None].repeat(2, axis=1)    # the same keys as lists
    given = {"topk_indices": lists} if engine == "sparse" else {"mask": keep, "implementation": engine}
    out, cache = na.attention_forward(q, k, v, sinks=sinks, **given)
    grads = na.attention_backward(dout, cache)
    assert np.isfinite(out).all() and np.isfinite(grads.dsinks).all() and grads.dsinks[0] == 0
    assert np.isfinite(grads.dq).all() and np.isfinite(grads.dk).all() and np.isfinite(grads.dv).all()
    if engine != "blocked":                                            # (no forward mode on blocked)
        jvp = na.attention_jvp(q, k, v, q, k, v, sinks=sinks, sinks_dot=np.ones(2), **given)
        assert all(np.isfinite(x).all() for x in (jvp[1], jvp[3][:, 1]))
