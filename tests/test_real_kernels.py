"""crosscheck on real attention kernels nobody here wrote (tests/real_kernels.py): torch SDPA's
math and flash backends, torch's CPU flash op with its lse, flex_attention eager and compiled,
JAX's dot_product_attention (xla) and MLX's fast SDPA, in float16, bfloat16 and float32, on
FlashAttention-test-style shapes (lengths 1 to 2048 with N_q != N_k, grouped-query heads, head
widths 32 / 64 / 128) with causal masks in both alignments, key padding, random masks, biases,
windows, softcap, ALiBi, custom scales, and decoding (one query row, or one key).

Honest results must all pass (0 false failures in every kernel and precision; a failure's
arrays and report are saved to real_kernels.FAILURES_DIR); a planted bug must fail in >= 95% of
the cases where it changes the exact result, in each precision. Each campaign runs once per
session: 50-85 s in all on a shared 2-core machine, of it torch.compile's flex_attention 4 s
with a warm inductor cache (23 s cold) and JAX's jit some 10 s.
"""
import importlib.util

import numpy as np
import pytest
from optional import JAX_REASON, MLX_REASON, TORCH_REASON

torch = pytest.importorskip("torch", reason=TORCH_REASON)   # the float64 reference of FA's rule
import real_kernels as rk  # noqa: E402  (needs torch)

from numpy_attention import crosscheck  # noqa: E402

LIBRARIES = {"torch": ("torch", TORCH_REASON), "jax": ("jax", JAX_REASON), "mlx": ("mlx.core", MLX_REASON)}
# cases per kernel and precision: compiling kernels fewer (JAX's float16 runs eager, its first call
# of a shape taking seconds; torch.compile takes 5-15 s per dtype: bfloat16 only here, all three
# in benchmarks/real_kernels.py)
CASES = {"sdpa_math": dict.fromkeys(rk.PRECISIONS, 60), "sdpa_flash": dict.fromkeys(rk.PRECISIONS, 60),
         "flash_lse": dict.fromkeys(rk.PRECISIONS, 50), "flex": dict.fromkeys(rk.PRECISIONS, 60),
         "flex_compiled": {"bfloat16": 12},
         "jax_xla": {"float16": 10, "bfloat16": 30, "float32": 40},
         "mlx_sdpa": dict.fromkeys(rk.PRECISIONS, 74)}
PLANT_EVERY = 2                 # a bug in every other case (benchmarks/real_kernels.py: every bug in each)
# one case with a length of 1024 or 2048 per kernel, in one precision each
LARGE = {("sdpa_math", "float32"), ("sdpa_flash", "bfloat16"), ("flash_lse", "float16"), ("flex", "float16"),
         ("jax_xla", "bfloat16"), ("mlx_sdpa", "float32")}
PAIRS = [(kernel, precision) for kernel, by in CASES.items() for precision in by]
SEED = 20
CAUGHT = 0.95
_CAMPAIGNS = {}


def installed(kernel):
    """Whether the kernel's library is installed."""
    return importlib.util.find_spec(LIBRARIES[rk.KERNELS[kernel].library][0]) is not None


def campaign_of(kernel, precision):
    """The kernel's campaign in `precision`, run once per session; skipped (naming the extra to
    install) where the kernel's library is not installed."""
    module, reason = LIBRARIES[rk.KERNELS[kernel].library]
    pytest.importorskip(module, reason=reason)
    if (kernel, precision) not in _CAMPAIGNS:
        torch.set_num_threads(1)                # the kernels' results do not depend on it; time does
        _CAMPAIGNS[kernel, precision] = rk.campaign(
            kernel, precision, CASES[kernel][precision], seed=SEED + PAIRS.index((kernel, precision)),
            large=int((kernel, precision) in LARGE), plant_large=False,
            plant_every=PLANT_EVERY)
    return _CAMPAIGNS[kernel, precision]


@pytest.mark.slow
@pytest.mark.parametrize("kernel, precision", PAIRS)
def test_no_false_failure(kernel, precision):
    """Every honest result of the kernel passes crosscheck (a failure's arrays are saved)."""
    result = campaign_of(kernel, precision)
    assert len(result.honest) == CASES[kernel][precision] + ((kernel, precision) in LARGE)
    failed = rk.false_failures(result.honest)
    saved = rk.save_failures(result.honest) if failed else []
    assert not failed, (f"{len(failed)} of {len(result.honest)} honest {kernel} {precision} results "
                        f"failed (saved: {', '.join(saved)}); the first, {failed[0].variant} "
                        f"{failed[0].layout}:\n{failed[0].report}")


@pytest.mark.slow
@pytest.mark.parametrize("precision", rk.PRECISIONS)
def test_planted_bugs_are_caught(precision):
    """Each planted bug fails crosscheck in >= 95% of the cases where it changes the result, over
    the kernels that show it in `precision` (a kernel's own few cases of a bug, 1 to 10 here,
    are too few for a share: benchmarks/real_kernels.py gives each kernel's)."""
    by_bug = {}
    for kernel in CASES:
        if precision in CASES[kernel] and installed(kernel):
            for bug, outcomes in campaign_of(kernel, precision).planted.items():
                n, caught, _ = rk.shares(outcomes)
                by_bug.setdefault(bug, {})[kernel] = (n, caught)
    missed = {bug: kernels for bug, kernels in by_bug.items()
              if sum(c for _, c in kernels.values()) < CAUGHT * sum(n for n, _ in kernels.values())}
    assert not missed, f"{precision}: bug: {{kernel: (cases, caught)}} {missed}"


@pytest.mark.slow
@pytest.mark.parametrize("kernel", list(CASES))
def test_every_bug_a_kernel_can_show_is_planted(kernel):
    """Each of the kernel's bugs (Kernel.bugs) is planted in some case of its campaigns."""
    planted = {bug for precision in CASES[kernel] for bug, outcomes in
               campaign_of(kernel, precision).planted.items() if outcomes}
    assert planted == set(rk.KERNELS[kernel].bugs), planted


@pytest.mark.slow
def test_the_campaigns_hold_a_thousand_cases_and_two_hundred_decoding_ones():
    """Over every kernel and precision: >= 1000 honest cases, >= 200 of them decoding (one query
    row) or with a single key; each kernel has a case with a length of 1024 or 2048."""
    for module, reason in LIBRARIES.values():
        pytest.importorskip(module, reason=reason)
    honest = [o for pair in PAIRS for o in campaign_of(*pair).honest]
    decoding = [o for o in honest if o.layout.n_q == 1 or o.layout.n_k == 1]
    assert len(honest) >= 1000 and len(decoding) >= 200, (len(honest), len(decoding))
    long = {o.kernel for o in honest if max(o.layout.n_q, o.layout.n_k) >= 1024 and o.layout.n_q > 1}
    assert long >= {kernel for kernel, _ in LARGE}, long


@pytest.mark.parametrize("kernel", ["sdpa_math", "sdpa_flash", "flash_lse", "flex", "mlx_sdpa"])
def test_the_float64_reference_of_flashattentions_rule_is_the_oracle(kernel):
    """reference64 (torch float64, FlashAttention's attention_ref) gives crosscheck's max abs
    errors to 1e-9 of the tensors' size, on a case of each of the kernel's variants in
    bfloat16: the two rules measure one error. (Every convention the kernels have is among
    these: top-left windows, rows with no key averaging v, ALiBi as slopes and as a bias; JAX's
    variants, each a compile, add none.)"""
    module, reason = LIBRARIES[rk.KERNELS[kernel].library]
    pytest.importorskip(module, reason=reason)
    torch.set_num_threads(1)
    rng = np.random.default_rng(7)
    for variant in rk.KERNELS[kernel].variants:
        case = rk.random_case(rng, "bfloat16", variant, kernel, rk.random_layout(rng, variant, kernel))
        arrays = rk.run(case, kernel)
        ref, report = rk.reference64(arrays), crosscheck(**arrays)
        for row in report.rows:
            with np.errstate(invalid="ignore"):             # -inf - -inf: rows with no key, left out
                err = np.max(np.abs(np.asarray(arrays[row.name]).astype(np.float64) - ref[row.name]),
                             initial=0.0, where=np.isfinite(ref[row.name]))
            size = np.max(np.abs(ref[row.name]), initial=1.0, where=np.isfinite(ref[row.name]))
            assert abs(err - row.max_abs_err) <= 1e-9 * size, (variant, row.name, err, row.max_abs_err)


@pytest.mark.slow
def test_flex_eager_without_its_dynamo_trace_gives_the_same_bits():
    """The campaigns run eager flex_attention's decomposition without the dynamo trace that
    wraps every eager call (real_kernels._flex, traced=False: 70x faster): on cases of its
    masks and score_mods in the three precisions, the bits of the traced call."""
    torch.set_num_threads(1)
    rng = np.random.default_rng(8)
    variants = ("padding", "bias", "causal", "bottom_right", "softcap_window", "alibi", "scale", "decode")
    for index, variant in enumerate(variants):
        precision = rk.PRECISIONS[index % 3]
        case = rk.random_case(rng, precision, variant, "flex", rk.random_layout(rng, variant, "flex"))
        fast, traced = rk.run(case, "flex"), rk.run(case, "flex_traced")
        bits = lambda x: np.ascontiguousarray(x).view(np.uint8)
        for name in ("out", "lse"):
            assert np.array_equal(bits(fast[name]), bits(traced[name])), (precision, variant, name)


def test_jax_jits_no_float16_attention_on_cpu_so_its_campaign_runs_eager(jax):
    """jax_xla runs eager in float16 (real_kernels._jax_attention): jitted, JAX 0.10.2's
    dot_product_attention raises on CPU for its F16_F16_F32 dot precision. Where a JAX compiles
    it, this test fails: its float16 campaign can then be jitted like the others."""
    q = jax.numpy.zeros((1, 3, 2, 8), jax.numpy.float16)
    attention = jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="xla"))
    with pytest.raises(ValueError, match="F16_F16_F32"):
        attention(q)
