"""Judge another attention's results: the oracle, the baseline and the rule, from arrays.

    report = crosscheck(q=q, k=k, v=v, dout=dout, out=out, dq=dq, dk=dk, dv=dv, causal=True)
    print(report); assert report                   # a CrosscheckReport, truthy iff all PASS

The keyword names are the .npz keys (case.py). For each candidate tensor X:
    oracle    attention.py in a wider dtype (oracle_dtype): float64 for float32 / float16
              candidates, np.longdouble for float64 ones;
    baseline  naive.py in the candidate's dtype (float16 computes in float32, then rounds);
    verdict   rule.judge: err(candidate) <= k * err(baseline) + atol, where
              atol = ATOL_ULPS * eps(dtype) * |X|max and |X|max (term_magnitudes) is the
              largest sum of absolute terms that makes an entry of X, e.g. for dq
              scale * max_i sum_j P_ij (|dP_ij| + |D_i|) max|k|: rounding error is relative
              to the terms, not to the result (a gradient that cancels to 0 still rounds).
"""
import math

import numpy as np

from .._checks import require_bool, require_mapping, require_nonnegative_real, require_positive_real, to_numpy
from .._layout import fold, unbroadcast, with_head_axis
from ..attention import ENGINES, attention_backward
from ..options import attention_options
from .case import CANDIDATES, GRADIENTS, CaseError, split_case
from .diagnosis import diagnose, rel_l2
from .precision import PRECISIONS, eps, recipe_attention
from .naive import naive_attention
from .rule import K_L2, CrosscheckReport, atol_for, judge


def _case_in(inputs, options, dtype, scale_factor=1.0):
    """(q, k, v, dout, record, scale): the case in `dtype` (inputs rounded to it, then held in
    its compute dtype; float16 computes in float32) and its AttentionOptions record.

    The scale (times scale_factor) multiplies q here and the record's scale is 1.0: the
    record keeps a scale as a Python float, and a default 1/sqrt(d_k) rounded to float64
    would cost an np.longdouble oracle its extra digits. dq is then `scale` times the
    gradient w.r.t. the scaled q.
    """
    work = np.result_type(dtype, np.float32)
    cast = lambda x: None if x is None else x.astype(dtype).astype(work)
    options = dict(options)
    if "bias" in options:
        options["bias"] = cast(options["bias"])
    q, k, v, dout = (cast(inputs.get(name)) for name in ("q", "k", "v", "dout"))
    given = options.pop("scale", None)
    scale = 1 / np.sqrt(work.type(q.shape[-1])) if given is None else work.type(given)
    if given is not None and not np.isfinite(scale):
        raise CaseError(f"scale={given:g} is not finite in the candidate's compute dtype {work}")
    scale = scale * work.type(scale_factor)
    try:
        q, k, v, record = attention_options(q * scale, k, v, scale=1.0, **options)
    except (ValueError, TypeError) as exc:
        raise CaseError(str(exc)) from None
    return q, k, v, dout, record, scale


def reference(inputs, options, dtype, gradients=True, forward_of=None):
    """The oracle: attention.py with every input cast to `dtype`, on the record's engine.

    forward_of: None, or a candidate's own {"out", "lse"} (natural log): the gradients are
    then those of FlashAttention's backward from that forward, P = exp(S - lse) and
    D = rowsum(dout * out), so that a backward is judged apart from its forward's error.
    Returns:
        dict with out [..., H, N_q, d_v], lse [..., H, N_q], the scores S (-inf where
        masked) and the weights P and P~ (after dropout) [..., H, N_q, N_k], and with
        gradients and dout: dq, dk, dv (dbias with a bias) and the stages dP, dS
        [..., H, N_q, N_k] and D [..., H, N_q].
    """
    q, k, v, dout, record, scale = _case_in(inputs, options, dtype)
    forward, _ = ENGINES[record.implementation]
    out, cache = forward(q, k, v, record)
    dropout_scale = record.dropout_scale
    p_drop = cache.weights if dropout_scale is None else cache.weights * dropout_scale
    result = {"out": out, "lse": cache.lse, "S": cache.scores, "P": cache.weights, "P~": p_drop}
    if gradients and dout is not None:
        if forward_of is not None:
            cache = _from_candidate_forward(cache, forward_of, dtype)
        g = attention_backward(dout, cache, method="flash" if forward_of else "vjp", return_stages=True)
        result.update(dq=scale * g.dq, dk=g.dk, dv=g.dv, dP=g.stages.dP, dS=g.stages.dS,
                      D=g.stages.D)
        if g.dbias is not None:
            result["dbias"] = g.dbias
    return result


def _from_candidate_forward(cache, forward_of, dtype):
    """The oracle's cache with the candidate's out and lse, and P = exp(S - lse) from them,
    for the textbook's flash backward (a +inf lse, FlashAttention's fully masked row, is -inf)."""
    out = np.asarray(forward_of["out"]).astype(dtype)
    lse = np.asarray(forward_of["lse"]).astype(dtype)
    lse = np.where(np.isposinf(lse) & np.isneginf(cache.lse), -np.inf, lse)
    scores = cache.scores
    with np.errstate(invalid="ignore"):
        weights = np.where(np.isneginf(scores) | np.isneginf(lse)[..., None], 0,
                           np.exp(scores - lse[..., None]))
    return cache._replace(out=out, lse=lse, weights=weights,
                          options=cache.options._replace(implementation="textbook"))


def baseline(inputs, options, dtype, gradients=True):
    """The naive baseline (naive.py) in the candidate's dtype: dict out, lse (dq, dk, dv, dbias).

    Its scale is one ulp off, scale * (1 + eps): a kernel holds the scale in its own
    precision (1/sqrt(d_k) rounded, or torch's sqrt(scale) applied to q and to k), and
    that error is systematic over a whole row of scores; with a sharp softmax it is what
    the result is most sensitive to.
    """
    work = np.result_type(dtype, np.float32)
    q, k, v, dout, record, scale = _case_in(inputs, options, dtype, 1 + np.finfo(work).eps)
    result = naive_attention(q, k, v, record, dout=dout if gradients else None)
    if "dq" in result:
        result["dq"] = scale * result["dq"]
    return result


def term_magnitudes(truth, inputs, options):
    """{tensor: the largest sum of |terms| behind one of its entries}, from the oracle's stages."""
    q, k, v = (np.abs(inputs[name]).astype(np.float64) for name in ("q", "k", "v"))
    scale = options.get("scale", 1 / np.sqrt(q.shape[-1]))
    h_kv = with_head_axis(k).shape[-3]
    group = lambda x: fold(with_head_axis(x), h_kv)             # [..., H_kv, G*N_q, X]
    p_drop = np.asarray(truth["P~"], dtype=np.float64)
    kept = np.asarray(truth["S"], dtype=np.float64)
    mags = {"out": np.sum(p_drop, -1).max(initial=0) * v.max(initial=0),
            "lse": np.abs(kept[np.isfinite(kept)]).max(initial=0) + np.log(max(k.shape[-2], 1))}
    if "dS" in truth:
        dout = np.abs(inputs["dout"]).astype(np.float64)
        terms = np.asarray(truth["P"], dtype=np.float64) * (
            np.abs(np.asarray(truth["dP"], dtype=np.float64))
            + np.abs(np.asarray(truth["D"], dtype=np.float64))[..., None])   # |dS|'s terms
        terms = np.nan_to_num(terms)
        mags.update(dv=np.sum(group(p_drop), -2).max(initial=0) * dout.max(initial=0),
                    dq=scale * np.sum(terms, -1).max(initial=0) * k.max(initial=0),
                    dk=scale * np.sum(group(terms), -2).max(initial=0) * q.max(initial=0))
        if "bias" in options:
            mags["dbias"] = unbroadcast(terms, np.shape(options["bias"])).max(initial=0)
    return mags


def _check_k_factors(k_factors):
    """{tensor name: k > 0}, every name a candidate tensor's."""
    if k_factors is None:
        return {}
    require_mapping(k_factors, "k_factors")
    for name, k in k_factors.items():
        if name not in CANDIDATES:
            raise ValueError(f"k_factors has the key {name!r}; the tensors are {', '.join(CANDIDATES)}")
        require_positive_real(k, f"k_factors[{name!r}]")
    return dict(k_factors)


def baselines(case, gradients=True):
    """The baselines of the case's precision (precision.py): a list of result dicts.

    float32 / float64: the naive baseline in that dtype. float16, bfloat16, float8: the
    recipe, with its two backwards (the eager one and the tiled flash one; the rule
    takes the larger error of the two, since a kernel may be built either way).
    """
    p = case.precision
    if not p.recipe:
        return [baseline(case.inputs, case.options, p.compute, gradients)]
    rounded = lambda x: None if x is None else x.astype(p.compute).astype(np.float32)
    q, k, v, dout = (rounded(case.inputs.get(name)) for name in ("q", "k", "v", "dout"))
    options = dict(case.options)
    if "bias" in options:
        options["bias"] = options["bias"].astype(np.float32)
    q, k, v, record = attention_options(q, k, v, **options)
    dout = dout if gradients else None
    ways = [("eager", True), ("eager", False)] + ([("flash", True)] if dout is not None else [])
    return [recipe_attention(q, k, v, record, p, dout=dout, backward=backward, reorder=reorder)
            for backward, reorder in ways]


def _as_arrays(arrays):
    """The keyword arguments as NumPy arrays; None means absent. torch's bfloat16 and float8
    tensors, which have no NumPy dtype, become ml_dtypes arrays (through float32, exactly)."""
    converted = {}
    for name, x in arrays.items():
        if x is None:
            continue
        torch_dtype = str(getattr(x, "dtype", "")).removeprefix("torch.")
        if hasattr(x, "detach") and torch_dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            converted[name] = x.detach().cpu().float().numpy().astype(PRECISIONS[torch_dtype].storage)
        else:
            converted[name] = to_numpy(x)
    return converted


def _atol(case, dtype, oracle, magnitude, given):
    """The tensor's atol (rule.py): the given one; 4 ulps of its largest sum of terms in a
    float32 / float64 precision; half an ulp of its largest entry in a 16- or 8-bit one."""
    if given is not None:
        return given
    if not case.precision.recipe:
        return atol_for(dtype, magnitude)
    return eps(dtype) / 2 * float(np.max(np.abs(oracle[np.isfinite(oracle)]), initial=0))


def crosscheck(*, precision=None, layout=None, lse_base=None, own_forward=False, k_factors=None,
               atol=None, **arrays):
    """Judge each candidate tensor among `arrays` (the .npz keys) against the oracle.

    Args:
        arrays: q, k, v, dout, the options and the candidate's out, lse, dq, dk, dv, dbias
            (numpy or ml_dtypes arrays, torch tensors, or anything np.asarray takes; None
            is the same as absent), and for float8 q_descale, k_descale, v_descale.
        precision: what the candidate computed in: 'float64', 'float32', 'float16',
            'bfloat16', 'float8_e4m3fn', 'float8_e5m2' (precision.py); default the case's
            `precision` key, else inferred from the tensors' dtypes (storage.py).
        layout: 'bhnd' ([..., H, N, d], default) or 'bnhd' (FlashAttention's [..., N, H, d]).
        lse_base: 'e' (default) or '2': the base of the candidate's lse.
        own_forward: judge the gradients against the backward of the candidate's own out
            and lse (needs both) instead of the oracle's: a backward bug is then told
            apart from the forward's error.
        k_factors: {tensor name: k > 0} overriding rule.K_DEFAULT.
        atol: one absolute tolerance >= 0 for every tensor, overriding the default.
    Every tensor is held to the baseline of the case's precision (a float16 kernel's float32
    lse is judged against float16 scores); the oracle computes in float64 (np.longdouble
    for a float64 precision). Overflow in a case shows as inf / NaN errors in the report,
    without numpy's warnings.
    Returns:
        CrosscheckReport. Raises CaseError (a ValueError) for a malformed case.
    """
    k_factors = _check_k_factors(k_factors)
    atol = None if atol is None else require_nonnegative_real(atol, "atol")
    arrays = _as_arrays(arrays)
    case = split_case(arrays, precision=precision, layout=layout, lse_base=lse_base)
    wide = np.dtype(np.longdouble if case.precision.name == "float64" else np.float64)
    want_grads = any(name in case.candidates for name in GRADIENTS)
    forward_of = None
    if require_bool(own_forward, "own_forward"):
        if not {"out", "lse"} <= set(case.candidates) or not want_grads:
            raise CaseError("own_forward=True judges gradients from the candidate's own out and lse: "
                            "the case needs out, lse and a gradient")
        lse = case.candidates["lse"].astype(np.float64) * (math.log(2) if case.lse_base == "2" else 1)
        forward_of = {"out": case.candidates["out"], "lse": lse}
    with np.errstate(all="ignore"):
        truth = reference(case.inputs, case.options, wide, want_grads)
        against = dict(truth)                              # what each candidate tensor is judged against
        if forward_of is not None:
            against.update({name: value for name, value in reference(
                case.inputs, case.options, wide, True, forward_of).items() if name in GRADIENTS})
        bases = baselines(case, want_grads)
        mags = term_magnitudes(truth, case.inputs, case.options)
        rows = []
        for name, cand in case.candidates.items():
            values = cand.astype(np.float64) * np.log(2) if name == "lse" and case.lse_base == "2" else cand
            rows.append(judge(name, values, against[name], [b[name].astype(cand.dtype) for b in bases],
                              baseline_oracle=truth[name],
                              k=k_factors.get(name), atol=_atol(case, cand.dtype, truth[name],
                                                                 mags[name], atol),
                              dtype=cand.dtype, l2_k=K_L2 if case.precision.recipe else None))
        failing = [row.name for row in rows if not row.passed]
        diagnosis = (diagnose(case, truth, failing) or _layout_mixup(arrays, case, failing)) if failing else []
    kind = "recipe" if case.precision.recipe else "naive, sums left to right"
    return CrosscheckReport(rows=rows, oracle_dtype=str(wide),
                            baseline_dtype=f"{case.precision.name} ({kind})", diagnosis=tuple(diagnosis))


def _layout_mixup(arrays, case, failing):
    """The diagnosis line when the failing tensors match the other layout (bnhd / bhnd)."""
    if "layout" in arrays:                              # the case says which: no mix-up to find
        return []
    layout = "bnhd" if case.layout == "bhnd" else "bhnd"
    try:
        other = split_case(arrays, precision=case.precision.name, layout=layout, lse_base=case.lse_base)
    except CaseError:
        return []
    grads = any(name in failing for name in GRADIENTS)
    truth = reference(other.inputs, other.options, np.dtype(np.float64), grads)
    errs = {n: rel_l2(np.asarray(other.candidates[n]).astype(np.float64), truth[n]) for n in failing}
    if all(err <= 1e-2 for err in errs.values()):
        said = {"bhnd": "[..., H, N, d]", "bnhd": "[..., N, H, d]"}
        return [f"{', '.join(failing)} match the {said[layout]} layout (rel L2 {max(errs.values()):.1e}); "
                f"the case is read as {said[case.layout]} (layout={layout!r} reads it)"]
    return []
