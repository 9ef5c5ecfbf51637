"""The textbook (attention.py) is the spec: the blocked and tiled engines equal it on every option
they support, and the textbook itself equals complex step."""
import os
import threading
import time

import numpy as np
import pytest
from compare import assert_normwise_equal

import numpy_attention as na
from numpy_attention.engines import blocked, parallel

RTOL = 1e-13          # float64, normwise: the engines differ only in the order of their sums

RNG = np.random.default_rng(7)
MASK = RNG.random((2, 1, 5, 7)) < 0.6
MASK[1, 0, 3] = False                                            # a fully masked row
BIAS = RNG.standard_normal((4, 1, 7))                            # broadcast over B and N_q
DROP = RNG.random((2, 4, 5, 7)) < 0.8

# option sets on q [2, 4, 5, 3], k, v [2, 2, 7, 3|2] (grouped-query: 2 query heads per kv head)
OPTIONS = {
    "plain": {},
    "mask with a dead row": {"mask": MASK},
    "bias broadcast": {"bias": BIAS},
    "bias with -inf": {"bias": np.where(MASK, RNG.standard_normal(MASK.shape), -np.inf)},
    "causal top_left": {"causal": True},
    "causal bottom_right": {"causal": "bottom_right"},
    "window top_left": {"window": (1, 2)},
    "window bottom_right": {"window": (2, 0), "align": "bottom_right"},
    "scale": {"scale": 0.37},
    "softcap": {"softcap": 1.5, "scale": 1.0},
    "dropout": {"dropout_mask": DROP, "dropout_p": 0.2},
    "uniform policy": {"mask": MASK, "fully_masked": "uniform"},
    "nan policy": {"mask": MASK, "fully_masked": "nan"},
    "everything": {"mask": MASK, "bias": BIAS, "causal": "bottom_right", "window": (3, 1),
                   "softcap": 2.0, "dropout_mask": DROP, "dropout_p": 0.1},
}
TILED = [name for name, o in OPTIONS.items()
         if not {"softcap", "dropout_mask"} & set(o) and o.get("fully_masked", "zero") == "zero"]


def inputs(seed=0, shape_q=(2, 4, 5, 3), shape_kv=(2, 2, 7, 3), d_v=2):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal(shape_q), rng.standard_normal(shape_kv)
    v = rng.standard_normal(shape_kv[:-1] + (d_v,))
    return q, k, v, rng.standard_normal(shape_q[:-1] + (d_v,))


def run(q, k, v, dout, implementation, options, method="vjp", **engine):
    out, cache = na.attention_forward(q, k, v, implementation=implementation, **options, **engine)
    grads = na.attention_backward(dout, cache, method=method)
    return {"out": out, "lse": cache.lse, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv,
            "dbias": grads.dbias}


@pytest.mark.parametrize("method", ["vjp", "jacobian", "flash"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("budget", [24, 1 << 30])               # a few rows per block; one block
def test_blocked_equals_the_textbook(monkeypatch, option, method, budget):
    monkeypatch.setattr(blocked, "BLOCK_BYTES", budget)
    for seed in range(3):
        q, k, v, dout = inputs(seed)
        spec = run(q, k, v, dout, "textbook", OPTIONS[option], method)
        assert_normwise_equal(spec, run(q, k, v, dout, "blocked", OPTIONS[option], method), RTOL)


@pytest.mark.parametrize("option", TILED)
@pytest.mark.parametrize("block_size", [1, 2, 3, 16])
def test_tiled_equals_the_textbook(option, block_size):
    for seed in range(3):
        q, k, v, dout = inputs(seed)
        spec = run(q, k, v, dout, "textbook", OPTIONS[option])
        assert_normwise_equal(spec, run(q, k, v, dout, "tiled", OPTIONS[option], block_size=block_size), RTOL)


@pytest.mark.parametrize("implementation", ["blocked", "tiled"])
@pytest.mark.parametrize("shapes", [
    ((3, 4), (6, 4), 2),                                         # one head, [N, d] arrays
    ((1, 3, 6, 2, 4), (1, 3, 1, 9, 4), 3),                       # two batch axes, 2 query heads per kv head
    ((2, 2, 0, 3), (2, 2, 4, 3), 2),                             # N_q = 0
    ((2, 2, 3, 3), (2, 2, 0, 3), 2),                             # N_k = 0: every row fully masked
    ((0, 2, 3, 3), (0, 2, 4, 3), 2),                             # an empty batch
])
def test_engines_equal_the_textbook_on_odd_shapes(implementation, shapes):
    q, k, v, dout = inputs(1, *shapes)
    for options in ({}, {"causal": "bottom_right"}):
        spec = run(q, k, v, dout, "textbook", options)
        assert_normwise_equal(spec, run(q, k, v, dout, implementation, options), RTOL)


@pytest.mark.parametrize("implementation", ["blocked", "tiled"])
def test_engines_equal_the_textbook_in_float32_and_complex(implementation):
    q, k, v, dout = inputs(2)
    spec = run(q, k, v, dout, "textbook", {"causal": True})
    q32, k32, v32, dout32 = (x.astype(np.float32) for x in (q, k, v, dout))
    got = run(q32, k32, v32, dout32, implementation, {"causal": True})
    for name in ("out", "dq", "dk", "dv"):
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], spec[name], atol=1e-5 * np.abs(spec[name]).max())
    h = 1e-20
    qc = q + 1j * h * np.random.default_rng(3).standard_normal(q.shape)
    spec_c = run(qc, k, v, dout, "textbook", {"causal": True})
    assert_normwise_equal(spec_c, run(qc, k, v, dout, implementation, {"causal": True}), RTOL)
    assert np.abs(spec_c["out"].imag).max() > 0                 # the perturbation is carried


@pytest.mark.parametrize("option", [name for name in OPTIONS if name != "nan policy"])  # NaN out: no derivative
def test_the_textbook_equals_complex_step(option):
    """The whole Jacobian w.r.t. q, k, v (and bias) against complex step, with every option."""
    options = dict(OPTIONS[option])
    q, k, v, _ = inputs(4)
    args = [q, k, v] + ([options.pop("bias")] if "bias" in options else [])

    def forward(q, k, v, *bias):
        return na.attention_forward(q, k, v, implementation="textbook", **options,
                                    **({"bias": bias[0]} if bias else {}))
    report = na.gradcheck(forward, na.attention_backward, args, method="complex")
    assert report, report


def test_return_stages_of_the_textbook_and_blocked_engines_agree():
    q, k, v, dout = inputs(5)
    stages = {}
    for implementation in ("textbook", "blocked"):
        out, cache = na.attention_forward(q, k, v, implementation=implementation, **OPTIONS["everything"])
        stages[implementation] = na.attention_backward(dout, cache, return_stages=True).stages
    assert_normwise_equal(stages["textbook"]._asdict(), stages["blocked"]._asdict(), RTOL)


@pytest.mark.parametrize("implementation", ["textbook", "blocked", "tiled"])
def test_gradients_come_back_contiguous(implementation):
    q, k, v, dout = inputs(6)
    out, cache = na.attention_forward(q, k, v, causal=True, implementation=implementation)
    grads = na.attention_backward(dout, cache)
    for g in (grads.dq, grads.dk, grads.dv):
        assert g.flags.c_contiguous


def test_the_default_engine_is_blocked_and_block_size_selects_tiled():
    q, k, v, _ = inputs()
    assert na.attention_forward(q, k, v)[1].plan.implementation == "blocked"
    assert na.attention_forward(q, k, v, block_size=4)[1].plan.implementation == "tiled"
    assert na.attention_forward(q, k, v, implementation="tiled")[1].plan.block_size == 256


@pytest.mark.parametrize("kwargs, fragment", [
    ({"implementation": "fast"}, "implementation must be one of"),
    ({"implementation": "blocked", "block_size": 4}, "block_size=4 is the tiled engine's"),
    ({"implementation": "textbook", "block_size": 4}, "implementation='textbook' takes none"),
    ({"implementation": "tiled", "softcap": 2.0}, "does not support softcap"),
    ({"implementation": "tiled", "fully_masked": "nan"}, "does not support fully_masked='nan'"),
])
def test_engine_selection_errors_name_the_argument(kwargs, fragment):
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match=fragment):
        na.attention_forward(q, k, v, **kwargs)


def test_the_options_record_is_frozen_and_owns_its_arrays():
    q, k, v, _ = inputs()
    mask, bias = MASK.copy(), BIAS.copy()
    _, cache = na.attention_forward(q, k, v, mask=mask, bias=bias)
    mask[...] = False
    bias[...] = 0
    assert cache.options.mask.any() and np.array_equal(cache.options.bias, BIAS)
    with pytest.raises(AttributeError):
        cache.options.scale = 2.0
    with pytest.raises(ValueError):
        cache.options.bias[0, 0, 0] = 1.0                       # read-only


# ----------------------------------------------------------------------------- workers

@pytest.mark.parametrize("option", OPTIONS)
def test_workers_give_bitwise_the_same_results(monkeypatch, option):
    """Many blocks (a small budget): 1, 2 and 3 threads give the same bits, forward and backward."""
    monkeypatch.setattr(blocked, "BLOCK_BYTES", 24)
    q, k, v, dout = inputs(7)
    results = []
    for workers in (1, 2, 3):
        out, cache = na.attention_forward(q, k, v, workers=workers, **OPTIONS[option])
        grads = na.attention_backward(dout, cache, return_stages=True)
        results.append([out, cache.lse, cache.weights, grads.dq, grads.dk, grads.dv, grads.dbias,
                        grads.stages.dS])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert (a is None and b is None) or np.array_equal(a, b, equal_nan=True)


TILED_WORKERS = {**{name: OPTIONS[name] for name in TILED},
                 "bias per head": {"bias": RNG.standard_normal((2, 4, 5, 7))},
                 "alibi and sinks": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]),
                                     "sinks": np.array([0.3, -1.0, 0.0, 2.0]), "causal": True}}


@pytest.mark.parametrize("option", TILED_WORKERS)
def test_tiled_workers_give_bitwise_the_same_results(option):
    """Tiles of 2 (3 query tiles, 4 key tiles): 1, 2 and 3 threads give the same bits, forward,
    backward (tasks: a batch index and kv head each) and the JVP."""
    q, k, v, dout = inputs(8)
    dots = inputs(9)[:3]
    results = []
    for workers in (1, 2, 3):
        out, cache = na.attention_forward(q, k, v, workers=workers, block_size=2, **TILED_WORKERS[option])
        grads = na.attention_backward(dout, cache)
        jvp = na.attention_jvp(q, k, v, *dots, workers=workers, block_size=2, **TILED_WORKERS[option])
        results.append([out, cache.lse, grads.dq, grads.dk, grads.dv, grads.dbias, grads.dalibi_slopes,
                        grads.dsinks, *jvp])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert (a is None and b is None) or np.array_equal(a, b, equal_nan=True)


def test_workers_default_to_every_core_from_2_to_the_19_scores():
    from numpy_attention.engines.plan import attention_plan
    cores = len(os.sched_getaffinity(0))
    def workers(q, k, **kwargs):
        planned = {n: kwargs.pop(n) for n in ("implementation", "block_size", "workers") if n in kwargs}
        q, k, _, options = na.attention_options(q, k, k, **kwargs)
        return attention_plan(options, q.shape, k.shape, **planned).workers
    small, large = np.zeros((1, 2, 255, 1)), np.zeros((1, 2, 1024, 1))   # 2 * 255 * 1024 < 2^19 scores
    assert workers(small, large) == 1
    assert workers(large, large) == cores                  # 2 * 1024^2 = 2^21
    assert workers(large, large, block_size=64) == cores
    assert workers(large, large, implementation="textbook") == 1
    assert workers(large, large, workers=1) == 1
    assert na.attention_forward(large, large, large)[1].plan.workers == cores   # what the call runs on
    packed = np.zeros((2, 2048, 1))                        # 2 * 2048^2 = 2^23 scores in the array,
    cu = np.arange(0, 2049, 256)                           # but 2 * 8 * 256^2 = 2^20 in its 8 sequences
    assert workers(packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu) == cores
    cu = np.arange(0, 2049, 128)                           # 2 * 16 * 128^2 = 2^19
    assert workers(packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu) == cores
    cu = np.arange(0, 2049, 64)                            # 2 * 32 * 64^2 = 2^18
    assert workers(packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu) == 1


def test_multihead_workers_default_to_every_core_for_large_projections_or_many_scores():
    """MultiHeadAttention's projections take every core from 2^24 multiply-adds in the four
    projections, B (N_q + N_k) 2^19 at d_model = 512, or from 2^19 scores; the attention
    resolves its own threads from `workers` as given (every core from 2^19 scores)."""
    cores = len(os.sched_getaffinity(0))
    modules = {D: na.MultiHeadAttention(D, 8, seed=0).params for D in (512, 16)}
    def workers(B, N_q, N_k, D=512, **options):
        query, key = np.zeros((B, N_q, D)), np.zeros((B, N_k, D))
        cache = na.multihead_forward(query, key, key, modules[D], 8, **options)[2]
        return cache.workers, cache.attention.plan.workers
    assert workers(2, 10, 10) == (cores, 1)                # the blog's shape: 40 2^19; 1600 scores
    assert workers(2, 8, 8) == (cores, 1)                  # 32 2^19 = 2^24
    assert workers(2, 8, 7) == (1, 1)                      # just below
    assert workers(1, 256, 256) == (cores, cores)          # 2^28 multiply-adds, 2^19 scores
    assert workers(1, 256, 256, D=16) == (cores, cores)    # 2^19 scores, 2^18 multiply-adds
    assert workers(1, 256, 255, D=16) == (1, 1)            # just below both
    assert workers(2, 10, 10, implementation="textbook") == (1, 1)
    assert workers(2, 10, 10, workers=1) == (1, 1)
    assert workers(1, 2, 2, D=16, workers=2) == (2, 2)


def test_multihead_splits_and_merges_heads_on_threads_from_a_mebibyte(monkeypatch):
    """The splits of Q, K, V and merges of dQ, dK, dV run on the projections' threads from
    arrays of 2^20 bytes (plan.PARALLEL_HEAD_COPIES), on the calling thread below."""
    import numpy_attention.multihead_threads as threaded
    calls = []
    def recording(fn, items, workers=1, **kwargs):
        calls.append((fn.__name__, workers))
        return parallel.run_tasks(fn, items, workers, **kwargs)
    monkeypatch.setattr(threaded, "run_tasks", recording)
    mha = na.MultiHeadAttention(512, 8, seed=0)
    for N, expected in ((256, 2), (255, 1)):                # Q [1, N, 512] float64: 2^20 bytes at 256
        calls.clear()
        x = np.zeros((1, N, 512))
        mha(x, x, x, workers=2)
        mha.backward(x)
        assert calls == [("split_heads", expected), ("merge_heads", expected)], calls


@pytest.mark.parametrize("engine", ["blocked", "textbook"])
def test_multihead_holds_blas_on_one_thread_through_each_call(monkeypatch, engine):
    """multihead_forward and multihead_backward hold BLAS on one thread from start to end (one
    setting instead of one per step), except around the textbook engine, whose products run
    on BLAS's own threads; BLAS gets its threads back after each call, and after a failure."""
    import numpy_attention.multihead_threads as threaded
    import numpy_attention.multihead as multihead
    from threadpoolctl import threadpool_limits
    seen = {}
    def recording(name, fn):
        def record(*args, **kwargs):
            seen.setdefault(name, []).append(blas_threads())
            return fn(*args, **kwargs)
        return record
    for module in (multihead, threaded):                       # the textbook pair's, the threads'
        for name in ("split_heads", "merge_heads", "attention_forward", "attention_backward"):
            monkeypatch.setattr(module, name, recording(name, getattr(module, name)))
    mha = na.MultiHeadAttention(16, 2, seed=0)
    x = np.random.default_rng(4).standard_normal((2, 3, 16))
    with threadpool_limits(limits=2, user_api="blas"):        # BLAS's own: two threads
        before = blas_threads()
        assert before == [2] * len(before)
        mha(x, x, x, implementation=engine)
        assert blas_threads() == before
        mha.backward(x)
        assert blas_threads() == before
        calls = dict(seen)
        seen.clear()
        with pytest.raises(ValueError, match="causal"):            # raised inside the hold
            mha(x, x, x, implementation=engine, causal="sideways")
        assert blas_threads() == before and "split_heads" in seen
    one = [1] * len(before)
    if engine == "textbook":                                    # plain calls, BLAS's own threads
        assert calls["split_heads"] == calls["merge_heads"] == [before] * 4
        assert calls["attention_forward"] == calls["attention_backward"] == [before]
    else:
        assert calls["split_heads"] == [one] * 4                # 3 on run_tasks (forward), backward's
        assert calls["merge_heads"] == [one] * 4                # forward's, 3 on run_tasks (backward)
        assert calls["attention_forward"] == calls["attention_backward"] == [one]


def test_a_bias_without_batch_axis_splits_a_batch_of_one_by_kv_head():
    """bias [H, N_q, N_k] on one batch index spans no two slices: the tiled backward runs one
    task per kv head (spans_slices), with the bits of one worker and the textbook's values."""
    from numpy_attention._layout import spans_slices
    q, k, v, dout = (x[:1] for x in inputs(10))
    bias = RNG.standard_normal((4, 5, 7))
    assert not spans_slices(bias, 4, (1, 4, 5, 7)) and spans_slices(bias, 4, (2, 4, 5, 7))
    runs = [run(q, k, v, dout, "tiled", {"bias": bias}, block_size=2, workers=w) for w in (1, 2)]
    for name in runs[0]:
        assert np.array_equal(runs[0][name], runs[1][name]), name
    assert_normwise_equal(run(q, k, v, dout, "textbook", {"bias": bias}), runs[0], RTOL)


def test_workers_belong_to_the_blocked_and_tiled_engines():
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match="workers=2 runs the blocked, tiled or sparse engine on threads"):
        na.attention_forward(q, k, v, workers=2, implementation="textbook")
    with pytest.raises(TypeError, match="workers must be a positive integer"):
        na.attention_forward(q, k, v, workers=1.5)


def test_overlapping_worker_pools_restore_blas_threads():
    """Three threads running workers=2 at once: afterwards BLAS has its thread count back."""
    before = blas_threads()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 256, 32))
    threads = [threading.Thread(target=lambda: na.attention_forward(x, x, x, workers=2)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert blas_threads() == before


def blas_threads():
    """The thread counts of numpy's BLAS (another library's, loaded later, is not limited)."""
    from threadpoolctl import threadpool_info
    numpy_dir = os.path.dirname(os.path.dirname(np.__file__))
    return [pool["num_threads"] for pool in threadpool_info()
            if pool["user_api"] == "blas" and pool["filepath"].startswith(os.path.join(numpy_dir, "numpy"))]


def test_tasks_hold_blas_to_one_thread_for_any_number_of_workers():
    """run_tasks holds BLAS to one thread for one worker too (a product on BLAS's threads can
    round differently from the same product on one), and gives BLAS its threads back."""
    from numpy_attention.engines.parallel import run_tasks
    before = blas_threads()
    assert before and max(before) > 1                      # this machine: several cores
    assert run_tasks(blas_threads, [()] * 3, workers=2) == [[1] * len(before)] * 3
    assert run_tasks(blas_threads, [()], workers=2) == [[1] * len(before)]
    assert run_tasks(blas_threads, [()], workers=1) == [[1] * len(before)]
    assert blas_threads() == before


def test_an_ending_call_leaves_blas_on_one_thread_while_another_runs():
    """Overlapping calls from two threads: the one that ends first does not give BLAS its
    threads back while the other still computes; the last one does."""
    from numpy_attention.engines.parallel import run_tasks
    before, inside, release, seen = blas_threads(), threading.Event(), threading.Event(), []
    def hold():
        inside.set()
        release.wait(10)
        return blas_threads()
    thread = threading.Thread(target=lambda: seen.extend(run_tasks(hold, [()])))
    thread.start()
    assert inside.wait(10)
    assert run_tasks(blas_threads, [()]) == [[1] * len(before)]
    assert blas_threads() == [1] * len(before)             # the other call is still open
    release.set()
    thread.join()
    assert seen == [[1] * len(before)] and blas_threads() == before


def test_a_child_forked_during_a_call_gets_blas_threads_back():
    """A process forked while another thread is inside a call: the child has no call open, so
    its BLAS has its threads, and a call there holds and gives them back as usual."""
    from numpy_attention.engines.parallel import run_tasks
    before, inside, release = blas_threads(), threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: run_tasks(lambda: (inside.set(), release.wait(10)), [()]))
    thread.start()
    try:
        assert inside.wait(10) and blas_threads() == [1] * len(before)
        pid = os.fork()
        if pid == 0:                                       # the child: report by exit code only
            ok = (blas_threads() == before and run_tasks(blas_threads, [()]) == [[1] * len(before)]
                  and blas_threads() == before)
            os._exit(0 if ok else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        release.set()
        thread.join()
    assert blas_threads() == before


def test_a_child_forked_inside_a_call_counts_only_that_call():
    """A task that forks: the child leaves the call it was forked in with BLAS's threads back,
    and its next call holds them again."""
    from numpy_attention.engines.parallel import run_tasks
    before = blas_threads()
    def fork():
        pid = os.fork()
        if pid:
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        ok = blas_threads() == [1] * len(before)           # the child, still inside the call
        return ("child", ok)
    result = run_tasks(fork, [()])[0]
    if isinstance(result, tuple):                          # the child, out of the call
        ok = (result[1] and blas_threads() == before
              and run_tasks(blas_threads, [()]) == [[1] * len(before)] and blas_threads() == before)
        os._exit(0 if ok else 1)
    assert result == 0 and blas_threads() == before


def test_calls_run_on_the_calling_thread_and_reuse_one_pool_of_helpers_per_worker_count():
    """A call on W workers computes on the calling thread and W - 1 helper threads, started
    once per number of workers and kept, not started for every call."""
    from numpy_attention.engines.parallel import run_tasks
    me, seen = threading.current_thread(), {}
    for workers in (2, 3):
        barrier = threading.Barrier(workers)               # W tasks at once: every thread has one
        def thread():                                      # kept alive in `seen`: no id reused
            barrier.wait(10)
            return threading.current_thread()
        calls = [set(run_tasks(thread, [()] * workers, workers)) for _ in range(5)]
        assert all(len(threads) == workers and me in threads for threads in calls)   # the caller too
        seen[workers] = set().union(*calls) - {me}
    assert len(seen[2]) == 1 and len(seen[3]) == 2 and not seen[2] & seen[3]


def test_an_interrupt_in_the_calling_thread_stops_the_call():
    """KeyboardInterrupt (not an Exception) in a task on the calling thread: raised once the
    helper's task in progress ends, the tasks not started are not run."""
    from numpy_attention.engines.parallel import run_tasks
    me, finished = threading.current_thread(), []
    def task(i):
        if threading.current_thread() is me:
            raise KeyboardInterrupt
        time.sleep(0.05)
        finished.append(i)
    with pytest.raises(KeyboardInterrupt):
        run_tasks(task, [(i,) for i in range(8)], 2)
    assert len(finished) <= 1


def test_calls_from_several_threads_sharing_a_pool_give_the_bits_of_one_worker(monkeypatch):
    """Four threads at once, each running forward + backward on two workers: their tasks
    interleave in one pool, and each call returns, complete, the bits of one worker alone
    (500 keys: products that BLAS's own threads would round otherwise)."""
    from concurrent.futures import ThreadPoolExecutor
    monkeypatch.setattr(blocked, "BLOCK_BYTES", 1 << 17)   # many blocks of rows
    rng = np.random.default_rng(21)
    cases = [[rng.standard_normal((1, 4, n, 16)) for n in (96, 500, 500, 96)] for _ in range(8)]
    def step(case, workers):
        q, k, v, dout = case
        out, cache = na.attention_forward(q, k, v, causal="bottom_right", workers=workers)
        return [out, *na.attention_backward(dout, cache)[:3]]
    alone = [step(case, 1) for case in cases]
    def same_bits(i):                                      # compared as soon as the call returns
        return all(np.array_equal(a, b) for a, b in zip(alone[i], step(cases[i], 2), strict=True))
    with ThreadPoolExecutor(4) as users:
        assert all(users.map(same_bits, range(len(cases))))


def test_a_task_that_runs_tasks_runs_them_in_its_own_thread_in_order():
    """Tasks of a task do not wait for the pool it runs in (with every thread of the pool in a
    task, they would wait forever); they run in order in the task's own thread."""
    from numpy_attention.engines.parallel import run_tasks
    def outer(i):
        return run_tasks(lambda j: (i, j, threading.get_ident()), [(j,) for j in range(3)], 2)
    done = []
    thread = threading.Thread(target=lambda: done.append(run_tasks(outer, [(i,) for i in range(4)], 2)),
                              daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and len(done) == 1
    for i, inner in enumerate(done[0]):
        assert [(a, b) for a, b, _ in inner] == [(i, j) for j in range(3)]
        assert len({ident for _, _, ident in inner}) == 1       # the outer task's thread


def test_a_failing_task_raises_after_every_task_of_the_call_is_done():
    from numpy_attention.engines.parallel import run_tasks
    finished = []
    def task(i):
        if i == 0:
            raise ArithmeticError("task 0")
        time.sleep(0.05)
        finished.append(i)
    with pytest.raises(ArithmeticError, match="task 0"):
        run_tasks(task, [(i,) for i in range(4)], 2)
    assert sorted(finished) == [1, 2, 3]


def test_a_helper_stopped_by_more_than_an_exception_stops_the_call():
    """SystemExit (not an Exception) in a task on a helper thread reaches the caller."""
    from numpy_attention.engines.parallel import run_tasks
    me, helper_started = threading.current_thread(), threading.Event()
    def task(i):
        if threading.current_thread() is me:
            helper_started.wait(10)                        # until a helper has taken a task
            return
        helper_started.set()
        raise SystemExit("helper")
    with pytest.raises(SystemExit, match="helper"):
        run_tasks(task, [(i,) for i in range(4)], 2)


def test_a_forked_child_starts_its_own_pool():
    """The parent's pool threads do not exist in a forked child: its calls start new ones
    (a pool carried over would queue the tasks for threads that never run them)."""
    import signal
    from numpy_attention.engines.parallel import run_tasks
    def slow_abs(x):
        time.sleep(0.02)                                   # the other task starts meanwhile
        return abs(x)
    assert run_tasks(slow_abs, [(-1,), (-2,)], 2) == [1, 2]   # the parent's pool, both threads
    pid = os.fork()
    if pid == 0:                                           # the child: report by exit code only
        signal.alarm(20)                                   # a hang ends the child, and fails
        ok = run_tasks(abs, [(-i,) for i in range(6)], 2) == list(range(6))
        os._exit(0 if ok else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.parametrize("engine", ["blocked", "tiled"])
def test_workers_give_the_same_bits_where_blas_threads_would_not(monkeypatch, engine):
    """N_k = 500 keys: OpenBLAS sums a product over k = 500 in other blocks on two threads than
    on one, so one worker with BLAS on its threads would not give the bits of two workers."""
    monkeypatch.setattr(blocked, "BLOCK_BYTES", 1 << 20)   # several blocks of rows
    rng = np.random.default_rng(15)
    q, dout = rng.standard_normal((1, 2, 384, 64)), rng.standard_normal((1, 2, 384, 64))
    k, v = rng.standard_normal((1, 2, 500, 64)), rng.standard_normal((1, 2, 500, 64))
    tiles = {"block_size": 500} if engine == "tiled" else {}
    runs = []
    for workers in (1, 2, 3):
        out, cache = na.attention_forward(q, k, v, workers=workers, implementation=engine, **tiles)
        runs.append([out, *na.attention_backward(dout, cache)[:3]])
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("d_model", [256, 600])
def test_multihead_attention_on_threads_has_the_bits_of_one_thread(d_model):
    """MultiHeadAttention runs its projections as tasks on the attention's threads: the output,
    the weights and every gradient are bitwise those of workers=1 (d_model = 600: products over
    k = 600, which BLAS's threads would sum in other blocks)."""
    rng = np.random.default_rng(14)
    query, key, value, dout = (rng.standard_normal((2, 96, d_model)) for _ in range(4))
    params = na.MultiHeadAttention(d_model, 4, seed=1).params
    runs = []
    for workers in (1, 2, 3):
        out, weights, cache = na.multihead_forward(query, key, value, params, 4, workers=workers, causal=True)
        assert cache.workers == cache.attention.plan.workers == workers
        runs.append([out, weights, *na.multihead_backward(dout, cache).values()])
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert np.array_equal(a, b)


PROJECTION_CASES = {            # (x's shape, W's shape, x's dtype, W's dtype, b's dtype or None)
    "split in 7 blocks": ((4, 1000, 64), (64, 64), np.float64, np.float64, np.float64),
    "odd rows, split in 3": ((1, 3277, 48), (48, 40), np.float64, np.float64, np.float64),
    "dW in 2 blocks": ((2, 600, 1024), (1024, 32), np.float64, np.float64, np.float64),
    "too small to split": ((2, 9, 6), (6, 5), np.float64, np.float64, np.float64),
    "no bias": ((2, 1000, 64), (64, 64), np.float64, np.float64, None),
    "float32": ((2, 1000, 64), (64, 64), np.float32, np.float32, np.float32),
    "complex x, real W": ((2, 1000, 64), (64, 64), np.complex128, np.float64, np.float64),
    "a bias that widens y": ((2, 1000, 64), (64, 64), np.float32, np.float32, np.float64),
}


@pytest.mark.parametrize("case", PROJECTION_CASES)
def test_projections_on_threads_equal_linear(case):
    """engines/projections.py computes y's, dx's and dW's rows in blocks: on 1, 2 and 3 threads
    the same bits (the library's promise: the blocks are cut by size, not by workers), and each
    within the rounding bound of a product of linear_forward / linear_backward's (BLAS may sum
    a block of rows in another order than the whole product: on some processors bitwise, not
    on all); two linears at once, one with a transposed W (the module's weight.T) and a strided
    x; the cache holds x and W themselves; the arguments are left alone."""
    from numpy_attention.engines.parallel import blas_on_one_thread
    from numpy_attention.engines.projections import projections_backward, projections_forward
    x_shape, W_shape, x_dtype, W_dtype, b_dtype = PROJECTION_CASES[case]
    rng = np.random.default_rng(21)
    draw = lambda shape, dtype: (rng.standard_normal(shape) + (1j * rng.standard_normal(shape)
                                 if np.dtype(dtype).kind == "c" else 0)).astype(dtype)
    bias = lambda: None if b_dtype is None else draw(W_shape[1], b_dtype)
    items = [(draw(x_shape, x_dtype), draw(W_shape, W_dtype), bias()),
             (draw(x_shape[:-1] + (2 * W_shape[0],), x_dtype)[..., ::2], draw(W_shape[::-1], W_dtype).T, bias())]
    before = [[np.copy(a) for a in item if a is not None] for item in items]
    with blas_on_one_thread():
        expected = [na.linear_forward(*item) for item in items]
        douts = [draw(y.shape, y.dtype) for y, _ in expected]
        want = [na.linear_backward(dy, cache) for dy, (_, cache) in zip(douts, expected)]
    bounds = [product_error_bounds(*item, dy) for item, dy in zip(items, douts)]
    runs = []
    for workers in (1, 2, 3):
        results = projections_forward(items, workers)
        got = projections_backward([(dy, cache) for dy, (_, cache) in zip(douts, results)], workers)
        runs.append([a for (y, cache), grads in zip(results, got) for a in (y, cache.x, cache.W, *grads)])
        for (y, cache), (y_ref, cache_ref), grads, grads_ref, bound in zip(results, expected, got, want,
                                                                            bounds, strict=True):
            assert cache.has_bias == cache_ref.has_bias and cache.out_shape == cache_ref.out_shape
            assert np.array_equal(cache.x, cache_ref.x) and np.array_equal(cache.W, cache_ref.W)
            for name, g, g_ref in zip(("y", "dx", "dW", "db"), (y, *grads), (y_ref, *grads_ref), strict=True):
                assert (g is None) == (g_ref is None), name
                if g is not None:
                    assert g.dtype == g_ref.dtype and g.shape == g_ref.shape, name
                    assert np.all(np.abs(g - g_ref) <= bound[name]), name
    for other in runs[1:]:
        assert all(a is b is None or np.array_equal(a, b) for a, b in zip(runs[0], other, strict=True))
    for item, saved in zip(items, before):
        assert all(np.array_equal(a, b) for a, b in zip([a for a in item if a is not None], saved))


def product_error_bounds(x, W, b, dy):
    """For each of y = x W + b, dx = dy W^T, dW = x^T dy, db = sum dy, twice the rounding error
    a sum of n products may make in any order, 2 (n + 2) u |a| |b| (u the unit roundoff of the
    result's dtype; + 2 for the bias and a complex product): the most two computations of one
    product may differ by."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    bound = lambda a, c, dtype: (a.shape[-1] + 2) * np.finfo(dtype).eps * (np.abs(a) @ np.abs(c))
    y = bound(x2, W, np.result_type(x, W)).reshape(x.shape[:-1] + W.shape[-1:])   # x W, then + b in y's dtype
    return {"y": y if b is None else y + np.finfo(np.result_type(x, W, b)).eps * np.abs(b),
            "dx": bound(dy2, W.T, np.result_type(dy, W)).reshape(x.shape),
            "dW": bound(x2.T, dy2, np.result_type(x, dy)),
            "db": bound(np.ones((1, len(dy2))), dy2, dy.dtype)[0]}


def test_projections_are_cut_by_size_not_by_workers(monkeypatch):
    """Each product runs as blocks of rows (y's; dx's and dW's in the backward), up to BLOCKS of
    at least MIN_ROWS rows and MIN_BLOCK multiply-adds each, the same blocks for any number of
    workers: threads share the module's projections evenly, with the same bits."""
    from numpy_attention.engines import projections
    tasks = []
    def recording(fn, items, workers):
        tasks.append([(item[0].__name__, item[-1] if isinstance(item[-1], slice) else None)
                      for item in items if item[0] is not np.copyto])
        return run_tasks(fn, items, workers)
    run_tasks = projections.run_tasks
    monkeypatch.setattr(projections, "run_tasks", recording)
    rng = np.random.default_rng(3)
    items = [(rng.standard_normal((2, 1000, 1024)), rng.standard_normal((1024, 64)), rng.standard_normal(64))
             for _ in range(3)]
    for workers in (1, 2, 3):
        results = projections.projections_forward(items, workers)
        projections.projections_backward([(rng.standard_normal((2, 1000, 64)), cache) for _, cache in results],
                                         workers)
    assert tasks[0] == tasks[2] == tasks[4] and tasks[1] == tasks[3] == tasks[5]
    rows = [r for name, r in tasks[0] if name == "_forward_rows"]
    assert len(rows) == 3 * 3 and rows[:3] == [slice(0, 666), slice(666, 1333), slice(1333, 2000)]  # MIN_ROWS
    backward = [(name, r) for name, r in tasks[1]]
    assert [name for name, _ in backward].count("_dx_rows") == 3 * 3
    assert [r for name, r in backward if name == "_dW_rows"][:2] == [slice(0, 512), slice(512, 1024)]
    assert [name for name, _ in backward].count("_dW_rows") == 3 * 2
    assert [name for name, _ in backward].count("sum") == 3
    assert projections._blocks(3 * projections.MIN_ROWS, 1) == [slice(0, 3 * projections.MIN_ROWS)]   # MIN_BLOCK
    assert len(projections._blocks(3 * projections.MIN_ROWS, projections.MIN_BLOCK)) == 3
    assert len(projections._blocks(100 * projections.MIN_ROWS, projections.MIN_BLOCK)) == projections.BLOCKS


def test_projections_backward_computes_the_part_asked_for(monkeypatch):
    """An item (dy, cache, "dx") gives (dx, None, None) and (dy, cache, "dW") gives (None, dW,
    db), each bitwise the whole backward's, on any number of threads, from that part's products
    alone."""
    from numpy_attention.engines import projections
    rng = np.random.default_rng(8)
    items = [(rng.standard_normal((2, 700, 64)), rng.standard_normal((64, 48)), rng.standard_normal(48)),
             (rng.standard_normal((2, 700, 64)), rng.standard_normal((64, 48)), None)]    # no bias
    caches = [cache for _, cache in projections.projections_forward(items, 1)]
    dys = [rng.standard_normal((2, 700, 48)) for _ in items]
    whole = projections.projections_backward(list(zip(dys, caches)), 1)
    names = []
    def recording(fn, tasks, workers):
        names.append(sorted({task[0].__name__ for task in tasks}))
        return run_tasks(fn, tasks, workers)
    run_tasks = projections.run_tasks
    monkeypatch.setattr(projections, "run_tasks", recording)
    for workers in (1, 2):
        dx, dW = (projections.projections_backward([(dy, cache, part) for dy, cache in zip(dys, caches)], workers)
                  for part in ("dx", "dW"))
        for (dx_, no_dW, no_db), (no_dx, dW_, db_), (dx_ref, dW_ref, db_ref) in zip(dx, dW, whole, strict=True):
            assert no_dW is None and no_db is None and no_dx is None
            assert np.array_equal(dx_, dx_ref) and np.array_equal(dW_, dW_ref)
        assert np.array_equal(dW[0][2], whole[0][2]) and dW[1][2] is None and whole[1][2] is None
    assert names == [["_dx_rows"], ["_dW_rows", "sum"]] * 2
    with pytest.raises(ValueError, match="part must be 'dx' or 'dW'"):
        projections.projections_backward([(dys[0], caches[0], "db")], 1)


def test_multihead_backward_puts_dW_o_with_the_input_projections(monkeypatch):
    """The module's backward computes dconcat alone first, and dW_o, db_o (which no step before
    the input projections needs) in the input projections' call, on their threads."""
    import numpy_attention.multihead_threads as threaded
    parts = []
    def recording(items, workers):
        parts.append([item[2] if len(item) > 2 else "all" for item in items])
        return projections_backward(items, workers)
    projections_backward = threaded.projections_backward
    monkeypatch.setattr(threaded, "projections_backward", recording)
    mha = na.MultiHeadAttention(16, 2, seed=0)
    x = np.random.default_rng(5).standard_normal((2, 3, 16))
    mha(x, x, x)
    grads = mha.backward(x)
    assert parts == [["dx"], ["dW", "all", "all", "all"]]
    assert grads["W_o.weight"].shape == (16, 16) and grads["W_o.bias"].shape == (16,)


def test_multihead_attention_checks_workers_before_projecting():
    params = na.MultiHeadAttention(8, 2, seed=0).params
    x = np.zeros((1, 3, 8))
    with pytest.raises(ValueError, match="workers=2 runs the blocked, tiled or sparse engine on threads"):
        na.multihead_forward(x, x, x, params, 2, workers=2, implementation="textbook")
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        na.multihead_forward(x, x, x, params, 2, workers=0)
