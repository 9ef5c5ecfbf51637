"""The attention variants torch's SDPA lacks, against complex step instead (no torch needed).

Same bound as tests/test_torch_attention.py: relative to the largest entry, <= 1e-12.
"""
import numpy as np
import pytest

from numpy_attention import gradcheck
from numpy_attention.gradcheck_cases import cases

RTOL = 1e-12


@pytest.mark.parametrize("name", ["window", "softcap", "causal bottom_right", "dropout", "sinks", "alibi", "gate"])
def test_variants_torch_lacks_against_complex_step(name):
    forward, backward, inputs, names = cases(np.random.default_rng(7))[name]
    report = gradcheck(forward, backward, inputs, method="complex", rtol=RTOL, names=names)
    assert report, str(report)
