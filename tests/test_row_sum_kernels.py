"""tests/row_sum_kernels.py, the kernel benchmarks/row_sum_bf16.py measures: its float32 row sum
(the control) is an honest kernel, and its row sum added key by key in bfloat16 over long rows
fails crosscheck, while the sum once per block of 128 keys hides within bfloat16's rounding."""
import numpy as np
import pytest
from optional import TORCH_REASON

torch = pytest.importorskip("torch", reason=TORCH_REASON)
import real_kernels as rk  # noqa: E402  (needs torch)
import row_sum_kernels as rs  # noqa: E402

from numpy_attention import crosscheck  # noqa: E402
from numpy_attention._checks import to_numpy  # noqa: E402


def judged(case, variant, kernel="flash_lse"):
    results = rs.row_sum_attention(case, kernel, variant)
    arrays = {n: x for n, x in case.items() if not n.startswith("_")}
    return crosscheck(**arrays, **{n: np.array(to_numpy(x, n)) for n, x in results.items()})


def test_the_control_passes_and_the_key_by_key_bfloat16_sum_fails_on_long_rows():
    rng = np.random.default_rng(4)
    case = rk.random_case(rng, "bfloat16", "plain", "flash_lse", rk.Layout(1, 2, 2, 16, 1024, 64, ()))
    for variant in rs.VARIANTS:
        assert judged(case, variant + "_f32"), variant
    assert not judged(case, "ltr")
    report = judged(case, "online128")
    assert report.rows[0].ratio <= 1, str(report)             # out within the honest baseline's error
