"""The conformance run: a kernel swept over the kernel test suites' case grid, each case judged
by crosscheck against the float64 oracle, each failure shrunk to its smallest case.

    supports.py   what a kernel supports: dtypes, options, outputs; declare(); the names checked
    grid.py       the case grid: ConformCase, cases() in the sweep's order, draw() its arrays
    kernels.py    how a torch, JAX or NumPy callable, or a command line, is called on a case
    processes.py  the sweep's child processes: started in a session of their own, stopped
    worker.py     a Python kernel called in a worker process: a hang or a crash costs one case
    judge.py      one case judged: check() (for pytest), evaluate() (PASS / FAIL / ERROR / TIMEOUT)
    shrink.py     a failing case shrunk, greedily, to the smallest that still fails
    properties.py what relates a kernel's results on related cases: honesty, lengths,
                  determinism, batch invariance, range, empty rows, layout, NaN keys
                  (properties(), check_property())
    layouts.py    a case's arrays laid out otherwise for them: packs reordered, pages moved
    pictures.py   a property's failures drawn: lengths' errors against N_k
    progress.py   the sweep's lines on stderr as it goes, and its progress bar
    record.py     the run's record, out_dir/conform.jsonl, one line per case as it is judged
    run_report.py the ConformReport: the verdict, the option x dtype table, the failures, JSON
    run.py        conform(kernel, ...): the sweep, the budget, the shrinks, the saved cases
    examples.py   torch SDPA (math, flash), flex_attention, jax.nn.dot_product_attention, and
                  our own float32 attention, each declared
    (the command `numpy-attention conform MODULE:FUNCTION` is numpy_attention/commands/conform.py)

`na.conform` is the function (numpy_attention/__init__.py keeps it so); na.conform.cases,
na.conform.check, na.conform.properties, na.conform.check_property and na.conform.declare are
its attributes.
"""
from .grid import ConformCase, cases, draw
from .judge import CaseResult, check, evaluate
from .kernels import KernelError, KernelTimeout, as_kernel
from .properties import PROPERTIES, PropertyResult, PropertyTrial, check_property, properties
from .run_report import ConformReport
from .run import ConformInterrupted, conform
from .shrink import Shrunk
from .supports import DTYPES, OPTIONS, OUTPUTS, declare

__all__ = ["conform", "cases", "check", "declare", "ConformCase", "ConformReport", "ConformInterrupted",
           "CaseResult", "Shrunk", "KernelError", "KernelTimeout", "draw", "evaluate", "as_kernel", "DTYPES",
           "OPTIONS", "OUTPUTS", "PROPERTIES", "PropertyTrial", "PropertyResult", "properties", "check_property"]
