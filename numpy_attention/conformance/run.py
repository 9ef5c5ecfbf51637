"""The conformance run: sweep a kernel over the grid, judge each case, shrink each failure.

    report = conform(kernel, dtypes=..., supports=..., budget=..., seed=..., out_dir=...)
    print(report); assert report                 # a ConformReport, truthy iff the run passed

1. the grid (grid.cases): one cell per (option, dtype) the kernel supports, in round-robin order;
   with out_dir, the run's record opened there (record.py): a directory that cannot be
   written is refused before any kernel runs;
2. the sweep: each case drawn, given to the kernel (kernels.py), judged by crosscheck (judge.py),
   and written to the record and, if it does not pass, to stderr (progress.py) as it comes.
   A Python kernel runs in a worker process (worker.py) unless isolate=False: a case it
   raises on, exits in, or dies in (a segfault, os.abort) is an ERROR row, one with no
   results within `timeout` seconds a TIMEOUT row, and the sweep goes on. With a budget, no
   case starts once it is spent (the first always runs);
3. the properties (properties.py): their trials, round-robin over (property, dtype), in the
   budget's last PROPERTY_SHARE (the first round always runs); with out_dir, each failing
   trial that crosscheck judged saved there as a case with the kernel's results;
4. each failing cell's smallest failing case shrunk (shrink.py), and with out_dir saved there
   as a crosscheck case with the kernel's results (`numpy-attention crosscheck FILE.npz`
   re-judges it), with a picture of its errors where matplotlib is installed.

The run passes only when every case and trial run passed, it covered every role of every
cell and it ran every trial (run_report.py); a Ctrl-C raises ConformInterrupted, a
KeyboardInterrupt that carries the report of what was done (the command prints it).
conform.cases and conform.check are the grid and one case's judgement, in this process, for a
pytest parametrize of the same cases (docs/conform.md), conform.properties and
conform.check_property the properties' trials and one trial's result; conform.declare declares
a kernel's support.
"""
import contextlib
import os
from time import monotonic

from .._checks import require_positive_real
from ..oracle import save_case
from ..oracle.errormap import plot_error_maps
from .grid import cases
from .judge import check, evaluate
from .kernels import as_kernel
from .progress import progress_bar
from .pictures import pictures as property_pictures
from .properties import check_properties, check_property, fits, properties as property_trials
from .record import Record
from .run_report import ConformReport, Failure, case_json, case_line, trial_json, wrapped
from .shrink import MAX_STEPS, shrink, shrink_trial
from .supports import (DEFAULT_SUPPORTS, DTYPES, check_block_sizes, check_dtypes, check_fully_masked,
                       check_supports, declaration_of, declare, promises)
from .worker import Worker

TIMEOUT = 60.0              # seconds a case may take by default
PROPERTY_SHARE = 0.25       # of a budget, the properties' (the grid's sweep stops before it)


class ConformInterrupted(KeyboardInterrupt):
    """A Ctrl-C during a conformance run; .report: the ConformReport of what was done."""

    def __init__(self, report):
        super().__init__("the conformance run was interrupted")
        self.report = report


def conform(kernel, *, dtypes=None, supports=None, budget=None, seed=0, out_dir=None, kind=None,
            fully_masked=None, progress=None, timeout=TIMEOUT, isolate=True, properties=None, block_sizes=None):
    """Run the kernel on the grid's cases and judge each against the oracle.

    Args:
        kernel: a torch, JAX or NumPy callable fn(q, k, v, **options), or a command line
            with {in} and {out} (kernels.py).
        dtypes: names among 'float32', 'bfloat16', 'float16'; supports: the options and
            outputs it supports (supports.py). None: the kernel's declaration (declare), else
            the defaults: every dtype; 'causal', 'gqa', 'gradients'.
        budget: seconds, or None (the whole grid and every trial): no case starts after them;
            with properties, the grid's sweep stops at (1 - PROPERTY_SHARE) of them.
        seed: an integer >= 0: the grid and its values (grid.py).
        out_dir: a directory for the run's record (conform.jsonl) and each shrunk failing case
            (.npz, .png), made if needed; None writes no file.
        kind: 'torch', 'jax', 'numpy' or 'command': overrides the kind told from the kernel.
        fully_masked: the kernel's policy for a row with no key ('zero', 'uniform', 'nan');
            None: its declaration's, else 'zero'.
        progress: lines on stderr as the run goes (progress.py); None: iff stderr is a terminal.
        timeout: seconds a case may take (the kernel's call), or None (no limit); a case that
            takes longer is stopped, a TIMEOUT row. It holds for a command line, and for a
            Python kernel in its worker process.
        isolate: True: a Python kernel runs in a worker process (worker.py; it must be
            importable there: TypeError naming it if not). False: in this process, with no
            timeout; what it raises or exits with is still an ERROR row, but a crash or a
            hang is the run's.
        properties: names among properties.PROPERTIES (None: all; () none): the properties
            checked beside the grid (properties.py), with the kernel's promises among supports
            ('deterministic', 'batch_invariant') held bit for bit.
        block_sizes: the kernel's block sizes along N (integers from 2 to 4096): the lengths
            property also tries each, twice each, and one either side. None: its declaration's.
    Returns:
        ConformReport (run_report.py): truthy iff the run passed; str() the table, to_json().
    Raises:
        ConformInterrupted (a KeyboardInterrupt) on a Ctrl-C, with the report so far;
        OSError naming the path for an out_dir that cannot be written, before the sweep.
    """
    declared = declaration_of(kernel)
    dtypes = check_dtypes(_given(dtypes, declared.dtypes, DTYPES))
    fully_masked = check_fully_masked(_given(fully_masked, declared.fully_masked, "zero"))
    supports = _given(supports, declared.supports, DEFAULT_SUPPORTS)
    block_sizes = check_block_sizes(_given(block_sizes, declared.block_sizes, ()))
    if not isinstance(supports, str):                  # read twice (an iterator, once)
        with contextlib.suppress(TypeError):           # not iterable: check_supports says what it must be
            supports = tuple(supports)
    options, outputs = check_supports(supports, fully_masked)
    promised = promises(supports)
    names = check_properties(properties)
    budget = None if budget is None else require_positive_real(budget, "budget")
    timeout = None if timeout is None else require_positive_real(timeout, "timeout")
    if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"out_dir must be a path (str or os.PathLike) or None, got {out_dir!r}")
    if not isinstance(isolate, bool):
        raise TypeError(f"isolate must be True or False, got {isolate!r}")
    runner = as_kernel(kernel, kind, timeout)
    isolated = isolate and runner.kind != "command"    # a command is a process of its own
    caller = Worker(runner, timeout) if isolated else contextlib.nullcontext(runner)
    timeout = timeout if isolate or runner.kind == "command" else None
    grid = cases(dtypes=dtypes, supports=options + outputs, seed=seed, fully_masked=fully_masked)
    trials = property_trials(names=names, dtypes=dtypes, supports=options + outputs, seed=seed,
                             fully_masked=fully_masked, block_sizes=block_sizes)
    settings = dict(kernel=runner.name, kind=runner.kind, seed=seed, dtypes=dtypes,
                    supports=options + outputs + promised, fully_masked=fully_masked, budget=budget, timeout=timeout)
    record = Record(out_dir, {**settings, "grid_cases": len(grid)})
    bar = progress_bar(len(grid), progress)
    results, failures, times, checked, saved, pictures, shrunk_trials = [], [], {"start": monotonic()}, [], [], [], []

    def report(interrupted=False):
        end = monotonic()
        swept = times.get("swept", end)
        return ConformReport(**settings, grid=tuple(grid), results=tuple(results),
                             failures=tuple(failures), seconds=swept - times["start"],
                             shrink_seconds=end - swept, interrupted=interrupted, unsaved=record.unsaved,
                             trials=tuple(trials), property_results=tuple(checked), saved=tuple(saved),
                             pictures=tuple(pictures), shrunk_trials=tuple(shrunk_trials),
                             properties=names)

    bar.say(_plan(grid, trials, budget, timeout))
    try:
        with record, caller as called:
            share = None if budget is None else budget * (1 - PROPERTY_SHARE if trials else 1)
            smallest = _sweep(called, grid, share, times, results, record, bar)
            _check(called, trials, promised, budget, times, checked, record, bar, out_dir, saved, pictures,
                   shrunk_trials)
            times["swept"] = monotonic()
            for (option, dtype), (result, arrays) in smallest.items():
                shrunk = shrink(called, result.case, result.report, arrays)
                file, picture = _save(shrunk, out_dir, record) if out_dir is not None else (None, None)
                failures.append(Failure(option, dtype, shrunk, file, picture))
        return report()
    except KeyboardInterrupt:
        raise ConformInterrupted(report(interrupted=True)) from None
    finally:
        bar.close()


def _sweep(kernel, grid, budget, times, results, record, bar):
    """Run the grid's cases within the budget, appending each CaseResult to `results` as it
    comes (and to the record, and to stderr when it does not pass); {(cell, dtype): (result,
    arrays)} of each cell's smallest failing case."""
    smallest = {}
    for case in grid:
        if budget is not None and results and monotonic() - times["start"] >= budget:
            break
        result, arrays = evaluate(kernel, case)
        results.append(result)
        record.add(case_json(result))
        if result.status != "PASS":
            bar.say(case_line(result))
        cell = (case.cell, case.dtype)
        if result.status == "FAIL" and (cell not in smallest or case.scores < smallest[cell][0].case.scores):
            smallest[cell] = (result, arrays)
        bar.update(result.status != "PASS")
    return smallest


def _check(kernel, trials, promised, budget, times, checked, record, bar, out_dir, saved, pictures, shrunk):
    """Run the properties' trials within the budget, appending each PropertyResult to `checked`
    (and to the record, and to stderr when it does not pass; a failing trial crosscheck judged
    saved in out_dir, its (id, path) appended to `saved`); the first round always runs. Then
    each property and dtype's smallest failing trial shrunk ((result, shrunk result, runs)
    appended to `shrunk`, the shrunk one saved), and a dtype's failing lengths and batch drawn in
    out_dir (pictures.py; (property, dtype, path) appended to `pictures`)."""
    first_round = len({(t.property, t.dtype) for t in trials})
    for n, trial in enumerate(trials):
        if budget is not None and n >= first_round and monotonic() - times["start"] >= budget:
            break
        result = check_property(kernel, trial, promised)
        checked.append(result)
        record.add(trial_json(result))
        if result.status != "PASS":
            bar.say("\n".join(wrapped(f"{result.status} {result.trial}: {result.detail}")))
        _save_trial(result, out_dir, record, saved)
    smallest = {}                                      # each (property, dtype)'s smallest failing trial,
    for result in checked:                             # shrunk (lengths' are not: they name their length)
        key = (result.trial.property, result.trial.dtype)
        if result.status == "FAIL" and (key not in smallest or result.trial.case.scores < smallest[key].trial.case.scores):
            smallest[key] = result
    for result in smallest.values():
        fit = fits(result.trial)
        if fit is not None:
            found, steps = shrink_trial(lambda trial: check_property(kernel, trial, promised), result, fit)
            shrunk.append((result, found, steps))
            if found is not result:
                _save_trial(found, out_dir, record, saved)
    if out_dir is not None:                            # failing lengths and batches: their errors drawn
        for name, dtype, draw, what in property_pictures(checked):
            path = _drawn(os.path.join(os.fspath(out_dir), f"{name}-{dtype}.png"), what, record, draw)
            if path is not None:
                pictures.append((name, dtype, path))


def _save_trial(result, out_dir, record, saved):
    """A trial crosscheck judged (result.arrays: its case with the kernel's results) saved in
    out_dir as <its id>.npz, (id, path) appended to `saved`; nothing without out_dir or arrays."""
    if result.arrays is not None and out_dir is not None:
        path = _save_arrays(str(result.trial), result.arrays, out_dir, record)
        if path is not None:
            saved.append((str(result.trial), path))


def _plan(grid, trials, budget, timeout):
    """What the run will do, said before it starts: the cases and trials, the time they may take,
    the shrinks."""
    cells = len({(case.cell, case.dtype) for case in grid})
    swept = "" if budget is None or not trials else f"the grid's after {budget * (1 - PROPERTY_SHARE):g} s, "
    limits = "" if budget is None else f"; no case starts after {swept}{budget:g} s"
    limits += "" if timeout is None else f", and a case runs at most {timeout:g} s"
    checked = f" and {len(trials)} property trials" if trials else ""
    return "\n".join(wrapped(f"conform: {len(grid)} cases in {cells} cells{checked}{limits}; then each "
                             f"failing cell is shrunk, in at most {MAX_STEPS} more runs of the kernel"))


def _given(argument, declared, default):
    """The argument if given, else the kernel's declaration, else the default."""
    return argument if argument is not None else declared if declared is not None else default


def _save(shrunk, out_dir, record):
    """(the .npz path, the .png path or None): the shrunk case with the kernel's results saved
    as a crosscheck case in out_dir, named by its id, and its error maps; (None, None) for a
    file that cannot be written (remembered in the record: the report says which)."""
    path = _save_arrays(shrunk.case.id, shrunk.arrays, out_dir, record)
    return (None, None) if path is None else (path, _picture(path.removesuffix(".npz") + ".png", shrunk.arrays,
                                                             record))


def _save_arrays(name, arrays, out_dir, record):
    """out_dir/<name>.npz with the case's arrays and the kernel's results; None for a file that
    cannot be written (remembered in the record)."""
    path = os.path.join(os.fspath(out_dir), f"{name}.npz")
    try:
        save_case(path, **arrays)
    except OSError as exc:
        record.failed(path, exc)
        return None
    return path


def _picture(path, arrays, record):
    """The case's error maps written to path (oracle/errormap.py); None where matplotlib
    is not installed, or the file cannot be written."""
    return _drawn(path, arrays, record, lambda path, arrays: plot_error_maps(path, **arrays))


def _drawn(path, what, record, draw):
    """draw(path, what) (a property's picture: pictures.py); None where matplotlib is not
    installed, or the file cannot be written (remembered in the record)."""
    try:
        draw(path, what)
    except ImportError:                     # matplotlib, imported when it draws
        return None
    except OSError as exc:
        record.failed(path, exc)
        return None
    return path


conform.cases = cases
conform.check = check
conform.declare = declare
conform.properties = property_trials
conform.check_property = check_property
