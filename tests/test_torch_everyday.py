"""crosscheck on torch's kernels in the shapes kernel authors run every day, where a rule that
scales its tolerance with the result cries wolf: decoding (one query row; causal, it sees one
key), one to three keys (dq and dk cancel to 0, a kernel returns rounding noise), a custom
scale with grouped-query heads, softcap with a bias and a window, biases handed over as
tensors in the kernel's own dtype (bfloat16 has no NumPy dtype); decoding with q nearly
orthogonal to its keys (the scores and lse cancel to near 0, and round at the size of q and
k); 400 decoding steps of SDPA and the CPU flash kernel; ALiBi with its gradient. In float16,
bfloat16 and float32, with SDPA, its math backend, the CPU flash kernel and attention as torch
ops (tests/torch_kernels.py's EVERYDAY, ORTHOGONAL and ALIBI).

Honest results must all pass (0 false failures over 840 + 180 + 1600 + 80 cases); a planted
bug must fail in >= 95% of the cases where it changes the exact result.
"""
import numpy as np
import pytest
from optional import TORCH_REASON

from numpy_attention import crosscheck

torch = pytest.importorskip("torch", reason=TORCH_REASON)
from torch_kernels import (ALIBI, EVERYDAY, ORTHOGONAL, campaign, caught,  # noqa: E402 (needs torch)
                           false_failures, random_case, run)

CASES_PER_VARIANT = 20                          # x 14 kernel-variant pairs = 280 cases per precision
CAUGHT = 0.95


@pytest.fixture(scope="module", params=["float16", "bfloat16", "float32"])
def results(request):
    torch.set_num_threads(1)
    return request.param, campaign(request.param, CASES_PER_VARIANT, seed=12, kernels=EVERYDAY)


@pytest.mark.slow
def test_no_false_failure(results):
    precision, (honest, _) = results
    assert len(honest) == 280
    failed = false_failures(honest)
    assert not failed, failed[:2]


@pytest.mark.slow
def test_planted_bugs_are_caught(results):
    precision, (_, planted) = results
    shares = caught(planted)
    assert len(planted["scale"]) >= 150 and len(planted["dq_entry"]) >= 150, {b: len(r) for b, r in planted.items()}
    assert all(share >= CAUGHT for share in shares.values()), (precision, shares)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float16", "bfloat16", "float32"])
def test_no_false_failure_where_q_is_nearly_orthogonal_to_its_keys(precision):
    """Decoding where the scores cancel: an lse of about 0 (one key) rounds at the size of q and
    k, and the scale barely moves the result (the scale check cannot apply)."""
    torch.set_num_threads(1)
    honest, _ = campaign(precision, CASES_PER_VARIANT, seed=13, kernels=ORTHOGONAL, bugs=())
    assert len(honest) == 60
    failed = false_failures(honest)
    assert not failed, failed[:2]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_no_false_failure_on_400_decoding_steps(precision):
    """Decoding (one query row, causal or not) by SDPA and the CPU flash kernel, 400 cases each:
    dq and dk, where dS = P (dP - D) nearly cancels, shift with the D = rowsum(dout * out) of the
    kernel's own out; the flash kernel's lse, summed from weights rounded to float16, is off by
    up to half a float16 ulp of 1 however small the lse."""
    torch.set_num_threads(1)
    failed = []
    for seed in range(400):
        case = random_case(np.random.default_rng(seed), precision, "decode")
        failed += [(seed, kernel) for kernel in ("sdpa", "flash_lse") if not crosscheck(**run(case, kernel))]
    assert not failed, failed


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_no_false_failure_with_alibi_slopes_and_their_gradient(precision):
    """ALiBi written as torch ops, the distances times the slopes in the kernel's dtype, with
    dalibi_slopes by autograd: 40 cases, half of them causal, each baseline in the case's
    dtype (tests/test_baseline_dtypes.py); a wrong dq entry caught. (In float16, autograd sums
    the bias's gradient over the batch in float16 before its product with the distances, which
    the recipe does not: not yet held here.)"""
    torch.set_num_threads(1)
    honest, planted = campaign(precision, 40, seed=14, kernels=ALIBI, bugs=("dq_entry",))
    failed = false_failures(honest)
    assert len(honest) == 40 and not failed, failed[:1]
    assert caught(planted)["dq_entry"] >= CAUGHT
