"""Judge another attention's results: the oracle, the baseline and the rule, from arrays.

    report = crosscheck(q=q, k=k, v=v, dout=dout, out=out, dq=dq, dk=dk, dv=dv, causal=True)
    print(report); assert report                   # a CrosscheckReport, truthy iff all PASS

The keyword names are the .npz keys (schema.py). For each candidate tensor X:
    oracle    attention.py in a wider dtype (oracle_dtype): float64 for float32 / float16
              candidates, np.longdouble for float64 ones;
    baseline  naive.py in the candidate's dtype (float16 computes in float32, then rounds);
    verdict   rule.judge: err(candidate) <= k * err(baseline) + atol, where
              atol = ATOL_ULPS * eps(dtype) * |X|max and |X|max (magnitudes.py) is the
              largest sum of absolute terms that makes an entry of X, e.g. for dq
              scale * max_i sum_j P_ij (|dP_ij| + |D_i|) max|k|: rounding error is relative
              to the terms, not to the result (a gradient that cancels to 0 still rounds).
The oracle's and the baselines' runs are runs.py's. In float16, bfloat16 and float8 the
baseline is the largest error of the recipe's ways (runs.case_ways) that compute the tensor
without overflowing (_computes). Every bound only grows with such ways (rule.py), so each
tensor is judged first against the ways of the recipe's first forward, the scale on k
(runs.ways_by_forward); only when one fails are the other ways computed and every tensor
judged again against all of them: a report that fails is the one against every way, one
that passes computes the first forward alone.

A large case (scores [..., H, N_q, N_k] over row_blocks.SCORE_BUDGET entries) runs in O(N)
memory plus its own arrays: the oracle on the tiled engine (an option options.untiled names,
or fully_masked other than 'zero': CaseError), the baselines and the term magnitudes in blocks
of query rows (row_blocks.py), with the same results as whole arrays; no diagnosis.
The oracle's runs, the baselines' forwards (a large case's slices) and the tensors' verdicts run
on `workers` threads (engines/parallel.py), the report bitwise the same for any number.
"""
import math
from functools import partial

import numpy as np

from .._checks import require_bool, require_mapping, require_nonnegative_real, require_positive_real, to_numpy
from ..engines.parallel import cluster
from ..engines.plan import check_scheduler, resolve_workers
from . import row_blocks, rule
from .case import split_case
from .diagnosis import diagnose
from .named import rel_l2
from .naive import WAY as NAIVE_WAY
from .precision import PRECISIONS, eps
from .rotary import angle_error
from .rule import K_L2, CrosscheckReport, atol_for, judge
from .runs import (SCALE_STEP, baselines, case_block_rows, case_magnitudes, case_score_shape, case_ways,
                   concurrently, reads_kernel_out, reference, scale_directions, scale_offsets, unpaged,
                   ways_by_forward)
from .schema import CANDIDATES, FORWARD_MODE, GRADIENTS, ROWS, CaseError, check_keys
from .tangents import add_tangents
from .gated import attention_case, gated_magnitudes
from .transforms import heads_max, latent_sum, per_head

HINT_PRECISIONS = ("bfloat16", "float16")   # a float32 result may hold a 16-bit kernel's values
PROGRESS_SCORES = 2 ** 22   # a case this large (some seconds and up) reports its stages to `progress`
ZERO_ULPS = 64             # a tensor this many ulps (of T) of its terms large that zeros pass: unjudgeable
HINT_VALUES = 8             # nonzero values a result must hold for the hint (chance: 2^-128)


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


def _as_arrays(arrays):
    """The keyword arguments as NumPy arrays (_checks.to_numpy: torch's bfloat16 and float8
    tensors become ml_dtypes arrays); None means absent, for a case key (another name is a
    CaseError even as None: attn_mask=None is torch's, read as nothing)."""
    check_keys(arrays)
    return {name: to_numpy(x, name) for name, x in arrays.items() if x is not None}


def _atol(case, name, dtype, oracle, magnitude, given):
    """The tensor's atol (rule.py): the given one; 4 ulps of its largest sum of terms in a
    float32 / float64 precision (of its largest entry for a tangent, which has no term
    magnitudes), ulps of the precision or of the tensor's dtype, the coarser (float32 results
    stored as float64 are still a float32 kernel's). In a 16- or 8-bit one: half an ulp of its
    largest entry, in the precision's output dtype at least (a bfloat16 result may come as
    float32 values), but in its own dtype for lse and max_logits, which kernels keep in float32
    (and for lse then at least eps(T) / 2: _summed_in_t); and at least 4 float32 ulps of its
    largest sum of terms, the rounding of the kernel's float32 sums, for a tensor that cancels
    to 0 or near it (dq and dk with one key in a row: exactly 0, and a kernel's rounding noise)."""
    if given is not None:
        return given
    largest = float(np.max(np.abs(oracle[np.isfinite(oracle)]), initial=0))
    if not case.precision.recipe:                     # a float32 kernel's results stored as float64: float32's
        wider = dtype if eps(dtype) >= eps(case.precision.output) else case.precision.output
        return atol_for(wider, largest if magnitude is None else magnitude)
    ulp = eps(dtype) if name in ROWS else max(eps(dtype), eps(case.precision.output))
    return max(ulp / 2 * largest, _summed_in_t(case, name),
               0.0 if magnitude is None else atol_for(np.float32, magnitude))


def _summed_in_t(case, name):
    """eps(T) / 2 for an lse in a 16- or 8-bit precision, what a kernel that sums its softmax
    weights rounded to T makes of the sum's log (rule.py); else 0."""
    return eps(case.precision.compute) / 2 if name == "lse" and case.precision.recipe else 0.0


def crosscheck(*, precision=None, layout=None, lse_base=None, own_forward=False, k_factors=None,
               atol=None, scheduler=None, workers=None, judge=judge, score_mod=None, mask_mod=None,
               score_mod_params=None, score_mod_vjps=None, progress=None, **arrays):
    """Judge each candidate tensor among `arrays` (the .npz keys) against the oracle.

    Args:
        arrays: q, k, v, dout, the options and the candidate's out, lse, dq, dk, dv, dbias
            (numpy or ml_dtypes arrays, torch tensors, or anything np.asarray takes; None
            is the same as absent); in a 16- or 8-bit precision q_descale, k_descale,
            v_descale (descale_block; float8's intermediate_dtype), accumulator_bits; rotary
            embeddings' rope_* keys; MLA's kv, head_dim_v and dkv; sparse top-k's
            topk_indices, topk_length, topk_block_size (schema.py lists them).
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
        scheduler: a dask.distributed Client, or a scheduler's address: a large case's tiled
            oracle, baselines and term magnitudes run their slices there (bitwise the same
            report); a case small enough to form its scores whole runs here.
        workers: threads for the oracle's runs, the baselines' forwards and a large case's slices
            (an int >= 1); default every core this process may use from PARALLEL_SCORES
            scores up (plan.resolve_workers), else 1. The report is bitwise the same for
            any number.
        judge: what judges each tensor, called as rule.judge (the default) is; errormap.py
            passes one that also keeps each entry's error over its bound.
        score_mod, mask_mod, score_mod_params, score_mod_vjps: FlexAttention's mods the candidate computed
            with (attention_forward's; scores.py), applied by the oracle and by every
            baseline in its own precision's way (a .npz case cannot hold a function).
        progress: a function called with a line of text as each stage starts (the oracle, the
            baselines, the term magnitudes, the verdicts, the diagnosis), on a case of at least
            PROGRESS_SCORES scores, which takes from seconds to minutes; None: quiet.
    Every tensor is held to the baseline of the case's precision (a float16 kernel's float32
    lse is judged against float16 scores); the oracle computes in float64 (np.longdouble
    for a float64 precision). Overflow in a case shows as inf / NaN errors in the report,
    without numpy's warnings.
    Returns:
        CrosscheckReport. Raises CaseError (a ValueError) for a malformed case.
    """
    settings = {"layout": layout, "lse_base": lse_base, "own_forward": own_forward,
                "k_factors": k_factors, "atol": atol, "scheduler": scheduler, "workers": workers}
    k_factors = _check_k_factors(k_factors)
    atol = None if atol is None else require_nonnegative_real(atol, "atol")
    scheduler = check_scheduler(scheduler)
    arrays = _as_arrays(arrays)
    case = split_case(arrays, precision=precision, layout=layout, lse_base=lse_base, memory=True)
    mods = {"score_mod": score_mod, "mask_mod": mask_mod, "score_mod_params": score_mod_params,
            "score_mod_vjps": score_mod_vjps}
    case = case._replace(options={**case.options, **{name: f for name, f in mods.items() if f is not None}})
    wide = np.dtype(np.longdouble if case.precision.name == "float64" else np.float64)
    want_grads = any(name in case.candidates for name in GRADIENTS)
    forward_of = _candidate_forward(case, require_bool(own_forward, "own_forward"), want_grads)
    block_rows = case_block_rows(case)                       # None: whole arrays
    workers = resolve_workers(workers, "tiled", row_blocks.score_entries(case_score_shape(case)))
    whole = block_rows is None
    tangents = any(name in case.candidates for name in FORWARD_MODE)
    if tangents and not whole:
        raise CaseError(f"tangents are judged on cases of at most {row_blocks.SCORE_BUDGET:,} scores")
    low = case.precision.recipe                          # a 16- or 8-bit precision
    scores = row_blocks.score_entries(case_score_shape(case))
    say = progress if progress is not None and scores >= PROGRESS_SCORES else lambda text: None
    say(f"a case of {scores:,} scores" + (", in blocks of rows" if not whole else "") + f": the oracle in {wide}")
    with np.errstate(all="ignore"), cluster(None if whole else scheduler) as client:
        oracle = partial(reference, case.inputs, case.options, wide, stages=whole, scheduler=client)
        jobs = {"truth": partial(oracle, want_grads)}
        if forward_of is not None:                       # the backward of the candidate's forward
            jobs["own"] = partial(oracle, True, forward_of)
        if low:                                          # the scale check's oracle at another scale
            jobs["shifted"] = partial(oracle, want_grads, scale_factor=1 + SCALE_STEP)
        done = {name: latent_sum(x, case.latent) for name, x in concurrently(jobs, workers).items()}
        truth = done["truth"]
        against = dict(truth)                              # what each candidate tensor is judged against
        if forward_of is not None:                         # but the truth where the candidate's forward
            against.update({name: np.where(np.isfinite(value) | ~np.isfinite(truth[name]), value, truth[name])
                            for name, value in done["own"].items() if name in GRADIENTS})   # is not finite
        ways = case_ways(case, want_grads)
        first = ways_by_forward(ways)[0]                         # the scale on k's forward and its backwards
        bases = [None] * len(ways)                         # each way's baseline, once computed

        def compute(numbers):                            # the baselines of those ways, put in bases
            computed = baselines(case, want_grads, block_rows, client, workers, ways=numbers)
            for number, base in zip(numbers, computed):
                base = latent_sum(base, case.latent, case.precision.output if low else None)
                bases[number] = per_head(base if case.paged is None else unpaged(base, case.paged), case)

        say(f"the {case.precision.name} baselines ({len(first)} way{'s' * (len(first) > 1)})")
        compute(first)
        if tangents:                                     # (float32, float64: one way, the first)
            add_tangents(case, truth, [bases[number] for number in first], wide)
            against.update({name: truth[name] for name in FORWARD_MODE})
        say("the term magnitudes")
        mags = gated_magnitudes(case_magnitudes(*attention_case(case, truth), whole, block_rows, client, workers),
                                case, truth)             # (with an output gate: the attention's, gated)
        if case.latent is not None and "dk" in mags:     # MLA's dkv: the terms of dk and of dv
            mags["dkv"] = mags["dk"] + mags["dv"]
        directions = scale_directions(truth, done["shifted"]) if low else {}
        if case.paged is not None:                       # the packed problem's results, as the caller's
            truth, against, directions = (unpaged(x, case.paged) for x in (truth, against, directions))
        truth, against = per_head(truth, case), per_head(against, case)
        if heads_max(case):                              # no scale check of a head's largest score
            directions = {name: x for name, x in directions.items() if name != "max_logits"}
        names = [names for names, _ in ways]             # each way's (forward, gradient) names
        offsets = scale_offsets(case, ways)
        def verdict(name, held, cand=None, by=judge):     # judged by the baselines of the ways `held`
            cand = case.candidates[name] if cand is None else cand   # (those that compute the tensor)
            held = [i for i in held if name in bases[i]]
            base = {i: bases[i][name].astype(cand.dtype) for i in held}
            held = [i for i in held if _computes(base[i], truth[name])] or held   # overflowing ways left out
            return by(name, _in_base_e(case, name, cand), against[name], [base[i] for i in held],
                      baseline_names=[names[i][name in GRADIENTS] for i in held],
                      baseline_oracle=truth[name],
                      k=k_factors.get(name), dtype=cand.dtype,
                      atol=_atol(case, name, cand.dtype, truth[name], mags.get(name), atol),
                      l2_k=K_L2 if low else None, rows=low,
                      scale_direction=directions.get(name), scale_tol=eps(case.precision.compute) / 2,
                      scale_atol=_summed_in_t(case, name), scale_offsets=[offsets[i] for i in held])

        def verdicts_of(names, held):                    # {name: verdict}, the tensors on threads
            return concurrently({name: partial(verdict, name, held) for name in names}, workers)

        reads_out = len(ways) - 1 if reads_kernel_out(case, want_grads) else None   # D from the kernel's out

        def judged(numbers):                             # the verdicts against the ways `numbers`
            forward = [i for i in numbers if i != reads_out]
            verdicts = verdicts_of([name for name in case.candidates if name not in GRADIENTS], forward)
            with_out = reads_out is not None and verdicts["out"].passed      # an out that passes is a kernel's
            verdicts.update(verdicts_of([name for name in case.candidates if name in GRADIENTS],
                                        numbers if with_out else forward))
            zeros = lambda name: verdict(name, forward, np.zeros_like(case.candidates[name]), rule.judge)
            return [verdicts[name] for name in case.candidates], zeros

        say("the verdicts")
        verdicts, zeros = judged(first)                  # a pass against some baselines passes against all
        if not all(row.passed for row in verdicts):      # (rule.py): the other ways only for a failure
            rest = [number for number in range(len(ways)) if number not in first]
            if rest:
                say(f"the other {case.precision.name} baselines, for a tensor that failed ({len(rest)} ways)")
                compute(rest)
                verdicts, zeros = judged(range(len(ways)))
        _require_judged(case, verdicts, against, mags, None if atol is not None else zeros)
        failing = [row.name for row in verdicts if not row.passed]
        if failing:
            say("the diagnosis")
        diagnosis = _diagnosis(arrays, case, truth, bases, failing, whole) if failing else []
    if failing:
        diagnosis = _precision_hint(arrays, case, settings) + diagnosis
    kind = "recipe" if case.precision.recipe else NAIVE_WAY
    return CrosscheckReport(rows=verdicts, oracle_dtype=str(wide),
                            baseline_dtype=f"{case.precision.name} ({kind})", diagnosis=tuple(diagnosis))


def _computes(base, oracle):
    """Whether a baseline (in the candidate's dtype) is finite wherever the oracle is. A way of
    the recipe whose values overflow the precision there (NaN or inf: a score past float16's
    65504 when the scale is applied after the product) computes nothing a kernel could be held
    to; crosscheck leaves it out of the tensor's envelope while another way computes the
    tensor, and refuses the case when none does (_require_judged). Leaving such ways out keeps
    the envelope's bound growing with every way added, so judging against the first forward's
    ways first (crosscheck) gives the verdict of judging against all of them."""
    return bool(np.all(np.isfinite(base) | ~np.isfinite(oracle)))


def _require_judged(case, verdicts, against, mags, verdict_of_zeros):
    """CaseError naming the first tensor that the case's precision cannot judge:
    - its bound is not finite where its oracle is (rule.py: it judges nothing): a baseline
      that overflows the precision, or term magnitudes that overflow float64;
    - an all-zero result would pass (verdict_of_zeros(name), with the default atol) though
      the oracle's largest entry is over ZERO_ULPS ulps of the compute dtype T of its terms
      (mags: a tensor that cancels to its terms' rounding is rounding noise in every kernel,
      zeros as good as any): the honest baseline's error is as large as the tensor, the
      result of that precision is noise (rope angles at positions where float32 cannot hold
      them), and garbage passes as well as an honest kernel. An oracle whose largest entry is
      over the tensor's own bound needs no such verdict: zeros are off by that entry, and their
      bound is at most the tensor's (the same k and atol, the envelope of the same or fewer
      ways), so they fail."""
    for row in verdicts:
        oracle = against[row.name]
        if not math.isfinite(row.bound) and np.isfinite(oracle).any():
            why = (f"the {case.precision.name} baseline is NaN or infinite where the float64 oracle is finite: "
                   f"the case's values overflow {case.precision.compute}" if not math.isfinite(row.baseline_err)
                   else "the sums of its terms overflow float64 (atol is infinite): the inputs are too large")
            raise CaseError(f"{row.name} cannot be judged: {why}; no kernel can be held to an infinite bound")
        largest = float(np.max(np.abs(oracle[np.isfinite(oracle)]), initial=0))
        floor = ZERO_ULPS * eps(case.precision.compute) * mags.get(row.name, math.inf)
        if (verdict_of_zeros is not None and floor < largest <= row.bound
                and verdict_of_zeros(row.name).passed):
            raise CaseError(f"{row.name} cannot be judged in {case.precision.name}: the honest baseline's error "
                            f"{row.baseline_err:.3g} is as large as {row.name} itself (largest entry "
                            f"{largest:.3g}), so an all-zero {row.name} would pass{_noise_hint(case)}")


def _noise_hint(case):
    """Why a case's precision computes noise, where it can be told: rope angles in float32 off
    by radians (rotary.angle_error); else ""."""
    error = angle_error(case) if case.precision.name != "float64" else 0.0
    if error < 0.1:
        return ""
    return (f"; its rope angles in float32 are off by up to {error:.3g} radians at the case's positions: a "
            f"{case.precision.name} kernel's turn is noise there (positions past 2^24 keep no fraction in float32)")


def _candidate_forward(case, own_forward, want_grads):
    """own_forward: the candidate's {"out", "lse" (base e, float64)} for the reference's
    gradients; else None."""
    if not own_forward:
        return None
    if not {"out", "lse"} <= set(case.candidates) or not want_grads:
        raise CaseError("own_forward=True judges gradients from the candidate's own out and lse: "
                        "the case needs out, lse and a gradient")
    if case.options.get("fully_masked", "zero") != "zero" or case.paged is not None:
        raise CaseError("own_forward=True rebuilds P as exp(S - lse): it takes fully_masked='zero' "
                        "and no paged KV cache")
    lse = case.candidates["lse"].astype(np.float64) * (math.log(2) if case.lse_base == "2" else 1)
    return {"out": case.candidates["out"], "lse": lse}


def _in_base_e(case, name, cand):
    """The candidate tensor, its lse in base e (lse_base '2': times log 2, in float64)."""
    return cand.astype(np.float64) * np.log(2) if name == "lse" and case.lse_base == "2" else cand


def _diagnosis(arrays, case, truth, bases, failing, whole):
    """The diagnosis lines of a failing case: the mix-up it matches (diagnosis.py, given the
    rounding of the case's precision: the baselines' rel L2 errors; or the other layout);
    none for a large case (not whole), whose reruns would be whole arrays; on a paged cache
    the reruns' results are put in its layout (and a max_logits given per head, per head)."""
    if not whole:
        return ["not run: the case is too large to rerun the oracle under each mix-up "
                f"(more than {row_blocks.SCORE_BUDGET:,} scores)"]
    noise = {name: max(rel_l2(b[name], truth[name]) for b in bases if name in b) for name in failing
             if any(name in b for b in bases)}
    paged = (lambda results: results) if case.paged is None else (lambda results: unpaged(results, case.paged))
    found = diagnose(case, truth, failing, noise, laid_out=lambda results: per_head(paged(results), case))
    return found if case.paged is not None else found or _layout_mixup(arrays, case, failing)


def _precision_hint(arrays, case, settings):
    """The diagnosis line of a failing float32 / float64 case whose results (out and the
    gradients; kernels keep lse in float32) hold only bfloat16 or float16 values, at least
    HINT_VALUES of them besides 0: a 16-bit kernel's results saved as float32, what NumPy
    without bfloat16 leads to. The line names that precision and the case's verdict in it.
    (A float32 result lands on a bfloat16 value by chance once in 2^16.)"""
    held = [np.asarray(case.candidates[n], np.float64) for n in ("out", *GRADIENTS)
            if n in case.candidates]
    if case.precision.recipe or not held:
        return []
    values = np.concatenate([x[np.isfinite(x) & (x != 0)] for x in held])
    for name in HINT_PRECISIONS:            # bfloat16 first: most of its values are float16's too
        if values.size >= HINT_VALUES and np.array_equal(
                values.astype(PRECISIONS[name].storage).astype(np.float64), values):
            said = f"the results hold only {name} values, as a {name} kernel's do"
            try:
                verdict = "PASS" if crosscheck(**{n: x for n, x in arrays.items() if n != "precision"},
                                               precision=name, **settings) else "FAIL"
            except CaseError as exc:          # q, k, v hold other values than such a kernel reads
                return [f"{said}; precision={name!r} would judge them, but: {exc}"]
            return [f"{said}; judged with precision={name!r} (a keyword, or the .npz key), the case "
                    f"gives {verdict}"]
    return []


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
