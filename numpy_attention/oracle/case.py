"""Reading a case: split_case checks a case's arrays and returns a Case; load_case, save_case and
write_example_case read and write its .npz file.

split_case checks the keys (schema.py) and the settings (precision, layout, lse_base), reads the
tensors under the precision (storage.py) in [..., H, N, d], applies the transforms of the inputs
(transforms.py: float8's descales, MLA's kv, top-k lists, a paged KV cache), refuses inputs that
are not finite, decodes the options (schema.py) and checks every shape against q, k, v.
"""
import zipfile

import numpy as np

from .._checks import is_float_dtype, require_choice
from .._files import replacing
from ..attention import attention_backward, attention_forward
from ..near_misses import NEAR_MISSES
from ..options import NEGINF, attention_options
from ..rope import rope_qk
from .memory import too_large
from .npz import read_npz
from .precision import PRECISIONS
from .schema import (CANDIDATES, DESCALES, FLOAT_OPTIONS, FORWARD_MODE, GRADIENTS, INPUTS, KEYS, LAID_OUT, LAYOUTS,
                     LSE_BASES, OPTION_OF, Case, CaseError, check_keys, decode_options, word)
from .storage import StorageError, decode, infer_precision
from .transforms import (checked_topk, dequantized, fp8_settings, latent_kv, packed_if_paged, token_lists,
                         tokens)


def _setting(arrays, name, given, choices):
    """A setting from the case or the keyword (which must agree when both are given)."""
    value = word(choices)(arrays, name) if name in arrays else None
    if given is not None:
        given = require_choice(str(given), name, choices)
        if value is not None and value != given:
            raise CaseError(f"{name}={given!r} contradicts the case's {name} {value!r}")
        value = given
    return value


def _read_tensors(arrays, precision, layout):
    """(inputs as stored, candidates): decoded under the precision, in [..., H, N, d]."""
    roles = {"q": "input", "k": "input", "v": "input", "kv": "input", "dout": "gradient input",
             "q_dot": "gradient input", "k_dot": "gradient input", "v_dot": "gradient input"}
    tensors = {}
    for name in INPUTS + CANDIDATES + FLOAT_OPTIONS + DESCALES:
        if name in arrays:
            role = roles.get(name, "result" if name in CANDIDATES else None)
            x = np.asarray(arrays[name])
            if role is None:                                    # FLOAT_OPTIONS, descales: floats
                if not is_float_dtype(x.dtype):
                    raise StorageError(f"{name} must be a float array (float16/32/64, bfloat16 or "
                                       f"float8), got dtype {x.dtype} with shape {x.shape}")
            else:
                x = decode(name, x, precision, role)
            if layout == "bnhd" and name in LAID_OUT:
                if x.ndim < 3:
                    raise CaseError(f"layout 'bnhd' needs {name} with axes [..., N, H, d], "
                                    f"got shape {x.shape}")
                x = np.swapaxes(x, -2, -3)
            tensors[name] = x
    return tensors


def _require_finite(tensors, inputs):
    """CaseError naming the key when an input the rule cannot judge with holds a value that is
    not finite: q, k, v, dout and the tangents (after their descales), a float option's (a -inf
    in options.NEGINF's: it masks a score, or is no sink). An infinite input
    makes every bound infinite, and anything would pass."""
    for name, x, allowed in [(n, inputs[n], ()) for n in INPUTS if n in inputs] + [
            (n, tensors[n].astype(np.float64), (-np.inf,) if n in NEGINF else ())
            for n in FLOAT_OPTIONS if n in tensors]:
        bad = ~np.isfinite(x) & ~np.isin(x, allowed)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            stored = tensors.get(name, x)[where]
            descaled = f" times {name}_descale" if np.isfinite(np.float64(stored)) else ""
            said = "; -inf masks a score" if allowed else ""
            raise CaseError(f"{name}{descaled} holds {int(bad.sum())} value(s) that are not finite, e.g. "
                            f"{name}{list(where)} = {x[where]:g}: crosscheck judges a kernel on finite "
                            f"inputs{said} (an infinite input makes every bound infinite)")


def _require_shape(arrays, name, shape):
    if arrays[name].shape != tuple(shape):
        raise CaseError(f"{name} must have shape {tuple(shape)}, got {arrays[name].shape}")


def _require_lse_shape(lse, shape):
    """lse [..., H, N_q]; FlashAttention's Triton kernel's, padded to a multiple of 128 rows, named."""
    n = shape[-1]
    if lse.shape[:-1] == tuple(shape[:-1]) and lse.shape[-1] == -(-n // 128) * 128 != n:
        raise CaseError(f"lse has {lse.shape[-1]} rows, N_q = {n}: FlashAttention's Triton kernel pads "
                        f"to a multiple of 128; pass lse[..., :{n}]")


def split_case(arrays, *, precision=None, layout=None, lse_base=None, memory=False):
    """Validate a case; return a Case (inputs, options, candidates, precision, lse_base).

    precision, layout ('bhnd' or FlashAttention's 'bnhd') and lse_base ('e' or '2') may
    come as keywords or as keys of the case. Checked in this order, so that a mistake is
    blamed on the tensor that has it: the keys; q, k, v against each other; the options;
    the upstream gradient and the candidate's tensors. Raises CaseError naming the key.
    memory: also refuse a case that crosscheck would need more memory to judge than this
    machine has (memory.py), before anything of the size of its scores is allocated.
    """
    check_keys(arrays)
    for name in ("q", "out") + (("k", "v") if "kv" not in arrays else ()):
        if name not in arrays:
            raise CaseError(f"missing key {name!r}")
    try:
        name = _setting(arrays, "precision", precision, tuple(PRECISIONS))
        layout = _setting(arrays, "layout", layout, LAYOUTS) or "bhnd"
        lse_base = _setting(arrays, "lse_base", lse_base, LSE_BASES) or "e"
        candidates = {n: np.asarray(arrays[n]) for n in CANDIDATES if n in arrays}
        chosen = PRECISIONS[name] if name else infer_precision(np.asarray(arrays["q"]), candidates)
        tensors = _read_tensors(arrays, chosen, layout)
    except (StorageError, ValueError) as exc:
        raise CaseError(str(exc)) from None
    latent = latent_kv(arrays, tensors)
    gradients = [n for n in GRADIENTS if n in tensors]
    if gradients and chosen.forward_only:
        raise CaseError(f"precision {chosen.name!r} is checked forward only; the case has {gradients[0]}")
    if gradients and "dout" not in tensors:
        raise CaseError(f"missing key 'dout': the upstream gradient that {gradients[0]} belongs to")
    for gradient, option in OPTION_OF.items():
        if gradient in tensors and option not in tensors:
            raise CaseError(f"{gradient} is given but {option} is not")
    chosen, block = fp8_settings(arrays, chosen)
    inputs, scales = dequantized(tensors, chosen, block)
    _require_finite(tensors, inputs)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]                  # as stored (a paged cache too)
    options = decode_options({**arrays, **{n: tensors[n] for n in FLOAT_OPTIONS if n in tensors}})
    inputs, options, paged = packed_if_paged(arrays, inputs, options)
    _check_qkv(inputs, layout)
    lists = checked_topk(arrays, inputs, options, paged)              # checked, not yet made tokens
    n_k = inputs["k"].shape[-2]
    if memory:                                                       # before the scores' size is taken
        refused = too_large(sum(np.asarray(x).nbytes for x in arrays.values()),
                            inputs["q"].shape[:-1] + (n_k,), 0 if lists is None else tokens(lists, n_k))
        if refused:
            raise CaseError(refused)
    topk = None if lists is None else token_lists(*lists, n_k)
    if topk is not None:                                             # the lists stay lists (topk.py)
        options = {**options, "topk_indices": topk[0],
                   **({} if topk[1] is None else {"topk_length": topk[1]})}
    try:
        plain = {name: x for name, x in options.items() if name != "rope"}
        record = attention_options(inputs["q"], inputs["k"], inputs["v"], **plain)[3]
    except (ValueError, TypeError) as exc:
        raise CaseError(str(exc)) from None
    try:                                                             # rope's settings and positions
        if "rope" in options:
            rope_qk(inputs["q"], inputs["k"], options["rope"], record)
    except (ValueError, TypeError) as exc:
        raise CaseError(f"the case's rope_* keys: {exc}") from None
    out_shape = q.shape[:-1] + v.shape[-1:]
    tangents = [n for n in FORWARD_MODE if n in tensors]
    if tangents and not {"q_dot", "k_dot", "v_dot"} & set(tensors):
        raise CaseError(f"missing a tangent: {tangents[0]} needs q_dot, k_dot or v_dot (the others are 0)")
    if tangents and chosen.recipe:
        raise CaseError(f"tangents are judged in the float32 and float64 precisions; this case's is "
                        f"{chosen.name!r}")
    if tangents and paged is not None:
        raise CaseError("tangents are judged without a paged KV cache (page_table)")
    for n, shape in (("q_dot", q.shape), ("k_dot", k.shape), ("v_dot", v.shape),
                     ("out_dot", out_shape), ("lse_dot", q.shape[:-1]),
                     ("dout", out_shape), ("out", out_shape), ("lse", q.shape[:-1]),
                     ("dq", q.shape), ("dk", k.shape), ("dv", v.shape), ("dkv", k.shape),
                     *((g, np.shape(tensors.get(o))) for g, o in OPTION_OF.items())):
        if n in tensors:
            if n == "lse":
                _require_lse_shape(tensors[n], shape)
            _require_shape(tensors, n, shape)
    if "max_logits" in tensors:                                     # per row, or per head (over the
        heads = q.shape[-3] if q.ndim >= 3 else 1                    # batch and the rows)
        shapes = (q.shape[:-1], (heads,))
        if tensors["max_logits"].shape not in shapes:
            raise CaseError(f"max_logits must have shape {shapes[0]} (each row's largest score, like lse) or "
                            f"{shapes[1]} (each head's, over the batch and the rows), got {tensors['max_logits'].shape}")
    return Case(inputs=inputs, options=options,
                candidates={n: tensors[n] for n in CANDIDATES if n in tensors},
                precision=chosen, layout=layout, lse_base=lse_base, paged=paged, latent=latent,
                scales=scales or None, topk=topk)


def _check_qkv(inputs, layout):
    """q, k, v against each other (attention_options' checks), CaseError naming the shapes; in
    layout 'bnhd' the shapes as stored, and whether they fit the default [..., H, N, d] as they
    are (the layout given to a case that needs none)."""
    qkv = [inputs[name] for name in ("q", "k", "v")]
    try:
        attention_options(*qkv)
    except (ValueError, TypeError) as exc:
        if layout != "bnhd":
            raise CaseError(str(exc)) from None
        stored = [np.swapaxes(x, -2, -3) for x in qkv]
        said = ", ".join(f"{name} {x.shape}" for name, x in zip("qkv", stored))
        try:
            attention_options(*stored)
        except (ValueError, TypeError):
            raise CaseError(f"{said} as stored, read as [..., N, H, d] (layout 'bnhd'): {exc}") from None
        raise CaseError(f"{said} do not fit [..., N, H, d] (layout 'bnhd'); as stored they fit [..., H, N, d], "
                        f"the default layout: drop layout='bnhd'") from None


def load_case(path):
    """Read a .npz case into a dict of arrays, every member checked before its data is read
    (npz.py); CaseError for a file that is not a case. Members named as in NEAR_MISSES (torch's
    attn_mask) are read too, for split_case to refuse with the advice."""
    try:
        return read_npz(path, KEYS + tuple(NEAR_MISSES))    # split_case explains a near miss
    except (OSError, ValueError, EOFError, RuntimeError, NotImplementedError, zipfile.BadZipFile) as exc:
        raise CaseError(f"cannot read {path} as a .npz case: {exc}") from None


def save_case(path, **arrays):
    """Write a case (keys as in schema.py's docstring); Python values become 0-d arrays.
    A file's raw bytes cannot tell the 1-byte formats (float8, float4_e2m1fn, e8m0) apart, so
    the case's precision is written with them: an input, a descale or an option as its float32
    values (exactly theirs), a candidate's result as raw bytes, which read back in the
    precision's 1-byte format (the only one split_case lets a result take: judged as it was)."""
    arrays = {name: np.asarray(x) for name, x in arrays.items()}
    case = split_case(arrays)                                           # refuse to write a bad case
    narrow = {name: x for name, x in arrays.items() if is_float_dtype(x.dtype) and x.dtype.itemsize == 1}
    if narrow:
        written = {name: x.view(np.uint8) if name in CANDIDATES else x.astype(np.float32) for name, x in narrow.items()}
        arrays = {**arrays, "precision": np.array(case.precision.name), **written}
    with replacing(path, "wb") as f:             # exactly `path` (np.savez(path) would append .npz),
        np.savez(f, **arrays)                    # replaced only once written whole


def write_example_case(path, *, seed=0):
    """Write an example case: float32 results of our own attention for a causal GQA case.

    q [2, 4, 6, 8], k and v [2, 2, 9, 8] (two query heads per kv head, N_q != N_k), a
    bias [4, 6, 9] with its gradient, bottom-right causal. Returns the arrays written.
    """
    rng = np.random.default_rng(seed)
    arrays = {"q": rng.standard_normal((2, 4, 6, 8)), "k": rng.standard_normal((2, 2, 9, 8)),
              "v": rng.standard_normal((2, 2, 9, 8)), "dout": rng.standard_normal((2, 4, 6, 8)),
              "bias": rng.standard_normal((4, 6, 9)), "causal": np.array("bottom_right")}
    f32 = {name: x.astype(np.float32) for name, x in arrays.items() if name != "causal"}
    out, cache = attention_forward(f32["q"], f32["k"], f32["v"], bias=f32["bias"],
                                   causal="bottom_right")
    g = attention_backward(f32["dout"], cache)
    arrays.update(out=out, lse=cache.lse, dq=g.dq, dk=g.dk, dv=g.dv, dbias=g.dbias)
    save_case(path, **arrays)
    return arrays
