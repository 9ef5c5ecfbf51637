"""attention_forward and attention_backward: the public pair, which checks its arguments and runs an engine.

Shapes, the steps and their gradients: textbook.py, the spec. attention_forward checks its
arguments once (options.py), makes the plan (engines/plan.py), then runs one of four
engines that compute the same thing, each tested equal to the textbook:
    'textbook'  textbook.py: whole arrays, every [..., H, N_q, N_k] stage formed
    'blocked'   engines/blocked.py: the same steps on blocks of query rows (the cache
                holds P whole); faster, the default
    'tiled'     engines/tiled.py: FlashAttention's online softmax, O(N) memory, no
                [N_q, N_k] array; the default when block_size is given
    'sparse'    engines/sparse.py: top-k lists (topk_indices), each query's listed keys
                gathered, blocks of query rows; the default with topk_indices
Around the engine: rope turns q and k first (rope.py); a paged KV cache or packed sequences
(cu_seqlens) are packed into one problem and its results unpacked (paged.py).
"""
import numpy as np

from ._checks import as_float_array, require_cache, require_choice, require_same_shape, result_dtype
from .caches import AttentionCache, AttentionGrads, AttentionStages, TiledAttentionCache
from .engines.blocked import blocked_backward, blocked_forward
from .engines.plan import attention_plan
from .engines.sparse import sparse_backward, sparse_forward
from .engines.tiled import tiled_backward, tiled_forward
from .gate import gate_backward, gate_forward
from .paged import NOT_WITH_PAGES, check_pages, cu_seqlens, pack, pack_rows, scatter_keys, unpack_rows
from .rope import rope_backward, rope_qk
from .option_checks import FULLY_MASKED_POLICIES
from .options import attention_options, head_vectors, with_options
from .textbook import textbook_backward, textbook_forward

BACKWARD_METHODS = ("vjp", "jacobian", "flash")

__all__ = ["attention_forward", "attention_backward", "ENGINES", "AttentionCache", "AttentionGrads",
           "AttentionStages", "TiledAttentionCache", "FULLY_MASKED_POLICIES", "BACKWARD_METHODS"]


# ----------------------------------------------------------------------------- the public pair

# implementation -> (forward(q, k, v, options, plan) -> (out, cache),
#                    backward(dout, cache, method, return_stages) -> AttentionGrads)
ENGINES = {"textbook": (textbook_forward, textbook_backward),
           "blocked": (blocked_forward, blocked_backward),
           "tiled": (tiled_forward, tiled_backward),
           "sparse": (sparse_forward, sparse_backward)}


@with_options
def attention_forward(q, k, v, *, implementation=None, block_size=None, workers=None, scheduler=None,
                      page_table=None, cache_seqlens=None, rope=None, **options):
    """out = softmax(scale * q k^T [+ options]) v: checks every argument once, then one engine.

    Args:
        q: [..., H, N_q, d_k]; k: [..., H_kv, N_k, d_k]; v: [..., H_kv, N_k, d_v].
        options: the math's keywords, one row each of options.OPTIONS:
{options}
        keep_steps: the steps that drop keys by position beyond the keep options above, each a
            keyword of its name (scores.py's KEEP_STEPS; docs/variants.md lists them). Any
            other name is a TypeError.
        rope: rotary position embeddings applied to q and k inside, as fused kernels do: a
            dict of rope_forward's options (layout, rotary_dim, base, scaling) and optionally
            positions_q [N_q], positions_k [N_k]; by default key j is at its position in its
            sequence and query i at i + N_k - N_q in its own (the last N_q tokens, bottom-right
            as in decoding; per packed sequence with cu_seqlens). The gradients come back to
            the unturned q and k; the cache holds the turned ones.
        page_table, cache_seqlens: [B, P] and [B] int, a paged KV cache (paged.py): k, v are
            then k_cache, v_cache [num_pages, H_kv, page, d] and q is [B, H, N_q, d_k];
            sequence b's keys are the first cache_seqlens[b] rows of its pages. It runs as
            packed sequences (the cache holds that problem: cache.q [H, B N_q, d_k]); out and
            the gradients come back in the caller's layout (dk, dv as the pages' gradients).
        implementation: 'textbook' (whole arrays, the spec), 'blocked' (the same steps on
            blocks of query rows; the default), 'tiled' (FlashAttention's algorithm: no
            [N_q, N_k] array, O(N) memory; every option but those whose row says tiled=False,
            ValueError for those) or 'sparse' (topk_indices: each query's listed keys
            gathered, O(N K) work and memory; every option). None: 'sparse' with topk_indices,
            else 'tiled' if block_size is given, else 'blocked'.
        block_size: the tiled engine's tile size (default plan.TILE_SIZE = 256); the sparse
            engine's query rows a block (default: as many as gather 2^15 keys a head).
        workers: threads for the blocked, tiled and sparse engines: their independent slices
            (blocks of rows; a backward's batch index and kv head) run on a thread pool with
            BLAS held to one thread (engines/parallel.py; for one worker too: `workers` threads
            in all); the results are bitwise the same for any number. None (default): every
            core this process may use when the scores have at least plan.PARALLEL_SCORES =
            2^19 entries (with packed sequences, counting each sequence's own scores only),
            else 1. The backward (and attention_jvp) uses the forward's.
        scheduler: the tiled or sparse engine's slices on a Dask cluster instead (the optional extra
            `dask`): a dask.distributed Client, or a scheduler's address such as
            'tcp://host:8786' (a Client is opened for the call). Results are bitwise those
            of a local run. The backward uses the forward's (a Client must still be open).
    Returns:
        out [..., H, N_q, d_v] (times sigmoid(gate) with a gate) and an AttentionCache (weights
        P, lse and max_logits inside; cache.scores recomputes S; cache.out is P V, before a
        gate), or a TiledAttentionCache (out, lse and max_logits) for 'tiled' and 'sparse'.
    """
    paged = None
    if page_table is not None or cache_seqlens is not None:          # gather the pages: packed sequences
        if any(options.get(name) is not None for name in NOT_WITH_PAGES + ("topk_indices",)):
            raise ValueError("a paged KV cache (page_table) takes no mask, bias, cu_seqlens, seqused_k or "
                             "topk_indices (each sequence's keys are its cache_seqlens rows), nor a gate")
        q, k, v = (as_float_array(x, name) for name, x in (("q", q), ("k", k), ("v", v)))
        paged = check_pages(q, k, v, page_table, cache_seqlens)
        per_head = head_vectors(q.shape, options, q.shape[0])      # against the caller's q
        q, k, v = pack(q, k, v, paged)
        cu_q, cu_k = cu_seqlens(paged)
        options = {**options, **per_head, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    q, k, v, options = attention_options(q, k, v, **options)        # the math, checked once
    plan = attention_plan(options, q.shape, k.shape, implementation=implementation,   # where and how
                          block_size=block_size, workers=workers, scheduler=scheduler)
    turned = None
    if rope is not None:                                            # q, k turned by their positions
        q, k, turned = rope_qk(q, k, rope, options)
    forward, _ = ENGINES[plan.implementation]
    out, cache = forward(q, k, v, options, plan)
    if options.gate is not None:                                    # out = (P V) * sigmoid(gate)
        out = gate_forward(out, options.gate)
    cache = cache._replace(rope=turned, paged=paged)                # for the backward
    return (out if paged is None else unpack_rows(out, paged)), cache


def attention_backward(dout, cache, dlse=None, *, method="vjp", return_stages=False):
    """Gradients of `attention_forward` w.r.t. q, k, v and bias, by the forward's engine.

    Args:
        dout: [..., H, N_q, d_v] upstream gradient of out.
        cache: the cache attention_forward returned.
        dlse: [..., H, N_q] upstream gradient of lse (cache.lse), for a loss on both out and
            lse (a kernel that returns lse for later use differentiates it too); None: 0.
            lse_i = log sum_j exp(S_ij) has d lse_i / d S_ij = P_ij, so step 5 becomes
            dS = P * (dP - rowsum(P * dP) + dlse): the flash form's D becomes D - dlse.
        method: how step 5 (softmax) is differentiated; all three agree to rounding
            normwise, but only 'vjp' keeps the tiny gradients of saturated rows (1 - max P
            near eps) accurate relatively (docs/derivations.md, "Softmax"):
            'vjp'      dS = P * (dP - rowsum(P * dP))             (softmax_backward)
            'jacobian' dS = J dP with J = diag(P) - P P^T per row  (softmax_jacobian; O(N_k^2) per row)
            'flash'    dS = P * (dP - D), D = rowsum(dout * out), P recomputed as exp(S - lse)
                       with S recomputed from q and k (FlashAttention's backward)
            The tiled and sparse engines always compute the 'flash' form ('vjp' is accepted
            there).
        return_stages: also return AttentionStages(dP, dS, D) for per-stage comparison
            (not with the tiled and sparse engines, which never form them).
    Returns:
        AttentionGrads: dq, dk, dv (contiguous arrays), each option's gradient (options.GRADIENTS:
        dbias, ...), dscore_mod_params and stages; each None without its option.
    """
    require_cache(cache, AttentionCache, "attention_backward",      # (a TiledAttentionCache is one)
                  arrays=("q", "k", "v", "out", "lse") + (() if isinstance(cache, TiledAttentionCache)
                                                          else ("weights", "top")))
    paged = cache.paged
    if paged is not None:                                           # the caller's layout -> packed
        require_same_shape(dout, paged.q_shape[:-1] + cache.v.shape[-1:], "dout")
        dout = pack_rows(np.asarray(dout))
        if dlse is not None and np.shape(dlse) == paged.q_shape[:-1]:   # (or packed, like cache.lse)
            dlse = pack_rows(np.asarray(dlse))
    require_same_shape(dout, cache.out.shape, "dout")
    require_choice(method, "method", BACKWARD_METHODS)
    dout = as_float_array(dout, "dout").astype(result_dtype(cache.out, np.asarray(dout)), copy=False)
    if dlse is not None:
        if np.shape(dlse) != cache.lse.shape:
            raise ValueError(f"dlse must have lse's shape {cache.lse.shape} [..., H, N_q], "
                             f"got {np.shape(dlse)}")
        dlse = as_float_array(dlse, "dlse").astype(dout.dtype, copy=False)
    gate = cache.options.gate
    if gate is not None:                                            # out = O * sigmoid(gate): dO, dgate
        dout, dgate = gate_backward(dout, cache.out, gate)
    _, backward = ENGINES[cache.plan.implementation]
    grads = backward(dout, cache, dlse, method=method, return_stages=return_stages)
    if gate is not None:
        grads = grads._replace(dgate=dgate)
    if cache.rope is not None:                                      # back to the unturned q and k
        q_turn, k_turn = cache.rope
        grads = grads._replace(dq=rope_backward(grads.dq, q_turn), dk=rope_backward(grads.dk, k_turn))
    if paged is None:
        return grads
    return grads._replace(dq=unpack_rows(grads.dq, paged), dk=scatter_keys(grads.dk, paged.k_cache_shape, paged),
                          dv=scatter_keys(grads.dv, paged.v_cache_shape, paged))
