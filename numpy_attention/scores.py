"""The score pipeline: each step from scale q k^T to the softmax's row, defined once.

Shape legend as in textbook.py: the scores S are [..., H, N_q, N_k]. A block of them is
S[index], index a tuple into the scores whose last two entries are the slices of the block's
rows and columns (slices of the leading axes and heads before them, or an Ellipsis): the
textbook's block is all of S, the blocked engine's a block of rows, the tiled engine's a tile.
A gathered block (the sparse engine's) has instead of the columns' slice an integer array
cols [heads, rows, K] of each row's own columns: the block is [..., heads, rows, K], entry t of
row i the score S[.., i, cols[.., i, t]] (`block_of`).

    1. S = scale q k^T                     the engine's product, on its own block of q and k
    2. S = softcap tanh(S / softcap)       softcap
    3. S = S + bias                        bias, broadcast to the scores
       S = S - slope |i + N_k - N_q - j|   ALiBi: each row's slope, its distance from the diagonal
       S = score_mod(S, b, h, q_idx, kv_idx)   FlexAttention's (its parameters: score_mod_params)
       S = S + log c                       top-k lists (topk.py): c the times the row lists the key,
                                           where it is over 1: a constant that weighs the key c
                                           times, so after score_mod (without one, with the bias);
                                           a gathered block gathers the key c times instead
    4. S = -inf where not kept             keep = mask & the steps by position (positions.band_keep)
                                           & KEEP_STEPS (attention_chunk) & mask_mod & (bias != -inf)
                                           & listed (top-k lists: c > 0) (True = attend; positions.py)
    5. [S, sink]                           a sink: one more logit per row, with no value

Each step, on any block:
    forward    `forward`: steps 2-4 on the block's scale q k^T
    backward   `backward`: steps 4-2 in reverse, the gradient of scale q k^T from that of S;
               the gradients of the steps' parameters (bias, ALiBi's slopes, score_mod's) go to
               a `ScoreGrads` (score_grads.py), which sums them block by block
    tangent    `tangent`: steps 2-4 in forward mode, S_dot from (scale q k^T)_dot and the
               parameters' tangents; `backward_tangent`: the backward's steps 4-2 in forward
               mode (a Hessian-vector product's)
    keep       `keep_mask`: which scores of the block step 4 keeps
FlexAttention's score_mod and mask_mod are called, and differentiated, by score_mods.py.
The sink's column (5) is the softmax row's (softmax_row.py); its gradient sums the column's
dS per head (`head_gradient`). A low-precision recipe (oracle/recipe.py)
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
from typing import Callable, NamedTuple, Optional

import numpy as np

from ._checks import as_scalar, require_positive_int
from ._layout import gathered_cols, grouped_matmul, is_gathered, scaled, unbroadcast
from .near_misses import unexpected_keyword
from .positions import band_keep, distance, positions, sequence_of
from .score_mods import (call_score_mod, mask_mod_keep, mod_indices, score_mod_param_grads,
                         score_mod_slope)
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
    return at.cols // chunk == at.diagonal // chunk


# name -> KeepStep: the steps that drop keys by position, beside positions.band_keep's
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
    """Which scores of S[index] are kept: mask & positions.band_keep & KEEP_STEPS
    & mask_mod & (bias != -inf) & listed (top-k lists).

    score_shape: [..., H, N_q, N_k]; index: a tuple into the scores whose last two
    entries are the slices of rows and columns.
    Returns a bool array broadcastable to S[index], or None when every score is kept.
    """
    o = options
    if not o.masked:
        return None
    at = _positions(o, score_shape, index, o.align)
    keep = band_keep(at, o)                                           # [rows, cols] or None
    for name, value in o.keep_steps:
        part = KEEP_STEPS[name].keep(value, at)                       # [rows, cols]
        keep = part if keep is None else keep & part
    parts = ([] if o.mask is None else [block_of(o.mask, score_shape, index)]) + \
            ([] if o.bias is None else [~np.isneginf(block_of(o.bias, score_shape, index).real)])
    if o.mask_mod is not None:
        parts.append(mask_mod_keep(o.mask_mod, score_shape, index))
    if o.topk is not None and not is_gathered(index):      # (a gathered block's entries are the lists')
        parts.append(counts(o.topk, score_shape, index) > 0)
    for part in parts:
        keep = part if keep is None else keep & part
    return keep


def _positions(options, score_shape, index, align):
    """positions.Positions of the rows [r, 1] and columns [1, c] (a gathered block's [heads, r, K])
    of S[index]."""
    n_q, n_k = score_shape[-2:]
    cols = index[-1] if is_gathered(index) else np.arange(n_k)[index[-1]][None, :]
    return positions(n_q, n_k, np.arange(n_q)[index[-2]][:, None], cols, align,
                     options.cu_seqlens_q, options.cu_seqlens_k, options.seqused_k)


def block_of(x, score_shape, index):
    """x (broadcastable to the scores) at the block S[index]: a view of it, or for a gathered
    block x[.., i, cols[.., i, t]] [..., heads, rows, K]."""
    x = np.broadcast_to(x, score_shape)
    if not is_gathered(index):
        return x[index]
    rows = x[index[:-1]]                                              # [..., heads, rows, N_k]
    return np.take_along_axis(rows, gathered_cols(index, rows.ndim), axis=-1)


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
    rows]. A block of columns gives its part of the sum; slopes_sum sums the rows.
    rounded: applied to the distances and to each product before the sum (a 16-bit autograd
    rounds them), or None."""
    distance = alibi_distance(options, score_shape, index).astype(dS.dtype)
    if rounded is None:
        return -np.sum(dS * distance, axis=-1)
    return -np.sum(rounded(dS * rounded(distance)), axis=-1)


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


# ----------------------------------------------------------------------------- 2-4. on a block

def _same(x):
    return x


class Rounding(NamedTuple):
    """How a low-precision recipe (oracle/recipe.py) rounds the score steps: `step` each
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
        return self.map(lambda x: x[index])

    def map(self, f):
        """Saved of f(x) for each stage x saved."""
        return Saved(*(None if x is None else f(x) for x in self))

    @staticmethod
    def whole(options, score_shape, dtype):
        """Zeros of the scores' shape for each stage the options' steps save (a blocked forward's
        blocks write theirs in)."""
        o = options
        return Saved(*(np.zeros(score_shape, dtype) if on else None
                       for on in (o.softcap is not None, o.score_mod is not None)))


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
        s += r.term(block_of(o.bias, shape, index))
        s = r.step(s)
    if o.score_mod is None:                         #    S = S + log c, with the bias (as a dense bias
        s = _multiplicity(s, o, shape, index, r)    #    log c rounds) where no score_mod follows
    if o.alibi_slopes is not None:                  #    S = S - slope |i + N_k - N_q - j|
        s += r.term(alibi_bias(o, shape, index, rounded=r.distance))
        s = r.step(s)
    if o.score_mod is not None:                     #    S = score_mod(S, b, h, q_idx, kv_idx)
        mod_input = s.copy()
        s[...] = r.step(call_score_mod(o, mod_input, mod_indices(shape, index)))
        s = _multiplicity(s, o, shape, index, r)    #    S = S + log c: a weight, never score_mod's input
    keep = keep_mask(o, shape, index) if keep is UNKNOWN else keep
    if keep is not None:                            # 4. S = -inf where not kept
        np.copyto(s, -np.inf, where=~keep)
    return s, Saved(softcap_tanh, mod_input)


def row_max(s, options, score_shape=None, index=WHOLE):
    """Each row's largest score (its max logit) of the block S[index] that `forward` returned:
    [..., heads, rows] of Re S, -inf in a row with no score kept. A key listed c times counts
    with its own score, without its weight's log c (as a gathering kernel sees it)."""
    o, shape = options, s.shape if score_shape is None else score_shape
    s = s.real
    if o.topk is not None and not is_gathered(index) and o.topk.repeats:
        s = s - log_multiplicity(o.topk, shape, index, s.dtype)
    return s.max(axis=-1, initial=-np.inf)


def _multiplicity(s, options, score_shape, index, rounding):
    """s + log c where the block's row lists its key c > 1 times (top-k lists; a gathered block
    gathers the key c times instead, and so adds nothing)."""
    o, r = options, rounding
    if o.topk is None or is_gathered(index) or not o.topk.repeats:
        return s
    s += r.term(log_multiplicity(o.topk, score_shape, index, s.dtype))
    return r.step(s)


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
        indices = mod_indices(shape, index)
        if grads is not None and o.score_mod_params is not None:
            grads.add_mod(score_mod_param_grads(o, saved.mod_input, indices, ds))
        ds = ds * score_mod_slope(o, saved.mod_input, indices)
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
        s_dot = s_dot + block_of(bias_dot, shape, index)
    if alibi_slopes_dot is not None:                #    - slope_dot |i + N_k - N_q - j|
        s_dot = s_dot + alibi_bias(o, shape, index, slopes=alibi_slopes_dot)
    if o.score_mod is not None:                     #    score_mod'(S_3) S_dot
        s_dot = score_mod_slope(o, saved.mod_input, mod_indices(shape, index)) * s_dot
    keep = keep_mask(o, shape, index) if keep is UNKNOWN else keep
    return s_dot if keep is None else np.where(keep, s_dot, 0)   # 4. 0 where masked


def backward_tangent(ds, ds_dot, s_dot, options, saved=Saved()):
    """Steps 4-2 of the backward in forward mode on the whole scores (attention_hvp): (dS_1,
    dS_1_dot) from dS, its tangent ds_dot and S_dot (`tangent`'s, with no parameter's tangent:
    they are constants here; no score_mod, whose second derivative this would need).
        4. dS_3 = dS where kept, 0 elsewhere;  the same for dS_dot
        2. dS_1 = dS_3 (1 - t^2),  dS_1_dot = dS_3_dot (1 - t^2) - 2 dS_3 t t_dot,
           t_dot = (1 - t^2) S_1_dot / softcap = S_dot / softcap
    """
    keep = keep_mask(options, ds.shape)
    if keep is not None:
        ds, ds_dot = np.where(keep, ds, 0), np.where(keep, ds_dot, 0)
    t = saved.softcap_tanh
    if t is None:
        return ds, ds_dot
    t_dot = s_dot / options.softcap
    return ds * (1 - t ** 2), ds_dot * (1 - t ** 2) - 2 * ds * t * t_dot
