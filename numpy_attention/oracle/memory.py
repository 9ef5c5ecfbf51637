"""How much memory crosscheck needs for a case, told from its shapes before anything of the
size of its scores is allocated, and refused when this machine has less.

    message = too_large(case_bytes, score_shape, topk=False)   # None, or why it is refused

The estimate (benchmarks/bench_memory.py prints it beside the peak it measures):
    the case's arrays     CASE_COPIES times their bytes (the arrays, their float64 values, the
                          oracle's and the baselines' copies and results)
    a whole case          WHOLE_BYTES per score (at most blocks.SCORE_BUDGET of them): the
                          oracle's S, P, dP, dS in float64 (np.longdouble for a float64 case),
                          the baselines', the term magnitudes'
    a large case          BLOCK_BYTES per score of a block of rows (blocks.py), for each thread
    top-k lists           TOPK_BYTES per score: the dense keep-mask they are judged as (and its
                          counts of repeated keys)
"""
import os

from . import blocks

CASE_COPIES = 6
WHOLE_BYTES = 192
BLOCK_BYTES = 256
TOPK_BYTES = 9
GIB = 2 ** 30


def available_bytes():
    """The memory this process may still take: Linux's MemAvailable, else the machine's physical
    memory; None where the system says neither."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def peak_bytes(case_bytes, score_shape, topk=False, threads=None):
    """(the estimated peak in bytes, what it is made of in words) of crosscheck on a case whose
    arrays take case_bytes, with scores of shape [..., H, N_q, N_k] (module docstring); threads:
    the large case's workers (default every core this process may use)."""
    scores = blocks.score_entries(score_shape)
    parts = [(CASE_COPIES * case_bytes, f"its arrays {case_bytes / GIB:.2f} GiB")]
    rows = blocks.block_rows(score_shape, 1)
    if rows is None:
        parts.append((WHOLE_BYTES * scores, f"{scores:,} scores formed whole"))
    else:
        threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
        block = min(scores, blocks.score_entries(score_shape[:-2]) * rows * score_shape[-1])
        parts.append((BLOCK_BYTES * block * threads, f"{scores:,} scores in blocks of rows on {threads} threads"))
    if topk:
        parts.append((TOPK_BYTES * scores, "the dense keep-mask its top-k lists are judged as"))
    return sum(size for size, _ in parts), ", ".join(text for _, text in parts)


def too_large(case_bytes, score_shape, topk=False, available=None):
    """The refusal's message when the estimated peak exceeds the memory available (the argument,
    default available_bytes()), naming both; None when it fits or the system does not tell."""
    available = available_bytes() if available is None else available
    need, parts = peak_bytes(case_bytes, score_shape, topk)
    if available is None or need <= available:
        return None
    return (f"the case needs about {need / GIB:.1f} GiB ({parts}); this machine has {available / GIB:.1f} GiB "
            f"available: judge a smaller case, or on a larger machine")
