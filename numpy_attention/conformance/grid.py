"""The case grid of a conformance run: the shapes and options kernel test suites sweep.

One cell of the grid per (option, dtype): 'plain' and each option the kernel supports
(supports.py), times each of its dtypes. Each cell holds PER_ROLE cases per ROLE, from a
single key to the long sequences:

    role        (N_q, N_k)
    one key     N_k = 1 (with N_q = 1: decoding's first step); dq, dk are 0 exactly
    decoding    N_q = 1 over 64 to 2048 keys
    short, unequal, equal, medium, long     N_q != N_k as well as equal, up to 2048

so that the grid meets the lengths {1, 3, 64, 113, 128, 239, 256, 512, 799, 1024, 2048};
cell c takes the pairs (c + seed + 2j) mod 5, j < PER_ROLE, of each role, and any 3 cells in
a row take them all. The rest is drawn, deterministically from the seed: the batch (1-4),
the heads (1-8; 2-8 with grouped-query heads, 2 to 4 query heads per kv head), the head
width (32, 40, 64, 72, 96, 128), and from the third role on, companions: up to
MAX_COMPANIONS other supported options join the cell's, drawn at random among those that go
with it (the shrinker then finds which one a failure needs). Batch and heads shrink until a
case has at most MAX_SCORES scores B H N_q N_k (one head of 2048 x 2048 stays, two with
grouped-query heads).
Fully masked rows come where the options make them: a mask masks one row of each sequence,
a bottom-right diagonal with N_q > N_k, the keys a narrow pair option keeps (kernels.PAIRS),
a packed sequence with no key.

The sweep's order (cases()) is round-robin: round r holds role r of every cell, smallest
first, so that a short budget still meets every cell; after the roles' first cases (j = 0)
come their second ones (j = 1), in the same order.

A ConformCase is a record of the shapes and option names; its arrays (draw) are drawn from
the seed and the case's id, rounded to its dtype, and stored as crosscheck's case format
(oracle/schema.py): q, k, v, dout as float32 arrays holding the dtype's values, with the
`precision` key.
"""
import zlib
from typing import NamedTuple

import numpy as np

from .._checks import require_positive_int
from ..options import OPTIONS, Sizes
from ..oracle.precision import PRECISIONS
from .supports import (DEFAULT_SUPPORTS, DTYPES, EXCLUSIVE, PLAIN, check_dtypes, check_fully_masked,
                       check_supports)

ROLES = (                                  # (N_q, N_k) pairs of each role, smallest role first
    ("one key", ((1, 1), (3, 1), (64, 1), (113, 1), (239, 1))),
    ("decoding", ((1, 64), (1, 113), (1, 239), (1, 799), (1, 2048))),
    ("short", ((3, 3), (3, 64), (64, 3), (64, 64), (3, 113))),
    ("unequal", ((64, 113), (113, 64), (113, 239), (239, 128), (128, 256))),
    ("equal", ((113, 113), (128, 128), (239, 239), (256, 256), (799, 799))),
    ("medium", ((256, 512), (512, 256), (512, 512), (128, 799), (799, 239))),
    ("long", ((1024, 1024), (799, 1024), (1024, 512), (512, 2048), (2048, 2048))),
)
LENGTHS = (1, 3, 64, 113, 128, 239, 256, 512, 799, 1024, 2048)
WIDTHS = (32, 40, 64, 72, 96, 128)          # head widths d_k = d_v, the odd ones beside 2^n
MAX_BATCH, MAX_HEADS, GROUPS = 4, 8, (2, 3, 4)
PER_ROLE = 2                                # cases of each role in each cell
MAX_SCORES = 2 ** 21                        # B H N_q N_k of a case, where batch and heads allow
COMPANION_FROM = 2                          # the first role whose cases get companion options
MAX_COMPANIONS = 2                          # other options a case may hold beside its cell's
PAGE = 16                                   # rows per page of a paged KV cache


class ConformCase(NamedTuple):
    """One case of the grid: shapes and option names; draw() gives its arrays. str(): its id."""
    id: str                 # e.g. 'bfloat16-causal+gqa-b2h8kv2-q113k239-d72-lse+grad'
    dtype: str              # what the kernel computes in: 'float32', 'bfloat16', 'float16'
    cell: str               # the table row it belongs to: 'plain' or an option
    role: str               # its role in the cell (ROLES): 'one key', 'decoding', ... 'long'
    options: tuple          # its options (supports.OPTIONS order), e.g. ('causal', 'gqa')
    outputs: tuple          # what the kernel returns besides out: ('lse', 'gradients') or fewer
    batch: int              # B (with varlen or paged: the sequences)
    kv_heads: int           # H_kv
    groups: int             # query heads per kv head: H = H_kv * groups (1 without gqa)
    n_q: int                # N_q (varlen: the longest sequence's)
    n_k: int                # N_k (varlen, paged: the longest sequence's)
    d: int                  # d_k = d_v
    fully_masked: str       # the policy the case is judged with: 'zero', 'uniform', 'nan'
    seed: int               # with the id, the seed of its values

    def __str__(self):
        return self.id

    @property
    def scores(self):
        """B H N_q N_k: the case's size, what the sweep orders a round by."""
        return self.batch * self.kv_heads * self.groups * self.n_q * self.n_k

    @property
    def tokens(self):
        """B (N_q + N_k): the tokens of its sequences."""
        return self.batch * (self.n_q + self.n_k)

    def arrays(self):
        """The case as crosscheck's keyword arguments (draw)."""
        return draw(self)


def make_case(dtype, cell, role, options, outputs, batch, kv_heads, groups, n_q, n_k, d, fully_masked, seed):
    """A ConformCase with its id (the id names every field but the seed, the cell and the role)."""
    tags = "+".join(["out"] + [{"lse": "lse", "max_logits": "max", "gradients": "grad"}[name] for name in outputs])
    shape = f"b{batch}h{kv_heads * groups}kv{kv_heads}-q{n_q}k{n_k}-d{d}"
    policy = "" if fully_masked == "zero" else f"-{fully_masked}"
    case_id = f"{dtype}-{'+'.join(options) or PLAIN}-{shape}-{tags}{policy}"
    return ConformCase(case_id, dtype, cell, role, tuple(options), tuple(outputs), batch, kv_heads, groups,
                       n_q, n_k, d, fully_masked, seed)


def cases(*, dtypes=DTYPES, supports=DEFAULT_SUPPORTS, seed=0, fully_masked="zero"):
    """The grid's cases in the sweep's order (round-robin over the cells, smallest first).

    Args:
        dtypes: names of supports.DTYPES.
        supports: names of supports.OPTIONS and OUTPUTS (supports.py).
        seed: an integer >= 0; the grid is a function of these arguments.
        fully_masked: the kernel's policy for a row with no key (attention_forward's).
    Returns:
        list of ConformCase, ids unique; `pytest.mark.parametrize("case", cases(...), ids=str)`.
    """
    dtypes = check_dtypes(dtypes)
    options, outputs = check_supports(supports, fully_masked)
    fully_masked = check_fully_masked(fully_masked)
    seed = require_positive_int(seed, "seed", minimum=0)
    cells = [(cell, dtype) for cell in (PLAIN,) + options for dtype in dtypes]
    rounds = [[] for _ in range(PER_ROLE * len(ROLES))]
    for c, (cell, dtype) in enumerate(cells):
        rng = np.random.default_rng([seed, c])
        for j in range(PER_ROLE):
            for r, (role, pairs) in enumerate(ROLES):
                n_q, n_k = pairs[(c + seed + 2 * j) % len(pairs)]
                chosen = _options(rng, cell, options, companions=r >= COMPANION_FROM)
                rounds[j * len(ROLES) + r].append(
                    _sized(rng, dtype, cell, role, chosen, outputs, n_q, n_k, fully_masked, seed))
    ordered, seen = [], set()
    for round_cases in rounds:
        for case in sorted(round_cases, key=lambda case: (case.scores, case.id)):
            if case.id not in seen:                  # two cells may draw one case: it runs once
                seen.add(case.id)
                ordered.append(case)
    return ordered


def _options(rng, cell, supported, companions):
    """The cell's option (none for 'plain') and, with companions, 0 to MAX_COMPANIONS other
    supported options drawn at random (one that does not go with those chosen is left out)."""
    if cell == PLAIN:
        return ()
    chosen = [cell]
    if companions:
        others = [str(name) for name in rng.permutation([n for n in supported if n != cell])]
        for name in others[:rng.integers(0, MAX_COMPANIONS + 1)]:
            if all(frozenset((name, other)) not in EXCLUSIVE for other in chosen):
                chosen.append(name)
    return tuple(name for name in supported if name in chosen)


def _sized(rng, dtype, cell, role, options, outputs, n_q, n_k, fully_masked, seed):
    """A case of these lengths with drawn batch, heads and width, within MAX_SCORES."""
    batch = int(rng.integers(1, MAX_BATCH + 1))
    groups = int(rng.choice(GROUPS)) if "gqa" in options else 1
    kv_heads = int(rng.integers(1, MAX_HEADS // groups + 1))
    d = int(rng.choice(WIDTHS))
    while batch * kv_heads * groups * n_q * n_k > MAX_SCORES and batch * kv_heads > 1:
        batch, kv_heads = (batch // 2, kv_heads) if batch > 1 else (batch, kv_heads // 2)
    return make_case(dtype, cell, role, options, outputs, batch, kv_heads, groups, n_q, n_k, d,
                     fully_masked, seed)


def draw(case):
    """The case's arrays: crosscheck's keyword arguments (the .npz keys) without the results.

    q [B, H, N_q, d], k, v [B, H_kv, N_k, d], dout [B, H, N_q, d] (with 'gradients'): float32
    arrays holding values of case.dtype; with varlen q [H, total_q, d], k, v [H_kv, total_k, d];
    with paged k, v [pages, H_kv, PAGE, d]. Options as 0-d or small arrays (schema.py), the
    float ones (schema.FLOAT_OPTIONS: bias, gate and the per-head vectors of options.HEAD_ROWS)
    rounded to the dtype; precision names the dtype.
    """
    rng = np.random.default_rng([case.seed, zlib.crc32(case.id.encode())])
    storage = PRECISIONS[case.dtype].storage
    rounded = lambda x: x.astype(storage).astype(np.float32)
    normal = lambda *shape: rounded(rng.standard_normal(shape))
    o = set(case.options)
    heads, b, n_q, n_k, d = case.kv_heads * case.groups, case.batch, case.n_q, case.n_k, case.d
    arrays = {}
    if "varlen" in o:
        lengths_q, lengths_k = _lengths(rng, b, n_q), _lengths(rng, b, n_k, empty=True)
        arrays["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(lengths_q)]).astype(np.int32)
        arrays["cu_seqlens_k"] = np.concatenate([[0], np.cumsum(lengths_k)]).astype(np.int32)
        q_shape, k_shape = (heads, int(lengths_q.sum()), d), (case.kv_heads, int(lengths_k.sum()), d)
    elif "paged" in o:
        per_sequence = -(-n_k // PAGE)
        pages = b * per_sequence + 1                          # one page that no sequence uses
        arrays["page_table"] = rng.permutation(pages)[:b * per_sequence].reshape(b, per_sequence).astype(np.int32)
        arrays["cache_seqlens"] = _lengths(rng, b, n_k).astype(np.int32)
        q_shape, k_shape = (b, heads, n_q, d), (pages, case.kv_heads, PAGE, d)
    else:
        q_shape, k_shape = (b, heads, n_q, d), (b, case.kv_heads, n_k, d)
    arrays["q"] = rounded(rng.uniform(0.5, 2.0) * rng.standard_normal(q_shape))   # sharper or flatter P
    arrays["k"], arrays["v"] = normal(*k_shape), normal(*k_shape)
    if "gradients" in case.outputs:
        arrays["dout"] = normal(*q_shape)
    if "causal" in o:
        arrays["causal"] = np.array(True)
    if "bottom_right" in o:
        arrays["causal"] = np.array("bottom_right")
    sizes = Sizes(b, heads, n_q, n_k, d, q_shape)
    for row in OPTIONS:                                   # the options' own draws, in the table's order
        if row.conform in o and row.draw is not None:
            drawn = {name: np.asarray(x) for name, x in row.draw(rng, sizes).items()}
            arrays.update({name: rounded(x) if x.ndim and x.dtype.kind == "f" else x for name, x in drawn.items()})
    if case.fully_masked != "zero":
        arrays["fully_masked"] = np.array(case.fully_masked)
    arrays["precision"] = np.array(case.dtype)
    return arrays


def _lengths(rng, b, longest, empty=False):
    """[B] sequence lengths in [1, longest], one of them `longest`; with `empty`, one other of
    them 0 half the time (a sequence with no key: its query rows are fully masked)."""
    lengths = rng.integers(1, longest + 1, b)
    top = int(rng.integers(0, b))
    lengths[top] = longest
    if empty and b > 1 and rng.random() < 0.5:
        lengths[(top + 1) % b] = 0
    return lengths
