"""Torch modules -> our modules, with the weights copied and torch's conventions converted.

    mha = from_torch(module)              # torch is imported by the caller, never here
    out, weights = mha(query, key, value, ...)           # same call signature as the module
    grads = mha.backward(grad_output)                    # keyed like module.named_parameters()

- The seed's MultiHeadAttention (W_q, W_k, W_v, W_o nn.Linear): our MultiHeadAttention
  with the same state_dict, and fully_masked="uniform", which is what its -1e9 fill gives.
- torch.nn.MultiheadAttention: TorchMultiheadAttention below. Packed in_proj_weight, or
  q/k/v_proj_weight when kdim/vdim differ from embed_dim (key [.., kdim], value [.., vdim]);
  bias=False loads as zero biases (and reports no bias gradients); batch_first=False means
  [N, B, E] tensors; attn_mask and key_padding_mask True = *ignore* (the opposite of
  ours) and float masks are added to the scores (our `bias`); weights are averaged
  over heads unless average_attn_weights=False. A query with every key masked gives what
  the module gives, which depends on need_weights: with need_weights=True (its default)
  the module computes the weights itself and returns NaN for that row
  (fully_masked="nan"); with need_weights=False it runs scaled_dot_product_attention,
  whose safe softmax gives zero attention, so the row's output is out_proj.bias and its
  gradients are finite (fully_masked="zero").
  Not supported: add_bias_kv, add_zero_attn, dropout > 0 in training mode.
"""
import numpy as np

from .._checks import as_float_array, require_same_shape, to_numpy
from ..multihead import MultiHeadAttention, multihead_backward, multihead_forward
from ..params import PROJECTIONS, check_params, torch_to_seed_keys


def from_torch(module, *, dtype=np.float64):
    """Our module for a torch module (the seed's class or nn.MultiheadAttention), in `dtype`."""
    if all(hasattr(module, name) for name in PROJECTIONS + ("num_heads", "d_model")):
        mha = MultiHeadAttention(module.d_model, module.num_heads, dtype=dtype, fully_masked="uniform")
        mha.load_state_dict(module.state_dict())
        return mha
    if all(hasattr(module, name) for name in ("embed_dim", "num_heads", "out_proj", "batch_first")):
        return TorchMultiheadAttention(module, dtype=dtype)
    raise TypeError(f"from_torch takes the seed's MultiHeadAttention or torch.nn.MultiheadAttention, "
                    f"got {type(module).__name__}")


class TorchMultiheadAttention:
    """torch.nn.MultiheadAttention's forward and call signature, on multihead_forward/backward."""

    def __init__(self, module, *, dtype=np.float64):
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported")
        if module.training and module.dropout > 0:
            raise ValueError(f"dropout={module.dropout} in training mode draws random numbers; "
                             f"call module.eval() first")
        sd = {name: to_numpy(x).astype(dtype) for name, x in module.state_dict().items()}
        e = module.embed_dim
        self.packed, self.has_bias = "in_proj_weight" in sd, "in_proj_bias" in sd
        params = torch_to_seed_keys(sd, e, module.kdim, module.vdim)      # bias=False: zero biases
        self.params = check_params(params, "module.state_dict()", e, module.kdim, module.vdim)
        self.num_heads, self.batch_first, self.dtype = module.num_heads, module.batch_first, dtype
        self._cache, self._out_shape = None, None

    def _layout(self, x):
        """[N, B, E] <-> [B, N, E] unless batch_first (its own inverse)."""
        return x if self.batch_first else np.swapaxes(x, 0, 1)

    def _masks(self, key_padding_mask, attn_mask, batch, n_q, n_k):
        """torch's masks (True = ignore, or additive floats) -> our (keep, bias), [B, H|1, N_q, N_k].

        The shapes torch takes: key_padding_mask [B, N_k]; attn_mask [N_q, N_k] or
        [B * H, N_q, N_k]; each bool or floating, as torch requires."""
        keep, bias = None, None
        h = self.num_heads
        for name, m, shapes, to in (("key_padding_mask", key_padding_mask, [(batch, n_k)], (batch, 1, 1, n_k)),
                                    ("attn_mask", attn_mask, [(n_q, n_k), (batch * h, n_q, n_k)],
                                     (batch, h, n_q, n_k))):
            if m is None:
                continue
            try:
                m = np.asarray(to_numpy(m))
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{name} must be a bool or floating array: {exc}") from None
            if m.dtype.kind not in "bf":
                raise TypeError(f"{name} must be a bool or floating array (as torch requires), got "
                                f"dtype {m.dtype} with shape {m.shape}")
            if m.shape not in shapes:
                raise ValueError(f"{name} must have shape {' or '.join(map(str, shapes))}, got {m.shape}")
            m = m.reshape(to) if name == "key_padding_mask" or m.ndim == 3 else m   # [N_q, N_k] broadcasts
            if m.dtype == bool:
                keep = ~m if keep is None else keep & ~m
            else:
                bias = m.astype(self.dtype) if bias is None else bias + m
        return keep, bias

    def _input(self, x, name):
        """A query/key/value in torch's layout -> ours [B, N, width], checked."""
        x = as_float_array(to_numpy(x), name)
        if x.ndim != 3:
            layout = "[B, N, E]" if self.batch_first else "[N, B, E] (batch_first=False)"
            raise ValueError(f"{name} must have 3 axes {layout}, got shape {x.shape}")
        return self._layout(x.astype(self.dtype, copy=False))

    def __call__(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                 average_attn_weights=True):
        """(attn_output, attn_weights) as the torch module returns them (weights None unless needed)."""
        query, key, value = (self._input(x, name) for name, x in
                             (("query", query), ("key", key), ("value", value)))
        keep, bias = self._masks(key_padding_mask, attn_mask, query.shape[0], query.shape[1], key.shape[1])
        policy = "nan" if need_weights else "zero"               # the module's two paths (docstring)
        out, weights, self._cache = multihead_forward(query, key, value, self.params, self.num_heads,
                                                      mask=keep, bias=bias, fully_masked=policy)
        self._out_shape = self._layout(out).shape                # what backward's grad_output must be
        if not need_weights:
            return self._layout(out), None
        return self._layout(out), weights.mean(axis=1) if average_attn_weights else weights

    forward = __call__

    def backward(self, grad_output):
        """dict: "query", "key", "value" (in the call's layout) and the module's parameter names."""
        if self._cache is None:
            raise ValueError("TorchMultiheadAttention.backward needs a forward first: call "
                             "mha(query, key, value) before mha.backward(grad_output)")
        grad_output = as_float_array(to_numpy(grad_output), "grad_output")
        require_same_shape(grad_output, self._out_shape, "grad_output")
        g = multihead_backward(self._layout(grad_output), self._cache)
        grads = {name: self._layout(g[name]) for name in ("query", "key", "value")}
        dw = [g[f"{name}.weight"] for name in PROJECTIONS[:3]]
        if self.packed:
            grads["in_proj_weight"] = np.concatenate(dw)
        else:
            grads.update({f"{c}_proj_weight": w for c, w in zip("qkv", dw)})
        if self.has_bias:
            grads["in_proj_bias"] = np.concatenate([g[f"{name}.bias"] for name in PROJECTIONS[:3]])
            grads["out_proj.bias"] = g["W_o.bias"]
        grads["out_proj.weight"] = g["W_o.weight"]
        return grads
