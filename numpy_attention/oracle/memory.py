"""How much memory crosscheck needs for a case, told from its shapes before anything of the
size of its scores is allocated, and refused when this machine has less.

    message = too_large(case_bytes, score_shape, tokens=0)   # None, or why it is refused

The estimate (benchmarks/bench_memory.py prints it beside the peak it measures):
    the case's arrays     CASE_COPIES times their bytes (the arrays, their float64 values, the
                          oracle's and the baselines' copies and results)
    a whole case          WHOLE_BYTES per score (at most row_blocks.SCORE_BUDGET of them): the
                          oracle's S, P, dP, dS in float64 (np.longdouble for a float64 case),
                          the baselines', the term magnitudes'
    a large case          BLOCK_BYTES per score of a block of rows (row_blocks.py), for each thread
    top-k lists           TOKEN_BYTES per entry of the token lists (key blocks: their tokens),
                          and KEY_BYTES more for each thread: the tokens, and each run's sorted
                          keys that the pipeline counts a block's keep-mask from (topk.py) and
                          their making; nothing per score
"""
import os

from . import row_blocks

CASE_COPIES = 6
WHOLE_BYTES = 192
BLOCK_BYTES = 256
TOKEN_BYTES = 12
KEY_BYTES = 10
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


def peak_bytes(case_bytes, score_shape, tokens=0, threads=None):
    """(the estimated peak in bytes, what it is made of in words) of crosscheck on a case whose
    arrays take case_bytes, with scores of shape [..., H, N_q, N_k] (module docstring) and top-k
    lists of `tokens` entries (key blocks counted as their tokens); threads: crosscheck's
    workers (default every core this process may use)."""
    scores = row_blocks.score_entries(score_shape)
    threads = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    parts = [(CASE_COPIES * case_bytes, f"its arrays {case_bytes / GIB:.2f} GiB")]
    rows = row_blocks.block_rows(score_shape, 1)
    if rows is None:
        parts.append((WHOLE_BYTES * scores, f"{scores:,} scores formed whole"))
    else:
        block = min(scores, row_blocks.score_entries(score_shape[:-2]) * rows * score_shape[-1])
        parts.append((BLOCK_BYTES * block * threads, f"{scores:,} scores in blocks of rows on {threads} threads"))
    if tokens:
        parts.append(((TOKEN_BYTES + KEY_BYTES * threads) * tokens, f"top-k lists of {tokens:,} entries"))
    return sum(size for size, _ in parts), ", ".join(text for _, text in parts)


def too_large(case_bytes, score_shape, tokens=0, available=None):
    """The refusal's message when the estimated peak exceeds the memory available (the argument,
    default available_bytes()), naming both; None when it fits or the system does not tell."""
    available = available_bytes() if available is None else available
    need, parts = peak_bytes(case_bytes, score_shape, tokens)
    if available is None or need <= available:
        return None
    return (f"the case needs about {need / GIB:.1f} GiB ({parts}); this machine has {available / GIB:.1f} GiB "
            f"available: judge a smaller case, or on a larger machine")
