"""Multi-head Latent Attention: the absorbed form (one latent kv head, values its first r columns)
and the non-absorbed one (per-head up-projections), each against an independent torch float64
implementation written here from DeepSeek-V2's definition and FlashMLA's reference (torch's
autograd sums the latent's two uses), the two forms against each other, every engine, a paged
latent cache of 64-row pages, forward mode, complex step and bad input."""
import math

import numpy as np
import pytest

import numpy_attention as na

RNG = np.random.default_rng(21)
R, P, N_NOPE, D_V, H = 16, 8, 12, 10, 4          # latent, rotary, per-head key and value widths


def absorbed_inputs(batch=2, n_q=3, n_k=9, r=R, p=P, heads=H):
    q = RNG.standard_normal((batch, heads, n_q, r + p))
    kv = RNG.standard_normal((batch, 1, n_k, r + p))
    return q, kv, RNG.standard_normal((batch, heads, n_q, r))


def torch_turn_last(torch, x, positions, p, layout):
    """test_rope.py's independent torch rope on the last p columns."""
    from test_rope import torch_rope
    return torch.cat([x[..., :-p], torch_rope(x[..., -p:], positions, layout=layout)], -1)


def torch_absorbed(torch, q, kv, r, scale, causal, rope=None):
    """FlashMLA's reference written in torch: scores q kv^T * scale, softmax, values kv[..., :r]."""
    if rope is not None:
        n_q, n_k = q.shape[-2], kv.shape[-2]
        q = torch_turn_last(torch, q, np.arange(n_k - n_q, n_k), rope[0], rope[1])
        kv = torch_turn_last(torch, kv, np.arange(n_k), rope[0], rope[1])
    s = q @ kv.transpose(-1, -2) * scale
    if causal:
        n_q, n_k = s.shape[-2:]
        keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, -1) @ kv[..., :r], torch.logsumexp(s, -1)


@pytest.mark.parametrize("rope", [None, (P, "interleaved"), (P, "half")], ids=["no-rope", "interleaved", "half"])
def test_absorbed_against_torch_float64_autograd(rope, torch):
    q, kv, dout = absorbed_inputs()
    dlse = RNG.standard_normal((2, H, 3))
    scale = 1 / math.sqrt(N_NOPE + P)                  # DeepSeek's: 1 / sqrt(n + p)
    options = {} if rope is None else {"rope": {"layout": rope[1]}}
    out, cache = na.mla_forward(q, kv, rope_dim=P, scale=scale, causal="bottom_right", **options)
    grads = na.mla_backward(dout, cache, dlse)
    tq, tkv = (torch.from_numpy(x).requires_grad_() for x in (q, kv))
    t_out, t_lse = torch_absorbed(torch, tq, tkv, R, scale, True, rope)
    torch.autograd.backward([t_out, t_lse], [torch.from_numpy(dout), torch.from_numpy(dlse)])
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=0, atol=1e-13)
    np.testing.assert_allclose(cache.attention.lse, t_lse.detach().numpy(), rtol=0, atol=1e-13)
    np.testing.assert_allclose(grads.dq, tq.grad.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(grads.dkv, tkv.grad.numpy(), rtol=0, atol=1e-12)


def unabsorbed_inputs(batch=2, n_q=3, n_k=9):
    return dict(q_nope=RNG.standard_normal((batch, H, n_q, N_NOPE)), q_pe=RNG.standard_normal((batch, H, n_q, P)),
                c_kv=RNG.standard_normal((batch, n_k, R)), k_pe=RNG.standard_normal((batch, n_k, P)),
                w_uk=RNG.standard_normal((H, R, N_NOPE)) / 4, w_uv=RNG.standard_normal((H, R, D_V)) / 4)


def test_unabsorbed_against_torch_float64_autograd(torch):
    """DeepSeek-V2's attention written in torch: k_h = [c_kv W_UK^h ; k_pe], v_h = c_kv W_UV^h."""
    x = unabsorbed_inputs()
    dout = RNG.standard_normal((2, H, 3, D_V))
    rope = {"layout": "interleaved", "base": 10000.0}
    out, cache = na.mla_unabsorbed_forward(**x, causal="bottom_right", rope=rope)
    grads = na.mla_unabsorbed_backward(dout, cache)
    t = {name: torch.from_numpy(a).requires_grad_() for name, a in x.items()}
    k_nope = torch.einsum("bkr,hrn->bhkn", t["c_kv"], t["w_uk"])
    v = torch.einsum("bkr,hrv->bhkv", t["c_kv"], t["w_uv"])
    k_pe = torch_turn_last(torch, t["k_pe"], np.arange(9), P, "interleaved")[:, None].expand(-1, H, -1, -1)
    q_pe = torch_turn_last(torch, t["q_pe"], np.arange(6, 9), P, "interleaved")
    q, k = torch.cat([t["q_nope"], q_pe], -1), torch.cat([k_nope, k_pe], -1)
    keep = torch.arange(9)[None, :] <= torch.arange(3)[:, None] + 6
    s = (q @ k.transpose(-1, -2) / math.sqrt(N_NOPE + P)).masked_fill(~keep, -math.inf)
    t_out = torch.softmax(s, -1) @ v
    t_out.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=0, atol=1e-13)
    for name in x:
        np.testing.assert_allclose(getattr(grads, f"d{name}"), t[name].grad.numpy(), rtol=0, atol=1e-12,
                                   err_msg=name)


def test_the_two_forms_give_the_same_out_and_gradients():
    """q = [q_nope w_uk^T ; q_pe], kv = [c_kv ; k_pe]: the absorbed out times w_uv[h] is out_h, and
    every gradient, chained through the absorption, is the non-absorbed one."""
    x = unabsorbed_inputs()
    dout = RNG.standard_normal((2, H, 3, D_V))
    options = dict(scale=1 / math.sqrt(N_NOPE + P), causal="bottom_right", rope={"layout": "half"})
    out, cache = na.mla_unabsorbed_forward(**x, **options)
    grads = na.mla_unabsorbed_backward(dout, cache)
    q = np.concatenate([na.mla_absorb(x["q_nope"], x["w_uk"]), x["q_pe"]], -1)
    kv = np.concatenate([x["c_kv"], x["k_pe"]], -1)[:, None]
    latent, latent_cache = na.mla_forward(q, kv, rope_dim=P, **options)
    np.testing.assert_allclose(np.einsum("bhqr,hrv->bhqv", latent, x["w_uv"]), out, rtol=0, atol=1e-13)
    dlatent = np.einsum("bhqv,hrv->bhqr", dout, x["w_uv"])             # d out_latent = dout w_uv^T
    g = na.mla_backward(dlatent, latent_cache)
    chained = {"dq_nope": np.einsum("bhqr,hrn->bhqn", g.dq[..., :R], x["w_uk"]), "dq_pe": g.dq[..., R:],
               "dc_kv": g.dkv[:, 0, :, :R], "dk_pe": g.dkv[:, 0, :, R:],
               "dw_uk": np.einsum("bhqr,bhqn->hrn", g.dq[..., :R], x["q_nope"]),
               "dw_uv": np.einsum("bhqr,bhqv->hrv", latent, dout)}
    for name, value in chained.items():
        np.testing.assert_allclose(getattr(grads, name), value, rtol=0, atol=1e-12, err_msg=name)


def test_the_options_gradients_come_back_as_attentions():
    """mla_backward returns every option's gradient attention_backward gives on k = kv,
    v = kv[..., :r] (a gate's too)."""
    q, kv, dout = absorbed_inputs()
    options = dict(bias=RNG.standard_normal((H, 3, 9)), sinks=RNG.standard_normal(H),
                   alibi_slopes=RNG.random(H), gate=RNG.standard_normal((2, H, 3, 1)))
    g = na.mla_backward(dout, na.mla_forward(q, kv, rope_dim=P, **options)[1])
    want = na.attention_backward(dout, na.attention_forward(q, kv, kv[..., :R], **options)[1])
    for name in ("dbias", "dsinks", "dalibi_slopes", "dgate"):
        np.testing.assert_array_equal(getattr(g, name), getattr(want, name), err_msg=name)


@pytest.mark.parametrize("engine", [{"implementation": "blocked", "workers": 2},
                                    {"implementation": "tiled", "block_size": 4, "workers": 2}],
                         ids=["blocked", "tiled"])
def test_every_engine_equals_the_textbook(engine):
    q, kv, dout = absorbed_inputs(n_q=5, n_k=11)
    options = dict(causal="bottom_right", rope={"layout": "interleaved"})
    out, cache = na.mla_forward(q, kv, rope_dim=P, implementation="textbook", **options)
    ours, ours_cache = na.mla_forward(q, kv, rope_dim=P, **engine, **options)
    np.testing.assert_allclose(ours, out, rtol=0, atol=1e-13)
    for a, b in zip(na.mla_backward(dout, ours_cache)[:2], na.mla_backward(dout, cache)[:2]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)


def test_a_paged_latent_cache_of_64_row_pages():
    """FlashMLA's decoding: kv pages [num_pages, 1, 64, r + p], a page table, each sequence's
    length; the same as each sequence's dense attention, and dkv lands in the pages."""
    lengths = [70, 130]
    pages = np.array([[3, 0, -1], [1, 4, 2]])
    cache_kv = RNG.standard_normal((5, 1, 64, R + P))
    q, dout = RNG.standard_normal((2, H, 1, R + P)), RNG.standard_normal((2, H, 1, R))
    out, cache = na.mla_forward(q, cache_kv, rope_dim=P, page_table=pages, cache_seqlens=np.array(lengths))
    grads = na.mla_backward(dout, cache)
    expected_dkv = np.zeros_like(cache_kv)
    for b, n in enumerate(lengths):
        rows = np.concatenate([cache_kv[page] for page in pages[b] if page >= 0], axis=-2)[:, :n]
        alone, alone_cache = na.mla_forward(q[b], rows, rope_dim=P)
        np.testing.assert_allclose(out[b], alone, rtol=0, atol=1e-14)
        g = na.mla_backward(dout[b], alone_cache)
        np.testing.assert_allclose(grads.dq[b], g.dq, rtol=0, atol=1e-14)
        for i, page in enumerate(p for p in pages[b] if p >= 0):
            part = g.dkv[:, i * 64:(i + 1) * 64]
            expected_dkv[page][:, :part.shape[-2]] += part
    np.testing.assert_allclose(grads.dkv, expected_dkv, rtol=0, atol=1e-14)


def test_mla_jvp_against_torch_func_jvp(torch):
    q, kv, _ = absorbed_inputs()
    q_dot, kv_dot = RNG.standard_normal(q.shape), RNG.standard_normal(kv.shape)
    _, out_dot, _, lse_dot = na.mla_jvp(q, kv, q_dot, kv_dot, rope_dim=P, causal="bottom_right",
                                        rope={"layout": "half"})
    f = lambda tq, tkv: torch_absorbed(torch, tq, tkv, R, 1 / math.sqrt(R + P), True, (P, "half"))
    _, (t_out_dot, t_lse_dot) = torch.func.jvp(f, (torch.from_numpy(q), torch.from_numpy(kv)),
                                               (torch.from_numpy(q_dot), torch.from_numpy(kv_dot)))
    np.testing.assert_allclose(out_dot, t_out_dot.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse_dot, t_lse_dot.numpy(), rtol=0, atol=1e-12)


def test_complex_step_gradcheck_of_both_forms():
    q, kv, _ = absorbed_inputs(batch=1, n_q=2, n_k=5, r=6, p=4, heads=2)
    report = na.gradcheck(lambda q, kv: na.mla_forward(q, kv, rope_dim=4, causal="bottom_right", rope={}),
                          lambda dout, cache: na.mla_backward(dout, cache)[:2], [q, kv], method="complex")
    assert report and max(row.max_rel_err for row in report.rows) <= 1e-13, report
    x = {name: a[:1, :2] if name.startswith("q") else a[:1] if name in ("c_kv", "k_pe") else a[:2]
         for name, a in unabsorbed_inputs(n_q=2, n_k=4).items()}
    report = na.gradcheck(lambda *xs: na.mla_unabsorbed_forward(*xs, causal="bottom_right", rope={}),
                          na.mla_unabsorbed_backward, list(x.values()), method="complex")
    assert report and max(row.max_rel_err for row in report.rows) <= 1e-13, report


def test_deepseek_v3_widths():
    """r = 512, p = 64 (576 columns, values the first 512), 16 heads, decoding one token."""
    q, kv, dout = absorbed_inputs(batch=1, n_q=1, n_k=40, r=512, p=64, heads=16)
    out, cache = na.mla_forward(q, kv, scale=1 / math.sqrt(192))
    plain, plain_cache = na.attention_forward(q, kv, kv[..., :512], scale=1 / math.sqrt(192))
    g, plain_g = na.mla_backward(dout, cache), na.attention_backward(dout, plain_cache)
    assert out.shape == (1, 16, 1, 512) and g.dkv.shape == kv.shape
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(g.dkv[..., 512:], plain_g.dk[..., 512:])
    np.testing.assert_array_equal(g.dkv[..., :512], plain_g.dk[..., :512] + plain_g.dv)


@pytest.mark.parametrize("change, error, words", [
    ({"kv": np.zeros((2, 2, 9, R + P))}, ValueError, "kv must be one latent head"),
    ({"kv": np.zeros((2, 1, 9, R + P + 2))}, ValueError, "q and kv must have the same width"),
    ({"rope_dim": R + P}, ValueError, "rope_dim must be an integer from 0 to below the width 24"),
    ({"rope": {"rotary_dim": 4}}, ValueError, r"rope\['rotary_dim'\] must be 8 or absent"),
    ({"rope": {"part": "first"}}, ValueError, r"rope\['part'\] must be 'last' or absent"),
])
def test_bad_input_is_refused_by_name(change, error, words):
    q, kv, _ = absorbed_inputs()
    arguments = {"q": q, "kv": kv, "rope_dim": P, **change}
    with pytest.raises(error, match=words):
        na.mla_forward(**arguments)


V3_YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
           "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}      # DeepSeek-V3's config.json rope_scaling


def torch_deepseek_v3(torch, x, positions_q, positions_k):
    """DeepSeek-V3's attention as its reference model computes it, in torch float64, written from
    its definitions: precompute_freqs_cis (YaRN frequencies, cos and sin NOT times an attention
    factor), apply_rotary_emb (interleaved pairs as complex numbers), softmax_scale =
    qk_head_dim^-0.5 mscale^2, mscale = 0.1 mscale_all_dim ln(factor) + 1. x: unabsorbed_inputs'
    tensors (autograd flows through)."""
    factor, original, base = V3_YARN["factor"], V3_YARN["original_max_position_embeddings"], 10000.0
    freqs = 1.0 / base ** (torch.arange(0, P, 2, dtype=torch.float64) / P)
    dim = lambda rotations: P * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(dim(V3_YARN["beta_fast"])), 0), min(math.ceil(dim(V3_YARN["beta_slow"])), P - 1)
    smooth = 1 - torch.clamp((torch.arange(P // 2, dtype=torch.float64) - low) / ((high - low) or 0.001), 0, 1)
    freqs = freqs / factor * (1 - smooth) + freqs * smooth

    def rotary(t, positions):                                          # [..., N, P], pairs (2i, 2i + 1)
        cis = torch.polar(torch.ones(len(positions), P // 2, dtype=torch.float64),
                          torch.outer(torch.as_tensor(positions, dtype=torch.float64), freqs))
        turned = torch.view_as_complex(t.reshape(*t.shape[:-1], P // 2, 2).contiguous()) * cis
        return torch.view_as_real(turned).flatten(-2)

    mscale = 0.1 * V3_YARN["mscale_all_dim"] * math.log(factor) + 1.0
    softmax_scale = (N_NOPE + P) ** -0.5 * mscale * mscale
    k_nope = torch.einsum("bkr,hrn->bhkn", x["c_kv"], x["w_uk"])
    v = torch.einsum("bkr,hrv->bhkv", x["c_kv"], x["w_uv"])
    scores = (torch.einsum("bhqn,bhkn->bhqk", x["q_nope"], k_nope)
              + torch.einsum("bhqp,bkp->bhqk", rotary(x["q_pe"], positions_q), rotary(x["k_pe"], positions_k)))
    return torch.softmax(scores * softmax_scale, -1) @ v


def test_deepseek_v3s_scale_with_yarn(torch):
    """DeepSeek-V3 with YaRN: rope={"scaling": its rope_scaling (mscale = mscale_all_dim = 1: cos
    and sin times 1, as Hugging Face's deepseek_v3 has it)} and scale = (n + p)^-0.5 yarn_mscale(40,
    mscale_all_dim)^2 are its reference model's attention, both forms, out and gradients. The
    scale's mscale^2 with a YaRN scaling lacking mscale and mscale_all_dim applies the attention
    factor a second time, on the rotary columns' scores: out 10% or more off."""
    from numpy_attention.rope import yarn_mscale
    x = unabsorbed_inputs(n_q=3, n_k=9)
    dout = RNG.standard_normal((2, H, 3, D_V))
    positions_q, positions_k = np.array([9000, 20000, 30000]), np.array([0, 70, 900, 4000, 5000, 9000, 12000, 20000,
                                                                         30000])
    scale = (N_NOPE + P) ** -0.5 * yarn_mscale(V3_YARN["factor"], V3_YARN["mscale_all_dim"]) ** 2
    rope = {"layout": "interleaved", "scaling": V3_YARN, "positions_q": positions_q, "positions_k": positions_k}
    out, cache = na.mla_unabsorbed_forward(**x, scale=scale, rope=rope)
    grads = na.mla_unabsorbed_backward(dout, cache)
    t = {name: torch.from_numpy(a).requires_grad_() for name, a in x.items()}
    t_out = torch_deepseek_v3(torch, t, positions_q, positions_k)
    t_out.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=0, atol=1e-13)
    for name in x:
        np.testing.assert_allclose(getattr(grads, f"d{name}"), t[name].grad.numpy(), rtol=0, atol=1e-12, err_msg=name)
    q = np.concatenate([na.mla_absorb(x["q_nope"], x["w_uk"]), x["q_pe"]], -1)
    kv = np.concatenate([x["c_kv"], x["k_pe"]], -1)[:, None]
    latent, _ = na.mla_forward(q, kv, rope_dim=P, scale=scale, rope=rope)
    np.testing.assert_allclose(np.einsum("bhqr,hrv->bhqv", latent, x["w_uv"]), out, rtol=0, atol=1e-13)
    without = {**V3_YARN}
    del without["mscale"], without["mscale_all_dim"]                   # cos, sin times 0.1 ln 40 + 1 too
    twice, _ = na.mla_unabsorbed_forward(**x, scale=scale, rope={**rope, "scaling": without})
    assert np.abs(twice - out).max() > 0.1 * np.abs(out).max()
