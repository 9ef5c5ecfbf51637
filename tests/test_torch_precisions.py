"""crosscheck on torch's own CPU kernels as candidates, in float16, bfloat16 and float32:
SDPA (its default CPU kernel), SDPA's math backend, the CPU flash kernel with its float32 lse,
and attention written as torch ops, on every variant each computes (mask, bias, causal in both
alignments, scale, grouped-query heads, window, softcap, dropout), lengths up to 200.

Honest results must all pass (0 false failures over 1,620 cases); results with a planted bug
must fail in >= 95% of its cases in every precision.
"""
import pytest
from optional import TORCH_REASON

torch = pytest.importorskip("torch", reason=TORCH_REASON)
from torch_kernels import campaign, caught, false_failures  # noqa: E402  (needs torch)

pytestmark = pytest.mark.slow                   # every test here judges the campaigns' cases
CASES_PER_VARIANT = 20                          # x 27 kernel-variant pairs = 540 cases per precision
CAUGHT = 0.95                                   # the share of a bug's cases that must fail


@pytest.fixture(scope="module", params=["float16", "bfloat16", "float32"])
def results(request):
    torch.set_num_threads(1)                    # the kernels' results do not depend on it; time does
    return request.param, campaign(request.param, CASES_PER_VARIANT, seed=11)


def test_no_false_failure(results):
    precision, (honest, _) = results
    assert len(honest) == 540
    failed = false_failures(honest)
    assert not failed, failed[:2]


def test_planted_bugs_are_caught(results):
    precision, (_, planted) = results
    shares = caught(planted)
    assert all(len(reports) >= 15 for reports in planted.values()), {b: len(r) for b, r in planted.items()}
    assert all(share >= CAUGHT for share in shares.values()), (precision, shares)
