"""The conformance run: sweep a kernel over the grid, judge each case, shrink each failure.

    report = conform(kernel, dtypes=..., supports=..., budget=..., seed=..., out_dir=...)
    print(report); assert report                 # a ConformReport, truthy iff every case passes

1. the grid (grid.cases): one cell per (option, dtype) the kernel supports, in round-robin order;
2. the sweep: each case drawn, given to the kernel (kernels.py), judged by crosscheck (judge.py);
   a kernel that raises gives an ERROR row. With a budget, no case starts once it is spent
   (the first always runs); the report says how many of the grid's cases ran;
3. each failing cell's smallest failing case shrunk (shrink.py), and with out_dir saved there
   as a crosscheck case with the kernel's results (`numpy-attention crosscheck FILE.npz`
   re-judges it), with a picture of its errors where matplotlib is installed.

conform.cases and conform.check are the grid and one case's judgement, for a pytest
parametrize of the same cases (docs/conform.md); conform.declare declares a kernel's support.
"""
import os
from time import monotonic

from .._checks import require_positive_real
from ..oracle import save_case
from ..oracle.errormap import plot_error_maps
from .grid import cases
from .judge import check, evaluate
from .kernels import as_kernel
from .progress import progress_bar
from .report import ConformReport, Failure
from .shrink import shrink
from .supports import (DEFAULT_SUPPORTS, DTYPES, check_dtypes, check_fully_masked, check_supports,
                       declaration_of, declare)


def conform(kernel, *, dtypes=None, supports=None, budget=None, seed=0, out_dir=None, kind=None,
            fully_masked=None, progress=None):
    """Run the kernel on the grid's cases and judge each against the oracle.

    Args:
        kernel: a torch, JAX or NumPy callable fn(q, k, v, **options), or a command line
            with {in} and {out} (kernels.py).
        dtypes: names among 'float32', 'bfloat16', 'float16'; supports: the options and
            outputs it supports (supports.py). None: the kernel's declaration (declare), else
            the defaults: every dtype; 'causal', 'gqa', 'gradients'.
        budget: seconds, or None (the whole grid): no case starts after them.
        seed: an integer >= 0: the grid and its values (grid.py).
        out_dir: a directory for each shrunk failing case (.npz, .png), made if needed;
            None writes no file.
        kind: 'torch', 'jax', 'numpy' or 'command': overrides the kind told from the kernel.
        fully_masked: the kernel's policy for a row with no key ('zero', 'uniform', 'nan');
            None: its declaration's, else 'zero'.
        progress: a bar on stderr (progress.py); None: iff stderr is a terminal.
    Returns:
        ConformReport (report.py): truthy iff every case run passed; str() the table, to_json().
    """
    declared = declaration_of(kernel)
    dtypes = check_dtypes(_given(dtypes, declared.dtypes, DTYPES))
    fully_masked = check_fully_masked(_given(fully_masked, declared.fully_masked, "zero"))
    options, outputs = check_supports(_given(supports, declared.supports, DEFAULT_SUPPORTS), fully_masked)
    budget = None if budget is None else require_positive_real(budget, "budget")
    if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"out_dir must be a path (str or os.PathLike) or None, got {out_dir!r}")
    runner = as_kernel(kernel, kind)
    grid = cases(dtypes=dtypes, supports=options + outputs, seed=seed, fully_masked=fully_masked)
    start = monotonic()
    results, smallest = [], {}              # (cell, dtype) -> (result, arrays) of its smallest failure
    bar = progress_bar(len(grid), progress)
    try:
        for case in grid:
            if budget is not None and results and monotonic() - start >= budget:
                break
            result, arrays = evaluate(runner, case)
            results.append(result)
            cell = (case.cell, case.dtype)
            if result.status == "FAIL" and (cell not in smallest or case.scores < smallest[cell][0].case.scores):
                smallest[cell] = (result, arrays)
            bar.update(result.status != "PASS")
    finally:
        bar.close()
    swept = monotonic()
    failures = []
    for (option, dtype), (result, arrays) in smallest.items():
        shrunk = shrink(runner, result.case, result.report, arrays)
        file, picture = _save(shrunk, out_dir) if out_dir is not None else (None, None)
        failures.append(Failure(option, dtype, shrunk, file, picture))
    return ConformReport(kernel=runner.name, kind=runner.kind, seed=seed, dtypes=dtypes,
                         supports=options + outputs, fully_masked=fully_masked, budget=budget,
                         grid_size=len(grid), results=tuple(results), failures=tuple(failures),
                         seconds=swept - start, shrink_seconds=monotonic() - swept)


def _given(argument, declared, default):
    """The argument if given, else the kernel's declaration, else the default."""
    return argument if argument is not None else declared if declared is not None else default


def _save(shrunk, out_dir):
    """(the .npz path, the .png path or None): the shrunk case with the kernel's results saved
    as a crosscheck case in out_dir, named by its id, and its error maps."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(os.fspath(out_dir), f"{shrunk.case.id}.npz")
    save_case(path, **shrunk.arrays)
    return path, _picture(path.removesuffix(".npz") + ".png", shrunk.arrays)


def _picture(path, arrays):
    """The case's error maps written to path (oracle/errormap.py); None where matplotlib
    is not installed."""
    try:
        plot_error_maps(path, **arrays)
    except ImportError:                     # matplotlib, imported when it draws
        return None
    return path


conform.cases = cases
conform.check = check
conform.declare = declare
