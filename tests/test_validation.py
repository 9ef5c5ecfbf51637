"""Every bad input to a public entry point gets a ValueError or TypeError naming the argument.

One parametrized table, BAD_INPUTS: each case is a call with one thing wrong, the exception
type it must raise (exactly ValueError or TypeError, never an IndexError, KeyError,
ZeroDivisionError or AttributeError from deep inside), and the fragments its message must
contain: the argument's name and, for shape errors, the expected and the actual shapes.
`pytest -q tests/test_validation.py -v` lists one id per distinct bad input; the README's
"Reliability" section quotes their number (test_the_table_is_large_enough keeps it honest).
"""
import inspect

import numpy as np
import pytest

import numpy_attention as na
from numpy_attention.commands import cli

rng = np.random.default_rng(0)
Q = rng.standard_normal((2, 4, 3, 8))          # [B, H, N_q, d_k]
K = rng.standard_normal((2, 2, 5, 8))          # [B, H_kv, N_k, d_k]  (GQA: 2 query heads per kv head)
V = rng.standard_normal((2, 2, 5, 6))          # [B, H_kv, N_k, d_v]
OUT, CACHE = na.attention_forward(Q, K, V)     # OUT [2, 4, 3, 6]
X, W, BIAS = rng.standard_normal((2, 3, 4)), rng.standard_normal((4, 5)), rng.standard_normal(5)
Y, LCACHE = na.linear_forward(X, W, BIAS)      # Y [2, 3, 5]
P, SCACHE = na.softmax_forward(rng.standard_normal((2, 3)))
QUERY, KEYS = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 5, 8))   # [B, N, d_model]


def attn(**changes):
    """attention_forward on the good Q, K, V with some arguments replaced."""
    args = {"q": Q, "k": K, "v": V, **changes}
    return lambda: na.attention_forward(**args)


def mha(**options):
    return na.MultiHeadAttention(8, 2, seed=0, **options)


def mha_kv():
    """A module with key width kdim = 5 and value width vdim = 3 (d_model = 8)."""
    return mha(kdim=5, vdim=3)


def mha_call(query=QUERY, key=KEYS, value=KEYS, **options):
    return lambda: mha()(query, key, value, **options)


def mha_after_forward():
    m = mha()
    m(QUERY, KEYS, KEYS)
    return m


def load(**changes):
    """load_state_dict of a good state dict with some keys replaced (None: removed)."""
    sd = {**mha().state_dict(), **changes}
    return lambda: mha().load_state_dict({k: v for k, v in sd.items() if v is not None})


TORCH_OUT = {"in_proj_bias": np.zeros(24), "out_proj.weight": np.zeros((8, 8)), "out_proj.bias": np.zeros(8)}
TORCH_PACKED = {"in_proj_weight": np.zeros((24, 8)), **TORCH_OUT}          # 8 = d_model
TORCH_SEPARATE = {"q_proj_weight": np.zeros((8, 8)), "k_proj_weight": np.zeros((8, 5)),
                  "v_proj_weight": np.zeros((8, 3)), **TORCH_OUT}          # kdim = 5, vdim = 3


def load_torch(base=TORCH_PACKED, module=mha, **changes):
    """load_state_dict of torch.nn.MultiheadAttention-style keys with some replaced (None: removed)."""
    sd = {**base, **changes}
    return lambda: module().load_state_dict({k: v for k, v in sd.items() if v is not None})


def load_torch_separate(**changes):
    """load_torch of the separate q/k/v_proj_weight layout into the kdim = 5, vdim = 3 module."""
    return load_torch(TORCH_SEPARATE, mha_kv, **changes)


def mh_forward(params=None, **changes):
    params = mha().state_dict() if params is None else params
    args = {"query": QUERY, "key": KEYS, "value": KEYS, "params": params, "num_heads": 2, **changes}
    return lambda: na.multihead_forward(**args)


def gradcheck(**changes):
    args = {"forward": na.linear_forward, "backward": na.linear_backward, "inputs": [X, W], **changes}
    return lambda: na.gradcheck(**args)


def taylor(**changes):
    args = {"forward": na.linear_forward, "backward": na.linear_backward, "inputs": [X, W], **changes}
    return lambda: na.taylor_test(**args)


def too_few_gradients(dy, cache):
    return na.linear_backward(dy, cache)[:1]                # dx only: W's gradient is missing


def case(case_id, exc, fragments, call):
    return pytest.param(call, exc, fragments, id=case_id)


E, T = ValueError, TypeError
BAD_INPUTS = [
    # ---- attention_forward: axes and shapes
    case("attn-q-1-axis", E, ["q", "(8,)"], attn(q=np.ones(8))),
    case("attn-q-scalar", E, ["q", "()"], attn(q=1.0)),
    case("attn-k-fewer-axes", E, ["q", "k", "(5, 8)", "(2, 4, 3, 8)"], attn(k=K[0, 0])),
    case("attn-batch-q-vs-k", E, ["batch", "(3, 4, 3, 8)", "(2, 2, 5, 8)"], attn(q=np.ones((3, 4, 3, 8)))),
    case("attn-batch-k-vs-v", E, ["batch", "(3, 2, 5, 6)"], attn(v=np.ones((3, 2, 5, 6)))),
    case("attn-width-q-vs-k", E, ["d_k", "(2, 4, 3, 7)", "(2, 2, 5, 8)"], attn(q=np.ones((2, 4, 3, 7)))),
    case("attn-length-k-vs-v", E, ["N_k", "(2, 2, 5, 8)", "(2, 2, 4, 6)"], attn(v=np.ones((2, 2, 4, 6)))),
    case("attn-heads-k-vs-v", E, ["H_kv", "(2, 2, 5, 8)", "(2, 1, 5, 6)"], attn(v=np.ones((2, 1, 5, 6)))),
    case("attn-gqa-not-dividing", E, ["H_kv=3", "H=4", "[..., H, N, d]"],
         attn(k=np.ones((2, 3, 5, 8)), v=np.ones((2, 3, 5, 6)))),
    case("attn-zero-heads", E, ["head", "(2, 0, 3, 8)"], attn(q=np.ones((2, 0, 3, 8)))),
    case("attn-zero-kv-heads", E, ["head", "(2, 0, 5, 8)"], attn(k=np.ones((2, 0, 5, 8)), v=np.ones((2, 0, 5, 6)))),
    case("attn-zero-width", E, ["d_k", "(2, 4, 3, 0)"], attn(q=np.ones((2, 4, 3, 0)), k=np.ones((2, 2, 5, 0)))),
    # ---- attention_forward: not numbers
    case("attn-q-None", T, ["q", "object"], attn(q=None)),
    case("attn-q-string", T, ["q", "<U"], attn(q="query")),
    case("attn-q-ragged-list", T, ["q", "list"], attn(q=[[1.0, 2.0], [3.0]])),
    case("attn-q-bool", T, ["q", "bool", "(2, 4, 3, 8)"], attn(q=Q > 0)),
    case("attn-v-object", T, ["v", "object"], attn(v=V.astype(object))),
    # ---- masks and biases
    case("mask-not-broadcasting", E, ["mask", "(3, 4)", "(2, 4, 3, 5)", "[B, N_k] are given as [B, 1, 1, N_k]"],
         attn(mask=np.ones((3, 4), bool))),
    case("mask-wrong-batch", E, ["mask", "(3, 1, 1, 1)", "(2, 4, 3, 5)"], attn(mask=np.ones((3, 1, 1, 1)))),
    case("mask-complex", T, ["mask", "complex128", "(3, 5)"], attn(mask=np.ones((3, 5), complex))),
    case("mask-object", T, ["mask", "object"], attn(mask=np.array([[True, None, 1]] * 3))),
    case("mask-strings", T, ["mask", "<U"], attn(mask=np.full((3, 5), "yes"))),
    case("mask-float-nan", E, ["mask", "NaN", "bias"], attn(mask=np.where(np.eye(3, 5) > 0, np.nan, 1.0))),
    case("bias-not-broadcasting", E, ["bias", "(3, 3)", "(2, 4, 3, 5)"], attn(bias=np.zeros((3, 3)))),
    case("bias-too-many-axes", E, ["bias", "(1, 2, 4, 3, 5)"], attn(bias=np.zeros((1, 2, 4, 3, 5)))),
    case("bias-strings", T, ["bias", "<U"], attn(bias=np.full((3, 5), "0"))),
    case("dropout-mask-not-broadcasting", E, ["dropout_mask", "(4, 4)"],
         attn(dropout_mask=np.ones((4, 4), bool), dropout_p=0.1)),
    # ---- scalar options
    case("scale-nan", E, ["scale", "nan"], attn(scale=float("nan"))),
    case("scale-inf", E, ["scale", "inf"], attn(scale=float("inf"))),
    case("scale-zero", E, ["scale", "0"], attn(scale=0.0)),
    case("scale-negative", E, ["scale", "-0.5"], attn(scale=-0.5)),
    case("scale-string", T, ["scale", "'0.5'"], attn(scale="0.5")),
    case("scale-complex", T, ["scale", "1j"], attn(scale=1j)),
    case("scale-bool", T, ["scale", "True"], attn(scale=True)),
    case("scale-array", T, ["scale", "ndarray"], attn(scale=np.array([0.5, 0.5]))),
    case("softcap-zero", E, ["softcap", "0"], attn(softcap=0.0)),
    case("softcap-string", T, ["softcap"], attn(softcap="30")),
    case("causal-word", E, ["causal", "'upper'"], attn(causal="upper")),
    case("causal-None", T, ["causal", "None"], attn(causal=None)),
    case("causal-int", T, ["causal", "1"], attn(causal=1)),
    case("align-word", E, ["align", "'left'"], attn(causal=True, align="left")),
    case("causal-contradicts-align", E, ["causal", "align"], attn(causal="top_left", align="bottom_right")),
    case("window-one-number", E, ["window", "(2,)"], attn(window=(2,))),
    case("window-below-minus-one", E, ["window", "-2"], attn(window=(-2, 0))),
    case("window-float", E, ["window", "1.5"], attn(window=(1.5, 0))),
    case("fully-masked-word", E, ["fully_masked", "'ones'"], attn(fully_masked="ones")),
    case("fully-masked-None", E, ["fully_masked", "None"], attn(fully_masked=None)),
    case("fully-masked-uniform-no-keys", E, ["uniform", "N_k = 0", "(2, 2, 0, 8)"],
         attn(k=np.ones((2, 2, 0, 8)), v=np.ones((2, 2, 0, 6)), fully_masked="uniform")),
    case("fully-masked-nan-no-keys", E, ["'nan'", "N_k = 0", "(2, 2, 0, 6)"],
         attn(k=np.ones((2, 2, 0, 8)), v=np.ones((2, 2, 0, 6)), fully_masked="nan")),
    case("dropout-p-one", E, ["dropout_p", "[0, 1)", "1.0"], attn(dropout_p=1.0)),
    case("dropout-p-negative", E, ["dropout_p", "-0.1"], attn(dropout_p=-0.1)),
    case("dropout-p-nan", E, ["dropout_p", "nan"], attn(dropout_p=float("nan"))),
    case("dropout-p-string", T, ["dropout_p", "'0.1'"], attn(dropout_p="0.1")),
    case("dropout-p-without-mask", E, ["dropout_p", "dropout_mask"], attn(dropout_p=0.1)),
    case("check-finite-word", T, ["check_finite", "'yes'"], attn(check_finite="yes")),
    case("check-finite-nan-q", E, ["q", "(2, 4, 3, 8)", "non-finite"],
         attn(q=np.where(Q > 2, np.nan, Q), check_finite=True)),
    case("check-finite-inf-k", E, ["k", "(2, 2, 5, 8)", "non-finite"],
         attn(k=np.where(K > 2, -np.inf, K), check_finite=True)),
    case("check-finite-inf-v", E, ["v", "(2, 2, 5, 6)", "non-finite"],
         attn(v=np.where(V > 2, np.inf, V), check_finite=True)),
    case("check-finite-nan-bias", E, ["bias", "(3, 5)", "non-finite"],
         attn(bias=np.where(np.eye(3, 5) > 0, np.nan, 0.0), check_finite=True)),
    case("check-finite-posinf-bias", E, ["bias", "(3, 5)", "non-finite"],
         attn(bias=np.where(np.eye(3, 5) > 0, np.inf, 0.0), check_finite=True)),
    case("attn-unknown-option", T, ["dropout"], attn(dropout=0.1)),
    # ---- attention_backward
    case("attn-bwd-dout-shape", E, ["dout", "(2, 4, 3, 6)", "(2, 4, 3, 5)"],
         lambda: na.attention_backward(np.ones((2, 4, 3, 5)), CACHE)),
    case("attn-bwd-dout-None", E, ["dout", "(2, 4, 3, 6)", "()"], lambda: na.attention_backward(None, CACHE)),
    case("attn-bwd-dout-strings", T, ["dout", "<U"], lambda: na.attention_backward(np.full(OUT.shape, "1"), CACHE)),
    case("attn-bwd-cache-None", T, ["attention_backward", "AttentionCache", "NoneType"],
         lambda: na.attention_backward(OUT, None)),
    case("attn-bwd-cache-tuple", T, ["AttentionCache", "tuple"], lambda: na.attention_backward(OUT, tuple(CACHE))),
    case("attn-bwd-foreign-cache", T, ["AttentionCache", "LinearCache"], lambda: na.attention_backward(OUT, LCACHE)),
    case("attn-bwd-method", E, ["method", "'autograd'"], lambda: na.attention_backward(OUT, CACHE, method="autograd")),
    # ---- linear
    case("linear-W-1-axis", E, ["W", "(4,)"], lambda: na.linear_forward(X, np.ones(4))),
    case("linear-x-scalar", E, ["x", "()"], lambda: na.linear_forward(1.0, W)),
    case("linear-width-mismatch", E, ["x", "W", "(2, 3, 4)", "(5, 5)"], lambda: na.linear_forward(X, np.ones((5, 5)))),
    case("linear-b-shape", E, ["b", "(5,)", "(4,)"], lambda: na.linear_forward(X, W, np.ones(4))),
    case("linear-x-strings", T, ["x", "<U"], lambda: na.linear_forward(np.full((2, 4), "a"), W)),
    case("linear-bwd-dy-shape", E, ["dy", "(2, 3, 5)", "(2, 3, 4)"], lambda: na.linear_backward(np.ones((2, 3, 4)), LCACHE)),
    case("linear-bwd-foreign-cache", T, ["LinearCache", "SoftmaxCache"], lambda: na.linear_backward(Y, SCACHE)),
    # ---- softmax, logsumexp
    case("softmax-scalar", E, ["z", "()"], lambda: na.softmax_forward(1.0)),
    case("softmax-strings", T, ["z", "<U"], lambda: na.softmax_forward(["a", "b"])),
    case("softmax-bwd-dp-shape", E, ["dp", "(2, 3)", "(3, 2)"], lambda: na.softmax_backward(np.ones((3, 2)), SCACHE)),
    case("softmax-bwd-foreign-cache", T, ["SoftmaxCache", "dict"], lambda: na.softmax_backward(P, {"p": P})),
    case("softmax-jacobian-scalar", E, ["p", "()"], lambda: na.softmax_jacobian(0.5)),
    case("logsumexp-axis", E, ["axis=0"], lambda: na.logsumexp(np.ones((2, 3)), axis=0)),
    # ---- heads
    case("split-heads-zero", E, ["num_heads", "0"], lambda: na.split_heads(X, 0)),
    case("split-heads-negative", E, ["num_heads", "-2"], lambda: na.split_heads(X, -2)),
    case("split-heads-float", T, ["num_heads", "2.0"], lambda: na.split_heads(X, 2.0)),
    case("split-heads-bool", T, ["num_heads", "True"], lambda: na.split_heads(X, True)),
    case("split-heads-not-dividing", E, ["num_heads=3", "D=4", "(2, 3, 4)"], lambda: na.split_heads(X, 3)),
    case("split-heads-1-axis", E, ["x", "(4,)"], lambda: na.split_heads(np.ones(4), 2)),
    case("merge-heads-2-axes", E, ["xh", "(3, 4)"], lambda: na.merge_heads(np.ones((3, 4)))),
    # ---- MultiHeadAttention: constructor
    case("mha-d-model-zero", E, ["d_model", "0"], lambda: na.MultiHeadAttention(0, 1)),
    case("mha-num-heads-zero", E, ["num_heads", "0"], lambda: na.MultiHeadAttention(8, 0)),
    case("mha-num-heads-negative", E, ["num_heads", "-2"], lambda: na.MultiHeadAttention(8, -2)),
    case("mha-not-divisible", E, ["d_model=6", "num_heads=4"], lambda: na.MultiHeadAttention(6, 4)),
    case("mha-d-model-float", T, ["d_model", "8.0"], lambda: na.MultiHeadAttention(8.0, 2)),
    case("mha-dtype-int", T, ["dtype", "int64"], lambda: na.MultiHeadAttention(8, 2, dtype=np.int64)),
    case("mha-dtype-nonsense", T, ["dtype", "'float65'"], lambda: na.MultiHeadAttention(8, 2, dtype="float65")),
    case("mha-seed-string", T, ["seed", "'zero'"], lambda: na.MultiHeadAttention(8, 2, seed="zero")),
    case("mha-seed-negative", E, ["seed", "-1"], lambda: na.MultiHeadAttention(8, 2, seed=-1)),
    case("mha-fully-masked-word", E, ["fully_masked", "'skip'"], lambda: na.MultiHeadAttention(8, 2, fully_masked="skip")),
    case("mha-kdim-zero", E, ["kdim", "0"], lambda: mha(kdim=0)),
    case("mha-kdim-float", T, ["kdim", "2.5"], lambda: mha(kdim=2.5)),
    case("mha-kdim-string", T, ["kdim", "'5'"], lambda: mha(kdim="5")),
    case("mha-vdim-negative", E, ["vdim", "-3"], lambda: mha(vdim=-3)),
    case("mha-vdim-bool", T, ["vdim", "True"], lambda: mha(vdim=True)),
    # ---- MultiHeadAttention: call and backward
    case("mha-query-2-axes", E, ["query", "d_model=8", "(3, 8)"], mha_call(query=QUERY[0])),
    case("mha-query-width", E, ["query", "d_model=8", "(2, 3, 7)"], mha_call(query=np.ones((2, 3, 7)))),
    case("mha-batch-mismatch", E, ["batch", "(2, 3, 8)", "(1, 5, 8)"], mha_call(key=KEYS[:1], value=KEYS[:1])),
    case("mha-key-value-length", E, ["N_k", "(2, 5, 8)", "(2, 4, 8)"], mha_call(value=KEYS[:, :4])),
    case("mha-key-not-kdim", E, ["key", "kdim=5", "(2, 5, 8)"], lambda: mha_kv()(QUERY, KEYS, KEYS[..., :3])),
    case("mha-value-not-vdim", E, ["value", "vdim=3", "(2, 5, 8)"], lambda: mha_kv()(QUERY, KEYS[..., :5], KEYS)),
    case("mha-query-strings", T, ["query", "<U"], mha_call(query=np.full((2, 3, 8), "q"))),
    case("mha-mask-not-broadcasting", E, ["mask", "(3, 4)", "(2, 2, 3, 5)"], mha_call(mask=np.ones((3, 4)))),
    case("mha-backward-before-forward", E, ["backward", "forward first"],
         lambda: mha().backward(np.ones((2, 3, 8)))),
    case("mha-backward-grad-shape", E, ["grad_output", "(2, 3, 8)", "(2, 3, 7)"],
         lambda: mha_after_forward().backward(np.ones((2, 3, 7)))),
    # ---- MultiHeadAttention.load_state_dict
    case("load-missing-key", E, ["missing", "W_o.bias"], load(**{"W_o.bias": None})),
    case("load-unexpected-key", E, ["unexpected", "W_x.weight"], load(**{"W_x.weight": np.zeros((8, 8))})),
    case("load-wrong-shape", E, ["W_k.weight", "(8, 8)", "(8, 7)"], load(**{"W_k.weight": np.zeros((8, 7))})),
    case("load-wrong-bias-shape", E, ["W_q.bias", "(8,)", "(8, 1)"], load(**{"W_q.bias": np.zeros((8, 1))})),
    case("load-strings", T, ["W_v.weight", "<U"], load(**{"W_v.weight": np.full((8, 8), "w")})),
    case("load-complex-into-float", T, ["W_o.weight", "complex"], load(**{"W_o.weight": np.zeros((8, 8), complex)})),
    case("load-not-a-mapping", T, ["state_dict", "list"], lambda: mha().load_state_dict([("W_q.weight", 0)])),
    case("load-torch-missing-key", E, ["missing", "out_proj.bias"], load_torch(**{"out_proj.bias": None})),
    case("load-torch-unexpected-key", E, ["unexpected", "bias_k"], load_torch(bias_k=np.zeros((1, 1, 8)))),
    case("load-torch-in-proj-shape", E, ["in_proj_weight", "(24, 8)", "(24, 7)"],
         load_torch(in_proj_weight=np.zeros((24, 7)))),
    case("load-torch-out-proj-shape", E, ["out_proj.weight", "(8, 8)", "(8, 9)"],
         load_torch(**{"out_proj.weight": np.zeros((8, 9))})),
    case("load-kdim-seed-keys-shape", E, ["W_k.weight", "(8, 5)", "(8, 8)"],
         lambda: mha_kv().load_state_dict(mha().state_dict())),
    case("load-torch-separate-missing", E, ["missing", "v_proj_weight"], load_torch_separate(v_proj_weight=None)),
    case("load-torch-both-layouts", E, ["packed", "unexpected", "q_proj_weight"],
         load_torch_separate(in_proj_weight=np.zeros((24, 8)))),
    case("load-torch-separate-shape", E, ["k_proj_weight", "(8, 5)", "(8, 4)"],
         load_torch_separate(k_proj_weight=np.zeros((8, 4)))),
    case("load-torch-packed-into-kdim", E, ["in_proj_weight", "kdim=5", "q_proj_weight"],
         load_torch(module=mha_kv)),
    # ---- multihead_forward / multihead_backward (the pure pair)
    case("mh-forward-params-missing", E, ["params", "missing", "W_q.weight"], mh_forward(params={})),
    case("mh-forward-params-not-mapping", T, ["params", "list"], mh_forward(params=[])),
    case("mh-forward-params-shape", E, ["params", "W_o.weight", "(8, 8)", "(4, 4)"],
         mh_forward(params={**mha().state_dict(), "W_o.weight": np.zeros((4, 4))})),
    case("mh-forward-width-mismatch", E, ["d_model", "(2, 5, 6)"], mh_forward(key=np.ones((2, 5, 6)))),
    case("mh-forward-value-width", E, ["value", "W_v.weight", "(8, 8)", "(2, 5, 6)"],
         mh_forward(value=np.ones((2, 5, 6)))),
    case("mh-forward-key-not-kdim", E, ["key", "W_k.weight", "(8, 5)", "(2, 5, 8)"],
         mh_forward(params=mha_kv().state_dict(), value=KEYS[..., :3])),
    case("mh-forward-W_k-1-axis", E, ["params", "W_k.weight", "(8,)"],
         mh_forward(params={**mha().state_dict(), "W_k.weight": np.zeros(8)})),
    case("mh-forward-query-width", E, ["query's width 4", "params['W_q.weight']", "(8, 8)", "(2, 3, 4)"],
         mh_forward(query=QUERY[..., :4])),
    case("mh-forward-heads-indivisible", E, ["d_model=8", "num_heads=3", "(2, 3, 8)"], mh_forward(num_heads=3)),
    case("mh-forward-heads-zero", E, ["num_heads", "0"], mh_forward(num_heads=0)),
    case("mh-forward-heads-bool", T, ["num_heads", "True"], mh_forward(num_heads=True)),
    case("mh-backward-grad-bool", T, ["grad_output", "bool", "(2, 3, 8)"],
         lambda: mha_after_forward().backward(np.ones((2, 3, 8), bool))),
    case("mh-backward-grad-none", T, ["grad_output", "object"], lambda: mha_after_forward().backward(None)),
    case("load-torch-in-proj-bool", T, ["state_dict['in_proj_weight']", "bool", "(24, 8)"],
         load_torch(in_proj_weight=np.zeros((24, 8), bool))),
    case("mha-seed-bool", T, ["seed", "True"], lambda: na.MultiHeadAttention(8, 2, seed=True)),
    case("mh-backward-foreign-cache", T, ["MultiHeadCache", "AttentionCache"],
         lambda: na.multihead_backward(np.ones((2, 3, 8)), CACHE)),
    # ---- gradcheck
    case("gradcheck-method", E, ["method", "'forward'"], gradcheck(method="forward")),
    case("gradcheck-mode", E, ["mode", "'diagonal'"], gradcheck(mode="diagonal")),
    case("gradcheck-inputs-array", T, ["inputs", "ndarray"], gradcheck(inputs=X)),
    case("gradcheck-no-float-input", E, ["floating"], gradcheck(inputs=[np.ones((2, 4), int), 3])),
    case("gradcheck-not-callable", T, ["callable"], gradcheck(forward="linear_forward")),
    case("gradcheck-eps-zero", E, ["eps", "> 0", "0"], gradcheck(eps=0)),
    case("gradcheck-eps-nan", E, ["eps", "nan"], gradcheck(eps=float("nan"))),
    case("gradcheck-eps-string", T, ["eps", "'a'"], gradcheck(eps="a")),
    case("gradcheck-eps-below-rounding", E, ["eps=1e-300", "does not move", "input 0", "eps_mach"],
         gradcheck(eps=1e-300)),
    case("gradcheck-rtol-negative", E, ["rtol", ">= 0", "-1"], gradcheck(rtol=-1)),
    case("gradcheck-rtol-inf", E, ["rtol", "inf"], gradcheck(rtol=float("inf"))),
    case("gradcheck-atol-string", T, ["atol", "'a'"], gradcheck(atol="a")),
    case("gradcheck-n-projections-zero", E, ["n_projections", "positive integer", "0"],
         gradcheck(mode="projection", n_projections=0)),
    case("gradcheck-seed-negative", E, ["seed", "-1"], gradcheck(seed=-1)),
    case("gradcheck-seed-bool", T, ["seed", "True"], gradcheck(seed=True)),
    case("gradcheck-wrt-int", T, ["wrt", "list", "0"], gradcheck(wrt=0)),
    case("gradcheck-wrt-bool", T, ["wrt", "True"], gradcheck(wrt=[True])),
    case("gradcheck-wrt-empty", E, ["wrt", "empty"], gradcheck(wrt=[])),
    case("gradcheck-wrt-out-of-range", E, ["wrt", "7", "2 inputs"], gradcheck(wrt=[7])),
    case("gradcheck-wrt-twice", E, ["wrt", "twice", "[0, 0]"], gradcheck(wrt=[0, 0])),
    case("gradcheck-wrt-int-array", E, ["wrt index 0", "int64", "(2, 4)"],
         gradcheck(inputs=[np.ones((2, 4), np.int64), W[:4]], wrt=[0])),
    case("gradcheck-wrt-empty-array", E, ["wrt index 0", "non-empty", "(0, 4)"],
         gradcheck(inputs=[np.ones((0, 4)), W], wrt=[0])),
    case("gradcheck-empty-output", E, ["output", "empty", "(2, 0)"],
         gradcheck(inputs=[np.ones((2, 4)), np.ones((4, 0))], wrt=[0])),
    case("gradcheck-backward-too-few", E, ["backward", "entry 1", "input 1"],
         gradcheck(backward=too_few_gradients)),
    case("gradcheck-forward-not-a-pair", T, ["forward must return a pair (out, cache)", "array of shape (2, 3, 5)"],
         gradcheck(forward=lambda x, W: x @ W)),
    case("gradcheck-backward-an-array", T, ["backward must return a sequence", "array of shape (2, 3, 4)"],
         gradcheck(backward=lambda dy, c: na.linear_backward(dy, c)[0])),
    # ---- taylor_test
    case("taylor-inputs-array", T, ["inputs", "ndarray"], taylor(inputs=X)),
    case("taylor-n-steps-one", E, ["n_steps", ">= 2", "1"], taylor(n_steps=1)),
    case("taylor-n-steps-float", T, ["n_steps", "2.5"], taylor(n_steps=2.5)),
    case("taylor-h0-zero", E, ["h0", "> 0", "0"], taylor(h0=0)),
    case("taylor-h0-nan", E, ["h0", "nan"], taylor(h0=float("nan"))),
    case("taylor-h0-below-rounding", E, ["h0=1e-300", "does not move", "input 0"], taylor(h0=1e-300)),
    case("taylor-wrt-empty", E, ["wrt", "empty"], taylor(wrt=[])),
    case("taylor-wrt-out-of-range", E, ["wrt", "7", "2 inputs"], taylor(wrt=[7])),
    case("taylor-complex-only", E, ["real floating-point", "complex128"],
         taylor(inputs=[X.astype(complex), W.astype(complex)])),
    case("taylor-backward-too-few", E, ["backward", "entry 1"], taylor(backward=too_few_gradients)),
    case("taylor-forward-not-a-pair", T, ["forward must return a pair"], taylor(forward=lambda x, W: (x @ W,))),
]

if "block_size" in inspect.signature(na.attention_forward).parameters:    # the tiled path
    _, TILED_CACHE = na.attention_forward(Q, K, V, block_size=2)
    BAD_INPUTS += [case(f"block-size-{name}", exc, ["block_size"], attn(block_size=value))
                   for name, exc, value in (("zero", E, 0), ("negative", E, -4), ("float", T, 2.5),
                                            ("string", T, "16"), ("bool", T, True))]
    BAD_INPUTS += [
        case("tiled-softcap", E, ["block_size", "softcap"], attn(block_size=2, softcap=5.0)),
        case("tiled-dropout", E, ["block_size", "dropout_mask"],
             attn(block_size=2, dropout_mask=np.ones((3, 5), bool), dropout_p=0.5)),
        case("tiled-fully-masked-uniform", E, ["block_size", "uniform"], attn(block_size=2, fully_masked="uniform")),
        case("tiled-bwd-dout-shape", E, ["dout", "(2, 4, 3, 6)", "(2, 4, 3, 5)"],
             lambda: na.attention_backward(np.ones((2, 4, 3, 5)), TILED_CACHE)),
        case("tiled-bwd-method", E, ["method", "'jacobian'"],
             lambda: na.attention_backward(OUT, TILED_CACHE, method="jacobian")),
        case("tiled-bwd-stages", E, ["return_stages", "block_size"],
             lambda: na.attention_backward(OUT, TILED_CACHE, return_stages=True)),
    ]


@pytest.mark.parametrize("call, exc, fragments", BAD_INPUTS)
def test_bad_input_raises_a_clear_error(call, exc, fragments):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert info.type is exc, f"{info.type.__name__}: {info.value}"
    message = str(info.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message {message!r} lacks {missing}"


def test_the_table_is_large_enough():
    """The README promises at least 40 distinct bad inputs, each with its own id."""
    ids = [p.id for p in BAD_INPUTS]
    assert len(set(ids)) == len(ids)
    assert len(ids) >= 40


def test_the_good_inputs_behind_the_table_work():
    """Each bad case changes one thing in a call that works: prove the base calls work."""
    attn()()
    mha_call()()
    load()()
    load_torch()()
    load_torch_separate()()
    mha_kv()(QUERY, KEYS[..., :5], KEYS[..., :3])
    mh_forward(params=mha_kv().state_dict(), key=KEYS[..., :5], value=KEYS[..., :3])()
    mh_forward()()
    mha_after_forward().backward(np.ones((2, 3, 8)))
    assert gradcheck()()
    assert taylor()()


# ---- the command line: one line on stderr, exit code 2, no traceback
# (no command at all prints the usage and the command list: tests/test_cli.py)

@pytest.mark.parametrize("argv", [["frobnicate"], ["gradcheck", "--no-such-option"]],
                         ids=["unknown-command", "unknown-option"])
def test_cli_bad_arguments_exit_2_with_one_line(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err


# ----------------------------------------------------------------------------- torch's habits, everywhere

TORCH_CAUSAL = np.triu(np.full((4, 4), -np.inf), 1)      # torch's additive causal mask: 0 / -inf
SEQ = rng.standard_normal((2, 4, 8))                     # [B, N, d_model = 8]: the module's input
HEADS = rng.standard_normal((2, 2, 4, 8))                # [B, H, N, d]
LATENT = rng.standard_normal((2, 1, 4, 8))               # MLA's kv [B, 1, N, r + p]


def entry_points(**options):
    """Every public entry point that takes attention's options, called with `options`."""
    return {
        **{f"attention_forward-{engine}": lambda engine=engine: na.attention_forward(
            HEADS, HEADS, HEADS, implementation=engine, **options) for engine in ("textbook", "blocked", "tiled")},
        **{f"attention_jvp-{engine}": lambda engine=engine: na.attention_jvp(
            HEADS, HEADS, HEADS, HEADS, HEADS, HEADS, implementation=engine, **options) for engine in ("textbook", "tiled")},
        "MultiHeadAttention": lambda: na.MultiHeadAttention(8, 2)(SEQ, SEQ, SEQ, **options),
        "multihead_forward": lambda: na.multihead_forward(SEQ, SEQ, SEQ, na.MultiHeadAttention(8, 2).state_dict(), 2,
                                                          **options),
        "mla_forward": lambda: na.mla_forward(HEADS, LATENT, rope_dim=2, **options),
    }


FLOAT_MASKS = {"mask 0 / -inf": ("mask", TORCH_CAUSAL), "mask 0 / -1e9": ("mask", np.triu(np.full((4, 4), -1e9), 1)),
               "dropout_mask scaled by 1 / (1 - p)": ("dropout_mask", np.where(TORCH_CAUSAL == 0, 1.25, 0.0))}


@pytest.mark.parametrize("call, mask", [(call, mask) for call in entry_points() for mask in FLOAT_MASKS
                                        if not ("tiled" in call and "dropout" in mask)])   # (no dropout there)
def test_a_float_mask_holding_anything_but_0_and_1_is_refused_naming_bias(call, mask):
    """torch's additive mask passed as mask= would keep exactly the keys it masks (nonzero =
    attend): every entry point refuses a float mask of anything but 0 and 1, naming bias=."""
    name, value = FLOAT_MASKS[mask]
    options = {name: value, **({"dropout_p": 0.2} if name == "dropout_mask" else {})}
    scaled = "; a dropout mask scaled by 1 / \\(1 - p\\) is dropout_mask != 0 with dropout_p=p" if "dropout" in mask else ""
    with pytest.raises(ValueError, match=f"{name} of shape \\(4, 4\\) and dtype float64 holds entries other than "
                                         f"0 and 1 .*pass it as bias={scaled}$"):
        entry_points(**options)[call]()


def test_the_same_mask_as_a_bias_or_as_0_and_1_is_causal_attention():
    causal = na.attention_forward(HEADS, HEADS, HEADS, causal=True)[0]
    for options in ({"bias": TORCH_CAUSAL}, {"mask": np.tril(np.ones((4, 4)))}, {"mask": TORCH_CAUSAL == 0}):
        np.testing.assert_allclose(na.attention_forward(HEADS, HEADS, HEADS, **options)[0], causal, rtol=0, atol=1e-15)


TORCH_NAMES = {"attn_mask": TORCH_CAUSAL == 0, "is_causal": True, "window_size": (2, 0), "softmax_scale": 0.5,
               "key_padding_mask": np.zeros((2, 4), bool)}


@pytest.mark.parametrize("call, name", [(call, name) for call in entry_points() for name in TORCH_NAMES])
def test_torchs_and_flashattentions_names_get_crosschecks_advice_everywhere(call, name):
    """attn_mask=, is_causal=, window_size=, ... at any entry point: a TypeError that says what to
    pass instead (near_misses.NEAR_MISSES, crosscheck's table), naming no function the caller did
    not call (MultiHeadAttention reaches attention_forward inside)."""
    from numpy_attention.near_misses import NEAR_MISSES
    with pytest.raises(TypeError) as error:
        entry_points(**{name: TORCH_NAMES[name]})[call]()
    assert str(error.value) == f"unexpected keyword argument {name!r}: {NEAR_MISSES[name]}"


def test_a_misspelt_option_gets_the_closest_name():
    with pytest.raises(TypeError, match="unexpected keyword argument 'casual': did you mean causal=\\?"):
        na.MultiHeadAttention(8, 2)(SEQ, SEQ, SEQ, casual=True)
