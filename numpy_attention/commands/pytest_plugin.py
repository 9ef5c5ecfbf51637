"""The conformance run as pytest items: `pytest --attention-kernel MODULE:FUNCTION`.

    pytest --attention-kernel my_kernels:attention [--attention-dtypes float32 bfloat16]
           [--attention-options causal gqa gradients] [--attention-properties lengths ...]
           [--attention-seed N] [-k causal]

With --attention-kernel, pytest collects, beside the tests it finds, one item per case of the
grid (conformance/grid.py) and one per property trial (conformance/properties.py), named by
their ids:
`conform[float32-causal-b2h4kv4-q64k113-d72-out+grad]`, `conform[lengths-float32-...]`. A case
item runs the kernel in pytest's process on read-only copies of the case (as conform does
with isolate=False) and fails with crosscheck's table of the case shrunk to its smallest
failing case (conformance/shrink.py); a trial item fails with what differed. The dtypes,
options and promises are the kernel's declaration's unless given (conformance/supports.py).
Without --attention-kernel the plugin adds nothing.

setup.cfg registers this module under pytest's `pytest11` entry point, so installing the
package makes the options available; it imports nothing of the package until they are used.
"""
import pytest


def pytest_addoption(parser):
    group = parser.getgroup("numpy_attention", "numpy-attention conformance of an attention kernel")
    group.addoption("--attention-kernel", metavar="MODULE:FUNCTION",
                    help="collect the conformance grid's cases and the properties' trials for this kernel")
    group.addoption("--attention-dtypes", nargs="+", metavar="DTYPE",
                    help="the dtypes to sweep (default: the kernel's declaration, else all)")
    group.addoption("--attention-options", nargs="+", metavar="OPTION",
                    help="the options, outputs and promises the kernel supports (default: its declaration)")
    group.addoption("--attention-properties", nargs="+", metavar="PROPERTY",
                    help="the properties to check, or none (default: all)")
    group.addoption("--attention-seed", type=int, default=0, metavar="N", help="the grid's seed (default 0)")


def pytest_collection_modifyitems(session, config, items):
    spec = config.getoption("--attention-kernel")
    if spec is None:
        return
    items.extend(conformance_items(session, config, spec))


def conformance_items(session, config, spec):
    """The items of the kernel's grid and properties, in the sweep's order."""
    from ..conformance.grid import cases
    from ..conformance.kernels import as_kernel
    from ..conformance.properties import check_properties, properties
    from ..conformance.supports import (DEFAULT_SUPPORTS, DTYPES, check_dtypes, check_supports, declaration_of,
                                        promises)
    from .cli import UsageError
    from .conform import load_kernel, names

    try:
        kernel = load_kernel(spec)
        declared = declaration_of(kernel)
        dtypes = check_dtypes(names(config.getoption("--attention-dtypes")) or declared.dtypes or DTYPES,
                              "--attention-dtypes")
        supports = names(config.getoption("--attention-options")) or declared.supports or DEFAULT_SUPPORTS
        named = names(config.getoption("--attention-properties"))
        names = () if named == ["none"] else check_properties(named, "--attention-properties")
        fully_masked = declared.fully_masked or "zero"
        options, outputs = check_supports(supports, fully_masked, "--attention-options")
        runner = as_kernel(kernel)
        grid = cases(dtypes=dtypes, supports=options + outputs, seed=config.getoption("--attention-seed"),
                     fully_masked=fully_masked)
        trials = properties(names=names, dtypes=dtypes, supports=options + outputs,
                            seed=config.getoption("--attention-seed"), fully_masked=fully_masked,
                            block_sizes=declared.block_sizes or ())
    except (UsageError, ValueError, TypeError) as exc:
        raise pytest.UsageError(f"--attention-kernel {spec}: {exc}") from None
    promised = promises(supports)
    return ([CaseItem.from_parent(session, name=f"conform[{case.id}]", kernel=runner, case=case) for case in grid]
            + [TrialItem.from_parent(session, name=f"conform[{trial}]", kernel=runner, trial=trial,
                                     promised=promised) for trial in trials])


class ConformFailure(Exception):
    """A conformance item's failure: its message is the whole report."""


class CaseItem(pytest.Item):
    """One case of the grid, judged by crosscheck; a failure shrunk to its smallest case."""

    def __init__(self, *, kernel, case, **kwargs):
        super().__init__(**kwargs)
        self.kernel, self.case = kernel, case

    def runtest(self):
        from ..conformance.judge import evaluate
        from ..conformance.shrink import shrink
        result, arrays = evaluate(self.kernel, self.case)
        if result.status == "PASS":
            return
        if result.status != "FAIL":
            raise ConformFailure(f"{result.status} {self.case.id}: {result.error}")
        shrunk = shrink(self.kernel, self.case, result.report, arrays)
        raise ConformFailure(f"FAIL {self.case.id}, shrunk in {shrunk.steps} runs to {shrunk.case.id}:\n"
                             f"{shrunk.report}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, self.name


class TrialItem(CaseItem):
    """One trial of a property (properties.py); a failure shrunk to its smallest case (but a
    lengths trial's, which names its length)."""

    def __init__(self, *, kernel, trial, promised, **kwargs):
        super().__init__(kernel=kernel, case=trial.case, **kwargs)
        self.trial, self.promised = trial, promised

    def runtest(self):
        from ..conformance.properties import check_property, fits
        from ..conformance.shrink import shrink_trial
        check = lambda trial: check_property(self.kernel, trial, self.promised)
        result = check(self.trial)
        if result.status == "PASS":
            return
        fit = fits(self.trial)
        if result.status != "FAIL" or fit is None:
            raise ConformFailure(f"{result.status} {self.trial}: {result.detail}")
        found, runs = shrink_trial(check, result, fit)
        raise ConformFailure(f"FAIL {self.trial}, shrunk in {runs} runs to {found.trial.case.id}: {found.detail}")
