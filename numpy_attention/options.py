"""Attention's options: the one table of them (OPTIONS), and the frozen record of the math that
every engine and crosscheck share, checked once.

    q, k, v, options = attention_options(q, k, v, mask=mask, causal=True, ...)

Each option is one row of OPTIONS: its keyword, default and meaning (attention_forward's
signature and docstring are made from the rows), where it acts in the textbook's steps,
how a .npz case holds it, its gradient and whether that gradient sums per head (and how the
oracle bounds a per-head gradient's terms), whether the tiled engine computes it, its name in
conform, the check of a one-value option, and how to draw a value of it for a random case. The
keyword arguments of attention_forward and attention_options, the gradient records
(caches.AttentionGrads, mla.MlaGrads), attention_jvp's tangents, the case reader's keys and
their docs (oracle/schema.py), the oracle's slices and term magnitudes, conform's options,
gradients and grid draws, and the gradcheck examples (gradcheck_cases.py) take their lists from
here. `attention_options` runs every check (option_checks.py), so an engine only computes;
where and how (the engine, its tiles, threads, a cluster) is the plan's (engines/plan.py).
Shape legend as in textbook.py:
    ...   leading batch axes;  H query heads,  H_kv key/value heads (H_kv divides H)
    N_q, N_k lengths;  d_k, d_v widths;  the scores S are [..., H, N_q, N_k]

The score steps that these options describe are scores.py's, the row's softmax_row.py's;
`masked` says whether step 4 removes any score.
"""
import inspect
import math
from typing import Callable, NamedTuple, Optional

import numpy as np

from ._checks import (as_float_array, as_mask, broadcast_shape_to, read_only_copy, require_bool,
                      require_positive_real, require_probability, result_dtype)
from .positions import check_window, resolve_alignment
from .option_checks import (check_fully_masked, check_mods, check_packed_sequences, check_qkv,
                            check_head_vector, check_topk, check_vjps, dropout_scale, require_finite)
from .scores import check_keep_steps

class Option(NamedTuple):
    """One row of OPTIONS: one keyword of attention_forward."""
    name: str                       # the keyword (and the .npz key of a case that holds it)
    default: object
    acts: str                       # where it acts in the textbook's steps: 'score' (1-3), 'keep' (4),
                                    # 'row' (5), 'output' (6-7); 'input': a check of the inputs
    doc: str                        # its meaning, in attention_forward's docstring
    case: Optional[str] = None      # how a .npz case holds it (oracle/schema.py decodes each kind):
                                    # 'array' as given, 'float' a float array rounded to the candidate's
                                    # dtype, or a 0-d or small array of kind 'mask', 'causal', 'align',
                                    # 'pair' (ints (left, right)), 'positive', 'probability', 'policy';
                                    # None: no key
    shape: Optional[str] = None     # an array's: 'scores' broadcastable to [..., H, N_q, N_k], 'heads' an
                                    # [H] (or [..., H], [B, H]) vector (its gradient sums each head's rows),
                                    # 'output' broadcastable to out [..., H, N_q, d_v]
    gradient: Optional[str] = None  # its gradient's name in AttentionGrads and in a case
    tiled: bool = True              # the tiled engine computes it (engines/plan.py refuses it otherwise)
    neginf: bool = False            # a float array that may hold -inf (a masked score, no sink); NaN and
                                    # +inf never (check_finite, and a case's inputs)
    batched: bool = False           # a 'heads' vector may also be [..., H] (q's leading axes) or, with
                                    # packed sequences, [B, H] (check_head_vector); its gradient likewise
    conform: Optional[str] = None   # its name among conform's options (conformance/supports.py), whose
                                    # cases draw it (conformance/grid.py); in that order
    every_score: bool = False       # its step reads every score of a row, a masked one too (a saved
                                    # stage kept whole; one more logit in every row): no column skipped
    policies: Optional[tuple] = None  # the fully_masked policies it takes, where not all of them
    term: Optional[str] = None      # a per-head vector's: how the oracle bounds the terms of its gradient
                                    # (oracle/magnitudes.py, TERMS): 'distance' dS times a distance
                                    # below N_q + N_k; 'weight' its logit's weight times D
    check: Optional[Callable] = None  # check(value, name) -> the value checked, for a value one check
                                    # decides (attention_options and a case's reader call it)
    draw: Optional[Callable] = None  # draw(rng, sizes) -> {keyword: value}: a random value for a case of
                                    # these Sizes (conform's grid draws its options' so, the gradcheck
                                    # examples theirs); float arrays in float64, numbers float32's


class Sizes(NamedTuple):
    """A drawn case's sizes, for the options' draws."""
    batch: int
    heads: int                      # H, the query heads
    n_q: int
    n_k: int
    d: int
    q_shape: tuple                  # q's ([B, H, N_q, d], or packed sequences' [H, total_q, d])


def _draw_window(rng, sizes):
    """(left, right): each side up to about a quarter of N_k, or -1 (unbounded), not both."""
    side = lambda: int(rng.integers(0, max(1, sizes.n_k // 4) + 1)) if rng.random() < 0.75 else -1
    left, right = side(), side()
    return {"window": (left, right if (left, right) != (-1, -1) else 0)}


def _draw_mask(rng, sizes):
    """[B, 1, N_q, N_k], some 30 to 100% of the keys kept, and one fully masked row a sequence."""
    b, n_q = sizes.batch, sizes.n_q
    keep = rng.random((b, 1, n_q, sizes.n_k)) < rng.uniform(0.3, 1.0)
    if n_q > 1:
        keep[np.arange(b), 0, rng.integers(0, n_q, b)] = False
    return {"mask": keep}


def _draw_dropout(rng, sizes):
    p = float(np.float32(rng.uniform(0.1, 0.3)))
    return {"dropout_p": p, "dropout_mask": rng.random((sizes.batch, sizes.heads, sizes.n_q, sizes.n_k)) >= p}


OPTIONS = (
    Option("causal", False, "keep", "False, True, 'top_left' (torch is_causal) or 'bottom_right' "
           "(FlashAttention).", case="causal"),
    Option("align", None, "keep", "diagonal alignment for causal=True and for window: 'top_left' "
           "(default) or 'bottom_right'.", case="align"),
    Option("scale", None, "score", "multiplies q k^T; default 1/sqrt(d_k); 1.0 for the unscaled "
           "experiment.", case="positive", conform="scale", check=require_positive_real,
           draw=lambda rng, n: {"scale": float(np.float32(rng.uniform(0.3, 2.0) / math.sqrt(n.d)))}),
    Option("window", None, "keep", "(left, right) sliding window around the diagonal, -1 = unbounded "
           "(FlashAttention's window_size; FlashAttention aligns it bottom-right, so pass "
           "align='bottom_right' to match it when N_q != N_k).", case="pair", conform="window", check=check_window,
           draw=_draw_window),
    Option("softcap", None, "score", "S <- softcap * tanh(S / softcap), after scaling and before bias and "
           "masks.", case="positive", tiled=False, conform="softcap", every_score=True, check=require_positive_real,
           draw=lambda rng, n: {"softcap": float(np.float32(rng.uniform(2.0, 10.0)))}),
    Option("bias", None, "score", "additive float scores broadcastable to [..., H, N_q, N_k]; gets a "
           "gradient, grads.dbias. An additive mask (0 / -inf) belongs here.", case="float", shape="scores",
           gradient="dbias", neginf=True, conform="bias",
           draw=lambda rng, n: {"bias": rng.standard_normal((n.heads, n.n_q, n.n_k))}),
    Option("mask", None, "keep", "keep-mask broadcastable to [..., H, N_q, N_k]; True/nonzero = attend.",
           case="mask", shape="scores", conform="mask", draw=_draw_mask),
    Option("dropout_mask", None, "output", "explicit keep-mask broadcastable to the weights: "
           "P <- P * dropout_mask / (1 - dropout_p). No RNG inside.", case="array", shape="scores",
           tiled=False, conform="dropout", draw=_draw_dropout),
    Option("dropout_p", 0.0, "output", "the drop probability of dropout_mask.", case="probability",
           check=require_probability),
    Option("fully_masked", "zero", "row", "a row with every score -inf gives 'zero' output 0 and gradient 0 "
           "(torch 2.5+ SDPA, FlashAttention, ONNX); 'uniform' the mean of v's rows (the seed's -1e9 "
           "fill, JAX), gradient 0 to q, k; 'nan' NaN output (the SDPA formula written out). The tiled "
           "engine has 'zero' alone.", case="policy"),
    Option("check_finite", False, "input", "raise ValueError on NaN/Inf in q, k, v and the float options "
           "(a -inf in bias and sinks masks a score, or is no sink) instead of letting them poison the rows "
           "they touch."),
    Option("alibi_slopes", None, "score", "[H] or [..., H]: ALiBi, S <- S - slope_h * |i + N_k - N_q - j|, "
           "the distance from the bottom-right-aligned diagonal (FlashAttention's convention; for "
           "N_q == N_k it is |i - j|, torch's and the paper's; a top-left form is bias = -slope * "
           "|i - j|); gets a gradient, grads.dalibi_slopes. With packed sequences or a paged KV "
           "cache: [H], or [B, H] with one row per sequence (as FlashAttention's varlen and kvcache "
           "functions take them), whose gradient's row b sums over sequence b's rows only.",
           case="float", shape="heads", gradient="dalibi_slopes", batched=True, conform="alibi", term="distance",
           draw=lambda rng, n: {"alibi_slopes": 2.0 ** (-8 * np.arange(1, n.heads + 1) / n.heads)}),   # FA's slopes
    Option("sinks", None, "row", "[H]: one more logit per query head in every row's softmax, with no "
           "value (gpt-oss's attention sink): lse = log(sum_j exp S_ij + exp sink_h), and the sink's "
           "weight exp(sink_h - lse) multiplies nothing. A row whose keys are all masked gives out 0 "
           "and lse = sink (fully_masked must be 'zero'); the gradient is grads.dsinks.",
           case="float", shape="heads", gradient="dsinks", neginf=True, conform="sinks", every_score=True,
           term="weight",
           policies=("zero",),
           draw=lambda rng, n: {"sinks": rng.standard_normal(n.heads)}),
    Option("gate", None, "output", "[..., H, N_q, 1] (headwise) or [..., H, N_q, d_v] (elementwise), "
           "broadcastable to out: Qwen3-Next's output gate, out <- (P V) * sigmoid(gate) (gate.py; lse and "
           "cache.out are the attention's, before it); gets a gradient, grads.dgate.", case="float",
           shape="output", gradient="dgate", conform="gate",     # headwise or elementwise
           draw=lambda rng, n: {"gate": 2 * rng.standard_normal(n.q_shape[:-1] + (int(rng.choice([1, n.d])),))}),
    Option("cu_seqlens_q", None, "keep", "[B + 1] int, with cu_seqlens_k: FlashAttention's varlen, B "
           "sequences packed along the length axes, q [H, total_q, d_k], k, v [H_kv, total_k, d]; no "
           "row attends across a sequence boundary, and causal, window and ALiBi align on each "
           "sequence's own lengths (positions.py). A zero-length sequence is allowed.", case="array"),
    Option("cu_seqlens_k", None, "keep", "[B + 1] int: the packed sequences' offsets along N_k.",
           case="array"),
    Option("seqused_k", None, "keep", "[B] int: only the first seqused_k[b] keys of sequence b are used.",
           case="array"),
    Option("score_mod", None, "score", "FlexAttention's score_mod(score, b, h, q_idx, kv_idx) -> score, "
           "applied after bias and ALiBi, before the masks (scores.py): called on NumPy arrays, the "
           "block's scores and its index arrays broadcastable to them (b the batch index, h the query "
           "head, q_idx and kv_idx the row and column). Its derivative in the score comes by complex "
           "step on it (docs/variants.md)."),
    Option("mask_mod", None, "keep", "FlexAttention's mask_mod(b, h, q_idx, kv_idx) -> bool (True = "
           "attend), called on a block's index arrays; a block it removes entirely is skipped."),
    Option("score_mod_params", None, "score", "{name: array}: parameters of score_mod, passed to it as a "
           "sixth argument; their gradients come back in grads.dscore_mod_params. score_mod may index "
           "one (params['rel'][h, q_idx - kv_idx]) or use a 0-d one as a scalar."),
    Option("score_mod_vjps", None, "score", "{name: vjp} for a parameter score_mod uses whole in any "
           "other way: vjp(ds, score, b, h, q_idx, kv_idx, params) -> the gradient of <ds, score_mod> "
           "on a block w.r.t. params[name], params[name]'s shape; checked by complex step along a "
           "random direction before it is trusted (ValueError naming it)."),
    Option("topk_indices", None, "keep", "[..., H_kv or H, N_q, K] int, sparse top-k attention's lists: "
           "each query attends to the keys it lists alone (a list per kv head, for its query heads, or "
           "per query head; -1 or any index outside [0, N_k) pads), a key listed c times with c times "
           "its weight (gathered c times). The sparse engine (the default with them) gathers each "
           "query's listed keys; the others take each block's keep-mask from the lists (topk.py, "
           "never [N_q, N_k] of them) and S + log c: the same results."),
    Option("topk_length", None, "keep", "[..., N_q] int: only each row's first topk_length entries of "
           "topk_indices."),
)
KEYWORDS = tuple(row.name for row in OPTIONS)
GRADIENTS = tuple(row.gradient for row in OPTIONS if row.gradient)           # AttentionGrads' of the options
NEGINF = tuple(row.name for row in OPTIONS if row.neginf)               # may hold -inf
EVERY_SCORE = frozenset(row.name for row in OPTIONS if row.every_score)  # no column skipped where given
HEAD_ROWS = tuple(row for row in OPTIONS if row.shape == "heads")                   # [H], [..., H] vectors
HEAD_GRADIENTS = tuple(row.gradient for row in HEAD_ROWS if row.gradient)


def head_vectors(q_shape, given, sequences=None):
    """{name: array or None} of the per-head vectors (HEAD_ROWS) among `given` ({name: value}),
    each checked against q's shape and its B = `sequences` packed sequences (check_head_vector)."""
    return {row.name: check_head_vector(q_shape, row.name, given.get(row.name), row.batched, sequences)
            for row in HEAD_ROWS}
_DEFAULTS = {row.name: row.default for row in OPTIONS}


class AttentionOptions(NamedTuple):
    scale: float                        # multiplies q k^T
    softcap: Optional[float]            # S <- softcap * tanh(S / softcap), or None
    bias: Optional[np.ndarray]          # additive scores broadcastable to [..., H, N_q, N_k] (read-only copy)
    mask: Optional[np.ndarray]          # bool keep-mask broadcastable to the scores (read-only), True = attend
    causal: bool
    align: str                          # 'top_left' or 'bottom_right': the diagonal of causal and window
    window: Optional[tuple]             # (left, right), -1 = unbounded
    dropout_scale: Optional[np.ndarray]  # dropout_mask / (1 - dropout_p), broadcastable to P (read-only)
    dropout_p: float                    # the drop probability (0 without dropout)
    gate: Optional[np.ndarray]          # the output gate broadcastable to out [..., H, N_q, d_v] (read-only)
    fully_masked: str                   # 'zero', 'uniform' or 'nan'
    sinks: Optional[np.ndarray]         # [H] one extra logit per query head, with no value (read-only)
    alibi_slopes: Optional[np.ndarray]  # [H], [..., H], or [B, H] per packed sequence (read-only)
    cu_seqlens_q: Optional[np.ndarray]  # [B + 1] packed sequences' offsets along N_q (positions.py)
    cu_seqlens_k: Optional[np.ndarray]  # [B + 1] along N_k
    seqused_k: Optional[np.ndarray]     # [B] keys used of each sequence (None: all)
    masked: bool                        # whether any score is set to -inf (step 4)
    keep_steps: tuple = ()              # ((name, value), ...) of scores.KEEP_STEPS given
    score_mod: object = None            # FlexAttention's score_mod(score, b, h, q_idx, kv_idx[, params]), or None
    mask_mod: object = None             # FlexAttention's mask_mod(b, h, q_idx, kv_idx) -> bool, or None
    score_mod_params: Optional[dict] = None   # {name: read-only array}: score_mod's parameters
    score_mod_vjps: Optional[dict] = None     # {name: vjp}: the user's VJPs of parameters used whole
    topk: object = None                 # topk.TopkLists: each query's listed keys (kept, a repeat's log
                                        # multiplicity added), or None
    given: frozenset = frozenset()      # the names of the OPTIONS rows given a value other than the default


def with_options(function):
    """function, taking OPTIONS as **options (attention_forward, attention_options), with a
    __signature__ that names them (after its positional parameters, before its own keywords)
    and the '{options}' line of its docstring replaced by one entry per option."""
    own = inspect.signature(function).parameters.values()
    keyword, rest = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD
    params = ([p for p in own if p.kind not in (keyword, rest)]
              + [inspect.Parameter(row.name, keyword, default=row.default) for row in OPTIONS]
              + [p for p in own if p.kind == keyword]
              + [inspect.Parameter("keep_steps", rest)])
    function.__signature__ = inspect.Signature(params)
    if function.__doc__:                            # (python -OO drops docstrings)
        function.__doc__ = function.__doc__.replace("{options}", "\n".join(_entry(row) for row in OPTIONS))
    return function


def _entry(row, width=96):
    """A docstring entry 'name: doc', wrapped at `width` with the continuation indented."""
    words, lines, line = row.doc.split(), [], f"        {row.name}:"
    for word in words:
        if len(line) + 1 + len(word) > width:
            lines.append(line)
            line = "            " + word
        else:
            line += " " + word
    return "\n".join(lines + [line])


def option_keywords(given):
    """(values, steps): every row's value, given or its default, as a dict, and the other names
    given (scores.KEEP_STEPS', which check_keep_steps checks, refusing any other name)."""
    steps = {name: value for name, value in given.items() if name not in _DEFAULTS}
    return {**_DEFAULTS, **{name: value for name, value in given.items() if name in _DEFAULTS}}, steps


@with_options
def attention_options(q, k, v, **given):
    """Check attention_forward's options (OPTIONS, and scores.KEEP_STEPS by name); return
    (q, k, v, AttentionOptions).

    q, k, v come back as fresh row-major arrays of the computation's dtype (a cache that keeps
    them then never shares memory with the caller's arrays, and each head's [N, d] matrix has
    unit stride for BLAS whatever the caller's layout: a transposed view, a broadcast stack);
    mask, bias and the dropout scale are read-only copies. Raises ValueError / TypeError
    naming the argument and the shapes.
    """
    q, k, v = check_qkv(q, k, v)
    return options_record(*(x.astype(result_dtype(q, k, v), order="C") for x in (q, k, v)), **given)   # copies


def options_record(q, k, v, **given):
    """attention_options for q, k, v that check_qkv checked and that share the computation's
    dtype: they come back as they are (cast, so copied, only where a float64 bias or complex
    per-head vectors widen it). For a caller that keeps its own arrays (sparse_attention.py's,
    which holds a frozen caller's arrays uncopied)."""
    a, keep_steps = option_keywords(given)
    a.update({row.name: row.check(a[row.name], row.name) for row in OPTIONS       # None: no value, where that
              if row.check and (a[row.name] is not None or row.default is not None)})   # is the default
    causal, align = resolve_alignment(a["causal"], a["align"])
    scale = 1.0 / math.sqrt(q.shape[-1]) if a["scale"] is None else a["scale"]
    fully_masked = a["fully_masked"]
    check_fully_masked(fully_masked, k, v)
    score_shape = q.shape[:-1] + (k.shape[-2],)                  # [..., H, N_q, N_k]
    legend = "the scores [..., H, N_q, N_k]"
    bias = a["bias"]
    if bias is not None:
        bias = as_float_array(bias, "bias")
        broadcast_shape_to(bias, "bias", score_shape, legend)
    gate = a["gate"]
    if gate is not None:
        gate = as_float_array(gate, "gate")
        broadcast_shape_to(gate, "gate", q.shape[:-1] + v.shape[-1:], "the output [..., H, N_q, d_v]",
                           "a gate per head and query row is [..., H, N_q, 1]")
    keep = None if a["mask"] is None else as_mask(a["mask"], "mask", score_shape, legend)
    drop = dropout_scale(a["dropout_mask"], a["dropout_p"], score_shape, legend)
    packed = check_packed_sequences(q, k, a["cu_seqlens_q"], a["cu_seqlens_k"], a["seqused_k"])
    sequences = None if packed[0] is None else packed[0].size - 1
    per_head = head_vectors(q.shape, a, sequences)
    sinks, alibi_slopes = per_head["sinks"], per_head["alibi_slopes"]
    for row in OPTIONS:                                          # (a sink weighs a row with no key)
        if row.policies is not None and a[row.name] is not None and fully_masked not in row.policies:
            raise ValueError(f"{row.name} takes fully_masked in {row.policies}, a row with no key as its doc "
                             f"says: fully_masked={fully_masked!r} does not apply; use {row.policies[0]!r}")
    if require_bool(a["check_finite"], "check_finite"):
        for name, x in {"q": q, "k": k, "v": v, "bias": bias, **per_head, "gate": gate}.items():
            if x is not None:
                require_finite(name, x, allow_neginf=name in NEGINF)
    # a float64 bias widens float32 scores; per-head vectors (often Python lists) and the gate
    # widen only to complex, for complex-step checks: real ones are cast to the scores' dtype
    dtype = result_dtype(q, bias, *(x for x in (sinks, alibi_slopes, gate) if x is not None and x.dtype.kind == "c"))
    q, k, v = (x.astype(dtype, copy=False) for x in (q, k, v))
    sinks, alibi_slopes, gate = (None if x is None else x.astype(dtype) for x in (sinks, alibi_slopes, gate))
    if drop is not None:                                         # keep / (1 - p) in the scores' dtype
        drop = drop.astype(q.real.dtype)
    if packed[0] is not None and fully_masked == "uniform":
        raise ValueError("fully_masked='uniform' would spread a row over every packed sequence's keys; "
                         "with cu_seqlens (or a paged KV cache) use 'zero' or 'nan'")
    score_mod, mask_mod, score_mod_params = check_mods(a["score_mod"], a["mask_mod"], a["score_mod_params"])
    score_mod_vjps = check_vjps(a["score_mod_vjps"], score_mod_params)
    keep_steps = check_keep_steps(keep_steps, KEYWORDS)          # scores.KEEP_STEPS, by name
    topk = check_topk(a["topk_indices"], a["topk_length"], q.shape, k.shape)
    masked = (keep is not None or causal or a["window"] is not None or packed[0] is not None or bool(keep_steps)
              or mask_mod is not None or (bias is not None and bool(np.isneginf(bias.real).any()))
              or topk is not None)
    return q, k, v, AttentionOptions(
        scale=scale, softcap=a["softcap"], bias=read_only_copy(bias), mask=read_only_copy(keep),
        causal=causal, align=align, window=a["window"], dropout_scale=read_only_copy(drop),
        dropout_p=a["dropout_p"], gate=read_only_copy(gate),
        fully_masked=fully_masked, sinks=read_only_copy(sinks), alibi_slopes=read_only_copy(alibi_slopes),
        cu_seqlens_q=read_only_copy(packed[0]), cu_seqlens_k=read_only_copy(packed[1]),
        seqused_k=read_only_copy(packed[2]),
        masked=masked, keep_steps=keep_steps, score_mod=score_mod, mask_mod=mask_mod,
        score_mod_params=score_mod_params, score_mod_vjps=score_mod_vjps, topk=topk,
        given=frozenset(name for name, value in a.items() if not _is_default(value, _DEFAULTS[name])))


def _is_default(value, default):
    """Whether a keyword's value is its row's default (None, or a scalar setting's)."""
    return value is None if default is None else value is not None and not isinstance(value, np.ndarray) \
        and value == default


def untiled(given):
    """The names among `given` (option names) that the tiled engine does not compute."""
    return [row.name for row in OPTIONS if not row.tiled and row.name in given]
