"""Fixtures the test files share.

torch, jax: the optional extras' modules, for a test that names one among its arguments (def
test_x(torch): ...); where the extra is not installed, the test skips with the reason
tests/optional.py gives (how to install it), as pytest.importorskip would. Nothing here imports
an extra before a test asks for it: the suite collects and runs on numpy and scipy alone (the
CI's second leg).

clock: the conformance run's clock, stepped by the test (tests/test_conform*.py).
"""
import itertools

import pytest
from optional import JAX_REASON, TORCH_REASON

from numpy_attention.conformance import run


@pytest.fixture
def torch():
    """The torch module, or the test skips."""
    return pytest.importorskip("torch", reason=TORCH_REASON)


@pytest.fixture
def jax():
    """The jax module (jax.numpy imported with it), or the test skips."""
    return pytest.importorskip("jax", reason=JAX_REASON)


@pytest.fixture
def clock(monkeypatch):
    """The run's clock, one second further at each reading: a budget of n.5 s runs n + 1 cases."""
    ticks = itertools.count()
    monkeypatch.setattr(run, "monotonic", lambda: float(next(ticks)))
