"""The score pipeline: each step from scale q k^T to the softmax's row, defined once.

Shape legend as in textbook.py: the scores S are [..., H, N_q, N_k]. A block of them is
S[index], index a tuple into the scores whose last two entries are the slices of the block's
rows and columns (slices of the leading axes and heads before them, or an Ellipsis): the
textbook's block is all of S, the blocked engine's a block of rows, the tiled engine's a tile.

    1. S = scale q k^T                     the engine's product, on its own block of q and k
    2. S = softcap tanh(S / softcap)       softcap
    3. S = S + bias                        bias, broadcast to the scores
       S = S + log c                       top-k lists (topk.py): c the times the row lists the key,
                                           where it is over 1 (a constant)
       S = S - slope |i + N_k - N_q - j|   ALiBi: each row's slope, its distance from the diagonal
       S = score_mod(S, b, h, q_idx, kv_idx)   FlexAttention's (its parameters: score_mod_params)
    4. S = -inf where not kept             keep = mask & causal & window & packed sequences
                                           & KEEP_STEPS (attention_chunk) & mask_mod & (bias != -inf)
                                           & listed (top-k lists: c > 0) (True = attend; positions.py)
    5. [S, sink]                           sinks: one more logit per row, with no value

Each step, on any block:
    forward    `forward`: steps 2-4 on the block's scale q k^T
    backward   `backward`: steps 4-2 in reverse, the gradient of scale q k^T from that of S;
               the gradients of the steps' parameters (bias, ALiBi's slopes, score_mod's) go to
               a `ScoreGrads`, which sums them block by block
    tangent    `tangent`: steps 2-4 in forward mode, S_dot from (scale q k^T)_dot and the
               parameters' tangents
    keep       `keep_mask`: which scores of the block step 4 keeps
The sink's column (5) is the softmax's: `with_sink`, `with_sink_weight`, and its gradient
sums the column's dS per head (`head_gradient`). A low-precision recipe (oracle/precision.py)
runs the same steps with its roundings (`Rounding`).

Backward and tangent, step by step (docs/derivations.md):
    2. dS_1 = dS_2 (1 - t^2),  S_dot_2 = (1 - t^2) S_dot_1      t = tanh(S_1 / softcap)
    3. dS = dS f'(S) for score_mod f, f' by complex step; a parameter it reads gets dS df/dp
       scattered back to the entries read;  S_dot = f'(S) S_dot  (f' and df/dp 0 where f is -inf:
       a score score_mod masks)
       dbias = dS_3 summed to bias's shape,  S_dot_3 = S_dot_2 + bias_dot   (log c: constant, nothing)
       dslope = -sum dS_3 |i + N_k - N_q - j| over the slope's rows,  S_dot_3 -= slope_dot |..|
    4. dS_3 = dS where kept, 0 elsewhere (a masked score is a constant),  S_dot = 0 there too
"""
import sys
import types
import warnings
from typing import Callable, NamedTuple, Optional

import numpy as np

from ._checks import as_scalar, require_positive_int
from ._layout import grouped_matmul, index_ranges, scaled, unbroadcast
from .near_misses import unexpected_keyword
from .positions import band_keep, distance, positions, sequence_of
from .topk import counts, log_multiplicity

WHOLE = (Ellipsis, slice(None), slice(None))     # the index of all of the scores
UNKNOWN = object()                               # keep= not given: the step computes it


# ----------------------------------------------------------------------------- 1-4. whole arrays

def attention_scores(q, k, options):
    """Steps 1-4 on whole arrays: the softmax's input S [..., H, N_q, N_k], -inf where not kept.

    q [..., H, N_q, d_k], k [..., H_kv, N_k, d_k] and options as attention_options returns them.
    Returns (S, Saved: tanh(scale q k^T / softcap) and score_mod's input, or Nones).
    """
    S = scaled(grouped_matmul(q, np.swapaxes(k, -1, -2)), options.scale)   # 1. S = scale q k^T
    return forward(S, options)                      # 2-4. softcap, bias, ALiBi, -inf where not kept


# ----------------------------------------------------------------------------- 4. keep

class KeepStep(NamedTuple):
    """A way of dropping keys by their position, defined here alone: attention_forward takes it
    as a keyword argument of its name (attention_options checks it with `check`), and every
    engine, baseline and crosscheck applies it through keep_mask."""
    check: Callable                 # (value, name) -> the checked value; ValueError / TypeError naming it
    keep: Callable                  # (value, positions.Positions) -> bool [rows, cols]: the pairs kept


def _attention_chunk(chunk, at):
    """Llama 4's chunked attention (FlashAttention 3's attention_chunk): row i keeps the keys of
    its diagonal's chunk, j // chunk == diagonal_i // chunk, in its own sequence (with causal,
    the keys of that chunk up to the diagonal). The diagonal is align's: bottom_right is
    FlashAttention's, i + N_k - N_q."""
    return at.cols[None, :] // chunk == at.diagonal[:, None] // chunk


# name -> KeepStep: the steps that drop keys by position, beside causal and window
KEEP_STEPS = {"attention_chunk": KeepStep(require_positive_int, _attention_chunk)}


def check_keep_steps(steps, known=()):
    """attention_forward's keyword arguments beyond its own, as ((name, checked value), ...) of
    the KEEP_STEPS given (None: not given); for any other name a TypeError with how to pass it
    (near_misses.py: another library's name, or the closest of KEEP_STEPS and the names `known`)."""
    for name in steps:
        if name not in KEEP_STEPS:
            raise unexpected_keyword(name, tuple(KEEP_STEPS) + tuple(known))
    return tuple((name, KEEP_STEPS[name].check(as_scalar(value), name))
                 for name, value in steps.items() if value is not None)


def keep_mask(options, score_shape, index=WHOLE):
    """Which scores of S[index] are kept: mask & causal & window & packed & KEEP_STEPS
    & mask_mod & (bias != -inf) & listed (top-k lists).

    score_shape: [..., H, N_q, N_k]; index: a tuple into the scores whose last two
    entries are the slices of rows and columns.
    Returns a bool array broadcastable to S[index], or None when every score is kept.
    """
    o = options
    if not o.masked:
        return None
    at = _positions(o, score_shape, index, o.align)
    keep = band_keep(at, o.causal, o.window)                          # [rows, cols] or None
    for name, value in o.keep_steps:
        part = KEEP_STEPS[name].keep(value, at)                       # [rows, cols]
        keep = part if keep is None else keep & part
    block = lambda x: np.broadcast_to(x, score_shape)[index]          # a view of x's block
    parts = ([] if o.mask is None else [block(o.mask)]) + \
            ([] if o.bias is None else [~np.isneginf(block(o.bias).real)])
    if o.mask_mod is not None:
        parts.append(mask_mod_keep(o.mask_mod, score_shape, index))
    if o.topk is not None:
        parts.append(counts(o.topk, score_shape, index) > 0)
    for part in parts:
        keep = part if keep is None else keep & part
    return keep


def _positions(options, score_shape, index, align):
    """positions.Positions of the rows and columns of S[index]."""
    n_q, n_k = score_shape[-2:]
    return positions(n_q, n_k, np.arange(n_q)[index[-2]], np.arange(n_k)[index[-1]], align,
                     options.cu_seqlens_q, options.cu_seqlens_k, options.seqused_k)


# ----------------------------------------------------------------------------- 3. ALiBi

def heads_view(x, score_shape):
    """A per-head array ([H], or [..., H]; [1] for [N, d] inputs) broadcast to score_shape[:-2]."""
    lead = tuple(score_shape[:-2])
    return np.broadcast_to(x.reshape(x.shape[len(x.shape) - len(lead):]) if x.ndim > len(lead) else x, lead)


def alibi_distance(options, score_shape, index=WHOLE):
    """|i + N_k - N_q - j| [rows, cols] for the rows and columns of S[index]: the distance from
    the bottom-right-aligned diagonal, in each row's own sequence (FlashAttention's ALiBi;
    N_q == N_k: the main diagonal)."""
    return distance(_positions(options, score_shape, index, "bottom_right"))


def _per_sequence(slopes, cu_seqlens_q):
    """Whether slopes are [B, H], one row per packed sequence (else one slope per head)."""
    return cu_seqlens_q is not None and np.ndim(slopes) == 2


def _row_slopes(slopes, options, score_shape, index):
    """The slope of each row of S[index], broadcastable to its block [..., heads, rows, cols]:
    slope_h, [..., heads, 1, 1], for slopes [H] or [..., H]; slopes[b, h] of the row's sequence
    b, [heads, rows, 1], for slopes [B, H] with packed sequences."""
    if not _per_sequence(slopes, options.cu_seqlens_q):
        return heads_view(slopes, score_shape)[index[:-2]][..., None, None]
    rows = np.arange(score_shape[-2])[index[-2]]
    by_row = np.swapaxes(slopes[sequence_of(options.cu_seqlens_q, rows)], 0, 1)    # [H, rows]
    by_row = by_row.reshape(tuple(score_shape[:-2]) + rows.shape)     # ([rows] for one [N, d] head)
    return by_row[index[:-2] + (slice(None),)][..., None]


def alibi_bias(options, score_shape, index=WHOLE, slopes=None, rounded=None):
    """ALiBi's bias of the scores S[index], -slope * alibi_distance, or None without
    alibi_slopes: each row's slope its head's (slopes [H] or [..., H]) or, for slopes [B, H]
    with packed sequences, that of its sequence b and head, slopes[b, h]. slopes:
    options.alibi_slopes by default (a tangent of them has their shape).
    In the slopes' dtype (the distances are integers below 2^24, exact in float32): a float32
    case's bias is float32, as a float32 kernel's is. rounded: applied to the distances first
    (a kernel that turns them into its 16-bit dtype, as torch's int * bfloat16 does), or None."""
    slopes = options.alibi_slopes if slopes is None else slopes
    if slopes is None:
        return None
    rows = _row_slopes(slopes, options, score_shape, index)
    distance = alibi_distance(options, score_shape, index).astype(rows.dtype)          # in the slopes' dtype
    return -rows * (distance if rounded is None else rounded(distance))


def alibi_row_gradient(dS, options, score_shape, index=WHOLE, rounded=None):
    """The gradient of each row's slope from the block dS = dS[index] [..., heads, rows, cols]
    (the gradient of S where ALiBi adds to it): -sum_j dS_ij |i + N_k - N_q - j|, [..., heads,
    rows]. A block of columns gives its part of the sum; alibi_slopes_gradient sums the rows.
    rounded: applied to the distances and to each product before the sum (a 16-bit autograd
    rounds them), or None."""
    distance = alibi_distance(options, score_shape, index).astype(dS.dtype)
    if rounded is None:
        return -np.sum(dS * distance, axis=-1)
    return -np.sum(rounded(dS * rounded(distance)), axis=-1)


def alibi_slopes_gradient(row_gradient, options):
    """dalibi_slopes, of alibi_slopes' shape, from every row's gradient [..., H, N_q]
    (alibi_row_gradient): summed over each slope's rows (slopes_sum)."""
    return slopes_sum(row_gradient, options.alibi_slopes, options.cu_seqlens_q)


def slopes_sum(x, slopes, cu_seqlens_q=None):
    """A value per row x [..., H, N_q] summed over each slope's rows, to the shape of slopes: for
    slopes [H] or [..., H] every row of the slope's head (and the batch where [H] broadcasts
    along it); for slopes [B, H] with packed sequences (cu_seqlens_q [B + 1]) the rows of
    sequence b alone, dslopes[b, h] = sum_{i in b} x[h, i]."""
    slopes = np.asarray(slopes)
    if not _per_sequence(slopes, cu_seqlens_q):
        return head_gradient(np.sum(x, axis=-1), slopes)
    sums = np.zeros((len(cu_seqlens_q) - 1,) + x.shape[:-1], x.dtype)       # [B, H] (or [B])
    for b, (start, stop) in enumerate(zip(cu_seqlens_q[:-1], cu_seqlens_q[1:])):
        sums[b] = np.sum(x[..., start:stop], axis=-1)
    return sums.reshape(slopes.shape)


def head_gradient(g, x):
    """A per-head gradient g [..., H] summed to the shape of x ([H] or [..., H]; [1] for a
    single head's [N, d] inputs)."""
    return unbroadcast(g, x.shape if x.ndim <= g.ndim else ()).reshape(x.shape)


# ----------------------------------------------------------------------------- FlexAttention's mods

def block_indices(score_shape, index=WHOLE):
    """(b, h, q_idx, kv_idx) of the block S[index]: int arrays of as many axes as the scores,
    broadcastable to the block, as FlexAttention's score_mod and mask_mod see them: b the
    batch index (the flat index over the leading axes; 0 without any), h the query head,
    q_idx and kv_idx the row and the column (in the packed axes, with packed sequences)."""
    ranges, ndim = index_ranges(index, score_shape), len(score_shape)
    along = lambda axis, values: values.reshape((1,) * axis + (-1,) + (1,) * (ndim - axis - 1))
    lead = tuple(score_shape[:-3])
    b = np.arange(int(np.prod(lead, dtype=np.int64))).reshape(lead)[ranges[:-3]]
    b = b.reshape(b.shape + (1, 1, 1))
    h, q_idx, kv_idx = (along(a, np.arange(score_shape[a])[ranges[a]]) for a in (ndim - 3, ndim - 2, ndim - 1))
    return b, h, q_idx, kv_idx


def _broadcasts(shape, to):
    """Whether an array of `shape` broadcasts to the shape `to`."""
    try:
        return np.broadcast_shapes(shape, to) == tuple(to)
    except ValueError:
        return False


def mask_mod_keep(mask_mod, score_shape, index=WHOLE):
    """mask_mod(b, h, q_idx, kv_idx) on the block S[index]: a bool array broadcastable to it."""
    block = tuple(len(range(r.start, r.stop, r.step)) for r in index_ranges(index, score_shape))
    keep = np.asarray(mask_mod(*block_indices(score_shape, index)))
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


def _call_score_mod(o, s, indices, params=None):
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
        value = _call_score_mod(o, stepped, indices, params)
        counts = np.isfinite(s) & ~np.isneginf(value.real)
        return np.where(counts, value.imag / COMPLEX_STEP, 0), counts


def _score_mod_slope(o, s, indices):
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
        x, picked = pick(s), tuple(pick(i) for i in indices)
        h = 1e-6 * np.maximum(1, np.abs(x))
        with np.errstate(all="ignore"):
            central = (_call_score_mod(o, x + h, picked) - _call_score_mod(o, x - h, picked)) / (2 * h)
        if not np.allclose(pick(slope), central, rtol=1e-4, atol=1e-4):
            warnings.warn("score_mod's complex-step derivative disagrees with central differences (it is "
                          "not analytic in the score: abs, a branch on it?); central differences are used",
                          ScoreModDerivativeWarning, stacklevel=4)
            h = 1e-6 * np.maximum(1, np.abs(s))
            with np.errstate(all="ignore"):
                slope = np.where(counts, (_call_score_mod(o, s + h, indices)
                                          - _call_score_mod(o, s - h, indices)) / (2 * h), 0)
    return slope


def _score_mod_param_grads(o, s, indices, ds):
    """{name: gradient} of the score_mod_params from the block's dS (of score_mod's output):
    by complex step through each read (scattered back to the entries read) or each scalar."""
    grads = {}
    recorded = _params(o)
    _call_score_mod(o, s, indices, recorded)                    # which reads score_mod makes
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


# ----------------------------------------------------------------------------- 2-4. on a block

def _block(x, score_shape, index):
    """x (broadcastable to the scores) at S[index]: a view."""
    return np.broadcast_to(x, score_shape)[index]


def _same(x):
    return x


class Rounding(NamedTuple):
    """How a low-precision recipe (oracle/precision.py) rounds the score steps: `step` each
    step's result, `term` each term a step adds (the bias's, ALiBi's), `distance` ALiBi's
    distances before they multiply the slopes (None: not rounded). The backward rounds each
    of autograd's operations with `step`. NONE: nothing rounded (the engines, in their dtype)."""
    step: Callable = _same
    term: Callable = _same
    distance: Optional[Callable] = None


NONE = Rounding()


class Saved(NamedTuple):
    """What a block's forward keeps for its backward and tangent (None: the step is off)."""
    softcap_tanh: Optional[np.ndarray] = None   # t = tanh(S_1 / softcap)
    mod_input: Optional[np.ndarray] = None      # S_3, score_mod's input

    def at(self, index):
        """The block S[index] of a whole forward's Saved."""
        return Saved(*(None if x is None else x[index] for x in self))


def forward(s, options, score_shape=None, index=WHOLE, keep=UNKNOWN, rounding=NONE):
    """Steps 2-4 on a block: S[index] from s = (scale q k^T)[index], which they overwrite
    (the caller's own array; the result is s itself or takes its place).

    score_shape: the whole scores' [..., H, N_q, N_k] (default s.shape: s is all of them).
    keep: the block's keep_mask if the caller has it (None: every score kept).
    rounding: a recipe's Rounding (default NONE: each step in s's dtype).
    Returns (S [..., heads, rows, cols], Saved: what the backward and tangent need).
    """
    o, shape, r = options, s.shape if score_shape is None else score_shape, rounding
    softcap_tanh = mod_input = None
    if o.softcap is not None:                       # 2. S = softcap tanh(S / softcap)
        softcap_tanh = r.step(np.tanh(r.step(s / o.softcap)))
        s = r.step(np.multiply(softcap_tanh, o.softcap, out=s))
    if o.bias is not None:                          # 3. S = S + bias
        s += r.term(_block(o.bias, shape, index))
        s = r.step(s)
    if o.topk is not None and o.topk.repeats:       #    S = S + log c (a key listed c > 1 times)
        s += r.term(log_multiplicity(o.topk, shape, index, s.dtype))
        s = r.step(s)
    if o.alibi_slopes is not None:                  #    S = S - slope |i + N_k - N_q - j|
        s += r.term(alibi_bias(o, shape, index, rounded=r.distance))
        s = r.step(s)
    if o.score_mod is not None:                     #    S = score_mod(S, b, h, q_idx, kv_idx)
        mod_input = s.copy()
        s[...] = r.step(_call_score_mod(o, mod_input, block_indices(shape, index)))
    keep = keep_mask(o, shape, index) if keep is UNKNOWN else keep
    if keep is not None:                            # 4. S = -inf where not kept
        np.copyto(s, -np.inf, where=~keep)
    return s, Saved(softcap_tanh, mod_input)


def backward(ds, options, score_shape=None, index=WHOLE, saved=Saved(), keep=UNKNOWN, grads=None,
             stage=False, rounding=None):
    """Steps 4-2 in reverse on a block: the gradient of (scale q k^T)[index] from ds, the
    gradient of S[index] (overwritten: the caller's own array).

    saved: the block's Saved (its forward's); keep: as for `forward`.
    grads: a ScoreGrads that receives the block's parameters' gradients (bias, ALiBi slopes,
    score_mod_params), or None.
    stage=True: returns (dS_1, dS_4), dS_4 the gradient of the softmax's input S, 0 where
    masked (AttentionStages.dS); else dS_1 [..., heads, rows, cols].
    rounding: a recipe's Rounding: each operation autograd would run, rounded by its step
    (softcap: round(round(round(dS softcap) (1 - t^2)) / softcap)); None: dS (1 - t^2).
    """
    o, shape = options, ds.shape if score_shape is None else score_shape
    keep = keep_mask(o, shape, index) if keep is UNKNOWN else keep
    if keep is not None:                            # 4. dS = 0 where masked
        np.copyto(ds, 0, where=~keep)
    ds4 = ds
    if o.score_mod is not None:                     # 3. dS = dS score_mod'(S_3); its parameters'
        indices = block_indices(shape, index)
        if grads is not None and o.score_mod_params is not None:
            grads.add_mod(_score_mod_param_grads(o, saved.mod_input, indices, ds))
        ds = ds * _score_mod_slope(o, saved.mod_input, indices)
    if grads is not None:                           #    dbias, dslopes
        grads.add(ds, index)
    t = saved.softcap_tanh
    if t is not None and rounding is not None:      # 2. autograd's ops on softcap tanh(S / softcap)
        r = rounding.step
        ds = r(r(r(ds * o.softcap) * (1 - t ** 2)) / o.softcap)
    elif t is not None:                             # 2. dS = dS (1 - tanh^2)
        ds = ds * (1 - t ** 2) if stage and ds is ds4 else np.multiply(ds, 1 - t ** 2, out=ds)
    return (ds, ds4) if stage else ds


def tangent(s_dot, options, score_shape=None, index=WHOLE, saved=Saved(), keep=UNKNOWN, bias_dot=None,
            alibi_slopes_dot=None):
    """Steps 2-4 in forward mode on a block: S_dot[index] from s_dot = (scale q k^T)_dot[index]
    and the tangents of the bias (its shape) and of the ALiBi slopes (theirs), None: 0.
    saved and keep as for `backward`. Returns S_dot [..., heads, rows, cols], fresh."""
    o, shape = options, s_dot.shape if score_shape is None else score_shape
    if saved.softcap_tanh is not None:              # 2. (1 - tanh^2) S_dot
        s_dot = (1 - saved.softcap_tanh ** 2) * s_dot
    if bias_dot is not None:                        # 3. + bias_dot
        s_dot = s_dot + _block(bias_dot, shape, index)
    if alibi_slopes_dot is not None:                #    - slope_dot |i + N_k - N_q - j|
        s_dot = s_dot + alibi_bias(o, shape, index, slopes=alibi_slopes_dot)
    if o.score_mod is not None:                     #    score_mod'(S_3) S_dot
        s_dot = _score_mod_slope(o, saved.mod_input, block_indices(shape, index)) * s_dot
    keep = keep_mask(o, shape, index) if keep is UNKNOWN else keep
    return s_dot if keep is None else np.where(keep, s_dot, 0)   # 4. 0 where masked


# ----------------------------------------------------------------------------- the parameters' gradients

def _bounds(indices, shape):
    """The smallest slices (of step 1) of each axis of `shape` that hold every index of the list."""
    ranges = [index_ranges(index, shape) for index in indices]
    return tuple(slice(min(r[a].start for r in ranges), max(r[a].stop for r in ranges)) for a in range(len(shape)))


class ScoreGrads:
    """The gradients of the score steps' parameters (bias, ALiBi slopes), summed block by
    block over a region of the scores: an index, as a block's, or the list of the blocks to
    come (every block added lies in it).

    Each task of an engine sums its own region's blocks in its own ScoreGrads; `total` adds
    the regions in a fixed order, so the bits do not depend on where or in which order the
    tasks ran.
        bias      dbias: each block's dS_3 summed to the bias's part it broadcast to
        ALiBi     each row's -sum_j dS_3 |i + N_k - N_q - j| (alibi_row_gradient)
    """

    def __init__(self, options, score_shape, dtype, region=WHOLE):
        o, self.options, self.score_shape = options, options, tuple(score_shape)
        self.region = _bounds(region if isinstance(region, list) else [region], score_shape)
        self.dbias = self.rows = None
        if o.bias is not None:                      # the bias's part the region reads
            self.bias_shape = (1,) * (len(score_shape) - o.bias.ndim) + o.bias.shape
            self.bias_at = self._bias_part(self.region)
            self.dbias = np.zeros([s.stop - s.start for s in self.bias_at], dtype)
        if o.alibi_slopes is not None:              # its rows [..., H, N_q]
            self.rows = np.zeros([s.stop - s.start for s in self.region[:-1]], dtype)
        self.mod = None if o.score_mod_params is None else \
            {name: np.zeros(x.shape, np.result_type(dtype, x.real.dtype)) for name, x in o.score_mod_params.items()}

    def _bias_part(self, ranges):
        """The slices of the bias (padded to the scores' axes) that scores at `ranges` read."""
        return tuple(slice(0, 1) if n == 1 else part for part, n in zip(ranges, self.bias_shape))

    def add(self, ds, index):
        """Add the block S[index]'s parameter gradients; ds [..., heads, rows, cols]: dS_3 there."""
        ranges = index_ranges(index, self.score_shape)
        within = lambda parts, region: tuple(slice(p.start - r.start, p.stop - r.start, p.step)
                                             for p, r in zip(parts, region))
        if self.dbias is not None:
            part = self.dbias[within(self._bias_part(ranges), self.bias_at)]
            part += unbroadcast(ds, part.shape)
        if self.rows is not None:
            self.rows[within(ranges[:-1], self.region[:-1])] += alibi_row_gradient(
                ds, self.options, self.score_shape, index)

    def add_mod(self, grads):
        """Add a block's score_mod_params gradients {name: gradient}."""
        for name, g in grads.items():
            self.mod[name] += g

    def __getstate__(self):
        """A region's sums, as a task on a cluster sends them back: without the options (and
        their bias), which only `add` needs."""
        return {**self.__dict__, "options": None}

    @staticmethod
    def total(parts, options, score_shape, dtype):
        """{"dbias": ..., "dalibi_slopes": ..., "dscore_mod_params": ...} (each None without its
        option) from the regions' ScoreGrads `parts`, added in their order."""
        o = options
        whole = ScoreGrads(o, score_shape, dtype)
        for part in parts:
            if whole.dbias is not None:
                whole.dbias[part.bias_at] += part.dbias
            if whole.rows is not None:
                whole.rows[part.region[:-1]] += part.rows
            if whole.mod is not None:
                whole.add_mod(part.mod)
        return {"dbias": None if o.bias is None else whole.dbias.reshape(o.bias.shape),
                "dalibi_slopes": None if o.alibi_slopes is None else alibi_slopes_gradient(whole.rows, o),
                "dscore_mod_params": whole.mod}


# ----------------------------------------------------------------------------- 5. the sink's column

def with_sink(S, options, score_shape=None, index=WHOLE, sinks=None):
    """S[index] [..., rows, cols], with the sink as one more column [..., rows, cols + 1] when
    the options have sinks: a logit per head in every row's softmax, with no value.
    score_shape: the whole scores' shape (default S.shape: S is all of them). sinks: the
    column's values in the sinks' place (their tangent), default options.sinks."""
    if options.sinks is None:
        return S
    sinks = options.sinks if sinks is None else sinks
    sinks = heads_view(sinks, S.shape if score_shape is None else score_shape)[index[:-2]]
    column = np.broadcast_to(sinks[..., None, None], S.shape[:-1] + (1,))
    return np.concatenate([S, column.astype(S.dtype)], axis=-1)


def with_sink_weight(P, lse, options, score_shape=None, index=WHOLE):
    """The softmax's whole row: P [..., rows, cols] with the sink's weight exp(sink - lse) as one
    more column [..., rows, cols + 1] when the options have sinks; P itself without.
    lse [..., rows]; score_shape, index: as for with_sink."""
    if options.sinks is None:
        return P
    sink = with_sink(np.zeros(P.shape[:-1] + (0,), P.dtype), options, score_shape, index)
    with np.errstate(invalid="ignore"):              # a -inf sink in a dead row: -inf - (-inf)
        return np.concatenate([P, np.exp(sink - lse[..., None])], axis=-1)
