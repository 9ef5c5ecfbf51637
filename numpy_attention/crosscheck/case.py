"""The `.npz` exchange format: one attention case and a candidate's results.

Any language that writes NumPy's .npz (numpy.savez; cnpy in C++; npyz in Rust;
NPZ.jl) can produce a case. Keys (shape legend of attention.py):

    inputs      q [..., H, N_q, d_k]  k [..., H_kv, N_k, d_k]  v [..., H_kv, N_k, d_v]
                dout [..., H, N_q, d_v]            (needed when a gradient is given)
    options     mask          keep-mask broadcastable to [..., H, N_q, N_k], True/nonzero = attend
                bias          additive float scores, broadcastable like mask
                causal        0-d bool, or the alignment name 'top_left' / 'bottom_right'
                align         0-d 'top_left' / 'bottom_right': the diagonal of causal and window
                scale         0-d float > 0, finite (default 1 / sqrt(d_k))
                window        int [2]: (left, right), -1 = unbounded
                softcap       0-d float > 0, finite
                dropout_mask  keep-mask broadcastable like mask;  dropout_p  0-d float in [0, 1)
                fully_masked  0-d 'zero' / 'uniform' / 'nan' (default 'zero')
    candidate   out [..., H, N_q, d_v]   (required)
                lse [..., H, N_q]        dq, dk, dv (the shapes of q, k, v)   dbias (bias's shape)
                (lse of a fully masked row: -inf, or FlashAttention's +inf; rule.py)

The candidate's dtype is that of its tensors (float16, float32 or float64; each
tensor is judged in its own, so a float32 lse may come with a float16 out);
the order of operations is attention.py's: scale -> softcap -> bias -> masks
-> softmax -> dropout -> @ v.
"""
import zipfile

import numpy as np

from .._checks import require_choice, require_positive_real, require_probability
from .._layout import ALIGNMENTS, check_window, resolve_alignment
from ..attention import FULLY_MASKED_POLICIES, attention_backward, attention_forward

INPUTS = ("q", "k", "v", "dout")
OPTIONS = ("mask", "bias", "causal", "align", "scale", "window", "softcap", "dropout_mask",
           "dropout_p", "fully_masked")
CANDIDATES = ("out", "lse", "dq", "dk", "dv", "dbias")
GRADIENTS = ("dq", "dk", "dv", "dbias")
CANDIDATE_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
KEYS = INPUTS + OPTIONS + CANDIDATES


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
    return _scalar(arrays, name, "bool")


def _window(arrays, name):
    x = np.asarray(arrays[name])
    if x.shape != (2,) or x.dtype.kind not in "iu":
        raise CaseError(f"{name} must be an integer array of shape (2,), got dtype {x.dtype} "
                        f"with shape {x.shape}")
    return check_window((int(x[0]), int(x[1])))


def _word(choices):
    return lambda arrays, name: require_choice(_scalar(arrays, name, "str"), name, choices)


def _real(check):
    return lambda arrays, name: check(_scalar(arrays, name, "float"), name)


# option -> decode(arrays, name): its Python value, checked by attention_forward's rules
_DECODE = {"causal": _causal, "window": _window, "align": _word(ALIGNMENTS),
           "scale": _real(require_positive_real), "softcap": _real(require_positive_real),
           "dropout_p": _real(require_probability), "fully_masked": _word(FULLY_MASKED_POLICIES)}


def _decode_options(arrays):
    """attention_forward's keyword arguments from the case; CaseError naming a bad option."""
    try:
        options = {name: _DECODE[name](arrays, name) if name in _DECODE else arrays[name]
                   for name in OPTIONS if name in arrays}
        resolve_alignment(options.get("causal", False), options.get("align"))
    except (ValueError, TypeError) as exc:
        raise CaseError(str(exc)) from None
    return options


def _float_array(arrays, name):
    x = np.asarray(arrays[name])
    if x.dtype.kind != "f":
        raise CaseError(f"{name} must be a float array, got dtype {x.dtype} with shape {x.shape}")
    return x


def _require_shape(arrays, name, shape):
    if arrays[name].shape != tuple(shape):
        raise CaseError(f"{name} must have shape {tuple(shape)}, got {arrays[name].shape}")


def split_case(arrays):
    """Validate a case; return (inputs, options, candidates), three dicts.

    inputs hold q, k, v (and dout) as float arrays; options are attention_forward's
    keyword arguments; candidates hold out (and lse, dq, dk, dv, dbias) as given.
    Raises CaseError naming the missing or unknown key, or the wrong shape or dtype.
    """
    unknown = sorted(set(arrays) - set(KEYS))
    if unknown:
        raise CaseError(f"unknown key {unknown[0]!r}; a case has keys {', '.join(KEYS)}")
    for name in ("q", "k", "v", "out"):
        if name not in arrays:
            raise CaseError(f"missing key {name!r}")
    arrays = {name: (_float_array(arrays, name) if name in INPUTS + CANDIDATES + ("bias",)
                     else arrays[name]) for name in arrays}
    for name in (n for n in CANDIDATES if n in arrays):
        if arrays[name].dtype not in CANDIDATE_DTYPES:
            raise CaseError(f"{name} must be float16, float32 or float64 (the oracle must be wider "
                            f"than the candidate), got dtype {arrays[name].dtype}")
    gradients = [name for name in GRADIENTS if name in arrays]
    if gradients and "dout" not in arrays:
        raise CaseError(f"missing key 'dout': the upstream gradient that {gradients[0]} belongs to")
    if "dbias" in arrays and "bias" not in arrays:
        raise CaseError("dbias is given but bias is not")
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise CaseError(f"{name} must have at least 2 axes [..., N, d], got shape {x.shape}")
    out_shape = q.shape[:-1] + v.shape[-1:]
    for name, shape in (("out", out_shape), ("dout", out_shape), ("lse", q.shape[:-1]),
                        ("dq", q.shape), ("dk", k.shape), ("dv", v.shape),
                        ("dbias", np.shape(arrays.get("bias")))):
        if name in arrays:
            _require_shape(arrays, name, shape)
    options = _decode_options(arrays)
    inputs = {name: arrays[name] for name in INPUTS if name in arrays}
    candidates = {name: arrays[name] for name in CANDIDATES if name in arrays}
    return inputs, options, candidates


def load_case(path):
    """Read a .npz case into a dict of arrays; CaseError for a file that is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
        if not head.startswith(b"PK") and head != b"\x93NUMPY":    # neither a zip (.npz) nor a .npy
            raise ValueError("not an .npz archive (no zip header)")
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError(f"not an .npz archive (a single {type(data).__name__})")
        with data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise CaseError(f"cannot read {path} as a .npz case: {exc}") from None


def save_case(path, **arrays):
    """Write a case (keys as in the module docstring); Python values become 0-d arrays."""
    split_case({name: np.asarray(x) for name, x in arrays.items()})     # refuse to write a bad case
    with open(path, "wb") as f:                  # exactly `path`: np.savez(path) would append .npz
        np.savez(f, **arrays)


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
