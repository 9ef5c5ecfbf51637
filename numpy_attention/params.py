"""The module's parameters: the seed's state_dict layout and torch.nn.MultiheadAttention's.

A leaf module beside multihead.py (it imports only _checks). Shape legend: D = d_model,
kdim / vdim the key / value widths. Weights are [out, in], as torch's nn.Linear stores them:

    the seed     W_q.weight [D, D]  W_k.weight [D, kdim]  W_v.weight [D, vdim]  W_o.weight [D, D],
                 each bias [D]
    torch        packed in_proj_weight [3D, D], or q/k/v_proj_weight (kdim, vdim set);
                 in_proj_bias [3D], out_proj.weight [D, D], out_proj.bias [D]
"""
import numpy as np

from ._checks import as_float_array, require_keys, require_mapping, require_shapes, to_numpy

PROJECTIONS = ("W_q", "W_k", "W_v", "W_o")
# torch.nn.MultiheadAttention's state_dict: packed when kdim == vdim == embed_dim, else separate
TORCH_PACKED = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")
TORCH_SEPARATE = ("q_proj_weight", "k_proj_weight", "v_proj_weight",
                  "in_proj_bias", "out_proj.weight", "out_proj.bias")
TORCH_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def param_shapes(d_model, kdim, vdim):
    """state_dict key -> shape: weights [out, in] = [D, input width], biases [D]."""
    shapes = {}
    for name, d_in in zip(PROJECTIONS, (d_model, kdim, vdim, d_model)):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (d_model, d_in), (d_model,)
    return shapes


def check_params(params, name, d_model, kdim=None, vdim=None):
    """The parameter arrays, checked: exactly the seed's keys, shapes as param_shapes.

    kdim / vdim None: the input widths W_k.weight / W_v.weight have (the caller checks
    them against key / value).
    """
    require_mapping(params, name)
    keys = param_shapes(d_model, d_model, d_model)
    require_keys(params, name, keys)
    arrays = {key: as_float_array(to_numpy(params[key]), f"{name}[{key!r}]") for key in keys}
    kdim = _input_width(arrays["W_k.weight"], d_model) if kdim is None else kdim
    vdim = _input_width(arrays["W_v.weight"], d_model) if vdim is None else vdim
    require_shapes(arrays, name, param_shapes(d_model, kdim, vdim))
    return arrays


def _input_width(weight, d_model):
    """A weight's input width (its last axis), d_model for a weight that is not 2-D."""
    return weight.shape[1] if weight.ndim == 2 else d_model


def torch_to_seed_keys(sd, d_model, kdim, vdim):
    """torch.nn.MultiheadAttention's keys -> the seed's keys (same [out, in] layout).

    Packed: in_proj_weight [3D, D] (torch's layout when kdim == vdim == D). Separate:
    q_proj_weight [D, D], k_proj_weight [D, kdim], v_proj_weight [D, vdim]. Both with
    in_proj_bias [3D], out_proj.weight [D, D], out_proj.bias [D]; a module made with
    bias=False has neither bias, and its biases are zeros.
    """
    if not any(key in sd for key in ("in_proj_bias", "out_proj.bias")):        # bias=False
        dtype = np.asarray(to_numpy(sd.get("out_proj.weight", 0.0))).dtype      # zeros in the weights' dtype
        dtype = dtype if dtype.kind in "fc" else np.float64
        sd = {**sd, "in_proj_bias": np.zeros(3 * d_model, dtype), "out_proj.bias": np.zeros(d_model, dtype)}
    packed = "in_proj_weight" in sd
    keys = TORCH_PACKED if packed else TORCH_SEPARATE
    require_keys(sd, f"state_dict (nn.MultiheadAttention layout, {'packed' if packed else 'separate'} "
                     f"in-projection weights)", keys)
    if packed and not kdim == vdim == d_model:
        raise ValueError(f"state_dict has the packed in_proj_weight, which needs kdim == vdim == d_model; "
                         f"this module has d_model={d_model}, kdim={kdim}, vdim={vdim}: "
                         f"pass q_proj_weight, k_proj_weight, v_proj_weight instead")
    sd = {key: as_float_array(to_numpy(sd[key]), f"state_dict[{key!r}]") for key in keys}
    require_shapes(sd, "state_dict", _torch_shapes(packed, d_model, kdim, vdim))
    weights = np.split(sd["in_proj_weight"], 3) if packed else [sd[f"{c}_proj_weight"] for c in "qkv"]
    out = {}
    for name, w, b in zip(PROJECTIONS, weights, np.split(sd["in_proj_bias"], 3)):
        out[f"{name}.weight"], out[f"{name}.bias"] = w, b
    out["W_o.weight"], out["W_o.bias"] = sd["out_proj.weight"], sd["out_proj.bias"]
    return out


def _torch_shapes(packed, d_model, kdim, vdim):
    """key -> shape of nn.MultiheadAttention's state_dict, packed or separate."""
    if packed:
        shapes = {"in_proj_weight": (3 * d_model, d_model)}
    else:
        shapes = {f"{c}_proj_weight": (d_model, d_in) for c, d_in in zip("qkv", (d_model, kdim, vdim))}
    return {**shapes, "in_proj_bias": (3 * d_model,), "out_proj.weight": (d_model, d_model),
            "out_proj.bias": (d_model,)}


def state_dict_grads(inputs, projections, dbias=None):
    """The module's gradients as a dict: "query", "key", "value" from `inputs` (dquery, dkey,
    dvalue), and each state_dict key from `projections`, the (dW, db) of W_q, W_k, W_v, W_o in the
    math layout [in, out] (returned transposed, [out, in] as the weights are stored); "bias"
    with an attention bias's gradient."""
    grads = dict(zip(("query", "key", "value"), inputs))
    for name, (dW, db) in zip(PROJECTIONS, projections):
        grads[f"{name}.weight"], grads[f"{name}.bias"] = dW.T, db
    if dbias is not None:
        grads["bias"] = dbias
    return grads
