"""The properties a conformance run checks beside each case's judgement: how a kernel's results
on related cases relate. Bugs that shipped past kernel test suites hid there, in how cases
relate to each other or at lengths their grids did not hold, not in any one case against a
reference (docs/conform.md names the threads each comes from):

    honesty           fresh inputs of the same shapes after a first call give results of those
                      inputs, not the first call's (an output cached by shape); on every call, no
                      write into any input (kernels.py) and no all-zero output where zeros would
                      pass (crosscheck's refusal)
    lengths           N_q = N_k, and decoding's N_q = 1, at every multiple of 16 up to 256 and one
                      either side of it, and at the block sizes the kernel declares and twice
                      them, one either side (a kernel right only at multiples of its block size,
                      or wrong at exactly one length)
    determinism       the same inputs twice: the same bits where the kernel declares
                      'deterministic', else each call's results judged
    batch_invariance  each sequence of a batch of 3 (and of a packed batch of 3 sequences of other
                      lengths): its rows of the batch's results judged as the lone sequence's;
                      where the kernel declares 'batch_invariant', the first and last sequence's
                      the same bits alone and in the batch
    range             q scaled so that each row's scores spread by 30 and more (a saturated
                      softmax: P nearly one-hot, its gradients tiny), and v scaled to RANGE_V (an
                      output and a dP far from 1; a kernel that keeps them in a 16-bit dtype
                      loses them), each judged
    empty_rows        query rows that keep no key, made by each way the kernel supports (a mask's
                      rows all False, a bottom-right diagonal with N_q > N_k, a packed batch with
                      a sequence of no queries and one of no keys, a paged cache's sequence of
                      cache_seqlens 0), with a sink logit per head and a bias where it takes
                      them (COMPANIONS): judged under its fully_masked policy (with a sink: out
                      0, lse the sink's logit), so a padded row that leaks into the sink's
                      gradient, dbias, dk or dv fails
    layout            the same sequences laid out otherwise: packed in reverse order, a paged
                      cache's pages renumbered and of twice the size; each layout's results
                      judged, and where the kernel declares 'batch_invariant' each sequence's
                      the same bits in every layout but the page size. For a kernel that
                      returns lse, the keys split across three calls (split-KV decoding, ring
                      attention): each part's results judged, and their merge by lse judged
                      against all the keys' oracle (oracle/split_keys.py)
    nan_keys          a NaN in a key every row attends to must reach every row's out (a kernel
                      that swallows NaN hides its inputs' faults); NaN in the keys no sequence
                      may read (a paged cache's unused page and the rows past cache_seqlens)
                      must not: the results judged as those of the same case without them

    trials = properties(dtypes=..., supports=..., seed=...)   # PropertyTrial, round-robin order
    result = check_property(kernel, trial, promises)          # a PropertyResult

A trial is a small case (grid.make_case), each property's of other shapes than the others' (a
kernel that caches by shape breaks honesty alone): a failure is its smallest case already,
but for `lengths`, whose failing trials name the lengths. Each trial's status is PASS, FAIL, ERROR
(the kernel raised, exited or died, or gave what crosscheck cannot judge) or TIMEOUT.
"""
import math
import time
from typing import NamedTuple

import numpy as np

from .._checks import require_positive_int
from ..options import OPTIONS as OPTION_ROWS
from ..oracle import CaseError, crosscheck
from ..oracle.precision import PRECISIONS
from ..oracle.split_keys import crosscheck_merged, key_parts
from .grid import make_case
from .judge import error_result, other_bits, share_of_bound
from .layouts import emptied, renumbered, repaged, reversed_sequences, sequence_alone, unread_rows
from .kernels import as_kernel
from .supports import EXCLUSIVE, ZERO_ONLY, check_block_sizes, check_dtypes, check_fully_masked, check_supports

PROPERTIES = ("honesty", "lengths", "determinism", "batch_invariance", "range", "empty_rows", "layout", "nan_keys")
EMPTYING = ("mask", "bottom_right", "varlen", "paged")   # empty_rows: the options that leave rows without keys
COMPANIONS = tuple(row.conform for row in OPTION_ROWS if row.neginf)   # and those its trials hold beside
                                                         # them (_with_empty): those a row with no key meets
NEEDS = {"empty_rows": "one of the options mask, bottom_right, varlen, paged",   # a property that needs a support
         "layout": "one of the options varlen, paged or the output lse"}
MULTIPLES = (128, 256, 64, 192, 32, 96, 160, 224, 16, 48, 80, 112, 144, 176, 208, 240)   # halvings first
LENGTHS = tuple(n for m in MULTIPLES for n in (m, m - 1, m + 1))     # every multiple of 16 to 256, +-1
DECLARED_SQUARE = 2048      # lengths: N_q = N_k trials at a declared block size up to this N (above: N_q = 1)
WIDTH = 64                                                           # d of the trials' cases
EMPTY_SHAPES = {"mask": (2, 21, 40), "bottom_right": (2, 41, 23), "varlen": (3, 25, 37),   # (B, N_q, N_k)
                "paged": (3, 11, 39)}   # of each way's empty_rows trial, and of each layout trial:
LAYOUT_SHAPES = {"varlen": (3, 29, 43), "paged": (2, 13, 53),   # (no trial shares another's shapes)
                 "split": (1, 19, 96)}   # keys split where split_at cuts: more queries than some parts' keys
SATURATING = 8.0            # range: q times this (the grid's q spreads each row's scores by about 4)
RANGE_V = 2.0 ** 12         # range: v times this (float16's largest is 65504)


class PropertyTrial(NamedTuple):
    """One check of a property on one case; str(): its id."""
    property: str           # one of PROPERTIES
    dtype: str
    case: object            # grid.ConformCase: the case it runs (batch_invariance: the batch)

    def __str__(self):
        named = self.property in ("range", "nan_keys") or self.case.role == "split"
        role = f"-{self.case.role.replace(' ', '_')}" if named else ""
        return f"{self.property}{role}-{self.case.id}"


class PropertyResult(NamedTuple):
    trial: PropertyTrial
    status: str             # 'PASS', 'FAIL', 'ERROR' or 'TIMEOUT'
    detail: str             # what differed (FAIL), what happened (ERROR, TIMEOUT); else ''
    seconds: float
    arrays: object = None   # a FAIL judged by crosscheck: its case with the kernel's results
    worst: float = math.nan  # lengths: its worst tensor's max abs error over its bound (nan: not judged)
    by_entry: tuple = ()    # batch_invariance: each sequence's worst error over its bound, judged alone


def check_properties(names, argument="properties"):
    """names (None: every one) as a tuple of PROPERTIES, in their order; ValueError naming
    `argument` for an unknown or repeated name."""
    names = PROPERTIES if names is None else ((names,) if isinstance(names, str) else tuple(names))
    for name in names:
        if name not in PROPERTIES:
            raise ValueError(f"{argument} has the unknown name {name!r} ({argument}: {', '.join(PROPERTIES)})")
    if len(set(names)) != len(names):
        raise ValueError(f"{argument} names a property twice: {names!r}")
    return tuple(name for name in PROPERTIES if name in names)


def properties(*, names=None, dtypes=("float32", "bfloat16", "float16"), supports=("gradients",), seed=0,
               fully_masked="zero", block_sizes=()):
    """The trials of the properties `names` (None: all) for a kernel of these dtypes and
    supports (supports.py: its outputs and options shape the trials), round-robin over
    (property, dtype): the first round tries each once. block_sizes: the kernel's along N
    (supports.check_block_sizes): `lengths` also tries each, twice each, and one either side
    (N_q = N_k up to DECLARED_SQUARE, decoding's N_q = 1 at any). For pytest:
    `pytest.mark.parametrize("trial", properties(...), ids=str)` with check_property."""
    names, dtypes = check_properties(names), check_dtypes(dtypes)
    declared = tuple(n for b in check_block_sizes(block_sizes) for n in (b - 1, b, b + 1, 2 * b - 1, 2 * b, 2 * b + 1)
                     if n not in LENGTHS)
    lengths = LENGTHS + tuple(dict.fromkeys(declared))
    options, outputs = check_supports(supports, fully_masked)
    fully_masked = check_fully_masked(fully_masked)
    seed = require_positive_int(seed, "seed", minimum=0)
    groups = 2 if "gqa" in options else 1
    case = lambda dtype, cell, role, batch, n_q, n_k, extra=(), outputs=outputs: make_case(
        dtype, cell, role, tuple(o for o in options if o in extra or o == "gqa"), outputs, batch, 2, groups, n_q,
        n_k, WIDTH, fully_masked, seed)
    queues = []
    for name in names:
        for dtype in dtypes:
            if name == "lengths":
                cases = [case(dtype, name, f"N={n}", 1, n_q, n) for n in lengths for n_q in (n, 1)
                         if n_q == 1 or n <= DECLARED_SQUARE]
            elif name == "batch_invariance":
                cases = [case(dtype, name, "batch of 3", 3, 33, 48)] + \
                    ([case(dtype, name, "packed", 3, 31, 47, extra=("varlen",))] if "varlen" in options else [])
            elif name == "range":
                cases = [case(dtype, name, "saturated", 1, 33, 64), case(dtype, name, "large v", 1, 35, 64)]
            elif name == "empty_rows":
                cases = [case(dtype, name, way, *EMPTY_SHAPES[way], extra=(way,) + _with_empty(way, options, fully_masked))
                         for way in EMPTYING if way in options]
            elif name == "layout":                  # (the parts' forward: out and lse)
                cases = [case(dtype, name, way, *LAYOUT_SHAPES[way], extra=(way,)) for way in LAYOUT_SHAPES
                         if way in options]
                if "lse" in outputs:
                    cases.append(case(dtype, name, "split", *LAYOUT_SHAPES["split"], outputs=("lse",)))
            elif name == "nan_keys":
                cases = [case(dtype, name, "visible", 2, 23, 44)] + \
                    ([case(dtype, name, "unread", 2, 27, 45, extra=("paged",))] if "paged" in options else [])
            else:                                   # one sequence; whole key blocks: the lengths' concern
                cases = [case(dtype, name, "short", 1, 17 if name == "honesty" else 19, 32)]
            queues.append([PropertyTrial(name, dtype, c) for c in cases])
    return [queue[r] for r in range(max(map(len, queues), default=0)) for queue in queues if r < len(queue)]


def _with_empty(way, options, fully_masked):
    """The options an empty_rows trial made `way` holds beside it, COMPANIONS: a sink logit per
    head (with the 'zero' policy) and a bias, where the kernel takes them and the case format
    allows them together."""
    return tuple(o for o in COMPANIONS if o in options and frozenset((way, o)) not in EXCLUSIVE
                 and fully_masked in ZERO_ONLY.get(o, (fully_masked,)))


def fits(trial):
    """fits(case) -> bool: whether a smaller case still tries what `trial`'s property tries (for
    shrink.shrink_trial): the option that makes its rows empty or its layout, its roles' shapes
    (two sequences at least to compare, more queries than keys bottom-right). None: its trials
    are not shrunk (a lengths trial names its length)."""
    name, way = trial.property, trial.case.role
    if name == "lengths":
        return None
    needs = {"batch_invariance": 2, "layout": 2 if way == "varlen" else 1,
             "empty_rows": 2 if way in ("varlen", "paged") else 1}.get(name, 1)
    keys = len(split_at(3)) + 1 if way == "split" else 1             # a key in each part
    kept = {"empty_rows": (way,), "layout": (way,) if way != "split" else (),
            "nan_keys": ("paged",) if way == "unread" else (),
            "batch_invariance": ("varlen",) if way == "packed" else ()}.get(name, ())
    return lambda case: (case.batch >= needs and case.n_k >= keys and all(o in case.options for o in kept)
                         and (way != "bottom_right" or case.n_q > case.n_k) and (way != "mask" or case.n_q >= 2))


class _CallFailed(Exception):
    """The kernel raised, exited, died or timed out: the trial's ERROR or TIMEOUT result."""

    def __init__(self, result):
        super().__init__(result.error)
        self.result = result


def check_property(kernel, trial, promises=()):
    """The PropertyResult of one trial: the kernel (a callable or a command line, called in this
    process; a kernels.Kernel or a worker's) called on its case (and related ones); promises:
    what the kernel declares (supports.PROMISES)."""
    kernel = kernel if hasattr(kernel, "results") else as_kernel(kernel)      # a Kernel, a worker's
    start = time.perf_counter()
    try:
        status, detail, arrays, *measured = _CHECKS[trial.property](kernel, trial.case, promises)
    except _CallFailed as failed:
        return PropertyResult(trial, failed.result.status, failed.result.error, time.perf_counter() - start)
    return PropertyResult(trial, status, detail, time.perf_counter() - start, arrays, **dict(measured))


def _call(kernel, case, arrays=None):
    """The kernel's results on the case's arrays (drawn if not given); _CallFailed if it raised."""
    start = time.perf_counter()
    arrays = case.arrays() if arrays is None else arrays
    try:
        return kernel.results(arrays, case.outputs)
    except (Exception, SystemExit) as exc:    # anything the kernel raises: the trial's ERROR
        raise _CallFailed(error_result(case, exc, start)) from None


def _judged(case, arrays, results, worst=False):
    """(status, detail, arrays with results): crosscheck of the results on the case's arrays;
    with worst, also the worst tensor's max abs error over its bound."""
    judged = {**arrays, **results}
    try:
        report = crosscheck(**judged)
    except CaseError as exc:                  # results that are not a case: the kernel's
        raise _CallFailed(error_result(case, exc, time.perf_counter())) from None
    share = (max(map(share_of_bound, report.rows)),) if worst else ()
    if report:
        return ("PASS", "", None) + share
    failed = "; ".join(f"{row.name}: {', '.join(row.failed)}" for row in report.rows if not row.passed)
    return ("FAIL", failed, judged) + share


def _honesty(kernel, case, promises):
    first, fresh = case, case._replace(seed=case.seed + 1)
    before = _call(kernel, first)
    arrays = fresh.arrays()
    results = _call(kernel, fresh, arrays)
    status, failed, judged = _judged(fresh, arrays, results)
    if status == "PASS":
        return status, "", None
    same = [name for name in results if name in before and np.array_equal(results[name], before[name])]
    said = (f"returned the first call's {', '.join(same)} for fresh inputs of the same shapes" if same
            else f"on fresh inputs of the same shapes after a first call: {failed}")
    return status, said, judged


def _lengths(kernel, case, promises):
    arrays = case.arrays()
    status, failed, judged, worst = _judged(case, arrays, _call(kernel, case, arrays), worst=True)
    return status, failed and f"N_q = {case.n_q}, N_k = {case.n_k}: {failed}", judged, ("worst", worst)


def _determinism(kernel, case, promises):
    arrays = case.arrays()
    results = [_call(kernel, case, arrays) for _ in range(2)]
    if "deterministic" in promises:
        differ = other_bits(results[0], results[1], "between two calls on the same inputs")
        return ("FAIL", differ, None) if differ else ("PASS", "", None)
    for second, result in enumerate(results):
        status, failed, judged = _judged(case, arrays, result)
        if status != "PASS":
            return status, f"call {second + 1} of 2 on the same inputs: {failed}", judged
    return "PASS", "", None


def _batch_invariance(kernel, case, promises):
    arrays = case.arrays()
    whole = _call(kernel, case, arrays)
    found, by_entry = ("PASS", "", None), []
    for b in range(case.batch):                    # (the trials hold no option with a batch axis)
        alone, in_batch = (sequence_alone(arrays, whole, b) if "varlen" in case.options else
                           ({name: x[b:b + 1] if name in ("q", "k", "v", "dout") else x for name, x in arrays.items()},
                            {name: x[b:b + 1] for name, x in whole.items()}))
        if "batch_invariant" in promises and b in (0, case.batch - 1):    # the first and last: bit for bit
            differ = other_bits(in_batch, _call(kernel, case._replace(batch=1), alone), "in the batch and alone")
            if differ:
                return "FAIL", f"sequence {b} of {case.batch}, {differ}", None
        status, failed, judged, worst = _judged(case, alone, in_batch, worst=True)   # each judged alone
        by_entry.append(worst)
        if status != "PASS" and found[0] == "PASS":
            found = status, f"sequence {b} of {case.batch}, in the batch, judged alone: {failed}", judged
    return (*found, ("by_entry", tuple(by_entry)))


def _range(kernel, case, promises):
    arrays = case.arrays()
    storage = PRECISIONS[case.dtype].storage
    name, factor = ("q", SATURATING) if case.role == "saturated" else ("v", RANGE_V)
    arrays[name] = (arrays[name] * factor).astype(storage).astype(np.float32)    # (a power of 2: exact)
    status, failed, judged = _judged(case, arrays, _call(kernel, case, arrays))
    return status, failed and f"{name} times {factor:g} ({case.role}): {failed}", judged


def _empty_rows(kernel, case, promises):
    arrays = case.arrays()
    if case.role == "mask":                        # the first and last rows too: all False
        arrays["mask"][..., [0, -1], :] = False
        made = "rows whose mask is all False"
    elif case.role == "bottom_right":
        made = f"rows 0 to {case.n_q - case.n_k - 1} (a bottom-right diagonal with N_q > N_k)"
    elif case.role == "paged":                     # sequence 1's cache empty
        arrays["cache_seqlens"] = np.where(np.arange(case.batch) == 1, 0, arrays["cache_seqlens"]).astype(
            arrays["cache_seqlens"].dtype)
        made = "a paged cache's sequence with cache_seqlens 0"
    else:                                          # sequence 0 without queries, sequence 1 without keys
        arrays = emptied(arrays)
        made = "a packed sequence with no query and one with no key"
    status, failed, judged = _judged(case, arrays, _call(kernel, case, arrays))
    extra = [o for o in case.options if o in COMPANIONS]
    return status, failed and f"{made}{' with ' + ' and '.join(extra) if extra else ''}: {failed}", judged


def split_at(n_k):
    """Where the layout property's split trial cuts N_k >= 3 keys: three parts of other sizes (a
    kernel that caches by shape is honesty's concern), at whole blocks of 16 for N_k = 96 (16, 32
    and 48 keys: a partial block is the lengths')."""
    return max(1, n_k // 6), max(2, n_k // 2)


def _split(kernel, case):
    arrays, at = case.arrays(), split_at(case.n_k)
    parts = key_parts(arrays, at)
    results = [_call(kernel, case, part) for part in parts]
    edges = (0,) + at + (case.n_k,)
    for part, result, first, end in zip(parts, results, edges, edges[1:]):
        status, failed, judged = _judged(case, part, result)
        if status != "PASS":
            return status, f"keys {first} to {end - 1} alone (of {case.n_k}): {failed}", judged
    try:
        report = crosscheck_merged(arrays, at, results)
    except CaseError as exc:                  # results that cannot be merged: the kernel's
        raise _CallFailed(error_result(case, exc, time.perf_counter())) from None
    if report:
        return "PASS", "", None
    failed = "; ".join(f"{row.name}: {', '.join(row.failed)}" for row in report.rows if not row.passed)
    return "FAIL", f"keys cut at {', '.join(map(str, at))}, three calls merged by lse: {failed}", None


def _layout(kernel, case, promises):
    if case.role == "split":
        return _split(kernel, case)
    arrays = case.arrays()
    first = _call(kernel, case, arrays)
    status, failed, judged = _judged(case, arrays, first)
    if status != "PASS":
        return status, f"as drawn: {failed}", judged
    if case.role == "varlen":
        layouts = [("packed in reverse order", reversed_sequences(arrays), True)]
    else:
        layouts = [("its pages renumbered", renumbered(arrays), True),
                   ("in pages of twice the size", repaged(arrays, 2 * arrays["k"].shape[2]), False)]
    for said, (other, back), same_bits in layouts:
        results = _call(kernel, case, other)
        status, failed, judged = _judged(case, other, results)
        if status != "PASS":
            return status, f"{said}: {failed}", judged
        if same_bits and "batch_invariant" in promises:
            differ = other_bits(first, back(results), f"as drawn and {said}")
            if differ:
                return "FAIL", differ, None
    return "PASS", "", None


def _nan_keys(kernel, case, promises):
    arrays = case.arrays()
    poisoned = dict(arrays)
    if case.role == "visible":                     # key 0 of every sequence and kv head: every row sees it
        for name in ("k", "v"):
            poisoned[name] = arrays[name].copy()
            poisoned[name][..., 0, :] = np.nan
        out = np.asarray(_call(kernel, case, poisoned)["out"], np.float32)
        reached = np.isnan(out).any(axis=-1)
        if reached.all():
            return "PASS", "", None
        first = tuple(int(i) for i in np.argwhere(~reached)[0])
        return ("FAIL", f"a NaN in key 0, which every row attends to, did not reach out in {int((~reached).sum())} "
                f"of {reached.size} rows, the first at {first}", None)
    unread = unread_rows(arrays)                  # [pages, PAGE] the cache's rows no sequence reads
    for name in ("k", "v"):
        poisoned[name] = np.where(unread[:, None, :, None], np.nan, arrays[name]).astype(arrays[name].dtype)
    status, failed, judged = _judged(case, arrays, _call(kernel, case, poisoned))
    return status, failed and (f"NaN in the {int(unread.sum())} cache rows no sequence reads (an unused page, "
                               f"the rows past cache_seqlens) reached the results: {failed}"), judged


_CHECKS = {"honesty": _honesty, "lengths": _lengths, "determinism": _determinism,
           "batch_invariance": _batch_invariance, "range": _range, "empty_rows": _empty_rows,
           "layout": _layout, "nan_keys": _nan_keys}
