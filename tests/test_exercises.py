"""exercises.check: the reference solutions pass, and each mistake learners make gets its own
message, in words; so does every other way a function can be wrong."""
import numpy as np
import pytest

from numpy_attention import exercises
from numpy_attention.exercises import mistakes, solutions
from numpy_attention.exercises.grading import PARAMS, complex_step_vjp

MISTAKES = [(name, function, message) for name, planted in mistakes.MISTAKES.items()
            for function, message in planted]


@pytest.mark.parametrize("name", list(exercises.EXERCISES))
def test_the_reference_solution_passes(name):
    result = exercises.check(name, getattr(solutions, name))
    assert result and result.passed, result
    assert str(result).startswith(f"{name}: correct: ")


@pytest.mark.parametrize("name, function, message", MISTAKES, ids=[f.__name__ for _, f, _ in MISTAKES])
def test_each_planted_mistake_gets_its_own_message(name, function, message):
    result = exercises.check(name, function)
    assert not result
    assert result.message.startswith(message), result.message
    others = [m for n, _, m in MISTAKES if m != message]
    assert not any(result.message.startswith(m) for m in others)


def test_every_exercise_plants_the_mistakes_the_learner_makes():
    said = " ".join(m for _, _, m in MISTAKES)
    for words in ("transposed product", "rowsum", "sqrt(d_k) times too large", "gradient of sum(",
                  "merged without the transpose"):
        assert words in said
    assert len({m for _, _, m in MISTAKES}) == len(MISTAKES)


def test_the_truth_is_the_complex_step_gradient_not_the_solution():
    rng = np.random.default_rng(1)
    z, dp = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    [dz] = complex_step_vjp(solutions.softmax, [z], dp)
    p = solutions.softmax(z)
    jacobian = np.diag(p[0]) - np.outer(p[0], p[0])
    np.testing.assert_allclose(dz[0], jacobian @ dp[0], rtol=1e-14, atol=1e-16)


def test_a_function_not_written_yet():
    def softmax_backward(dp, p):
        raise NotImplementedError
    result = exercises.check("softmax_backward", softmax_backward)
    assert not result and result.message.startswith("not written yet (it raises NotImplementedError)")


@pytest.mark.parametrize("operand, said", [("q", "it raised ValueError: matmul"),
                                            ("v", "dP is a transposed product: out = P v gives dP = dout v^T")],
                         ids=["an error of no known mistake", "the error of dP = dout v"])
def test_a_function_that_raises_is_reported_with_the_shapes(operand, said):
    """dout @ q, or dout @ v (dP without its transpose), added to dv times 0: fine while d_v =
    d_k = N_k (the square case), a matmul error on the rectangular one, named when it is the
    error of a known mistake."""
    def attention_backward(dout, q, k, v, p):
        dq, dk, dv = solutions.attention_backward(dout, q, k, v, p)
        return dq, dk, dv + 0 * (dout @ {"q": q, "v": v}[operand])[..., :1, :1]
    result = exercises.check("attention_backward", attention_backward)
    assert not result and result.message.startswith(said), result.message
    assert "ValueError: matmul" in result.message
    assert "(on the rectangular case; the square one passes" in result.message
    assert "Shapes: dout (2, 3, 6), q (2, 3, 8), k (2, 5, 8)" in result.message


def test_a_function_that_writes_into_its_argument():
    def softmax_backward(dp, p):
        dp -= np.sum(p * dp, axis=-1, keepdims=True)
        return p * dp
    result = exercises.check("softmax_backward", softmax_backward)
    assert not result and result.message.startswith("it wrote into its argument dp")


def test_a_module_backward_that_writes_into_the_cache_is_named():
    def multihead_backward(dout, cache):
        cache["P"] *= 1.0                                     # in place, even without changing a value
        cache["params"]["W_o"][0, 0] += 1.0
        return solutions.multihead_backward(dout, cache)
    result = exercises.check("multihead_backward", multihead_backward)
    assert not result and result.message.startswith("it wrote into its argument cache['params']['W_o']")


def test_a_function_that_ignores_the_upstream_gradient():
    result = exercises.check("softmax_backward", lambda dp, p: p * (1 - p))
    assert not result
    assert result.message.startswith("it returns the same for two different upstream gradients dp")


@pytest.mark.parametrize("returned, said", [
    (lambda dy, x, W: (dy,), "it must return 3 arrays, (dx, dW, db), got tuple"),
    (lambda dy, x, W: {"dx": dy}, "it returned a dict without dW, db"),
    (lambda dy, x, W: ("a", "b", "c"), "it must return arrays of numbers (dx, dW, db)"),
])
def test_a_function_that_returns_the_wrong_kind_of_thing(returned, said):
    result = exercises.check("linear_backward", returned)
    assert not result and result.message.startswith(said), result.message


def test_a_constant_factor_and_the_scale():
    def attention_backward(dout, q, k, v, p):
        dq, dk, dv = solutions.attention_backward(dout, q, k, v, p)
        return dq / np.sqrt(q.shape[-1]), dk, dv                  # the scale applied twice to dq
    result = exercises.check("attention_backward", attention_backward)
    assert result.message.startswith("dq is 0.5 times the right gradient (sqrt(d_k) = 2: the scale")
    assert "right: dk, dv" in result.message


def test_a_wrong_shape_on_the_rectangular_case_only():
    def attention_backward(dout, q, k, v, p):
        dq, dk, dv = solutions.attention_backward(dout, q, k, v, p)
        return dq, dk[..., :q.shape[-2], :], dv                   # N_q rows where N_k belong
    result = exercises.check("attention_backward", attention_backward)
    assert result.message.startswith("dk has shape (2, 3, 8), expected (2, 5, 8); right: dq, dv")
    assert "(on the rectangular case; the square one passes" in result.message


@pytest.mark.parametrize("wrong, said", [
    (lambda dy, x, W: (dy @ W, *solutions.linear_backward(dy, x, W)[1:]), "dx is a transposed product"),
    (lambda dy, x, W: (dy @ W.T, np.einsum("bni,bnj->bij", x, dy), dy.sum((0, 1))),
     "dW is not summed over the batch: x^T dy of each batch entry is [B, d_in, d_out]"),
    (lambda dy, x, W: (dy @ W.T, x.T @ dy, dy.sum((0, 1))), "dW = x.T @ dy: x.T of x [B, N, d_in] is [d_in, N, B]"),
])
def test_the_common_linear_mistakes_are_named_on_a_square_W(wrong, said):
    """With d_in = d_out a forgotten transpose keeps every shape; the sum over the batch left out
    gives dW [B, d_in, d_out], whose last two axes are W's own."""
    result = exercises.check("linear_backward", wrong)
    assert not result and result.message.startswith(said), result.message
    assert "off by up to" not in result.message and "(transposed:" not in result.message


def test_a_gradient_with_an_axis_too_many_is_told_to_sum_it():
    """dW [3, d_in, d_out] for W [d_in, d_out], square: one per entry of an axis, not a transpose."""
    result = exercises.check("linear_backward", lambda dy, x, W: (dy @ W.T, np.tile(W, (3, 1, 1)), dy.sum((0, 1))))
    assert not result and "(transposed:" not in result.message
    assert ("dW has shape (3, 4, 4), expected (4, 4) (one per entry of the leading axes (3,): every entry "
            "used the same parameter, so its gradient sums over them)") in result.message, result.message


def test_a_transposed_shape_is_named():
    result = exercises.check("linear_backward", mistakes._linear_dW_transposed)   # its own message first
    assert "dW is transposed" in result.message
    result = exercises.check("linear_backward", lambda dy, x, W: (dy @ W.T, W.T.copy(), dy.sum((0, 1))))
    assert not result and "dW is off by up to" in result.message          # the square case: values
    wrong = lambda dy, x, W: (dy @ W.T, np.zeros(W.shape[::-1]), dy.sum((0, 1))) if W.shape[0] != W.shape[1] \
        else solutions.linear_backward(dy, x, W)
    result = exercises.check("linear_backward", wrong)
    assert "dW has shape (5, 4), expected (4, 5) (transposed: a product's operands" in result.message


def test_a_zero_result_is_named():
    result = exercises.check("linear_backward", lambda dy, x, W: (dy @ W.T, np.zeros(W.shape), dy.sum((0, 1)) * 0))
    assert not result
    assert "dW is 0 everywhere; db is 0 everywhere; right: dx" in result.message


@pytest.mark.parametrize("change, said", [
    ({"W_o": 1.5}, "Step 5, the output projection's linear_backward, is wrong: start there"),
    ({"query": 1.5}, "The error is in step 1, the input projections' linear_backward"),
    ({"query": 1.5, "key": 1.5, "value": 1.5, "W_q": 2.0, "W_k": 2.0, "W_v": 2.0, "b_q": 2.0, "b_v": 2.0},
     "Step 5's gradients (W_o, b_o) are right, so the error enters later in the backward"),
])
def test_the_module_backward_names_the_step(change, said):
    def multihead_backward(dout, cache):
        g = solutions.multihead_backward(dout, cache)
        return {name: x * change.get(name, 1.0) for name, x in g.items()}
    result = exercises.check("multihead_backward", multihead_backward)
    assert not result and said in result.message, result.message


def test_the_key_bias_gradient_is_zero_and_passes():
    """b_k shifts every score of a row by q . b_k: softmax ignores it, so its gradient is 0 and
    the solution's rounding noise there must pass (ZERO)."""
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal((4, 4) if n[0] == "W" else 4) for n in PARAMS}
    x = rng.standard_normal((2, 3, 4))
    out, cache = exercises.multihead_forward(x, x, x, params, 2)
    g = solutions.multihead_backward(rng.standard_normal(out.shape), cache)
    assert np.max(np.abs(g["b_k"])) < 1e-14 * np.max(np.abs(g["W_k"]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="name must be one of"):
        exercises.check("softmax_forward", solutions.softmax)
    with pytest.raises(TypeError, match="function must be your softmax_backward function, got int"):
        exercises.check("softmax_backward", 3)
