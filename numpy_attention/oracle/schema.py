"""The `.npz` exchange format: one attention case and a candidate's results, its keys.

Any language that writes NumPy's .npz (numpy.savez; cnpy in C++; npyz in Rust;
NPZ.jl) can produce a case. Keys (shape legend of textbook.py):

    inputs      q [..., H, N_q, d_k]  k [..., H_kv, N_k, d_k]  v [..., H_kv, N_k, d_v]
                dout [..., H, N_q, d_v]            (needed when a gradient is given)
    options     attention_forward's keywords, one row each of options.OPTIONS (its doc says the
                value's meaning), stored by the row's `case` kind:
{options}
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
                max_logits [..., H, N_q] each row's largest score S (after the scale; -inf for a row
                              with no key), or [H] each head's, over the batch and the rows
                dkv (kv's shape, with kv: the keys' and the values' gradients summed)   dgate (gate's shape)
                (lse of a fully masked row: -inf, or FlashAttention's +inf; rule.py)

The candidate's dtype is that of its tensors (float16, float32 or float64; each
tensor is judged in its own, so a float32 lse may come with a float16 out);
the order of operations is textbook.py's: {order} -> masks -> softmax -> dropout
-> @ v.

Here: the key lists (KEYS: all of them), Case (a case read, split_case's result) and CaseError,
check_keys (a name that is no key refused, with a close match), and the decoding of the options'
values (decode_options: attention_forward's keyword arguments; integer, word: one 0-d key's).
Reading a case is case.py; the transforms of its inputs (float8's descales, MLA's kv, top-k
lists, a paged KV cache) are transforms.py.
"""
from typing import NamedTuple

import numpy as np

from .._checks import require_choice, require_keep_mask, require_positive_real
from ..positions import ALIGNMENTS, resolve_alignment
from ..option_checks import FULLY_MASKED_POLICIES
from ..options import OPTIONS as OPTION_ROWS
from ..near_misses import near_miss
from ..rope import LAYOUTS as ROPE_LAYOUTS, PARTS, SCALINGS
from ..scores import KEEP_STEPS
from .precision import Precision

INPUTS = ("q", "k", "v", "dout", "q_dot", "k_dot", "v_dot", "kv")   # the tangents: forward mode; kv: MLA
PAGED = ("page_table", "cache_seqlens")               # read by packed_if_paged, not options
ROPE = ("rope_layout", "rope_rotary_dim", "rope_part", "rope_base", "rope_positions_q", "rope_positions_k",
        "rope_scaling", "rope_factor", "rope_original_max_position_embeddings", "rope_beta_fast", "rope_beta_slow",
        "rope_truncate", "rope_mscale", "rope_mscale_all_dim", "rope_attention_factor")
_KIND = {row.name: row.case for row in OPTION_ROWS if row.case is not None}   # the table's options a case holds
_CHECK = {row.name: row.check for row in OPTION_ROWS if row.check}
# how a case stores each kind of option (before and after its shape), for the docstring's key list
_STORED = {"array": ("array", " (as attention_forward takes it)"),
           "float": ("float", ", rounded to the candidate's dtype"),
           "mask": ("keep-mask", ", True/nonzero = attend\n" + " " * 30
                    + "(a float one holds 0 / 1; torch's 0 / -inf float mask is a bias)"),
           "causal": ("0-d bool, or the alignment name 'top_left' / 'bottom_right'", ""),
           "align": ("0-d 'top_left' / 'bottom_right'", ""), "pair": ("int [2]: (left, right), -1 = unbounded", ""),
           "positive": ("0-d float > 0, finite", ""), "probability": ("0-d float in [0, 1)", ""),
           "policy": ("0-d 'zero' / 'uniform' / 'nan'", "")}
_SHAPE = {"scores": " broadcastable to [..., H, N_q, N_k]", "heads": " [H]", "output": " broadcastable to out",
          None: ""}


def _entry(row):
    """The docstring's line of a row's key: its name, how a case stores it, its default."""
    shape = " [H] (or [..., H], or [B, H] per packed sequence)" if row.batched else _SHAPE[row.shape]
    default = "" if row.default in (None, False) else f" (default {row.default!r})"
    return f"{'':16}{row.name:<14}{_STORED[row.case][0]}{shape}{_STORED[row.case][1]}{default}"


if __doc__:                                                   # (python -OO drops docstrings)
    __doc__ = __doc__.replace("{options}", "\n".join(_entry(row) for row in OPTION_ROWS if row.case)).replace(
        "{order}", " -> ".join(row.name for row in OPTION_ROWS if row.acts == "score" and row.case))
OPTIONS = tuple(_KIND) + PAGED + tuple(KEEP_STEPS) + ROPE   # + scores.py's steps, by name; rope gathered
                                                            # into attention_forward's rope={...}
FLOAT_OPTIONS = tuple(name for name, kind in _KIND.items() if kind == "float")   # rounded to the candidate's dtype
OPTION_OF = {row.gradient: row.name for row in OPTION_ROWS if row.gradient}   # a gradient's option
GRADIENTS = ("dq", "dk", "dv") + tuple(row.gradient for row in OPTION_ROWS if row.gradient) + ("dkv",)
CANDIDATES = ("out", "lse", "max_logits") + GRADIENTS[:-1] + ("out_dot", "lse_dot", "dkv")
ROWS = ("lse", "max_logits")                          # a number per query row [..., H, N_q]
FORWARD_MODE = ("out_dot", "lse_dot")
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
LAID_OUT = ("q", "k", "v", "dout", "out", "dq", "dk", "dv", "q_dot", "k_dot", "v_dot", "out_dot", "kv", "dkv",
            "gate", "dgate")


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
    scales: object = None   # descales: {'q' / 'k' / 'v': (stored values, descale [..., H, N, 1 or d], block along d)}
    topk: object = None     # sparse top-k: (token indices [..., H_kv or H, N_q, K], topk_length or None,
                            # (block indices, block size) or None); options has the first two


class CaseError(ValueError):
    """A malformed case: the one-line message names the key and the shapes."""


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


def _pair(arrays, name):
    x = np.asarray(arrays[name])
    if x.shape != (2,) or x.dtype.kind not in "iu":
        raise CaseError(f"{name} must be an integer array of shape (2,), got dtype {x.dtype} "
                        f"with shape {x.shape}")
    return _CHECK[name]((int(x[0]), int(x[1])), name)


def _number(arrays, name):
    """A 0-d real option, checked by its row's check."""
    return _CHECK[name](_scalar(arrays, name, "float"), name)


def _mask(arrays, name):
    """A keep-mask as given; a float one must hold only 0 and 1 (torch's 0 / -inf is a bias)."""
    return require_keep_mask(np.asarray(arrays[name]), name)


def word(choices):
    return lambda arrays, name: require_choice(_scalar(arrays, name, "str"), name, choices)


def _real(check):
    return lambda arrays, name: check(_scalar(arrays, name, "float"), name)


# an option's kind (options.OPTIONS' case) -> decode(arrays, name): its Python value, checked by
# attention_forward's rules ('array' and 'float' options: as given)
_DECODE = {"mask": _mask, "causal": _causal, "pair": _pair, "align": word(ALIGNMENTS),
           "positive": _number, "probability": _number,
           "policy": word(FULLY_MASKED_POLICIES)}


def _as_given(arrays, name):
    return arrays[name]


def _positions(arrays, name):
    x = np.asarray(arrays[name])
    if x.ndim != 1 or x.dtype.kind not in "iuf":
        raise CaseError(f"{name} must be a 1-d array of positions, got dtype {x.dtype} with shape {x.shape}")
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        at = int(np.argmax(~np.isfinite(x)))
        raise CaseError(f"{name} must hold finite positions, got {name}[{at}] = {x[at]:g}")
    return x


def integer(arrays, name):
    x = np.asarray(arrays[name])
    if x.ndim != 0 or x.dtype.kind not in "iu":
        raise CaseError(f"{name} must be a 0-d integer, got dtype {x.dtype} with shape {x.shape}")
    return int(x)


_ROPE_DECODE = {"rope_layout": word(ROPE_LAYOUTS), "rope_rotary_dim": integer, "rope_part": word(PARTS),
                "rope_base": _real(require_positive_real), "rope_positions_q": _positions,
                "rope_positions_k": _positions, "rope_scaling": word(tuple(SCALINGS)),
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


def decode_options(arrays):
    """attention_forward's keyword arguments from the case; CaseError naming a bad option."""
    try:
        options = {name: _DECODE.get(_KIND.get(name), _as_given)(arrays, name)
                   for name in OPTIONS if name in arrays and name not in PAGED and name not in ROPE}
        resolve_alignment(options.get("causal", False), options.get("align"))
        rope = _rope(arrays)
    except (ValueError, TypeError) as exc:
        raise CaseError(str(exc)) from None
    return options if rope is None else {**options, "rope": rope}

