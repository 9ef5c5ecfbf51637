"""Where each score sits: its query's diagonal and its key's position, in their own sequence.

Causal masking, the sliding window and ALiBi depend only on positions. A leaf module (it
imports only _checks): the checks of causal alignment and of the window, and which pairs they
keep.

One sequence (the usual case): row i and column j are their own positions, and the
diagonal of row i is i (top_left, torch's is_causal) or i + N_k - N_q (bottom_right,
FlashAttention 2.1+).

Packed sequences (FlashAttention's varlen): the rows and columns of B sequences are
concatenated, sequence b's rows cu_seqlens_q[b] : cu_seqlens_q[b + 1], its columns
cu_seqlens_k[b] : cu_seqlens_k[b + 1], of which only the first seqused_k[b] are used.
A row keeps only columns of its own sequence, counts positions from the start of its
sequence, and aligns on that sequence's own lengths:

    i' = i - cu_seqlens_q[b],  j' = j - cu_seqlens_k[b],  N_q' = its length,  N_k' = seqused_k[b]
    diagonal = i' (top_left)  or  i' + N_k' - N_q' (bottom_right)

    causal keeps   j' <= diagonal
    window keeps   diagonal - left <= j' <= diagonal + right   (-1: unbounded on that side)
    ALiBi          distance = |i' + N_k' - N_q' - j'|           (the bottom-right diagonal)
                   slope = slopes[b, h] with [B, H] slopes, one row per sequence
"""
from typing import NamedTuple, Optional

import numpy as np

from ._checks import brief, require_choice

ALIGNMENTS = ("top_left", "bottom_right")
WINDOW_MAX = 2 ** 62        # a window side above this reaches every key of any array numpy can hold


def resolve_alignment(causal, align):
    """One diagonal alignment for causal and window: 'top_left' (torch is_causal) by default."""
    if isinstance(causal, str):
        require_choice(causal, "causal", ALIGNMENTS)
        if align is not None and align != causal:
            raise ValueError(f"causal={causal!r} contradicts align={align!r}")
        return True, causal
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be False, True, 'top_left' or 'bottom_right'; got {brief(causal)}")
    if align is not None:
        require_choice(align, "align", ALIGNMENTS)
    return bool(causal), align or "top_left"


def check_window(window, name="window"):
    """window as (left, right) ints >= -1 (-1 = unbounded), or None; ValueError naming `name`
    otherwise."""
    if window is None:
        return None
    ok = (isinstance(window, (tuple, list)) and len(window) == 2
          and all(isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_))
                  and w >= -1 for w in window))
    if not ok:
        raise ValueError(f"{name} must be a pair (left, right) of integers >= -1 "
                         f"(-1 = unbounded), got {brief(window)}")
    # a side wider than any sequence is unbounded; clamped, positions + right cannot overflow int64
    return tuple(min(int(w), WINDOW_MAX) for w in window)


class Positions(NamedTuple):
    """Where the scores at rows [r, 1] and cols [1, c] sit (or at cols [..., r, K], each row's
    own columns: a gathered block); every field broadcasts against the others."""
    diagonal: np.ndarray            # rows' shape: each row's diagonal, in its sequence's columns
    cols: np.ndarray                # cols' shape: each column's position in its sequence
    same: Optional[np.ndarray]      # the pairs within one sequence and used; None: all


def sequence_lengths(cu_seqlens):
    """[B] the lengths of the packed sequences, from their cumulative offsets [B + 1]."""
    return np.diff(cu_seqlens)


def sequence_of(cu_seqlens, indices):
    """[n] the packed sequence b of each index [n] along its axis: cu_seqlens[b] <= index <
    cu_seqlens[b + 1] (a zero-length sequence holds none)."""
    return np.searchsorted(cu_seqlens, indices, side="right") - 1


def positions(n_q, n_k, rows, cols, align, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None):
    """The Positions of rows and cols (absolute indices into the N_q, N_k axes, of shapes that
    broadcast against each other: [r, 1] and [1, c], or [r, 1] and [..., r, K])."""
    rows, cols = np.asarray(rows), np.asarray(cols)
    if cu_seqlens_q is None:
        return Positions(diagonal=rows + (n_k - n_q if align == "bottom_right" else 0), cols=cols, same=None)
    seq_q, seq_k = sequence_of(cu_seqlens_q, rows), sequence_of(cu_seqlens_k, cols)   # rows', cols' shapes
    used_k = sequence_lengths(cu_seqlens_k) if seqused_k is None else seqused_k
    offset = used_k - sequence_lengths(cu_seqlens_q) if align == "bottom_right" else np.zeros_like(used_k)
    local_cols = cols - cu_seqlens_k[seq_k]
    same = (seq_q == seq_k) & (local_cols < used_k[seq_k])
    return Positions(diagonal=rows - cu_seqlens_q[seq_q] + offset[seq_q], cols=local_cols, same=same)


def band_keep(pos, options):
    """The pairs that the sequences, causal masking and the window (options') keep (the
    positions' broadcast shape: [r, c], or [..., r, K]); None: all."""
    j, diagonal = pos.cols, pos.diagonal
    bounds = []
    if options.causal:
        bounds.append(j <= diagonal)
    if options.window is not None:
        left, right = options.window
        if left >= 0:
            bounds.append(j >= diagonal - left)
        if right >= 0:
            bounds.append(j <= diagonal + right)
    keep = pos.same
    for bound in bounds:
        keep = bound if keep is None else keep & bound
    return keep


def banded(options):
    """Whether the keys a row keeps depend on its position (band_keep): causal masking, a
    window, packed sequences."""
    return bool(options.causal or options.window is not None or options.cu_seqlens_q is not None)


def distance(pos):
    """|diagonal - j| ([r, c], or [..., r, K]): ALiBi's distance when pos has the bottom-right
    diagonal."""
    return np.abs(pos.diagonal - pos.cols)
