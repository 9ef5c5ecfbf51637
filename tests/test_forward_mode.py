"""Forward mode and second order: linear_jvp, softmax_jvp, attention_jvp (out and lse) and
attention_hvp (the tangents of dq, dk, dv), against complex step (whole Jacobian columns), the
adjoint identity with the backward, the Hessian's symmetry, and torch.func / double backward."""
import numpy as np
import pytest
from layouts import grouped_inputs

import numpy_attention as na

RNG = np.random.default_rng(41)
MASK = RNG.random((2, 1, 4, 6)) < 0.6
MASK[1, 0, 2] = False                                            # a fully masked row
OPTIONS = {
    "plain": {},
    "mask with a dead row": {"mask": MASK},
    "causal bottom_right, window": {"causal": "bottom_right", "window": (2, 1)},
    "bias": {"bias": RNG.standard_normal((4, 4, 6))},
    "softcap": {"softcap": 1.5, "scale": 1.0},
    "dropout": {"dropout_mask": RNG.random((2, 4, 4, 6)) < 0.8, "dropout_p": 0.2},
    "sinks, ALiBi": {"sinks": RNG.standard_normal(4), "alibi_slopes": RNG.uniform(0.1, 1, (2, 4))},
    "uniform policy": {"mask": MASK, "fully_masked": "uniform"},
}
TANGENTS = {"bias": "bias_dot", "sinks": "sinks_dot", "alibi_slopes": "alibi_slopes_dot"}


def test_linear_and_softmax_jvp_equal_complex_step():
    rng = np.random.default_rng(1)
    x, W, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    report = na.jvpcheck(lambda x, W, b: (na.linear_forward(x, W, b)[0], None),
                         lambda xs, ts: na.linear_jvp(*xs, *ts)[1], [x, W, b])
    assert report, report
    z = 4 * rng.standard_normal((3, 6))
    assert na.jvpcheck(lambda z: (na.softmax_forward(z)[0], None), lambda zs, ts: na.softmax_jvp(zs[0], ts[0])[1], [z])


def test_jvpcheck_projections_of_an_input_do_not_depend_on_the_others_checked():
    """The seed alone draws each input's directions, in order: checking x alone or x, W and b
    gives x the same projections (nothing else, such as full mode's probes, draws from it)."""
    rng = np.random.default_rng(2)
    x, W, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    forward, jvp = lambda x, W, b: (na.linear_forward(x, W, b)[0], None), lambda xs, ts: na.linear_jvp(*xs, *ts)[1]
    alone, together = (na.jvpcheck(forward, jvp, [x, W, b], mode="projection", wrt=wrt) for wrt in ([0], [0, 1, 2]))
    assert alone.rows[0] == together.rows[0]


@pytest.mark.parametrize("option", OPTIONS)
def test_attention_jvp_of_out_and_lse_equals_complex_step(option):
    per_input = [n for n in TANGENTS if n in OPTIONS[option]]
    fixed = {n: x for n, x in OPTIONS[option].items() if n not in per_input}

    def forward(q, k, v, *extra):
        out, cache = na.attention_forward(q, k, v, **fixed, **dict(zip(per_input, extra)))
        lse = np.where(np.isneginf(cache.lse.real), 0, cache.lse)
        return np.concatenate([out.ravel(), lse.ravel()]), None

    def jvp(primals, tangents):
        q, k, v, *extra = primals
        dots = {TANGENTS[n]: t for n, t in zip(per_input, tangents[3:])}
        _, out_dot, lse, lse_dot = na.attention_jvp(q, k, v, *tangents[:3], **fixed,
                                                    **dict(zip(per_input, extra)), **dots)
        return np.concatenate([out_dot.ravel(), np.where(np.isneginf(lse.real), 0, lse_dot).ravel()])
    report = na.jvpcheck(forward, jvp, list(grouped_inputs()[:3]) + [OPTIONS[option][n] for n in per_input])
    assert report, report


@pytest.mark.parametrize("option", OPTIONS)
def test_the_jvp_is_the_adjoint_of_the_backward(option):
    """<u, J v> from attention_jvp equals <J^T u, v> from attention_backward."""
    rng = np.random.default_rng(2)
    q, k, v = grouped_inputs(2)[:3]
    tangents = [rng.standard_normal(x.shape) for x in (q, k, v)]
    out, out_dot, _, _ = na.attention_jvp(q, k, v, *tangents, **OPTIONS[option])
    u = rng.standard_normal(out.shape)
    grads = na.attention_backward(u, na.attention_forward(q, k, v, **OPTIONS[option])[1])
    forward_mode = np.sum(u * out_dot)
    reverse_mode = sum(np.sum(g * t) for g, t in zip(grads[:3], tangents))
    assert abs(forward_mode - reverse_mode) <= 1e-13 * max(1.0, abs(reverse_mode))


@pytest.mark.parametrize("option", OPTIONS)
def test_attention_hvp_equals_complex_step_on_the_backward(option):
    """The backward is analytic: Im backward(x + i h x_dot) / h is the tangent of the gradients."""
    rng = np.random.default_rng(3)
    q, k, v = grouped_inputs(3)[:3]
    tangents = [rng.standard_normal(x.shape) for x in (q, k, v)]
    dout = rng.standard_normal((2, 4, 4, 2))
    grads, grads_dot = na.attention_hvp(q, k, v, dout, *tangents, **OPTIONS[option])
    h = 1e-20
    moved = [x + 1j * h * t for x, t in zip((q, k, v), tangents)]
    complex_grads = na.attention_backward(dout, na.attention_forward(*moved, **OPTIONS[option])[1])
    for ours, theirs, plain in zip(grads_dot[:3], complex_grads[:3], grads[:3]):
        np.testing.assert_allclose(ours, theirs.imag / h, rtol=0, atol=1e-13 * np.abs(ours).max())
        np.testing.assert_allclose(plain, theirs.real, rtol=1e-13, atol=1e-15)


def test_the_hessian_vector_product_is_symmetric():
    """<a, H b> = <b, H a> for the Hessian H of <dout, out> w.r.t. (q, k, v)."""
    rng = np.random.default_rng(4)
    q, k, v = grouped_inputs(4)[:3]
    dout = rng.standard_normal((2, 4, 4, 2))
    a, b = ([rng.standard_normal(x.shape) for x in (q, k, v)] for _ in range(2))
    Ha = na.attention_hvp(q, k, v, dout, *a, causal=True, softcap=2.0)[1]
    Hb = na.attention_hvp(q, k, v, dout, *b, causal=True, softcap=2.0)[1]
    left, right = (sum(np.sum(x * y) for x, y in zip(u, Hw[:3])) for u, Hw in ((a, Hb), (b, Ha)))
    assert abs(left - right) <= 1e-13 * abs(left)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")   # torch.func's own
def test_against_torch_func_jvp_and_double_backward(torch):
    rng = np.random.default_rng(5)
    q, k, v = grouped_inputs(5)[:3]
    bias = rng.standard_normal((4, 4, 6))
    tangents = [rng.standard_normal(x.shape) for x in (q, k, v)]
    dout = rng.standard_normal((2, 4, 4, 2))

    def attention(tq, tk, tv):
        kk, vv = tk.repeat_interleave(2, dim=1), tv.repeat_interleave(2, dim=1)
        s = tq @ kk.transpose(-1, -2) / np.sqrt(3) + torch.tensor(bias)
        s = s.masked_fill(~torch.ones(4, 6, dtype=torch.bool).tril(), float("-inf"))
        return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)
    primals, dots = [torch.tensor(x) for x in (q, k, v)], [torch.tensor(t) for t in tangents]
    (out, lse), (out_dot, lse_dot) = torch.func.jvp(attention, tuple(primals), tuple(dots))
    _, ours_out_dot, _, ours_lse_dot = na.attention_jvp(q, k, v, *tangents, bias=bias, causal=True)
    np.testing.assert_allclose(ours_out_dot, out_dot.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ours_lse_dot, lse_dot.numpy(), rtol=1e-12, atol=1e-13)
    leaves = [x.clone().requires_grad_() for x in primals]          # double backward: d/dt grad(x + t x_dot)
    grads = torch.autograd.grad(attention(*leaves)[0], leaves, torch.tensor(dout), create_graph=True)
    hvp = torch.autograd.grad(grads, leaves, dots)
    _, grads_dot = na.attention_hvp(q, k, v, dout, *tangents, bias=bias, causal=True)
    for ours, theirs in zip(grads_dot[:3], hvp):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("kwargs, message", [
    ({"implementation": "blocked"}, "runs on the textbook, tiled or sparse engine, not implementation='blocked'"),
    ({"q_dot": np.zeros((2, 4, 4, 4))}, r"q_dot must have its primal's shape \(2, 4, 4, 3\)"),
    ({"bias_dot": np.zeros((4, 6))}, "bias_dot is the tangent of an option this call does not have"),
])
def test_bad_jvp_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        na.attention_jvp(*grouped_inputs()[:3], **kwargs)


def test_the_hvp_runs_on_the_textbook_only():
    q, k, v = grouped_inputs()[:3]
    with pytest.raises(ValueError, match="runs on the textbook engine, not implementation='tiled'"):
        na.attention_hvp(q, k, v, np.ones((2, 4, 4, 2)), implementation="tiled")


@pytest.mark.slow
def test_the_gradcheck_command_checks_forward_mode_and_the_identities(capsys):
    from numpy_attention.commands.cli import main
    from numpy_attention.gradcheck_cases import identity_gaps, jvp_cases
    assert all(gap <= 1e-12 for gap in identity_gaps(np.random.default_rng(0)).values())
    for forward, jvp, inputs, names in jvp_cases(np.random.default_rng(0)).values():
        assert na.jvpcheck(forward, jvp, inputs, names=names)
    assert main(["gradcheck"]) == 0
    out = capsys.readouterr().out
    assert "== forward mode: attention, sinks\njvpcheck" in out and "Hessian symmetry" in out


# ----------------------------------------------------------------------------- the tiled JVP

TILED_OPTIONS = [o for o in OPTIONS if not {"softcap", "dropout_mask"} & set(OPTIONS[o])
                 and OPTIONS[o].get("fully_masked", "zero") == "zero"]


@pytest.mark.parametrize("option", TILED_OPTIONS)
@pytest.mark.parametrize("block_size", [1, 3, 128])
def test_the_tiled_jvp_equals_the_textbook(option, block_size):
    rng = np.random.default_rng(6)
    q, k, v = grouped_inputs(6)[:3]
    tangents = [rng.standard_normal(x.shape) for x in (q, k, v)]
    extra = {TANGENTS[n]: rng.standard_normal(np.shape(OPTIONS[option][n])) for n in TANGENTS if n in OPTIONS[option]}
    spec = na.attention_jvp(q, k, v, *tangents, **OPTIONS[option], **extra)
    tiled = na.attention_jvp(q, k, v, *tangents, implementation="tiled", block_size=block_size,
                             **OPTIONS[option], **extra)
    for got, want in zip(tiled, spec):
        finite = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got), finite)
        np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=1e-13 * np.abs(want[finite]).max())


@pytest.mark.slow
def test_the_tiled_jvp_runs_in_o_n_memory():
    """N = 4096: one float64 [2, N, N] array would be 256 MiB; the tiled JVP stays far below."""
    import subprocess
    import sys
    code = ("import numpy as np, numpy_attention as na\n"
            "rng = np.random.default_rng(0)\n"
            "q, k, v, qd, kd, vd = (rng.standard_normal((2, 4096, 16)) for _ in range(6))\n"
            "na.attention_jvp(q, k, v, qd, kd, vd, causal=True, implementation='tiled', block_size=256)\n"
            "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n")
    peak_kib = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert peak_kib < 200 * 1024, peak_kib                      # a materialized JVP needs > 1 GiB here
