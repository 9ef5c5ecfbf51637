"""crosscheck with rotary embeddings: the case's rope_* keys, the oracle and the baselines turning q
and k in their precisions (oracle/rotary.py), torch candidates honest and with planted bugs
(tests/rope_kernels.py; the longer sweep: benchmarks/variant_sweeps.py --variant rope), the diagnosis's rope
mix-ups, and bad keys refused by name."""
import math

import ml_dtypes
import numpy as np
import pytest
from optional import TORCH_REASON

import numpy_attention as na
from numpy_attention.oracle.case import load_case, save_case
from numpy_attention.oracle.schema import CaseError
from numpy_attention.oracle.rotary import turn_qk
from numpy_attention.options import attention_options

torch = pytest.importorskip("torch", reason=TORCH_REASON)
import rope_kernels  # noqa: E402  (needs torch)

CASES = 25          # per dtype, each honest and with each bug


@pytest.fixture(scope="module")
def counts():
    return rope_kernels.sweep(CASES, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", rope_kernels.DTYPES)
def test_honest_torch_candidates_pass(counts, dtype):
    judged, failed, _, _ = counts[(dtype, "honest")]
    assert judged == CASES and failed == 0, counts


@pytest.mark.slow
@pytest.mark.parametrize("bug", rope_kernels.BUGS)
@pytest.mark.parametrize("dtype", rope_kernels.DTYPES)
def test_each_planted_bug_is_caught_and_named(counts, dtype, bug):
    judged, failed, named, _ = counts[(dtype, bug)]
    assert judged >= 5 and failed == judged and named == judged, counts


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_the_baselines_turn_as_hugging_face_does(dtype, layout):
    """The baseline's turn is the peers': bfloat16 bit for bit with Hugging Face's in torch
    (cos, sin and every step rounded to it), float32 within 4 ulps of its largest entry (torch's
    and NumPy's float32 cos differ in the last bit), with the angles' own float32 error, far past
    float64's, at position 7000."""
    t = rope_kernels.DTYPES["float32" if dtype == np.float32 else "bfloat16"]
    scaling = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256}
    q, k = torch.randn(1, 2, 50, 64).to(t), torch.randn(1, 2, 300, 64).to(t)
    positions_k = np.arange(300) + 7000
    rope = dict(layout=layout, rotary_dim=32, base=500000.0, positions_q=positions_k[250:],
                positions_k=positions_k, scaling=scaling)
    q32, k32 = q.float().numpy(), k.float().numpy()
    turned, _, _ = turn_qk(q32, k32, rope, attention_options(q32, k32, k32)[3], dtype)
    theirs = rope_kernels.turn(q, positions_k[250:], layout, 32, 500000.0, scaling, "hf").float().numpy()
    exact = na.rope_forward(q32.astype(np.float64), positions_k[250:], **{n: x for n, x in rope.items()
                                                                          if not n.startswith("positions")})[0]
    if dtype == np.float32:
        np.testing.assert_allclose(turned, theirs, rtol=0, atol=4 * 2.0 ** -23 * np.abs(theirs).max())
        assert np.abs(turned - exact).max() > 100 * np.finfo(np.float32).eps * np.abs(exact).max()
    else:
        np.testing.assert_array_equal(turned, theirs)


def test_a_float64_case_with_rope_agrees_with_an_independent_torch_reference():
    """A float64 candidate from torch (test_rope.py's float64 rope, SDPA, autograd) passes within a
    few ulps of the np.longdouble oracle, and so does ours; the same candidate with float32
    angles (Hugging Face's, rope_kernels.turn) is a float64 kernel's bug, and fails."""
    from test_rope import torch_rope
    rng = np.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal(shape) for shape in [(1, 4, 5, 16), (1, 2, 9, 16), (1, 2, 9, 16),
                                                              (1, 4, 5, 16)])
    scaling = {"type": "linear", "factor": 2.0}
    keys = dict(causal="bottom_right", rope_layout="interleaved", rope_rotary_dim=8, rope_scaling="linear",
                rope_factor=2.0, rope_positions_q=np.arange(4, 9) + 3000, rope_positions_k=np.arange(9) + 3000)
    mask = torch.arange(9)[None, :] <= torch.arange(5)[:, None] + 4
    def torch_candidate(turn):
        leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(
            turn(leaves[0], keys["rope_positions_q"]), turn(leaves[1], keys["rope_positions_k"]), leaves[2],
            attn_mask=mask, enable_gqa=True)
        out.backward(torch.from_numpy(dout))
        return dict(out=out.detach().numpy(), dq=leaves[0].grad.numpy(), dk=leaves[1].grad.numpy(),
                    dv=leaves[2].grad.numpy())
    exact = torch_candidate(lambda x, at: torch_rope(x, at, layout="interleaved", rotary_dim=8, scaling=scaling))
    report = na.crosscheck(q=q, k=k, v=v, dout=dout, **exact, **keys)
    assert report and max(row.max_abs_err for row in report.rows) < 1e-12, report
    rope = {"layout": "interleaved", "rotary_dim": 8, "scaling": scaling, "positions_q": keys["rope_positions_q"],
            "positions_k": keys["rope_positions_k"]}
    ours, cache = na.attention_forward(q, k, v, causal="bottom_right", rope=rope)
    grads = na.attention_backward(dout, cache)
    report = na.crosscheck(q=q, k=k, v=v, dout=dout, out=ours, dq=grads.dq, dk=grads.dk, dv=grads.dv, **keys)
    assert report and max(row.max_abs_err for row in report.rows) < 1e-12, report
    angles32 = torch_candidate(lambda x, at: rope_kernels.turn(x, at, "interleaved", 8, 10000.0, scaling, "flash"))
    assert not na.crosscheck(q=q, k=k, v=v, dout=dout, **angles32, **keys)


def _float32_case(rope_keys, candidate_rope, causal="bottom_right"):
    """A float32 candidate of our own attention with `candidate_rope`, judged under `rope_keys`."""
    rng = np.random.default_rng(4)
    q, dout = (rng.standard_normal((1, 2, 6, 16)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 12, 16)).astype(np.float32) for _ in range(2))
    out, cache = na.attention_forward(q, k, v, causal=causal, rope=candidate_rope)
    g = na.attention_backward(dout, cache)
    return dict(q=q, k=k, v=v, dout=dout, out=out, dq=g.dq, dk=g.dk, dv=g.dv, causal=causal, **rope_keys)


@pytest.mark.parametrize("candidate_rope, words", [
    ({"layout": "interleaved", "rotary_dim": 8}, "match rope_layout='interleaved', interleaved pairs (GPT-J)"),
    (None, "match no rotary embedding"),
    ({"layout": "half"}, "match rope_rotary_dim=16 (the whole head)"),
    ({"layout": "half", "rotary_dim": 8, "positions_q": np.arange(6)}, "match the queries' rope positions from 0"),
])
def test_the_diagnosis_names_the_rope_mixup(candidate_rope, words):
    report = na.crosscheck(**_float32_case({"rope_layout": "half", "rope_rotary_dim": 8}, candidate_rope))
    assert not report and any(words in line for line in report.diagnosis), report


def test_a_case_file_with_rope_round_trips(tmp_path):
    arrays = _float32_case({"rope_layout": "half", "rope_base": 500000.0, "rope_scaling": "yarn",
                            "rope_factor": 4.0, "rope_original_max_position_embeddings": 8},
                           {"layout": "half", "base": 500000.0,
                            "scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}})
    save_case(tmp_path / "rope.npz", **arrays)
    assert na.crosscheck(**load_case(tmp_path / "rope.npz"))
    wrong = {**arrays, "rope_factor": 2.0}                 # the candidate's factor is 4
    assert not na.crosscheck(**wrong)


@pytest.mark.parametrize("keys, words", [
    ({"rope_base": 500000.0}, "rope_base is given but rope_layout is not"),
    ({"rope_layout": "neox"}, "rope_layout must be one of"),
    ({"rope_layout": "half", "rope_factor": 2.0}, "rope_factor is given but rope_scaling is not"),
    ({"rope_layout": "half", "rope_scaling": "yarn", "rope_factor": 2.0},
     "the case's rope_\\* keys: original_max_position_embeddings|scaling\\['original_max_position_embeddings'\\]"),
    ({"rope_layout": "half", "rope_rotary_dim": 5}, "the case's rope_\\* keys: rotary_dim must be an even integer"),
    ({"rope_layout": "half", "rope_positions_q": np.arange(5)}, "the case's rope_\\* keys: positions of shape \\(5,\\)"),
    ({"rope_layout": "half", "rope_positions_k": np.zeros((2, 12))}, "rope_positions_k must be a 1-d array"),
    ({"interleaved": True}, "rope_layout='interleaved'"),
    ({"rope_theta": 10000.0}, "rope_base="),
])
def test_bad_rope_keys_are_refused_by_name(keys, words):
    arrays = {**_float32_case({}, None), **keys}
    with pytest.raises(CaseError, match=words):
        na.crosscheck(**arrays)


def tangent_case(rng, bug=None):
    """A float32 case of forward mode with rope: torch.func.jvp through Hugging Face's turn (float32
    angles) and grouped attention in torch ops, at rope_kernels.draw's settings (long positions,
    linear and YaRN scaling); the bug turns the other layout."""
    s = rope_kernels.draw(rng)
    b, h_kv, h, n_q, n_k, d = s["batch"], s["h_kv"], s["h_kv"] * s["groups"], s["n_q"], s["n_k"], s["d"]
    shapes = [(b, h, n_q, d), (b, h_kv, n_k, d), (b, h_kv, n_k, d)]
    primals, dots = ([torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) for shape in shapes]
                     for _ in range(2))
    positions_k = np.arange(n_k) + s["offset"]
    layout = {"half": "interleaved", "interleaved": "half"}[s["layout"]] if bug == "layout" else s["layout"]
    turn = lambda x, at: rope_kernels.turn(x, at, layout, s["rotary_dim"], s["base"], s["scaling"], "hf")

    def attention(q, k, v):
        k, v = (x.repeat_interleave(s["groups"], dim=1) for x in (k, v))
        scores = turn(q, positions_k[n_k - n_q:]) @ turn(k, positions_k).transpose(-1, -2) / math.sqrt(d)
        if s["causal"]:
            keep = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + n_k - n_q
            scores = scores.masked_fill(~keep, -math.inf)
        return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)
    (out, lse), (out_dot, lse_dot) = torch.func.jvp(attention, tuple(primals), tuple(dots))
    arrays = dict(zip(("q", "k", "v", "q_dot", "k_dot", "v_dot"), (x.numpy() for x in primals + dots)),
                  out=out.numpy(), lse=lse.numpy(), out_dot=out_dot.numpy(), lse_dot=lse_dot.numpy())
    return {**arrays, **rope_kernels.case_keys(s)}


@pytest.mark.slow
def test_tangents_with_rope_pass_when_honest_and_fail_with_the_other_layout():
    """20 float32 cases: torch.func.jvp's out_dot and lse_dot of an honest candidate pass (the
    baseline's tangents turned with float32 angles, as the candidate's are), the other layout's
    fail."""
    rng = np.random.default_rng(8)
    for _ in range(20):
        honest = na.crosscheck(**tangent_case(rng))
        assert honest and {"out_dot", "lse_dot"} <= {row.name for row in honest.rows}, honest
        wrong = na.crosscheck(**tangent_case(rng, bug="layout"))
        assert not wrong, wrong


def test_the_term_magnitudes_of_dq_and_dk_are_the_turned_case_s_times_the_turn_back():
    """dq and dk of the unturned q, k sum two terms a pair in the turn back (|cos| + |sin| <= sqrt 2,
    times YaRN's magnitude): their magnitudes are the turned case's times that; the others the
    turned case's."""
    from numpy_attention.oracle.runs import case_magnitudes, reference
    from numpy_attention.oracle.case import split_case
    from numpy_attention.oracle.rotary import turned_case
    arrays = _float32_case({"rope_layout": "half", "rope_scaling": "yarn", "rope_factor": 4.0,
                            "rope_original_max_position_embeddings": 8}, None)
    case = split_case(arrays)
    truth = reference(case.inputs, case.options, np.dtype(np.float64))
    turned, factor = turned_case(case)
    assert factor == pytest.approx(math.sqrt(2) * (0.1 * math.log(4.0) + 1))
    with_rope, plain = (case_magnitudes(c, truth, True, None, None, 1) for c in (case, turned))
    for name, x in plain.items():
        assert with_rope[name] == (x * factor if name in ("dq", "dk") else x), name
