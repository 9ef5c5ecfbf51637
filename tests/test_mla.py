"""Multi-head Latent Attention: the absorbed form (one latent kv head, values its first r columns)
and the non-absorbed one (per-head up-projections), each against an independent torch float64
implementation written here from DeepSeek-V2's definition and FlashMLA's reference (torch's
autograd sums the latent's two uses), the two forms against each other, every engine, a paged
latent cache of 64-row pages, forward mode, complex step and bad input."""
import math

import numpy as np
import pytest
from optional import TORCH_REASON

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
def test_absorbed_against_torch_float64_autograd(rope):
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
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


def test_unabsorbed_against_torch_float64_autograd():
    """DeepSeek-V2's attention written in torch: k_h = [c_kv W_UK^h ; k_pe], v_h = c_kv W_UV^h."""
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
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


def test_mla_jvp_against_torch_func_jvp():
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
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
