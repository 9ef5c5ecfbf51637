"""Example kernels for the conformance run, each declared with what it supports.

    numpy-attention conform numpy_attention.conformance.examples:torch_sdpa --budget 600

    torch_sdpa        torch.nn.functional.scaled_dot_product_attention, torch's own dispatch
    torch_sdpa_math   the same under sdpa_kernel(SDPBackend.MATH)
    torch_sdpa_flash  the same under sdpa_kernel(SDPBackend.FLASH_ATTENTION) (the CPU flash kernel)
    torch_flex        torch.nn.attention.flex_attention, eager (forward only: no backward on CPU)
    jax_xla           jax.nn.dot_product_attention(implementation="xla"); fully masked rows: the
                      mean of v ('uniform'), as JAX's large negative fill gives; float32 and
                      bfloat16 (under jax.jit, XLA's CPU dot_general refuses float16 x float16
                      accumulated in float32: "precision 'F16_F16_F32' is not supported")
    mlx_sdpa          mlx.core.fast.scaled_dot_product_attention (the optional extra `mlx`), its
                      gradients by mx.vjp: a NumPy kernel that calls MLX; fully masked rows the
                      mean of v ('uniform'), as MLX's boolean mask gives
    numpy_float32     this package's attention in float32, results rounded to the dtype: a NumPy
                      kernel with every option and output

Each adapter translates the case's options (kernels.py: crosscheck's case keys) into its
library's arguments, and nothing else: a mask, a bottom-right diagonal or a window that the
library takes only as an attention mask is built here as one (_keep). torch, JAX and MLX
are imported when a kernel is called.
"""
import math
import warnings

import numpy as np

from ..attention import attention_backward, attention_forward
from ..oracle.schema import FLOAT_OPTIONS
from ..paged import unpack_rows
from .kernels import GRADIENT_OF
from .supports import OPTIONS, OUTPUTS, declare

SDPA = ("causal", "bottom_right", "gqa", "scale", "window", "bias", "mask", "gradients")
SDPA_FLASH = tuple(name for name in SDPA if name != "bias")    # the CPU flash kernel: no float attn_mask
FLEX = ("causal", "bottom_right", "gqa", "scale", "window", "softcap", "bias", "mask", "alibi", "lse")
JAX = ("causal", "gqa", "scale", "window", "bias", "mask", "lse", "gradients")
MLX = ("causal", "bottom_right", "gqa", "scale", "window", "mask", "gradients")   # (its one mask: no bias beside it)


def _keep(n_q, n_k, causal, window):
    """The keep-mask [N_q, N_k] of causal and window as a NumPy bool array (None: every key
    kept). The diagonal: i + N_k - N_q for causal='bottom_right', else i; a window
    (left, right) keeps j in [diagonal - left, diagonal + right] (-1: no bound on that side)."""
    if not causal and window is None:
        return None
    i, j = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    diagonal = i + (n_k - n_q if causal == "bottom_right" else 0)
    keep = j <= diagonal if causal else np.ones((n_q, n_k), dtype=bool)
    left, right = window if window is not None else (-1, -1)
    if left >= 0:
        keep = keep & (j >= diagonal - left)
    if right >= 0:
        keep = keep & (j <= diagonal + right)
    return keep


def _sdpa(backend, q, k, v, causal=False, scale=None, window=None, bias=None, mask=None):
    """SDPA with the case's options: is_causal for a plain top-left diagonal, else one attn_mask
    (bool: the keep-mask; float: the bias, -inf where not kept)."""
    import torch
    from torch.nn.attention import sdpa_kernel
    F = torch.nn.functional
    kwargs = {"scale": scale, "enable_gqa": q.shape[-3] != k.shape[-3]}
    if causal is True and window is None and mask is None and bias is None:
        kwargs["is_causal"] = True
    else:
        keep = _keep(q.shape[-2], k.shape[-2], causal, window)
        keep = None if keep is None else torch.as_tensor(keep)
        if mask is not None:
            keep = mask if keep is None else keep & mask
        if bias is not None:
            kwargs["attn_mask"] = bias if keep is None else bias.masked_fill(~keep, -math.inf)
        elif keep is not None:
            kwargs["attn_mask"] = keep
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(getattr(torch.nn.attention.SDPBackend, backend)):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


@declare(kind="torch", supports=SDPA)
def torch_sdpa(q, k, v, **options):
    """torch's scaled_dot_product_attention, the backend torch picks."""
    return _sdpa(None, q, k, v, **options)


@declare(kind="torch", supports=SDPA)
def torch_sdpa_math(q, k, v, **options):
    """torch's scaled_dot_product_attention on its math backend."""
    return _sdpa("MATH", q, k, v, **options)


@declare(kind="torch", supports=SDPA_FLASH)
def torch_sdpa_flash(q, k, v, **options):
    """torch's scaled_dot_product_attention on its flash backend (the CPU flash kernel)."""
    return _sdpa("FLASH_ATTENTION", q, k, v, **options)


@declare(kind="torch", supports=FLEX)
def torch_flex(q, k, v, causal=False, scale=None, window=None, softcap=None, bias=None, mask=None,
               alibi_slopes=None):
    """torch's flex_attention, eager: softcap, bias and ALiBi in a score_mod (on the scaled
    score, which flex traces in the tensors' dtype), the diagonal, window and mask in a block
    mask; (out, lse)."""
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention
    n_q, n_k = q.shape[-2], k.shape[-2]
    keep = _keep(n_q, n_k, causal, window)
    keep = None if keep is None else torch.as_tensor(keep)
    if mask is not None:                                   # [B, 1, N_q, N_k]
        keep = mask[:, 0] if keep is None else keep & mask[:, 0]

    def score_mod(score, b, h, i, j):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:                               # [H, N_q, N_k]
            score = score + bias[h, i, j]
        if alibi_slopes is not None:                       # -slope_h |i + N_k - N_q - j|
            score = score - alibi_slopes[h] * (i + n_k - n_q - j).abs()
        return score

    block_mask = None
    if keep is not None:
        batch = keep.shape[0] if keep.ndim == 3 else None
        at = (lambda b, h, i, j: keep[b, i, j]) if batch else (lambda b, h, i, j: keep[i, j])
        block_mask = create_block_mask(at, batch, None, n_q, n_k, device="cpu")
    with warnings.catch_warnings():                        # its advice to compile, once per run
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=q.shape[-3] != k.shape[-3], return_aux=AuxRequest(lse=True))
    return out, aux.lse


JAX_FILL = -1e38            # JAX's lse of a row with no key: about float32's lowest, not -inf


@declare(kind="jax", supports=JAX, dtypes=("float32", "bfloat16"), fully_masked="uniform")
def jax_xla(q, k, v, causal=False, scale=None, window=None, bias=None, mask=None):
    """jax.nn.dot_product_attention(implementation='xla') on [B, N, H, d] (ours is [B, H, N, d]);
    (out, lse), an lse at JAX's fill (a row with no key) read as -inf."""
    import jax
    import jax.numpy as jnp
    laid_out = lambda x: jnp.swapaxes(x, -2, -3)           # [B, H, N, d] <-> [B, N, H, d]
    if window is not None:                                  # JAX has no -1: a side wider than any i - j
        window = tuple(q.shape[-2] + k.shape[-2] if side < 0 else side for side in window)
    out, lse = jax.nn.dot_product_attention(
        laid_out(q), laid_out(k), laid_out(v), bias=None if bias is None else bias[None], mask=mask,
        scale=scale, is_causal=bool(causal), local_window_size=window, implementation="xla",
        return_residual=True)
    lse = jnp.swapaxes(lse, -1, -2)                         # [B, N_q, H] -> [B, H, N_q]
    return laid_out(out), jnp.where(lse <= JAX_FILL, -jnp.inf, lse)


@declare(kind="numpy", supports=MLX, fully_masked="uniform")
def mlx_sdpa(q, k, v, dout=None, causal=False, scale=None, window=None, mask=None):
    """MLX's fused attention on the case's arrays (NumPy, in the case's dtype), on MLX's CPU: the
    keep-mask of the mask, the diagonal and the window as its boolean mask (a bias would be a
    second, additive one, which it does not take); out and, with dout, dq, dk, dv by mx.vjp."""
    import mlx.core as mx
    dtype = q.dtype
    typed = {np.dtype(np.float32): mx.float32, np.dtype(np.float16): mx.float16}.get(dtype, mx.bfloat16)
    as_mx = lambda x: mx.array(np.asarray(x, np.float32)).astype(typed)
    keep = _keep(q.shape[-2], k.shape[-2], causal, window)
    if mask is not None:
        keep = mask if keep is None else keep & mask
    attn_mask = None if keep is None else mx.array(np.ascontiguousarray(keep))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    attend = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=attn_mask)
    back = lambda x: np.array(x.astype(mx.float32)).astype(dtype)
    inputs = [as_mx(x) for x in (q, k, v)]
    if dout is None:
        return {"out": back(attend(*inputs))}
    (out,), grads = mx.vjp(attend, inputs, [as_mx(dout)])
    return {"out": back(out), **{name: back(g) for name, g in zip(("dq", "dk", "dv"), grads)}}


@declare(kind="numpy", supports=OPTIONS + OUTPUTS)
def numpy_float32(q, k, v, dout=None, **options):
    """This package's attention_forward / attention_backward in float32, out and the gradients
    rounded to the inputs' dtype (lse and max_logits kept in float32, as kernels keep them)."""
    dtype = q.dtype
    wide = lambda x: x.astype(np.float32)
    options = {name: wide(x) if name in FLOAT_OPTIONS else x for name, x in options.items()}
    out, cache = attention_forward(wide(q), wide(k), wide(v), **options)
    rows = (lambda x: x) if cache.paged is None else (lambda x: unpack_rows(x, cache.paged))   # a paged
    results = {"out": out.astype(dtype), "lse": rows(cache.lse),                # cache's rows: packed
               "max_logits": rows(cache.max_logits).astype(np.float32)}
    if dout is not None:
        grads = attention_backward(wide(dout), cache)._asdict()
        results.update({GRADIENT_OF[name]: grads[GRADIENT_OF[name]].astype(dtype) for name in GRADIENT_OF
                        if name in ("q", "k", "v") or name in options})
    return results
