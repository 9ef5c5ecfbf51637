"""What gradcheck's report tells a person: a fallback that worked is said once, in words, not as
an error; every input that was not checked is listed, with why; no line is wider than 100."""
import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.gradcheck_cases import cases

WIDTH = 100


def tanh_layer_forward(x, W):                         # y = tanh(x W), W [d_in, d_out]
    if np.ndim(W) != 2:
        raise ValueError(f"W must have 2 axes [d_in, d_out], got shape {np.shape(W)}")
    y = np.tanh(x @ W)
    return y, (x, W, y)


def tanh_layer_backward(dy, cache):
    x, W, y = cache
    dz = dy * (1 - y ** 2)
    return [dz @ W.T, np.swapaxes(x, -1, -2) @ dz]


def test_a_fallback_that_worked_is_said_once_in_words_not_as_an_error():
    """W [d_in, d_out] refuses a stack: the check runs one perturbed input at a time and passes.
    The report says so in one sentence, without the error the probe met."""
    rng = np.random.default_rng(0)
    x, W = rng.standard_normal((5, 3)), rng.standard_normal((3, 4))
    report = na.gradcheck(tanh_layer_forward, tanh_layer_backward, [x, W], names=["x", "W"])
    text = str(report)
    assert report and "Error" not in text and "must have 2 axes" not in text
    assert "the forward took one perturbed input at a time" in text
    assert text.count("at a time") == 1 and "batched=True shows why" in text
    with pytest.raises(ValueError, match="must have 2 axes"):     # the detail, for who asks for it
        na.gradcheck(tanh_layer_forward, tanh_layer_backward, [x, W], batched=True)


def test_the_fallback_names_the_inputs_it_holds_for_and_the_backward():
    """x stacks, W does not (its forward reads W's first entry only): only W is named."""
    rng = np.random.default_rng(13)
    x, W = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    forward = lambda x, W: (x @ W.reshape((-1,) + W.shape[-2:])[0], (x, W))

    def backward(dout, cache):
        x, W = cache
        if np.ndim(dout) > 2:
            raise ValueError("dout must be [N, d_out]")
        return [dout @ W.T, x.T @ dout]
    report = na.gradcheck(forward, backward, [x, W], names=["x", "W"])
    assert report.batching.startswith("the forward took one perturbed W at a time, the backward one "
                                      "upstream gradient: they take no stack along a new leading axis")


def test_nothing_is_said_of_a_stacked_check_nor_of_batched_false():
    """batched=False is the caller's choice: "looped", and no note (the package's own commands
    pass it for their functions that take no stack)."""
    z = np.random.default_rng(1).standard_normal((3, 5))
    backward = lambda dp, cache: [na.softmax_backward(dp, cache)]
    stacked = na.gradcheck(na.softmax_forward, backward, [z])
    looped = na.gradcheck(na.softmax_forward, backward, [z], batched=False)
    projection = na.gradcheck(na.softmax_forward, backward, [z], mode="projection")
    assert stacked.batching == "vectorized" and "vectorized" not in str(stacked)
    assert projection.batching is None and "note" not in str(projection)
    assert looped.batching == "looped" and "note" not in str(looped) and "looped" not in str(looped)
    rows = lambda report: [row[:2] for row in report.rows]
    assert rows(looped) == rows(stacked)


def test_a_fallback_note_is_plain_and_wrapped():
    """A function of the caller's that takes no stack: a note in plain words, wrapped to WIDTH."""
    def gather_forward(x):                                    # x[[0, 2]] indexes the first axis
        return x[[0, 2]], None

    def gather_backward(dy, _):
        dx = np.zeros(4)
        np.add.at(dx, [0, 2], dy)
        return [dx]
    report = na.gradcheck(gather_forward, gather_backward, [np.arange(4.0)])
    lines = str(report).splitlines()
    assert " ".join(lines[1:3]) == f"note: {report.batching}" and all(len(line) <= WIDTH for line in lines)
    assert report.batching == ("the forward took one perturbed input at a time, the backward one upstream "
                               "gradient: they take no stack along a new leading axis (batched=True shows why); "
                               "the same numbers, only slower")


def indexing_forward(x, index, scale, bias, empty):
    """y = scale * x[index] + bias; an integer index, a float scalar, a None and an empty array."""
    return scale * x[index] + (0.0 if bias is None else bias), (x, index, scale)


def indexing_backward(dy, cache):
    x, index, scale = cache
    dx = np.zeros(x.shape, dtype=np.result_type(dy, float))
    np.add.at(dx, index, scale * dy)
    return [dx, None, np.sum(dy * x[index]), None, None]


INDEXING_INPUTS = [np.random.default_rng(2).standard_normal(5), np.array([0, 3, 3], dtype=np.int64), 2.0,
                   None, np.zeros((0, 2))]
INDEXING_NAMES = ["x", "index", "scale", "bias", "empty"]


@pytest.mark.parametrize("check", ["gradcheck", "jvpcheck"])
def test_an_input_that_is_not_checked_is_listed_with_why(check):
    if check == "gradcheck":
        report = na.gradcheck(indexing_forward, indexing_backward, INDEXING_INPUTS, names=INDEXING_NAMES)
    else:
        jvp = lambda xs, ts: xs[2] * ts[0][xs[1]]
        report = na.jvpcheck(indexing_forward, jvp, INDEXING_INPUTS, names=INDEXING_NAMES)
    assert report and [row.name for row in report.rows] == ["x"]
    assert report.skipped == (
        ("index", "an array of int64, not floating-point (or complex)"),
        ("scale", "not an array (float): wrt=[2] checks it"),
        ("bias", "not an array (None)"),
        ("empty", "an empty array, shape (0, 2)"))
    lines = str(report).splitlines()
    for name, why in report.skipped:
        assert f"{name:<7}skipped: {why}" in lines


def test_an_input_left_out_of_wrt_is_listed_as_such():
    report = na.gradcheck(indexing_forward, indexing_backward, INDEXING_INPUTS, wrt=[2],
                          names=INDEXING_NAMES)
    assert [row.name for row in report.rows] == ["scale"]
    assert [why for _, why in report.skipped] == ["not in wrt"] * 4


def test_a_gradient_the_backward_returns_as_none_is_checked_as_zero_not_skipped():
    """None says "no gradient": for an input the forward depends on, that is a wrong gradient."""
    rng = np.random.default_rng(3)
    x, W, b = rng.standard_normal((4, 3)), rng.standard_normal((3, 2)), rng.standard_normal(2)
    no_db = lambda dy, cache: [*na.linear_backward(dy, cache)[:2], None]
    report = na.gradcheck(na.linear_forward, no_db, [x, W, b], names=["x", "W", "b"])
    assert [(row.name, row.passed) for row in report.rows] == [("x", True), ("W", True), ("b", False)]
    assert report.rows[2].analytic == 0 and report.skipped == ()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "projection"])
def test_every_line_of_every_report_fits_in_100_columns(mode):
    """Every op and attention variant of `numpy-attention gradcheck` (4-d indices, names of ten
    characters, fallbacks), passing and failing; a check with skipped inputs, one with a hint."""
    x = np.random.default_rng(4).standard_normal((3, 4))
    reports = [na.gradcheck(indexing_forward, indexing_backward, INDEXING_INPUTS, names=INDEXING_NAMES,
                            mode=mode),
               na.gradcheck(lambda x: (np.abs(x), x), lambda dout, x: [dout * np.sign(x)], [x],
                            method="complex", mode=mode)]
    for forward, backward, inputs, names in cases(np.random.default_rng(0)).values():
        halved = lambda dout, cache, backward=backward: [None if g is None else g / 2
                                                         for g in backward(dout, cache)]
        reports += [na.gradcheck(forward, backward, inputs, names=names, method=method, mode=mode)
                    for method in ("complex", "richardson")]
        reports.append(na.gradcheck(forward, halved, inputs, names=names, method="complex", mode=mode))
    assert any(not report for report in reports) and reports[1].hints
    assert any("at a time" in str(report) for report in reports) == (mode == "full")
    for report in reports:
        for line in str(report).splitlines():
            assert len(line) <= WIDTH, f"{len(line)} columns: {line}"
