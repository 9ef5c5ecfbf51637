"""attention_forward and attention_backward: the public pair, which checks its arguments and runs an engine.

Shapes, the steps and their gradients: textbook.py, the spec. attention_forward checks its
arguments once (options.py), makes the plan (engines/plan.py), then runs one of three
engines that compute the same thing, each tested equal to the textbook:
    'textbook'  textbook.py: whole arrays, every [..., H, N_q, N_k] stage formed
    'blocked'   engines/blocked.py: the same steps on blocks of query rows (the cache
                holds P whole); faster, the default
    'tiled'     engines/tiled.py: FlashAttention's online softmax, O(N) memory, no
                [N_q, N_k] array; the default when block_size is given
Around the engine: rope turns q and k first (rope.py); a paged KV cache or packed sequences
(cu_seqlens) are packed into one problem and its results unpacked (paged.py).
"""
import numpy as np

from ._checks import as_float_array, require_cache, require_choice, require_same_shape, result_dtype
from .caches import AttentionCache, AttentionGrads, AttentionStages, TiledAttentionCache
from .engines.blocked import blocked_backward, blocked_forward
from .engines.plan import attention_plan
from .engines.tiled import tiled_backward, tiled_forward
from .paged import check_pages, cu_seqlens, pack, pack_rows, scatter_keys, unpack_rows
from .rope import rope_backward, rope_qk
from .options import FULLY_MASKED_POLICIES, attention_options, check_per_head
from .textbook import textbook_backward, textbook_forward

BACKWARD_METHODS = ("vjp", "jacobian", "flash")

__all__ = ["attention_forward", "attention_backward", "ENGINES", "AttentionCache", "AttentionGrads",
           "AttentionStages", "TiledAttentionCache", "FULLY_MASKED_POLICIES", "BACKWARD_METHODS"]


# ----------------------------------------------------------------------------- the public pair

# implementation -> (forward(q, k, v, options, plan) -> (out, cache),
#                    backward(dout, cache, method, return_stages) -> AttentionGrads)
ENGINES = {"textbook": (textbook_forward, textbook_backward),
           "blocked": (blocked_forward, blocked_backward),
           "tiled": (tiled_forward, tiled_backward)}


def attention_forward(q, k, v, *, mask=None, bias=None, causal=False, align=None, window=None,
                      scale=None, softcap=None, dropout_mask=None, dropout_p=0.0,
                      fully_masked="zero", check_finite=False, implementation=None, block_size=None,
                      sinks=None, alibi_slopes=None, cu_seqlens_q=None, cu_seqlens_k=None,
                      seqused_k=None, page_table=None, cache_seqlens=None, workers=None,
                      scheduler=None, score_mod=None, mask_mod=None, score_mod_params=None,
                      score_mod_vjps=None, rope=None, topk_indices=None, topk_length=None, **keep_steps):
    """out = softmax(scale * q k^T [+ options]) v: checks every argument once, then one engine.

    Args:
        q: [..., H, N_q, d_k]; k: [..., H_kv, N_k, d_k]; v: [..., H_kv, N_k, d_v].
        mask: keep-mask broadcastable to [..., H, N_q, N_k]; True/nonzero = attend.
        bias: additive float scores broadcastable to [..., H, N_q, N_k]; gets a gradient.
            An additive mask (0 / -inf) belongs here.
        causal: False, True, 'top_left' (torch is_causal) or 'bottom_right' (FlashAttention).
        align: diagonal alignment for causal=True and for window: 'top_left' (default)
            or 'bottom_right'.
        window: (left, right) sliding window around the diagonal, -1 = unbounded
            (FlashAttention's window_size; FlashAttention aligns it bottom-right, so pass
            align='bottom_right' to match it when N_q != N_k).
        scale: multiplies q k^T; default 1/sqrt(d_k); 1.0 for the unscaled experiment.
        softcap: S <- softcap * tanh(S / softcap), after scaling and before bias and masks.
        alibi_slopes: [H] or [..., H]: ALiBi, S <- S - slope_h * |i + N_k - N_q - j|, the
            distance from the bottom-right-aligned diagonal (FlashAttention's convention;
            for N_q == N_k it is |i - j|, torch's and the paper's; a top-left form is
            bias = -slope * |i - j|); gets a gradient, grads.dalibi_slopes. With packed
            sequences or a paged KV cache: [H], or [B, H] with one row per sequence (as
            FlashAttention's varlen and kvcache functions take them), whose gradient's row b
            sums over sequence b's rows only.
        score_mod: FlexAttention's score_mod(score, b, h, q_idx, kv_idx) -> score, applied
            after bias and ALiBi, before the masks (scores.py): called on NumPy arrays, the
            block's scores and its index arrays broadcastable to them (b the batch index,
            h the query head, q_idx and kv_idx the row and column). Its derivative in the
            score comes by complex step on it (docs/variants.md).
        keep_steps: the steps that drop keys by position beyond causal and window, each a
            keyword of its name (scores.py's KEEP_STEPS; docs/variants.md lists them). Any
            other name is a TypeError.
        mask_mod: FlexAttention's mask_mod(b, h, q_idx, kv_idx) -> bool (True = attend),
            called on a block's index arrays; a block it removes entirely is skipped.
        topk_indices: [..., H_kv or H, N_q, K] int, sparse top-k attention's lists: each query
            attends to the keys it lists alone (a list per kv head, for its query heads, or per
            query head; -1 or any index outside [0, N_k) pads), a key listed c times with c
            times its weight (S + log c, as a kernel that gathers it c times computes); the
            engines take each block's keep-mask from the lists (topk.py), never [N_q, N_k] of
            them. sparse_attention_forward gathers the keys instead: the same results.
        topk_length: [..., N_q] int: only each row's first topk_length entries of topk_indices.
        score_mod_params: {name: array}: parameters of score_mod, passed to it as a sixth
            argument; their gradients come back in grads.dscore_mod_params. score_mod may
            index one (params["rel"][h, q_idx - kv_idx]) or use a 0-d one as a scalar.
        score_mod_vjps: {name: vjp} for a parameter score_mod uses whole in any other way:
            vjp(ds, score, b, h, q_idx, kv_idx, params) -> the gradient of <ds, score_mod> on
            a block w.r.t. params[name], params[name]'s shape; checked by complex step along
            a random direction before it is trusted (ValueError naming it).
        rope: rotary position embeddings applied to q and k inside, as fused kernels do: a
            dict of rope_forward's options (layout, rotary_dim, base, scaling) and optionally
            positions_q [N_q], positions_k [N_k]; by default key j is at its position in its
            sequence and query i at i + N_k - N_q in its own (the last N_q tokens, bottom-right
            as in decoding; per packed sequence with cu_seqlens). The gradients come back to
            the unturned q and k; the cache holds the turned ones.
        sinks: [H]: one more logit per query head in every row's softmax, with no value
            (gpt-oss's attention sink): lse = log(sum_j exp S_ij + exp sink_h), and the
            sink's weight exp(sink_h - lse) multiplies nothing. A row whose keys are all
            masked gives out 0 and lse = sink (fully_masked must be 'zero'); the gradient
            is grads.dsinks.
        cu_seqlens_q, cu_seqlens_k: [B + 1] int, FlashAttention's varlen: B sequences packed
            along the length axes, q [H, total_q, d_k], k, v [H_kv, total_k, d]; no row
            attends across a sequence boundary, and causal, window and ALiBi align on each
            sequence's own lengths (positions.py). A zero-length sequence is allowed.
        seqused_k: [B] int: only the first seqused_k[b] keys of sequence b are used.
        page_table, cache_seqlens: [B, P] and [B] int, a paged KV cache (paged.py): k, v are
            then k_cache, v_cache [num_pages, H_kv, page, d] and q is [B, H, N_q, d_k];
            sequence b's keys are the first cache_seqlens[b] rows of its pages. It runs as
            packed sequences (the cache holds that problem: cache.q [H, B N_q, d_k]); out and
            the gradients come back in the caller's layout (dk, dv as the pages' gradients).
        dropout_mask, dropout_p: explicit keep-mask (broadcastable to the weights) and
            drop probability: P <- P * dropout_mask / (1 - dropout_p). No RNG inside.
        fully_masked: a row with every score -inf gives
            'zero'    output 0 and gradient 0 (torch 2.5+ SDPA, FlashAttention, ONNX);
            'uniform' the mean of v's rows (the seed's -1e9 fill, JAX), gradient 0 to q, k;
            'nan'     NaN output (the SDPA formula written out).
        check_finite: raise ValueError on NaN/Inf in q, k, v (and NaN/+inf in bias)
            instead of letting them poison the rows they touch.
        implementation: 'textbook' (whole arrays, the spec), 'blocked' (the same steps on
            blocks of query rows; the default) or 'tiled' (FlashAttention's algorithm: no
            [N_q, N_k] array, O(N) memory; every option but softcap, dropout and the
            'uniform' / 'nan' policies, ValueError for those). None: 'tiled' if
            block_size is given, else 'blocked'.
        block_size: the tiled engine's tile size (default plan.TILE_SIZE = 256).
        workers: threads for the blocked and tiled engines: their independent slices (blocks
            of rows; the tiled backward's batch index and kv head) run on a thread pool with
            BLAS held to one thread (engines/parallel.py; for one worker too: `workers` threads
            in all); the results are bitwise the same for any number. None (default): every
            core this process may use when the scores have at least plan.PARALLEL_SCORES =
            2^19 entries (with packed sequences, counting each sequence's own scores only),
            else 1. The backward (and attention_jvp) uses the forward's.
        scheduler: the tiled engine's slices on a Dask cluster instead (the optional extra
            `dask`): a dask.distributed Client, or a scheduler's address such as
            'tcp://host:8786' (a Client is opened for the call). Results are bitwise those
            of a local run. The backward uses the forward's (a Client must still be open).
    Returns:
        out [..., H, N_q, d_v] and an AttentionCache (weights P and lse inside;
        cache.scores recomputes S), or a TiledAttentionCache (out and lse) for 'tiled'.
    """
    paged = None
    if page_table is not None or cache_seqlens is not None:          # gather the pages: packed sequences
        if mask is not None or bias is not None or cu_seqlens_q is not None or seqused_k is not None \
                or topk_indices is not None:
            raise ValueError("a paged KV cache (page_table) takes no mask, bias, cu_seqlens, seqused_k or "
                             "topk_indices: each sequence's keys are its cache_seqlens rows")
        q, k, v = (as_float_array(x, name) for name, x in (("q", q), ("k", k), ("v", v)))
        paged = check_pages(q, k, v, page_table, cache_seqlens)
        sinks, alibi_slopes = check_per_head(q.shape, sinks, alibi_slopes, q.shape[0])   # the caller's q
        q, k, v = pack(q, k, v, paged)
        cu_seqlens_q, cu_seqlens_k = cu_seqlens(paged)
    q, k, v, options = attention_options(                           # the math, checked once
        q, k, v, mask=mask, bias=bias, causal=causal, align=align, window=window, scale=scale,
        softcap=softcap, dropout_mask=dropout_mask, dropout_p=dropout_p,
        fully_masked=fully_masked, check_finite=check_finite, sinks=sinks, alibi_slopes=alibi_slopes,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
        score_mod=score_mod, mask_mod=mask_mod, score_mod_params=score_mod_params,
        score_mod_vjps=score_mod_vjps, topk_indices=topk_indices, topk_length=topk_length, **keep_steps)
    plan = attention_plan(options, q.shape, k.shape, implementation=implementation,   # where and how
                          block_size=block_size, workers=workers, scheduler=scheduler)
    turned = None
    if rope is not None:                                            # q, k turned by their positions
        q, k, turned = rope_qk(q, k, rope, options)
    forward, _ = ENGINES[plan.implementation]
    out, cache = forward(q, k, v, options, plan)
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
            The tiled engine always computes the 'flash' form ('vjp' is accepted there).
        return_stages: also return AttentionStages(dP, dS, D) for per-stage comparison
            (not with the tiled engine, which never forms them).
    Returns:
        AttentionGrads(dq, dk, dv, dbias, stages, dsinks, dalibi_slopes); dq, dk, dv are
        contiguous arrays; dbias, dsinks, dalibi_slopes None without their option.
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
    _, backward = ENGINES[cache.plan.implementation]
    grads = backward(dout, cache, dlse, method=method, return_stages=return_stages)
    if cache.rope is not None:                                      # back to the unturned q and k
        q_turn, k_turn = cache.rope
        grads = grads._replace(dq=rope_backward(grads.dq, q_turn), dk=rope_backward(grads.dk, k_turn))
    if paged is None:
        return grads
    return grads._replace(dq=unpack_rows(grads.dq, paged), dk=scatter_keys(grads.dk, paged.k_cache_shape, paged),
                          dv=scatter_keys(grads.dv, paged.v_cache_shape, paged))
