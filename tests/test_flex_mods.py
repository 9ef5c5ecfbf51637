"""crosscheck judges torch's flex_attention given the same score_mod and mask_mod: honest
float32 and bfloat16 results pass, each planted bug fails (tests/flex_mods.py; its sweep of
300 cases a dtype runs by hand: python3 tests/flex_mods.py)."""
import pytest
from optional import TORCH_REASON

pytest.importorskip("torch", reason=TORCH_REASON)
import flex_mods  # noqa: E402

CASES = 20                                                  # per dtype: each variant 4 times


@pytest.fixture(scope="module")
def counts():
    return flex_mods.sweep(CASES, seed=1)


@pytest.mark.parametrize("dtype", flex_mods.DTYPES)
def test_honest_flex_attention_passes(counts, dtype):
    judged, failed = counts[(dtype, "honest")]
    assert judged == CASES and failed == 0


@pytest.mark.parametrize("bug", sorted(set(flex_mods.BUGS.values())))
@pytest.mark.parametrize("dtype", flex_mods.DTYPES)
def test_each_planted_bug_is_caught(counts, dtype, bug):
    judged, failed = counts[(dtype, bug)]
    assert judged > 0 and failed >= 0.95 * judged, (judged, failed)

