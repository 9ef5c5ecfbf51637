"""The catalogue of convention mix-ups that diagnosis.py tries on a failing candidate: the ones
that apply to a case (case_mixups), two at once (combined), and the float64 oracle's results
under one (rerun_oracle).

A Mixup is what the candidate did, what the case says, and the rerun's changes: of the options
(attention_forward's keyword arguments), of the heads' grouping (interleaved), of MLA's latent
kv (latent), of the inputs (inputs: float8's dequantized otherwise).

The mix-ups: causal alignment swapped (a bottom-right one also with fully masked rows the mean
of v: MLX's mask="causal"); causal masking missing, or added, or off by one (the diagonal
excluded, one key of the future kept); scale 1, sqrt(d_k) or 1/d_k (the scale applied twice)
instead of 1/sqrt(d_k), or off by a few percent (the scale fitted to the candidate's out:
diagnosis.py); softcap missing, or applied after the bias; mask polarity inverted; the window's
alignment swapped, or each side off by one; grouped-query heads interleaved (query head h with
kv head h % H_kv, not h // G); rotary embeddings in the other layout (interleaved for
half-split or the reverse), missing, over the whole head where they are partial, or with the
queries' positions from 0; MLA's values read from kv's last columns, or its rotary columns'
scores unscaled; a float8 descale dropped, applied twice, or the first head's used for every
head; sparse top-k's indices read one key over, -1 read as the last key, a key listed twice
counted once, the block size doubled or halved.
"""
import math
from typing import NamedTuple

import numpy as np

from ..attention import attention_backward, attention_forward
from ..options import GRADIENTS
from ..score_mods import numpy_mod
from ..topk import block_indices, listed, topk_lists


class Mixup(NamedTuple):
    """One convention mix-up: what the candidate did, what the case says, and the rerun's
    option changes (a value of None removes the option)."""
    did: str
    said: str
    change: dict
    interleaved: bool = False           # query head h meets kv head h % H_kv
    latent: str = None                  # MLA: 'values_last' (v = kv's last r columns) or
                                        # 'rope_unscaled' (q's rotary columns times 1 / scale)
    inputs: dict = None                 # q, k or v replaced (float8: dequantized otherwise)


def rerun_oracle(inputs, options, gradients, mixup, latent=None):
    """The float64 oracle's results for these inputs and the options changed by `mixup` (a
    dict like runs.reference's); with MLA's latent r, also dkv."""
    options = {name: x for name, x in {**options, **mixup.change}.items() if x is not None}
    q, k, v = ({**inputs, **(mixup.inputs or {})}[n].astype(np.float64) for n in "qkv")
    groups = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    if mixup.interleaved:
        k, v = (np.concatenate([x] * groups, axis=-3) for x in (k, v))
        lists = options.get("topk_indices")
        if lists is not None and lists.shape[-3] != q.shape[-3]:     # a kv head's list, for its queries
            options["topk_indices"] = np.repeat(lists, groups, axis=-3)
    unscaled = 1.0
    if mixup.latent == "values_last":
        v = k[..., k.shape[-1] - latent:]
    elif mixup.latent == "rope_unscaled":                # the rotary columns' scores without the scale
        unscaled = options.get("scale") or 1 / math.sqrt(q.shape[-1])
        q = np.concatenate([q[..., :latent], q[..., latent:] / unscaled], axis=-1)
    out, cache = attention_forward(q, k, v, **options)
    result = {"out": out, "lse": cache.lse, "max_logits": cache.max_logits}
    if gradients and "dout" in inputs:
        grads = attention_backward(inputs["dout"].astype(np.float64), cache)
        dk, dv = grads.dk, grads.dv
        if mixup.interleaved:                        # each kv head's copies summed back
            fold = lambda x: x.reshape(x.shape[:-3] + (groups, -1) + x.shape[-2:]).sum(axis=-4)
            dk, dv = fold(dk), fold(dv)
        dq = grads.dq
        if unscaled != 1.0:
            dq = np.concatenate([dq[..., :latent], dq[..., latent:] / unscaled], axis=-1)
        result.update(dq=dq, dk=dk, dv=dv, **{name: getattr(grads, name) for name in GRADIENTS})
        if latent is not None:                       # MLA: kv's gradient, from both of its uses
            dkv = dk.copy()
            at = slice(None, latent) if mixup.latent != "values_last" else slice(dk.shape[-1] - latent, None)
            dkv[..., at] += dv
            result["dkv"] = dkv
    return result


def case_mixups(case):
    """The mix-ups that apply to the case (Mixup), the scale fitted to the candidate aside."""
    o, q, k = case.options, case.inputs["q"], case.inputs["k"]
    n_q, n_k = q.shape[-2], k.shape[-2]
    causal = o.get("causal", False)
    align = causal if isinstance(causal, str) else o.get("align") or "top_left"
    other = {"top_left": "bottom_right", "bottom_right": "top_left"}[align]
    if causal:
        said = f"the case says causal={align!r}"
        yield Mixup(f"causal={other!r}", said, {"causal": other, "align": None})
        if other == "bottom_right" and n_q > n_k and o.get("fully_masked", "zero") != "uniform":
            yield Mixup(f"causal={other!r} with fully masked rows the mean of v (MLX's causal)", said,
                        {"causal": other, "align": None, "fully_masked": "uniform"})
        yield Mixup("no causal mask", said, {"causal": None, "align": o.get("align")})
        for shift, did in ((-1, "the diagonal excluded"), (1, "one key of the future kept")):
            keep = _causal_keep(n_q, n_k, align, shift)
            mask = keep if "mask" not in o else keep & (np.asarray(o["mask"]) != 0)
            yield Mixup(f"causal masking off by one ({did})", said,
                        {"causal": None, "align": align if "window" in o else None, "mask": mask})
    else:
        for alignment in ("top_left", "bottom_right"):
            yield Mixup(f"causal={alignment!r}", "the case has no causal mask",
                        {"causal": alignment, "align": None})
    d_k, scale = q.shape[-1], o.get("scale")
    case_scale = f"the case's is {scale:g}" if scale is not None else "the case's is 1/sqrt(d_k)"
    for value, name in ((1.0, "1"), (math.sqrt(d_k), f"sqrt(d_k) = {math.sqrt(d_k):g}"),
                        (1 / d_k, f"1/d_k = {1 / d_k:g} (the scale applied twice)")):
        if scale is None or not math.isclose(scale, value):
            yield Mixup(f"scale {name}", case_scale, {"scale": value})
    if "softcap" in o:
        yield Mixup("no softcap", f"the case's softcap is {o['softcap']:g}", {"softcap": None})
        if "bias" in o:
            yield Mixup("softcap applied after the bias", "the case applies it before",
                        {"softcap": None, "score_mod": _softcap_last(o["softcap"], o.get("score_mod"))})
    if "mask" in o:
        yield Mixup("the mask inverted (True = ignore)", "the case's mask is True = attend",
                    {"mask": np.asarray(o["mask"]) == 0})
    if "window" in o:
        if not causal:
            yield Mixup(f"the window aligned {other}", f"the case aligns it {align}", {"align": other})
        left, right = o["window"]
        for change, did in (((1, 1), "both sides + 1"), ((-1, -1), "both sides - 1"),
                            ((1, 0), "left + 1"), ((-1, 0), "left - 1"), ((0, 1), "right + 1"),
                            ((0, -1), "right - 1")):
            moved = tuple(w + c if w >= 0 else w for w, c in zip((left, right), change))
            if moved != (left, right) and all(m >= 0 for m, w in zip(moved, (left, right)) if w >= 0):
                yield Mixup(f"window={moved} ({did})", f"the case's window is {(left, right)}",
                            {"window": moved})
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        yield Mixup("interleaved grouped-query heads (query head h with kv head h % H_kv)",
                    "the case groups them (h // G)", {}, interleaved=True)
    if "rope" in o:
        yield from _rope_mixups(o["rope"], o, n_q, n_k, d_k)
    if case.scales:
        yield from _descale_mixups(case.scales)
    if case.topk is not None:
        yield from _topk_mixups(case, q.shape, k.shape)
    if case.latent is not None and case.latent < d_k:
        said = f"the case's values are kv's first head_dim_v = {case.latent} columns"
        yield Mixup(f"the values read from kv's last {case.latent} columns", said, {}, latent="values_last")
        yield Mixup(f"the scores of the rotary columns (past {case.latent}) not scaled",
                    "the case scales every column's", {}, latent="rope_unscaled")


def _softcap_last(softcap, score_mod=None):
    """A score_mod that applies the softcap after the bias and ALiBi (and after the case's own
    score_mod): S = softcap tanh(S / softcap) as the pipeline's last step before the masks."""
    inner = None if score_mod is None else numpy_mod(score_mod)
    def mod(score, *indices):
        s = score if inner is None else inner(score, *indices)
        return softcap * np.tanh(s / softcap)
    return mod


def _causal_keep(n_q, n_k, align, shift):
    """[N_q, N_k] the causal keep-mask of `align` with its diagonal moved by `shift` keys."""
    offset = n_k - n_q if align == "bottom_right" else 0
    return np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + offset + shift


def _descale_mixups(scales):
    """The descales' mix-ups, each a rerun on inputs dequantized otherwise: one scale a tensor
    (the first head's, where the case's vary) for all of them, or for one; each descale dropped,
    applied twice; with blocks along d (MXFP8's, NVFP4's), _block_mixups."""
    varying = {name: (stored, descale) for name, (stored, descale, _) in scales.items() if np.ptp(descale) > 0}
    if varying:
        yield Mixup("the first head's descale of each tensor for every head and batch entry (one scale a "
                    "tensor)", "the case's descales vary", {},
                    inputs={name: stored * np.ravel(descale)[0] for name, (stored, descale) in varying.items()})
    for name, (stored, descale, along_d) in scales.items():
        said = f"the case's values of {name} are its stored values times {name}_descale"
        yield Mixup(f"{name}_descale dropped", said, {}, inputs={name: stored})
        yield Mixup(f"{name}_descale applied twice", said, {}, inputs={name: stored * descale * descale})
        if along_d is not None:
            yield from _block_mixups(name, stored, descale, along_d, said)
        if name in varying and len(varying) > 1:
            first = np.ravel(descale)[0]
            yield Mixup(f"the first head's {name}_descale ({first:.4g}) for every head and batch entry",
                        said, {}, inputs={name: stored * first})


def _block_mixups(name, stored, descale, along_d, said):
    """The mix-ups of a descale [..., N, d] in blocks of `along_d` along d: MXFP8's (32, e8m0:
    powers of two) halved or doubled (the exponent read one off); NVFP4's (16) read in MXFP8's
    blocks of 32; either's one block over, and its [N, d / along_d] scales read as laid out
    [d / along_d, N] (transposed)."""
    d = stored.shape[-1]
    blocks = descale[..., ::along_d]                                 # [..., N, ceil(d / along_d)]
    spread = lambda scales, width=along_d: np.repeat(scales, width, axis=-1)[..., :d]
    if along_d == 32:
        for factor, how, bias in ((0.5, "halved", 128), (2.0, "doubled", 126)):
            yield Mixup(f"{name}_descale {how} (an exponent one off: e8m0's bias 127 read as {bias})", said, {},
                        inputs={name: stored * descale * factor})
    elif d > along_d:                                                # scale j on elements 32 j to 32 j + 31
        yield Mixup(f"{name}_descale's blocks of 16 read as blocks of 32 (MXFP8's)", said, {},
                    inputs={name: stored * spread(blocks, 32)})
    if d > along_d:                                                  # block b's scale on block b + 1
        yield Mixup(f"{name}_descale's blocks one over along d (block b's scale on block b + 1)", said, {},
                    inputs={name: stored * spread(np.roll(blocks, 1, axis=-1))})
        if stored.shape[-2] > 1:
            read = np.swapaxes(blocks, -1, -2).reshape(blocks.shape)   # its bytes in the other order
            yield Mixup(f"{name}_descale's [N, d / {along_d}] scales read transposed (as laid out "
                        f"[d / {along_d}, N])", said, {}, inputs={name: stored * spread(read)})


def _rope_mixups(rope, o, n_q, n_k, d_k):
    """The rotary embeddings' mix-ups: the other layout (the one peers report most), no rope,
    the rotary width the whole head's, the queries at the first N_q keys' positions (top-left,
    from 0 without an offset) where they are not already."""
    layout = rope.get("layout", "half")
    other = {"half": "interleaved", "interleaved": "half"}[layout]
    names = {"half": "half-split pairs (GPT-NeoX, rotate_half)", "interleaved": "interleaved pairs (GPT-J)"}
    changed = lambda **change: {"rope": {**rope, **change}}
    yield Mixup(f"rope_layout={other!r}, {names[other]}", f"the case says rope_layout={layout!r}",
                changed(layout=other))
    yield Mixup("no rotary embedding", f"the case turns q and k (rope_layout={layout!r})", {"rope": None})
    if rope.get("rotary_dim") not in (None, d_k):
        yield Mixup(f"rope_rotary_dim={d_k} (the whole head)", f"the case's is {rope['rotary_dim']}",
                    changed(rotary_dim=None))
    keys = np.asarray(rope.get("positions_k", np.arange(n_k)))
    first, given = keys[:n_q], rope.get("positions_q")
    now = np.arange(n_k - n_q, n_k) if given is None else given
    if n_q < n_k and o.get("cu_seqlens_q") is None and not np.array_equal(first, now):
        yield Mixup("the queries' rope positions from 0 (top-left: the first keys' positions)",
                    "the case's queries have the last keys' positions" if given is None else
                    "the case gives rope_positions_q", changed(positions_q=first))


def _topk_mixups(case, q_shape, k_shape):
    """Sparse top-k's mix-ups: each index read one key over, -1 read as the last key (Python's and
    torch's negative indexing), a key listed twice counted once; with key blocks, the block size
    twice or half the case's."""
    indices, length, blocks = case.topk
    said = "the case's queries attend to the keys topk_indices list"
    valid = indices >= 0
    yield Mixup("the indices read one key over (index + 1)", said, {"topk_indices": np.where(valid, indices + 1, -1)})
    if (indices == -1).any():
        yield Mixup("-1 read as the last key (negative indexing)", said,
                    {"topk_indices": np.where(indices == -1, k_shape[-2] - 1, indices)})
    if topk_lists(indices, length, q_shape, k_shape).repeats:          # some row lists a key more than once
        yield Mixup("a key listed twice counted once", said,
                    {"topk_indices": _once(indices, length, k_shape[-2]), "topk_length": None})
    if blocks is not None:
        chosen, size = blocks
        for other in (2 * size, size // 2):
            if other >= 1 and other != size:
                yield Mixup(f"topk_block_size={other}", f"the case's is {size}",
                            {"topk_indices": block_indices(chosen, other, k_shape[-2])})


def _once(indices, length, n_k):
    """The lists [..., N_q, K] (and topk_length, or None) with each row's keys listed once: sorted,
    -1 for each repeat and for each entry that names no key (listed)."""
    ordered = np.sort(np.where(listed(indices, length, n_k), indices, -1), axis=-1)
    again = np.zeros(ordered.shape, bool)
    again[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    return np.where(again, -1, ordered)


def combined(first, second):
    """The two mix-ups at once, or None where they change one option (or both regroup heads,
    or both change MLA's inputs, or the same input)."""
    if set(first.change) & set(second.change) or (first.interleaved and second.interleaved) \
            or (first.latent and second.latent) or set(first.inputs or {}) & set(second.inputs or {}):
        return None
    return Mixup(f"{first.did} and {second.did}", f"{first.said}; {second.said}",
                 {**first.change, **second.change}, first.interleaved or second.interleaved,
                 first.latent or second.latent, {**(first.inputs or {}), **(second.inputs or {})} or None)
