"""crosscheck judges torch's flex_attention given the same score_mod and mask_mod: honest
float32 and bfloat16 results pass, each planted bug fails, eager and compiled
(tests/flex_mods.py; its sweeps of 300 cases a dtype run by hand: benchmarks/flex_mods.py)."""
import pytest
from optional import TORCH_REASON

pytest.importorskip("torch", reason=TORCH_REASON)
import flex_mods  # noqa: E402

pytestmark = pytest.mark.slow                               # every test here judges a sweep
CASES = 20                                                  # per dtype: each variant 4 times
COMPILED_CASES = 5                                          # bfloat16: each variant once (a compile each)


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



@pytest.fixture(scope="module")
def compiled_counts():
    return flex_mods.sweep(COMPILED_CASES, seed=1, compiled=True, dtypes=("bfloat16",))


def test_compiled_flex_attention_passes_honest_and_fails_each_bug(compiled_counts):
    """torch.compile's flex_attention (its own CPU kernel, out alone): every honest case passes,
    every planted bug fails."""
    assert compiled_counts[("bfloat16", "honest")] == (COMPILED_CASES, 0)
    bugs = {what: counts for (_, what), counts in compiled_counts.items() if what != "honest"}
    assert set(bugs) == set(flex_mods.BUGS.values())
    assert all(judged > 0 and failed == judged for judged, failed in bugs.values()), bugs
