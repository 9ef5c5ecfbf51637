"""The `.npz` exchange format: one attention case and a candidate's results.

Any language that writes NumPy's .npz (numpy.savez; cnpy in C++; npyz in Rust;
NPZ.jl) can produce a case. Keys (shape legend of textbook.py):

    inputs      q [..., H, N_q, d_k]  k [..., H_kv, N_k, d_k]  v [..., H_kv, N_k, d_v]
                dout [..., H, N_q, d_v]            (needed when a gradient is given)
    options     mask          keep-mask broadcastable to [..., H, N_q, N_k], True/nonzero = attend
                              (a float one holds 0 / 1; torch's 0 / -inf float mask is a bias)
                bias          additive float scores, broadcastable like mask
                causal        0-d bool, or the alignment name 'top_left' / 'bottom_right'
                align         0-d 'top_left' / 'bottom_right': the diagonal of causal and window
                scale         0-d float > 0, finite (default 1 / sqrt(d_k))
                window        int [2]: (left, right), -1 = unbounded
                softcap       0-d float > 0, finite
                dropout_mask  keep-mask broadcastable like mask;  dropout_p  0-d float in [0, 1)
                fully_masked  0-d 'zero' / 'uniform' / 'nan' (default 'zero')
                rope_layout   0-d 'half' / 'interleaved': q and k are turned inside (rope.py; q, k,
                              dq, dk are the unturned ones); with it, optionally
                              rope_rotary_dim (0-d int), rope_part (0-d 'first' / 'last': which
                              rope_rotary_dim entries turn), rope_base (0-d float), rope_positions_q
                              [N_q] and rope_positions_k [N_k] (default bottom-right per sequence),
                              rope_scaling 0-d 'linear' / 'yarn' with rope_factor and for YaRN
                              rope_original_max_position_embeddings, rope_beta_fast, rope_beta_slow,
                              rope_truncate (0-d bool), rope_mscale, rope_mscale_all_dim,
                              rope_attention_factor (Hugging Face's YaRN keys)
                kv            MLA's latent keys [..., 1, N_k, r + p] in place of k and v, with
                              head_dim_v (0-d int r): the values are kv[..., :r] (mla.py)
    candidate   out [..., H, N_q, d_v]   (required)
                lse [..., H, N_q]        dq, dk, dv (the shapes of q, k, v)   dbias (bias's shape)
                dkv (kv's shape, with kv: the keys' and the values' gradients summed)
                (lse of a fully masked row: -inf, or FlashAttention's +inf; rule.py)

The candidate's dtype is that of its tensors (float16, float32 or float64; each
tensor is judged in its own, so a float32 lse may come with a float16 out);
the order of operations is textbook.py's: scale -> softcap -> bias -> masks
-> softmax -> dropout -> @ v.
"""
import zipfile
from typing import NamedTuple

import numpy as np

from .._checks import (is_float_dtype, require_choice, require_keep_mask, require_positive_real,
                       require_probability)
from .._files import replacing
from .._layout import ALIGNMENTS, check_window, resolve_alignment
from ..attention import FULLY_MASKED_POLICIES, attention_backward, attention_forward
from ..near_misses import NEAR_MISSES, near_miss
from ..options import attention_options
from ..paged import check_pages, cu_seqlens, pack, pack_rows
from ..rope import LAYOUTS as ROPE_LAYOUTS, PARTS, SCALINGS, rope_qk
from ..scores import KEEP_STEPS
from ..topk import block_indices, check_lists, listed
from .precision import ACCUMULATOR_BITS, PRECISIONS, Precision, round_to
from .memory import too_large
from .npz import read_npz
from .storage import StorageError, decode, infer_precision

INPUTS = ("q", "k", "v", "dout", "q_dot", "k_dot", "v_dot", "kv")   # the tangents: forward mode; kv: MLA
OPTIONS = ("mask", "bias", "causal", "align", "scale", "window", "softcap", "dropout_mask",
           "dropout_p", "fully_masked", "sinks", "alibi_slopes", "cu_seqlens_q", "cu_seqlens_k",
           "seqused_k", "page_table", "cache_seqlens") + tuple(KEEP_STEPS)   # + scores.py's, by name
CANDIDATES = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks", "dalibi_slopes", "out_dot", "lse_dot", "dkv")
FORWARD_MODE = ("out_dot", "lse_dot")
ROPE = ("rope_layout", "rope_rotary_dim", "rope_part", "rope_base", "rope_positions_q", "rope_positions_k", "rope_scaling",
        "rope_factor", "rope_original_max_position_embeddings", "rope_beta_fast", "rope_beta_slow", "rope_truncate",
        "rope_mscale", "rope_mscale_all_dim", "rope_attention_factor")
OPTIONS = OPTIONS + ROPE                              # gathered into attention_forward's rope={...}
PAGED = ("page_table", "cache_seqlens")
FLOAT_OPTIONS = ("bias", "sinks", "alibi_slopes")     # float arrays: rounded to the candidate's dtype              # read by _packed_if_paged, not options
GRADIENTS = ("dq", "dk", "dv", "dbias", "dsinks", "dalibi_slopes", "dkv")
_PER_HEAD = {"dsinks": "sinks", "dalibi_slopes": "alibi_slopes"}
DESCALES = ("q_descale", "k_descale", "v_descale")
FP8 = ("descale_block", "intermediate_dtype", "accumulator_bits")   # float8: the descales' block, P's dtype
                                                                     # before P v, the products' accumulator
INTERMEDIATE = ("float8_e4m3fn", "float8_e5m2", "bfloat16")
SETTINGS = ("precision", "layout", "lse_base")        # how to read the case (also keywords)
LATENT = ("head_dim_v",)                              # MLA: the values are kv's first head_dim_v columns
TOPK = ("topk_indices", "topk_length", "topk_block_size")   # sparse top-k: each query's keys (or key blocks)
LAYOUTS = ("bhnd", "bnhd")
LSE_BASES = ("e", "2")
KEYS = INPUTS + OPTIONS + CANDIDATES + DESCALES + FP8 + SETTINGS + LATENT + TOPK
# tensors with a head axis and a length axis, in [..., H, N, d] (or FlashAttention's [..., N, H, d])
_LAID_OUT = ("q", "k", "v", "dout", "out", "dq", "dk", "dv", "q_dot", "k_dot", "v_dot", "out_dot", "kv", "dkv")


class Case(NamedTuple):
    inputs: dict            # q, k, v (dout): float64 arrays of the values the kernel used
                            # (float8: dequantized, x * descale)
    options: dict           # attention_forward's keyword arguments
    candidates: dict        # out (lse, dq, dk, dv, dbias): float or ml_dtypes arrays, as given
    precision: Precision    # what the candidate computed in (precision.py)
    layout: str             # 'bhnd' or 'bnhd': how the tensors were stored (now all [..., H, N, d])
    lse_base: str           # 'e' or '2': the base of the candidate's lse
    paged: object = None    # paged.PagedLayout: inputs packed from a paged KV cache (page_table)
    latent: object = None   # MLA's head_dim_v r: k is the case's kv, v = kv[..., :r], dkv judged
    scales: object = None   # float8: {'q' / 'k' / 'v': (stored values, descale [..., H, N, 1])}
    topk: object = None     # sparse top-k: (token indices [..., H_kv or H, N_q, K], topk_length or None,
                            # (block indices, block size) or None); options has the first two


class CaseError(ValueError):
    """A malformed case: the one-line message names the key and the shapes."""


def _scalar(arrays, name, kind):
    """A 0-d option as a Python value; `kind` is 'bool', 'float' or 'str'."""
    x = np.asarray(arrays[name])
    ok = {"bool": "b", "float": "fiu", "str": "U"}[kind]
    if x.ndim != 0 or x.dtype.kind not in ok:
        raise CaseError(f"{name} must be a 0-d {kind}, got dtype {x.dtype} with shape {x.shape}")
    return x.item()


def _causal(arrays, name):
    x = np.asarray(arrays[name])
    if x.ndim == 0 and x.dtype.kind == "U":
        return require_choice(x.item(), name, ALIGNMENTS)
    if x.ndim == 0 and x.dtype.kind in "iu" and x.item() in (0, 1):      # 0 / 1 as a bool
        return bool(x.item())
    return _scalar(arrays, name, "bool")


def _window(arrays, name):
    x = np.asarray(arrays[name])
    if x.shape != (2,) or x.dtype.kind not in "iu":
        raise CaseError(f"{name} must be an integer array of shape (2,), got dtype {x.dtype} "
                        f"with shape {x.shape}")
    return check_window((int(x[0]), int(x[1])))


def _mask(arrays, name):
    """A keep-mask as given; a float one must hold only 0 and 1 (torch's 0 / -inf is a bias)."""
    return require_keep_mask(np.asarray(arrays[name]), name)


def _word(choices):
    return lambda arrays, name: require_choice(_scalar(arrays, name, "str"), name, choices)


def _real(check):
    return lambda arrays, name: check(_scalar(arrays, name, "float"), name)


# option -> decode(arrays, name): its Python value, checked by attention_forward's rules
_DECODE = {"mask": _mask, "causal": _causal, "window": _window, "align": _word(ALIGNMENTS),
           "scale": _real(require_positive_real), "softcap": _real(require_positive_real),
           "dropout_p": _real(require_probability), "fully_masked": _word(FULLY_MASKED_POLICIES)}


def _positions(arrays, name):
    x = np.asarray(arrays[name])
    if x.ndim != 1 or x.dtype.kind not in "iuf":
        raise CaseError(f"{name} must be a 1-d array of positions, got dtype {x.dtype} with shape {x.shape}")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        at = int(np.argmax(~np.isfinite(x)))
        raise CaseError(f"{name} must hold finite positions, got {name}[{at}] = {x[at]:g}")
    return x


def _integer(arrays, name):
    x = np.asarray(arrays[name])
    if x.ndim != 0 or x.dtype.kind not in "iu":
        raise CaseError(f"{name} must be a 0-d integer, got dtype {x.dtype} with shape {x.shape}")
    return int(x)


_ROPE_DECODE = {"rope_layout": _word(ROPE_LAYOUTS), "rope_rotary_dim": _integer, "rope_part": _word(PARTS),
                "rope_base": _real(require_positive_real), "rope_positions_q": _positions,
                "rope_positions_k": _positions, "rope_scaling": _word(tuple(SCALINGS)),
                "rope_truncate": lambda arrays, name: _scalar(arrays, name, "bool")}


def _rope(arrays):
    """attention_forward's rope dict from the case's rope_* keys, or None without rope_layout."""
    given = [name for name in ROPE if name in arrays]
    if not given:
        return None
    if "rope_layout" not in arrays:
        raise CaseError(f"{given[0]} is given but rope_layout is not: a case with rope names its layout "
                        f"('half' or 'interleaved')")
    rope, scaling = {}, {}
    for name in given:
        value = _ROPE_DECODE.get(name, _real(require_positive_real))(arrays, name)
        key = name[len("rope_"):]
        if key in ("layout", "rotary_dim", "part", "base", "positions_q", "positions_k"):
            rope[key] = value
        else:
            scaling["type" if key == "scaling" else key] = value
    if scaling:
        if "type" not in scaling:
            raise CaseError(f"rope_{next(iter(scaling))} is given but rope_scaling is not ('linear' or 'yarn')")
        rope["scaling"] = scaling
    return rope


def _decode_options(arrays):
    """attention_forward's keyword arguments from the case; CaseError naming a bad option."""
    try:
        options = {name: _DECODE[name](arrays, name) if name in _DECODE else arrays[name]
                   for name in OPTIONS if name in arrays and name not in PAGED and name not in ROPE}
        resolve_alignment(options.get("causal", False), options.get("align"))
        rope = _rope(arrays)
    except (ValueError, TypeError) as exc:
        raise CaseError(str(exc)) from None
    return options if rope is None else {**options, "rope": rope}


def _require_shape(arrays, name, shape):
    if arrays[name].shape != tuple(shape):
        raise CaseError(f"{name} must have shape {tuple(shape)}, got {arrays[name].shape}")


def _require_lse_shape(lse, shape):
    """lse [..., H, N_q]; FlashAttention's Triton kernel's, padded to a multiple of 128 rows, named."""
    n = shape[-1]
    if lse.shape[:-1] == tuple(shape[:-1]) and lse.shape[-1] == -(-n // 128) * 128 != n:
        raise CaseError(f"lse has {lse.shape[-1]} rows, N_q = {n}: FlashAttention's Triton kernel pads "
                        f"to a multiple of 128; pass lse[..., :{n}]")


def check_keys(names):
    """CaseError for the first name that is not a case key: how to pass it, a close match, or
    the keys (crosscheck's keywords too, even set to None: a torch name must not pass unread)."""
    unknown = sorted(set(names) - set(KEYS))
    if unknown:
        raise CaseError(_unknown_key(unknown[0]))


def _unknown_key(name):
    """The message for a key a case does not have: how to pass it, a close match, or the keys."""
    hint = near_miss(name, KEYS)
    return f"unknown key {name!r}: {hint}" if hint else \
        f"unknown key {name!r}; a case has keys {', '.join(KEYS)}"


def _setting(arrays, name, given, choices):
    """A setting from the case or the keyword (which must agree when both are given)."""
    value = _word(choices)(arrays, name) if name in arrays else None
    if given is not None:
        given = require_choice(str(given), name, choices)
        if value is not None and value != given:
            raise CaseError(f"{name}={given!r} contradicts the case's {name} {value!r}")
        value = given
    return value


def _read_tensors(arrays, precision, layout):
    """(inputs as stored, candidates): decoded under the precision, in [..., H, N, d]."""
    roles = {"q": "input", "k": "input", "v": "input", "kv": "input", "dout": "gradient input", "q_dot": "gradient input",
             "k_dot": "gradient input", "v_dot": "gradient input"}
    tensors = {}
    for name in INPUTS + CANDIDATES + ("bias", "sinks", "alibi_slopes") + DESCALES:
        if name in arrays:
            role = roles.get(name, "result" if name in CANDIDATES else None)
            x = np.asarray(arrays[name])
            if role is None:                                    # bias, sinks, slopes, descales: floats
                if not is_float_dtype(x.dtype):
                    raise StorageError(f"{name} must be a float array (float16/32/64, bfloat16 or "
                                       f"float8), got dtype {x.dtype} with shape {x.shape}")
            else:
                x = decode(name, x, precision, role)
            if layout == "bnhd" and name in _LAID_OUT:
                if x.ndim < 3:
                    raise CaseError(f"layout 'bnhd' needs {name} with axes [..., N, H, d], "
                                    f"got shape {x.shape}")
                x = np.swapaxes(x, -2, -3)
            tensors[name] = x
    return tensors


def _require_finite(tensors, inputs):
    """CaseError naming the key when an input the rule cannot judge with holds a value that is
    not finite: q, k, v, dout and the tangents (after their descales), a NaN or +inf in bias or
    sinks (-inf masks a score, or is no sink), a non-finite ALiBi slope. An infinite input
    makes every bound infinite, and anything would pass."""
    for name, x, allowed in [(n, inputs[n], ()) for n in INPUTS if n in inputs] + [
            (n, tensors[n].astype(np.float64), (-np.inf,) if n != "alibi_slopes" else ())
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


def _dequantized(tensors, precision, block):
    """(q, k, v (dout) as float64 values, {name: (stored values, descale [..., H, N, 1])}): float8
    inputs times their descales (descale_of), the stored values and descales kept for the
    diagnosis's reruns."""
    given = [name for name in DESCALES if name in tensors]
    if given and not precision.forward_only:
        raise CaseError(f"{given[0]} belongs to a float8 precision; this case's is {precision.name!r}")
    if block is not None and not given:
        raise CaseError("descale_block is given but no descale is")
    inputs = {name: tensors[name].astype(np.float64) for name in INPUTS if name in tensors}
    scales = {}
    for name in given:
        x = inputs[name[0]]
        descale = tensors[name].astype(np.float64)
        bad = ~(np.isfinite(descale) & (descale > 0))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0]) if descale.ndim else ()
            raise CaseError(f"{name} must hold finite values > 0 (a kernel multiplies {name[0]} by them), got "
                            f"{descale[where]:g}" + (f" at {list(where)}" if where else ""))
        descale = descale_of(descale, x.shape, inputs["k"].shape, block, name)
        scales[name[0]] = (x, descale)
        with np.errstate(over="ignore"):                     # an overflow is refused by _require_finite
            inputs[name[0]] = x * descale
    return inputs, scales


def descale_of(descale, shape, k_shape, block, name):
    """A descale broadcast to its tensor's [..., H, N, 1] (shape: the tensor's), by its shape:

        ()                      per tensor (vLLM's k_scale, v_scale)
        k's [..., H_kv]         per batch entry and kv head (FlashAttention-3's descale_q/k/v;
                                query head h uses kv head h // G)
        [..., H] (q)            per batch entry and query head
        [..., H, N]             per token of a head (vLLM's per-token-head scales)
        [..., H, ceil(N / B)]   per block of B = descale_block tokens of a head
    CaseError naming the shapes it takes otherwise."""
    heads, n = shape[:-2], shape[-2]
    if descale.ndim == 0:
        return descale
    if len(shape) >= 3 and descale.shape == tuple(k_shape[:-2]):
        groups = shape[-3] // k_shape[-3]
        return np.repeat(descale, groups, axis=-1)[..., None, None]
    if len(shape) >= 3 and descale.shape == tuple(heads):
        return descale[..., None, None]
    if block is not None and descale.shape == tuple(heads) + (-(-n // block),):
        return np.repeat(descale, block, axis=-1)[..., :n, None]
    if descale.shape == tuple(shape[:-1]):
        return descale[..., None]
    blocks = f", [..., H, ceil(N / {block})] = {tuple(heads) + (-(-n // block),)}" if block else ""
    raise CaseError(f"{name} of shape {descale.shape} is none of the shapes a descale of {name[0]} {shape} "
                    f"takes: () per tensor, k's [..., H_kv] = {tuple(k_shape[:-2])} per (batch, kv head), "
                    f"[..., H] = {tuple(heads)} per head, [..., H, N] = {tuple(shape[:-1])} per token{blocks}")


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
    latent = _latent_kv(arrays, tensors)
    gradients = [n for n in GRADIENTS if n in tensors]
    if gradients and chosen.forward_only:
        raise CaseError(f"precision {chosen.name!r} is checked forward only; the case has {gradients[0]}")
    if gradients and "dout" not in tensors:
        raise CaseError(f"missing key 'dout': the upstream gradient that {gradients[0]} belongs to")
    for gradient, option in (("dbias", "bias"), *_PER_HEAD.items()):
        if gradient in tensors and option not in tensors:
            raise CaseError(f"{gradient} is given but {option} is not")
    chosen, block = _fp8_settings(arrays, chosen)
    inputs, scales = _dequantized(tensors, chosen, block)
    _require_finite(tensors, inputs)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]                  # as stored (a paged cache too)
    options = _decode_options({**arrays, **{n: tensors[n] for n in ("bias", "sinks", "alibi_slopes")
                                            if n in tensors}})
    inputs, options, paged = _packed_if_paged(arrays, inputs, options)
    _check_qkv(inputs, layout)
    lists = _topk(arrays, inputs, options, paged)                    # checked, not yet made tokens
    n_k = inputs["k"].shape[-2]
    if memory:                                                       # before the scores' size is taken
        refused = too_large(sum(np.asarray(x).nbytes for x in arrays.values()),
                            inputs["q"].shape[:-1] + (n_k,), 0 if lists is None else _tokens(lists, n_k))
        if refused:
            raise CaseError(refused)
    topk = None if lists is None else _token_lists(*lists, n_k)
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
                     ("dbias", np.shape(tensors.get("bias"))),
                     *((g, np.shape(tensors.get(o))) for g, o in _PER_HEAD.items())):
        if n in tensors:
            if n == "lse":
                _require_lse_shape(tensors[n], shape)
            _require_shape(tensors, n, shape)
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


def _latent_kv(arrays, tensors):
    """MLA's absorbed form: with the key kv [..., 1, N_k, r + p] (and head_dim_v = r), the keys
    are kv and the values its first r columns; the candidate's gradient is dkv, the two summed.
    Sets tensors' k and v; returns r, or None for a case without kv."""
    if "kv" not in tensors:
        for name in ("head_dim_v", "dkv"):
            if name in arrays:
                raise CaseError(f"{name} is given but kv is not: {name} belongs to an MLA case, whose keys "
                                f"and values are the one tensor kv")
        return None
    kv = tensors["kv"]
    mixed = [name for name in ("k", "v", "dk", "dv") if name in arrays]
    if mixed:
        raise CaseError(f"a case with kv (MLA: k = kv, v = kv[..., :head_dim_v]) takes no {mixed[0]}; its "
                        f"gradient is dkv, the keys' and the values' summed")
    if "head_dim_v" not in arrays:
        raise CaseError(f"a case with kv {kv.shape} needs head_dim_v, the width of the values (kv's first "
                        f"columns; 512 in DeepSeek-V3)")
    r = _integer(arrays, "head_dim_v")
    if not 0 < r <= kv.shape[-1]:
        raise CaseError(f"head_dim_v must be from 1 to kv's width {kv.shape[-1]} (kv {kv.shape}), got {r}")
    tensors["k"], tensors["v"] = kv, kv[..., :r]
    del tensors["kv"]
    return r


def _fp8_settings(arrays, precision):
    """(the precision with P's dtype the case's intermediate_dtype and its products' accumulator
    accumulator_bits wide, descale_block or None)."""
    given = [name for name in FP8 if name in arrays]
    if given and not precision.forward_only:
        raise CaseError(f"{given[0]} belongs to a float8 precision; this case's is {precision.name!r}")
    block = None
    if "descale_block" in arrays:
        block = _integer(arrays, "descale_block")
        if block < 1:
            raise CaseError(f"descale_block must be a positive number of tokens, got {block}")
    if "intermediate_dtype" in arrays:
        try:
            weights = _word(INTERMEDIATE)(arrays, "intermediate_dtype")
        except ValueError as exc:
            raise CaseError(str(exc)) from None
        precision = precision._replace(weights=PRECISIONS[weights].storage)
    if "accumulator_bits" in arrays:
        bits = _integer(arrays, "accumulator_bits")
        if not ACCUMULATOR_BITS[0] <= bits <= ACCUMULATOR_BITS[1]:
            raise CaseError(f"accumulator_bits must be from {ACCUMULATOR_BITS[0]} to {ACCUMULATOR_BITS[1]} (float32's "
                            f"sign and exponent and bits - 9 of its mantissa; 22 for Hopper's float8 products), "
                            f"got {bits}")
        precision = precision._replace(accumulator=bits)
    return precision, block


def _topk(arrays, inputs, options, paged):
    """(indices, topk_length or None, topk_block_size or None) of a sparse top-k case, checked, or
    None: topk_indices [..., H_kv or H, N_q, K] int, each query's keys, or with topk_block_size
    its key blocks (topk_length then counts blocks)."""
    given = [name for name in TOPK if name in arrays]
    if not given:
        return None
    if "topk_indices" not in arrays:
        raise CaseError(f"{given[0]} is given but topk_indices is not")
    if paged is not None or {"mask", "bias"} & set(options):
        raise CaseError("topk_indices choose each query's keys: the case takes no mask, bias or paged KV cache "
                        "with them")
    q, k = inputs["q"], inputs["k"]
    if q.ndim < 3:
        raise CaseError(f"topk_indices need q with a head axis [..., H, N_q, d_k], got q {q.shape}")
    try:
        indices, length = check_lists(arrays["topk_indices"], arrays.get("topk_length"), q.shape, k.shape,
                                      "topk_indices")
    except (TypeError, ValueError) as exc:
        raise CaseError(str(exc)) from None
    if "topk_block_size" not in arrays:
        return indices, length, None
    size = _integer(arrays, "topk_block_size")
    if size < 1:
        raise CaseError(f"topk_block_size must be a positive number of keys, got {size}")
    return indices, length, size


def _tokens(lists, n_k):
    """The entries of the token lists that _topk's checked lists make (key blocks: their tokens)."""
    indices, _, size = lists
    return indices.size * (1 if size is None else min(size, n_k))


def _token_lists(indices, length, size, n_k):
    """Case.topk of _topk's checked lists: (token indices [..., H_kv or H, N_q, K'], topk_length or
    None, (block indices, block size) or None); key blocks become their tokens (block_indices),
    the blocks past a row's topk_length -1 first."""
    if size is None:
        return indices, length, None
    if length is not None:                                         # it counts blocks
        indices = np.where(listed(indices, length, np.inf), indices, -1)
    return block_indices(indices, size, n_k), None, (indices, size)


def latent_sum(results, latent, dtype=None):
    """results with dkv = dk + [dv ; 0] added (MLA: kv serves as k and its first `latent`
    columns as v), rounded to `dtype` when given (a 16- or 8-bit precision's output: a kernel
    adds the two in it); results unchanged without latent or without dk."""
    if latent is None or results is None or "dk" not in results:
        return results
    dkv = np.array(results["dk"], copy=True)
    dkv[..., :latent] += results["dv"]
    return {**results, "dkv": dkv if dtype is None else round_to(dkv, dtype)}


def _packed_if_paged(arrays, inputs, options):
    """(inputs, options, PagedLayout or None): a paged KV cache's case as packed sequences
    (paged.py): q, dout [B, H, N_q, d] -> [H, B N_q, d], the caches' used rows gathered,
    cu_seqlens among the options. The candidates stay in the caller's layout."""
    if "page_table" not in arrays and "cache_seqlens" not in arrays:
        return inputs, options, None
    if {"mask", "bias", "cu_seqlens_q", "seqused_k"} & set(options):
        raise CaseError("a paged KV cache (page_table) takes no mask, bias, cu_seqlens or seqused_k")
    try:
        paged = check_pages(inputs["q"], inputs["k"], inputs["v"], arrays.get("page_table"),
                            arrays.get("cache_seqlens"))
    except ValueError as exc:
        raise CaseError(str(exc)) from None
    q, k, v = pack(inputs["q"], inputs["k"], inputs["v"], paged)
    packed = {**inputs, "q": q, "k": k, "v": v}
    if "dout" in inputs:
        packed["dout"] = pack_rows(inputs["dout"])
    cu_q, cu_k = cu_seqlens(paged)
    return packed, {**options, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, paged


def load_case(path):
    """Read a .npz case into a dict of arrays, every member checked before its data is read
    (npz.py); CaseError for a file that is not a case. Members named as in NEAR_MISSES (torch's
    attn_mask) are read too, for split_case to refuse with the advice."""
    try:
        return read_npz(path, KEYS + tuple(NEAR_MISSES))    # split_case explains a near miss
    except (OSError, ValueError, EOFError, RuntimeError, NotImplementedError, zipfile.BadZipFile) as exc:
        raise CaseError(f"cannot read {path} as a .npz case: {exc}") from None


def save_case(path, **arrays):
    """Write a case (keys as in the module docstring); Python values become 0-d arrays."""
    split_case({name: np.asarray(x) for name, x in arrays.items()})     # refuse to write a bad case
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
