"""gradcheck and taylor_test: they pass right gradients, fail wrong ones, and say why."""
import ast
import importlib
import pathlib

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.finite_differences import block_functions

GRADCHECK_PACKAGE = importlib.import_module("numpy_attention.finite_differences")   # na.gradcheck is the function


def softmax_case(seed=0):
    return na.softmax_forward, (lambda d, c: [na.softmax_backward(d, c)]), \
        [np.random.default_rng(seed).standard_normal((3, 5))]


def wrong_softmax_backward(dp, cache):
    return [cache.p * dp]                                  # no row-sum term


@pytest.mark.parametrize("method", ["central", "complex", "richardson"])
@pytest.mark.parametrize("mode", ["full", "projection"])
def test_right_gradient_passes_wrong_one_fails(method, mode):
    forward, backward, inputs = softmax_case()
    assert na.gradcheck(forward, backward, inputs, method=method, mode=mode)
    assert not na.gradcheck(forward, wrong_softmax_backward, inputs, method=method, mode=mode)


def test_error_levels_per_method():
    """complex step ~1e-16, Richardson ~1e-11, central ~1e-10 on the same float64 problem."""
    forward, backward, inputs = softmax_case(1)
    err = {m: na.gradcheck(forward, backward, inputs, method=m).rows[0].max_rel_err
           for m in ("complex", "richardson", "central")}
    assert err["complex"] < 1e-14
    assert err["complex"] < err["richardson"] < 1e-8
    assert err["complex"] < err["central"] < 1e-7


def test_report_table_names_everything():
    forward, backward, inputs = softmax_case()
    report = na.gradcheck(forward, backward, inputs, method="complex", names=["z"])
    text = str(report)
    for word in ("method=complex", "mode=full", "rtol=1e-12", "max abs err", "max rel err",
                 "worst index", "analytic", "numeric", "PASS", "z"):
        assert word in text
    row = report.rows[0]
    assert row.passed and row.max_abs_err <= row.tol
    assert len(row.worst_index) == 2                       # (output index, input index)


def test_raise_on_failure():
    forward, _, inputs = softmax_case()
    with pytest.raises(na.GradcheckError, match="FAIL"):
        na.gradcheck(forward, wrong_softmax_backward, inputs, raise_on_failure=True)
    with pytest.raises(AssertionError):
        na.gradcheck(forward, wrong_softmax_backward, inputs, raise_on_failure=True)


def test_upstream_gradient_is_random_not_ones():
    """A backward that is right only for dout = ones (sum(softmax) = 1 has zero gradient)."""
    forward, _, inputs = softmax_case()
    zero_backward = lambda dp, cache: [np.zeros_like(cache.p)]
    assert not na.gradcheck(forward, zero_backward, inputs, mode="projection")
    assert not na.gradcheck(forward, zero_backward, inputs, mode="full")


def test_projection_mode_is_seeded_and_deterministic():
    forward, backward, inputs = softmax_case()
    a = na.gradcheck(forward, backward, inputs, mode="projection", seed=3)
    b = na.gradcheck(forward, backward, inputs, mode="projection", seed=3)
    assert a.rows == b.rows


def test_float32_inputs_use_float32_tolerances():
    forward, backward, inputs = softmax_case()
    report = na.gradcheck(forward, backward, [inputs[0].astype(np.float32)], method="central")
    assert report.dtype == "float32" and report.rtol == 1e-2 and report


def test_wrt_and_none_gradients():
    rng = np.random.default_rng(2)
    x, W = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    report = na.gradcheck(na.linear_forward, na.linear_backward, [x, W, None], wrt=[1], method="complex")
    assert [r.name for r in report.rows] == ["input 1"] and report


@pytest.mark.parametrize("kwargs,error", [
    ({"method": "forward"}, ValueError), ({"mode": "diagonal"}, ValueError),
    ({"wrt": [5]}, ValueError), ({"names": ["a", "b"]}, ValueError)])
def test_bad_arguments(kwargs, error):
    forward, backward, inputs = softmax_case()
    with pytest.raises(error):
        na.gradcheck(forward, backward, inputs, **kwargs)


def test_backward_with_wrong_gradient_shape_is_named():
    forward, _, inputs = softmax_case()
    with pytest.raises(ValueError, match="shape"):
        na.gradcheck(forward, lambda d, c: [np.zeros(3)], inputs)


def test_taylor_remainder_order_two_for_right_one_for_wrong():
    forward, backward, inputs = softmax_case()
    right = na.taylor_test(forward, backward, inputs)
    wrong = na.taylor_test(forward, wrong_softmax_backward, inputs)
    assert right and abs(right.order - 2) < 0.2
    assert not wrong and abs(wrong.order - 1) < 0.2
    assert "order" in str(right)


def test_taylor_on_a_linear_map_is_exact():
    """L linear in b: a right gradient leaves no remainder at all (a pass, order inf); a wrong
    one leaves h * error (order 1)."""
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((3, 4)), rng.standard_normal((4, 2)), rng.standard_normal(2)]
    wrong = lambda dy, c: [None, None, 1.5 * na.linear_backward(dy, c)[2]]
    right = na.taylor_test(na.linear_forward, na.linear_backward, inputs, wrt=[2])
    assert right and right.order == np.inf and np.all(right.r0 > 0)
    assert not na.taylor_test(na.linear_forward, wrong, inputs, wrt=[2])


def test_taylor_floor_follows_the_size_of_the_function():
    """f = 1e-14 x^2: every remainder is far below 1e3 eps, yet far above the rounding of L's
    own terms; the right gradient shows order 2 and a wrong one order 1 (an absolute floor
    would pass both as 'exact')."""
    x = np.random.default_rng(5).standard_normal(4)
    forward = lambda x: (1e-14 * x ** 2, x)
    right = na.taylor_test(forward, lambda d, x: [2e-14 * x * d], [x])
    wrong = na.taylor_test(forward, lambda d, x: [4e-14 * x * d], [x])
    assert right and abs(right.order - 2) < 0.2
    assert not wrong and abs(wrong.order - 1) < 0.2


def test_a_step_that_does_not_move_the_input_is_refused():
    """eps = 1e-300: x + eps = x, every central difference is 0 and the floor 1e285 would pass
    any gradient; gradcheck refuses it. The smallest step allowed is eps_mach * max(1, |x|)."""
    forward, backward, inputs = softmax_case()
    with pytest.raises(ValueError, match="does not move"):
        na.gradcheck(forward, wrong_softmax_backward, inputs, eps=1e-300)
    bound = np.finfo(float).eps * np.max(np.abs(inputs[0]))
    with pytest.raises(ValueError, match="does not move"):
        na.gradcheck(forward, backward, inputs, eps=bound)
    assert na.gradcheck(forward, backward, inputs, method="complex", eps=1e-300)   # no cancellation


def test_checks_at_the_edges_of_finite_differences_still_run():
    """Not refused: a zero gradient checked alone (softmax ignores a shift of its row), float32
    with a large |f|, 0-d eps, an integer-array wrt, and a scalar float input named in wrt.

    float32 central differences of f = 1e3 + x have a roundoff floor of 1.2, above the
    derivative 1: they cannot see a gradient wrong by 100%, and the report's tol column says
    so. Complex step has no floor and catches it."""
    x, shift = np.random.default_rng(6).standard_normal((3, 5)), np.zeros((3, 1))
    forward = lambda x, c: na.softmax_forward(x + c)
    backward = lambda d, cache: [na.softmax_backward(d, cache), np.zeros((3, 1))]
    for method in ("central", "richardson", "complex"):
        assert na.gradcheck(forward, backward, [x, shift], wrt=[1], method=method)
    big = lambda x: (1e3 + x, None)
    x32, doubled = x.astype(np.float32), lambda d, c: [2 * d]
    assert na.gradcheck(big, doubled, [x32], method="central").rows[0].tol > 1      # blind, and says so
    assert not na.gradcheck(big, doubled, [x32], method="complex")
    assert na.gradcheck(big, lambda d, c: [d], [x], eps=np.array(1e-6), wrt=np.array([0]))
    scalar = na.gradcheck(lambda a, x: (a * x, x), lambda d, x: [np.sum(d * x), None], [2.0, x], wrt=[0])
    assert scalar and scalar.rows[0].name == "input 0"


@pytest.mark.parametrize("method", ["central", "complex", "richardson"])
@pytest.mark.parametrize("mode", ["full", "projection"])
def test_a_nan_gradient_fails(method, mode):
    forward, _, inputs = softmax_case()
    nan_backward = lambda dp, cache: [np.full_like(cache.p, np.nan)]
    report = na.gradcheck(forward, nan_backward, inputs, method=method, mode=mode)
    assert not report and report.rows[0].max_abs_err == np.inf


def test_compare_fails_an_inf_and_skips_nan_in_the_scale():
    """The report's comparison: NaN on both sides agrees, NaN on one side is an infinite error,
    inf on both sides is no agreement (inf - inf), and the scale counts NaN as 0."""
    compare = importlib.import_module("numpy_attention.finite_differences.verdict_table").compare
    index = lambda k: (k,)
    both_nan = compare("x", "jacobian", [1.0, np.nan], [1.0, np.nan], index, 1e-6, 0.0)
    assert both_nan.passed and both_nan.max_abs_err == 0 and both_nan.worst_index == (0,)
    one_nan = compare("x", "jacobian", [1.0, np.nan], [1.0, 2.0], index, 1e-6, 0.0)
    assert not one_nan.passed and one_nan.max_abs_err == np.inf and one_nan.worst_index == (1,)
    with np.errstate(invalid="ignore"):
        both_inf = compare("x", "jacobian", [1.0, np.inf], [1.0 + 1e-9, np.inf], index, 1e-6, 1.0)
    assert not both_inf.passed
    scaled = compare("x", "jacobian", [4.0, np.nan, 1.0], [4.0, np.nan, 1.0 + 3e-6], index, 1e-6, 0.0)
    assert scaled.passed and scaled.tol == pytest.approx(4e-6)     # rtol * max |entry| without the NaN


def test_an_exact_row_shows_its_largest_entry():
    """Complex step on a linear map has no error at all; the row then shows where the
    Jacobian is largest (not index 0, which may be a zero of the Jacobian)."""
    x = np.array([0.0, 0.0, 3.0])
    report = na.gradcheck(lambda x: (np.array([0.0, 2.0, -5.0]) * x, None),
                          lambda d, c: [np.array([0.0, 2.0, -5.0]) * d], [x], method="complex")
    row = report.rows[0]
    assert report and row.max_abs_err == 0 and row.analytic == row.numeric == -5.0
    assert row.worst_index == ((2,), (2,))


def imported_modules(path):
    """The absolute names of the modules `path` (a module of numpy_attention.finite_differences) imports."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module
        elif isinstance(node, ast.ImportFrom):        # relative: from the package numpy_attention.finite_differences
            base = ["numpy_attention", "finite_differences"][:3 - node.level]
            yield ".".join(base + ([node.module] if node.module else []))


def test_gradcheck_imports_nothing_of_the_package_but_its_checks():
    """It only calls the functions it is given: of numpy_attention, only the leaf `_checks`."""
    files = sorted(pathlib.Path(GRADCHECK_PACKAGE.__file__).parent.glob("*.py"))
    assert {f.stem for f in files} >= {"__init__", "differences", "jacobians", "batching", "verdict_table",
                                       "taylor", "restricted"}
    seen = set()
    for path in files:
        for module in imported_modules(path):
            seen.add(module)
            if module.startswith("numpy_attention"):
                assert module.startswith("numpy_attention.finite_differences") or module == "numpy_attention._checks", \
                    f"{path.name} imports {module}"
    assert "numpy_attention._checks" in seen and "numpy_attention.finite_differences.verdict_table" in seen   # the walk works


def test_a_small_gradient_is_held_to_its_own_scale():
    """Complex step: an input whose gradient is ~1e-13 of another's, wrong by 1%, must fail
    (an atol scaled by the largest gradient in the call, 1.3e-13 here, would let it pass)."""
    x, y = np.array([3.0, -2.0, 4.0]), np.array([1.0, 2.0, 3.0])
    forward = lambda x, y: (1e-13 * x ** 2 + y ** 2, (x, y))
    right = lambda d, c: [2e-13 * c[0] * d, 2 * c[1] * d]
    wrong = lambda d, c: [2e-13 * 1.01 * c[0] * d, 2 * c[1] * d]
    assert na.gradcheck(forward, right, [x, y], method="complex")
    report = na.gradcheck(forward, wrong, [x, y], method="complex")
    assert [r.passed for r in report.rows] == [False, True] and not report


def test_directional_derivative_refuses_unknown_methods():
    with pytest.raises(ValueError, match="method"):
        na.directional_derivative(np.sin, np.zeros(2), np.ones(2), "centrall", 1e-6)


def test_the_worst_index_column_says_what_its_index_is():
    forward, backward, inputs = softmax_case()
    full = str(na.gradcheck(forward, backward, inputs)).splitlines()
    projection = str(na.gradcheck(forward, backward, inputs, mode="projection")).splitlines()
    assert "worst index (out, in)" in full[1] and "(projection)" not in full[1]
    assert "worst index (projection)" in projection[1] and "(out, in)" not in projection[1]
    assert "((" in full[2] and "((" not in projection[2]                 # ((out...), (in...)) vs (k,)


def test_complex_step_on_a_forward_that_is_not_analytic_prints_a_hint():
    """np.abs drops the imaginary part of x + i h e: complex step sees a derivative of exactly 0."""
    x = np.random.default_rng(7).standard_normal((3, 4))
    absolute = lambda x: (np.abs(x), x)
    absolute_backward = lambda dout, x: [dout * np.sign(x)]
    for mode in ("full", "projection"):
        report = na.gradcheck(absolute, absolute_backward, [x], method="complex", mode=mode, names=["x"])
        assert not report and report.rows[0].numeric == 0
        assert len(report.hints) == 1 and "not analytic in x" in report.hints[0]
        assert str(report).split("\nhint: ")[1].startswith("x: complex step saw a derivative of exactly 0")
        assert "np.abs" in str(report)
    assert na.gradcheck(absolute, absolute_backward, [x], method="central")  # central can check it


def test_the_hint_also_names_a_zero_gradient_computed_as_rounding():
    """softmax ignores a shift c of its rows: dc is 0, computed as cancelling terms (~1e-16).
    Checked alone it fails (its atol is 0) and the hint names both causes and the fix."""
    x, shift = np.random.default_rng(6).standard_normal((3, 5)), np.zeros((3, 1))
    forward = lambda x, c: na.softmax_forward(x + c)
    backward = lambda d, cache: [None, np.sum(na.softmax_backward(d, cache), axis=-1, keepdims=True)]
    report = na.gradcheck(forward, backward, [x, shift], wrt=[1], method="complex", names=["x", "c"])
    assert not report and len(report.hints) == 1
    assert "the true derivative is 0 and the backward's is rounding: give an atol" in report.hints[0]
    largest = max(abs(report.rows[0].analytic), 1e-300)
    assert na.gradcheck(forward, backward, [x, shift], wrt=[1], method="complex", atol=10 * largest)


def test_no_hint_where_complex_step_sees_a_derivative():
    forward, _, inputs = softmax_case()
    wrong = na.gradcheck(forward, wrong_softmax_backward, inputs, method="complex")
    assert not wrong and wrong.hints == () and "hint" not in str(wrong)
    zero = na.gradcheck(lambda x: (0 * x, None), lambda d, c: [0 * d], inputs, method="complex")
    assert zero and zero.hints == ()                                     # both exactly 0: right


def test_block_functions_restrict_the_jacobian_to_a_block():
    """f's Jacobian is the (out_block, in_block) block of forward's; its backward matches it."""
    rng = np.random.default_rng(8)
    x, W, b = rng.standard_normal((4, 5)), rng.standard_normal((5, 3)), rng.standard_normal(3)
    in_blocks = [(slice(1, 3), slice(2, 4)), (slice(0, 2), slice(1, 3)), (slice(0, 2),)]
    out_block = (slice(2, 4), slice(0, 2))
    f, f_backward, blocks = block_functions(na.linear_forward, na.linear_backward, [x, W, b],
                                            in_blocks, out_block)
    assert [blk.shape for blk in blocks] == [(2, 2), (2, 2), (2,)]
    np.testing.assert_array_equal(f(*blocks)[0], na.linear_forward(x, W, b)[0][out_block])
    assert na.gradcheck(f, f_backward, blocks, method="complex")
    wrong = lambda d, cache: [g * 1.01 if i == 1 else g for i, g in enumerate(f_backward(d, cache))]
    assert [row.passed for row in na.gradcheck(f, wrong, blocks, method="complex").rows] == [True, False, True]
    untouched = [x.copy(), W.copy(), b.copy()]
    f(*[blk + 1 for blk in blocks])                                       # f writes into copies
    for before, after in zip(untouched, [x, W, b]):
        np.testing.assert_array_equal(before, after)


def test_block_functions_take_a_stack_when_the_functions_do():
    """Attention broadcasts over leading axes, and so do its block functions: gradcheck stacks
    them (batched=True), to the numbers of one entry at a time."""
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 6, 4)), rng.standard_normal((2, 2, 6, 3))
    forward = lambda q, k, v: na.attention_forward(q, k, v, causal=True)
    in_blocks = [(slice(0, 1), slice(1, 2), slice(2, 4))] * 3
    f, f_backward, blocks = block_functions(forward, na.attention_backward, [q, k, v], in_blocks,
                                            (slice(1, 2), slice(0, 1), slice(1, 4)))
    stacked = na.gradcheck(f, f_backward, blocks, method="complex", batched=True)
    looped = na.gradcheck(f, f_backward, blocks, method="complex", batched=False)
    assert stacked and stacked.batching == "vectorized" and looped.batching == "looped"
    for a, b in zip(stacked.rows, looped.rows):
        assert a.max_abs_err <= 1e-15 and b.max_abs_err <= 1e-15
        np.testing.assert_allclose(a.analytic, b.analytic, rtol=1e-14)
