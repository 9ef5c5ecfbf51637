"""The optional extras some tests need: torch (the cross-checks) and matplotlib (the figures).

Without one, its tests skip and say how to install it; every other test still runs, so
`pip install -e '.[test]' && python3 -m pytest -q` passes on numpy and scipy alone. The
README's test command installs both and runs everything.
"""
import importlib.util

import pytest

TORCH_REASON = "torch is an optional extra: pip install torch==2.13.0"     # pytest.importorskip's reason
MATPLOTLIB_REASON = "matplotlib is an optional extra: pip install 'numpy-attention[plot]'"

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason=MATPLOTLIB_REASON)
JAX_REASON = "jax is an optional extra: pip install 'numpy-attention[jax]'"
