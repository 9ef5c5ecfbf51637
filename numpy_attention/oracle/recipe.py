"""The recipe: what an attention kernel computing in a 16- or 8-bit precision T does, step by
step (precision.py: the precisions; which baseline each one gets).

T is the compute dtype; every matrix product is accumulated in float32 and its result
rounded to T, every element-wise step computed in float32 and rounded to T:

    forward   k' = round(k * scale)            S = round(q k'^T)     (MLX's: q' = round(round(scale) q))
              S = round(round(tanh(round(S / softcap))) * softcap)          (softcap)
              S = round(S + bias);  S = -inf where not kept
              P = round(softmax(S)),  lse = logsumexp(S) in float32
              P~ = P * dropout_mask (float8: rounded to float8),  v' = round(v / (1 - p))
              out = round(P~ v')
    backward  (the flash backward's D = rowsum(dout * out) from the recipe's out, or the kernel's)
              dv' = round(P~^T dout),  dv = round(dv' / (1 - p)),  dP = round(dout v'^T) * mask
              dS = round(P * (dP - rowsum(P * dP)))  (0 where masked),  dbias = round(sum of dS)
                   (MLX's: dS = round(round(P dP) - round(P round(rowsum(round(P dP))))))
              softcap: dS = round(round(round(dS * softcap) * (1 - t^2)) / softcap)
              dq = round(dS k'),  dk = round(round(dS^T q) * scale)
              dslope = round(-sum of dS |i + N_k - N_q - j|), each product rounded (eager)
    (ALiBi's distances rounded to T where the scale is on S, as torch's int * bfloat16 does:
    beyond 256 in bfloat16, 2048 in float16)

Grouped-query heads: each query head's dk, dv rounded to T (k and v repeated for each query
head, as torch's kernels, MLX's and FlashAttention's dk_expanded do), then their sum over
the group: in float32, rounded again (eager), or head by head in T (flash). Every product by
rows (S, out, dP, dq) is taken TILE_ROWS query rows at a time, and every float32 sum over
rows (dk, dv, dbias) adds up such tiles' products in order. On a large case the recipe runs
on blocks of query rows (row_blocks.py), a multiple of TILE_ROWS: the same results bitwise.

Float8's accumulator (the case's accumulator_bits, Precision.accumulator): Hopper's tensor
cores sum float8 products in about 22 bits, not float32's 32. With bits < 32 the forward's two
products, S = q k'^T and out = P~ v', add ACCUMULATE_STEP products at a time to an
accumulator that keeps float32's sign and exponent and bits - 9 bits of mantissa, truncated
(toward zero) after each step:
    acc = trunc_bits(acc + sum_{t in step} x_t y_t)     (the step's sum in float32: its
                                                          products of 8-bit values are exact)
"""
from functools import partial
from typing import NamedTuple

import numpy as np

from .._layout import grouped_matmul, grouped_sum_matmul, with_head_axis
from .. import scores
from ..options import GRADIENTS
from ..score_grads import ScoreGrads
from ..scores import keep_mask
from ..softmax_row import masked_row_weight, row_weights, with_sink
from .row_blocks import block_of, row_slices
from .precision import round_to

TILE_ROWS, TILE_COLS = 32, 512
ACCUMULATE_STEP = 32          # products it adds at once (the k of a Hopper MMA on 8-bit inputs)


def recipe_attention(q, k, v, options, precision, dout=None, backward="eager", reorder=True,
                     block_rows=None, saved_out=None, mlx=False, scores="rounded"):
    """The recipe of the module docstring: out, lse (and dq, dk, dv, dbias with dout).

    q, k, v (and dout): float32 arrays holding values of the compute dtype (float8 inputs
    already dequantized and rounded to it); options: an AttentionOptions record whose scale
    is the one the kernel applies. backward: 'eager' (the forward's ops differentiated one by
    one) or 'flash' (the tiled flash backward). reorder: the scale and the dropout's
    1 / (1 - p) applied to k and v (FlashAttention's reorder_ops), else to S and P.
    block_rows: query rows per block (row_blocks.py; a multiple of TILE_ROWS), None: all of them.
    saved_out: the out, of q's shape but d_v, that the flash backward reads for D = rowsum(dout
    * out) (and a sink's gradient): a kernel's own, as FlashAttention's backward reads the
    forward's O; None: the recipe's. D's rounding then shifts dq, dk as it does the kernel's
    (decoding's one query row: one D per head, and dS = P (dP - D) nearly cancels).
    mlx: MLX's order (its CPU kernel): the scale, rounded to T, applied to q,
    S = round(round(round(scale) q) k^T), then dq = round(dq' round(scale)) from the gradient
    dq' of the scaled q; and the softmax's
    backward op by op, dS = round(round(P dP) - round(P round(rowsum(round(P dP))))) (eager).
    Grouped-query heads: each query head's dk, dv is rounded to T, then the group's sum, as a
    kernel that repeats k and v for each query head does (torch's kernels and MLX's;
    FlashAttention's dk_expanded): in float32 and rounded (eager), or added head by head in
    T (flash: torch's CPU flash kernel accumulates a group's heads in its T output).
    scores: how the score pipeline rounds: 'rounded' (each step to T, as above); 'float32'
    (from the product on, the scale, softcap and the sums with the bias and ALiBi's terms,
    those in T, not rounded; P still is), as flex_attention's eager kernel computes them;
    'fused' (the same in float32, then S rounded to T once: a kernel that fuses the scale and
    the bias into its product's epilogue, as ONNX Runtime's Attention does in float16).
    Blocks change no result: every product and every sum over rows goes a tile of TILE_ROWS
    rows at a time, in the same order for any block size.
    Results are float32 arrays holding values of the output dtype (lse: float32).
    """
    return recipe_backwards(q, k, v, options, precision, dout, [(backward, saved_out)], reorder=reorder,
                            block_rows=block_rows, mlx=mlx, scores=scores)[0]


def recipe_backwards(q, k, v, options, precision, dout=None, backwards=(("eager", None),), reorder=True,
                     block_rows=None, mlx=False, scores="rounded"):
    """One forward of the recipe and several backwards from it: a result dict for each of
    `backwards`, bitwise recipe_attention's with that backward (out and lse are the same
    arrays in every dict, computed once).

    backwards: (backward, saved_out) pairs, recipe_attention's arguments: 'eager' or 'flash',
    and the out the flash backward reads for D (None: the recipe's); backward None: the
    forward only (out, lse), as is every result without dout. The other arguments are
    recipe_attention's. On each block of rows the forward runs once, then each backward on it.
    """
    T = precision.compute
    rnd = partial(round_to, dtype=T)                                             # round to T
    again = partial(recipe_backwards, precision=precision, dout=dout, backwards=backwards, reorder=reorder,
                    block_rows=block_rows, mlx=mlx, scores=scores)
    if mlx and options.scale != 1.0:                                             # S = (round(scale) q) k^T
        scale = rnd(np.float32(options.scale))
        results = again(rnd(q * scale), k, v, options._replace(scale=1.0))
        return [{**result, "dq": rnd(result["dq"] * scale)} if "dq" in result else result for result in results]
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:                              # k, v for each query head
        h_kv, g = k.shape[-3], q.shape[-3] // k.shape[-3]
        results = again(q, np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3), options)
        for (backward, _), result in zip(backwards, results):
            for name in ("dk", "dv"):                                            # the group's sum, rounded
                if name in result:
                    x = result[name]
                    heads = x.reshape(x.shape[:-3] + (h_kv, g) + x.shape[-2:])
                    if backward == "flash":                                      # added head by head in T
                        total = heads[..., 0, :, :]
                        for h in range(1, g):
                            total = rnd(total + heads[..., h, :, :])
                    else:                                                        # in float32, rounded once
                        total = rnd(np.sum(heads, axis=-3))
                    result[name] = total
        return results
    o = options
    q3, k3, v3 = (with_head_axis(x) for x in (q, k, v))
    score_shape = q3.shape[:-1] + k3.shape[-2:-1]                              # [..., H, N_q, N_k]
    inv_keep = np.float32(1 / (1 - o.dropout_p))
    used = _Used(k=rnd(k3 * np.float32(o.scale)) if reorder else k3,             # S = q (scale k)^T
                 v=rnd(v3 * inv_keep) if reorder else v3)                        # out = P~ (v / (1 - p))
    out = np.empty(q3.shape[:-1] + v3.shape[-1:], np.float32)
    lse = np.empty(q3.shape[:-1], np.float32)
    max_logits = np.empty(q3.shape[:-1], np.float32)
    dout3 = None if dout is None else rnd(with_head_axis(dout))
    runs = [None if dout3 is None or backward is None else _backward_run(rnd, backward, saved, q3, k3, v3, o,
                                                                         score_shape, mlx)
            for backward, saved in backwards]
    flash = any(run is not None and run["backward"] == "flash" for run in runs)
    for rows in row_slices(score_shape[-2], block_rows):
        index = (Ellipsis, rows, slice(None))
        f = _forward_rows(rnd, q3[..., rows, :], k3, v3, used, o, precision, score_shape, index,
                          reorder, scores)
        out[..., rows, :], lse[..., rows], max_logits[..., rows] = f.out, f.lse, f.max_logits
        stages = _flash_stages(dout3[..., rows, :], o, f) if flash else None   # the flash backwards' S, P, dP
        for run in runs:
            if run is not None:
                _backward_rows(rnd, run, dout3[..., rows, :], o, f, rows, stages)
    result = {"out": out.reshape(q.shape[:-1] + v.shape[-1:]), "lse": lse.reshape(q.shape[:-1]),
              "max_logits": max_logits.reshape(q.shape[:-1])}
    shapes = (q.shape, k.shape, v.shape)
    return [dict(result) if run is None else {**result, **_gradients(rnd, run, o, reorder, *shapes)} for run in runs]


def _backward_run(rnd, backward, saved_out, q3, k3, v3, o, score_shape, mlx):
    """A backward's state over the blocks of rows (_backward_rows continues it): its step
    (_eager_rows or _flash_rows), the out it reads for D (rounded; None: the forward's), dq by
    rows and the float32 sums over rows (dk, dv; the parameters' gradients, in a ScoreGrads)."""
    return {"backward": backward,
            "step": _flash_rows if backward == "flash" else partial(_eager_rows, mlx=mlx),
            "saved": None if saved_out is None else rnd(with_head_axis(saved_out)),
            "dq": np.empty(q3.shape, np.float32),
            "sums": {"dk": np.zeros(k3.shape, np.float32), "dv": np.zeros(v3.shape, np.float32)},
            "params": ScoreGrads(o, score_shape, np.float32)}


def _backward_rows(rnd, run, dout, o, f, rows, stages):
    """The backward of `run` (_backward_run) on the block `rows` of the forward f (_Forward),
    dout its rows [..., H, b, d_v]: its dq rows written, its sums continued. stages: the
    block's _flash_stages, which every flash backward shares (they differ in D alone)."""
    if run["saved"] is not None:                                                 # D from the kernel's out
        f = f._replace(out=run["saved"][..., rows, :])
    step = partial(run["step"], stages=stages) if run["backward"] == "flash" else run["step"]
    run["dq"][..., rows, :], ds, run["sums"] = step(rnd, dout, o, f, run["sums"])
    rounded = rnd if run["backward"] == "eager" else None                        # (autograd's products)
    for r in range(0, ds.shape[-2], TILE_ROWS):                                  # dS's sums, a tile at a time
        tile = slice(rows.start + r, rows.start + min(r + TILE_ROWS, ds.shape[-2]))
        run["params"].add(ds[..., r:r + TILE_ROWS, :], (Ellipsis, tile, slice(None)), rounded)
    if f.p_sink.shape[-1]:                                                       # a sink: -sum P_sink D
        run["params"].add_sink(-np.sum(f.p_sink[..., 0] * np.sum(dout * f.out, axis=-1), axis=-1), f.index)


def _gradients(rnd, run, o, reorder, q_shape, k_shape, v_shape):
    """The gradients of a finished backward run (_backward_run): dq, dk, dv (of q's, k's, v's
    shapes) and the options' gradients where the options have them, rounded to T."""
    sums = run["sums"] if run["backward"] == "flash" else _eager_sums_rounded(rnd, run["sums"], o, reorder)
    result = {"dq": run["dq"].reshape(q_shape), "dk": sums["dk"].reshape(k_shape), "dv": sums["dv"].reshape(v_shape)}
    params = ScoreGrads.total([run["params"]], o, run["params"].score_shape, np.float32)
    return {**result, **{name: rnd(g) for name, g in params.items() if name in GRADIENTS and g is not None}}


class _Used(NamedTuple):
    """The k and v of the products, k [..., H_kv, N_k, d_k], v [..., H_kv, N_k, d_v] (float32)."""
    k: np.ndarray           # the k of S = q k^T: round(scale k) (reorder) or k
    v: np.ndarray           # the v of out = P~ v: round(v / (1 - p)) (reorder) or v


class _Forward(NamedTuple):
    """What the recipe's forward computed on a block of rows, for its backwards (float32
    arrays; [..., H, b, N_k] and [..., H, b, d] blocks, k and v whole)."""
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    used: _Used
    keep: object            # the keep-mask, or None
    saved: scores.Saved     # the score steps' (softcap's tanh, rounded)
    drop: object            # the dropout keep-mask as 0 / 1 (1 without dropout)
    p: np.ndarray           # P rounded
    p_drop: np.ndarray      # P~ as multiplied with used.v
    out: np.ndarray
    lse: np.ndarray
    max_logits: np.ndarray  # [..., H, b] each row's largest score
    reorder: bool
    distance: object        # how the forward rounded ALiBi's distances (None: not)
    index: tuple            # the block's index into the scores
    score_shape: tuple      # the whole scores' shape
    p_sink: np.ndarray      # [..., H, b, 1] the sink's weight (float32), or [..., H, b, 0] without


def _forward_rows(rnd, q, k, v, used, o, precision, score_shape, index, reorder, mode):
    """The recipe's forward on the rows of q [..., H, b, d_k] (index: their block of the scores);
    mode: recipe_attention's `scores`, how the score pipeline's steps are rounded (the bias and
    ALiBi terms are rounded to T either way)."""
    srnd = rnd if mode == "rounded" else (lambda x: np.asarray(x, np.float32))
    scale, inv_keep = np.float32(o.scale), np.float32(1 / (1 - o.dropout_p))
    bits = precision.accumulator
    if reorder:                                                                  # S = q (scale k)^T
        s = srnd(_tile_matmul(q, np.swapaxes(used.k, -1, -2), bits))
    else:                                                                        # S = scale (q k^T)
        s = srnd(srnd(_tile_matmul(q, np.swapaxes(k, -1, -2), bits)) * scale)
    keep = keep_mask(o, score_shape, index)
    rounding = scores.Rounding(step=srnd, term=rnd, distance=None if reorder else rnd)  # torch: distances in T
    s, saved = scores.forward(s, o, score_shape, index, keep, rounding)          # 2-4. (scores.py), rounded
    if mode == "fused":                                                          # S rounded once
        s = rnd(s)
    p32, lse = (x.astype(np.float32) for x in row_weights(                       # a sink: one more logit
        with_sink(s, o, score_shape, index), masked_row_weight(o.fully_masked, s.shape[-1])))
    p, p_sink = rnd(p32[..., :s.shape[-1]]), p32[..., s.shape[-1]:]
    drop = _drop(block_of(o.dropout_scale, score_shape, index))
    if reorder:                                                                  # P~ = P mask, v' = v / (1 - p)
        p_drop = p * drop
    else:                                                                        # P~ = P mask / (1 - p)
        p_drop = rnd(rnd(p * drop) * inv_keep)
    p_drop = round_to(p_drop, precision.weights)
    return _Forward(q=q, k=k, v=v, used=used, keep=keep, saved=saved, drop=drop, p=p, p_drop=p_drop,
                    out=rnd(_tile_matmul(p_drop, used.v, bits)), lse=lse, reorder=reorder,
                    max_logits=scores.row_max(s, o, score_shape, index),
                    distance=rounding.distance, index=index, score_shape=score_shape, p_sink=p_sink)


def _tile_matmul(x, y, bits=32):
    """grouped_matmul(x, y), x [..., H, b, a] @ y [..., H_kv, a, c] -> [..., H, b, c], in tiles
    of TILE_ROWS rows of x: each row's product is one BLAS call of the same shapes whether the
    recipe holds all of the rows or a block of them (a multiple of TILE_ROWS rows), so blocks
    give the same bits on any processor (BLAS's kernels may sum a product of other shapes in
    another order). bits < 32: accumulated in that many bits (_narrow_matmul)."""
    out = np.empty(x.shape[:-1] + y.shape[-1:], np.result_type(x, y))
    for r in range(0, x.shape[-2], TILE_ROWS):
        rows = (Ellipsis, slice(r, r + TILE_ROWS), slice(None))
        if bits == 32:
            grouped_matmul(x[rows], y, out=out[rows])
        else:
            out[rows] = _narrow_matmul(x[rows], y, bits)
    return out


def _narrow_matmul(x, y, bits):
    """grouped_matmul(x, y) of float32 arrays with its sums over a in an accumulator of `bits`
    bits (module docstring): ACCUMULATE_STEP products at a time, then the low 32 - bits bits of
    the float32 accumulator cleared (a truncation toward zero; +-inf and NaN stay)."""
    low = np.uint32((1 << (32 - bits)) - 1)
    acc = np.zeros(x.shape[:-1] + y.shape[-1:], np.float32)
    for t in range(0, x.shape[-1], ACCUMULATE_STEP):
        acc += grouped_matmul(x[..., t:t + ACCUMULATE_STEP], y[..., t:t + ACCUMULATE_STEP, :])
        bits_of = acc.view(np.uint32)
        bits_of &= ~low
    return acc


def _eager_rows(rnd, dout, o, f, sums, mlx=False):
    """The backward of the forward's ops on a block of rows, each rounded (torch's autograd in
    that dtype): (dq, dS for dbias, sums) with the float32 sums of dk and dv over the rows
    continued (rounded once at the end, _eager_sums_rounded)."""
    inv_keep, scale = np.float32(1 / (1 - o.dropout_p)), np.float32(o.scale)
    dv = _tile_sum_matmul(f.p_drop, dout, sums["dv"])
    dp = rnd(_tile_matmul(dout, np.swapaxes(f.used.v, -1, -2)))
    dp = dp * f.drop if f.reorder else rnd(rnd(dp * inv_keep) * f.drop)
    if mlx:                                                                      # MLX's softmax backward
        pdp = rnd(f.p * dp)
        ds = rnd(pdp - rnd(f.p * rnd(np.sum(pdp, axis=-1, keepdims=True))))
    else:
        ds = rnd(f.p * (dp - np.sum(f.p * dp, axis=-1, keepdims=True)))
    ds, ds_bias = scores.backward(ds, o, f.score_shape, f.index, f.saved, f.keep, stage=True,   # 4-2.
                                  rounding=scores.Rounding(step=rnd))
    if f.reorder:
        dq = rnd(_tile_matmul(ds, f.used.k))
    else:
        ds = rnd(ds * scale)
        dq = rnd(_tile_matmul(ds, f.k))
    return dq, ds_bias, {**sums, "dk": _tile_sum_matmul(ds, f.q, sums["dk"]), "dv": dv}


def _tile_sum_matmul(x, y, total):
    """total + grouped_sum_matmul(x, y), x [..., H, b, a], y [..., H, b, c] -> [..., H_kv, a, c]
    (total's shape), summed in float32 a tile of TILE_ROWS rows at a time: the same products
    and the same sum whether the recipe holds all of the rows or a block of them."""
    for r in range(0, x.shape[-2], TILE_ROWS):
        rows = (Ellipsis, slice(r, r + TILE_ROWS), slice(None))
        total = total + grouped_sum_matmul(x[rows], y[rows], total.shape[-3])
    return total


def _eager_sums_rounded(rnd, sums, o, reorder):
    """dk, dv of the eager backward from their float32 sums: dv = round(dv) (reorder: then
    round(dv / (1 - p))), dk = round(round(dk) * scale) (reorder; else round(dk))."""
    dv, dk = rnd(sums["dv"]), rnd(sums["dk"])
    if reorder:
        dv, dk = rnd(dv * np.float32(1 / (1 - o.dropout_p))), rnd(dk * np.float32(o.scale))
    return {**sums, "dk": dk, "dv": dv}


def _flash_stages(dout, o, f):
    """FlashAttention's backward's recomputation on a block of rows (f its forward, dout
    [..., H, b, d_v]), in float32 from float32 scores: (P = exp(S - lse), dP = dout v^T
    (dropped, / (1 - p)), the score steps' Saved)."""
    inv_keep = np.float32(1 / (1 - o.dropout_p))
    s = _tile_matmul(f.q, np.swapaxes(f.k, -1, -2)) * np.float32(o.scale)     # 1-4. in float32, the terms
    s, saved32 = scores.forward(s, o, f.score_shape, f.index, f.keep, scores.Rounding(   # in float32
        term=lambda x: x.astype(np.float32), distance=f.distance))
    with np.errstate(invalid="ignore"):                                          # a row of no key: its fill
        p32 = np.where(np.isneginf(f.lse)[..., None], np.float32(masked_row_weight(o.fully_masked, s.shape[-1])),
                       np.exp(s - f.lse[..., None]))
    return p32, _tile_matmul(dout, np.swapaxes(f.v, -1, -2)) * f.drop * inv_keep, saved32


def _flash_rows(rnd, dout, o, f, sums, stages):
    """FlashAttention's backward on a block of rows, from its recomputed P, dP (stages:
    _flash_stages): dS = P (dP - D) in float32, P and dS rounded to T for the products, dq, dk,
    dv accumulated in T over tiles (TILE_ROWS query rows for dk, dv, continuing `sums` over the
    block's tiles; TILE_COLS keys for dq), as torch's CPU kernel does. Returns (dq, dS for
    dbias, sums)."""
    q, k = f.q, f.k
    h_kv = k.shape[-3]
    inv_keep, scale = np.float32(1 / (1 - o.dropout_p)), np.float32(o.scale)
    p32, dp, saved32 = stages
    ds = p32 * (dp - np.sum(dout * f.out, axis=-1, keepdims=True))
    ds, ds_bias = scores.backward(ds, o, f.score_shape, f.index, saved32, f.keep, stage=True)   # 4-2.
    p_T, ds_T = rnd(p32 * f.drop), rnd(ds)
    dq, dk, dv = np.zeros(q.shape, np.float32), sums["dk"], sums["dv"]
    for r in range(0, q.shape[-2], TILE_ROWS):
        rows = (Ellipsis, slice(r, r + TILE_ROWS), slice(None))
        dv = rnd(dv + grouped_sum_matmul(p_T[rows], dout[rows], h_kv) * inv_keep)
        dk = rnd(dk + grouped_sum_matmul(ds_T[rows], q[rows], h_kv) * scale)
    for c in range(0, k.shape[-2], TILE_COLS):
        cols = slice(c, c + TILE_COLS)
        dq = rnd(dq + _tile_matmul(ds_T[..., cols], k[..., cols, :]) * scale)
    return dq, ds_bias, {**sums, "dk": dk, "dv": dv}


def _drop(dropout_scale):
    """The dropout keep-mask as 0/1 float32 (1 without dropout) from (a block of) the record's
    dropout_scale."""
    return np.float32(1) if dropout_scale is None else (dropout_scale != 0).astype(np.float32)
