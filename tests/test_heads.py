"""split_heads / merge_heads: each is the other's inverse and the other's backward."""
import numpy as np
import pytest

import numpy_attention as na


def test_split_is_the_seeds_view_and_transpose():
    x = np.random.default_rng(0).standard_normal((2, 5, 12))
    xh = na.split_heads(x, 3)
    assert xh.shape == (2, 3, 5, 4)
    np.testing.assert_array_equal(xh, x.reshape(2, 5, 3, 4).transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(xh[1, 2, 4], x[1, 4, 8:12])     # head 2 = features 8..11


@pytest.mark.parametrize("shape,h", [((2, 5, 12), 3), ((1, 1, 7), 7), ((5, 6), 2), ((2, 3, 4, 6), 1)])
def test_inverse_both_ways(shape, h):
    x = np.random.default_rng(1).standard_normal(shape)
    np.testing.assert_array_equal(na.merge_heads(na.split_heads(x, h)), x)
    xh = na.split_heads(x, h)
    np.testing.assert_array_equal(na.split_heads(na.merge_heads(xh), h), xh)


def test_each_is_the_others_backward():
    """<split(x), y> == <x, merge(y)>: merge is split's adjoint, hence its VJP (and vice versa)."""
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((2, 5, 12)), rng.standard_normal((2, 3, 5, 4))
    assert np.isclose(np.sum(na.split_heads(x, 3) * y), np.sum(x * na.merge_heads(y)), rtol=1e-14)
    split = na.gradcheck(lambda x: (na.split_heads(x, 3), None), lambda d, c: [na.merge_heads(d)],
                         [x], method="complex")
    merge = na.gradcheck(lambda y: (na.merge_heads(y), None), lambda d, c: [na.split_heads(d, 3)],
                         [y], method="complex")
    assert split and merge


def test_fresh_arrays():
    x = np.random.default_rng(3).standard_normal((2, 5, 12))
    assert not np.shares_memory(na.split_heads(x, 3), x)
    xh = na.split_heads(x, 3)
    assert not np.shares_memory(na.merge_heads(xh), xh)


def test_indivisible_width_is_a_clear_error():
    with pytest.raises(ValueError, match=r"num_heads=5.*|.*divisible"):
        na.split_heads(np.zeros((2, 3, 12)), 5)
