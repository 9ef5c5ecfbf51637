"""The transforms of a case's inputs as split_case reads them: the tensors a kernel used, from
the tensors the case stores.

    float8      fp8_settings (P's dtype, the accumulator, the descales' block), dequantized: q, k, v
                times their descales, broadcast by descale_of from each of the shapes a descale takes
                (per tensor, head, token, block of tokens, or a block along d: MXFP8's 32, NVFP4's 16)
    MLA         latent_kv: the keys kv [..., 1, N_k, r + p], the values kv[..., :r]; latent_sum: a
                result's dkv = dk + [dv ; 0]
    max logits  per_head: a result's max_logits [..., H, N_q] as the [H] a candidate may give
    top-k       checked_topk: the lists checked; tokens: their size as token lists; token_lists: key
                blocks as their tokens (Case.topk)
    paged       packed_if_paged: a paged KV cache's case as packed sequences (paged.py)

Each raises CaseError naming the key (schema.py).
"""
import numpy as np

from ..paged import NOT_WITH_PAGES, check_pages, cu_seqlens, pack, pack_rows
from ..topk import block_indices, check_lists, listed
from .precision import ACCUMULATOR_BITS, PRECISIONS, round_to
from .schema import DESCALES, FP8, INPUTS, INTERMEDIATE, TOPK, CaseError, integer, word

WIDTH_BLOCKS = (32, 16)     # a descale's blocks along d: MXFP8's, NVFP4's (width_block)


def fp8_settings(arrays, precision):
    """(the precision with P's dtype the case's intermediate_dtype and its products' accumulator
    accumulator_bits wide, descale_block or None). accumulator_bits and descale_block apply to
    any 16- or 8-bit precision (the recipe's forward products; the descales' blocks of tokens),
    intermediate_dtype to float8's."""
    given = [name for name in FP8 if name in arrays and name not in ("accumulator_bits", "descale_block")]
    if given and not precision.forward_only:
        raise CaseError(f"{given[0]} belongs to a float8 precision; this case's is {precision.name!r}")
    if "accumulator_bits" in arrays and not precision.recipe:
        raise CaseError(f"accumulator_bits belongs to a 16- or 8-bit precision, whose recipe sums its products "
                        f"so; this case's is {precision.name!r}")
    block = None
    if "descale_block" in arrays:
        block = integer(arrays, "descale_block")
        if block < 1:
            raise CaseError(f"descale_block must be a positive number of tokens, got {block}")
    if "intermediate_dtype" in arrays:
        try:
            weights = word(INTERMEDIATE)(arrays, "intermediate_dtype")
        except ValueError as exc:
            raise CaseError(str(exc)) from None
        precision = precision._replace(weights=PRECISIONS[weights].storage)
    if "accumulator_bits" in arrays:
        bits = integer(arrays, "accumulator_bits")
        if not ACCUMULATOR_BITS[0] <= bits <= ACCUMULATOR_BITS[1]:
            raise CaseError(f"accumulator_bits must be from {ACCUMULATOR_BITS[0]} to {ACCUMULATOR_BITS[1]} (float32's "
                            f"sign and exponent and bits - 9 of its mantissa; 22 for Hopper's float8 products), "
                            f"got {bits}")
        precision = precision._replace(accumulator=bits)
    return precision, block


def dequantized(tensors, precision, block):
    """(q, k, v (dout) as float64 values, {name: (stored values, descale [..., H, N, 1] or
    [..., H, N, d], its block along d or None)}): the inputs times their descales (descale_of;
    float8's, NVFP4's), the stored values and descales kept for the diagnosis's reruns."""
    given = [name for name in DESCALES if name in tensors]
    if given and not precision.recipe:
        raise CaseError(f"{given[0]} belongs to a 16- or 8-bit precision (float8's, NVFP4's q and k beside a "
                        f"bfloat16 or float16 v); this case's is {precision.name!r}")
    gradient = next((name for name in ("dout", "q_dot", "k_dot", "v_dot") if name in tensors), None)
    if given and gradient:
        raise CaseError(f"a case with {given[0]} is judged forward only (out, lse); it has {gradient}")
    if block is not None and not given:
        raise CaseError("descale_block is given but no descale is")
    inputs = {name: tensors[name].astype(np.float64) for name in INPUTS if name in tensors}
    scales = {}
    for name in given:
        x = inputs[name[0]]
        descale = tensors[name].astype(np.float64)
        bad = ~(np.isfinite(descale) & (descale > 0))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0]) if descale.ndim else ()
            raise CaseError(f"{name} must hold finite values > 0 (a kernel multiplies {name[0]} by them), got "
                            f"{descale[where]:g}" + (f" at {list(where)}" if where else ""))
        along_d = width_block(descale.shape, x.shape)
        descale = descale_of(descale, x.shape, inputs["k"].shape, block, name)
        scales[name[0]] = (x, descale, along_d)
        with np.errstate(over="ignore"):                     # an overflow is refused by split_case
            inputs[name[0]] = x * descale
    return inputs, scales


def width_block(descale_shape, shape):
    """The block along the head width d of a descale of that shape for a tensor of `shape`:
    WIDTH_BLOCKS[0] = 32 for [..., H, N, ceil(d / 32)] (MXFP8's e8m0 scale a 32 elements of a
    row), WIDTH_BLOCKS[1] = 16 for [..., H, N, ceil(d / 16)] (NVFP4's a 16); else None."""
    if len(descale_shape) != len(shape) or tuple(descale_shape[:-1]) != tuple(shape[:-1]):
        return None
    return next((b for b in WIDTH_BLOCKS if descale_shape[-1] == -(-shape[-1] // b)), None)


def descale_of(descale, shape, k_shape, block, name):
    """A descale broadcast to its tensor's [..., H, N, 1] (shape: the tensor's), or with blocks
    along d to [..., H, N, d], by its shape:

        ()                      per tensor (vLLM's k_scale, v_scale)
        k's [..., H_kv]         per batch entry and kv head (FlashAttention-3's descale_q/k/v;
                                query head h uses kv head h // G)
        [..., H] (q)            per batch entry and query head
        [..., H, N]             per token of a head (vLLM's per-token-head scales)
        [..., H, ceil(N / B)]   per block of B = descale_block tokens of a head
        [..., H, N, ceil(d / 32)]  per block of 32 elements of a row (MXFP8: e8m0 scales)
        [..., H, N, ceil(d / 16)]  per block of 16 elements of a row (NVFP4: its e4m3 scales
                                   times the tensor's float32 scale)
    CaseError naming the shapes it takes otherwise."""
    heads, n = shape[:-2], shape[-2]
    if descale.ndim == 0:
        return descale
    along_d = width_block(descale.shape, shape)
    if along_d is not None:
        return np.repeat(descale, along_d, axis=-1)[..., :shape[-1]]
    if len(shape) >= 3 and descale.shape == tuple(k_shape[:-2]):
        groups = shape[-3] // k_shape[-3]
        return np.repeat(descale, groups, axis=-1)[..., None, None]
    if len(shape) >= 3 and descale.shape == tuple(heads):
        return descale[..., None, None]
    if block is not None and descale.shape == tuple(heads) + (-(-n // block),):
        return np.repeat(descale, block, axis=-1)[..., :n, None]
    if descale.shape == tuple(shape[:-1]):
        return descale[..., None]
    blocks = f", [..., H, ceil(N / {block})] = {tuple(heads) + (-(-n // block),)}" if block else ""
    raise CaseError(f"{name} of shape {descale.shape} is none of the shapes a descale of {name[0]} {shape} "
                    f"takes: () per tensor, k's [..., H_kv] = {tuple(k_shape[:-2])} per (batch, kv head), "
                    f"[..., H] = {tuple(heads)} per head, [..., H, N] = {tuple(shape[:-1])} per token{blocks}, "
                    f"[..., H, N, ceil(d / 32)] = {tuple(shape[:-1]) + (-(-shape[-1] // 32),)} per 32 elements "
                    f"of a row (MXFP8), [..., H, N, ceil(d / 16)] = {tuple(shape[:-1]) + (-(-shape[-1] // 16),)} "
                    f"per 16 (NVFP4)")


def latent_kv(arrays, tensors):
    """MLA's absorbed form: with the key kv [..., 1, N_k, r + p] (and head_dim_v = r), the keys
    are kv and the values its first r columns; the candidate's gradient is dkv, the two summed.
    Sets tensors' k and v; returns r, or None for a case without kv."""
    if "kv" not in tensors:
        for name in ("head_dim_v", "dkv"):
            if name in arrays:
                raise CaseError(f"{name} is given but kv is not: {name} belongs to an MLA case, whose keys "
                                f"and values are the one tensor kv")
        return None
    kv = tensors["kv"]
    mixed = [name for name in ("k", "v", "dk", "dv") if name in arrays]
    if mixed:
        raise CaseError(f"a case with kv (MLA: k = kv, v = kv[..., :head_dim_v]) takes no {mixed[0]}; its "
                        f"gradient is dkv, the keys' and the values' summed")
    if "head_dim_v" not in arrays:
        raise CaseError(f"a case with kv {kv.shape} needs head_dim_v, the width of the values (kv's first "
                        f"columns; 512 in DeepSeek-V3)")
    r = integer(arrays, "head_dim_v")
    if not 0 < r <= kv.shape[-1]:
        raise CaseError(f"head_dim_v must be from 1 to kv's width {kv.shape[-1]} (kv {kv.shape}), got {r}")
    tensors["k"], tensors["v"] = kv, kv[..., :r]
    del tensors["kv"]
    return r


def heads_max(case):
    """Whether the case's candidate max_logits is given per head, [H]: not of the shape of its
    rows, q's [..., H, N_q] (the caller's q with a paged cache), which wins where they agree."""
    given = case.candidates.get("max_logits")
    rows = (case.inputs["q"].shape if case.paged is None else case.paged.q_shape)[:-1]
    return given is not None and given.shape != tuple(rows)


def per_head(results, case):
    """results with their max_logits [..., H, N_q] taken to [H], the largest over the batch and
    the rows (TransformerEngine's return_max_logit, QK-clip's statistic), where the case's
    candidate gives it per head (heads_max); else results as they are (None stays None)."""
    if results is None or not heads_max(case) or results.get("max_logits") is None:
        return results
    x = results["max_logits"]
    x = x.reshape((1,) * (2 - x.ndim) + x.shape)               # a single head's [N_q]: H = 1
    return {**results, "max_logits": np.max(np.moveaxis(x, -2, 0).reshape(x.shape[-2], -1), axis=-1,
                                            initial=-np.inf)}


def latent_sum(results, latent, dtype=None):
    """results with dkv = dk + [dv ; 0] added (MLA: kv serves as k and its first `latent`
    columns as v), rounded to `dtype` when given (a 16- or 8-bit precision's output: a kernel
    adds the two in it); results unchanged without latent or without dk."""
    if latent is None or results is None or "dk" not in results:
        return results
    dkv = np.array(results["dk"], copy=True)
    dkv[..., :latent] += results["dv"]
    return {**results, "dkv": dkv if dtype is None else round_to(dkv, dtype)}


def checked_topk(arrays, inputs, options, paged):
    """(indices, topk_length or None, topk_block_size or None) of a sparse top-k case, checked, or
    None: topk_indices [..., H_kv or H, N_q, K] int, each query's keys, or with topk_block_size
    its key blocks (topk_length then counts blocks)."""
    given = [name for name in TOPK if name in arrays]
    if not given:
        return None
    if "topk_indices" not in arrays:
        raise CaseError(f"{given[0]} is given but topk_indices is not")
    if paged is not None:
        raise CaseError("topk_indices choose each query's keys: the case takes no paged KV cache with them")
    q, k = inputs["q"], inputs["k"]
    if q.ndim < 3:
        raise CaseError(f"topk_indices need q with a head axis [..., H, N_q, d_k], got q {q.shape}")
    try:
        indices, length = check_lists(arrays["topk_indices"], arrays.get("topk_length"), q.shape, k.shape,
                                      "topk_indices")
    except (TypeError, ValueError) as exc:
        raise CaseError(str(exc)) from None
    if "topk_block_size" not in arrays:
        return indices, length, None
    size = integer(arrays, "topk_block_size")
    if size < 1:
        raise CaseError(f"topk_block_size must be a positive number of keys, got {size}")
    return indices, length, size


def tokens(lists, n_k):
    """The entries of the token lists that checked_topk's lists make (key blocks: their tokens)."""
    indices, _, size = lists
    return indices.size * (1 if size is None else min(size, n_k))


def token_lists(indices, length, size, n_k):
    """Case.topk of checked_topk's lists: (token indices [..., H_kv or H, N_q, K'], topk_length or
    None, (block indices, block size) or None); key blocks become their tokens (block_indices),
    the blocks past a row's topk_length -1 first."""
    if size is None:
        return indices, length, None
    if length is not None:                                         # it counts blocks
        indices = np.where(listed(indices, length, np.inf), indices, -1)
    return block_indices(indices, size, n_k), None, (indices, size)


def packed_if_paged(arrays, inputs, options):
    """(inputs, options, PagedLayout or None): a paged KV cache's case as packed sequences
    (paged.py): q, dout [B, H, N_q, d] -> [H, B N_q, d], the caches' used rows gathered,
    cu_seqlens among the options. The candidates stay in the caller's layout."""
    if "page_table" not in arrays and "cache_seqlens" not in arrays:
        return inputs, options, None
    if set(NOT_WITH_PAGES) & set(options):
        raise CaseError("a paged KV cache (page_table) takes no mask, bias, cu_seqlens, seqused_k or gate")
    try:
        paged = check_pages(inputs["q"], inputs["k"], inputs["v"], arrays.get("page_table"),
                            arrays.get("cache_seqlens"))
    except ValueError as exc:
        raise CaseError(str(exc)) from None
    q, k, v = pack(inputs["q"], inputs["k"], inputs["v"], paged)
    packed = {**inputs, "q": q, "k": k, "v": v}
    if "dout" in inputs:
        packed["dout"] = pack_rows(inputs["dout"])
    cu_q, cu_k = cu_seqlens(paged)
    return packed, {**options, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, paged
