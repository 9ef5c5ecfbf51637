"""Diagnosis: which common convention mix-up a failing candidate matches instead.

When a tensor fails, the oracle is run again (float64) under each mix-up that applies to
the case, and the failing tensors are compared with each rerun. A mix-up is named when
every failing tensor is at least 100 times closer (rel L2) to its rerun than to the oracle
and within 1e-2 of it:

    out, dq match causal='bottom_right' (rel L2 3.1e-08); the case says causal='top_left'

The mix-ups: causal alignment swapped; causal masking missing, or added; scale 1 or
sqrt(d_k) instead of 1/sqrt(d_k); mask polarity inverted; the window's alignment swapped;
grouped-query heads interleaved (query head h with kv head h % H_kv, not h // G);
dropout not rescaled by 1 / (1 - p); softcap applied after the bias; lse in base 2;
the [..., N, H, d] layout read as [..., H, N, d].
"""
import math

import numpy as np

from .._layout import grouped_matmul
from ..attention import attention_backward, attention_forward, attention_scores
from ..options import attention_options
from ..softmax import softmax_and_logsumexp

CLOSER = 100.0          # a mix-up must explain a failing tensor this much better than the case
NEAR = 1e-2             # and be this close to it (rel L2)


def rel_l2(x, ref):
    """||x - ref|| / ||ref|| over the finite entries (inf where their non-finite entries differ)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.array_equal(np.isfinite(x), np.isfinite(ref)):
        return math.inf
    finite = np.isfinite(ref)
    norm = float(np.linalg.norm(np.where(finite, ref, 0)))
    err = float(np.linalg.norm(np.where(finite, x - ref, 0)))
    return err / norm if norm > 0 else (0.0 if err == 0 else math.inf)


def _rerun(inputs, options, gradients, interleaved=False):
    """The float64 oracle's results for these inputs and options (a dict like check.reference's)."""
    q, k, v = (inputs[n].astype(np.float64) for n in "qkv")
    groups = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    if interleaved:                                  # query head h meets kv head h % H_kv
        k, v = (np.concatenate([x] * groups, axis=-3) for x in (k, v))
    out, cache = attention_forward(q, k, v, **options)
    result = {"out": out, "lse": cache.lse}
    if gradients and "dout" in inputs:
        grads = attention_backward(inputs["dout"].astype(np.float64), cache)
        dk, dv = grads.dk, grads.dv
        if interleaved:                              # each kv head's copies summed back
            fold = lambda x: x.reshape(x.shape[:-3] + (groups, -1) + x.shape[-2:]).sum(axis=-4)
            dk, dv = fold(dk), fold(dv)
        result.update(dq=grads.dq, dk=dk, dv=dv, dbias=grads.dbias)
    return result


def _softcap_after_bias(inputs, options):
    """out and lse with S = softcap tanh((scale q k^T + bias) / softcap) (forward only)."""
    options = dict(options)
    softcap = options.pop("softcap")
    q, k, v, record = attention_options(*(inputs[n].astype(np.float64) for n in "qkv"), **options)
    s = attention_scores(q, k, record)[0]            # scale q k^T + bias, -inf where masked
    s = np.where(np.isneginf(s), -np.inf, softcap * np.tanh(s / softcap))
    p, lse, _ = softmax_and_logsumexp(s)
    return {"out": grouped_matmul(p, v), "lse": lse}


def _with(options, **change):
    """The options with `change` applied; a value of None removes the option."""
    options = {**options, **change}
    return {name: x for name, x in options.items() if x is not None}


def _mixups(case, gradients):
    """(what the candidate did, what the case says, rerun()) for each mix-up that applies."""
    o, inputs = case.options, case.inputs
    rerun = lambda options, **kw: (lambda: _rerun(inputs, options, gradients, **kw))
    causal = o.get("causal", False)
    align = causal if isinstance(causal, str) else o.get("align") or "top_left"
    other = {"top_left": "bottom_right", "bottom_right": "top_left"}[align]
    if causal:
        said = f"the case says causal={align!r}"
        yield f"causal={other!r}", said, rerun(_with(o, causal=other, align=None))
        yield "no causal mask", said, rerun(_with(o, causal=None, align=o.get("align")))
    else:
        for alignment in ("top_left", "bottom_right"):
            yield f"causal={alignment!r}", "the case has no causal mask", \
                rerun(_with(o, causal=alignment, align=None))
    d_k, scale = inputs["q"].shape[-1], o.get("scale")
    for value, name in ((1.0, "1"), (math.sqrt(d_k), f"sqrt(d_k) = {math.sqrt(d_k):g}")):
        if scale is None or not math.isclose(scale, value):
            yield f"scale {name}", f"the case's is {scale if scale is not None else '1/sqrt(d_k)'}", \
                rerun(_with(o, scale=value))
    if "mask" in o:
        yield "the mask inverted (True = ignore)", "the case's mask is True = attend", \
            rerun(_with(o, mask=np.asarray(o["mask"]) == 0))
    if "window" in o and not causal:
        yield f"the window aligned {other}", f"the case aligns it {align}", rerun(_with(o, align=other))
    q, k = inputs["q"], inputs["k"]
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        yield "interleaved grouped-query heads (query head h with kv head h % H_kv)", \
            "the case groups them (h // G)", rerun(o, interleaved=True)
    if "dropout_mask" in o and o.get("dropout_p", 0) > 0:
        yield "dropout without the 1 / (1 - p) rescaling", "the case rescales", \
            rerun(_with(o, dropout_p=0.0))
    if "softcap" in o and "bias" in o:
        yield "softcap applied after the bias", "the case applies it before", \
            lambda: _softcap_after_bias(inputs, o)


def diagnose(case, truth, failing):
    """Lines naming the mix-up the failing tensors match; [] when none does.

    case: the split case; truth: the oracle's results; failing: the names of the tensors
    that failed (their candidates are in case.candidates).
    """
    candidates = {n: np.asarray(case.candidates[n]).astype(np.float64) for n in failing}
    if case.lse_base == "2" and "lse" in candidates:
        candidates["lse"] = candidates["lse"] * math.log(2)
    distance = {n: rel_l2(candidates[n], truth[n]) for n in candidates}
    explains = lambda err, name: err <= NEAR and err * CLOSER <= distance[name]
    if "lse" in candidates and case.lse_base == "e":
        base2 = rel_l2(candidates["lse"] * math.log(2), truth["lse"])
        if explains(base2, "lse"):
            return [f"lse matches lse in base 2 (rel L2 {base2:.1e}); the case says base e "
                    f"(lse_base='2' reads it)"]
    gradients = any(n in candidates for n in ("dq", "dk", "dv", "dbias"))
    with np.errstate(all="ignore"):
        for did, said, rerun in _mixups(case, gradients):
            try:
                alternative = rerun()
            except (ValueError, TypeError):             # not a valid case under this mix-up
                continue
            names = [n for n in candidates if alternative.get(n) is not None]
            errs = {n: rel_l2(candidates[n], alternative[n]) for n in names}
            if names and all(explains(errs[n], n) for n in names):
                return [f"{', '.join(names)} match {did} (rel L2 {max(errs.values()):.1e}); {said}"]
    return []
