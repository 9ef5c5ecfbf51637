"""One comparison for the tests that hold two engines' results against each other."""
import numpy as np


def assert_normwise_equal(spec, got, rtol):
    """Each array of `got` equals spec's array of the same name: same shape and dtype, NaN and
    -inf in the same places, and the finite entries within rtol * max|spec| (normwise).
    A name whose spec is None must be None in `got` too."""
    for name, b in spec.items():
        a = got[name]
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
        np.testing.assert_array_equal(np.isneginf(a.real), np.isneginf(b.real), err_msg=name)
        finite = np.isfinite(b)
        scale = max(np.max(np.abs(b[finite]), initial=0.0), 1e-300)
        assert np.max(np.abs(a[finite] - b[finite]), initial=0.0) <= rtol * scale, name
