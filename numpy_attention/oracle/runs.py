"""crosscheck's runs: the oracle, the baselines (the naive one, the recipe's ways) and the term
magnitudes of a case, whole or in slices, on threads or a cluster.

    truth = reference(case.inputs, case.options, np.float64)      the oracle, in a wider dtype
    bases = baselines(case, gradients, block_rows, scheduler, workers, ways=numbers)
    mags = case_magnitudes(case, truth, whole, block_rows, scheduler, workers)

The oracle is attention.py in a wider dtype (the blocked engine on a case whose scores fit
row_blocks.SCORE_BUDGET, the tiled one in O(N) memory above). The baseline of a float32 or
float64 candidate is naive.py; of a 16- or 8-bit one, each way of the precision's recipe
(recipe.py): the recipe with one kernel's order of roundings (case_ways). A large case
runs in (batch index, kv head) slices (slices.py), put back together in a fixed order: the
results are bitwise the same for any number of workers, or on a cluster.
"""
from functools import partial

import numpy as np

from .._layout import grouped_matmul, with_head_axis
from ..attention import ENGINES, TiledAttentionCache, attention_backward
from ..caches import TEXTBOOK
from ..engines.parallel import run_tasks
from ..engines.plan import PARALLEL_SCORES, attention_plan
from ..engines.tiled import tile_scores
from ..gate import gate_forward, sigmoid
from ..options import GRADIENTS, attention_options, untiled
from ..paged import scatter_keys, unpack_rows
from . import row_blocks
from .schema import CANDIDATES, FLOAT_OPTIONS, CaseError
from .magnitudes import magnitudes_of, max_sums, term_magnitudes, term_sums, whole_stages
from .naive import WAY as NAIVE_WAY, naive_attention
from .gated import gated, gated_dout
from .precision import round_to
from .recipe import TILE_ROWS, recipe_backwards
from .rotary import turn_qk, turned_case
from .slices import case_slices, put_together

ORACLE_TILE = 256           # the tiled oracle's block_size on a large case
SCALE_STEP = 2.0 ** -20     # the rule's scale check: d oracle / d log(scale) by this step


def case_in(inputs, options, dtype, scale_factor=1.0):
    """(q, k, v, dout, record, scale, back): the case in `dtype` (inputs rounded to it, then
    held in its compute dtype; float16 computes in float32) and its AttentionOptions record.

    The scale (times scale_factor) multiplies q here and the record's scale is 1.0: the
    record keeps a scale as a Python float, and a default 1/sqrt(d_k) rounded to float64
    would cost an np.longdouble oracle its extra digits. dq is then `scale` times the
    gradient w.r.t. the scaled q. With rope, q and k are turned in `dtype`'s way (rotary.py)
    before the scale, and back(dq, dk) turns their gradients back (else back is None).
    """
    work = np.result_type(dtype, np.float32)
    cast = lambda x: None if x is None else x.astype(dtype).astype(work)
    options = {name: cast(x) if name in FLOAT_OPTIONS else x for name, x in options.items()}
    q, k, v, dout = (cast(inputs.get(name)) for name in ("q", "k", "v", "dout"))
    given, rope = options.pop("scale", None), options.pop("rope", None)
    scale = 1 / np.sqrt(work.type(q.shape[-1])) if given is None else work.type(given)
    if given is not None and not np.isfinite(scale):
        raise CaseError(f"scale={given:g} is not finite in the candidate's compute dtype {work}")
    scale = scale * work.type(scale_factor)
    try:
        q, k, v, record = attention_options(q, k, v, scale=1.0, **options)
    except (ValueError, TypeError) as exc:
        raise CaseError(str(exc)) from None
    back = None
    if rope is not None:
        q, k, back = turn_qk(q, k, rope, record, work)
    return q * scale, k, v, dout, record, scale, back


def reference(inputs, options, dtype, gradients=True, forward_of=None, stages=True,
              scale_factor=1.0, scheduler=None):
    """The oracle: attention.py with every input cast to `dtype`, on the blocked engine (stages)
    or the tiled one.

    forward_of: None, or a candidate's own {"out", "lse"} (natural log): the gradients are
    then those of FlashAttention's backward from that forward, P = exp(S - lse) and
    D = rowsum(dout * out), so that a backward is judged apart from its forward's error.
    stages: False runs the tiled engine (O(N) memory; options.untiled's options and
    fully_masked other than 'zero' refused) and returns no [..., H, N_q, N_k] stage.
    scale_factor: the scale times this (the rule's scale check reruns the oracle so).
    scheduler: a Dask Client for the tiled engine's slices (stages False), or None.
    Returns:
        dict with out [..., H, N_q, d_v] (times sigmoid(gate) with a gate), lse and max_logits
        [..., H, N_q], and with gradients and dout dq, dk, dv (dbias, dgate with their
        options); with stages also the scores S (-inf where masked), the weights P and P~
        (after dropout) [..., H, N_q, N_k], and with gradients the stages dP, dS
        [..., H, N_q, N_k] and D [..., H, N_q].
    """
    engine = {"implementation": "blocked"} if stages else {"implementation": "tiled", "block_size": ORACLE_TILE,
                                                           "scheduler": scheduler}
    q, k, v, dout, record, scale, back = case_in(inputs, options, dtype, scale_factor)
    plan = attention_plan(record, q.shape, k.shape, **engine)
    forward, _ = ENGINES[plan.implementation]
    out, cache = forward(q, k, v, record, plan)
    gate = record.gate
    result = {"out": out if gate is None else gate_forward(out, gate), "lse": cache.lse,
              "max_logits": cache.max_logits}
    if stages:
        dropout_scale = record.dropout_scale
        p_drop = cache.weights if dropout_scale is None else cache.weights * dropout_scale
        result.update({"S": cache.scores, "P": cache.weights, "P~": p_drop})
    if gradients and dout is not None:
        if forward_of is not None:
            cache = _from_candidate_forward(cache, forward_of, dtype)
        g = attention_backward(dout, cache, method="flash" if forward_of else "vjp",   # (and the gate's)
                               return_stages=stages)
        dq, dk = scale * g.dq, g.dk
        result.update(zip(("dq", "dk"), (dq, dk) if back is None else back(dq, dk)), dv=g.dv)
        if stages:
            result.update(dP=g.stages.dP, dS=g.stages.dS, D=g.stages.D)
        result.update({name: getattr(g, name) for name in GRADIENTS if getattr(g, name) is not None})
    return result


def _from_candidate_forward(cache, forward_of, dtype):
    """The oracle's cache with the candidate's out (over sigmoid(gate) with a gate: P V) and lse
    (a +inf lse, FlashAttention's fully masked row, is -inf), for a flash backward: the tiled
    engine's recomputes P from them; for the others P = exp(S - lse) here, and the textbook's
    flash backward."""
    out = np.asarray(forward_of["out"]).astype(dtype)
    if cache.options.gate is not None:                  # the attention's O, before the gate
        out = out / sigmoid(cache.options.gate)
    lse = np.asarray(forward_of["lse"]).astype(dtype)
    lse = np.where(np.isposinf(lse) & np.isneginf(cache.lse), -np.inf, lse)
    if isinstance(cache, TiledAttentionCache):
        return cache._replace(out=out, lse=lse)
    scores = cache.scores
    with np.errstate(invalid="ignore"):
        weights = np.where(np.isneginf(scores) | np.isneginf(lse)[..., None], 0,
                           np.exp(scores - lse[..., None]))
    return cache._replace(out=out, lse=lse, weights=weights, plan=TEXTBOOK)


def baseline(inputs, options, dtype, gradients=True):
    """The naive baseline (naive.py) in the candidate's dtype: dict out, lse (dq, dk, dv, dbias).

    Its scale is one ulp off, scale * (1 + eps): a kernel holds the scale in its own
    precision (1/sqrt(d_k) rounded, or torch's sqrt(scale) applied to q and to k), and
    that error is systematic over a whole row of scores; with a sharp softmax it is what
    the result is most sensitive to. It takes O(N) memory on any case (a tile of rows at a time).
    """
    work = np.result_type(dtype, np.float32)
    q, k, v, dout, record, scale, back = case_in(inputs, options, dtype, 1 + np.finfo(work).eps)
    dout = dout if gradients else None
    result = gated(naive_attention(q, k, v, record, dout=gated_dout(dout, record.gate)), dout, record.gate)
    if "dq" in result:
        result["dq"] = scale * result["dq"]
        if back is not None:
            result["dq"], result["dk"] = back(result["dq"], result["dk"])
    return result


def _recomputed_stages(truth, inputs, options, block_rows):
    """The tiled oracle's stages block by block (for term_magnitudes on a large case): S of
    the block's rows in float64, P = exp(S - lse) from the oracle's lse (P~ = P: no dropout), lse,
    dP = dout v^T and D = rowsum(dout * out) from the oracle's out. Yields (index, stages)."""
    q, k, v, dout, record, _, _ = case_in(inputs, options, np.float64)
    q3, k3, v3 = (with_head_axis(x) for x in (q, k, v))
    score_shape = q3.shape[:-1] + k3.shape[-2:-1]
    lse = truth["lse"].astype(np.float64).reshape(score_shape[:-1])
    shift = np.where(np.isneginf(lse), np.inf, lse)     # a fully masked row's: P = exp(-inf) = 0
    out = with_head_axis(truth["out"]).astype(np.float64)
    for r in row_blocks.row_slices(score_shape[-2], block_rows):
        index = (Ellipsis, r, slice(None))
        s, keep, _ = tile_scores(record, q3[..., r, :], k3, score_shape, index)
        if keep is False:                               # nothing kept: no term
            continue
        p = np.exp(s - shift[..., r, None])
        stages = {"S": s, "P": p, "P~": p, "lse": lse[..., r]}
        if dout is not None and "dq" in truth:
            dout_r = with_head_axis(dout)[..., r, :]
            stages.update(dP=grouped_matmul(dout_r, np.swapaxes(v3, -1, -2)),
                          D=np.sum(dout_r * out[..., r, :], axis=-1))
        yield index, stages


def baselines(case, gradients=True, block_rows=None, scheduler=None, workers=1, ways=None):
    """The baselines of the case's precision (precision.py): a list of result dicts.

    float32 / float64: the naive baseline in that dtype. float16, bfloat16, float8: the
    recipe, with the scale on k, on the scores and on q (MLX's order), its two backwards (the
    eager one and the tiled flash one; the rule takes the largest error of them all, since a
    kernel may be built any of these ways), and last the flash one with D from the
    candidate's out where reads_kernel_out. Ways that compute the same forward (ways_by_forward)
    compute it once.
    ways: the numbers (case_ways) of the baselines wanted, in the list's order; None: all of them.
    block_rows: the recipe's query rows per block (row_blocks.py; a multiple of TILE_ROWS), None:
    all (the naive baseline runs on tiles of rows of its own).
    scheduler: a Dask Client: the case's (batch index, kv head) slices run there (slices.py),
    with the same results.
    workers: threads for the forwards, and for the slices of a case of at least PARALLEL_SCORES
    scores (engines.parallel.run_tasks), with the same results.
    """
    every = case_ways(case, gradients)
    ways = range(len(every)) if ways is None else ways
    groups = [tuple(way for way in group if way in ways) for group in ways_by_forward(every)]
    groups = [group for group in groups if group]
    slices = slices_of(case, scheduler, workers, len(groups))
    results = run_tasks(_baseline, [(piece, group) for _, piece in slices for group in groups],
                        workers=workers, shared={"gradients": gradients, "block_rows": block_rows},
                        scheduler=scheduler)
    ats = [at for at, _ in slices]
    by_way = {}
    for g, group in enumerate(groups):
        pieces = results[g::len(groups)]                 # the group's results in each slice
        by_way.update({way: put_together(case, ats, [piece[i] for piece in pieces]) for i, way in enumerate(group)})
    return [by_way[way] for way in ways]


def case_score_shape(case):
    """The case's scores' shape [..., H, N_q, N_k]."""
    q, k = with_head_axis(case.inputs["q"]), with_head_axis(case.inputs["k"])
    return q.shape[:-1] + k.shape[-2:-1]


def slices_of(case, scheduler, workers, tasks=1):
    """The case in (batch index, kv head) slices (slices.py) for a cluster, or for threads
    when it has at least PARALLEL_SCORES scores and its `tasks` (the baselines' forwards) are
    fewer than the workers; else whole."""
    threads = workers > tasks and row_blocks.score_entries(case_score_shape(case)) >= PARALLEL_SCORES
    return case_slices(case) if scheduler is not None or threads else [((Ellipsis,), case)]


def _baseline(case, ways, gradients, block_rows):
    """The baselines of `case` (a whole case, or one slice of it) computed its ways numbered
    `ways` (case_ways), which compute one forward (ways_by_forward): a task of baselines, their list."""
    p = case.precision
    if not p.recipe:
        return [baseline(case.inputs, case.options, p.compute, gradients)]
    q, k, v, dout, record, back = recipe_case_in(case)
    every = case_ways(case, gradients)
    _, reorder, _, mlx, scores = every[ways[0]][1]     # the forward they share
    any_reads = any(every[way][1][2] for way in ways)
    saved = round_to(case.candidates["out"], p.compute) if any_reads and "out" in case.candidates else None
    backwards = [(backward, saved if reads else None) for backward, _, reads, _, _ in (every[way][1] for way in ways)]
    gradients = gradients and any(backward is not None for backward, _ in backwards)   # None: a forward-only way
    dout, rnd = dout if gradients else None, partial(round_to, dtype=p.compute)
    results = recipe_backwards(q, k, v, record, p, dout=gated_dout(dout, record.gate, rnd), backwards=backwards,
                               reorder=reorder, block_rows=block_rows, mlx=mlx, scores=scores)
    results = [gated(result, dout, record.gate, rnd) for result in results]
    if back is not None:
        for result in results:
            if "dq" in result:
                result["dq"], result["dk"] = back(result["dq"], result["dk"])
    return results


def recipe_case_in(case):
    """(q, k, v, dout, record, back): the case as the recipe reads it (recipe.py), its inputs
    rounded to the compute dtype T and held in float32 (dout None if absent), its options'
    float arrays in float32, its AttentionOptions record; with rope, q and k turned in T
    (rotary.py) and back(dq, dk) turning their gradients back (else back is None)."""
    p = case.precision
    rounded = lambda x: None if x is None else round_to(x, p.compute)
    q, k, v, dout = (rounded(case.inputs.get(name)) for name in ("q", "k", "v", "dout"))
    options = {name: x.astype(np.float32) if name in FLOAT_OPTIONS else x for name, x in case.options.items()}
    rope = options.pop("rope", None)
    q, k, v, record = attention_options(q, k, v, **options)
    back = None
    if rope is not None:
        q, k, back = turn_qk(q, k, rope, record, p.compute)
    return q, k, v, dout, record, back


def case_ways(case, gradients):
    """The recipe's ways of computing the case (recipe.recipe_attention's arguments), each
    with its names for a forward result and for a gradient: [((name of its forward, name
    with its backward), (backward, reorder, reads the kernel's out, MLX's order, how the
    scores round))], backward None for a way of the forward only (the fused one: ONNX Runtime's
    inference kernel has no backward); the naive baseline's one way in float32 / float64."""
    if not case.precision.recipe:
        return [((NAIVE_WAY,) * 2, None)]
    named = lambda scale, backward: (scale, f"{scale}, {backward}")
    ways = [(named("scale on k", "eager backward"), ("eager", True, False, False, "rounded")),
            (named("scale on S", "eager backward"), ("eager", False, False, False, "rounded")),
            (named("scale on q (MLX)", "eager backward"), ("eager", True, False, True, "rounded"))]
    flash = [(named("scale on k", "flash backward"), ("flash", True, False, False, "rounded")),
             (named("S in float32 (flex)", "flash backward"), ("flash", False, False, False, "float32"))]
    if gradients and "dout" in case.inputs:
        ways += flash
    else:                                              # the forward of the flex way
        ways.append(flash[1])
    ways.append((named("S rounded once (fused)", "no backward"), (None, False, False, False, "fused")))
    if reads_kernel_out(case, gradients):                 # last: the verdicts take it apart
        ways.append((named("scale on k", "flash backward, D of its out"), ("flash", True, True, False, "rounded")))
    return ways


def ways_by_forward(ways):
    """The ways (case_ways) by the forward they compute: [tuple of way numbers], a group's ways
    sharing the scale's place, MLX's order and the scores' rounding (its forward computed once,
    recipe.recipe_backwards), the groups in the order of their first ways."""
    groups = {}
    for number, (_, way) in enumerate(ways):
        groups.setdefault(None if way is None else (way[1],) + way[3:], []).append(number)
    return [tuple(group) for group in groups.values()]


def scale_offsets(case, ways):
    """Each of the ways' (case_ways) own relative scale error, on purpose: MLX's way rounds the
    scale to T, by round(scale) / scale - 1 (0 where the scale is 1, which it leaves); the
    others 0. The scale check measures a(baseline) from it: its allowance eps(T) / 2 already
    covers a scale held in T (rule.py)."""
    if not case.precision.recipe:
        return [0.0] * len(ways)
    given = case.options.get("scale")
    scale = np.float32(given) if given is not None else 1 / np.sqrt(np.float32(case.inputs["q"].shape[-1]))
    rounded = round_to(np.float32(scale), case.precision.compute)
    mlx = 0.0 if scale == 1 else float(rounded) / float(scale) - 1
    return [mlx if way[3] else 0.0 for _, way in ways]


def reads_kernel_out(case, gradients):
    """Whether the case's baselines end with the flash backward that reads the candidate's out
    for D = rowsum(dout * out), as a FlashAttention backward reads its forward's: in a 16- or
    8-bit precision, for a case with gradients and an out (not on a paged cache, whose out is
    laid out otherwise, nor with a gate, whose out is not the attention's). The gradients are
    held to it only when that out passes: a wrong out must not excuse the gradients it would
    make wrong."""
    return (case.precision.recipe and gradients and "dout" in case.inputs and "out" in case.candidates
            and case.paged is None and "gate" not in case.options)


def case_block_rows(case):
    """Query rows per block for the case (row_blocks.block_rows): None when its scores fit
    row_blocks.SCORE_BUDGET. A larger case runs on the tiled oracle: CaseError naming an option
    it lacks."""
    score_shape = case_score_shape(case)
    block_rows = row_blocks.block_rows(score_shape, TILE_ROWS)
    o = case.options
    lacking = untiled(o) + ([f"fully_masked={o['fully_masked']!r}"] if o.get("fully_masked", "zero") != "zero"
                            else [])
    if block_rows is not None and lacking:
        raise CaseError(f"{lacking[0]} is not supported on a case this large: its scores "
                        f"{score_shape} have {row_blocks.score_entries(score_shape):,} entries, more than "
                        f"the {row_blocks.SCORE_BUDGET:,} crosscheck forms whole, so the oracle runs on "
                        f"the tiled engine (O(N) memory), which has no {lacking[0]}")
    return block_rows


def case_magnitudes(case, truth, whole, block_rows, scheduler, workers):
    """The case's term magnitudes (magnitudes.py): from the oracle's stages when whole, else
    recomputed block by block, on a cluster or on threads in (batch index, kv head) slices
    (slices.py). With rope, those of the turned q and k, dq's and dk's times the largest sum
    |cos| + |sin| of the turn back (rotary.turned_case)."""
    if "rope" in case.options:
        turned, factor = turned_case(case)
        mags = case_magnitudes(turned, truth, whole, block_rows, scheduler, workers)
        return {name: x * factor if name in ("dq", "dk") else x for name, x in mags.items()}
    if whole:
        return term_magnitudes(whole_stages(truth), case.inputs, case.options)
    items = [(piece, {name: truth[name][at] for name in ("out", "lse", "dq") if name in truth})
             for at, piece in slices_of(case, scheduler, workers)]
    sums = run_tasks(_slice_sums, items, workers=workers, shared={"block_rows": block_rows},
                     scheduler=scheduler)
    return magnitudes_of(max_sums(sums), case.inputs, case.options)


def _slice_sums(piece, truth, block_rows):
    """One slice's term_sums (a task of case_magnitudes), truth its part of the oracle's out, lse."""
    return term_sums(_recomputed_stages(truth, piece.inputs, piece.options, block_rows),
                     piece.inputs, piece.options)


def scale_directions(truth, shifted):
    """{tensor: d oracle / d log(scale)} for the rule's scale check, by a forward difference
    of the oracle and the oracle rerun at scale * (1 + SCALE_STEP) (`shifted`; float64: the
    difference is exact to about 1e-10 of it, far finer than a 16-bit precision's rounding)."""
    with np.errstate(invalid="ignore"):
        return {name: (shifted[name] - truth[name]) / SCALE_STEP
                for name in CANDIDATES if name in shifted and name in truth}


def concurrently(jobs, workers):
    """{name: job()} for a dict of calls without arguments: on `workers` threads when there
    are several (run_tasks: BLAS on one thread, the same bits for any number of workers); a
    single job runs as it is."""
    if len(jobs) == 1:
        return {name: job() for name, job in jobs.items()}
    return dict(zip(jobs, run_tasks(_call, [(job,) for job in jobs.values()], workers=workers)))


def _call(job):
    return job()


def unpaged(results, paged):
    """A result dict of the packed problem in the paged case's layout: out, lse, max_logits, dq back to
    [B, H, N_q, ...], dk, dv scattered into the pages (paged.py)."""
    back = {"out": unpack_rows, "lse": unpack_rows, "max_logits": unpack_rows, "dq": unpack_rows,
            "dk": lambda x, p: scatter_keys(x, p.k_cache_shape, p),
            "dkv": lambda x, p: scatter_keys(x, p.k_cache_shape, p),
            "dv": lambda x, p: scatter_keys(x, p.v_cache_shape, p)}
    return {name: back[name](x, paged) if name in back else x for name, x in results.items()}
