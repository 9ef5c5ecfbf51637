"""Multi-head attention, the seed's module: composition only.

Shape legend:  B batch,  N_q / N_k lengths,  D = d_model,  H = num_heads,  d_k = D / H.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o,   head_i = Attention(Q W_q^i, K W_k^i, V W_v^i)

Forward                                             Backward (reverse order, one line each)
    1. Q = query W_q + b_q    [B, N_q, D]               5. linear_backward (W_o)
       K = key   W_k + b_k    [B, N_k, D]               4. split_heads (merge's backward)
       V = value W_v + b_v    [B, N_k, D]               3. attention_backward
    2. split_heads            [B, H, N, d_k]            2. merge_heads (split's backward)
    3. attention_forward      [B, H, N_q, d_k]          1. linear_backward (W_q, W_k, W_v)
    4. merge_heads            [B, N_q, D]
    5. out = concat W_o + b_o [B, N_q, D]

Parameters are stored as torch's nn.Linear stores them (weight [out, in]), so
`state_dict()` has the seed's keys and layouts; the math layout W = weight^T is
what `linear_forward` receives.

Self-attention: when the same array is passed as query, key and value, the
gradient w.r.t. that array is grads["query"] + grads["key"] + grads["value"].
"""
from typing import NamedTuple

import numpy as np

from ._checks import (as_float_array, require_cache, require_choice, require_keys, require_mapping,
                      require_positive_int, require_same_shape, require_shapes)
from .attention import FULLY_MASKED_POLICIES, attention_backward, attention_forward
from .heads import merge_heads, split_heads
from .linear import linear_backward, linear_forward

PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")
TORCH_KEYS = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")


class MultiHeadCache(NamedTuple):
    q: tuple                        # LinearCache of each input projection
    k: tuple
    v: tuple
    attention: tuple                # AttentionCache
    o: tuple                        # LinearCache of the output projection
    num_heads: int


def multihead_forward(query, key, value, params, num_heads, *, mask=None, **attention_options):
    """The seed's MultiHeadAttention.forward as a pure function.

    Args:
        query [B, N_q, D], key [B, N_k, D], value [B, N_k, D].
        params: dict of state_dict arrays ("W_q.weight" [D, D] as [out, in], "W_q.bias" [D], ...).
        mask: keep-mask broadcastable to [B, H, N_q, N_k] (True/nonzero = attend).
        attention_options: passed to attention_forward (causal, bias, fully_masked, ...).
    Returns:
        out [B, N_q, D], attn_weights [B, H, N_q, N_k], MultiHeadCache.
    """
    query, key, value = (as_float_array(x, name) for name, x in
                         (("query", query), ("key", key), ("value", value)))
    shapes = f"query {query.shape}, key {key.shape}, value {value.shape}"
    if not query.ndim == key.ndim == value.ndim == 3:
        raise ValueError(f"query, key, value must each have 3 axes [B, N, d_model], got {shapes}")
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        raise ValueError(f"query, key, value must have the same batch size B, got {shapes}")
    if not query.shape[2] == key.shape[2] == value.shape[2]:
        raise ValueError(f"query, key, value must have the same width d_model, got {shapes}")
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"key and value must have the same length N_k, got {shapes}")
    params = _check_params(params, query.shape[2], "params")
    # 1. linear projections (math layout W = weight^T)
    Q, cq = linear_forward(query, params["W_q.weight"].T, params["W_q.bias"])   # [B, N_q, D]
    K, ck = linear_forward(key, params["W_k.weight"].T, params["W_k.bias"])     # [B, N_k, D]
    V, cv = linear_forward(value, params["W_v.weight"].T, params["W_v.bias"])   # [B, N_k, D]
    # 2. split heads: [B, N, D] -> [B, H, N, d_k]
    Qh, Kh, Vh = (split_heads(x, num_heads) for x in (Q, K, V))
    # 3. attention per head
    attn, ca = attention_forward(Qh, Kh, Vh, mask=mask, **attention_options)   # [B, H, N_q, d_k]
    # 4. merge heads: [B, H, N_q, d_k] -> [B, N_q, D]
    concat = merge_heads(attn)
    # 5. output projection
    out, co = linear_forward(concat, params["W_o.weight"].T, params["W_o.bias"])  # [B, N_q, D]
    cache = MultiHeadCache(q=cq, k=ck, v=cv, attention=ca, o=co, num_heads=num_heads)
    return out, ca.weights.copy(), cache              # a copy: the caller may write into it


def multihead_backward(dout, cache):
    """Gradients of `multihead_forward`: the children's backwards in reverse, one line each.

    Returns:
        dict with "query", "key", "value" and one entry per state_dict key, each in that
        key's layout (weights [out, in]).
    """
    require_cache(cache, MultiHeadCache, "multihead_backward")
    require_same_shape(dout, cache.o.out_shape, "dout")
    H = cache.num_heads
    dconcat, dWo, dbo = linear_backward(dout, cache.o)                   # 5. output projection
    dattn = split_heads(dconcat, H)                                      # 4. merge_heads' backward
    g = attention_backward(dattn, cache.attention)                       # 3. attention
    dQ, dK, dV = merge_heads(g.dq), merge_heads(g.dk), merge_heads(g.dv)  # 2. split_heads' backward
    dquery, dWq, dbq = linear_backward(dQ, cache.q)                      # 1. input projections
    dkey, dWk, dbk = linear_backward(dK, cache.k)
    dvalue, dWv, dbv = linear_backward(dV, cache.v)
    return {"query": dquery, "key": dkey, "value": dvalue,
            "W_q.weight": dWq.T, "W_q.bias": dbq, "W_k.weight": dWk.T, "W_k.bias": dbk,
            "W_v.weight": dWv.T, "W_v.bias": dbv, "W_o.weight": dWo.T, "W_o.bias": dbo}


def _check_params(params, d_model, name):
    """The parameter arrays, checked: exactly the seed's keys, weights [D, D], biases [D]."""
    require_mapping(params, name)
    shapes = {f"{p}.{kind}": (d_model, d_model) if kind == "weight" else (d_model,)
              for p in PROJECTIONS for kind in ("weight", "bias")}
    require_keys(params, name, shapes)
    arrays = {key: as_float_array(_to_numpy(params[key]), f"{name}[{key!r}]") for key in shapes}
    require_shapes(arrays, name, shapes)
    return arrays


def _from_torch_mha(sd, d_model):
    """torch.nn.MultiheadAttention's packed keys -> the seed's keys (same [out, in] layout)."""
    sd = {key: _to_numpy(sd[key]) for key in TORCH_KEYS}
    require_shapes(sd, "state_dict", dict(zip(TORCH_KEYS, ((3 * d_model, d_model), (3 * d_model,),
                                                           (d_model, d_model), (d_model,)))))
    w, b = sd["in_proj_weight"], sd["in_proj_bias"]                      # [3D, D], [3D]
    out = {}
    for i, name in enumerate(("W_q", "W_k", "W_v")):
        out[f"{name}.weight"] = w[i * d_model:(i + 1) * d_model]
        out[f"{name}.bias"] = b[i * d_model:(i + 1) * d_model]
    out["W_o.weight"], out["W_o.bias"] = sd["out_proj.weight"], sd["out_proj.bias"]
    return out


class MultiHeadAttention:
    """The seed's PyTorch MultiHeadAttention in NumPy, with a hand-written backward.

        mha = MultiHeadAttention(d_model, num_heads, seed=0)     # float64 by default
        out, attn_weights = mha(query, key, value, mask=None)    # [B, N_q, D], [B, H, N_q, N_k]
        grads = mha.backward(grad_output)                        # dict, see multihead_backward

    Weights are initialized like nn.Linear: U(-1/sqrt(D), 1/sqrt(D)), from
    numpy.random.default_rng(seed). The module remembers the last forward's
    cache for `backward`; the computation itself is the pure pair
    multihead_forward / multihead_backward.

    fully_masked: the policy for query rows whose keys are all masked
    ('zero' by default; 'uniform' reproduces the seed's -1e9 fill exactly).
    """

    def __init__(self, d_model, num_heads, *, seed=0, dtype=np.float64, fully_masked="zero"):
        self.d_model = require_positive_int(d_model, "d_model")
        self.num_heads = require_positive_int(num_heads, "num_heads")
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        self.d_k = d_model // num_heads
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype must be a floating or complex dtype, got {dtype!r}") from None
        if self.dtype.kind not in "fc":
            raise TypeError(f"dtype must be a floating or complex dtype, got {self.dtype}")
        self.fully_masked = require_choice(fully_masked, "fully_masked", FULLY_MASKED_POLICIES)
        try:
            rng = np.random.default_rng(seed)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"seed must be a non-negative integer (or None), got {seed!r}: {exc}") from None
        bound = 1.0 / np.sqrt(d_model)
        self.params = {}
        for name in PROJECTIONS:
            self.params[f"{name}.weight"] = rng.uniform(-bound, bound, (d_model, d_model)).astype(self.dtype)
            self.params[f"{name}.bias"] = rng.uniform(-bound, bound, d_model).astype(self.dtype)
        self._cache = None

    def __call__(self, query, key, value, mask=None, **attention_options):
        """(output [B, N_q, D], attn_weights [B, H, N_q, N_k]); options go to attention_forward."""
        inputs = [self._as_model_dtype(x, name)
                  for name, x in (("query", query), ("key", key), ("value", value))]
        for name, x in zip(("query", "key", "value"), inputs):
            if x.ndim != 3 or x.shape[-1] != self.d_model:
                raise ValueError(f"{name} must have shape [B, N, d_model={self.d_model}], got {x.shape}")
        attention_options.setdefault("fully_masked", self.fully_masked)
        out, weights, self._cache = multihead_forward(*inputs, self.params, self.num_heads,
                                                      mask=mask, **attention_options)
        return out, weights

    forward = __call__

    def _as_model_dtype(self, x, name):
        """The model's dtype; complex input stays complex (complex-step checks)."""
        x = as_float_array(x, name)
        dtype = np.result_type(self.dtype, x.dtype) if x.dtype.kind == "c" else self.dtype
        return x.astype(dtype, copy=False)

    def backward(self, grad_output):
        """Gradients of the last forward: dict with "query", "key", "value" and every state_dict key."""
        if self._cache is None:
            raise ValueError("MultiHeadAttention.backward needs a forward first: call "
                             "mha(query, key, value) before mha.backward(grad_output)")
        require_same_shape(grad_output, self._cache.o.out_shape, "grad_output")
        return multihead_backward(grad_output, self._cache)

    def state_dict(self):
        """Copies of the parameters under the seed's keys, weights [out, in] like nn.Linear."""
        return {name: value.copy() for name, value in self.params.items()}

    def load_state_dict(self, state_dict):
        """Load the seed's keys, or torch.nn.MultiheadAttention's (in_proj_weight, in_proj_bias,
        out_proj.weight, out_proj.bias). Arrays are copied; torch tensors are accepted."""
        require_mapping(state_dict, "state_dict")
        if "in_proj_weight" in state_dict:
            require_keys(state_dict, "state_dict (nn.MultiheadAttention layout)", TORCH_KEYS)
            state_dict = _from_torch_mha(state_dict, self.d_model)
        params = _check_params(state_dict, self.d_model, "state_dict")
        for name, arr in params.items():
            if arr.dtype.kind == "c" and self.dtype.kind != "c":
                raise TypeError(f"state_dict[{name!r}] is complex ({arr.dtype}); "
                                f"the module's dtype is {self.dtype}")
        self.params = {name: arr.astype(self.dtype) for name, arr in params.items()}  # copies


def _to_numpy(value):
    """A torch tensor (detached, on the CPU) or array-like -> ndarray."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return value.detach().cpu().numpy()
    return np.asarray(value)
