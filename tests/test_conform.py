"""The conformance run (numpy_attention/conformance/): its grid, the kernels it calls (torch, JAX,
NumPy, a command line), its verdicts, the shrinking of planted bugs, its report and command."""
import json
import math
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
from optional import JAX_REASON, MLX_REASON, TORCH_REASON

import conform_bugs
import numpy_attention as na
from numpy_attention.commands.cli import main
from numpy_attention.conformance import examples, judge, run
from numpy_attention.conformance.grid import LENGTHS, PER_ROLE, ROLES, WIDTHS, cases, draw
from numpy_attention.conformance.judge import evaluate
from numpy_attention.conformance.kernels import KernelError, as_kernel, command_args, kind_of
from numpy_attention.conformance.progress import LineBar, NoBar, progress_bar
from numpy_attention.conformance.shrink import shrink
from numpy_attention.conformance.supports import OPTIONS, OUTPUTS, declare
from numpy_attention.oracle import load_case, split_case

EVERYTHING = OPTIONS + OUTPUTS
FEW_TOKENS = 36                         # "a few dozen": B (N_q + N_k) of a shrunk planted bug


# ----------------------------------------------------------------------------- the grid

def test_the_grid_is_deterministic_and_its_ids_unique():
    grid = cases()
    assert [c.id for c in grid] == [c.id for c in cases()]
    assert len({c.id for c in grid}) == len(grid) == PER_ROLE * len(ROLES) * 3 * 3   # 3 cells x 3 dtypes
    assert [c.id for c in cases(seed=1)] != [c.id for c in grid]
    case = grid[20]
    assert all(np.array_equal(x, y) for x, y in zip(draw(case).values(), draw(case).values()))


def test_the_grid_meets_every_length_shape_and_width_it_names():
    grid = cases()
    assert {n for c in grid for n in (c.n_q, c.n_k)} == set(LENGTHS)
    assert any(c.n_k == 1 for c in grid)                                   # a single key
    assert any(c.n_q == 1 and c.n_k > 1 and "causal" in c.options for c in grid)    # decoding
    assert any(c.n_q == c.n_k > 1 for c in grid) and any(c.n_q > c.n_k > 1 for c in grid)
    assert any(1 < c.n_q < c.n_k for c in grid)
    assert {c.d for c in grid} <= set(WIDTHS) and {40, 72, 96} & {c.d for c in grid}
    assert {c.batch for c in grid} == {1, 2, 3, 4}
    assert max(c.kv_heads * c.groups for c in grid) == 8 and min(c.kv_heads * c.groups for c in grid) == 1
    assert all(c.groups > 1 for c in grid if "gqa" in c.options)
    assert all(c.groups == 1 for c in grid if "gqa" not in c.options)


def test_the_sweep_is_round_robin_smallest_first():
    grid = cases(dtypes=("float32", "bfloat16"), supports=("causal", "window", "bias"))
    cells = {(c.cell, c.dtype) for c in grid}
    first_round = grid[:len(cells)]
    assert {(c.cell, c.dtype) for c in first_round} == cells                # every cell at once
    assert [c.scores for c in first_round] == sorted(c.scores for c in first_round)


def test_each_cell_holds_each_role_at_different_lengths():
    grid = cases(dtypes=("float32", "float16"), supports=("causal", "gqa", "softcap"))
    cells = {(c.cell, c.dtype) for c in grid}
    for cell in cells:
        pairs = [(c.n_q, c.n_k) for c in grid if (c.cell, c.dtype) == cell]
        assert len(pairs) == len(set(pairs)) == PER_ROLE * len(ROLES)
        for _, role in ROLES:
            assert sum(pair in role for pair in pairs) == PER_ROLE
    second = grid[len(cells) * len(ROLES):]                 # the rounds of each role's second case
    assert [(c.n_q, c.n_k) in ROLES[0][1] for c in second[:len(cells)]] == [True] * len(cells)


def test_fully_masked_rows_where_the_options_make_them():
    grid = cases(supports=("mask", "bottom_right"))
    masks = [draw(c)["mask"] for c in grid if "mask" in c.options and c.n_q > 1]
    assert masks and all((~m.any(axis=-1)).any() for m in masks)            # a row with no key
    assert any(c.n_q > c.n_k for c in grid if "bottom_right" in c.options)


def test_inputs_hold_values_of_their_dtype_and_form_a_case():
    for case in cases(dtypes=("bfloat16",), supports=EVERYTHING)[:60]:
        arrays = draw(case)
        for name in ("q", "k", "v", "dout", "bias", "sinks", "alibi_slopes"):
            if name in arrays:
                x = arrays[name]
                assert np.array_equal(x.astype(ml_dtypes.bfloat16).astype(np.float32), x), (case.id, name)
        out = np.zeros(arrays["q"].shape[:-1] + arrays["v"].shape[-1:], np.float32)
        if "page_table" in arrays:                                          # q [B, H, N_q, d] of a paged cache
            out = np.zeros(arrays["q"].shape, np.float32)
        split_case({**arrays, "out": out})                                  # a case crosscheck reads


def test_unknown_names_are_refused_by_argument_with_a_guess():
    with pytest.raises(ValueError, match=r"supports has the unknown name 'casual': did you mean 'causal'"):
        cases(supports=("casual",))
    with pytest.raises(ValueError, match=r"supports .* 'top_left': did you mean top-left causal is 'causal'"):
        cases(supports=("top_left",))
    with pytest.raises(ValueError, match=r"dtypes has the unknown name 'bf16': did you mean 'bfloat16'"):
        cases(dtypes=("bf16",))
    with pytest.raises(ValueError, match="dtypes is empty"):
        cases(dtypes=())
    with pytest.raises(ValueError, match="supports has 'sinks', which takes fully_masked"):
        cases(supports=("sinks",), fully_masked="uniform")
    with pytest.raises(TypeError, match="seed"):
        cases(seed=True)
    with pytest.raises(ValueError, match="budget"):
        na.conform(examples.numpy_float32, budget=0, properties=())
    with pytest.raises(ValueError, match="kind must be one of"):
        na.conform(examples.numpy_float32, kind="cuda", properties=())


@pytest.mark.parametrize("case", cases(dtypes=("float32", "float16"), supports=("causal", "lse"))[:4], ids=str)
def test_cases_parametrize_a_test_by_their_ids(case, request):
    assert request.node.callspec.id == case.id
    report = na.conform.check(examples.numpy_float32, case)
    assert report, report


# ----------------------------------------------------------------------------- the kernels

@pytest.mark.slow
def test_our_float32_attention_passes_the_first_rounds_of_every_option():
    grid = cases(dtypes=("bfloat16",), supports=EVERYTHING)
    kernel = as_kernel(examples.numpy_float32)
    results = [evaluate(kernel, case)[0] for case in grid[:2 * (1 + len(OPTIONS))]]     # 2 rounds
    assert {r.case.cell for r in results} == {"plain", *OPTIONS}
    assert [(r.case.id, r.error or r.report) for r in results if r.status != "PASS"] == []


def test_the_kind_is_told_from_the_kernel(torch):
    def by_torch(q, k, v, **options):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    assert kind_of(by_torch) == "torch" and kind_of(torch.nn.Identity()) == "torch"
    assert kind_of(lambda q, k, v: np.tanh(q)) == "numpy" and kind_of("prog {in} {out}") == "command"
    assert kind_of(examples.jax_xla) == "jax"                             # declared
    assert as_kernel(by_torch, kind="numpy").kind == "numpy"
    with pytest.raises(TypeError, match="kernel must be a callable or a command line"):
        kind_of(3)


def test_the_jax_kind_is_told_from_code_that_names_jax(jax):
    assert kind_of(lambda q, k, v: jax.numpy.tanh(q)) == "jax"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["torch_sdpa", "torch_sdpa_math", "torch_sdpa_flash", "torch_flex"])
def test_torch_examples_pass_on_a_small_budget(name, clock):
    pytest.importorskip("torch", reason=TORCH_REASON)
    kernel = getattr(examples, name)
    isolate = name == "torch_sdpa"                  # one through a worker process; a worker's start costs
    report = na.conform(kernel, budget=4.5, isolate=isolate, properties=())               # 5 cases (the clock)
    assert len(report.results) == 5 and report.kind == "torch", report
    assert all(r.status == "PASS" for r in report.results) and report.status == "INCOMPLETE", report


@pytest.mark.slow
def test_jax_example_passes_on_a_small_budget(clock):
    pytest.importorskip("jax", reason=JAX_REASON)
    report = na.conform(examples.jax_xla, budget=1.5, properties=())
    assert len(report.results) == 2 and report.fully_masked == "uniform", report
    assert all(r.status == "PASS" for r in report.results), report


def test_mlx_example_passes_its_first_cases_and_properties():
    """MLX's fused attention (a NumPy kernel that calls MLX): a dozen of its grid's cases (one key,
    short) in the three dtypes, and its empty rows (a mask's, bottom-right's) under its
    'uniform' policy."""
    pytest.importorskip("mlx.core", reason=MLX_REASON)
    kernel = as_kernel(examples.mlx_sdpa)
    grid = cases(supports=examples.MLX, fully_masked="uniform")
    first = [case for case in grid if case.role == "one key"][:6] + [case for case in grid if case.role == "short"][:6]
    for case in first:
        result, _ = evaluate(kernel, case)
        assert result.status == "PASS", (case.id, result)
    for trial in na.conform.properties(names=("empty_rows",), supports=examples.MLX, fully_masked="uniform"):
        assert na.conform.check_property(kernel, trial).status == "PASS", trial


def test_a_kernel_that_raises_is_an_error_row(clock):
    @declare(kind="numpy", supports=("causal",))
    def breaks_on_causal(q, k, v, causal=False, **options):
        if causal:
            raise RuntimeError("no causal here\nsecond line")
        return examples.numpy_float32(q, k, v, **options)

    grid = cases(dtypes=("float32",), supports=("causal",))
    report = na.conform(breaks_on_causal, dtypes=("float32",), budget=5.5, isolate=False, properties=())   # 3 rounds of 2 cells
    assert not report and len(report.results) == 6
    errors = [r for r in report.results if r.status == "ERROR"]
    assert errors and all(r.case.cell == "causal" and r.error == "RuntimeError: no causal here" for r in errors)
    assert all(r.status == "PASS" for r in report.results if r.case.cell == "plain")
    first = errors[0].case.id
    said = " ".join(str(report).split())                                    # its lines wrapped at 100
    assert f"causal float32: 3 of 3 cases, e.g. {first}: RuntimeError: no causal here" in said
    with pytest.raises(RuntimeError, match="no causal here"):                # check() lets it through
        na.conform.check(breaks_on_causal, next(c for c in grid if c.cell == "causal"))


def test_missing_results_are_kernel_errors():
    case = cases(dtypes=("float32",), supports=("lse", "gradients"))[1]
    forward_only = lambda q, k, v, dout=None, **options: {"out": examples.numpy_float32(q, k, v, **options)["out"]}
    with pytest.raises(KernelError, match="returned no lse"):
        na.conform.check(forward_only, case)
    no_dict = lambda q, k, v, **options: q
    with pytest.raises(KernelError, match="returns a dict with 'out'"):
        na.conform.check(no_dict, case)
    with pytest.raises(TypeError, match="case must be a ConformCase"):
        na.conform.check(no_dict, case.id)


def test_results_crosscheck_refuses_are_the_kernels_errors_its_own_are_not(monkeypatch):
    case = cases(dtypes=("float32",), supports=())[3]
    transposed = lambda q, k, v, **options: {"out": np.swapaxes(examples.numpy_float32(q, k, v)["out"], -1, -2)}
    result, arrays = evaluate(as_kernel(transposed), case)
    assert result.status == "ERROR" and result.error.startswith("CaseError: out must have shape") and arrays is None

    def broken(**arrays):
        raise ZeroDivisionError("a bug of crosscheck's")
    monkeypatch.setattr(judge, "crosscheck", broken)
    with pytest.raises(ZeroDivisionError):                                 # not blamed on the kernel
        evaluate(as_kernel(examples.numpy_float32), case)


def test_declare_checks_what_it_is_given(clock):
    with pytest.raises(ValueError, match="supports has the unknown name 'flash'"):
        declare(supports=("flash",))
    with pytest.raises(TypeError, match="declare.. cannot attach to a command line"):
        declare("prog {in} {out}", supports=("causal",))
    kernel = declare(lambda q, k, v, **options: q, kind="numpy", dtypes="float16")
    report = na.conform(kernel, budget=0.5, isolate=False, properties=())                 # one case, by the clock
    assert report.dtypes == ("float16",) and [r.status for r in report.results] == ["ERROR"]
    assert report.results[0].error == "KernelError: a numpy kernel returns a dict with 'out' (and 'lse', 'dq', ...), got ndarray"


KERNEL_SCRIPT = '''\
import sys
if "fail" in sys.argv:
    print("cannot compute this case", file=sys.stderr)
    raise SystemExit(3)
import numpy as np
from numpy_attention.conformance.examples import numpy_float32
case = dict(np.load(sys.argv[1]))
options = {n: x.item() if x.ndim == 0 else x for n, x in case.items() if n not in ("q", "k", "v", "precision")}
results = numpy_float32(case["q"], case["k"], case["v"], **options)
np.savez(sys.argv[2], **{n: np.asarray(x, np.float32) for n, x in results.items()})
'''


@pytest.mark.slow
def test_a_command_line_kernel_reads_and_writes_npz(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL_SCRIPT)
    grid = cases(dtypes=("bfloat16",), supports=("causal", "lse", "gradients"))
    command = f"{sys.executable} {script} {{in}} {{out}}"
    for case in (grid[3], next(c for c in grid if c.cell == "causal" and c.n_k > 1)):
        report = na.conform.check(command, case)
        assert report and {row.name for row in report.rows} == {"out", "lse", "dq", "dk", "dv"}, report
    failing = as_kernel(f"{sys.executable} {script} {{in}} {{out}} fail")
    result, _ = evaluate(failing, grid[0])
    assert result.status == "ERROR"
    assert result.error == f"KernelError: {sys.executable} exited with status 3: cannot compute this case"
    assert command_args("prog --fast") == ["prog", "--fast", "{in}", "{out}"]
    with pytest.raises(ValueError, match=r"both \{in\} and \{out\}"):
        as_kernel("prog {in}")


# ----------------------------------------------------------------------------- planted bugs

several_keys = lambda c: c.n_q > 1 and c.n_k > 1              # a case the bug changes


@pytest.mark.slow
@pytest.mark.parametrize("bug, changes, tensor, diagnosis", [
    (conform_bugs.scale_off, lambda c: c.cell == "plain" and several_keys(c), "out", "matches scale 1.01"),
    (conform_bugs.causal_shifted, lambda c: c.cell == "causal" and several_keys(c), "out", "causal="),
    (conform_bugs.gqa_interleaved, lambda c: "gqa" in c.options and c.kv_heads > 1, "out",
     "interleaved grouped-query heads"),
    (conform_bugs.dk_negated, lambda c: c.cell == "plain" and several_keys(c), "dk", "dk matches the oracle negated"),
], ids=["scale_off", "causal_shifted", "gqa_interleaved", "dk_negated"])
def test_a_planted_bug_fails_and_shrinks_to_a_few_tokens(bug, changes, tensor, diagnosis):
    kernel = as_kernel(bug)
    grid = cases(dtypes=("float32",), supports=conform_bugs.SUPPORTS)
    case = min((c for c in grid if changes(c) and c.tokens > 100), key=lambda c: c.scores)
    result, arrays = evaluate(kernel, case)
    assert result.status == "FAIL"
    shrunk = shrink(kernel, case, result.report, arrays)
    assert not shrunk.report and shrunk.case.tokens <= FEW_TOKENS < case.tokens, shrunk.case.id
    assert tensor in [row.name for row in shrunk.report.rows if not row.passed]
    assert any(diagnosis in line for line in shrunk.report.diagnosis), shrunk.report


def test_the_diagnosis_prefers_what_holds_on_the_failing_case():
    """causal_shifted shrinks to one query row and two keys, where the bug is also bottom-right
    causal: the failing case's explanation (the mask off by one) is the one shown."""
    kernel = as_kernel(conform_bugs.causal_shifted)
    grid = cases(dtypes=("float32",), supports=conform_bugs.SUPPORTS)
    case = min((c for c in grid if c.cell == "causal" and several_keys(c) and c.tokens > 100), key=lambda c: c.scores)
    result, arrays = evaluate(kernel, case)
    shrunk = shrink(kernel, case, result.report, arrays)
    lines, before = shrunk.diagnosis()
    assert before and lines == list(result.report.diagnosis) and "causal masking off by one" in lines[0]
    assert any("causal='bottom_right'" in line for line in shrunk.report.diagnosis)     # what it alone says


def test_a_failing_run_saves_each_shrunk_case_for_crosscheck(tmp_path, clock, monkeypatch, capsys):
    drawn = []

    def plot_error_maps(path, **arrays):
        drawn.append((path, sorted(arrays)))
        open(path, "wb").close()

    monkeypatch.setattr(run, "plot_error_maps", plot_error_maps)
    report = na.conform(conform_bugs.gqa_interleaved, dtypes=("float32",), budget=8.5, out_dir=tmp_path / "out",
                        isolate=False, properties=())
    assert not report and len(report.results) == 9
    (failure,) = report.failures
    assert (failure.option, failure.dtype) == ("gqa", "float32") and failure.shrunk.case.tokens <= FEW_TOKENS
    assert failure.file == str(tmp_path / "out" / f"{failure.shrunk.case.id}.npz")
    assert drawn == [(failure.picture, sorted(load_case(failure.file)))]
    text = str(report)
    assert f"9 of {PER_ROLE * 21} cases of the grid run" in text and failure.shrunk.case.id in text
    assert "diagnosis (before shrinking): out, dq, dk, dv match interleaved grouped-query heads" in " ".join(text.split())
    assert f"saved in {tmp_path / 'out'}: each case as <id>.npz" in " ".join(text.split())
    assert main(["crosscheck", failure.file]) == 1                         # the file, re-judged
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.slow
def test_without_the_picture_the_case_is_still_saved(tmp_path, clock, monkeypatch):
    def no_matplotlib(path, **arrays):
        raise ImportError("matplotlib is not installed")
    monkeypatch.setattr(run, "plot_error_maps", no_matplotlib)
    report = na.conform(conform_bugs.scale_off, dtypes=("float32",), supports=("gradients",),
                        budget=3.5, out_dir=tmp_path, isolate=False, properties=())
    assert report.failures and all(f.picture is None and f.file for f in report.failures)


# ----------------------------------------------------------------------------- the report

def test_the_budget_stops_new_cases_and_the_table_says_how_many_ran(clock):
    report = na.conform(examples.numpy_float32, dtypes=("float32",), supports=("causal",), budget=2.5,
                        isolate=False, properties=())
    assert len(report.results) == 3 and report.grid_size == PER_ROLE * 14   # clock: 0 | 1, 2, 3 | 4
    assert str(report).startswith("conform: numpy_attention.conformance.examples:numpy_float32 (numpy), seed 0\n"
                                  f"3 of {PER_ROLE * 14} cases of the grid run in 4 s (budget 2.5 s) -> INCOMPLETE\n"
                                  "coverage: 1 of 7 roles run in every cell: not enough to pass (a larger budget "
                                  "runs more)\n")


def test_the_json_report(clock):
    report = na.conform(conform_bugs.causal_shifted, dtypes=("float16",), budget=5.5, isolate=False, properties=())
    data = json.loads(report.to_json())
    assert data["passed"] is False and data["cases_run"] == 6 == len(data["cases"]) and data["grid_cases"] == PER_ROLE * 21
    assert {"kernel", "kind", "seed", "dtypes", "supports", "budget", "seconds", "cells"} <= set(data)
    assert [(c["option"], c["dtype"]) for c in data["cells"]] == [("plain", "float16"), ("causal", "float16"),
                                                                 ("gqa", "float16")]
    causal = data["cells"][1]
    assert causal["cases"] == causal["passed"] + causal["failed"] + causal["errors"] and causal["failed"] >= 1
    failing = causal["smallest_failing"]
    assert failing["tensors"][0]["name"] == "out" and failing["file"] is None and failing["runs"] >= 1
    assert all(isinstance(c["worst_ratio"], float) for c in data["cases"])


def test_the_progress_bar_and_lines():
    def stream(terminal):
        written = []
        return written, type("Stream", (), {"isatty": lambda self: terminal, "flush": lambda self: None,
                                            "write": lambda self, text: written.append(text)})()

    written, terminal = stream(True)
    bar = progress_bar(4, stream=terminal)
    bar.say("the plan")
    bar.update(False)
    bar.update(True)
    bar.say("FAIL a-case: out at 38 times its bound")
    bar.close()
    assert "the plan" in "".join(written) and "FAIL a-case: out at 38 times its bound" in "".join(written)
    if isinstance(bar, LineBar):                                            # tqdm's when it is installed
        assert written[3].startswith("\rconform    2/4 [###############...............] 1 failed")
    written, log = stream(False)                                            # a CI log: lines, no bar
    lines = progress_bar(4, enabled=True, stream=log)
    lines.say("the plan")
    lines.update(True)
    lines.close()
    assert written == ["the plan\n"]
    assert isinstance(progress_bar(4, stream=log), NoBar) and isinstance(progress_bar(4, enabled=False), NoBar)


# ----------------------------------------------------------------------------- the command

@pytest.mark.slow
def test_command_exit_codes(tmp_path, clock, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["conform", "numpy_attention.conformance.examples:numpy_float32", "--quiet", "--properties", "none",
            "--budget"]
    assert main(argv + ["2.5", "--dtypes", "float32,bfloat16", "--options", "causal", "lse"]) == 1
    assert f"3 of {PER_ROLE * 28} cases of the grid run" in capsys.readouterr().out      # and not passed
    assert main(argv + ["6.5", "--dtypes", "float16", "--options", ""]) == 0             # each role of plain
    assert "7 of 14 cases of the grid run" in capsys.readouterr().out
    assert main(["conform", "conform_bugs:scale_off", "--quiet", "--budget", "4.5", "--json", "--dtypes", "float32",
                 "--properties", "none"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is False and data["cells"][0]["smallest_failing"]["file"].startswith("conform-failures/")
    assert (tmp_path / data["cells"][0]["smallest_failing"]["file"]).is_file()


@pytest.mark.parametrize("argv, message", [
    (["nope.nothing:fn"], "cannot import nope.nothing: ModuleNotFoundError: No module named 'nope'"),
    (["numpy_attention.conformance.examples:nothing"], "module numpy_attention.conformance.examples has no 'nothing'"),
    (["numpy_attention.conformance.examples"], "the kernel is MODULE:FUNCTION"),
    (["raises_on_import:fn"], "cannot import raises_on_import: RuntimeError: not today"),
    (["conform_bugs:scale_off", "--options", "casual"], "--options has the unknown name 'casual': did you mean 'causal'"),
    (["conform_bugs:scale_off", "--dtypes", "fp16"], "--dtypes has the unknown name 'fp16': did you mean 'float16'"),
    (["conform_bugs:scale_off", "--budget", "0"], "--budget: must be a number of seconds > 0"),
])
def test_command_bad_input_one_line_exit_2(argv, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "raises_on_import.py").write_text("raise RuntimeError('not today')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["conform", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("numpy-attention conform: ") and message in err, err


def test_na_conform_stays_the_function_whatever_is_imported_first():
    code = textwrap.dedent("""\
        import numpy_attention.conformance, numpy_attention.conformance.run
        import numpy_attention as na
        from numpy_attention.conformance import cases
        print(callable(na.conform), na.conform.cases is cases, type(na.conform).__name__)
    """)
    run_ = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run_.returncode == 0, run_.stderr
    assert run_.stdout.split() == ["True", "True", "function"]


def test_worst_ratio_is_the_share_of_the_bound():
    case = cases(dtypes=("float32",), supports=())[5]
    result, _ = evaluate(as_kernel(examples.numpy_float32), case)
    worst, tensor = result.worst
    row = next(r for r in result.report.rows if r.name == tensor)
    assert worst == row.max_abs_err / row.bound and 0 <= worst <= 1
    assert all(r.max_abs_err / r.bound <= worst for r in result.report.rows if r.bound > 0)
    assert not math.isnan(worst)
