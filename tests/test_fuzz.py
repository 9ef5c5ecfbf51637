"""Fuzzing every public entry point with odd layouts, empty axes, extreme values and wrong
types: only ValueError / TypeError come out, finite inputs within range give no NaN, and no
input is ever modified."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import numpy_attention as na

# extreme values overflow on purpose: numpy's RuntimeWarnings are expected, errors are not
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DTYPES = [np.float64, np.float32, np.float16, np.int64, np.complex128, np.bool_]
VALUES = st.sampled_from([0.0, 1.0, -2.5, 1e-300, 1e300, -1e300, 3.0e3])


@st.composite
def arrays(draw, min_dims=0, max_dims=5):
    """An array of a random dtype and shape (axes of 0 to 3), values from ordinary to extreme."""
    shape = tuple(draw(st.lists(st.integers(0, 3), min_size=min_dims, max_size=max_dims)))
    dtype = draw(st.sampled_from(DTYPES))
    return _values(draw, shape, dtype)


def _values(draw, shape, dtype):
    x = np.random.default_rng(draw(st.integers(0, 2 ** 16))).standard_normal(shape) * draw(VALUES)
    with np.errstate(over="ignore", invalid="ignore"):       # 1e300 in float16 is inf: extreme on purpose
        return x.astype(dtype) if dtype is not np.bool_ else x > 0


@st.composite
def attention_inputs(draw):
    """(q, k, v, dout) of consistent shapes [..., H, N, d] (axes of 0 to 3, H_kv dividing H), in
    one random dtype, values from ordinary to extreme."""
    lead = tuple(draw(st.lists(st.integers(0, 2), max_size=2)))
    h_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    n_q, n_k, d_k, d_v = (draw(st.integers(0, 3)) for _ in range(4))
    dtype = draw(st.sampled_from(DTYPES[:-1]))
    return tuple(_values(draw, lead + shape, dtype) for shape in
                 ((h_kv * group, n_q, max(d_k, 1)), (h_kv, n_k, max(d_k, 1)), (h_kv, n_k, d_v),
                  (h_kv * group, n_q, d_v)))


WRONG = st.sampled_from([None, "x", [[1.0, 2.0], [3.0]], {"a": 1}, 1.5, object()])
ANY = st.one_of(arrays(), WRONG)
OPTIONS = st.fixed_dictionaries({}, optional={
    "causal": st.sampled_from([True, False, "top_left", "bottom_right", "x", 2]),
    "window": st.sampled_from([(1, 1), (-1, 0), (2**70, -1), (1,), "w"]),
    "scale": st.sampled_from([0.5, 0.0, -1.0, float("nan"), 10 ** 400, "s"]),
    "softcap": st.sampled_from([2.0, 0.0, float("inf")]),
    "fully_masked": st.sampled_from(["zero", "uniform", "nan", "x"]),
    "implementation": st.sampled_from(["textbook", "blocked", "tiled", "fast"]),
    "mask": ANY, "bias": ANY, "sinks": ANY, "alibi_slopes": ANY,
})


def _call(function, *args, **kwargs):
    """function(...) with every array argument checked unchanged; only ValueError / TypeError."""
    copies = [np.copy(a) for a in list(args) + list(kwargs.values()) if isinstance(a, np.ndarray)]
    try:
        result = function(*args, **kwargs)
    except (ValueError, TypeError):
        result = None
    originals = [a for a in list(args) + list(kwargs.values()) if isinstance(a, np.ndarray)]
    for before, after in zip(copies, originals):
        np.testing.assert_array_equal(before, after)
    return result


def _in_range(*xs):
    return all(isinstance(x, np.ndarray) and x.dtype.kind in "fiu" and np.all(np.abs(x) <= 1e3) for x in xs)


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(qkv=st.one_of(attention_inputs(), st.tuples(ANY, ANY, ANY, ANY)), options=OPTIONS)
def test_attention_forward_and_backward(qkv, options):
    q, k, v, dout = qkv
    result = _call(na.attention_forward, q, k, v, **options)
    if result is None:
        return
    out, cache = result
    quiet = options.get("fully_masked", "zero") != "nan" and _in_range(q, k, v)
    if quiet and all(_in_range(options[n]) for n in ("bias", "sinks", "alibi_slopes") if n in options):
        assert not np.isnan(out).any()
    _call(na.attention_backward, dout, cache)


@FUZZ
@given(z=ANY, dp=ANY, x=ANY, W=ANY, b=ANY, h=st.sampled_from([1, 2, 0, -1, "h", 2.0]))
def test_the_ops(z, dp, x, W, b, h):
    for forward, backward, args in ((na.softmax_forward, na.softmax_backward, (z,)),
                                    (na.linear_forward, na.linear_backward, (x, W, b))):
        result = _call(forward, *args)
        if result is not None:
            if _in_range(*args):
                assert not np.isnan(result[0]).any()
            _call(backward, dp, result[1])
    _call(na.softmax_jacobian, z)
    _call(na.logsumexp, z)
    _call(na.split_heads, x, h)
    _call(na.merge_heads, x)
    _call(na.softmax_jvp, z, dp)
    _call(na.linear_jvp, x, W, b, x)


@FUZZ
@given(outs=ANY, lses=ANY, base=st.sampled_from(["e", 2, 10, None]), dout=ANY, dlse=ANY)
def test_combine(outs, lses, base, dout, dlse):
    result = _call(na.combine_forward, outs, lses, base=base)
    if result is not None:
        _call(na.combine_backward, dout, dlse, result[2])


@FUZZ
@given(qkv=st.one_of(attention_inputs(), st.tuples(ANY, ANY, ANY, ANY)), options=OPTIONS)
def test_forward_mode(qkv, options):
    q, k, v, dout = qkv
    _call(na.attention_jvp, q, k, v, q, k, v, **options)
    _call(na.attention_hvp, q, k, v, dout, q, k, v, **{n: x for n, x in options.items() if n != "implementation"})


@FUZZ
@given(query=ANY, d_model=st.sampled_from([4, 0, -2, "d"]), heads=st.sampled_from([2, 3, 0]), dout=ANY)
def test_the_module(query, d_model, heads, dout):
    try:
        mha = na.MultiHeadAttention(d_model, heads)
    except (ValueError, TypeError):
        return
    if _call(mha, query, query, query) is not None:
        _call(mha.backward, dout)
