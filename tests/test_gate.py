"""The output gate (Qwen3-Next's gated attention, gate.py): out = (P V) * sigmoid(gate) on every
engine, forward, backward and JVP, against complex step and torch; crosscheck's `gate` and `dgate`."""
import math

import ml_dtypes
import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.oracle import CaseError

rng = np.random.default_rng(0)
Q, K, V = rng.standard_normal((2, 4, 5, 8)), rng.standard_normal((2, 2, 7, 8)), rng.standard_normal((2, 2, 7, 6))
DOUT = rng.standard_normal((2, 4, 5, 6))
GATES = {"headwise": rng.standard_normal((2, 4, 5, 1)), "elementwise": rng.standard_normal((2, 4, 5, 6)),
         "over the batch": rng.standard_normal((4, 5, 1))}
OPTIONS = {"causal": {"causal": True}, "bias, sinks, ALiBi": {"bias": rng.standard_normal((4, 5, 7)),
                                                              "sinks": rng.standard_normal(4),
                                                              "alibi_slopes": rng.random(4)},
           "top-k lists": {"topk_indices": rng.integers(-1, 7, (2, 2, 5, 4))}}
H = 1e-30


def engines(options):
    return ("textbook", "blocked", "tiled") + (("sparse",) if "topk_indices" in options else ())


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def complex_step(f, x, direction):
    """<direction, d f / d x> summed against DOUT: Im f(x + i h direction) / h."""
    return np.sum(DOUT * f(x + 1j * H * direction).imag) / H


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("option", OPTIONS)
def test_every_engine_gates_and_differentiates_the_gate(gate, option):
    g, options = GATES[gate], OPTIONS[option]
    plain = na.attention_forward(Q, K, V, **options)[0]
    u = rng.standard_normal(g.shape)
    for engine in engines(options):
        out, cache = na.attention_forward(Q, K, V, gate=g, implementation=engine, **options)
        assert np.abs(out - plain * sigmoid(g)).max() < 1e-15, engine
        assert np.abs(cache.out - plain).max() < 1e-15, engine          # the cache holds P V
        grads = na.attention_backward(DOUT, cache)
        assert grads.dgate.shape == g.shape
        close = lambda a, b: abs(a - b) <= 1e-14 * max(1.0, abs(b))
        forward = lambda x: na.attention_forward(Q, K, V, gate=x, implementation="textbook", **options)[0]
        assert close(np.sum(grads.dgate * u), complex_step(forward, g, u)), engine
        calls = {"q": lambda y: na.attention_forward(y, K, V, gate=g, **options)[0],
                 "k": lambda y: na.attention_forward(Q, y, V, gate=g, **options)[0],
                 "v": lambda y: na.attention_forward(Q, K, y, gate=g, **options)[0]}
        for name, x in zip("qkv", (Q, K, V)):
            w = rng.standard_normal(x.shape)
            assert close(np.sum(getattr(grads, f"d{name}") * w), complex_step(calls[name], x, w)), (engine, name)


@pytest.mark.parametrize("gate", GATES)
def test_the_jvp_carries_the_gates_tangent(gate):
    g, q_dot, v_dot = GATES[gate], rng.standard_normal(Q.shape), rng.standard_normal(V.shape)
    g_dot = rng.standard_normal(g.shape)
    want = na.attention_forward(Q + 1j * H * q_dot, K, V + 1j * H * v_dot, gate=g + 1j * H * g_dot,
                                causal=True)[0].imag / H
    for engine, extra in (("textbook", {}), ("tiled", {}), ("sparse", {"topk_indices": np.tile(np.arange(7), (2, 2, 5, 1))})):
        out, out_dot, lse, _ = na.attention_jvp(Q, K, V, q_dot, None, v_dot, gate_dot=g_dot, gate=g, causal=True,
                                                implementation=engine, **extra)
        assert np.abs(out_dot - want).max() < 1e-12, engine
        assert np.abs(lse - na.attention_forward(Q, K, V, causal=True)[1].lse).max() < 1e-14   # lse: ungated
    _, out_dot, _, _ = na.attention_jvp(Q, K, V, q_dot, gate=g)        # no gate_dot: the gate is constant
    assert np.abs(out_dot - na.attention_forward(Q + 1j * H * q_dot, K, V, gate=g)[0].imag / H).max() < 1e-12


def test_against_torch_float64(torch):
    """Qwen3-Next's eager form in torch: SDPA, times sigmoid(gate); autograd's gradients."""
    t = [torch.tensor(x, requires_grad=True) for x in (Q, K, V, GATES["headwise"])]
    out = torch.nn.functional.scaled_dot_product_attention(*t[:3], is_causal=True, enable_gqa=True)
    out = out * torch.sigmoid(t[3])
    out.backward(torch.tensor(DOUT))
    mine, cache = na.attention_forward(Q, K, V, gate=GATES["headwise"], causal=True, implementation="tiled")
    grads = na.attention_backward(DOUT, cache)
    assert np.abs(mine - out.detach().numpy()).max() < 1e-12
    for name, x in zip(("dq", "dk", "dv", "dgate"), t):
        assert np.abs(getattr(grads, name) - x.grad.numpy()).max() < 1e-12, name


@pytest.mark.parametrize("kwargs, error, message", [
    ({"gate": np.zeros((2, 4, 5, 3))}, ValueError, r"gate of shape \(2, 4, 5, 3\) does not broadcast to the "
                                                   r"output \[\.\.\., H, N_q, d_v\] \(2, 4, 5, 6\)"),
    ({"gate": np.zeros((2, 4, 5, 1)).astype(str)}, TypeError, "gate"),
    ({"gate": np.full((2, 4, 5, 1), np.nan), "check_finite": True}, ValueError, "gate .* non-finite"),
])
def test_a_bad_gate_is_refused_naming_it(kwargs, error, message):
    with pytest.raises(error, match=message):
        na.attention_forward(Q, K, V, **kwargs)


def test_what_takes_no_gate_says_so():
    g = GATES["headwise"]
    with pytest.raises(ValueError, match="takes no mask, bias, .* nor a gate"):
        na.attention_forward(Q, rng.standard_normal((3, 2, 4, 8)), rng.standard_normal((3, 2, 4, 6)), gate=g,
                             page_table=np.array([[0, 1], [2, 0]]), cache_seqlens=np.array([5, 3]))
    with pytest.raises(ValueError, match="attention_hvp takes no gate"):
        na.attention_hvp(Q, K, V, DOUT, Q, gate=g)
    with pytest.raises(ValueError, match="gate_dot is the tangent of an option this call does not have"):
        na.attention_jvp(Q, K, V, Q, gate_dot=g)


def test_the_callers_gate_is_not_written():
    g = GATES["elementwise"].copy()
    g.flags.writeable = False
    out, cache = na.attention_forward(Q, K, V, gate=g)
    na.attention_backward(DOUT, cache)
    assert np.array_equal(g, GATES["elementwise"]) and not np.shares_memory(cache.options.gate, g)


# ----------------------------------------------------------------------------- crosscheck

def kernel_case(dtype, gate="headwise", **options):
    """Our attention on the dtype's values standing in for a gated kernel (float32 inside)."""
    q, k, v, dout, g = (x.astype(dtype) for x in (Q, K, V, DOUT, GATES[gate]))
    f32 = lambda x: x.astype(np.float32)
    out, cache = na.attention_forward(f32(q), f32(k), f32(v), gate=f32(g), **options)
    grads = na.attention_backward(f32(dout), cache)
    return dict(q=q, k=k, v=v, dout=dout, gate=g, out=out.astype(dtype), lse=cache.lse,
                **{name: getattr(grads, name).astype(dtype) for name in ("dq", "dk", "dv", "dgate")}, **options)


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_crosscheck_judges_the_gated_out_and_dgate(dtype, gate):
    case = kernel_case(dtype, gate, causal=True)
    report = na.crosscheck(**case)
    assert report and [row.name for row in report.rows] == ["out", "lse", "dq", "dk", "dv", "dgate"], report
    assert report.rows == na.crosscheck(**case, workers=2).rows
    assert na.crosscheck(**case, own_forward=True)
    inner = na.attention_forward(*(x.astype(np.float32) for x in (case["q"], case["k"], case["v"])), causal=True)[0]
    for out, words in ((inner, "the gate not applied"), (inner * case["gate"].astype(np.float32), "without its sigmoid")):
        report = na.crosscheck(**{**case, "out": out.astype(dtype)})
        assert not report and words in report.diagnosis[0], report
    wrong = (case["dgate"].astype(np.float32) * 4).astype(dtype)        # sigmoid'(g) taken as 1/4 ... times 4
    assert not na.crosscheck(**{**case, "dgate": wrong})


def test_a_gate_case_in_flashattentions_layout_and_its_errors():
    case = kernel_case(np.float32, "elementwise")
    laid_out = {name: np.swapaxes(x, 1, 2) if name in ("q", "k", "v", "dout", "out", "dq", "dk", "dv", "gate", "dgate")
                else x for name, x in case.items()}
    assert na.crosscheck(**laid_out, layout="bnhd")
    with pytest.raises(CaseError, match=r"dgate must have shape \(2, 4, 5, 6\), got \(2, 4, 5, 1\)"):
        na.crosscheck(**{**case, "dgate": case["dgate"][..., :1]})
    with pytest.raises(CaseError, match="dgate is given but gate is not"):
        na.crosscheck(**{name: x for name, x in case.items() if name != "gate"})


def test_torch_candidates_pass_honest_and_fail_with_each_bug_named(torch):
    """Qwen3-Next's eager order and a fused epilogue (gate_kernels.py), a few cases per dtype
    (benchmarks/variant_sweeps.py --variant gate: 200 a dtype)."""
    import gate_kernels
    counts = gate_kernels.sweep(6, seed=1)
    for (dtype, what), (judged, failed, named, not_run) in counts.items():
        assert judged == 6, counts
        assert (failed, named) == ((0, 0) if what == "honest" else (6, 6)) and not not_run, (dtype, what, counts)


def test_the_sigmoid_and_its_slope_hold_their_digits_at_any_gate():
    """s(g) and s'(g) = s (1 - s) to 1e-15 relatively from -800 to 800 (against exact fractions of
    exp(-|g|)), no overflow; complex step through them gives the slope."""
    from numpy_attention.gate import sigmoid, sigmoid_slope
    g = np.array([-800.0, -30.0, -1.0, 0.0, 2.0, 30.0, 800.0])
    e = [math.exp(-abs(x)) for x in g]
    want_s = [ei / (1 + ei) if x < 0 else 1 / (1 + ei) for x, ei in zip(g, e)]
    want_slope = [ei / (1 + ei) ** 2 for ei in e]
    with np.errstate(over="raise", invalid="raise", divide="raise"):     # (exp(-800) underflows to 0)
        assert np.allclose(sigmoid(g), want_s, rtol=1e-15, atol=0)
        assert np.allclose(sigmoid_slope(g), want_slope, rtol=1e-15, atol=0)
        assert np.allclose(sigmoid(g + 1j * H).imag / H, want_slope, rtol=1e-15, atol=0)


# ----------------------------------------------------------------------------- conform

def test_conform_draws_a_gate_and_judges_dgate(torch):
    from numpy_attention.conformance import examples
    from numpy_attention.conformance.grid import cases
    from numpy_attention.conformance.supports import declare
    grid = [case for case in cases(dtypes=("float32", "bfloat16"), supports=("causal", "gate", "varlen", "gradients"))
            if "gate" in case.options][:8]
    assert {case.arrays()["gate"].shape[-1] for case in grid} > {1}           # headwise and elementwise
    for case in grid:
        assert na.conform.check(examples.numpy_float32, case), case.id

    @declare(kind="torch", supports=("causal", "gate", "gradients"))
    def qwen3_next(q, k, v, causal=False, gate=None):                 # its eager attention, in the dtype
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                               enable_gqa=q.shape[-3] != k.shape[-3])
        return out if gate is None else out * torch.sigmoid(gate)
    plain_grid = [case for case in grid if "varlen" not in case.options][:4]
    for case in plain_grid:
        report = na.conform.check(qwen3_next, case)
        assert report and report.rows[-1].name == "dgate", report

    @declare(kind="torch", supports=("causal", "gate", "gradients"))
    def ungated(q, k, v, causal=False, gate=None):
        return qwen3_next(q, k, v, causal=causal) + 0 * gate.sum()
    report = na.conform.check(ungated, plain_grid[0])
    assert not report and "the gate not applied" in report.diagnosis[0], report


@pytest.mark.parametrize("value", [-20.0, -12.0])
def test_a_gate_that_shrinks_out_shrinks_every_bound(value):
    """The term magnitudes are the attention's under dout * sigmoid(gate), out's times the gate:
    with sigmoid(gate) near 1e-9 a wrong out, dq or dv still fails."""
    f32 = lambda x: x.astype(np.float32)
    q, k, v, dout = (f32(x) for x in (Q, K, V, DOUT))
    gate = np.full((2, 4, 5, 1), value, np.float32)
    out, cache = na.attention_forward(q, k, v, gate=gate, causal=True)
    grads = na.attention_backward(dout, cache)
    case = dict(q=q, k=k, v=v, dout=dout, gate=gate, causal=True, out=out, dq=grads.dq, dk=grads.dk, dv=grads.dv,
                dgate=grads.dgate)
    assert na.crosscheck(**case)
    for name, wrong in (("out", out * 1.3), ("dq", grads.dq * 0), ("dv", grads.dv * 1.5), ("dgate", grads.dgate * 1.5)):
        report = na.crosscheck(**{**case, name: wrong})
        assert not report and not next(row for row in report.rows if row.name == name).passed, (name, report)


def test_crosscheck_refuses_a_gate_on_a_paged_cache():
    case = dict(q=Q[:, :, :2], k=rng.standard_normal((3, 2, 4, 8)), v=rng.standard_normal((3, 2, 4, 6)),
                page_table=np.array([[0, 1], [2, 0]]), cache_seqlens=np.array([5, 3]), gate=np.zeros((2, 4, 2, 1)),
                out=np.zeros((2, 4, 2, 6)))
    with pytest.raises(CaseError, match="a paged KV cache .* takes no mask, bias, cu_seqlens, seqused_k or gate"):
        na.crosscheck(**case)
