"""Hostile input: no crash, no silent wrong answer, a clear ValueError / TypeError naming the
argument (the repros of the reliability review, each failing before its fix)."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.softmax import SoftmaxCache


@pytest.mark.slow
def test_an_empty_query_block_never_touches_memory_it_does_not_own():
    """N_q = 0 with N_k > 0: the softmax backward once wrote into an empty einsum result
    (complex long double aborted the process under malloc checking)."""
    code = ("import numpy as np, numpy_attention as na\n"
            "q = np.zeros((1, 2, 0, 3), np.clongdouble); k = np.ones((1, 2, 4, 3), np.clongdouble)\n"
            "for _ in range(2000):\n"
            "    out, c = na.attention_forward(q, k, k)\n"
            "    g = na.attention_backward(out, c)\n"
            "assert g.dq.shape == (1, 2, 0, 3) and not g.dk.any()\n")
    env = {**os.environ, "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-500:]


@pytest.mark.parametrize("window", [(-1, sys.maxsize), (2 ** 63, 2 ** 64), (np.uint64(2 ** 63), -1),
                                    (sys.maxsize, sys.maxsize)])
@pytest.mark.parametrize("implementation", ["textbook", "blocked", "tiled"])
def test_a_window_wider_than_any_sequence_is_unbounded(window, implementation):
    q = np.random.default_rng(0).standard_normal((1, 2, 4, 3))
    wide = na.attention_forward(q, q, q, window=window, implementation=implementation)[0]
    np.testing.assert_array_equal(wide, na.attention_forward(q, q, q, implementation=implementation)[0])


@pytest.mark.parametrize("call", [
    lambda q: na.attention_forward(q, q, q, scale=10 ** 400),
    lambda q: na.attention_forward(q, q, q, softcap=10 ** 400),
    lambda q: na.gradcheck(lambda x: (x, None), lambda d, c: [d], [q], eps=10 ** 400),
    lambda q: na.taylor_test(lambda x: (x, None), lambda d, c: [d], [q], h0=10 ** 400),
    lambda q: na.crosscheck(q=q, k=q, v=q, out=q, atol=10 ** 400),
    lambda q: na.crosscheck(q=q, k=q, v=q, out=q, k_factors={"out": 10 ** 400}),
])
def test_huge_python_integers_are_a_value_error(call):
    with pytest.raises(ValueError, match="an integer of 401 digits"):
        call(np.ones((1, 2, 3)))


def test_ragged_lists_and_caches_built_by_hand_get_errors_that_name_them():
    q = np.ones((1, 2, 3))
    out, cache = na.attention_forward(q, q, q)
    with pytest.raises(TypeError, match="dout must be a numeric array .* a ragged nested list"):
        na.attention_backward([[[1, 2, 3], [1, 2]]], cache)
    with pytest.raises(TypeError, match="dy must be a numeric array"):
        na.linear_backward([[1], [1, 2]], na.linear_forward(np.ones((2, 2)), np.ones((2, 2)))[1])
    with pytest.raises(TypeError, match="dp must be a numeric array"):
        na.softmax_backward([[1], [1, 2]], na.softmax_forward(np.ones((2, 2)))[1])
    np.testing.assert_array_equal(na.softmax_backward(np.ones((1, 2)), SoftmaxCache(p=[[0.5, 0.5]])), 0)
    with pytest.raises(TypeError, match="cache.p must be a numeric"):
        na.softmax_backward(np.ones((1, 2)), SoftmaxCache(p=None))
    with pytest.raises(TypeError, match="its weights is NoneType, not an array"):
        na.attention_backward(out, cache._replace(weights=None))


@pytest.mark.parametrize("implementation", ["textbook", "blocked", "tiled"])
def test_a_scale_beyond_float32_still_computes_in_float32(implementation):
    """q = 1e-20 and scale = 1e39: scale q k^T = 3e19 fits in float32, the scale alone does not."""
    q, k = np.full((1, 2, 3), 1e-20, np.float32), np.ones((1, 2, 3), np.float32)
    out, cache = na.attention_forward(q, k, k, scale=1e39, implementation=implementation)
    grads = na.attention_backward(np.ones_like(out), cache)
    assert out.dtype == np.float32 and np.isfinite(out).all() and np.isfinite(grads.dq).all()
    np.testing.assert_allclose(cache.lse, 3e19 + np.log(2), rtol=1e-6)


# ----------------------------------------------------------------------------- the command line

def test_outputs_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write that fails part-way leaves the old file as it was (and no temporary file)."""
    from numpy_attention.oracle import save_case, write_example_case
    from numpy_attention.experiments import tables
    target = tmp_path / "records.json"
    target.write_text("old")

    def failing_dump(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(tables.json, "dump", failing_dump)
    with pytest.raises(OSError):
        tables.write_json([{"a": 1}], str(target))
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["records.json"]
    case = tmp_path / "case.npz"
    write_example_case(str(case))
    before = case.read_bytes()
    monkeypatch.setattr(np, "savez", failing_dump)
    with pytest.raises(OSError):
        save_case(str(case), q=np.ones((1, 2, 3)), k=np.ones((1, 2, 3)), v=np.ones((1, 2, 3)), out=np.ones((1, 2, 3)))
    assert case.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["case.npz", "records.json"]


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    from numpy_attention.commands import cli, demo
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(demo, "run", interrupted)
    assert cli.main(["demo"]) == 130
    err = capsys.readouterr().err
    assert err == "numpy-attention: interrupted\n"


def test_a_sweep_too_large_for_this_machine_is_refused_before_the_work(capsys):
    from numpy_attention.commands.cli import main
    assert main(["vanishing", "--trials", "2147483647"]) == 2
    err = capsys.readouterr().err
    assert "needs about" in err and "GiB" in err and err.count("\n") == 1


def test_the_pure_pair_is_thread_safe_and_equals_the_module():
    """The module keeps its last forward (its docstring says so); the pure pair keeps nothing."""
    from concurrent.futures import ThreadPoolExecutor
    mha = na.MultiHeadAttention(16, 2, seed=3)
    rng = np.random.default_rng(7)
    inputs = [(rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 5, 16))) for _ in range(8)]

    def pure(x, dout):
        out, _, cache = na.multihead_forward(x, x, x, mha.params, 2)
        return out, na.multihead_backward(dout, cache)["query"]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda pair: pure(*pair), inputs))
    for (x, dout), (out, dquery) in zip(inputs, threaded):
        serial_out, _ = mha(x, x, x)
        np.testing.assert_array_equal(out, serial_out)
        np.testing.assert_array_equal(dquery, mha.backward(dout)["query"])


SEQUENCES = 10 ** 5
CU = np.arange(SEQUENCES + 1) * 2                    # 10^5 packed sequences of 2 tokens


@pytest.mark.parametrize("options, words", [
    ({"cu_seqlens_q": CU, "cu_seqlens_k": CU, "seqused_k": np.full(SEQUENCES, 3)},
     "got seqused_k[0] = 3, seqused_k[1] = 3, seqused_k[2] = 3, ... (100000 entries) where the sequences hold 2, 2, 2"),
    ({"page_table": np.full((SEQUENCES, 2), 7), "cache_seqlens": np.full(SEQUENCES, 3)},
     "got page_table[0, 0] = 7, page_table[0, 1] = 7, page_table[1, 0] = 7, ... (200000 entries)"),
    ({"page_table": np.zeros((SEQUENCES, 2), int), "cache_seqlens": np.r_[np.full(SEQUENCES - 1, 4), -1]},
     "got cache_seqlens[99999] = -1"),
])
def test_an_error_over_many_sequences_names_the_first_offenders_and_how_many(options, words):
    """A message lists at most a few offending entries and counts the rest: 10^5 sequences once
    gave single-line errors of 300-600 KB."""
    paged = "page_table" in options
    q = np.ones((SEQUENCES, 1, 1, 4)) if paged else np.ones((1, 2 * SEQUENCES, 4))
    k = np.ones((4, 1, 2, 4)) if paged else q
    with pytest.raises(ValueError, match=re.escape(words)) as error:
        na.attention_forward(q, k, k, **options)
    assert len(str(error.value)) < 300


@pytest.mark.parametrize("option", [{"scale": [1.0] * 10 ** 5}, {"causal": "x" * 10 ** 5},
                                    {"window": tuple(range(10 ** 5))}, {"fully_masked": ["zero"] * 10 ** 5},
                                    {"block_size": [1] * 10 ** 5}, {"check_finite": [True] * 10 ** 5}])
def test_an_error_quotes_a_huge_argument_briefly(option):
    """A list of 10^5 entries (or a string of 10^5 letters) where a number, a word or a pair
    belongs: the message names the argument and quotes the first few entries (reprlib)."""
    q = np.ones((1, 2, 3))
    with pytest.raises((TypeError, ValueError), match=list(option)[0]) as error:
        na.attention_forward(q, q, q, **option)
    assert len(str(error.value)) < 200 and "..." in str(error.value)
