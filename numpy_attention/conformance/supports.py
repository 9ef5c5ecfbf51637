"""What a kernel supports: the dtypes and options a conformance run sweeps, checked by name.

    dtypes    float32, bfloat16, float16: what the kernel computes in (its tensors' dtype)
    options   the variants of a case, one row of the table each (besides 'plain'); those of
              options.OPTIONS pass the kernel its keyword, drawn by the row's draw with any
              companion it needs, dropout_p beside its mask (the values: docs/conform.md):
                causal        causal=True, top-left (torch's is_causal)
                bottom_right  causal='bottom_right' (FlashAttention 2.1+); a case of the table's pair
                              options (kernels.PAIRS) aligns them there too
                gqa           grouped-query heads: k, v with H_kv < H heads
{table}
                varlen        packed sequences: q [H, total_q, d], cu_seqlens_q, cu_seqlens_k
                paged         a paged KV cache: k, v [pages, H_kv, page, d], page_table, cache_seqlens
    outputs   what the kernel returns besides out, on every case:
                lse           the logsumexp [..., H, N_q], natural log
                max_logits    each row's largest score [..., H, N_q], after the scale (-inf: no key)
                gradients     dq, dk, dv (and the options' gradients where it gives them)
    promises  what the kernel's results keep, held bit for bit by the properties (properties.py):
                deterministic     the same inputs give the same bits
                batch_invariant   a sequence's results are the same bits alone and in a batch

Defaults: the three dtypes, 'causal', 'gqa' and 'gradients'. A kernel declares its own
with declare() (the conformance run reads the declaration when its arguments are None):

    @declare(supports=("causal", "bottom_right", "gqa", "lse"), dtypes=("bfloat16",))
    def my_attention(q, k, v, **options): ...
"""
import difflib
from typing import NamedTuple

import numpy as np

from .._checks import require_choice
from ..near_misses import OTHER_NAMES
from ..options import OPTIONS as OPTION_ROWS

_CONFORM = {row.name: row.conform for row in OPTION_ROWS if row.conform}   # a table's option -> its name here
if __doc__:                                 # the table's rows, each as a kernel is called with it
    __doc__ = __doc__.replace("{table}", "\n".join(f"{'':16}{name:<14}{option}="
                                                   for option, name in _CONFORM.items()))
DTYPES = ("float32", "bfloat16", "float16")
OPTIONS = (("causal", "bottom_right", "gqa") + tuple(row.conform for row in OPTION_ROWS if row.conform)
           + ("varlen", "paged"))          # attention_forward's options by the table's conform names
OUTPUTS = ("lse", "max_logits", "gradients")
PROMISES = ("deterministic", "batch_invariant")
PLAIN = "plain"                             # the table's row of cases with no option
MAX_BLOCK = 4096                            # the largest block size a kernel may declare
DEFAULT_SUPPORTS = ("causal", "gqa", "gradients")
FULLY_MASKED = ("zero", "uniform", "nan")   # attention_forward's policies for a row with no key
KINDS = ("torch", "jax", "numpy", "command")
# options that one case cannot hold together (the case format refuses them, or they contradict)
EXCLUSIVE = frozenset(frozenset(pair) for pair in (
    ("causal", "bottom_right"), ("varlen", "paged"), ("varlen", "mask"), ("varlen", "bias"),
    ("varlen", "dropout"), ("paged", "mask"), ("paged", "bias"), ("paged", "dropout"), ("paged", "gate")))
# options that take some fully_masked policies only (attention_forward's rules)
ZERO_ONLY = {"varlen": ("zero", "nan"), "paged": ("zero", "nan"),
             **{row.conform: row.policies for row in OPTION_ROWS if row.policies}}
# other names for an option or a dtype: what to write instead
NEAR_MISSES = {
    "top_left": "top-left causal is 'causal'", "is_causal": "'causal' (top-left)",
    "causal_lower_right": "'bottom_right'", "enable_gqa": "'gqa'", "mqa": "'gqa' (H_kv = 1 included)",
    "attn_mask": "'mask' (bool) or 'bias' (float)", "cu_seqlens": "'varlen'", "page_table": "'paged'",
    "kv_cache": "'paged'", "logsumexp": "'lse'", "grad": "'gradients'", "grads": "'gradients'",
    "backward": "'gradients'", "bf16": "'bfloat16'", "fp16": "'float16'", "half": "'float16'",
    "fp32": "'float32'", "float": "'float32'", "float64": "'float32' (float64 is the oracle's)",
    **{row.name: f"'{row.conform}'" for row in OPTION_ROWS if row.conform not in (None, row.name)},
    **{other: f"'{_CONFORM[option]}'" for other, option in OTHER_NAMES.items()},
}


class Declaration(NamedTuple):
    """What a kernel declares (None: the conformance run's default)."""
    kind: object            # 'torch', 'jax', 'numpy', 'command' or None (told from the kernel)
    supports: object        # tuple of OPTIONS, OUTPUTS and PROMISES names, or None
    dtypes: object          # tuple of DTYPES, or None
    fully_masked: object    # the kernel's policy for a row with no key (FULLY_MASKED), or None
    block_sizes: object = None   # the kernel's block sizes along N (the lengths property tries
                                 # them and twice them, one either side), or None


def _unknown(name, argument, known):
    """The message for a name not among `known`: its near miss, difflib's guess, or the list."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = NEAR_MISSES.get(name) or (f"'{close[0]}'" if close else None)
    names = ", ".join(known)
    return (f"{argument} has the unknown name {name!r}" + (f": did you mean {hint}?" if hint else "")
            + f" ({argument}: {names})")


def _names(values, argument, known):
    """`values` (a name or an iterable of names) as a tuple in `known`'s order; ValueError naming
    `argument` for an unknown or repeated name, TypeError for a value that is not a name."""
    values = (values,) if isinstance(values, str) else values
    try:
        values = tuple(values)
    except TypeError:
        raise TypeError(f"{argument} must be a name or a sequence of names, got {values!r}") from None
    for name in values:
        if not isinstance(name, str):
            raise TypeError(f"{argument} must hold names (strings), got {name!r}")
        if name not in known:
            raise ValueError(_unknown(name, argument, known))
    if len(set(values)) != len(values):
        raise ValueError(f"{argument} names an option twice: {values!r}")
    return tuple(name for name in known if name in values)


def check_dtypes(dtypes, argument="dtypes"):
    """dtypes as a non-empty tuple of DTYPES names, in DTYPES order (errors name `argument`)."""
    names = _names(dtypes, argument, DTYPES)
    if not names:
        raise ValueError(f"{argument} is empty: name at least one of {', '.join(DTYPES)}")
    return names


def check_supports(supports, fully_masked="zero", argument="supports"):
    """(options, outputs): supports split into case OPTIONS and OUTPUTS, each in its order
    ('plain' is always run and may be named; PROMISES are accepted: promises() reads them).
    ValueError naming `argument` for an unknown name, or for an option that does not go with
    the kernel's fully_masked policy."""
    names = _names(supports, argument, (PLAIN,) + OPTIONS + OUTPUTS + PROMISES)
    fully_masked = check_fully_masked(fully_masked)
    for name, policies in ZERO_ONLY.items():
        if name in names and fully_masked not in policies:
            raise ValueError(f"{argument} has {name!r}, which takes fully_masked in {policies}, "
                             f"and fully_masked is {fully_masked!r}")
    return (tuple(n for n in names if n in OPTIONS), tuple(n for n in names if n in OUTPUTS))


def promises(supports):
    """The PROMISES among supports (checked by check_supports), in their order."""
    return tuple(name for name in PROMISES if name in supports)


def check_fully_masked(fully_masked):
    return require_choice(fully_masked, "fully_masked", FULLY_MASKED)


def check_kind(kind):
    return None if kind is None else require_choice(kind, "kind", KINDS)


def check_block_sizes(block_sizes, argument="block_sizes"):
    """block_sizes as a sorted tuple of distinct integers in [2, MAX_BLOCK] (an int: one);
    ValueError / TypeError naming `argument`."""
    sizes = (block_sizes,) if isinstance(block_sizes, (int, np.integer)) else block_sizes
    try:
        sizes = tuple(sizes)
    except TypeError:
        raise TypeError(f"{argument} must be an integer or a sequence of integers, got {block_sizes!r}") from None
    for size in sizes:
        if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or not 2 <= size <= MAX_BLOCK:
            raise ValueError(f"{argument} must hold integers from 2 to {MAX_BLOCK} (a kernel's block along N), "
                             f"got {size!r}")
    return tuple(sorted({int(size) for size in sizes}))


def declare(kernel=None, *, kind=None, supports=None, dtypes=None, fully_masked=None, block_sizes=None):
    """Attach a Declaration to `kernel` (a function or any object that takes attributes), as
    its `conform_declaration`; with kernel None, a decorator that does. Checked at once:
    ValueError / TypeError naming the argument. Returns the kernel itself."""
    declaration = Declaration(
        kind=check_kind(kind),
        supports=None if supports is None else _names(supports, "supports", (PLAIN,) + OPTIONS + OUTPUTS + PROMISES),
        dtypes=None if dtypes is None else check_dtypes(dtypes),
        fully_masked=None if fully_masked is None else check_fully_masked(fully_masked),
        block_sizes=None if block_sizes is None else check_block_sizes(block_sizes))
    if declaration.supports is not None:
        check_supports(declaration.supports, declaration.fully_masked or "zero")

    def attach(kernel):
        if isinstance(kernel, str):
            raise TypeError("declare() cannot attach to a command line (a str): pass supports=, "
                            "dtypes=, fully_masked= and block_sizes= to conform() instead")
        kernel.conform_declaration = declaration
        return kernel
    return attach if kernel is None else attach(kernel)


def declaration_of(kernel):
    """The kernel's Declaration (all None if it has none)."""
    found = getattr(kernel, "conform_declaration", None)
    return found if isinstance(found, Declaration) else Declaration(None, None, None, None, None)
