"""The one table of options (options.OPTIONS): attention_forward's signature and docstring, the
record's `given`, the case reader's keys, the oracle's slices, conform's gradients and the tiled
engine's refusals all follow its rows."""
import inspect
import pathlib
import re

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.caches import AttentionGrads
from numpy_attention.conformance import supports
from numpy_attention.conformance.kernels import GRADIENT_OF
from numpy_attention.forward_mode import OPTION_TANGENTS
from numpy_attention.options import OPTIONS, attention_options, untiled
from numpy_attention.oracle import schema, slices
from numpy_attention.oracle.magnitudes import TERMS

NAMES = [row.name for row in OPTIONS]
OWN = ["implementation", "block_size", "workers", "scheduler", "page_table", "cache_seqlens", "rope"]


def test_attention_forwards_keywords_are_the_rows_and_its_own():
    params = inspect.signature(na.attention_forward).parameters
    assert list(params) == ["q", "k", "v"] + NAMES + OWN + ["keep_steps"]
    for row in OPTIONS:
        assert params[row.name].default == row.default
        assert f"\n        {row.name}: " in na.attention_forward.__doc__
    assert "{options}" not in na.attention_forward.__doc__


def test_the_rows_are_unique_and_their_columns_take_known_values():
    assert len(set(NAMES)) == len(NAMES)
    for row in OPTIONS:
        assert row.acts in ("score", "keep", "row", "output", "input"), row
        assert row.case in (None, "array", "float", "mask", "causal", "align", "pair", "positive",
                            "probability", "policy"), row
        assert row.shape in (None, "scores", "heads", "output"), row
        assert row.gradient is None or row.gradient in AttentionGrads._fields, row
        assert not row.neginf or row.case == "float", row
        assert not row.batched or row.shape == "heads", row


def test_the_case_reader_and_the_oracle_take_their_lists_from_the_rows():
    assert [name for name in schema.OPTIONS if name in NAMES] == [row.name for row in OPTIONS if row.case]
    assert set(schema.FLOAT_OPTIONS) == {row.name for row in OPTIONS if row.case == "float"}
    for row in OPTIONS:
        if row.gradient:
            assert row.gradient in schema.GRADIENTS and row.gradient in schema.CANDIDATES
            assert GRADIENT_OF[row.name] == row.gradient and row.name in slices.SUMMED
        assert (row.name in slices.BY_HEAD) == (row.shape == "heads")
        assert (row.name in slices.BY_SCORE) == (row.shape in ("scores", "output"))


def test_given_names_the_options_set_to_other_than_their_default():
    q = np.ones((2, 3, 4))
    assert attention_options(q, q, q)[3].given == frozenset()
    assert attention_options(q, q, q, softcap=None, dropout_p=0.0, causal=False)[3].given == frozenset()
    o = attention_options(q, q, q, softcap=2.0, causal=True, bias=np.zeros(3), fully_masked="nan")[3]
    assert o.given == {"softcap", "causal", "bias", "fully_masked"}


VALUES = {"softcap": 2.0, "dropout_mask": np.ones((3, 3), bool)}


@pytest.mark.parametrize("name", [row.name for row in OPTIONS if not row.tiled])
def test_the_tiled_engine_refuses_by_name_each_option_it_lacks(name):
    q = np.ones((2, 3, 4))
    assert untiled({name}) == [name]
    with pytest.raises(ValueError, match=f"the tiled engine .* does not support {name}"):
        na.attention_forward(q, q, q, implementation="tiled", **{name: VALUES[name]})
    na.attention_forward(q, q, q, implementation="blocked", **{name: VALUES[name]})


def test_an_unknown_keyword_is_refused_with_the_closest_name():
    q = np.ones((2, 3, 4))
    with pytest.raises(TypeError, match="unexpected keyword argument 'softcapp'.*softcap"):
        na.attention_forward(q, q, q, softcapp=2.0)


def test_conforms_options_and_their_other_names_come_from_the_rows():
    named = [row.conform for row in OPTIONS if row.conform]
    assert [name for name in supports.OPTIONS if name in named] == named
    for row in OPTIONS:
        if row.conform and row.conform != row.name:        # the keyword is a near miss of its name
            with pytest.raises(ValueError, match=f"'{row.conform}'"):
                supports.check_supports((row.name,), "zero")


@pytest.mark.parametrize("row", [row for row in OPTIONS if row.case == "float"], ids=lambda row: row.name)
def test_check_finite_allows_minus_infinity_where_the_row_says_so(row):
    """bias and sinks may hold -inf (a masked score, no sink); ALiBi's slopes may not; none NaN."""
    q = np.ones((1, 2, 3, 4))
    value = lambda x: np.full({"heads": (2,), "output": (3, 1), "scores": (3, 3)}[row.shape], x)
    na.attention_forward(q, q, q, check_finite=True, **{row.name: value(0.0)})
    with pytest.raises(ValueError, match=f"{row.name} .* non-finite"):
        na.attention_forward(q, q, q, check_finite=True, **{row.name: value(np.nan)})
    if row.neginf:
        na.attention_forward(q, q, q, check_finite=True, **{row.name: value(-np.inf)})
    else:
        with pytest.raises(ValueError, match=f"{row.name} .* non-finite"):
            na.attention_forward(q, q, q, check_finite=True, **{row.name: value(-np.inf)})


@pytest.mark.parametrize("row", [row for row in OPTIONS if row.shape == "heads"], ids=lambda row: row.name)
def test_a_per_head_vector_takes_a_batch_axis_where_the_row_says_so(row):
    q = np.ones((3, 2, 4, 4))
    na.attention_forward(q, q, q, **{row.name: np.zeros(2)})
    if row.batched:
        na.attention_forward(q, q, q, **{row.name: np.zeros((3, 2))})
    else:
        with pytest.raises(ValueError, match=rf"{row.name} must have shape \(2,\) \(\[H\] for q \(3, 2, 4, 4\)\)"):
            na.attention_forward(q, q, q, **{row.name: np.zeros((3, 2))})


BAD = {"pair": (-2, 0), "positive": -1.0, "probability": 1.5}


def test_an_option_of_one_value_has_its_rows_check():
    for row in OPTIONS:
        assert (row.check is not None) == (row.case in BAD), row


@pytest.mark.parametrize("row", [row for row in OPTIONS if row.check], ids=lambda row: row.name)
def test_a_call_and_a_case_refuse_a_bad_value_by_the_rows_check(row):
    q = np.ones((2, 3, 4))
    with pytest.raises(ValueError, match=f"^{row.name} must be"):
        attention_options(q, q, q, **{row.name: BAD[row.case]})
    with pytest.raises(schema.CaseError, match=f"^{row.name} must be"):
        schema.decode_options({row.name: np.array(BAD[row.case])})


def test_the_gradient_records_and_the_forward_mode_tangents_come_from_the_rows():
    gradients = tuple(row.gradient for row in OPTIONS if row.gradient)
    assert AttentionGrads._fields == ("dq", "dk", "dv") + gradients + ("dscore_mod_params", "stages")
    assert na.MlaGrads._fields == ("dq", "dkv") + gradients
    assert list(OPTION_TANGENTS) == [f"{row.name}_dot" for row in OPTIONS if row.gradient]
    params = inspect.signature(na.attention_jvp).parameters
    assert list(params) == ["q", "k", "v", "q_dot", "k_dot", "v_dot"] + list(OPTION_TANGENTS) + ["options"]
    for row in OPTIONS:                        # a per-head vector's gradient has a bound of its terms
        assert (row.term in TERMS) == (row.shape == "heads" and row.gradient is not None), row.name
    q = np.ones((2, 3, 4))
    with pytest.raises(TypeError, match="unexpected keyword argument 'bias_dott'"):
        na.attention_jvp(q, q, q, bias_dott=np.ones((3, 3)))


def test_the_case_formats_and_conforms_docstrings_list_the_rows():
    for row in OPTIONS:
        assert (f"\n                {row.name} " in schema.__doc__) == (row.case is not None), row.name
        if row.conform:
            assert re.search(rf"\n +{row.conform} +{row.name}=\n", supports.__doc__), row.name
    assert "{options}" not in schema.__doc__ and "{table}" not in supports.__doc__


def test_each_option_is_spelled_in_a_handful_of_library_files():
    """A new option's name goes in its row, its step, the diagnosis of its mix-up and the
    adapters to other libraries' names; the rest of the package reads the table."""
    package = pathlib.Path(na.__file__).parent
    for name in ("softcap", "window", "alibi_slopes", "sinks", "dropout_mask"):
        files = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if name in p.read_text())
        assert len(files) <= 6, (name, files)
