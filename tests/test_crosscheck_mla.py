"""crosscheck of Multi-head Latent Attention's absorbed form: the case key kv (k = kv, v = its first
head_dim_v columns) and the candidate's dkv (both uses summed, in the precision's rounding);
torch candidates honest and with planted bugs (tests/mla_kernels.py; the longer sweep:
benchmarks/variant_sweeps.py --variant mla), FlashMLA's [B, N, H, d] layout, a case file, and
bad keys refused by name."""
import math

import numpy as np
import pytest
from optional import TORCH_REASON

import numpy_attention as na
from numpy_attention.oracle.case import load_case, save_case
from numpy_attention.oracle.schema import CaseError

torch = pytest.importorskip("torch", reason=TORCH_REASON)
import mla_kernels  # noqa: E402  (needs torch)

CASES = 15          # per dtype, each honest and with each bug


@pytest.fixture(scope="module")
def counts():
    return mla_kernels.sweep(CASES, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", mla_kernels.DTYPES)
def test_honest_torch_candidates_pass(counts, dtype):
    judged, failed, _, _ = counts[(dtype, "honest")]
    assert judged == CASES and failed == 0, counts


@pytest.mark.slow
@pytest.mark.parametrize("bug", mla_kernels.BUGS)
@pytest.mark.parametrize("dtype", mla_kernels.DTYPES)
def test_each_planted_bug_is_caught_and_named_where_the_diagnosis_runs(counts, dtype, bug):
    """Caught every time. dkv's missing use is named in every case (it needs no rerun); the two
    bugs named by a rerun, in at least 80% of the cases the diagnosis tries (it does not rerun
    mix-ups on a paged cache's case; in bfloat16 a mix-up that makes the softmax sharp can put
    the candidate's rounding past the diagnosis's 1% reach)."""
    judged, failed, named, not_run = counts[(dtype, bug)]
    assert judged == CASES and failed == judged, counts
    if bug == "keys_gradient_alone":
        assert named == judged, counts
    else:
        assert named >= 0.8 * (judged - not_run) and named + not_run <= judged, counts


def latent_case(seed=5, r=24, p=8, heads=4, n_q=2, n_k=11):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, heads, n_q, r + p)), rng.standard_normal((1, 1, n_k, r + p)),
            rng.standard_normal((1, heads, n_q, r)))


def test_a_float64_candidate_from_torch_and_ours_pass_within_a_few_ulps():
    q, kv, dout = latent_case()
    tq, tkv = (torch.from_numpy(x).requires_grad_() for x in (q, kv))
    keep = torch.arange(11)[None, :] <= torch.arange(2)[:, None] + 9
    s = (tq @ tkv.transpose(-1, -2) / math.sqrt(32)).masked_fill(~keep, -math.inf)
    out = torch.softmax(s, -1) @ tkv[..., :24]
    out.backward(torch.from_numpy(dout))
    keys = dict(q=q, kv=kv, dout=dout, head_dim_v=24, causal="bottom_right")
    report = na.crosscheck(**keys, out=out.detach().numpy(), dq=tq.grad.numpy(), dkv=tkv.grad.numpy())
    assert report and max(row.max_abs_err for row in report.rows) < 1e-12, report
    ours, cache = na.mla_forward(q, kv, rope_dim=8, causal="bottom_right")
    g = na.mla_backward(dout, cache)
    report = na.crosscheck(**keys, out=ours, dq=g.dq, dkv=g.dkv)
    assert report and max(row.max_abs_err for row in report.rows) < 1e-14, report


def test_flashmla_layout_and_a_case_file(tmp_path):
    """FlashMLA's q [B, N_q, H, d] and kv [B, N_k, 1, d] read with layout='bnhd'; the case written
    and read back judges the same."""
    q, kv, dout = latent_case()
    out, cache = na.mla_forward(q.astype(np.float32), kv.astype(np.float32), rope_dim=8)
    g = na.mla_backward(dout.astype(np.float32), cache)
    swap = lambda x: np.swapaxes(x, -2, -3)
    arrays = dict(q=swap(q.astype(np.float32)), kv=swap(kv.astype(np.float32)), dout=swap(dout.astype(np.float32)),
                  out=swap(out), dq=swap(g.dq), dkv=swap(g.dkv), head_dim_v=24, layout="bnhd")
    assert na.crosscheck(**arrays)
    save_case(tmp_path / "mla.npz", **arrays)
    assert na.crosscheck(**load_case(tmp_path / "mla.npz"))


@pytest.mark.parametrize("change, words", [
    ({"k": np.zeros((1, 1, 11, 32))}, "a case with kv .* takes no k"),
    ({"head_dim_v": None}, "needs head_dim_v, the width of the values"),
    ({"head_dim_v": 40}, "head_dim_v must be from 1 to kv's width 32"),
    ({"dkv": np.zeros((1, 1, 10, 32))}, r"dkv must have shape \(1, 1, 11, 32\)"),
    ({"kv": None, "k": np.zeros((1, 1, 11, 32)), "v": np.zeros((1, 1, 11, 24))}, "head_dim_v is given but kv is not"),
])
def test_bad_mla_keys_are_refused_by_name(change, words):
    q, kv, dout = latent_case()
    arrays = {**dict(q=q, kv=kv, dout=dout, head_dim_v=24, out=np.zeros((1, 4, 2, 24)), dkv=np.zeros_like(kv)),
              **change}
    with pytest.raises(CaseError, match=words):
        na.crosscheck(**arrays)
