"""Multi-head attention, the seed's module: composition only.

Shape legend:  B batch,  N_q / N_k lengths,  D = d_model,  H = num_heads,  d_k = D / H,
               kdim / vdim the key / value widths (D unless set, like torch's kdim / vdim).

    MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_o,   head_i = Attention(Q W_q^i, K W_k^i, V W_v^i)

Forward                                             Backward (reverse order, one line each)
    1. Q = query W_q + b_q    [B, N_q, D]               5. linear_backward (W_o)
       K = key   W_k + b_k    [B, N_k, D]               4. split_heads (merge's backward)
       V = value W_v + b_v    [B, N_k, D]               3. attention_backward
       (query [B, N_q, D], key [B, N_k, kdim], value [B, N_k, vdim];
        W_k [kdim, D], W_v [vdim, D] in the math layout)
    2. split_heads            [B, H, N, d_k]            2. merge_heads (split's backward)
    3. attention_forward      [B, H, N_q, d_k]          1. linear_backward (W_q, W_k, W_v)
    4. merge_heads            [B, N_q, D]
    5. out = concat W_o + b_o [B, N_q, D]

`textbook_multihead_forward` / `textbook_multihead_backward` below are these steps with the
ops' own functions, the spec. `multihead_forward` checks its arguments once, then runs an
engine chosen as attention's is, by `implementation`: 'textbook' runs the textbook pair (and
the textbook attention), the others (the default 'blocked') run the same steps on threads
(multihead_threads.py: the projections in blocks of rows, the heads' copies, BLAS held to one
thread; the results bitwise the same for any number of `workers`), tested equal to the
textbook to rounding.

Parameters are stored as torch's nn.Linear stores them (weight [out, in]), so
`state_dict()` has the seed's keys and layouts (W_k.weight [D, kdim], W_v.weight
[D, vdim], the others [D, D]); the math layout W = weight^T is what
`linear_forward` receives. The layouts, and torch's nn.MultiheadAttention keys
that load_state_dict also takes, are in params.py.

Self-attention: when the same array is passed as query, key and value, the
gradient w.r.t. that array is grads["query"] + grads["key"] + grads["value"].
"""
import numpy as np

from ._checks import (as_float_array, brief, read_only_copy, require_cache, require_choice, require_mapping,
                      require_positive_int, require_same_shape, rng_from_seed)
from .attention import FULLY_MASKED_POLICIES, attention_backward, attention_forward
from .caches import MultiHeadCache
from .multihead_threads import threaded_multihead_backward, threaded_multihead_forward
from .engines.plan import resolve_workers, score_count
from .heads import merge_heads, split_heads
from .linear import linear_backward, linear_forward
from .params import TORCH_WEIGHTS, check_params, param_shapes, state_dict_grads, torch_to_seed_keys


# ----------------------------------------------------------------------------- the textbook

def textbook_multihead_forward(query, key, value, params, num_heads, mask=None, attention_options=None):
    """The five steps of the module docstring, whole arrays, the ops' own functions.

    Arguments as multihead_forward's, checked by it. Returns (out [B, N_q, D], MultiHeadCache).
    """
    W = {name: params[f"W_{name}.weight"].T for name in "qkvo"}    # math layout [in, out]
    b = {name: params[f"W_{name}.bias"] for name in "qkvo"}
    (Q, cq), (K, ck), (V, cv) = (linear_forward(x, W[n], b[n])      # 1. Q = query W_q + b_q  [B, N, D]
                                 for n, x in zip("qkv", (query, key, value)))
    Qh, Kh, Vh = (split_heads(x, num_heads) for x in (Q, K, V))     # 2. [B, H, N, d_k]
    heads, ca = attention_forward(Qh, Kh, Vh, mask=mask, **(attention_options or {}))   # 3. [B, H, N_q, d_k]
    concat = merge_heads(heads)                                     # 4. [B, N_q, D]
    out, co = linear_forward(concat, W["o"], b["o"])                # 5. out = concat W_o + b_o
    return out, MultiHeadCache(q=cq, k=ck, v=cv, attention=ca, o=co, num_heads=num_heads, workers=1)


def textbook_multihead_backward(dout, cache):
    """Gradients of textbook_multihead_forward: its five steps in reverse, one line each.

    Returns the dict multihead_backward describes.
    """
    dconcat, dW_o, db_o = linear_backward(dout, cache.o)            # 5. output projection
    dheads = split_heads(dconcat, cache.num_heads)                  # 4. merge_heads' backward
    g = attention_backward(dheads, cache.attention)                 # 3. attention
    dQ, dK, dV = (merge_heads(d) for d in (g.dq, g.dk, g.dv))       # 2. split_heads' backward
    (dquery, dW_q, db_q), (dkey, dW_k, db_k), (dvalue, dW_v, db_v) = (   # 1. input projections
        linear_backward(d, c) for d, c in ((dQ, cache.q), (dK, cache.k), (dV, cache.v)))
    return state_dict_grads((dquery, dkey, dvalue), ((dW_q, db_q), (dW_k, db_k), (dW_v, db_v), (dW_o, db_o)),
                            g.dbias)


# ----------------------------------------------------------------------------- the public pair

def multihead_forward(query, key, value, params, num_heads, *, mask=None, **attention_options):
    """The seed's MultiHeadAttention.forward as a pure function.

    Args:
        query [B, N_q, D], key [B, N_k, kdim], value [B, N_k, vdim].
        params: dict of state_dict arrays, weights as [out, in]: "W_q.weight" [D, D],
            "W_k.weight" [D, kdim], "W_v.weight" [D, vdim], "W_o.weight" [D, D], each
            bias [D]. D is query's width; kdim and vdim are read from W_k and W_v. The
            cache copies the weights, unless they are frozen (_checks.frozen: read-only down
            to the array that owns the memory, like MultiHeadAttention's own).
        mask: keep-mask broadcastable to [B, H, N_q, N_k] (True/nonzero = attend).
        attention_options: passed to attention_forward (causal, bias, fully_masked, ...);
            `implementation` also picks the module's engine (module docstring): 'textbook'
            runs the textbook pair, 'blocked' (default, with topk_indices too) the threaded one;
            'tiled' and 'sparse' are refused (they never form the attention weights this returns). `workers` runs the
            projections too, where None gives every core for at least
            plan.PARALLEL_PROJECTIONS multiply-adds in the four projections
            (B (2 N_q D + N_k (kdim + vdim)) D) or PARALLEL_SCORES scores, else 1.
    Returns:
        out [B, N_q, D], attn_weights [B, H, N_q, N_k], MultiHeadCache. attn_weights is a
        read-only view of the cache's P (like a tensor torch saved for backward, it must not
        change); np.array(attn_weights) is a writable copy.
    """
    if attention_options.get("block_size") is not None or attention_options.get("implementation") in ("tiled", "sparse"):
        raise ValueError("multihead_forward returns the attention weights [B, H, N_q, N_k], which the "
                         "tiled and sparse engines (implementation='tiled' or 'sparse', or block_size) never form; "
                         "call attention_forward(..., implementation='tiled') on split heads for O(N) memory")
    query, key, value = (as_float_array(x, name) for name, x in
                         (("query", query), ("key", key), ("value", value)))
    shapes = f"query {query.shape}, key {key.shape}, value {value.shape}"
    if not query.ndim == key.ndim == value.ndim == 3:
        raise ValueError(f"query, key, value must each have 3 axes [B, N, width], got {shapes}")
    if not query.shape[0] == key.shape[0] == value.shape[0]:
        raise ValueError(f"query, key, value must have the same batch size B, got {shapes}")
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"key and value must have the same length N_k, got {shapes}")
    D, num_heads = query.shape[2], require_positive_int(num_heads, "num_heads")
    if D % num_heads:
        raise ValueError(f"query's width d_model={D} must be divisible by num_heads={num_heads}, got {shapes}")
    require_mapping(params, "params")
    W_q = np.shape(params.get("W_q.weight"))                # d_model is query's width: check it first
    if len(W_q) == 2 and W_q[1] != D:
        raise ValueError(f"query's width {D} is not the input width of params['W_q.weight'] of shape "
                         f"{W_q} = [d_model, d_model]; got {shapes}")
    params = check_params(params, "params", D)
    for name, x, weight, width in (("key", key, "W_k.weight", "kdim"),
                                   ("value", value, "W_v.weight", "vdim")):
        if x.shape[2] != params[weight].shape[1]:
            raise ValueError(f"{name}'s width {x.shape[2]} is not the input width of params[{weight!r}] "
                             f"of shape {params[weight].shape} = [d_model, {width}]; got {shapes}")
    # the projections' threads: every core for large projections or many scores (the attention
    # resolves its own from `workers` as given); checked here, before any work
    B, N_q, N_k = query.shape[0], query.shape[1], key.shape[1]
    projections = B * (2 * N_q * D + N_k * (key.shape[2] + value.shape[2])) * D      # multiply-adds
    scores = score_count((B, num_heads, N_q, D // num_heads), N_k)
    engine = attention_options.get("implementation") or "blocked"      # (with topk_indices too: not sparse)
    attention_options = {**attention_options, "implementation": engine}
    workers = resolve_workers(attention_options.get("workers"), engine, scores, projections)
    if engine == "textbook":
        out, cache = textbook_multihead_forward(query, key, value, params, num_heads, mask, attention_options)
    else:
        out, cache = threaded_multihead_forward(query, key, value, params, num_heads, workers, mask,
                                                attention_options)
    weights = cache.attention.weights.view()          # read-only: the backward needs P unchanged,
    weights.flags.writeable = False                   # and a copy would cost another [B, H, N_q, N_k]
    return out, weights, cache


def multihead_backward(dout, cache):
    """Gradients of `multihead_forward`, by the forward's engine.

    Returns:
        dict with "query" [B, N_q, D], "key" [B, N_k, kdim], "value" [B, N_k, vdim] and one
        entry per state_dict key, each in that key's layout (weights [out, in]); with a
        `bias` among the forward's attention_options also "bias" (bias's shape).
    """
    require_cache(cache, MultiHeadCache, "multihead_backward")
    dout = as_float_array(dout, "dout")
    require_same_shape(dout, cache.o.out_shape, "dout")
    if cache.attention.plan.implementation == "textbook":
        return textbook_multihead_backward(dout, cache)
    return threaded_multihead_backward(dout, cache)


class MultiHeadAttention:
    """The seed's PyTorch MultiHeadAttention in NumPy, with a hand-written backward.

        mha = MultiHeadAttention(d_model, num_heads, seed=0)     # float64 by default
        out, attn_weights = mha(query, key, value, mask=None)    # [B, N_q, D], [B, H, N_q, N_k]
        grads = mha.backward(grad_output)                        # dict, see multihead_backward

    kdim, vdim: the widths of key [B, N_k, kdim] and value [B, N_k, vdim] (default d_model),
    like torch.nn.MultiheadAttention's; W_k.weight is [D, kdim], W_v.weight [D, vdim].

    Weights are initialized like nn.Linear: U(-1/sqrt(in), 1/sqrt(in)), in the projection's
    input width, from numpy.random.default_rng(seed), projection by projection (weight, then
    bias; W_q, W_k, W_v, W_o). The module remembers the last forward's
    cache for `backward`; the computation itself is the pure pair
    multihead_forward / multihead_backward.

    `params` holds read-only arrays the module owns, so a cache keeps them without a copy (a
    2 MiB copy per float64 weight at d_model = 512) and nothing can change them under it. To
    change the weights, load_state_dict, or put new arrays in `params` (a cache made before
    keeps the old ones).

    fully_masked: the policy for query rows whose keys are all masked
    ('zero' by default; 'uniform' reproduces the seed's -1e9 fill exactly).

    Threads: like a torch module, the object remembers its last forward for `backward`, so
    one module shared by threads (forward A, forward B, backward A) returns B's gradients.
    Give each thread its own module, or call the pure pair multihead_forward /
    multihead_backward, which keeps no state: it is safe across threads and gives bitwise
    the same results as the module.
    """

    def __init__(self, d_model, num_heads, *, kdim=None, vdim=None, seed=0, dtype=np.float64,
                 fully_masked="zero"):
        self.d_model = require_positive_int(d_model, "d_model")
        self.num_heads = require_positive_int(num_heads, "num_heads")
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}")
        self.d_k = d_model // num_heads
        self.kdim = d_model if kdim is None else require_positive_int(kdim, "kdim")
        self.vdim = d_model if vdim is None else require_positive_int(vdim, "vdim")
        try:
            self.dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype must be a floating or complex dtype, got {brief(dtype)}") from None
        if self.dtype.kind not in "fc":
            raise TypeError(f"dtype must be a floating or complex dtype, got {self.dtype}")
        self.fully_masked = require_choice(fully_masked, "fully_masked", FULLY_MASKED_POLICIES)
        rng = rng_from_seed(seed)
        shapes = param_shapes(self.d_model, self.kdim, self.vdim)
        self.params = {}
        for key, shape in shapes.items():                     # weight, then bias, per projection
            bound = 1.0 / np.sqrt(shapes[key.replace(".bias", ".weight")][1])   # nn.Linear: 1/sqrt(in)
            self.params[key] = read_only_copy(rng.uniform(-bound, bound, shape), self.dtype)   # frozen
        self._cache = None

    def __call__(self, query, key, value, mask=None, **attention_options):
        """query [B, N_q, D], key [B, N_k, kdim], value [B, N_k, vdim] ->
        (output [B, N_q, D], attn_weights [B, H, N_q, N_k]); options go to attention_forward."""
        inputs = [self._as_model_dtype(x, name)
                  for name, x in (("query", query), ("key", key), ("value", value))]
        widths = (("d_model", self.d_model), ("kdim", self.kdim), ("vdim", self.vdim))
        for name, x, (width_name, width) in zip(("query", "key", "value"), inputs, widths):
            if x.ndim != 3 or x.shape[-1] != width:
                raise ValueError(f"{name} must have shape [B, N, {width_name}={width}], got {x.shape} "
                                 f"(d_model={self.d_model}, kdim={self.kdim}, vdim={self.vdim})")
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
        grad_output = as_float_array(grad_output, "grad_output")
        require_same_shape(grad_output, self._cache.o.out_shape, "grad_output")
        return multihead_backward(grad_output, self._cache)

    def state_dict(self):
        """Copies of the parameters under the seed's keys, weights [out, in] like nn.Linear."""
        return {name: value.copy() for name, value in self.params.items()}

    def load_state_dict(self, state_dict):
        """Load the seed's keys, or torch.nn.MultiheadAttention's: in_proj_weight [3D, D] (packed)
        or q_proj_weight [D, D], k_proj_weight [D, kdim], v_proj_weight [D, vdim] (separate,
        torch's layout when kdim or vdim is set), with in_proj_bias [3D], out_proj.weight [D, D],
        out_proj.bias [D] (neither bias for a module made with bias=False: zeros). Arrays are
        copied; torch tensors are accepted."""
        require_mapping(state_dict, "state_dict")
        if any(key in state_dict for key in TORCH_WEIGHTS):
            state_dict = torch_to_seed_keys(state_dict, self.d_model, self.kdim, self.vdim)
        params = check_params(state_dict, "state_dict", self.d_model, self.kdim, self.vdim)
        for name, arr in params.items():
            if arr.dtype.kind == "c" and self.dtype.kind != "c":
                raise TypeError(f"state_dict[{name!r}] is complex ({arr.dtype}); "
                                f"the module's dtype is {self.dtype}")
        self.params = {name: read_only_copy(arr, self.dtype) for name, arr in params.items()}  # frozen
