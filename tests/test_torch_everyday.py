"""crosscheck on torch's kernels in the shapes kernel authors run every day, where a rule that
scales its tolerance with the result cries wolf: decoding (one query row; causal, it sees one
key), one to three keys (dq and dk cancel to 0, a kernel returns rounding noise), a custom
scale with grouped-query heads, softcap with a bias and a window, and biases handed over as
tensors in the kernel's own dtype (bfloat16 has no NumPy dtype). In float16, bfloat16 and
float32, with SDPA, its math backend, the CPU flash kernel and attention as torch ops
(tests/torch_kernels.py's EVERYDAY).

Honest results must all pass (0 false failures over 840 cases); a planted bug must fail in
>= 95% of the cases where it changes the exact result.
"""
import pytest
from optional import TORCH_REASON

torch = pytest.importorskip("torch", reason=TORCH_REASON)
from torch_kernels import EVERYDAY, campaign  # noqa: E402  (needs torch)

CASES_PER_VARIANT = 20                          # x 14 kernel-variant pairs = 280 cases per precision
CAUGHT = 0.95


@pytest.fixture(scope="module", params=["float16", "bfloat16", "float32"])
def results(request):
    torch.set_num_threads(1)
    return request.param, campaign(request.param, CASES_PER_VARIANT, seed=12, kernels=EVERYDAY)


def test_no_false_failure(results):
    precision, (honest, _) = results
    assert len(honest) == 280
    failed = [(kernel, variant, str(report)) for kernel, variant, report in honest if not report]
    assert not failed, failed[:2]


def test_planted_bugs_are_caught(results):
    precision, (_, planted) = results
    shares = {bug: sum(not report for report in reports) / len(reports)
              for bug, reports in planted.items() if reports}
    assert len(planted["scale"]) >= 150 and len(planted["dq_entry"]) >= 150, {b: len(r) for b, r in planted.items()}
    assert all(share >= CAUGHT for share in shares.values()), (precision, shares)
