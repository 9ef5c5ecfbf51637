"""The naive baseline's sums (oracle/naive.py): over the head width left to right in float32,
over the keys and the rows in float64 chunks of 32 terms at fixed positions, rounded and
added left to right in float32; exp and log in float64. Checked bit for bit against the
rule written as plain loops, with chunks of masked keys skipped or not, and under another
SIMD level of numpy."""
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention import scores
from numpy_attention.score_grads import ScoreGrads
from numpy_attention.softmax_row import masked_row_weight, with_sink
from numpy_attention.oracle import naive
from numpy_attention.oracle.naive import naive_attention

F32, F64 = np.float32, np.float64
CHUNK = 32


def chain(a, b):
    """a @ b [..., m, n] @ [..., n, p], each dot product summed left to right in float32."""
    acc = np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), F32)
    for i in range(a.shape[-1]):
        acc = acc + a[..., :, i:i + 1] * b[..., i:i + 1, :]
    return acc


def chunked(terms, n, sums=1):
    """The sum of terms(j, t) over j < sums, then t < n: each chunk of CHUNK terms (t at fixed
    positions 0..31, 32..63, ... for each j) summed in float64 one by one, rounded to float32,
    the chunks' sums added left to right in float32 from +0."""
    acc = F32(0)
    for j in range(sums):
        for start in range(0, n, CHUNK):
            part = F64(0)
            for t in range(start, min(start + CHUNK, n)):
                part = part + terms(j, t)
            acc = acc + part.astype(F32)
    return acc


def exp32(x):
    return np.exp(x.astype(F64)).astype(F32)


def reference(q, k, v, o, dout):
    """The naive baseline's rule in plain loops, whole arrays, every key computed: q, dout
    [B, H, N_q, d], k, v [B, H_kv, N_k, d] in float32; dict as naive_attention's."""
    B, H, n_q, _ = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    G = H // h_kv
    kh, vh = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)         # each query head's k, v
    shape = (B, H, n_q, n_k)
    s, saved = scores.forward(chain(q * o.scale, np.swapaxes(kh, -1, -2)), o, shape)
    s_row = with_sink(s, o, shape)
    m = np.max(s_row, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isneginf(m), 0, m)
    e = exp32(s_row - m)
    e64 = e.astype(F64)
    total = chunked(lambda _, t: e64[..., t:t + 1], n_k)
    if o.sinks is not None:
        total = total + e[..., n_k:]
    dead = total == 0
    fill = masked_row_weight(o.fully_masked, n_k)
    p_row = np.where(dead, fill, e / np.where(dead, 1, total)).astype(F32)
    p, p_sink = p_row[..., :n_k], p_row[..., n_k:]
    with np.errstate(divide="ignore"):
        lse = (m + np.log(total.astype(F64)).astype(F32))[..., 0]
    drop = None if o.dropout_scale is None else np.broadcast_to(o.dropout_scale, shape)
    p_drop = p if drop is None else (p * drop).astype(F32)
    over_keys = lambda a, b: chunked(lambda _, t: a[..., :, t, None].astype(F64) * b[..., t, None, :].astype(F64), n_k)
    out = over_keys(p_drop, vh)
    with np.errstate(invalid="ignore"):
        p = np.where(dead, p, exp32(s - lse[..., None]))
    p_drop = p if drop is None else (p * drop).astype(F32)
    dp = chain(dout, np.swapaxes(vh, -1, -2))
    dp = dp if drop is None else (dp * drop).astype(F32)
    D = chain(dout * out, np.ones((dout.shape[-1], 1), F32))
    dsinks = np.zeros((B, H), F32)                                    # summed a tile of rows at a time
    for r in range(0, n_q, CHUNK):
        dsinks += -np.sum(p_sink[..., r:r + CHUNK, :] * D[..., r:r + CHUNK, :], axis=(-2, -1))
    grads = ScoreGrads(o, shape, F32)
    ds = scores.backward(p * (dp - D), o, shape, saved=saved, grads=grads)
    dq = o.scale * over_keys(ds, kh)
    grouped = lambda x: x.reshape(B, h_kv, G, n_q, x.shape[-1])      # kv head, its query heads g
    over_rows = lambda a, b: chunked(lambda g, t: a[:, :, g, t, :, None].astype(F64)   # head 0's rows,
                                     * b[:, :, g, t, None, :].astype(F64), n_q, G)     # head 1's, ...
    dk = o.scale * over_rows(grouped(ds), grouped(q))
    dv = over_rows(grouped(p_drop), grouped(dout))
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv,
            **{name: g for name, g in ScoreGrads.total([grads], o, shape, F32).items() if g is not None},
            "dsinks": None if o.sinks is None else scores.head_gradient(dsinks, o.sinks)}


def inputs(rng, n_q=70, n_k=90, h=4, h_kv=2, d=16):
    return (rng.standard_normal((2, h, n_q, d)), rng.standard_normal((2, h_kv, n_k, d)),
            rng.standard_normal((2, h_kv, n_k, d)), rng.standard_normal((2, h, n_q, d)))


def cases(rng):
    """{name: (shapes, options)}: options of every kind the baseline sums around."""
    mask = rng.random((70, 90)) < 0.7
    mask[3] = False                                                   # a fully masked row
    blocks = np.kron(np.array([[1, 0, 1], [1, 1, 0], [0, 0, 0]], bool), np.ones((32, 32), bool))[:70, :90]
    return {
        "none": ({}, {}),
        "causal, GQA": ({}, {"causal": True}),
        "causal bottom_right, window": ({}, {"causal": "bottom_right", "window": (20, 0)}),
        "mask with a fully masked row": ({}, {"mask": mask}),
        "mask of whole chunks, two runs": ({}, {"mask": blocks}),       # rows 64..69: none kept
        "mask, uniform rows": ({}, {"mask": mask, "fully_masked": "uniform"}),
        "bias per head, scale": ({}, {"bias": rng.standard_normal((4, 70, 90)), "scale": 0.4}),
        "bias broadcast over rows": ({}, {"bias": rng.standard_normal((2, 1, 1, 90))}),
        "bias with -inf": ({}, {"bias": np.where(rng.random((70, 90)) < 0.2, -np.inf, 0.0), "causal": True}),
        "softcap, dropout": ({}, {"softcap": 3.0, "dropout_mask": rng.random((2, 4, 70, 90)) < 0.8,
                                  "dropout_p": 0.2}),
        "sinks, causal": ({}, {"sinks": rng.standard_normal(4), "causal": True}),
        "N_k = 1": ({"n_k": 1}, {}),
        "N = 64, no GQA": ({"n_q": 64, "n_k": 64, "h_kv": 4}, {"causal": True}),
    }


CASES = cases(np.random.default_rng(0))


def record(name, rng):
    shapes, opts = CASES[name]
    q, k, v, dout = (x.astype(F32) for x in inputs(rng, **shapes))
    opts = {key: x.astype(F32) if key in ("bias", "sinks") else x for key, x in opts.items()}
    return na.attention_options(q, k, v, **opts), dout


def assert_same_bits(got, want, skip=()):
    assert set(want) - set(skip) <= set(got)
    for name in set(want) - set(skip):
        assert got[name].dtype == want[name].dtype, name
        assert np.array_equal(got[name], want[name], equal_nan=True), (name, np.nanmax(np.abs(got[name] - want[name])))


@pytest.mark.parametrize("name", list(CASES))
def test_the_baseline_is_its_rule_in_plain_loops(name):
    """Forward and backward bit for bit (but the dbias of a bias broadcast along the heads or
    the rows: the baseline sums them a tile at a time, the same to rounding)."""
    (q, k, v, o), dout = record(name, np.random.default_rng(1))
    got = naive_attention(q, k, v, o, dout=dout)
    want = reference(q, k, v, o, dout)
    broadcast = o.bias is not None and np.shape(o.bias)[-3:-1] != q.shape[-3:-1]
    assert_same_bits(got, {n: x for n, x in want.items() if x is not None}, skip=("dbias",) if broadcast else ())
    if broadcast:
        np.testing.assert_allclose(got["dbias"], want["dbias"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["causal, GQA", "mask of whole chunks, two runs", "bias with -inf",
                                  "sinks, causal"])
def test_skipping_masked_chunks_gives_the_bits_of_computing_them(name, monkeypatch):
    (q, k, v, o), dout = record(name, np.random.default_rng(2))
    skipped = naive_attention(q, k, v, o, dout=dout)
    runs, _ = naive.kept_runs(o, (2, 4, 70, 90), (Ellipsis, slice(0, None, 2), slice(0, 32)))
    assert sum(run.stop - run.start for run in runs) < 90              # the first tile skips keys
    monkeypatch.setattr(naive, "_skips_chunks", lambda options, n_k: False)
    assert_same_bits(naive_attention(q, k, v, o, dout=dout), skipped)


def test_kept_runs_are_the_chunks_with_a_kept_score():
    """Causal: a tile of rows 0..31 computes keys 0..31, rows 32..63 keys 0..63; a mask of whole
    chunks gives a run per stretch of kept chunks; nothing kept: one empty run."""
    o = na.attention_options(*(np.zeros((1, 2, 100, 4), F32),) * 3, causal=True)[-1]
    shape, tile = (1, 2, 100, 100), lambda r: (Ellipsis, slice(0, None, 1), slice(r, r + 32))
    assert naive.kept_runs(o, shape, tile(0))[0] == [slice(0, 32)]
    assert naive.kept_runs(o, shape, tile(32))[0] == [slice(0, 64)]
    assert naive.kept_runs(o, shape, tile(96))[0] == [slice(0, 100)]
    mask = np.zeros((100, 100), bool)
    mask[40:64, [3, 70, 99]] = True
    o = na.attention_options(*(np.zeros((1, 2, 100, 4), F32),) * 3, mask=mask)[-1]
    assert naive.kept_runs(o, shape, tile(32))[0] == [slice(0, 32), slice(64, 100)]
    assert naive.kept_runs(o, shape, tile(0))[0] == [slice(0, 0)]


CHILD = """
import hashlib, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import test_naive_chunks as t
(q, k, v, o), dout = t.record("causal, GQA", np.random.default_rng(3))
got = t.naive_attention(q, k, v, o, dout=dout)
print(hashlib.sha256(b"".join(got[n].tobytes() for n in sorted(got))).hexdigest())
"""


@pytest.mark.slow
def test_the_bits_do_not_depend_on_numpys_simd_level():
    """exp and log in float64: the same bits with numpy's AVX2 and FMA3 code switched off
    (NPY_DISABLE_CPU_FEATURES="X86_V3"; numpy's float32 exp and log then round differently)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": "X86_V3"}
    child = subprocess.run([sys.executable, "-c", CHILD, here], env=env, capture_output=True, text=True, check=True)
    (q, k, v, o), dout = record("causal, GQA", np.random.default_rng(3))
    got = naive_attention(q, k, v, o, dout=dout)
    assert child.stdout.split() == [hashlib.sha256(b"".join(got[n].tobytes() for n in sorted(got))).hexdigest()]
