"""Every tensor argument takes the 16- and 8-bit floats NumPy lacks, as ml_dtypes arrays and as
torch tensors, wherever it takes float32: the same result as the float32 values it holds
(bias, mask, sinks, alibi_slopes, dropout_mask in attention_forward; bias in crosscheck)."""
import ml_dtypes
import numpy as np
import pytest

import numpy_attention as na

RNG = np.random.default_rng(8)
Q, K, V = (RNG.standard_normal((1, 2, 5, 4)) for _ in range(3))
OPTIONS = {"bias": RNG.standard_normal((2, 5, 5)), "mask": RNG.random((5, 5)) < 0.7,
           "sinks": RNG.standard_normal(2), "alibi_slopes": RNG.uniform(0, 1, 2)}


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.float16])
@pytest.mark.parametrize("name", OPTIONS)
def test_an_option_in_a_low_precision_is_its_float32_values(name, dtype):
    value = OPTIONS[name].astype(dtype)
    out, _ = na.attention_forward(Q, K, V, **{name: value})
    want, _ = na.attention_forward(Q, K, V, **{name: value.astype(np.float32)})
    assert np.array_equal(out, want)


def test_a_dropout_mask_in_bfloat16():
    keep = RNG.random((1, 2, 5, 5)) < 0.8
    out, _ = na.attention_forward(Q, K, V, dropout_mask=keep.astype(ml_dtypes.bfloat16), dropout_p=0.2)
    want, _ = na.attention_forward(Q, K, V, dropout_mask=keep, dropout_p=0.2)
    assert np.array_equal(out, want)


def test_torch_bfloat16_tensors_as_options(torch):
    for name, value in OPTIONS.items():
        tensor = torch.from_numpy(np.asarray(value, np.float32)).to(torch.bfloat16)
        out, _ = na.attention_forward(Q, K, V, **{name: tensor})
        want, _ = na.attention_forward(Q, K, V, **{name: tensor.float().numpy()})
        assert np.array_equal(out, want), name


def test_an_integer_like_ml_dtype_is_refused():
    with pytest.raises(TypeError, match="bias"):
        na.attention_forward(Q, K, V, bias=np.zeros((5, 5), ml_dtypes.int4))
