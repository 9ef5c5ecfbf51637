"""crosscheck in forward mode: a case with tangents q_dot, k_dot, v_dot and a candidate's out_dot,
lse_dot. A correct torch float32 JVP passes; one that drops the softmax tangent's <p, z_dot>
term fails."""
import numpy as np
import pytest
from optional import TORCH_REASON

import numpy_attention as na
from numpy_attention.oracle import CaseError

torch = pytest.importorskip("torch", reason=TORCH_REASON)


def torch_jvp(q, k, v, tangents, causal, drop_mean_term=False):
    """float32 (out_dot, lse_dot) by torch.func.jvp of attention in torch ops; with
    drop_mean_term, softmax's tangent written as p * z_dot (a planted bug)."""
    softmax = _BadSoftmax.apply if drop_mean_term else (lambda s: torch.softmax(s, -1))

    def attention(q, k, v):
        s = q @ k.transpose(-1, -2) / np.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        return softmax(s) @ v, torch.logsumexp(s, -1)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)
    (out, lse), (out_dot, lse_dot) = torch.func.jvp(attention, (f32(q), f32(k), f32(v)),
                                                    tuple(f32(t) for t in tangents))
    return out.numpy(), lse.numpy(), out_dot.numpy(), lse_dot.numpy()


class _BadSoftmax(torch.autograd.Function):
    """softmax whose JVP forgets the <p, z_dot> term: p_dot = p * z_dot."""
    generate_vmap_rule = True

    @staticmethod
    def forward(s):
        return torch.softmax(s, -1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_forward(output)

    @staticmethod
    def jvp(ctx, s_dot):
        p, = ctx.saved_tensors
        return p * torch.nan_to_num(s_dot)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("causal", [False, True])
def test_a_torch_jvp_passes_and_one_without_the_mean_term_fails(causal):
    rng = np.random.default_rng(0)
    for _ in range(10):
        n_q = int(rng.integers(2, 40))
        n_k = n_q + int(rng.integers(0, 20))
        q, k, v = (rng.standard_normal((1, 2, n, 16)) for n in (n_q, n_k, n_k))
        tangents = [rng.standard_normal(x.shape) for x in (q, k, v)]
        inputs = {n: x.astype(np.float32) for n, x in zip(("q", "k", "v", "q_dot", "k_dot", "v_dot"),
                                                          [q, k, v] + tangents)}
        out, lse, out_dot, lse_dot = torch_jvp(q, k, v, tangents, causal)
        report = na.crosscheck(**inputs, causal=causal, out=out, lse=lse, out_dot=out_dot, lse_dot=lse_dot)
        assert report, str(report)
        *_, bad_out_dot, _ = torch_jvp(q, k, v, tangents, causal, drop_mean_term=True)
        bad = na.crosscheck(**inputs, causal=causal, out=out, out_dot=bad_out_dot)
        assert not {r.name: r.passed for r in bad.rows}["out_dot"], str(bad)


def test_tangent_cases_are_checked():
    q = np.ones((1, 2, 3, 4), np.float32)
    with pytest.raises(CaseError, match="out_dot needs q_dot, k_dot or v_dot"):
        na.crosscheck(q=q, k=q, v=q, out=q, out_dot=q)
    with pytest.raises(CaseError, match="tangents are judged in the float32 and float64 precisions"):
        na.crosscheck(q=q, k=q, v=q, q_dot=q, out=q.astype(np.float16), out_dot=q.astype(np.float16),
                      precision="float16")
    with pytest.raises(CaseError, match=r"q_dot must have shape \(1, 2, 3, 4\)"):
        na.crosscheck(q=q, k=q, v=q, q_dot=q[..., :2], out=q, out_dot=q)
