"""MLX arrays wherever torch tensors are taken (_checks.to_numpy): float32, float16 and bfloat16
(which NumPy lacks: read as ml_dtypes arrays, exactly) as q, k, v, the candidates and the
options, bool and integer masks; the same reports and results as the same values in NumPy /
ml_dtypes arrays. And MLX's own kernel, mx.fast.scaled_dot_product_attention, judged honest in
float32, and its 16-bit forward the recipe's MLX way (tests/test_real_kernels.py judges it in
every dtype, with gradients).
"""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from optional import MLX_REASON

import numpy_attention as na
from numpy_attention import _checks

mx = pytest.importorskip("mlx.core", reason=MLX_REASON)      # every test here needs it: skip the file

DTYPES = {"float32": (mx.float32, np.float32), "float16": (mx.float16, np.float16),
          "bfloat16": (mx.bfloat16, ml_dtypes.bfloat16)}
RNG = np.random.default_rng(11)
Q, K, V, DOUT = (RNG.standard_normal(shape) for shape in [(2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8),
                                                             (2, 2, 5, 8)])


def both(x, dtype):
    """x in `dtype` as an MLX array and as the NumPy / ml_dtypes array of the same values."""
    mx_dtype, np_dtype = DTYPES[dtype]
    values = np.asarray(x, np.float32).astype(np_dtype)
    return mx.array(values.astype(np.float32)).astype(mx_dtype), values


def test_an_mlx_bfloat16_array_is_read_exactly_and_read_only():
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, 3.0e38, 1 / 3], np.float32)
    x_mx, x_np = both(np.concatenate([special, RNG.standard_normal(57).astype(np.float32)]), "bfloat16")
    got = _checks.to_numpy(x_mx.reshape(8, 8).T, "x")             # a transposed (strided) view too
    assert got.dtype == ml_dtypes.bfloat16 and not got.flags.writeable
    assert np.array_equal(got.view(np.uint16), x_np.reshape(8, 8).T.view(np.uint16))    # bit for bit
    shared = _checks.to_numpy(mx.array(np.ones(3, np.float32)), "x")
    assert shared.dtype == np.float32 and not shared.flags.writeable   # MLX's memory: never written


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlx_candidates_and_options_give_the_numpy_report(dtype):
    """q, k, v, dout, the candidates out, dq, dk, dv and the options bias (float, in `dtype`) and
    mask (bool) as MLX arrays: the report of the same values as NumPy / ml_dtypes arrays."""
    keep = RNG.random((5, 7)) < 0.8
    keep[:, 0] = True
    inputs = {"q": Q, "k": K, "v": V, "dout": DOUT, "bias": 0.5 * RNG.standard_normal((2, 5, 7))}
    pairs = {name: both(x, dtype) for name, x in inputs.items()}
    exact = {name: np.asarray(p[1], np.float64) for name, p in pairs.items()}
    out, cache = na.attention_forward(exact["q"], exact["k"], exact["v"], bias=exact["bias"], mask=keep)
    dq, dk, dv = na.attention_backward(exact["dout"], cache)[:3]
    pairs.update({name: both(x, dtype) for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))})
    from_mlx = na.crosscheck(**{n: p[0] for n, p in pairs.items()}, mask=mx.array(keep))
    from_numpy = na.crosscheck(**{n: p[1] for n, p in pairs.items()}, mask=keep)
    assert str(from_mlx) == str(from_numpy)
    assert from_mlx, str(from_mlx)                   # the oracle's values rounded to `dtype`: honest
    assert [row.dtype for row in from_mlx.rows] == [dtype] * 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_mlx_inputs_and_options_in_attention_forward(dtype):
    options = {"bias": RNG.standard_normal((2, 5, 7)), "sinks": RNG.standard_normal(2),
               "alibi_slopes": RNG.uniform(0, 1, 2)}
    for name, value in options.items():
        value_mx, value_np = both(value, dtype)
        out, _ = na.attention_forward(Q, K, V, **{name: value_mx})
        want, _ = na.attention_forward(Q, K, V, **{name: value_np})
        assert np.array_equal(out, want), name
    qkv = [both(x, dtype) for x in (Q, K, V)]
    out, _ = na.attention_forward(*(p[0] for p in qkv))
    want, _ = na.attention_forward(*(p[1] for p in qkv))
    assert out.dtype == want.dtype == np.float32 and np.array_equal(out, want)
    keep = RNG.random((1, 2, 5, 7)) < 0.8
    for mask in (mx.array(keep), mx.array(keep.astype(np.int32)), both(keep, dtype)[0]):
        out, _ = na.attention_forward(Q, K, V, mask=mask)
        assert np.array_equal(out, na.attention_forward(Q, K, V, mask=keep)[0]), mask.dtype
    dropout_mx, _ = both(RNG.random((2, 2, 5, 7)) < 0.9, dtype)
    out, _ = na.attention_forward(Q, K, V, dropout_mask=dropout_mx, dropout_p=0.1)
    want, _ = na.attention_forward(Q, K, V, dropout_mask=np.asarray(dropout_mx.astype(mx.float32)) != 0,
                                   dropout_p=0.1)
    assert np.array_equal(out, want)


def test_an_mlx_dtype_with_no_numpy_reading_is_a_type_error_naming_it(monkeypatch):
    """Every dtype of today's MLX has a reading; one a later MLX adds (an MLX float8, say) is
    refused, not read as its bits: here float16, its reading taken away."""
    monkeypatch.delitem(_checks._MLX_DTYPES, "float16")
    x = mx.zeros((2, 2, 5, 8), dtype=mx.float16)
    with pytest.raises(TypeError, match=r"q is an MLX array of dtype float16 with shape \(2, 2, 5, 8\)"):
        na.attention_forward(x, K, V)
    with pytest.raises(TypeError, match=r"mask is an MLX array of dtype float16 with shape \(5, 7\)"):
        na.attention_forward(Q, K, V, mask=mx.ones((5, 7), dtype=mx.float16))
    with pytest.raises(TypeError, match="dtype float16 with shape"):
        na.crosscheck(q=x, k=K, v=V, out=np.zeros((2, 2, 5, 8)))


def test_an_mlx_array_of_a_refused_dtype_is_refused_as_numpys_is():
    with pytest.raises(TypeError, match=r"q must be a numeric .* got dtype bool with shape \(2, 2, 5, 8\)"):
        na.attention_forward(mx.array(Q > 0), K, V)
    with pytest.raises(TypeError, match="mask must be a bool, integer or float array.* got dtype complex64"):
        na.attention_forward(Q, K, V, mask=mx.ones((5, 7), dtype=mx.complex64))


def test_mlx_is_never_imported_by_the_package():
    code = ("import sys, numpy as np, numpy_attention as na\n"
            "x = np.ones((1, 1, 3, 4))\n"
            "na.crosscheck(q=x, k=x, v=x, out=na.attention_forward(x, x, x)[0])\n"
            "assert 'mlx' not in sys.modules and 'mlx.core' not in sys.modules, 'mlx imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- MLX's own kernel

def mlx_sdpa_case(rng, variant, dtype=mx.float32):
    """A random case and mx.fast.scaled_dot_product_attention's out, dq, dk, dv for it (mx.vjp),
    as MLX arrays: the .npz keys, MLX's conventions (causal: bottom-right aligned)."""
    b, h_kv, g = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.choice([1, 2]))
    n_k = int(rng.integers(2, 40))
    n_q = int(rng.integers(1, n_k + 1))                   # a causal row always sees a key
    d = int(rng.choice([8, 32, 64]))                      # MLX's SDPA: d_k = d_v
    shapes = {"q": (b, h_kv * g, n_q, d), "k": (b, h_kv, n_k, d), "v": (b, h_kv, n_k, d),
              "dout": (b, h_kv * g, n_q, d)}
    arrays = {n: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype) for n, s in shapes.items()}
    scale, kw = float(d ** -0.5), {}
    if variant == "causal":
        kw["mask"], arrays["causal"] = "causal", "bottom_right"
    elif variant == "mask":
        keep = rng.random((b, 1, n_q, n_k)) < 0.7
        keep[..., 0] = True
        kw["mask"] = arrays["mask"] = mx.array(keep)
    elif variant == "bias":
        kw["mask"] = arrays["bias"] = mx.array(rng.standard_normal((n_q, n_k)).astype(np.float32)).astype(dtype)
    elif variant == "scale":
        scale = arrays["scale"] = float(rng.uniform(0.1, 2.0) / np.sqrt(d))

    def sdpa(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, **kw)

    (out,), (dq, dk, dv) = mx.vjp(sdpa, [arrays["q"], arrays["k"], arrays["v"]], [arrays["dout"]])
    arrays.update(out=out, dq=dq, dk=dk, dv=dv)
    return arrays


@pytest.mark.parametrize("variant", ["plain", "causal", "mask", "bias", "scale"])
def test_mlx_float32_sdpa_passes(variant):
    rng = np.random.default_rng(["plain", "causal", "mask", "bias", "scale"].index(variant))
    for _ in range(4):
        report = na.crosscheck(**mlx_sdpa_case(rng, variant))
        assert report, str(report)
        assert {row.name for row in report.rows} == {"out", "dq", "dk", "dv"}


def test_mlx_causal_is_bottom_right_and_crosscheck_tells_it():
    """A case with N_q < N_k: MLX's "causal" judged as top-left fails; as bottom-right, passes."""
    arrays = mlx_sdpa_case(np.random.default_rng(7), "causal")
    while arrays["q"].shape[2] == arrays["k"].shape[2]:
        arrays = mlx_sdpa_case(np.random.default_rng(arrays["k"].shape[2]), "causal")
    assert na.crosscheck(**arrays)
    assert not na.crosscheck(**{**arrays, "causal": "top_left"})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_recipes_mlx_way_is_mlxs_forward(dtype):
    """MLX's CPU kernel in 16 bits: the scale rounded to the dtype times q, S = round(q' k^T),
    the softmax in float32 rounded, out = round(P v): recipe_attention(..., mlx=True)'s out,
    bit for bit with the scale 1/sqrt(d); with a custom one, all but a few entries (< 1%, by
    one ulp: float32 sums taken in another order). The recipe's other ways differ in half."""
    from numpy_attention.oracle.precision import PRECISIONS
    from numpy_attention.oracle.recipe import recipe_attention
    precision, rng = PRECISIONS[dtype], np.random.default_rng(3)
    for scale in (None, 0.1234567):
        pairs = [both(rng.standard_normal(shape), dtype) for shape in ((1, 2, 16, 40), (1, 2, 24, 40),
                                                                       (1, 2, 24, 40))]
        out = mx.fast.scaled_dot_product_attention(*(x for x, _ in pairs),
                                                   scale=scale if scale else 40 ** -0.5)
        out = np.array(out.astype(mx.float32))
        q, k, v, record = na.attention_options(*(values.astype(np.float32) for _, values in pairs),
                                               scale=scale)
        ours, other = (recipe_attention(q, k, v, record, precision, mlx=mlx)["out"] for mlx in (True, False))
        ulp = np.abs(out) * float(ml_dtypes.finfo(precision.storage).eps)
        assert np.mean(ours != out) <= (0 if scale is None else 0.01)
        assert np.all(np.abs(ours - out) <= ulp) and np.mean(other != out) > 0.3
