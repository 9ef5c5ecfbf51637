"""The optional extras some tests need: torch (the cross-checks), jax (its forward mode),
mlx (its arrays and its SDPA kernel), matplotlib (the figures), dask.distributed (the cluster),
triton (a FlashAttention kernel of the tests', run by Triton's CPU interpreter) and learn (the
tutorial notebook: JupyterLab, nbclient, ipykernel, matplotlib).

Without one, its tests skip and say how to install it (the reasons below; a test that takes
tests/conftest.py's torch or jax fixture skips with them too); every other test still runs, so
`pip install '.[test]' && python3 -m pytest -q` passes on numpy and scipy alone (.ci/run's
second leg runs exactly that). The README's test command installs them all and runs everything.
"""
import importlib.util

import pytest

TORCH_REASON = "torch is an optional extra: pip install torch==2.13.0"     # pytest.importorskip's reason
MATPLOTLIB_REASON = "matplotlib is an optional extra: pip install 'numpy-attention[plot]'"
JAX_REASON = "jax is an optional extra: pip install 'numpy-attention[jax]'"
MLX_REASON = "mlx is an optional extra: pip install 'numpy-attention[mlx]' (on Linux its CPU build, mlx[cpu])"
DASK_REASON = "dask.distributed is an optional extra: pip install 'numpy-attention[dask]'"
TRITON_REASON = "triton is an optional extra of the tests: pip install 'numpy-attention[triton]'"
LEARN_REASON = ("the tutorial notebook runs with the optional extra `learn` (JupyterLab, nbclient, "
                "ipykernel, matplotlib): pip install 'numpy-attention[learn]'")

needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason=MATPLOTLIB_REASON)
