"""What attention's forward saves for its backward, and what the backward returns.

Shape legend as in textbook.py. A cache is the options record (options.py) plus the
tensors the backward needs, all filled in by the forward that builds it; MultiHeadCache
(multihead.py) holds its steps' caches.
"""
from collections import namedtuple
from typing import NamedTuple, Optional

import numpy as np

from .options import GRADIENTS, AttentionOptions
from .paged import PagedLayout
from .scores import Saved, attention_scores


class AttentionPlan(NamedTuple):
    """How a cache was made, which its backward follows (engines/plan.py makes it)."""
    implementation: str             # 'textbook', 'blocked', 'tiled' or 'sparse'
    block_size: Optional[int] = None    # the tiled engine's tile size, the sparse engine's block rows
    workers: int = 1                # threads of the blocked and tiled engines (engines/parallel.py)
    scheduler: object = None        # the tiled engine's Dask cluster: a Client or an address (or None)


TEXTBOOK = AttentionPlan("textbook")


class AttentionCache(NamedTuple):
    """What the backward needs. The textbook and blocked engines store P whole; the tiled
    engine saves only O(N) tensors (its cache is a TiledAttentionCache, weights None)."""
    options: AttentionOptions
    q: np.ndarray                   # [..., H, N_q, d_k]
    k: np.ndarray                   # [..., H_kv, N_k, d_k]
    v: np.ndarray                   # [..., H_kv, N_k, d_v]
    out: np.ndarray                 # [..., H, N_q, d_v] P V (before an output gate: gate.py)
    lse: np.ndarray                 # [..., H, N_q] logsumexp of each row of S (-inf: fully masked)
    weights: Optional[np.ndarray] = None     # [..., H, N_q, N_k] P, after the fully-masked policy,
                                             # before dropout (None: tiled)
    top: Optional[np.ndarray] = None         # [..., H, N_q] index of each row's largest S, so of its
                                             # largest P (None: tiled)
    saved: Saved = Saved()                   # the score steps' stages [..., H, N_q, N_k] that their
                                             # backward reuses (scores.Saved; none: tiled)
    plan: AttentionPlan = TEXTBOOK   # the engine that made it, and computes its backward
    paged: Optional[PagedLayout] = None      # q, k, v were packed from a paged KV cache (paged.py)
    rope: Optional[tuple] = None             # (RopeCache of q, of k): q and k were turned (rope.py)
    max_logits: Optional[np.ndarray] = None  # [..., H, N_q] each row's largest score Re S, its max logit
                                             # (-inf: no key kept; scores.row_max)

    @property
    def scores(self):
        """S [..., H, N_q, N_k], the softmax input (-inf where masked), recomputed from q and k.

        Not stored: the blocked engine only ever holds one block of it.
        """
        return attention_scores(self.q, self.k, self.options)[0]


class TiledAttentionCache(AttentionCache):
    """The tiled and sparse engines' cache: options, q, k, v, out, lse and max_logits; P is
    recomputed by the backward."""
    __slots__ = ()


class AttentionStages(NamedTuple):
    dP: np.ndarray                  # [..., H, N_q, N_k] gradient w.r.t. P (before dropout)
    dS: np.ndarray                  # [..., H, N_q, N_k] gradient w.r.t. S (the softmax input)
    D: np.ndarray                   # [..., H, N_q] rowsum(dout * out) = rowsum(P * dP)


AttentionGrads = namedtuple("AttentionGrads", ("dq", "dk", "dv") + GRADIENTS + ("dscore_mod_params", "stages"),
                            defaults=(None,) * (len(GRADIENTS) + 2))
AttentionGrads.__doc__ = """What attention's backward returns:
    dq [..., H, N_q, d_k],  dk [..., H_kv, N_k, d_k],  dv [..., H_kv, N_k, d_v]
    one gradient per option that has one (options.GRADIENTS: dbias, ...), its option's shape
    dscore_mod_params    {name: gradient} of score_mod_params
    stages               AttentionStages, with return_stages=True
each None without its option."""


class MultiHeadCache(NamedTuple):
    """What multihead_backward needs: each step's cache (multihead.py)."""
    q: tuple                        # LinearCache of each input projection
    k: tuple
    v: tuple
    attention: tuple                # AttentionCache
    o: tuple                        # LinearCache of the output projection
    num_heads: int
    workers: int                    # the projections' threads, resolved (1: the textbook engine)
