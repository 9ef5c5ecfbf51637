"""Nothing is lost: no public function writes into its arguments, caches own their arrays,
and every result is bitwise the same on every call.

- Read-only inputs: every public function is called with arrays whose `writeable` flag is
  off (a write would raise) and gives bitwise the result it gives on writeable copies.
- Caches are immutable from outside: a forward copies the caller's arrays into its cache
  (all but frozen ones: read-only down to the array that owns the memory, like the module's
  weights), and no array of a cache shares memory with a writeable argument or returned
  array. Changing the caller's arrays (or the returned ones) after the forward leaves the
  backward unchanged.
- Determinism: repeated and interleaved calls give bitwise identical results.
"""
import numpy as np
import pytest

import numpy_attention as na

rng = np.random.default_rng(7)


def readonly(x):
    y = np.array(x, copy=True)
    y.flags.writeable = False
    return y


def arrays_in(obj):
    """Every ndarray inside a (nested) cache, grads tuple, dict or list."""
    if isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [a for item in obj for a in arrays_in(item)]
    return []


def assert_bitwise_equal(a, b):
    a, b = arrays_in(a), arrays_in(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y, equal_nan=True)


# ----------------------------------------------------------------------------- the calls

def attention_inputs(n_q=3, n_k=5):
    q = rng.standard_normal((2, 4, n_q, 6))
    k = rng.standard_normal((2, 2, n_k, 6))
    v = rng.standard_normal((2, 2, n_k, 5))
    options = dict(mask=rng.random((n_q, n_k)) > 0.3, bias=rng.standard_normal((4, 1, n_k)),
                   dropout_mask=rng.random((2, 4, n_q, n_k)) > 0.2, dropout_p=0.2,
                   causal="bottom_right", window=(2, -1), softcap=5.0)
    return (q, k, v), options


TILED = ("mask", "bias", "causal", "window")     # the options the tiled path (block_size) takes


def tiled(options, block_size=2):
    return {**{key: options[key] for key in TILED}, "block_size": block_size}


def run_attention(q, k, v, options, dout, method):
    out, cache = na.attention_forward(q, k, v, **options)
    return out, na.attention_backward(dout, cache, method=method, return_stages=True)


def run_mha(query, key, value, mask, dout, state_dict):
    m = na.MultiHeadAttention(8, 2, seed=3)
    m.load_state_dict(state_dict)
    out, weights = m(query, key, value, mask=mask)
    return out, weights, m.backward(dout), m.state_dict()


def public_calls():
    """(id, function, argument arrays): every public entry point with its array arguments."""
    x, W, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    z = rng.standard_normal((3, 6))
    (q, k, v), options = attention_inputs()
    _, lcache = na.linear_forward(x, W, b)
    _, scache = na.softmax_forward(z)
    _, acache = na.attention_forward(q, k, v, **options)
    _, tcache = na.attention_forward(q, k, v, **tiled(options))
    query, key = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
    sd = na.MultiHeadAttention(8, 2, seed=1).state_dict()
    _, _, mcache = na.multihead_forward(query, key, key, sd, 2)
    return [
        ("linear_forward", lambda x, W, b: na.linear_forward(x, W, b), [x, W, b]),
        ("linear_backward", lambda dy: na.linear_backward(dy, lcache), [rng.standard_normal((2, 3, 5))]),
        ("softmax_forward", na.softmax_forward, [z]),
        ("softmax_backward", lambda dp: na.softmax_backward(dp, scache), [rng.standard_normal((3, 6))]),
        ("softmax_jacobian", na.softmax_jacobian, [scache.p]),
        ("logsumexp", na.logsumexp, [z]),
        ("split_heads", lambda x: na.split_heads(x, 2), [x]),
        ("merge_heads", na.merge_heads, [q]),
        ("attention_forward",
         lambda q, k, v, mask, bias, dm: na.attention_forward(
             q, k, v, **{**options, "mask": mask, "bias": bias, "dropout_mask": dm}),
         [q, k, v, options["mask"], options["bias"], options["dropout_mask"]]),
        *[(f"attention_backward-{method}",
           lambda dout, method=method: na.attention_backward(dout, acache, method=method, return_stages=True),
           [rng.standard_normal((2, 4, 3, 5))]) for method in ("vjp", "jacobian", "flash")],
        ("attention_forward-tiled",
         lambda q, k, v, mask, bias: na.attention_forward(q, k, v, **tiled({**options, "mask": mask, "bias": bias})),
         [q, k, v, options["mask"], options["bias"]]),
        *[(f"attention_backward-tiled-{method}",
           lambda dout, method=method: na.attention_backward(dout, tcache, method=method),
           [rng.standard_normal((2, 4, 3, 5))]) for method in ("vjp", "flash")],
        ("multihead_forward",
         lambda query, key, value, mask, *params: na.multihead_forward(
             query, key, value, dict(zip(sd, params)), 2, mask=mask),
         [query, key, key, rng.random((3, 5)) > 0.3, *sd.values()]),
        ("multihead_backward", lambda dout: na.multihead_backward(dout, mcache), [rng.standard_normal((2, 3, 8))]),
        ("MultiHeadAttention",
         lambda query, key, value, mask, dout, *params: run_mha(query, key, value, mask, dout,
                                                                 dict(zip(sd, params))),
         [query, key, key, rng.random((2, 1, 3, 5)) > 0.3, rng.standard_normal((2, 3, 8)), *sd.values()]),
        ("gradcheck",
         lambda x, W, b: tuple(na.gradcheck(na.linear_forward, na.linear_backward, [x, W, b],
                                            method="complex", mode="projection").rows),
         [x[:1, :2], W, b]),
        ("taylor_test",
         lambda x, W, b: na.taylor_test(na.linear_forward, na.linear_backward, [x, W, b]),
         [x, W, b]),
    ]


CALLS = public_calls()


@pytest.mark.parametrize("function, args", [(f, a) for _, f, a in CALLS], ids=[c[0] for c in CALLS])
def test_read_only_inputs_are_accepted_and_left_alone(function, args):
    before = [np.array(a, copy=True) for a in args]
    from_readonly = function(*[readonly(a) for a in args])
    from_writeable = function(*[np.array(a, copy=True) for a in args])
    assert_bitwise_equal(from_readonly, from_writeable)
    function(*args)
    for a, b in zip(args, before):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("function, args", [(f, a) for _, f, a in CALLS], ids=[c[0] for c in CALLS])
def test_results_are_bitwise_identical_across_calls(function, args):
    first = function(*args)
    assert_bitwise_equal(function(*args), first)
    assert_bitwise_equal(function(*args), first)


# ----------------------------------------------------------------------------- caches own their arrays

def forwards():
    """(id, forward's arguments, forward's (out..., cache)) for every op with a cache."""
    x, W, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    z = rng.standard_normal((3, 6))
    (q, k, v), options = attention_inputs()
    query, key = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
    sd = na.MultiHeadAttention(8, 2, seed=1).state_dict()
    mask = rng.random((3, 5)) > 0.3
    return [
        ("linear", [x, W, b], na.linear_forward(x, W, b)),
        ("softmax", [z], na.softmax_forward(z)),
        ("attention", [q, k, v, *options.values()], na.attention_forward(q, k, v, **options)),
        ("attention-2-axes", [q[0, 0], k[0, 0], v[0, 0]], na.attention_forward(q[0, 0], k[0, 0], v[0, 0])),
        ("attention-tiled", [q, k, v, options["mask"], options["bias"]],
         na.attention_forward(q, k, v, **tiled(options))),
        ("multihead", [query, key, mask, *sd.values()], na.multihead_forward(query, key, key, sd, 2, mask=mask)),
    ]


@pytest.mark.parametrize("args, results", [(a, r) for _, a, r in forwards()], ids=[f[0] for f in forwards()])
def test_cache_shares_no_memory_with_arguments_or_results(args, results):
    *outputs, cache = results
    outside = arrays_in(args) + arrays_in(outputs)
    for held in arrays_in(cache):
        for a in outside:
            # a read-only result (multihead's attn_weights, a view of P) cannot change the cache
            assert not np.shares_memory(held, a) or not a.flags.writeable, (held.shape, a.shape)


@pytest.mark.parametrize("implementation", ["textbook", "blocked", "tiled"])
def test_cache_keeps_row_major_copies_of_strided_and_broadcast_inputs(implementation):
    """q, k, v come into the cache as fresh row-major [..., N, d] copies, whatever the caller's
    layout: a transposed view (FlashAttention's [B, N, H, d] memory) or a broadcast stack (as
    gradcheck evaluates perturbations). Each head's matrix then has unit stride for BLAS."""
    q = np.swapaxes(rng.standard_normal((2, 5, 3, 4)), 1, 2)                 # [B, H, N, d] view
    k = np.broadcast_to(rng.standard_normal((1, 3, 6, 4)), (2, 3, 6, 4))      # stride 0 over B
    _, cache = na.attention_forward(q, k, k, implementation=implementation)
    for held, given in ((cache.q, q), (cache.k, k), (cache.v, k)):
        assert held.flags.c_contiguous and held.shape == given.shape
        assert not np.shares_memory(held, given)
        np.testing.assert_array_equal(held, given)


def test_linear_backward_ignores_later_changes_to_x_and_W():
    x, W, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
    dy = rng.standard_normal((2, 3, 5))
    y, cache = na.linear_forward(x, W, b)
    expected = na.linear_backward(dy, cache)
    x[...], W[...], y[...] = 7.0, -3.0, 0.0
    assert_bitwise_equal(na.linear_backward(dy, cache), expected)


def test_softmax_backward_ignores_later_changes_to_z_and_p():
    z, dp = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    p, cache = na.softmax_forward(z)
    expected = na.softmax_backward(dp, cache)
    z[...], p[...] = 0.0, 0.5
    assert_bitwise_equal(na.softmax_backward(dp, cache), expected)


@pytest.mark.parametrize("method, block_size", [("vjp", None), ("jacobian", None), ("flash", None),
                                                ("vjp", 2), ("flash", 2)])
def test_attention_backward_ignores_later_changes_to_every_input_and_output(method, block_size):
    (q, k, v), options = attention_inputs()
    if block_size:
        options = tiled(options, block_size)
    dout = rng.standard_normal((2, 4, 3, 5))
    out, cache = na.attention_forward(q, k, v, **options)
    expected = na.attention_backward(dout, cache, method=method)
    for a in (q, k, v, options["bias"], out):
        a[...] = 1e3
    for key in ("mask", "dropout_mask"):
        if key in options:
            options[key][...] = False
    assert_bitwise_equal(na.attention_backward(dout, cache, method=method), expected)


def test_mha_backward_ignores_later_changes_to_inputs_outputs_and_weights():
    m = na.MultiHeadAttention(8, 2, seed=4)
    query, key = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))
    mask, dout = rng.random((3, 5)) > 0.3, rng.standard_normal((2, 3, 8))
    out, weights = m(query, key, key, mask=mask)
    expected = m.backward(dout)
    for a in (query, key, out):
        a[...] = 2.0
    for a in (weights, *m.params.values()):           # attn_weights is a view of P; the weights are
        with pytest.raises(ValueError, match="read-only"):      # the module's own, kept uncopied
            a[...] = 2.0
    mask[...] = False
    assert_bitwise_equal(m.backward(dout), expected)
    m.load_state_dict(na.MultiHeadAttention(8, 2, seed=5).state_dict())   # new weights, same cache
    assert_bitwise_equal(m.backward(dout), expected)
    m.params = {name: np.full_like(a, 3.0) for name, a in m.params.items()}   # replaced: same cache
    assert_bitwise_equal(m.backward(dout), expected)


def test_the_module_keeps_its_weights_uncopied_and_a_callers_weights_copied():
    """The module's weights are frozen (read-only, owned by it): the caches hold them, no copy.
    A caller's writeable weights, or read-only views of them, are copied: writing into them
    after the forward leaves the backward unchanged."""
    m = na.MultiHeadAttention(8, 2, seed=4)
    query, dout = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 3, 8))
    m(query, query, query)
    for name, child in (("W_q", m._cache.q), ("W_k", m._cache.k), ("W_v", m._cache.v), ("W_o", m._cache.o)):
        assert np.shares_memory(child.W, m.params[f"{name}.weight"])
    for read_only_views in (False, True):
        sd = m.state_dict()                            # writeable copies
        params = {name: a.view() for name, a in sd.items()} if read_only_views else sd
        for a in params.values():
            a.flags.writeable = not read_only_views
        _, _, cache = na.multihead_forward(query, query, query, params, 2)
        expected = na.multihead_backward(dout, cache)
        for a in sd.values():
            a[...] = 2.0                               # in place, into the caller's arrays
        assert_bitwise_equal(na.multihead_backward(dout, cache), expected)


@pytest.mark.parametrize("make, is_frozen", [
    (lambda: readonly(rng.standard_normal((3, 4))), True),                 # read-only, owns its memory
    (lambda: readonly(rng.standard_normal((3, 4))).T, True),               # a view of a frozen array
    (lambda: readonly(rng.standard_normal((3, 4)))[1:], True),
    (lambda: rng.standard_normal((3, 4)), False),                          # writeable
    (lambda: np.broadcast_to(rng.standard_normal(4), (3, 4)), False),      # read-only view, writeable owner
    (lambda: np.frombuffer(bytes(96)).reshape(3, 4), False),               # memory no ndarray owns
])
def test_kept_copies_all_but_frozen_arrays(make, is_frozen):
    from numpy_attention._checks import frozen, kept
    a = make()
    assert frozen(a) is is_frozen
    held = kept(a)
    assert (held is a) is is_frozen
    np.testing.assert_array_equal(held, a)
    if not is_frozen:
        assert not np.shares_memory(held, a) and held.strides == np.empty_like(a, order="K").strides


def test_state_dict_and_load_state_dict_copy():
    m = na.MultiHeadAttention(8, 2, seed=4)
    sd = m.state_dict()
    sd["W_q.weight"][...] = 0.0                               # the caller's copy, not the module's
    assert np.array_equal(m.state_dict()["W_q.weight"], na.MultiHeadAttention(8, 2, seed=4).params["W_q.weight"])
    m.load_state_dict(sd)
    sd["W_q.weight"][...] = 1.0                               # loaded arrays were copied in
    assert np.all(m.params["W_q.weight"] == 0.0)


def test_forward_leaves_the_module_weights_unchanged():
    m = na.MultiHeadAttention(8, 2, seed=4)
    before = m.state_dict()
    query = rng.standard_normal((2, 3, 8))
    m(query, query, query)
    m.backward(rng.standard_normal((2, 3, 8)))
    assert_bitwise_equal(m.state_dict(), before)


@pytest.mark.parametrize("shape, heads", [((2, 1, 4), 2), ((2, 3, 4), 1), ((1, 1, 6), 3), ((3, 2, 6), 3)])
def test_split_and_merge_never_return_a_view_of_their_argument(shape, heads):
    x = rng.standard_normal(shape)
    xh = na.split_heads(x, heads)
    assert not np.shares_memory(xh, x)
    assert not np.shares_memory(na.merge_heads(xh), xh)


def test_interleaved_calls_do_not_influence_each_other():
    """No global state: a call in between with other inputs and options changes nothing."""
    (q, k, v), options = attention_inputs()
    dout = rng.standard_normal((2, 4, 3, 5))
    first = run_attention(q, k, v, options, dout, "flash")
    (q2, k2, v2), options2 = attention_inputs(n_q=4, n_k=4)
    run_attention(q2.astype(np.float32), k2, v2, {**options2, "fully_masked": "nan"},
                  rng.standard_normal((2, 4, 4, 5)), "jacobian")
    assert_bitwise_equal(run_attention(q, k, v, options, dout, "flash"), first)


def test_same_seed_same_module():
    a, b = na.MultiHeadAttention(8, 2, seed=11), na.MultiHeadAttention(8, 2, seed=11)
    assert_bitwise_equal(a.state_dict(), b.state_dict())
    assert not np.array_equal(a.params["W_q.weight"], na.MultiHeadAttention(8, 2, seed=12).params["W_q.weight"])


# ----------------------------------------------------------------------------- every forward that returns a cache

def scribble(a):
    """Write other values over the array a, in place (a caller reusing its buffer)."""
    if a.dtype == bool:
        a[...] = ~a
    elif a.dtype.kind in "iu":
        a[...] = 0
    else:
        a[...] = 7.0


def _attention_call(engine, **fixed):
    """attention_forward on arrays passed by name, the engine's options and `fixed` (non-arrays)."""
    return lambda q, k, v, **arrays: na.attention_forward(q, k, v, **engine, **fixed, **arrays)


def cached_forwards():
    """(id, {argument name: array}, forward(**arrays) -> (results..., cache), backward(dout, cache)):
    every forward that returns a cache, with every array argument it takes (score_mod's
    parameters and rope's positions inside their dicts)."""
    (q, k, v), _ = attention_inputs()
    bias, mask = rng.standard_normal((4, 3, 5)), rng.random((3, 5)) > 0.3
    heads = {"sinks": rng.standard_normal(4), "alibi_slopes": rng.uniform(0, 1, 4)}
    mod = lambda s, b, h, i, j, p: s + p["rel"][h, i - j + 4]
    cu_q, cu_k = np.array([0, 1, 3]), np.array([0, 2, 5])
    attention_backward = lambda dout, cache: na.attention_backward(dout, cache)
    calls = []
    for engine in ({"implementation": "textbook"}, {"implementation": "blocked"}, {"block_size": 2}):
        name = engine.get("implementation", "tiled")
        arrays = dict(q=q, k=k, v=v, mask=mask, bias=bias, **heads,
                      **({} if name == "tiled" else {"dropout_mask": rng.random((3, 5)) > 0.2}))
        calls.append((f"attention-{name}", arrays,
                      lambda q, k, v, rel, positions, engine=engine, **arrays: na.attention_forward(
                          q, k, v, **engine, **arrays, dropout_p=0.2 if "dropout_mask" in arrays else 0.0,
                          score_mod=mod, score_mod_params={"rel": rel},
                          rope={"layout": "half", "positions_q": positions[:3], "positions_k": positions}),
                      attention_backward))
        calls[-1][1].update(rel=rng.standard_normal((4, 8)), positions=np.arange(5) * 7.0)
        calls.append((f"attention-packed-{name}", dict(q=q[0, :, :3], k=k[0, :, :5], v=v[0, :, :5], cu_seqlens_q=cu_q,
                                                        cu_seqlens_k=cu_k, seqused_k=np.array([1, 3])),
                      _attention_call(engine, causal=True), attention_backward))
    pages = dict(q=rng.standard_normal((2, 4, 1, 6)), k=rng.standard_normal((3, 2, 4, 6)),
                 v=rng.standard_normal((3, 2, 4, 5)), page_table=np.array([[2, 0], [1, 2]]),
                 cache_seqlens=np.array([6, 3]))
    calls.append(("attention-paged", pages, _attention_call({}), attention_backward))
    indices = rng.integers(-1, 6, (2, 2, 3, 4))
    calls.append(("sparse", dict(q=q, k=k, v=v, indices=indices, topk_length=np.array([[4, 2, 3], [1, 4, 4]])),
                  lambda **a: na.sparse_attention_forward(**a, block_rows=2), na.sparse_attention_backward))
    calls.append(("mla", dict(q=rng.standard_normal((2, 4, 3, 10)), kv=rng.standard_normal((2, 1, 5, 10))),
                  lambda q, kv: na.mla_forward(q, kv, rope_dim=4, rope={"layout": "interleaved"}), na.mla_backward))
    calls.append(("mla-unabsorbed", dict(q_nope=rng.standard_normal((2, 4, 3, 6)), q_pe=rng.standard_normal((2, 4, 3, 4)),
                                         c_kv=rng.standard_normal((2, 5, 8)), k_pe=rng.standard_normal((2, 5, 4)),
                                         w_uk=rng.standard_normal((4, 8, 6)), w_uv=rng.standard_normal((4, 8, 5))),
                  lambda **a: na.mla_unabsorbed_forward(**a, rope={"layout": "half"}), na.mla_unabsorbed_backward))
    calls.append(("rope", dict(x=rng.standard_normal((2, 5, 8)), positions=np.arange(5.0)),
                  lambda x, positions: na.rope_forward(x, positions, scaling={"type": "linear", "factor": 2.0}),
                  na.rope_backward))
    calls.append(("linear", dict(x=rng.standard_normal((2, 3, 4)), W=rng.standard_normal((4, 5)), b=rng.standard_normal(5)),
                  na.linear_forward, na.linear_backward))
    calls.append(("softmax", dict(z=rng.standard_normal((3, 6))), na.softmax_forward, na.softmax_backward))
    calls.append(("combine", dict(outs=rng.standard_normal((3, 2, 4, 5)), lses=rng.standard_normal((3, 2, 4))),
                  na.combine_forward, na.combine_backward))
    sd = na.MultiHeadAttention(8, 2, seed=1).state_dict()
    calls.append(("multihead", dict(query=rng.standard_normal((2, 3, 8)), key=rng.standard_normal((2, 5, 8)),
                                    mask=rng.random((3, 5)) > 0.3, bias=rng.standard_normal((3, 5)), **sd),
                  lambda query, key, mask, bias, **params: na.multihead_forward(query, key, key, params, 2, mask=mask,
                                                                                 bias=bias),
                  na.multihead_backward))
    return calls


CACHED = cached_forwards()


@pytest.mark.parametrize("arrays, forward, backward", [c[1:] for c in CACHED], ids=[c[0] for c in CACHED])
def test_writing_into_every_argument_and_result_after_the_forward_leaves_the_backward(arrays, forward, backward):
    """A cache never aliases an array the caller can still write: every argument array (and every
    result) written over after the forward, the backward is bitwise what it was."""
    arrays = {name: np.array(a, copy=True) for name, a in arrays.items()}
    *results, cache = forward(**arrays)
    dout = np.random.default_rng(5).standard_normal(results[0].shape)
    expected = backward(dout, cache)
    for a in list(arrays.values()) + [r for r in results if r.flags.writeable]:
        scribble(a)
    assert_bitwise_equal(backward(dout, cache), expected)
    for held in arrays_in(cache):
        for a in list(arrays.values()) + results:
            assert not np.shares_memory(held, a) or not a.flags.writeable, (held.shape, a.shape)
