"""FlexAttention's score_mod and mask_mod (scores.py): every built-in variant written as one
equals the built-in option on every engine, forward, backward and tangent; the parameters'
gradients by complex step through what score_mod reads; against flex_attention's own eager
math in float64 under torch's autograd."""
import math
import warnings

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.score_mods import ScoreModDerivativeWarning

B, H, N_Q, N_K, D = 2, 3, 7, 9, 5
ENGINES = [{"implementation": "textbook"}, {"implementation": "blocked"}, {"implementation": "tiled", "block_size": 4}]
ENGINE_IDS = ["textbook", "blocked", "tiled"]
TOL = 1e-13


def qkv(seed=0, shape=(B, H)):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape + (N_Q, D)), rng.standard_normal(shape + (N_K, D)),
            rng.standard_normal(shape + (N_K, D)), rng.standard_normal(shape + (N_Q, D)))


RNG = np.random.default_rng(1)
SLOPES, BIAS = RNG.uniform(0.1, 1, H), RNG.standard_normal((H, N_Q, N_K))
OFFSET = N_K - N_Q                                              # the bottom-right diagonal's
PREFIX = 3
PREFIX_MASK = (np.arange(N_K)[None, :] <= np.arange(N_Q)[:, None]) | (np.arange(N_K)[None, :] < PREFIX)

# name -> (built-in options, the same as score_mod / mask_mod options, {built-in gradient: its param})
VARIANTS = {
    "alibi": ({"alibi_slopes": SLOPES},
              {"score_mod": lambda s, b, h, i, j, p: s - p["slopes"][h] * np.abs(i + OFFSET - j),
               "score_mod_params": {"slopes": SLOPES}}, {"dalibi_slopes": "slopes"}),
    "softcap": ({"softcap": 1.5}, {"score_mod": lambda s, b, h, i, j: 1.5 * np.tanh(s / 1.5)}, {}),
    "bias": ({"bias": BIAS}, {"score_mod": lambda s, b, h, i, j, p: s + p["bias"][h, i, j],
                              "score_mod_params": {"bias": BIAS}}, {"dbias": "bias"}),
    "causal": ({"causal": True}, {"mask_mod": lambda b, h, i, j: j <= i}, {}),
    "causal_bottom_right": ({"causal": "bottom_right"}, {"mask_mod": lambda b, h, i, j: j <= i + OFFSET}, {}),
    "window": ({"window": (2, 1), "align": "bottom_right"},
               {"mask_mod": lambda b, h, i, j: (j >= i + OFFSET - 2) & (j <= i + OFFSET + 1)}, {}),
    "prefix_lm": ({"mask": PREFIX_MASK}, {"mask_mod": lambda b, h, i, j: (j <= i) | (j < PREFIX)}, {}),
    "llama4_chunked": ({"causal": "bottom_right", "attention_chunk": 3},
                       {"mask_mod": lambda b, h, i, j: (j <= i + OFFSET) & ((i + OFFSET) // 3 == j // 3)}, {}),
}


def assert_close(actual, expected, what):
    np.testing.assert_allclose(actual, expected, rtol=0, atol=TOL, err_msg=what)


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
@pytest.mark.parametrize("name", VARIANTS)
def test_a_built_in_variant_as_a_mod_is_the_built_in(name, engine):
    builtin, mod, params = VARIANTS[name]
    q, k, v, dout = qkv()
    reference = engine                                    # the tiled engine has no softcap option
    if "softcap" in builtin and engine["implementation"] == "tiled":
        reference = {"implementation": "textbook"}
    out, cache = na.attention_forward(q, k, v, **reference, **builtin)
    out_mod, cache_mod = na.attention_forward(q, k, v, **engine, **mod)
    assert_close(out_mod, out, "out")
    assert_close(cache_mod.lse, cache.lse, "lse")
    dlse = np.random.default_rng(2).standard_normal(cache.lse.shape)
    grads, grads_mod = na.attention_backward(dout, cache, dlse), na.attention_backward(dout, cache_mod, dlse)
    for field in ("dq", "dk", "dv"):
        assert_close(getattr(grads_mod, field), getattr(grads, field), field)
    for field, param in params.items():
        assert_close(grads_mod.dscore_mod_params[param], getattr(grads, field), field)
    forward_mode = lambda e: {"implementation": "textbook"} if e["implementation"] == "blocked" else e
    tangents = qkv(3)[:3]
    for a, b in zip(na.attention_jvp(q, k, v, *tangents, **forward_mode(engine), **mod),
                    na.attention_jvp(q, k, v, *tangents, **forward_mode(reference), **builtin)):
        assert_close(a, b, "jvp")


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
def test_a_document_mask_is_packed_sequences(engine):
    """mask_mod on a document id per row and key equals cu_seqlens (q [H, total, d])."""
    rng = np.random.default_rng(4)
    cu_q, cu_k = np.array([0, 3, 3, 8]), np.array([0, 4, 6, 11])
    doc_q, doc_k = np.repeat(np.arange(3), np.diff(cu_q)), np.repeat(np.arange(3), np.diff(cu_k))
    q, dout = rng.standard_normal((H, 8, D)), rng.standard_normal((H, 8, D))
    k, v = rng.standard_normal((H, 11, D)), rng.standard_normal((H, 11, D))
    out, cache = na.attention_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal="bottom_right",
                                      **engine)
    local_q, local_k = np.arange(8) - cu_q[doc_q], np.arange(11) - cu_k[doc_k]
    lengths = np.diff(cu_k) - np.diff(cu_q)
    mask_mod = lambda b, h, i, j: (doc_q[i] == doc_k[j]) & (local_k[j] <= local_q[i] + lengths[doc_q[i]])
    out_mod, cache_mod = na.attention_forward(q, k, v, mask_mod=mask_mod, **engine)
    assert_close(out_mod, out, "out")
    for a, b in zip(na.attention_backward(dout, cache_mod)[:3], na.attention_backward(dout, cache)[:3]):
        assert_close(a, b, "grads")


def rel_mod(s, b, h, i, j, p):
    """A relative-position table and a learnable temperature: s / t + rel[h, i - j]."""
    return s / p["t"] + p["rel"][h, i - j + N_K - 1]


def rel_params(seed=5):
    rng = np.random.default_rng(seed)
    return {"rel": rng.standard_normal((H, N_Q + N_K - 1)), "t": np.array(1.3)}


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
def test_parameter_gradients_equal_complex_step_of_the_whole_attention(engine):
    q, k, v, dout = qkv(6)
    params = rel_params()
    loss = lambda p: np.sum(dout * na.attention_forward(q, k, v, score_mod=rel_mod, score_mod_params=p,
                                                          causal=True, **engine)[0]).real
    grads = na.attention_backward(dout, na.attention_forward(q, k, v, score_mod=rel_mod, score_mod_params=params,
                                                             causal=True, **engine)[1])
    h = 1e-30
    for name, value in params.items():
        expected = np.zeros(value.shape)
        for at in np.ndindex(value.shape):
            stepped = value.astype(complex)
            stepped[at] += 1j * h
            expected[at] = np.sum(dout * na.attention_forward(
                q.astype(complex), k, v, score_mod=rel_mod, score_mod_params={**params, name: stepped},
                causal=True, **engine)[0]).imag / h
        assert_close(grads.dscore_mod_params[name], expected, name)
    assert np.isfinite(loss(params))


def polynomial_mod(s, b, h, i, j, p):
    """A bias polynomial in the relative distance, its coefficients used whole (np.polyval)."""
    return s + np.polyval(p["c"], (i - j) / N_K)


def polynomial_vjp(ds, s, b, h, i, j, p):
    """d <ds, polynomial_mod> / d c_m = sum ds d^(K - 1 - m), d = (i - j) / N_K."""
    d = np.broadcast_to((i - j) / N_K, ds.shape)
    return np.array([np.sum(ds * d ** power) for power in range(len(p["c"]) - 1, -1, -1)])


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
def test_a_parameter_used_whole_takes_the_users_vjp(engine):
    """score_mod_vjps: the user's VJP of a parameter score_mod uses whole, checked by complex step
    before it is trusted; the gradient equals complex step of the whole attention."""
    q, k, v, dout = qkv(8)
    c = np.random.default_rng(9).standard_normal(4)
    mods = dict(score_mod=polynomial_mod, score_mod_params={"c": c}, score_mod_vjps={"c": polynomial_vjp},
                causal=True)
    grads = na.attention_backward(dout, na.attention_forward(q, k, v, **mods, **engine)[1])
    expected = np.zeros(4)
    for m in range(4):
        stepped = c + 1j * 1e-30 * np.eye(4)[m]
        out = na.attention_forward(q.astype(complex), k, v, causal=True, **engine,
                                   score_mod=lambda s, b, h, i, j: s + np.polyval(stepped, (i - j) / N_K))[0]
        expected[m] = np.sum(dout * out).imag / 1e-30
    assert_close(grads.dscore_mod_params["c"], expected, "dc")


def test_a_wrong_vjp_is_refused_naming_its_parameter():
    q, k, v, dout = qkv(8)
    reversed_vjp = lambda *args: polynomial_vjp(*args)[::-1]           # the powers in the wrong order
    _, cache = na.attention_forward(q, k, v, score_mod=polynomial_mod, score_mod_params={"c": np.arange(4.0)},
                                    score_mod_vjps={"c": reversed_vjp})
    with pytest.raises(ValueError, match="score_mod_vjps\\['c'\\] is not score_mod's VJP: along a random"):
        na.attention_backward(dout, cache)
    _, cache = na.attention_forward(q, k, v, score_mod=polynomial_mod, score_mod_params={"c": np.arange(4.0)},
                                    score_mod_vjps={"c": lambda *args: np.zeros(3)})
    with pytest.raises(ValueError, match="returned shape \\(3,\\); the gradient of score_mod_params\\['c'\\]"):
        na.attention_backward(dout, cache)


def test_complex_step_gradcheck_through_a_score_mod():
    q, k, v, _ = qkv(7)
    params = rel_params()
    forward = lambda q, k, v: na.attention_forward(q, k, v, score_mod=rel_mod, score_mod_params=params,
                                                   mask_mod=lambda b, h, i, j: j <= i + 1)
    report = na.gradcheck(forward, na.attention_backward, [q, k, v], method="complex")
    assert report, report
    assert max(row.max_rel_err for row in report.rows) < 1e-13, report


def test_a_score_mod_not_analytic_in_the_score_warns_and_falls_back_to_central_differences():
    q, k, v, _ = qkv(8)
    forward = lambda q, k, v: na.attention_forward(q, k, v, score_mod=lambda s, b, h, i, j: np.abs(s))
    with pytest.warns(ScoreModDerivativeWarning, match="not analytic"):
        report = na.gradcheck(forward, na.attention_backward, [q, k, v])
    assert report, report


def test_an_analytic_score_mod_gives_no_warning():
    q, k, v, dout = qkv(9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScoreModDerivativeWarning)
        na.attention_backward(dout, na.attention_forward(q, k, v, score_mod=rel_mod, score_mod_params=rel_params())[1])


def test_threads_give_the_same_bits():
    q, k, v, dout = qkv(10)
    results = []
    for workers in (1, 2):
        for engine in ENGINES[1:]:
            out, cache = na.attention_forward(q, k, v, score_mod=rel_mod, score_mod_params=rel_params(),
                                              mask_mod=lambda b, h, i, j: j <= i, workers=workers, **engine)
            results.append((out, na.attention_backward(dout, cache).dscore_mod_params["rel"]))
    for a, b in zip(results[:2], results[2:]):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_the_callables_see_index_arrays_broadcastable_to_the_block():
    q, k, v, _ = qkv(11)
    seen = []

    def mask_mod(b, h, i, j):
        seen.append((b.shape, h.shape, i.shape, j.shape))
        return np.broadcast_to(True, np.broadcast_shapes(b.shape, h.shape, i.shape, j.shape))
    na.attention_forward(q, k, v, mask_mod=mask_mod, implementation="textbook")
    assert seen == [((B, 1, 1, 1), (1, H, 1, 1), (1, 1, N_Q, 1), (1, 1, 1, N_K))]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"score_mod": 3}, TypeError, "score_mod must be a function"),
    ({"mask_mod": "causal"}, TypeError, "mask_mod must be a function"),
    ({"score_mod_params": {"t": 1.0}}, ValueError, "pass a score_mod too"),
    ({"score_mod": rel_mod, "score_mod_params": [1.0]}, TypeError, "dict of name -> array"),
    ({"mask_mod": lambda b, h, i, j: (j <= i).astype(int)}, TypeError, "must return booleans"),
    ({"mask_mod": lambda b, h, i, j: np.ones((2, 2), bool)}, ValueError, "not broadcastable"),
    ({"score_mod": lambda s, b, h, i, j: s[..., :1, :1, :1]}, None, None),
    ({"score_mod": lambda s, b, h, i, j: np.ones(3)}, ValueError, "score_mod returned shape"),
    ({"score_mod": lambda s, b, h, i, j, p: s + p["rel"], "score_mod_params": {"rel": np.ones(N_K)}},
     TypeError, "used score_mod_params\\['rel'\\] whole.*score_mod_vjps=\\{'rel': vjp\\}"),
    ({"score_mod": rel_mod, "score_mod_params": {"rel": np.ones(N_K)}, "score_mod_vjps": {"c": len}},
     ValueError, "score_mod_vjps\\['c'\\] is a VJP of a parameter score_mod_params does not have"),
    ({"score_mod": rel_mod, "score_mod_params": {"rel": np.ones(N_K)}, "score_mod_vjps": {"rel": 3}},
     TypeError, "score_mod_vjps\\['rel'\\] must be a function"),
    ({"score_mod": rel_mod, "score_mod_params": {"rel": np.ones(N_K)}, "score_mod_vjps": [len]},
     TypeError, "score_mod_vjps must be a dict"),
])
def test_bad_mods_are_refused(kwargs, error, message):
    q, k, v, _ = qkv()
    if error is None:                                     # a broadcastable result is accepted
        na.attention_forward(q, k, v, **kwargs)
        return
    with pytest.raises(error, match=message):
        na.attention_forward(q, k, v, **kwargs)


def test_the_hvp_refuses_a_score_mod_and_takes_a_mask_mod():
    q, k, v, dout = qkv(13)
    with pytest.raises(ValueError, match="takes no score_mod"):
        na.attention_hvp(q, k, v, dout, q, k, v, score_mod=lambda s, b, h, i, j: s)
    grads, grads_dot = na.attention_hvp(q, k, v, dout, q, k, v, mask_mod=lambda b, h, i, j: j <= i)
    expected = na.attention_hvp(q, k, v, dout, q, k, v, causal=True)
    for a, b in zip(grads_dot[:3], expected[1][:3]):
        assert_close(a, b, "hvp")


def test_the_callers_parameters_are_not_written():
    q, k, v, dout = qkv(12)
    params = rel_params()
    before = {name: x.copy() for name, x in params.items()}
    na.attention_backward(dout, na.attention_forward(q, k, v, score_mod=rel_mod, score_mod_params=params)[1])
    assert all(np.array_equal(params[n], before[n]) for n in params)


# ----------------------------------------------------------------------------- against torch

def flex_math(q, k, v, score_mod, mask_mod, scale):
    """flex_attention's eager math (torch's math_attention: the dense decomposition flex_attention
    runs without compiling), called directly so that torch's autograd runs on CPU (flex_attention
    itself refuses a CPU backward). Returns (out, lse) in natural log."""
    from torch._higher_order_ops.flex_attention import math_attention
    from torch.nn.attention.flex_attention import create_block_mask
    block_mask = create_block_mask(mask_mod or (lambda b, h, i, j: j >= 0), q.shape[0], q.shape[1],
                                   q.shape[2], k.shape[2], device="cpu")
    out, lse, _ = math_attention(q, k, v, score_mod or (lambda s, b, h, i, j: s), block_mask.as_tuple(),
                                 scale, {})
    return out, lse * math.log(2)


CHUNK, WINDOW = 3, 2


def torch_variants(torch):
    """name -> (params {name: array}, numpy score_mod, numpy mask_mod, torch score_mod(params),
    torch mask_mod, sinks or None)."""
    rng = np.random.default_rng(13)
    doc = np.array([0, 0, 0, 1, 1, 1, 1, 2, 2])                   # a document id per key (and row)
    start = np.array([0, 3, 7])                                    # each document's first index
    doc_t, start_t = torch.from_numpy(doc), torch.from_numpy(start)
    return {
        "relative_position_table": (
            {"rel": rng.standard_normal((H, N_Q + N_K - 1))},
            lambda s, b, h, i, j, p: s + p["rel"][h, i - j + N_K - 1], None,
            lambda p: lambda s, b, h, i, j: s + p["rel"][h, i - j + N_K - 1], None, None),
        "learnable_temperature": (
            {"t": np.array(0.7)}, lambda s, b, h, i, j, p: s / p["t"], lambda b, h, i, j: j <= i + OFFSET,
            lambda p: lambda s, b, h, i, j: s / p["t"], lambda b, h, i, j: j <= i + OFFSET, None),
        "tanh_softcap_with_a_learnable_cap": (
            {"cap": np.array(1.2)}, lambda s, b, h, i, j, p: p["cap"] * np.tanh(s / p["cap"]), None,
            lambda p: lambda s, b, h, i, j: p["cap"] * torch.tanh(s / p["cap"]), None, None),
        "llama4_chunked": (
            {}, None, lambda b, h, i, j: (i // CHUNK == j // CHUNK) & (j <= i),
            None, lambda b, h, i, j: (i // CHUNK == j // CHUNK) & (j <= i), None),
        "document_mask_with_a_prefix": (
            {}, None, lambda b, h, i, j: (doc[i] == doc[j]) & ((j <= i) | (j - start[doc[j]] < 2)),
            None, lambda b, h, i, j: (doc_t[i] == doc_t[j]) & ((j <= i) | (j - start_t[doc_t[j]] < 2)), None),
        "sliding_window_and_sinks": (
            {}, None, lambda b, h, i, j: (j <= i) & (j > i - WINDOW),
            None, lambda b, h, i, j: (j <= i) & (j > i - WINDOW), rng.standard_normal(H)),
    }


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
@pytest.mark.parametrize("name", ["relative_position_table", "learnable_temperature",
                                  "tanh_softcap_with_a_learnable_cap", "llama4_chunked",
                                  "document_mask_with_a_prefix", "sliding_window_and_sinks"])
def test_against_flex_attentions_math_in_float64(name, engine, torch):
    params, score_mod, mask_mod, torch_score_mod, torch_mask_mod, sinks = torch_variants(torch)[name]
    n = N_K if name.startswith(("llama4", "document", "sliding")) else N_Q   # square for the masks by index
    rng = np.random.default_rng(14)
    q, k, v = rng.standard_normal((B, H, n, D)), rng.standard_normal((B, H, N_K, D)), rng.standard_normal((B, H, N_K, D))
    dout, dlse = rng.standard_normal((B, H, n, D)), rng.standard_normal((B, H, n))
    q_t, k_t, v_t = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    p_t = {key: torch.tensor(x, requires_grad=True) for key, x in params.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out_t, lse_t = flex_math(q_t, k_t, v_t, torch_score_mod and torch_score_mod(p_t), torch_mask_mod,
                                 1 / math.sqrt(D))
    sink_t = None
    if sinks is not None:                                  # one more logit per row, no value
        sink_t = torch.tensor(sinks, requires_grad=True)
        total = torch.logaddexp(lse_t, sink_t[None, :, None])
        out_t, lse_t = out_t * torch.exp(lse_t - total)[..., None], total
    (torch.sum(out_t * torch.from_numpy(dout)) + torch.sum(lse_t * torch.from_numpy(dlse))).backward()
    options = dict(engine, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks,
                   score_mod_params=params or None)
    out, cache = na.attention_forward(q, k, v, **options)
    grads = na.attention_backward(dout, cache, dlse)
    tol = dict(rtol=0, atol=1e-12)
    np.testing.assert_allclose(out, out_t.detach().numpy(), **tol)
    np.testing.assert_allclose(cache.lse, lse_t.detach().numpy(), **tol)
    for ours, x in zip(grads[:3], (q_t, k_t, v_t)):
        np.testing.assert_allclose(ours, x.grad.numpy(), **tol)
    for key, x in p_t.items():
        np.testing.assert_allclose(grads.dscore_mod_params[key], x.grad.numpy(), **tol)
    if sinks is not None:
        np.testing.assert_allclose(grads.dsinks, sink_t.grad.numpy(), **tol)


def test_the_pipeline_on_blocks_of_strided_heads_is_the_pipeline_on_the_whole():
    """Blocks of every G-th head and of rows (the naive baseline's) give the whole's bits for S
    and the same parameters' gradients (to rounding: their sums split over the blocks)."""
    from numpy_attention import scores
    from numpy_attention.score_grads import ScoreGrads
    from numpy_attention.options import attention_options
    rng = np.random.default_rng(15)
    q, k, v = rng.standard_normal((B, 4, N_Q, D)), rng.standard_normal((B, 2, N_K, D)), rng.standard_normal((B, 2, N_K, D))
    params = {"rel": rng.standard_normal((4, N_Q + N_K - 1)), "t": np.array(0.9)}
    _, _, _, o = attention_options(q, k, v, bias=rng.standard_normal((1, N_Q, N_K)), alibi_slopes=rng.uniform(0, 1, 4),
                                   score_mod=lambda s, b, h, i, j, p: s / p["t"] + p["rel"][h, i - j + N_K - 1],
                                   score_mod_params=params, mask_mod=lambda b, h, i, j: (i + j) % 3 != 0)
    shape = (B, 4, N_Q, N_K)
    s1, ds = rng.standard_normal(shape), rng.standard_normal(shape)
    whole_s, saved = scores.forward(s1.copy(), o, shape)
    whole = ScoreGrads(o, shape, np.float64)
    whole_ds = scores.backward(ds.copy(), o, shape, saved=saved, grads=whole)
    blocks = [(Ellipsis, slice(g, None, 2), rows, slice(None)) for g in range(2) for rows in (slice(0, 3), slice(3, N_Q))]
    parts = [ScoreGrads(o, shape, np.float64, region=[block]) for block in blocks]
    for block, part in zip(blocks, parts):
        s_block, saved_block = scores.forward(s1[block].copy(), o, shape, block)
        np.testing.assert_array_equal(s_block, whole_s[block])
        np.testing.assert_array_equal(scores.backward(ds[block].copy(), o, shape, block, saved_block, grads=part),
                                      whole_ds[block])
    total, expected = ScoreGrads.total(parts, o, shape, np.float64), ScoreGrads.total([whole], o, shape, np.float64)
    for name in ("dbias", "dalibi_slopes"):
        assert_close(total[name], expected[name], name)
    for name in params:
        assert_close(total["dscore_mod_params"][name], expected["dscore_mod_params"][name], name)


MODS_MODULE = '''
import numpy as np
REL = np.random.default_rng(0).standard_normal((3, 2 * 9 - 1))

def rel_bias(score, b, h, q_idx, kv_idx):
    return score + REL[h, q_idx - kv_idx + 8]

def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx
'''


def test_the_command_takes_the_mods_by_module_and_name(tmp_path, monkeypatch, capsys):
    from numpy_attention.commands.cli import main
    (tmp_path / "mymods.py").write_text(MODS_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import mymods
    rng = np.random.default_rng(16)
    q, k, v = (rng.standard_normal((1, 3, 9, 4)).astype(np.float32) for _ in range(3))
    honest, _ = na.attention_forward(q, k, v, score_mod=mymods.rel_bias, mask_mod=mymods.causal)
    plain, _ = na.attention_forward(q, k, v, causal=True)
    for name, out in (("honest", honest), ("plain", plain)):
        np.savez(tmp_path / f"{name}.npz", q=q, k=k, v=v, out=out)
    mods = ["--score-mod", "mymods:rel_bias", "--mask-mod", "mymods:causal"]
    assert main(["crosscheck", "honest.npz", *mods]) == 0
    assert main(["crosscheck", "plain.npz", *mods]) == 1          # computed without the score_mod
    capsys.readouterr()
    assert main(["crosscheck", "honest.npz", "--score-mod", "mymods"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--score-mod is MODULE:FUNCTION" in err
    assert main(["crosscheck", "honest.npz", "--mask-mod", "mymods:nope"]) == 2
    assert "module mymods has no 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
def test_mods_written_with_torch_are_taken_as_they_are(engine, torch):
    """flex_attention's mods, torch's operations on tensors (a captured table, torch.tanh, a
    captured document id per position), give the NumPy-written mods' results."""
    rng = np.random.default_rng(17)
    q, k, v, dout = qkv(18)
    rel, doc = rng.standard_normal((H, N_Q + N_K - 1)), np.sort(rng.integers(0, 3, N_K))
    rel_t, doc_t = torch.tensor(rel, dtype=torch.float32), torch.from_numpy(doc)
    pairs = [  # (torch-written, NumPy-written)
        ({"score_mod": lambda s, b, h, i, j: s + rel_t[h, i - j + N_K - 1]},
         {"score_mod": lambda s, b, h, i, j: s + rel.astype(np.float32).astype(np.float64)[h, i - j + N_K - 1]}),
        ({"score_mod": lambda s, b, h, i, j, p: p["cap"] * torch.tanh(s / p["cap"]),
          "score_mod_params": {"cap": np.array(1.4)}},
         {"score_mod": lambda s, b, h, i, j, p: p["cap"] * np.tanh(s / p["cap"]),
          "score_mod_params": {"cap": np.array(1.4)}}),
        ({"mask_mod": lambda b, h, i, j: (doc_t[i.clamp(max=N_K - 1)] == doc_t[j]) & (j <= i + OFFSET)},
         {"mask_mod": lambda b, h, i, j: (doc[np.minimum(i, N_K - 1)] == doc[j]) & (j <= i + OFFSET)}),
    ]
    for with_torch, with_numpy in pairs:
        (out_t, cache_t), (out_n, cache_n) = (na.attention_forward(q, k, v, **engine, **mods)
                                              for mods in (with_torch, with_numpy))
        assert_close(out_t, out_n, "out")
        grads_t, grads_n = na.attention_backward(dout, cache_t), na.attention_backward(dout, cache_n)
        for a, b in zip(grads_t[:3], grads_n[:3]):
            assert_close(a, b, "grads")
        if "score_mod_params" in with_torch:
            assert_close(grads_t.dscore_mod_params["cap"], grads_n.dscore_mod_params["cap"], "dcap")
        jvp_engine = {"implementation": "textbook"} if engine["implementation"] == "blocked" else engine
        for a, b in zip(*(na.attention_jvp(q, k, v, q, k, v, **jvp_engine, **mods) for mods in (with_torch, with_numpy))):
            assert_close(a, b, "jvp")


def test_crosscheck_of_a_large_case_with_mods_on_threads_is_its_report_on_one():
    """A case of PARALLEL_SCORES scores runs its baselines on threads in (batch, kv head)
    slices; with mods that index the heads it must stay whole (they see its b and h)."""
    rng = np.random.default_rng(19)
    q, k, v = (rng.standard_normal((2, 4, 256, 8)).astype(np.float32) for _ in range(3))
    rel = rng.standard_normal((4, 511))
    mods = dict(score_mod=lambda s, b, h, i, j, p: s + 3 * p["rel"][h, i - j + 255] * (b + 1),
                score_mod_params={"rel": rel}, mask_mod=lambda b, h, i, j: (j <= i) | (h == b))
    out, cache = na.attention_forward(q, k, v, **mods)
    reports = [na.crosscheck(q=q, k=k, v=v, out=out, lse=cache.lse, workers=w, **mods) for w in (1, 2)]
    assert reports[0] and str(reports[0]) == str(reports[1])


# score_mod's -inf (FlexAttention's way to mask) -> the same mask as a -inf bias
MASKED = RNG.random((H, N_Q, N_K)) < 0.3
MASKED[:, 2] = True                                             # a row whose every key score_mod masks
MASKS = {
    "a column": (lambda s, b, h, i, j: np.where(j == 2, -np.inf, s), np.where(np.arange(N_K) == 2, -np.inf, 0.0), {}),
    "an added -inf": (lambda s, b, h, i, j: s + np.where((i + j) % 4 == 0, -np.inf, 0.0),
                      np.where((np.arange(N_Q)[:, None] + np.arange(N_K)) % 4 == 0, -np.inf, 0.0), {}),
    "entries and a whole row": (lambda s, b, h, i, j: np.where(MASKED[h, i, j], -np.inf, s),
                                np.where(MASKED, -np.inf, 0.0), {}),
    "a parameter's -inf": (lambda s, b, h, i, j, p: s + p["bias"][h, i, j], np.where(MASKED, -np.inf, BIAS),
                           {"score_mod_params": {"bias": np.where(MASKED, -np.inf, BIAS)}}),
}


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
@pytest.mark.parametrize("mask", MASKS)
def test_a_score_mod_that_masks_with_minus_inf_is_that_mask_as_a_bias(mask, engine):
    """A score score_mod sets to -inf is a masked score: out, lse, the gradients (dq, dk, dv, and a
    parameter's 0 where it is -inf) and the tangents are those of the same -inf given as bias, to
    1e-12 and finite (its derivative once came out NaN, by the entries its self-check sampled)."""
    mod, bias, params = MASKS[mask]
    q, k, v, dout = qkv(11)
    dlse = np.random.default_rng(12).standard_normal((B, H, N_Q))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScoreModDerivativeWarning)
        out, cache = na.attention_forward(q, k, v, score_mod=mod, **params, **engine)
        grads = na.attention_backward(dout, cache, dlse)
        forward_mode = {"implementation": "textbook"} if engine["implementation"] == "blocked" else engine
        tangents = qkv(13)[:3]
        jvp = na.attention_jvp(q, k, v, *tangents, score_mod=mod, **params, **forward_mode)
    out_bias, cache_bias = na.attention_forward(q, k, v, bias=bias, **engine)
    grads_bias = na.attention_backward(dout, cache_bias, dlse)
    jvp_bias = na.attention_jvp(q, k, v, *tangents, bias=bias, **forward_mode)
    pairs = [(out, out_bias), (cache.lse, cache_bias.lse), (grads.dq, grads_bias.dq), (grads.dk, grads_bias.dk),
             (grads.dv, grads_bias.dv), *zip(jvp, jvp_bias)]
    if params:
        pairs.append((grads.dscore_mod_params["bias"], grads_bias.dbias))
    for ours, theirs in pairs:
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
    for g in grads[:3]:
        assert np.isfinite(g).all()


@pytest.mark.parametrize("mask", MASKS)
def test_complex_step_through_a_minus_inf_score_mod(mask):
    """gradcheck by complex step (random upstream gradients) of attention whose score_mod masks
    with -inf: the hand-written backward to 1e-12."""
    mod, _, params = MASKS[mask]
    q, k, v, _ = qkv(14)
    forward = lambda q, k, v: na.attention_forward(q, k, v, score_mod=mod, **params)
    report = na.gradcheck(forward, na.attention_backward, [q, k, v], method="complex", mode="projection")
    assert report and max(row.max_rel_err for row in report.rows) < 1e-12, report


def test_what_a_score_mod_prints_stays_off_the_json(tmp_path, monkeypatch, capsys):
    """A --score-mod that prints wrote into crosscheck's --json; its prints now go to stderr."""
    import json

    from numpy_attention.commands.cli import main
    (tmp_path / "chatty.py").write_text("def bias(score, b, h, q_idx, kv_idx):\n"
                                        "    print('computing a score')\n    return score + 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    rng = np.random.default_rng(17)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)).astype(np.float32) for _ in range(3))
    out, _ = na.attention_forward(q, k, v)                         # + 1 on every score changes nothing
    np.savez(tmp_path / "case.npz", q=q, k=k, v=v, out=out)
    assert main(["crosscheck", "case.npz", "--json", "--score-mod", "chatty:bias"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["passed"] is True and "computing a score" in captured.err


def test_a_float32_backward_through_an_analytic_score_mod_keeps_float32_accuracy():
    """The complex step's check against central differences runs in float64 for float32 scores
    (in float32, s + h keeps about one digit of h: the check once failed, and the float32
    fallback made the baseline's dq off by 1e-2, so a float32 crosscheck with a score_mod
    passed a dq 1% wrong)."""
    q, k, v, dout = qkv(14)
    params = rel_params()
    options = {"score_mod": rel_mod, "score_mod_params": params}
    grads = na.attention_backward(dout, na.attention_forward(q, k, v, **options)[1])
    low = {"score_mod": rel_mod, "score_mod_params": {name: x.astype(np.float32) for name, x in params.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScoreModDerivativeWarning)
        out32, cache32 = na.attention_forward(*(x.astype(np.float32) for x in (q, k, v)), **low)
        grads32 = na.attention_backward(dout.astype(np.float32), cache32)
    for g32, g in zip(grads32[:3], grads[:3]):
        assert g32.dtype == np.float32
        assert np.abs(g32 - g).max() <= 1e-5 * np.abs(g).max()


def test_one_heads_2d_inputs_take_a_score_mod_and_a_mask_mod_with_b_and_h_zero():
    """q [N_q, d], k, v [N_k, d]: the textbook's scores are [N_q, N_k], its mods' b and h 0 (one
    head of one sequence), as the blocked and tiled engines' [1, N_q, N_k]; forward and backward."""
    rng = np.random.default_rng(9)
    q, k, v, dout = (rng.standard_normal(shape) for shape in [(3, 4), (5, 4), (5, 4), (3, 4)])
    mods = dict(score_mod=lambda s, b, h, i, j: 1.1 * s + 0.1 * (i - j) + 0.3 * h + 0.2 * b,
                mask_mod=lambda b, h, i, j: (j != 2) | (h + b > 0))
    results = []
    for engine in ("textbook", "blocked", "tiled"):
        out, cache = na.attention_forward(q, k, v, implementation=engine, **mods)
        results.append((out, *na.attention_backward(dout, cache)[:3]))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)
