"""FlexAttention's mods, as the score pipeline (scores.py) calls them and differentiates them.

    score_mod(score, b, h, q_idx, kv_idx[, params]) -> score     step 3, on a block of scores
    mask_mod(b, h, q_idx, kv_idx) -> bool                           step 4, True = attend

Each is called on a block S[index] of the scores [..., H, N_q, N_k] with the block's index
arrays (mod_indices); a mod written with torch's operations is called on tensors (numpy_mod).
score_mod's derivative and its parameters' gradients are taken by complex step,

    d score_mod / d s = Im score_mod(s + i h) / h,   h = COMPLEX_STEP = 1e-30,

exact to rounding where score_mod is analytic in s (checked against central differences on a
sample: ScoreModDerivativeWarning, and central differences, where it is not); a parameter
score_mod indexes gets each read stepped in turn and its gradient scattered back to the
entries read; one it uses whole needs the user's VJP (score_mod_vjps), checked along a
random direction before it is trusted.
"""
import sys
import types
import warnings
from typing import NamedTuple

import numpy as np

from ._layout import block_ranges, gathered_cols, is_gathered, unbroadcast


def mod_indices(score_shape, index):
    """(b, h, q_idx, kv_idx) of the block S[index]: int arrays of as many axes as the scores,
    broadcastable to the block, as FlexAttention's score_mod and mask_mod see them: b the
    batch index (the flat index over the leading axes; 0 without any), h the query head,
    q_idx and kv_idx the row and the column (in the packed axes, with packed sequences; a
    gathered block's kv_idx is its columns, scores.py)."""
    if len(score_shape) < 3:                        # one head's [N_q, N_k] ([N, d] inputs): b = h = 0
        return tuple(x[0] for x in mod_indices((1,) + tuple(score_shape), (slice(None),) + tuple(index)))
    ranges, ndim = block_ranges(index, score_shape), len(score_shape)
    along = lambda axis, values: values.reshape((1,) * axis + (-1,) + (1,) * (ndim - axis - 1))
    lead = tuple(score_shape[:-3])
    b = np.arange(int(np.prod(lead, dtype=np.int64))).reshape(lead)[ranges[:-3]]
    b = b.reshape(b.shape + (1, 1, 1))
    h, q_idx, kv_idx = (along(a, np.arange(score_shape[a])[ranges[a]]) for a in (ndim - 3, ndim - 2, ndim - 1))
    if is_gathered(index):
        kv_idx = gathered_cols(index, ndim)
    return b, h, q_idx, kv_idx


def _broadcasts(shape, to):
    """Whether an array of `shape` broadcasts to the shape `to`."""
    try:
        return np.broadcast_shapes(shape, to) == tuple(to)
    except ValueError:
        return False


def mask_mod_keep(mask_mod, score_shape, index):
    """mask_mod(b, h, q_idx, kv_idx) on the block S[index]: a bool array broadcastable to it."""
    block = tuple(len(range(r.start, r.stop, r.step)) for r in block_ranges(index, score_shape))
    block = block[:-1] + index[-1].shape[-1:] if is_gathered(index) else block   # (a gathered block's K columns)
    keep = np.asarray(mask_mod(*mod_indices(score_shape, index)))
    if keep.dtype != bool:
        raise TypeError(f"mask_mod must return booleans (True = attend), got dtype {keep.dtype}")
    if not _broadcasts(keep.shape, block):
        raise ValueError(f"mask_mod returned shape {keep.shape}, not broadcastable to the block of "
                         f"scores {block} its index arrays broadcast to")
    return keep


def numpy_mod(f):
    """f itself, or, for a score_mod or mask_mod written with torch's operations (as for
    flex_attention: it refers to torch or to a torch tensor, in its globals, closure or
    defaults), a TorchMod that calls it on NumPy arrays."""
    torch = sys.modules.get("torch")
    code = getattr(f, "__code__", None)
    if torch is None or code is None or isinstance(f, TorchMod):
        return f
    cells = []
    for cell in f.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:                          # a cell not yet filled
            pass
    seen = [f.__globals__.get(name) for name in code.co_names] + cells + list(f.__defaults__ or ())
    is_torch = lambda x: isinstance(x, torch.Tensor) or (isinstance(x, types.ModuleType)
                                                         and x.__name__.split(".")[0] == "torch")
    return TorchMod(f) if any(is_torch(x) for x in seen) else f


class TorchMod:
    """A mod written with torch's operations, called as the pipeline calls one: its scores as
    float64 or complex128 CPU tensors (complex for the complex step), its index arrays as int64
    tensors, a parameter's reads as tensors; its result back as an array."""

    def __init__(self, f):
        self.f = f

    def __call__(self, *args):
        import torch
        tensor = lambda x: torch.from_numpy(np.ascontiguousarray(x))
        params = args[5:]
        if params:                                  # score_mod's parameters: reads give tensors
            params = ({name: _TorchReads(x) if isinstance(x, _Reads) else torch.tensor(x)
                       for name, x in params[0].items()},)
        out = self.f(*(tensor(x) for x in args[:5]), *params)
        return out.detach().numpy() if isinstance(out, torch.Tensor) else np.asarray(out)


class _TorchReads:
    """A parameter's _Reads for a TorchMod: indexed with tensors, it gives a tensor."""

    def __init__(self, reads):
        self.reads = reads

    def __getitem__(self, index):
        import torch
        index = tuple(i.numpy() if isinstance(i, torch.Tensor) else i
                      for i in (index if isinstance(index, tuple) else (index,)))
        return torch.from_numpy(np.ascontiguousarray(self.reads[index]))


COMPLEX_STEP = 1e-30            # the complex step of score_mod's derivatives: Im f(s + i h) / h
VJP_SEED = 0                    # the random direction along which a user's VJP is checked


class ScoreModDerivativeWarning(UserWarning):
    """score_mod's complex-step derivative disagrees with central differences (score_mod is not
    analytic in the score there: abs, a branch on it): central differences are used instead."""


class _Read(NamedTuple):
    index: tuple                # what score_mod indexed a parameter with
    shape: tuple                # the shape of what it got


class _Reads:
    """A score_mod parameter as score_mod sees it: it can be indexed (each read is recorded, and
    one read can be given an imaginary step), not used whole."""

    def __init__(self, name, value, step_read):
        self.name, self.value, self.reads, self.step_read = name, value, [], step_read
        self.shape, self.ndim, self.dtype = value.shape, value.ndim, value.dtype

    def __len__(self):
        return len(self.value)

    def __getitem__(self, index):
        got = self.value[index]
        if len(self.reads) == self.step_read:
            got = got + 1j * COMPLEX_STEP
        self.reads.append(_Read(index if isinstance(index, tuple) else (index,), np.shape(got)))
        return got

    def _whole(self, *args, **kwargs):
        raise TypeError(f"score_mod used score_mod_params[{self.name!r}] whole: the oracle differentiates "
                        f"a parameter that score_mod indexes (params[{self.name!r}][h, q_idx - kv_idx]) or "
                        f"a scalar (0-d) one; for any other use, pass its VJP in "
                        f"score_mod_vjps={{{self.name!r}: vjp}}")

    __array__ = __array_ufunc__ = __array_function__ = _whole     # numpy's operators and functions
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _whole


def _params(o, reads=None, stepped=None, direction=None):
    """The score_mod_params as score_mod gets them: one with a VJP of the user's whole (+ i h
    direction when it is `stepped`), a 0-d one as a scalar (+ i h when it is `stepped`), any
    other as _Reads (reads: {name: step_read}, -1: none)."""
    params = {}
    for name, value in o.score_mod_params.items():
        if name in (o.score_mod_vjps or {}):
            params[name] = value + 1j * COMPLEX_STEP * direction if name == stepped else value
        elif value.ndim == 0:
            params[name] = value[()] + (1j * COMPLEX_STEP if name == stepped else 0)
        else:
            params[name] = _Reads(name, value, (reads or {}).get(name, -1))
    return params


def call_score_mod(o, s, indices, params=None):
    """score_mod(score, b, h, q_idx, kv_idx[, params]) as an array of s's shape."""
    args = (s,) + tuple(indices) + (() if o.score_mod_params is None else (_params(o) if params is None else params,))
    out = np.asarray(o.score_mod(*args))
    if not _broadcasts(out.shape, s.shape):
        raise ValueError(f"score_mod returned shape {out.shape} for scores of shape {s.shape}")
    return np.broadcast_to(out, s.shape)


def _complex_step(o, s, stepped, indices, params=None):
    """(Im score_mod(stepped) / h where the score counts, 0 elsewhere; where it counts): a complex
    step's derivative (stepped: s + i h, or s with a parameter's read stepped in params). A score
    counts where the block's scores s are finite and score_mod's value is not -inf: a score it
    sets to -inf (FlexAttention's way to mask) is a masked score, whose gradient is 0."""
    with np.errstate(all="ignore"):
        value = call_score_mod(o, stepped, indices, params)
        counts = np.isfinite(s) & ~np.isneginf(value.real)
        return np.where(counts, value.imag / COMPLEX_STEP, 0), counts


def score_mod_slope(o, s, indices):
    """d score_mod / d score on the block s (real), by complex step, checked against central
    differences on a sample of the entries that count (ScoreModDerivativeWarning: those instead);
    0 where score_mod's value is -inf."""
    if np.iscomplexobj(s):
        raise ValueError("score_mod's derivative is taken by complex step on real scores: a backward or "
                         "tangent of complex scores (a complex-step check through score_mod) needs a "
                         "real one; check score_mod's attention with central differences instead")
    slope, counts = _complex_step(o, s, s + 1j * COMPLEX_STEP, indices)
    flat = np.flatnonzero(np.broadcast_to(counts, s.shape))
    sample = flat[np.linspace(0, flat.size - 1, min(flat.size, 16)).astype(np.int64)] if flat.size else flat
    if sample.size:
        at = np.unravel_index(sample, s.shape)
        pick = lambda x: np.broadcast_to(x, s.shape)[at]
        picked = tuple(pick(i) for i in indices)
        if not np.allclose(pick(slope), _central(o, pick(s), picked), rtol=1e-4, atol=1e-4):
            warnings.warn("score_mod's complex-step derivative disagrees with central differences (it is "
                          "not analytic in the score: abs, a branch on it?); central differences are used",
                          ScoreModDerivativeWarning, stacklevel=4)
            slope = np.where(counts, _central(o, s, indices), 0).astype(slope.dtype)
    return slope


def _central(o, s, indices):
    """(score_mod(s + h) - score_mod(s - h)) / 2h, h = 1e-6 max(1, |s|), in float64 whatever s's
    dtype: in float32 (a low-precision baseline's scores) s + h would keep about one digit of h."""
    x = s.astype(np.float64)
    h = 1e-6 * np.maximum(1, np.abs(x))
    with np.errstate(all="ignore"):
        return (call_score_mod(o, x + h, indices) - call_score_mod(o, x - h, indices)) / (2 * h)


def score_mod_param_grads(o, s, indices, ds):
    """{name: gradient} of the score_mod_params from the block's dS (of score_mod's output):
    by complex step through each read (scattered back to the entries read) or each scalar."""
    grads = {}
    recorded = _params(o)
    call_score_mod(o, s, indices, recorded)                    # which reads score_mod makes
    for name, value in o.score_mod_params.items():
        if name in (o.score_mod_vjps or {}):
            grads[name] = _users_vjp(o, name, s, indices, ds)
            continue
        g = np.zeros(value.shape, ds.dtype)
        steps = [None] if value.ndim == 0 else range(len(recorded[name].reads))
        for read in steps:
            params = _params(o, {name: read}, stepped=name if value.ndim == 0 else None)
            d = _complex_step(o, s, s, indices, params)[0] * ds
            if read is None:
                g = g + np.sum(d)
            else:
                r = recorded[name].reads[read]
                np.add.at(g, r.index, unbroadcast(d, r.shape) if r.shape else np.sum(d))
        grads[name] = g
    return grads


def _users_vjp(o, name, s, indices, ds):
    """score_mod_vjps[name](ds, score, b, h, q_idx, kv_idx, params): the block's gradient of the
    parameter `name`, which score_mod uses whole, checked before it is trusted: along a random
    direction u, <vjp, u> must be the complex step's sum(ds Im score_mod(p + i h u)) / h to 1e-8
    (ValueError naming the parameter otherwise)."""
    value = o.score_mod_params[name]
    with np.errstate(all="ignore"):
        g = np.asarray(o.score_mod_vjps[name](ds, s, *indices, _params(o)))
    if g.shape != value.shape:
        raise ValueError(f"score_mod_vjps[{name!r}] returned shape {g.shape}; the gradient of "
                         f"score_mod_params[{name!r}] has its shape {value.shape}")
    u = np.random.default_rng(VJP_SEED).standard_normal(value.shape)   # the same direction every call
    stepped = _params(o, stepped=name, direction=u)
    along = float(np.sum(_complex_step(o, s, s, indices, stepped)[0] * ds))
    claimed = float(np.sum(g * u).real)
    if not abs(claimed - along) <= 1e-8 * (float(np.sum(np.abs(g * u))) + abs(along)):
        raise ValueError(f"score_mod_vjps[{name!r}] is not score_mod's VJP: along a random direction u of "
                         f"the parameter, <vjp, u> = {claimed:.10g} while complex step on score_mod gives "
                         f"{along:.10g}")
    return g
