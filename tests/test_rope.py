"""rope_forward / rope_backward / rope_jvp: the two layouts, partial rotary, offsets and packed
positions, linear and YaRN scaling; against an independent torch float64 implementation (the
formulas of FlashAttention's apply_rotary_emb_torch and Hugging Face's YaRN frequencies, written
here), complex step and the rotation's own properties."""
import decimal
import math

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.rope import frequencies

RNG = np.random.default_rng(3)
CASES = [dict(layout="half"), dict(layout="interleaved"), dict(layout="half", rotary_dim=4),
         dict(layout="interleaved", rotary_dim=6, base=500000.0),
         dict(layout="half", scaling={"type": "linear", "factor": 4.0}),
         dict(layout="half", scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}),
         dict(layout="interleaved", rotary_dim=6,
              scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16, "beta_fast": 16.0,
                       "beta_slow": 2.0}),
         dict(layout="half", base=150000.0,                                  # gpt-oss's
              scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                       "beta_slow": 1.0, "truncate": False}),
         dict(layout="interleaved",                                          # DeepSeek-V3's: magnitude 1
              scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                       "mscale_all_dim": 1.0}),
         dict(layout="half", scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                      "mscale": 1.0, "mscale_all_dim": 0.5}),
         dict(layout="half", scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                      "mscale": 0.7}),                       # alone: the default factor
         dict(layout="half", scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "attention_factor": 0.8, "mscale": 1.0, "mscale_all_dim": 0.5})]
IDS = ["half", "interleaved", "half-partial", "interleaved-partial-base", "linear", "yarn", "yarn-partial",
       "yarn-not-truncated", "yarn-mscale-deepseek-v3", "yarn-mscale-ratio", "yarn-mscale-alone",
       "yarn-attention-factor"]


def torch_rope(x, positions, layout="half", rotary_dim=None, base=10000.0, scaling=None):
    """The reference, in torch float64: FlashAttention's rotate_half and apply_rotary_emb_torch
    (cos, sin [N, r/2] repeated over the pairs' layout), Hugging Face's linear and YaRN inverse
    frequencies and attention factor (_compute_yarn_parameters: truncate, mscale, mscale_all_dim,
    attention_factor), written from their definitions. x: a float64 tensor (autograd flows
    through)."""
    import torch
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    t, attention_factor = torch.as_tensor(positions, dtype=torch.float64), 1.0
    if scaling and scaling["type"] == "linear":
        t = t / scaling["factor"]
    elif scaling:
        f, L = scaling["factor"], scaling["original_max_position_embeddings"]
        fast, slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
        dim = lambda rot: (r * math.log(L / (rot * 2 * math.pi))) / (2 * math.log(base))
        low, high = dim(fast), dim(slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, r - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(r // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv_freq = inv_freq / f * (1 - extrapolation) + inv_freq * extrapolation
        mscale = lambda m: 0.1 * m * math.log(f) + 1.0 if f > 1 else 1.0
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None and scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"])
        elif attention_factor is None:
            attention_factor = mscale(1.0)
    freqs = t[..., None] * inv_freq                                   # [..., N, r/2]
    cos, sin = torch.cos(freqs) * attention_factor, torch.sin(freqs) * attention_factor
    if layout == "half":
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        x1, x2 = x[..., :r].chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], -1)
    else:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        rotated = torch.stack([-x2, x1], -1).flatten(-2)
    return torch.cat([x[..., :r] * cos + rotated * sin, x[..., r:]], -1)


@pytest.mark.parametrize("options", CASES, ids=IDS)
def test_against_an_independent_torch_float64_rope(options, torch):
    x = RNG.standard_normal((2, 3, 7, 8))
    positions = np.array([0, 1, 2, 5, 9, 40, 1000])
    y, _ = na.rope_forward(x, positions, **options)
    reference = torch_rope(torch.from_numpy(x), positions, **options).numpy()
    np.testing.assert_allclose(y, reference, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("options", CASES, ids=IDS)
def test_backward_and_jvp_against_complex_step(options):
    x, x_dot = RNG.standard_normal((2, 5, 8)), RNG.standard_normal((2, 5, 8))
    positions = np.arange(3, 8)
    forward = lambda x: na.rope_forward(x, positions, **options)
    report = na.gradcheck(forward, lambda dy, cache: [na.rope_backward(dy, cache)], [x], method="complex")
    assert report and report.rows[0].max_rel_err <= 1e-14, report
    y, y_dot = na.rope_jvp(x, positions, x_dot, **options)
    np.testing.assert_array_equal(y, forward(x)[0])
    step = forward(x + 1e-30j * x_dot)[0].imag / 1e-30
    np.testing.assert_allclose(y_dot, step, rtol=1e-14, atol=1e-15)


def test_it_turns_pairs_keeps_norms_and_makes_scores_depend_on_the_offset_alone():
    """Each pair keeps its length; q_m . k_n depends on m - n only (what RoPE is for); the entries
    past rotary_dim pass unchanged; position 0 turns nothing."""
    q, k = RNG.standard_normal((1, 16)), RNG.standard_normal((1, 16))
    for layout in ("half", "interleaved"):
        y, _ = na.rope_forward(q, [37], layout=layout, rotary_dim=12)
        a, b = (y[0, :6], y[0, 6:12]) if layout == "half" else (y[0, 0:12:2], y[0, 1:12:2])
        qa, qb = (q[0, :6], q[0, 6:12]) if layout == "half" else (q[0, 0:12:2], q[0, 1:12:2])
        np.testing.assert_allclose(a ** 2 + b ** 2, qa ** 2 + qb ** 2, rtol=1e-13)
        np.testing.assert_array_equal(y[0, 12:], q[0, 12:])
        np.testing.assert_allclose(na.rope_forward(q, [0], layout=layout)[0], q, rtol=0, atol=0)
        turned = lambda x, m: na.rope_forward(x, [m], layout=layout)[0][0]
        score = lambda m, n: float(turned(q, m) @ turned(k, n))
        assert math.isclose(score(10, 3), score(107, 100), rel_tol=1e-12)


def test_packed_positions_restart_per_sequence_and_offsets_decode():
    """Positions are the caller's: packed sequences pass each sequence's own 0, 1, ...; a decoding
    step passes its offset; the rows equal the whole sequence's rows at those positions."""
    x = RNG.standard_normal((4, 10, 8))
    whole, _ = na.rope_forward(x, np.arange(10))
    packed = np.concatenate([np.arange(6), np.arange(4)])
    y, _ = na.rope_forward(np.concatenate([x[:, :6], x[:, :4]], axis=1), packed)
    np.testing.assert_array_equal(y[:, 6:], whole[:, :4])
    step, _ = na.rope_forward(x[:, 9:], [9])
    np.testing.assert_array_equal(step, whole[:, 9:])
    per_batch, _ = na.rope_forward(x[:2, :1], np.array([[3], [7]]))          # [B, 1] offsets
    np.testing.assert_allclose(per_batch[1], na.rope_forward(x[1:2, :1], [7])[0][0], rtol=0, atol=0)


def test_the_layouts_differ_and_float32_turns_in_float32():
    x = RNG.standard_normal((3, 8))
    half, interleaved = (na.rope_forward(x, np.arange(3), layout=layout)[0] for layout in ("half", "interleaved"))
    assert not np.allclose(half, interleaved)
    y, cache = na.rope_forward(x.astype(np.float32), np.arange(3))
    assert y.dtype == np.float32 and cache.cos.dtype == np.float32
    np.testing.assert_allclose(y, na.rope_forward(x.astype(np.float32).astype(np.float64), np.arange(3))[0], rtol=1e-6)


def test_yarn_keeps_the_high_frequencies_and_interpolates_the_low_ones():
    plain = frequencies(64)[0]
    yarn, position_factor, magnitude = frequencies(64, scaling={"type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 2048})
    assert yarn[0] == plain[0] and np.isclose(yarn[-1], plain[-1] / 4) and position_factor == 1.0
    assert math.isclose(magnitude, 0.1 * math.log(4) + 1)


@pytest.mark.parametrize("call, error, words", [
    (lambda x: na.rope_forward(x, np.arange(5), rotary_dim=3), ValueError,
     "rotary_dim must be an even integer from 2 to d = 8"),
    (lambda x: na.rope_forward(x, np.arange(5), rotary_dim=10), ValueError, "rotary_dim must be an even integer"),
    (lambda x: na.rope_forward(x, np.arange(4)), ValueError,
     r"positions of shape \(4,\) do not broadcast to x's \[..., N\] = \(2, 5\)"),
    (lambda x: na.rope_forward(x, np.arange(5), layout="neox"), ValueError, "layout"),
    (lambda x: na.rope_forward(x, np.array(["a"] * 5)), TypeError, "positions must be integers or floats"),
    (lambda x: na.rope_forward(x, np.arange(5), scaling={"type": "ntk", "factor": 2.0}), ValueError,
     "scaling\\['type'\\]"),
    (lambda x: na.rope_forward(x, np.arange(5), scaling={"type": "yarn", "factor": 2.0}), TypeError,
     "original_max_position_embeddings"),
    (lambda x: na.rope_forward(x, np.arange(5), scaling={"type": "linear", "factor": 2.0, "mscale": 0.7}),
     ValueError, "scaling has the key 'mscale'; a linear scaling takes type, factor"),
    (lambda x: na.rope_backward(np.ones((2, 5, 7)), na.rope_forward(x, np.arange(5))[1]), ValueError, "dy"),
])
def test_bad_arguments_are_refused_by_name(call, error, words):
    with pytest.raises(error, match=words):
        call(RNG.standard_normal((2, 5, 8)))


def test_does_not_write_into_its_arguments():
    x, positions, dy = RNG.standard_normal((2, 5, 8)), np.arange(5), RNG.standard_normal((2, 5, 8))
    copies = [a.copy() for a in (x, positions, dy)]
    _, cache = na.rope_forward(x, positions)
    na.rope_backward(dy, cache)
    na.rope_jvp(x, positions, dy)
    for a, b in zip((x, positions, dy), copies):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------------------------------------- inside attention

ENGINES = [{"implementation": "textbook"}, {"implementation": "blocked"}, {"implementation": "tiled", "block_size": 3}]
ENGINE_IDS = ["textbook", "blocked", "tiled"]


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
@pytest.mark.parametrize("rope", [{"layout": "half"}, {"layout": "interleaved", "rotary_dim": 4, "base": 500000.0}],
                         ids=["half", "interleaved-partial"])
def test_attention_turns_q_and_k_inside_and_returns_the_gradients_of_the_unturned(engine, rope):
    """attention_forward(..., rope=...) is attention on rope_forward's q and k at the bottom-right
    positions (query i at i + N_k - N_q, as the last N_q tokens); dq, dk are turned back."""
    q, k, v = RNG.standard_normal((2, 4, 5, 8)), RNG.standard_normal((2, 2, 9, 8)), RNG.standard_normal((2, 2, 9, 8))
    dout = RNG.standard_normal((2, 4, 5, 8))
    out, cache = na.attention_forward(q, k, v, causal="bottom_right", rope=rope, **engine)
    grads = na.attention_backward(dout, cache)
    q_turned, q_cache = na.rope_forward(q, np.arange(4, 9), **rope)
    k_turned, k_cache = na.rope_forward(k, np.arange(9), **rope)
    plain, plain_cache = na.attention_forward(q_turned, k_turned, v, causal="bottom_right", **engine)
    plain_grads = na.attention_backward(dout, plain_cache)
    np.testing.assert_allclose(out, plain, rtol=0, atol=1e-15)
    np.testing.assert_allclose(grads.dq, na.rope_backward(plain_grads.dq, q_cache), rtol=0, atol=1e-14)
    np.testing.assert_allclose(grads.dk, na.rope_backward(plain_grads.dk, k_cache), rtol=0, atol=1e-14)
    np.testing.assert_allclose(grads.dv, plain_grads.dv, rtol=0, atol=1e-14)


def test_attention_with_rope_against_torch_float64_autograd(torch):
    """An independent reference: torch turns q and k (torch_rope), SDPA attends (causal, grouped
    heads), autograd differentiates, all in float64."""
    q, k, v = RNG.standard_normal((1, 4, 6, 8)), RNG.standard_normal((1, 2, 6, 8)), RNG.standard_normal((1, 2, 6, 8))
    dout = RNG.standard_normal((1, 4, 6, 8))
    rope = {"layout": "interleaved", "scaling": {"type": "linear", "factor": 2.0}}
    out, cache = na.attention_forward(q, k, v, causal=True, rope=rope)
    grads = na.attention_backward(dout, cache)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    turned = lambda x: torch_rope(x, np.arange(6), **rope)
    t_out = torch.nn.functional.scaled_dot_product_attention(turned(tq), turned(tk), tv, is_causal=True,
                                                             enable_gqa=True)
    t_out.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=0, atol=1e-13)
    for ours, theirs in ((grads.dq, tq.grad), (grads.dk, tk.grad), (grads.dv, tv.grad)):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=0, atol=1e-13)


def test_rope_positions_restart_in_each_packed_sequence():
    lengths = [4, 6]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    q, k, v = (RNG.standard_normal((2, cu[-1], 8)) for _ in range(3))
    dout = RNG.standard_normal((2, cu[-1], 8))
    out, cache = na.attention_forward(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, rope={})
    grads = na.attention_backward(dout, cache)
    for start, stop in zip(cu[:-1], cu[1:]):
        part = slice(start, stop)
        alone, alone_cache = na.attention_forward(q[:, part], k[:, part], v[:, part], causal=True, rope={})
        alone_grads = na.attention_backward(dout[:, part], alone_cache)
        np.testing.assert_allclose(out[:, part], alone, rtol=0, atol=1e-14)
        np.testing.assert_allclose(grads.dq[:, part], alone_grads.dq, rtol=0, atol=1e-14)
        np.testing.assert_allclose(grads.dk[:, part], alone_grads.dk, rtol=0, atol=1e-14)


def test_complex_step_gradcheck_through_attention_with_rope():
    q, k, v = RNG.standard_normal((1, 2, 4, 6)), RNG.standard_normal((1, 2, 7, 6)), RNG.standard_normal((1, 2, 7, 6))
    forward = lambda q, k, v: na.attention_forward(q, k, v, causal="bottom_right", rope={"rotary_dim": 4})
    report = na.gradcheck(forward, na.attention_backward, [q, k, v], method="complex")
    assert report and max(row.max_rel_err for row in report.rows) <= 1e-13, report


@pytest.mark.parametrize("rope, error, words", [
    ({"layot": "half"}, TypeError, "rope has the key 'layot'; it takes layout, rotary_dim"),
    ([("layout", "half")], TypeError, "rope must be a dict"),
    ({"layout": "neox"}, ValueError, "layout"),
])
def test_a_bad_rope_is_refused_by_name(rope, error, words):
    x = RNG.standard_normal((1, 3, 4))
    with pytest.raises(error, match=words):
        na.attention_forward(x, x, x, rope=rope)


def _torch_attention_with_rope(torch, rope, positions_q, positions_k):
    """(q, k, v) -> out: torch_rope on q and k, then attention in torch ops (bottom-right causal,
    grouped heads), in float64: the independent reference for forward mode."""
    def attend(tq, tk, tv):
        n_q, n_k, groups = tq.shape[-2], tk.shape[-2], tq.shape[-3] // tk.shape[-3]
        tk, tv = (x.repeat_interleave(groups, dim=-3) for x in (torch_rope(tk, positions_k, **rope), tv))
        scores = torch_rope(tq, positions_q, **rope) @ tk.transpose(-1, -2) / math.sqrt(tq.shape[-1])
        keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
        return torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1) @ tv
    return attend


@pytest.mark.parametrize("engine", [{}, {"implementation": "tiled", "block_size": 3}], ids=["textbook", "tiled"])
def test_attention_jvp_with_rope_against_torch_func_jvp(engine, torch):
    """The tangents of q and k turn with them (rope is linear): out_dot against torch.func.jvp of
    an independent rope + SDPA, float64."""
    rope = {"layout": "interleaved", "rotary_dim": 6, "scaling": {"type": "linear", "factor": 2.0}}
    q, k, v = RNG.standard_normal((2, 4, 5, 8)), RNG.standard_normal((2, 2, 9, 8)), RNG.standard_normal((2, 2, 9, 8))
    q_dot, k_dot, v_dot = (RNG.standard_normal(x.shape) for x in (q, k, v))
    out, out_dot, _, _ = na.attention_jvp(q, k, v, q_dot, k_dot, v_dot, causal="bottom_right", rope=rope, **engine)
    attend = _torch_attention_with_rope(torch, rope, np.arange(4, 9), np.arange(9))
    t_out, t_dot = torch.func.jvp(attend, tuple(map(torch.from_numpy, (q, k, v))),
                                  tuple(map(torch.from_numpy, (q_dot, k_dot, v_dot))))
    np.testing.assert_allclose(out, t_out.numpy(), rtol=0, atol=1e-13)
    np.testing.assert_allclose(out_dot, t_dot.numpy(), rtol=0, atol=1e-12)


def test_attention_hvp_with_rope_against_torch_double_backward(torch):
    """Hessian-vector products with rope: the gradients' tangents turned back like the gradients,
    against torch's double backward (the Hessian is symmetric) of the same independent reference."""
    rope = {"layout": "half", "base": 500000.0, "positions_q": np.array([3, 7, 8]), "positions_k": np.arange(10)}
    causal = "bottom_right"
    q, k, v = RNG.standard_normal((1, 2, 3, 6)), RNG.standard_normal((1, 2, 10, 6)), RNG.standard_normal((1, 2, 10, 6))
    dout = RNG.standard_normal((1, 2, 3, 6))
    tangents = [RNG.standard_normal(x.shape) for x in (q, k, v)]
    grads, grads_dot = na.attention_hvp(q, k, v, dout, *tangents, causal=causal, rope=rope)
    settings = {name: x for name, x in rope.items() if not name.startswith("positions")}
    attend = _torch_attention_with_rope(torch, settings, rope["positions_q"], rope["positions_k"])
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]    # d/dt grad(x + t x_dot)
    t_grads = torch.autograd.grad(attend(*leaves), leaves, torch.from_numpy(dout), create_graph=True)
    t_dots = torch.autograd.grad(t_grads, leaves, [torch.from_numpy(t) for t in tangents])
    for ours, theirs in zip((grads.dq, grads.dk, grads.dv, grads_dot.dq, grads_dot.dk, grads_dot.dv),
                            tuple(t_grads) + tuple(t_dots)):
        np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=0, atol=1e-12)


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("options, error, words", [
    ({"base": 1, "scaling": YARN}, ValueError, "YaRN's ramp divides by ln\\(base\\): base must not be 1"),
    ({"scaling": {**YARN, "factor": 5e-324}}, ValueError, "give frequencies outside the float range: inv_freq\\["),
    ({"scaling": {"type": "linear", "factor": 5e-324}}, ValueError,
     "give frequencies outside the float range: positions times inf"),
    ({"scaling": {**YARN, "truncate": "no"}}, TypeError, "scaling\\['truncate'\\] must be True or False"),
    ({"scaling": {**YARN, "mscale": -1.0, "mscale_all_dim": 1.0}}, ValueError,
     "scaling\\['mscale'\\] must be a finite real"),
    ({"scaling": {**YARN, "attention_factor": 0.0}}, ValueError,
     "scaling\\['attention_factor'\\] must be a finite real number > 0"),
    ({"positions": np.array([0.0, 1.0, np.nan, 3.0, 4.0])}, ValueError,
     "{name} must be finite, got {name}\\[2\\] = nan"),
    ({"positions": np.array([0.0, np.inf, 2.0, -np.inf, 4.0])}, ValueError,
     "{name} must be finite, got {name}\\[1\\] = inf, {name}\\[3\\] = -inf"),
    ({"positions": np.array([0.0, 1.0, 2.0, 3.0, 1e308]), "base": 1e-300}, ValueError,
     "positions up to 1e\\+308 times the frequencies .* leave the float range"),
])
def test_rope_out_of_range_is_an_error_naming_it(options, error, words):
    """YaRN's base 1 (ln 1 = 0 once divided), a factor whose frequencies overflow, non-finite
    positions and angles beyond the float range: an error naming them, from rope_forward and from
    attention's rope= alike, never a ZeroDivisionError, OverflowError or NaN output."""
    x = RNG.standard_normal((2, 5, 8))
    positions = options.pop("positions", np.arange(5))
    with pytest.raises(error, match=words.format(name="positions")):
        na.rope_forward(x, positions, **options)
    rope = {"layout": "half", **options, "positions_q": positions, "positions_k": positions}
    with pytest.raises(error, match=words.format(name="rope\\['positions_q'\\]")):
        na.attention_forward(x, x, x, rope=rope)


def decimal_yarn(r, scaling, base=10000.0):
    """Hugging Face's YaRN inverse frequencies with the correction dims' logarithms taken in
    60-digit decimals (ln(L / (2 pi rotations)) as ln L - ln rotations - ln 2 pi: no ratio to
    overflow), the rest as _compute_yarn_parameters does it, in float64."""
    with decimal.localcontext(prec=60):
        ln = lambda x: decimal.Decimal(x).ln()
        two_pi = 2 * decimal.Decimal("3.14159265358979323846264338327950288419716939937510582097494")
        dim = lambda rot: float(r * (ln(scaling["original_max_position_embeddings"]) - ln(rot) - two_pi.ln())
                                / (2 * ln(base)))
        low, high = dim(scaling.get("beta_fast", 32.0)), dim(scaling.get("beta_slow", 1.0))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    ramp = np.clip((np.arange(r // 2) - low) / ((high - low) or 0.001), 0, 1)
    plain = 1 / base ** (np.arange(0, r, 2) / r)
    return plain / scaling["factor"] * ramp + plain * (1 - ramp)


@pytest.mark.parametrize("scaling", [{**YARN, "beta_fast": 5e-324}, {**YARN, "beta_slow": 5e-324},
                                     {**YARN, "original_max_position_embeddings": 1e308, "beta_slow": 1e-3},
                                     {**YARN, "original_max_position_embeddings": 1e308, "truncate": False}],
                         ids=["beta_fast 5e-324", "beta_slow 5e-324", "L 1e308", "L 1e308 not truncated"])
def test_yarn_at_the_ends_of_the_float_range_is_its_formula(scaling):
    """A rotation count of 5e-324 or an original length of 1e308 makes ln(L / (2 pi rotations))
    overflow in floats (HF's formula raises OverflowError there): the frequencies are the formula's,
    its logarithms taken in 60-digit decimals, and the turn is finite."""
    inv_freq, position_factor, magnitude = frequencies(8, scaling=scaling)
    np.testing.assert_allclose(inv_freq, decimal_yarn(8, scaling), rtol=1e-15, atol=0)
    assert position_factor == 1.0 and math.isclose(magnitude, 0.1 * math.log(4) + 1)
    y, _ = na.rope_forward(RNG.standard_normal((3, 8)), np.arange(3), scaling=scaling)
    assert np.isfinite(y).all()
