"""crosscheck on the variants: packed sequences, attention sinks and ALiBi as case keys, with
dsinks and dalibi_slopes as candidate results. Honest torch float32 candidates pass; planted
bugs fail (a token attending across a sequence boundary, a sink's gradient missing, ALiBi's
distance off by one, a split-KV merge mixing lse bases)."""
import numpy as np
import pytest
from optional import TORCH_REASON

import numpy_attention as na
from numpy_attention.oracle import CaseError

torch = pytest.importorskip("torch", reason=TORCH_REASON)


def torch_candidate(case, alibi_shift=0, drop_sink_grad=False, packed_as_one=False):
    """float32 results of an attention written in torch ops: sequences one by one (or, with
    packed_as_one, the packed arrays as one sequence), a sink column, ALiBi's bias."""
    t = {n: torch.tensor(case[n], dtype=torch.float32, requires_grad=n != "dout")
         for n in ("q", "k", "v", "dout", "sinks", "alibi_slopes")}
    cu_q, cu_k = case["cu_seqlens_q"], case["cu_seqlens_k"]
    spans = [(0, cu_q[-1], 0, cu_k[-1])] if packed_as_one else \
        [(cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]) for b in range(len(cu_q) - 1)]
    outs, lses = [], []
    for q0, q1, k0, k1 in spans:
        q, k, v = t["q"][:, q0:q1], t["k"][:, k0:k1], t["v"][:, k0:k1]
        k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], dim=0) for x in (k, v))
        n_q, n_k = q1 - q0, k1 - k0
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        s = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])
        s = s - t["alibi_slopes"][:, None, None] * ((i + n_k - n_q - j).abs() + alibi_shift)
        s = s.masked_fill(j > i + n_k - n_q, float("-inf"))              # causal, bottom-right
        sinks = t["sinks"].detach() if drop_sink_grad else t["sinks"]
        s = torch.cat([s, sinks[:, None, None].expand(s.shape[0], n_q, 1)], dim=-1)
        outs.append(torch.softmax(s, -1)[..., :-1] @ v)
        lses.append(torch.logsumexp(s, -1))
    out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=1)
    out.backward(t["dout"])
    grads = {f"d{n}": t[n].grad.numpy() if t[n].grad is not None else np.zeros(case[n].shape, np.float32)
             for n in ("q", "k", "v", "sinks", "alibi_slopes")}
    return {**case, "causal": np.array("bottom_right"), "out": out.detach().numpy(),
            "lse": lse.detach().numpy(), **grads}


def random_case(rng):
    batch = int(rng.integers(1, 4))
    len_q = rng.integers(1, 12, batch)
    len_k = len_q + rng.integers(0, 12, batch)                         # no fully masked row
    h_kv, group, d = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([4, 8, 16]))
    cu = lambda lengths: np.concatenate([[0], np.cumsum(lengths)])
    return {"q": rng.standard_normal((h_kv * group, int(len_q.sum()), d)),
            "k": rng.standard_normal((h_kv, int(len_k.sum()), d)),
            "v": rng.standard_normal((h_kv, int(len_k.sum()), d)),
            "dout": rng.standard_normal((h_kv * group, int(len_q.sum()), d)),
            "sinks": rng.standard_normal(h_kv * group), "alibi_slopes": rng.uniform(0.05, 1.0, h_kv * group),
            "cu_seqlens_q": cu(len_q), "cu_seqlens_k": cu(len_k)}


@pytest.mark.slow
def test_honest_torch_candidates_pass():
    rng = np.random.default_rng(0)
    failed = []
    for _ in range(300):
        report = na.crosscheck(**torch_candidate(random_case(rng)))
        if not report:
            failed.append(str(report))
    assert not failed, failed[:1]


@pytest.mark.slow
@pytest.mark.parametrize("bug, fails", [
    ({"packed_as_one": True}, "out"),                                 # attends across sequences
    ({"drop_sink_grad": True}, "dsinks"),
    ({"alibi_shift": 1}, "out"),                                      # distance off by one
])
def test_planted_bugs_fail(bug, fails):
    rng = np.random.default_rng(1)
    for _ in range(20):
        case = random_case(rng)
        if "packed_as_one" in bug and len(case["cu_seqlens_q"]) < 3:
            continue
        report = na.crosscheck(**torch_candidate(case, **bug))
        assert not {row.name: row.passed for row in report.rows}[fails], str(report)


@pytest.mark.parametrize("base", ["e", 2])
def test_a_split_kv_merge_mixing_lse_bases_fails(base):
    """Partials merged with the wrong base: the merged out and lse are wrong, and crosscheck says so."""
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((1, 2, 4, 8)), rng.standard_normal((1, 2, 9, 8)), rng.standard_normal((1, 2, 9, 8))
    parts = [na.attention_forward(q, k[..., a:b, :], v[..., a:b, :]) for a, b in ((0, 4), (4, 9))]
    outs, lses = np.stack([p[0] for p in parts]), np.stack([p[1].lse for p in parts])   # natural logs
    stored = lses if base == "e" else lses / np.log(2)                 # the partials' lse, in `base`
    other = 2 if base == "e" else "e"
    to_e = {"e": 1.0, 2: np.log(2)}
    right, wrong = na.combine_forward(outs, stored, base=base), na.combine_forward(outs, stored, base=other)
    assert na.crosscheck(q=q, k=k, v=v, out=right[0], lse=right[1] * to_e[base])
    assert not na.crosscheck(q=q, k=k, v=v, out=wrong[0], lse=wrong[1] * to_e[other])


def test_a_paged_kv_cache_case():
    """page_table, cache_seqlens as case keys; dk, dv judged as the pages' gradients; the
    diagnosis's reruns laid out as the pages."""
    rng = np.random.default_rng(3)
    q, dout = rng.standard_normal((2, 2, 2, 8)), rng.standard_normal((2, 2, 2, 8))
    k_cache, v_cache = rng.standard_normal((5, 1, 4, 8)), rng.standard_normal((5, 1, 4, 8))
    paging = {"page_table": np.array([[3, 0], [1, 4]]), "cache_seqlens": np.array([6, 3])}
    f32 = lambda x: x.astype(np.float32)
    out, cache = na.attention_forward(f32(q), f32(k_cache), f32(v_cache), causal="bottom_right", **paging)
    grads = na.attention_backward(f32(dout), cache)
    case = dict(q=q, k=k_cache, v=v_cache, dout=dout, causal=np.array("bottom_right"), out=out,
                dq=grads.dq, dk=grads.dk, dv=grads.dv, **paging)
    assert na.crosscheck(**case)
    wrong_page = grads.dk.copy()
    wrong_page[[2, 3]] = wrong_page[[3, 2]]                          # page 3's gradient put in page 2
    report = na.crosscheck(**{**case, "dk": wrong_page})
    assert not report and not report.diagnosis                      # no mix-up of the options
    for mixup, words in (({"causal": True}, "match causal='top_left'"),
                         ({"causal": "bottom_right", "scale": 1.0}, "match scale 1")):
        out, cache = na.attention_forward(f32(q), f32(k_cache), f32(v_cache), **mixup, **paging)
        grads = na.attention_backward(f32(dout), cache)             # the mix-ups rerun on the pages
        report = na.crosscheck(**{**case, "out": out, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv})
        assert not report and words in report.diagnosis[0], report
    with pytest.raises(CaseError, match="a paged KV cache .* takes no mask, bias, cu_seqlens"):   # (not replaced
        na.crosscheck(**case, cu_seqlens_k=np.array([0, 1, 2]))                              # by the pages')


def test_float64_per_head_vectors_do_not_widen_a_float32_baseline():
    """sinks given as float64 values (of float32 numbers): the baseline stays float32."""
    rng = np.random.default_rng(4)
    fails = 0
    for _ in range(10):
        case = random_case(rng)
        case["sinks"] = case["sinks"].astype(np.float32).astype(np.float64)
        case["alibi_slopes"] = case["alibi_slopes"].astype(np.float32).astype(np.float64)
        fails += not na.crosscheck(**torch_candidate(case))
    assert fails == 0


def test_own_forward_is_refused_where_p_cannot_be_rebuilt_from_lse():
    q = np.random.default_rng(5).standard_normal((1, 2, 3, 4)).astype(np.float32)
    mask = np.ones((3, 3), bool)
    mask[1] = False
    out, cache = na.attention_forward(q, q, q, mask=mask, fully_masked="uniform")
    grads = na.attention_backward(out, cache)
    with pytest.raises(CaseError, match="takes fully_masked='zero'"):
        na.crosscheck(q=q, k=q, v=q, dout=out, mask=mask, fully_masked=np.array("uniform"), out=out,
                      lse=cache.lse, dq=grads.dq, own_forward=True)

