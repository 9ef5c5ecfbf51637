"""The tiled engine, sparse attention and crosscheck on a Dask cluster: a LocalCluster of two worker processes
gives bitwise the results of a local run, forward, backward, JVP and a large crosscheck (its
oracle and its baselines in slices). The tests that need no cluster run without dask."""
import os
import socket
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from layouts import grouped_inputs
from optional import DASK_REASON

import numpy_attention as na
from numpy_attention.commands.cli import main
from numpy_attention.engines.plan import check_scheduler
from numpy_attention.oracle import row_blocks as blocks, crosscheck, save_case, split_case
from numpy_attention.oracle.runs import _baseline, case_ways, ways_by_forward
from numpy_attention.oracle.slices import case_slices, put_together

SIZES = (40, 56, 8, 6)        # grouped_inputs' N_q, N_k, d, d_v: 4 slices of the backward
RNG = np.random.default_rng(3)
OPTIONS = {
    "plain": {},
    "causal bottom_right": {"causal": "bottom_right"},
    "mask and window": {"mask": RNG.random((2, 1, 40, 56)) < 0.7, "window": (9, 3)},
    "bias per head": {"bias": RNG.standard_normal((2, 4, 40, 56))},
    "bias broadcast (one task)": {"bias": RNG.standard_normal((40, 56))},
    "alibi and sinks": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]),
                        "sinks": np.array([0.3, -1.0, 0.0, 2.0])},
    "score_mod and mask_mod": {"score_mod": lambda s, b, h, i, j, p: s / p["t"] + p["rel"][h, i - j + 55],
                               "score_mod_params": {"t": np.array(1.1), "rel": RNG.standard_normal((4, 95))},
                               "mask_mod": lambda b, h, i, j: (i + j) % 5 != 0},
    "top-k lists, topk_length": {"topk_indices": RNG.integers(-1, 60, (2, 2, 40, 12)),
                                 "topk_length": RNG.integers(0, 13, (2, 40))},
}
# crosscheck's baselines in slices (oracle/slices.py): options -> (batch size, slices)
SLICED = {
    "plain": ({}, 2, 4),
    "mask, causal": ({"mask": RNG.random((2, 1, 40, 56)) < 0.7, "causal": True}, 2, 4),
    "window": ({"window": (9, 3)}, 2, 4),
    "bias per head": ({"bias": RNG.standard_normal((2, 4, 40, 56))}, 2, 4),
    "bias broadcast": ({"bias": RNG.standard_normal((40, 56))}, 2, 1),
    "alibi per batch and head": ({"alibi_slopes": RNG.uniform(0, 1, (2, 4))}, 2, 4),
    "sinks broadcast over the batch": ({"sinks": np.array([0.3, -1.0, 0.0, 2.0])}, 2, 1),
    "sinks, one batch index": ({"sinks": np.array([0.3, -1.0, 0.0, 2.0])}, 1, 2),
    "top-k lists per kv head": ({"topk_indices": RNG.integers(-1, 60, (2, 2, 40, 12))}, 2, 4),
    "top-k lists per query head, topk_length": ({"topk_indices": RNG.integers(-1, 60, (2, 4, 40, 12)),
                                                 "topk_length": RNG.integers(0, 13, (2, 40))}, 2, 4),
}


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed", reason=DASK_REASON)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        yield client


def results(scheduler, options):
    q, k, v, dout, _ = grouped_inputs(0, *SIZES)
    out, cache = na.attention_forward(q, k, v, block_size=16, workers=1, scheduler=scheduler, **options)
    grads = na.attention_backward(dout, cache)
    tangents = grouped_inputs(1, *SIZES)[:3]
    jvp = na.attention_jvp(q, k, v, *tangents, block_size=16, workers=1, scheduler=scheduler, **options)
    return [out, cache.lse, grads.dq, grads.dk, grads.dv, grads.dbias, grads.dalibi_slopes, grads.dsinks, *jvp,
            *(grads.dscore_mod_params or {}).values()]


@pytest.mark.parametrize("option", OPTIONS)
def test_the_tiled_engine_on_a_cluster_gives_the_local_bits(client, option):
    local, remote = results(None, OPTIONS[option]), results(client, OPTIONS[option])
    for a, b in zip(local, remote):
        assert (a is None and b is None) or np.array_equal(a, b)


def sparse_results(scheduler):
    q, k, v, dout, _ = grouped_inputs(0, *SIZES)
    indices = np.random.default_rng(4).integers(-1, 60, (2, 2, 40, 9))
    out, lse, top, cache = na.sparse_attention_forward(q, k, v, indices, block_rows=16, scheduler=scheduler)
    tangents = grouped_inputs(1, *SIZES)[:3]
    jvp = na.sparse_attention_jvp(q, k, v, indices, *tangents, block_rows=16, scheduler=scheduler)
    return [out, lse, top, *na.sparse_attention_backward(dout, cache), *jvp]


def test_sparse_attention_on_a_cluster_gives_the_local_bits(client):
    for a, b in zip(sparse_results(None), sparse_results(client)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("empty", ["K = 0", "N_q = 0", "B = 0"])
def test_sparse_attention_with_an_empty_axis_on_a_cluster_gives_the_local_results(client, empty):
    q, k, v, dout, _ = grouped_inputs(0, *SIZES)
    indices = np.random.default_rng(4).integers(-1, 60, (2, 2, 40, 9))
    if empty == "K = 0":
        indices = indices[..., :0]
    elif empty == "N_q = 0":
        q, dout, indices = q[..., :0, :], dout[..., :0, :], indices[..., :0, :]
    else:
        q, k, v, dout, indices = q[:0], k[:0], v[:0], dout[:0], indices[:0]
    runs = []
    for scheduler in (None, client):
        out, lse, top, cache = na.sparse_attention_forward(q, k, v, indices, block_rows=16, scheduler=scheduler)
        jvp = na.sparse_attention_jvp(q, k, v, indices, q, k, v, block_rows=16, scheduler=scheduler)
        runs.append([out, lse, top, *na.sparse_attention_backward(dout, cache), *jvp])
    for a, b in zip(*runs):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_the_tiled_engine_with_no_query_row_on_a_cluster_gives_the_local_results(client):
    """N_q = 0: no task at all, on a cluster as locally (Dask's scatter of no data once failed)."""
    q, k, v, dout, _ = grouped_inputs(0, *SIZES)
    runs = []
    for scheduler in (None, client):
        out, cache = na.attention_forward(q[..., :0, :], k, v, block_size=16, scheduler=scheduler)
        runs.append([out, *na.attention_backward(dout[..., :0, :], cache)[:3]])
    for a, b in zip(*runs):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_an_address_opens_a_client_for_the_call(client):
    q, k, v, _, _ = grouped_inputs(0, *SIZES)
    out, _ = na.attention_forward(q, k, v, causal=True, block_size=16, scheduler=client.scheduler.address)
    assert np.array_equal(out, na.attention_forward(q, k, v, causal=True, block_size=16)[0])


def test_a_scheduler_is_checked():
    q, k, v, _, _ = grouped_inputs(0, *SIZES)
    with pytest.raises(TypeError, match="scheduler must be a dask.distributed Client or a scheduler's address"):
        na.attention_forward(q, k, v, block_size=16, scheduler=8786)
    with pytest.raises(ValueError, match="scheduler must be a scheduler's address"):
        na.attention_forward(q, k, v, block_size=16, scheduler=" ")
    with pytest.raises(ValueError, match="scheduler= runs the tiled or sparse engine's slices on a Dask cluster"):
        na.attention_forward(q, k, v, scheduler="tcp://127.0.0.1:8786")
    with pytest.raises(TypeError, match="scheduler must be"):
        crosscheck(q=q, k=k, v=v, out=q[..., :6], scheduler=object())


def large_case(tmp_path=None, options=None, batch=2):
    """A float32 case with gradients (causal, or `options`), judged on the tiled oracle (the
    score budget set below its batch * 4 * 40 * 56 scores), the candidate our float64
    attention rounded."""
    options = {"causal": True} if options is None else options
    q, k, v, dout = (x[:batch].astype(np.float32) for x in grouped_inputs(0, *SIZES)[:4])
    out, cache = na.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), **options)
    grads = na.attention_backward(dout.astype(np.float64), cache)
    arrays = dict(q=q, k=k, v=v, dout=dout, **options, out=out.astype(np.float32),
                  lse=cache.lse.astype(np.float32), dq=grads.dq.astype(np.float32),
                  dk=grads.dk.astype(np.float32), dv=grads.dv.astype(np.float32))
    arrays.update({f"d{name}": getattr(grads, f"d{name}").astype(np.float32)
                   for name in ("bias", "sinks", "alibi_slopes") if name in options})
    if tmp_path is not None:
        save_case(tmp_path / "case.npz", **arrays)
    return arrays


@pytest.mark.parametrize("gradients", [True, False])
@pytest.mark.parametrize("option", ["mask, causal", "bias per head", "alibi per batch and head",
                                    "sinks broadcast over the batch", "sinks, one batch index",
                                    "top-k lists per kv head", "top-k lists per query head, topk_length"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_crosscheck_of_a_large_case_on_a_cluster_gives_the_local_report(client, monkeypatch, precision,
                                                                         option, gradients):
    """bfloat16: the candidate's results rounded to bfloat16 (held as float32 values). Without
    gradients a case is cut in slices even where an option broadcasts (sinks over the batch)."""
    monkeypatch.setattr(blocks, "SCORE_BUDGET", 1000)
    options, batch, _ = SLICED[option]
    arrays = large_case(options=options, batch=batch)
    if not gradients:
        arrays = {name: x for name, x in arrays.items()
                  if name not in ("dout", "dq", "dk", "dv", "dbias", "dsinks", "dalibi_slopes")}
    if precision == "bfloat16":
        arrays = {name: x.astype(ml_dtypes.bfloat16).astype(np.float32) if name != "lse" and
                  isinstance(x, np.ndarray) and x.dtype == np.float32 else x for name, x in arrays.items()}
    local = crosscheck(precision=precision, **arrays)
    remote = crosscheck(precision=precision, scheduler=client, **arrays)
    assert local and remote.to_json() == local.to_json()


def test_the_command_takes_a_scheduler(client, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(blocks, "SCORE_BUDGET", 1000)
    large_case(tmp_path)
    assert main(["crosscheck", str(tmp_path / "case.npz")]) == 0
    local = capsys.readouterr().out
    assert main(["crosscheck", str(tmp_path / "case.npz"), "--scheduler", client.scheduler.address]) == 0
    assert capsys.readouterr().out == local


def test_the_command_without_dask_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    import importlib.util
    large_case(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "distributed" else real(name))
    assert main(["crosscheck", str(tmp_path / "case.npz"), "--scheduler", "tcp://127.0.0.1:8786"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs dask.distributed" in err




def long_case(path):
    """A case of more than SCORE_BUDGET scores (the oracle would run in slices on the cluster),
    q = k = v = out [1, 1, 4200, 4] float32 (the verdict does not matter: it is never reached)."""
    q = np.random.default_rng(5).standard_normal((1, 1, 4200, 4)).astype(np.float32)
    assert 4200 ** 2 > blocks.SCORE_BUDGET
    save_case(path, q=q, k=q, v=q, out=q)
    return str(path)


def crosscheck_process(case, address, **env):
    """`numpy-attention crosscheck CASE --scheduler ADDRESS` in a process of its own, `env` added."""
    return subprocess.run([sys.executable, "-m", "numpy_attention", "crosscheck", case, "--scheduler", address],
                          capture_output=True, text=True, timeout=30, env={**os.environ, **env})


@pytest.mark.slow
@pytest.mark.parametrize("address", ["not-an-address", "tcp://host", "tcp://host:x", "nosuch://host:8786"])
def test_an_address_that_is_none_fails_at_once_with_one_line(address, tmp_path):
    """Not a dask address: one line and exit 2 within seconds, nothing after it (a Client opened on
    such an address fails half made, and its clean-up at exit waited 60 s, then printed a traceback)."""
    pytest.importorskip("distributed", reason=DASK_REASON)
    run = crosscheck_process(long_case(tmp_path / "long.npz"), address)
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"scheduler {address!r} is not a scheduler's address such as 'tcp://host:8786'" in run.stderr
    with pytest.raises(ValueError, match="is not a scheduler's address"):
        check_scheduler(address)


@pytest.mark.slow
def test_an_address_where_no_scheduler_answers_fails_with_one_line(tmp_path):
    """After dask's connect timeout (2 s here, 30 s by default): one line, exit 2, nothing after it
    (before it, the large case's progress line)."""
    pytest.importorskip("distributed", reason=DASK_REASON)
    with socket.socket() as free:                       # a port nothing listens on once closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run = crosscheck_process(long_case(tmp_path / "long.npz"), f"tcp://127.0.0.1:{port}",
                             DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT="2s")
    assert run.returncode == 2 and run.stdout == "", run
    *progress, last = run.stderr.splitlines()
    assert "Timed out trying to connect" in last and run.stderr.endswith("\n"), run.stderr
    assert all(line.startswith("numpy-attention crosscheck: a case of") for line in progress), run.stderr


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("option", SLICED)
def test_the_baselines_in_slices_put_together_are_the_whole_ones(option, precision):
    """oracle/slices.py: each (batch index, kv head) slice's baselines, put together, are
    bitwise the whole case's (or the case stays whole when a gradient sums over slices)."""
    options, batch, count = SLICED[option]
    storage = np.float32 if precision == "float32" else ml_dtypes.bfloat16
    q, k, v, dout = (x[:batch].astype(storage) for x in grouped_inputs(0, *SIZES)[:4])
    case = split_case(dict(q=q, k=k, v=v, dout=dout, out=q[..., :6], precision=precision, **options))
    slices = case_slices(case)
    assert len(slices) == count
    assert_slices_put_together_are_whole(case, slices, gradients=True)


def assert_slices_put_together_are_whole(case, slices, gradients):
    """Each way's baselines of the slices, put together, bitwise those of the whole case."""
    groups = ways_by_forward(case_ways(case, gradients))               # the ways of each forward, computed together
    by_way = lambda c: {way: result for group in groups
                        for way, result in zip(group, _baseline(c, group, gradients, 32))}
    whole = by_way(case)
    pieces = [by_way(piece) for _, piece in slices]
    for way, expected in whole.items():
        got = put_together(case, [at for at, _ in slices], [piece[way] for piece in pieces])
        assert got.keys() == expected.keys()
        for name in expected:
            assert np.array_equal(got[name], expected[name], equal_nan=True), name


@pytest.mark.parametrize("option", ["bias broadcast", "sinks broadcast over the batch"])
def test_a_case_without_gradients_is_cut_even_where_an_option_broadcasts(option):
    """No gradient sums over the slices without dout: the case is cut in (batch, kv head)
    slices, whose forward baselines put together are bitwise the whole case's."""
    options, batch, _ = SLICED[option]
    q, k, v, _ = (x[:batch].astype(np.float32) for x in grouped_inputs(0, *SIZES)[:4])
    case = split_case(dict(q=q, k=k, v=v, out=q[..., :6], **options))
    slices = case_slices(case)
    assert len(slices) == batch * k.shape[-3]
    assert_slices_put_together_are_whole(case, slices, gradients=False)
