"""The conformance run against an untrusted kernel: it cannot change the case it is judged on,
its hang, crash or exit is one case's TIMEOUT or ERROR row, what it prints stays off the
report, and the run's verdicts survive a Ctrl-C and a full disk; the report's lines, JSON and
coverage rule. The hostile kernels are in conform_hostile.py."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_conform import KERNEL_SCRIPT

import conform_bugs
import conform_hostile
import numpy_attention as na
from numpy_attention.commands.cli import main
from numpy_attention.conformance import examples
from numpy_attention.conformance.grid import PER_ROLE, ROLES, cases, draw
from numpy_attention.conformance.judge import evaluate
from numpy_attention.conformance.kernels import as_kernel

TESTS = pathlib.Path(__file__).resolve().parent
TIMEOUT = 3.0                           # a case's seconds in the hung kernel's run
SLACK = 30.0                            # seconds a loaded machine may add to stopping a case
WIDTH = 100
NUMBERS = ("worst_ratio", "seconds", "shrink_seconds", "budget", "timeout", "errors", "timeouts",
           "roles", "roles_run", "least_roles_run", "cases_run", "grid_cases")    # the JSON's number fields


def first_case(option, name):
    """The first case of the option's cell that gives the kernel the argument `name`."""
    return next(c for c in cases(dtypes=("float32",), supports=(option,))
                if c.cell == option and name in draw(c) and c.n_q > 1)


def attacked(case):
    return case.cell == "causal" and case.n_k == 1


# ----------------------------------------------------------------------------- the case is the case's

ARGUMENTS = [("mask", "mask"), ("dropout_mask", "dropout"), ("page_table", "paged"),
             ("cache_seqlens", "paged"), ("cu_seqlens_q", "varlen"), ("cu_seqlens_k", "varlen"),
             ("q", "causal"), ("bias", "bias")]


@pytest.mark.parametrize("name, option", ARGUMENTS, ids=[name for name, _ in ARGUMENTS])
def test_a_write_into_an_argument_is_an_error(name, option):
    case = first_case(option, name)
    plain, _ = evaluate(as_kernel(conform_hostile.writes(name)), case)
    assert plain.status == "ERROR" and "read-only copies of the case" in plain.error, plain
    sneaky, _ = evaluate(as_kernel(conform_hostile.writes(name, sneaky=True)), case)
    assert sneaky.status == "ERROR", sneaky
    assert sneaky.error == (f"KernelError: the kernel wrote into its argument {name} (a copy of the "
                            f"case's {name}, which is judged as drawn)")


@pytest.mark.slow
def test_a_kernel_that_drops_the_mask_and_says_so_in_it_fails_the_command(tmp_path, clock, capsys):
    argv = ["conform", "conform_hostile:drops_mask", "--quiet", "--budget", "3.5", "--out", str(tmp_path),
            "--properties", "none"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "mask          float32       2    2/7       0       0       2" in out, out


def test_a_torch_kernel_that_writes_into_its_mask_is_an_error(torch):
    def drops_mask(q, k, v, mask=None, **options):
        mask[...] = True
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    result, _ = evaluate(as_kernel(drops_mask, kind="torch"), first_case("mask", "mask"))
    assert result.status == "ERROR" and "wrote into its argument mask" in result.error, result


def test_a_nan_in_a_case_is_read_back_as_any_nan_and_a_nan_written_is_a_write(torch):
    """A bfloat16 NaN does not come back through float32 with its payload and sign (nan_keys' cases
    hold NaN): still no write; a kernel that writes a NaN over a number has written."""
    from numpy_attention.conformance.grid import make_case
    case = make_case("bfloat16", "plain", "short", (), (), 1, 1, 1, 3, 5, 8, "zero", 0)
    arrays = case.arrays()
    arrays["k"][..., 0, :] = np.nan
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert np.isnan(as_kernel(sdpa, kind="torch").results(arrays, ())["out"]).any()

    def writes_nan(q, k, v):
        k[..., 1, 0] = float("nan")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with pytest.raises(Exception, match="the kernel wrote into its argument k"):
        as_kernel(writes_nan, kind="torch").results(arrays, ())


def test_what_a_kernel_returns_besides_its_results_is_not_read():
    def returns_a_mask(q, k, v, mask=None, **options):      # computed without it, and a mask to match
        return {**examples.numpy_float32(q, k, v, **options), "mask": np.ones_like(mask)}

    result, _ = evaluate(as_kernel(returns_a_mask), first_case("mask", "mask"))
    assert result.status == "FAIL", result


# ----------------------------------------------------------------------------- exits, crashes, hangs

@pytest.mark.slow
@pytest.mark.parametrize("kernel, error", [
    (conform_hostile.segfaults, "KernelError: the kernel's process ended (killed by SIGSEGV)"),
    (conform_hostile.aborts, "KernelError: the kernel's process ended (killed by SIGABRT)"),
    (conform_hostile.exits_at_once, "KernelError: the kernel's process ended (exited with status 0)"),
    (conform_hostile.exits, "SystemExit(0) raised in _exits (conform_hostile.py:"),
], ids=["segfault", "abort", "os._exit", "sys.exit"])
def test_a_crash_or_an_exit_is_one_cases_error(kernel, error, clock, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                         # a core file, where the system writes one
    report = na.conform(kernel, budget=3.5, out_dir=tmp_path / "out", properties=())
    assert [attacked(r.case) for r in report.results] == [False, True, False, False]
    assert [r.status for r in report.results] == ["PASS", "ERROR", "PASS", "PASS"]
    assert report.results[1].error.startswith(error), report.results[1].error
    record = (tmp_path / "out" / "conform.jsonl").read_text().splitlines()
    assert [json.loads(line)["status"] for line in record[1:]] == ["PASS", "ERROR", "PASS", "PASS"]


@pytest.mark.slow
def test_a_hung_case_is_a_timeout_row_and_the_sweep_goes_on(clock):
    report = na.conform(conform_hostile.hangs, budget=3.5, timeout=TIMEOUT, properties=())
    assert [r.status for r in report.results] == ["PASS", "TIMEOUT", "PASS", "PASS"]
    hung = report.results[1]
    assert attacked(hung.case) and TIMEOUT <= hung.seconds < TIMEOUT + SLACK
    assert hung.error == f"no results within {TIMEOUT:g} s: the kernel's process was stopped"
    assert report.status == "FAIL" and "causal        float32       2    2/7       1       0       0         1" \
        in str(report)


def test_an_exit_in_this_process_is_an_error_row_too(clock):
    report = na.conform(conform_hostile.exits_3, budget=1.5, isolate=False, properties=())
    assert report.timeout is None and [r.status for r in report.results] == ["PASS", "ERROR"]
    assert report.results[1].error.startswith("SystemExit(3) raised in _exits_3 (conform_hostile.py:")


@pytest.mark.parametrize("kernel", ["exits", "exits_3"])
def test_the_command_reports_a_kernels_exit_with_its_own_code(kernel, clock, tmp_path, capsys):
    assert main(["conform", f"conform_hostile:{kernel}", "--quiet", "--budget", "3.5", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "-> FAIL" in out and "SystemExit(" in out


def test_a_module_that_exits_at_import_is_a_usage_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    np.savez(tmp_path / "case.npz", q=np.ones((1, 1, 2, 4)), k=np.ones((1, 1, 2, 4)),
             v=np.ones((1, 1, 2, 4)), out=np.ones((1, 1, 2, 4)))
    for argv in (["conform", "exits_at_import:kernel"], ["crosscheck", "case.npz", "--score-mod", "exits_at_import:mod"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cannot import exits_at_import: SystemExit(0) raised in <module> " \
            "(exits_at_import.py:2)" in err, err


def test_a_score_mod_that_exits_ends_crosscheck_with_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "exiting_mods.py").write_text("import sys\n\ndef bias(score, b, h, q_idx, kv_idx):\n"
                                              "    sys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    np.savez(tmp_path / "case.npz", q=q, k=k, v=v, out=na.attention_forward(q, k, v)[0])
    assert main(["crosscheck", "case.npz", "--score-mod", "exiting_mods:bias"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("numpy-attention crosscheck: user code ended the command: SystemExit(0) "
                                 "raised in bias (exiting_mods.py:4)\n")


# ----------------------------------------------------------------------------- a kernel in a worker

def test_a_kernel_the_worker_cannot_load_is_refused_before_the_sweep():
    with pytest.raises(TypeError, match=r"the kernel .*<lambda> cannot be loaded in a worker process "
                                        r"\(AttributeError: Can't pickle local object.*isolate=False"):
        na.conform(lambda q, k, v, **options: examples.numpy_float32(q, k, v, **options), dtypes="float32", properties=())
    with pytest.raises(TypeError, match=r"Unloadable cannot be loaded in a worker process \(RuntimeError: "
                                        r"this kernel is not to be unpickled\)"):
        na.conform(conform_hostile.Unloadable(), dtypes="float32", kind="numpy", properties=())


def test_what_a_kernel_prints_stays_off_the_json(tmp_path, clock, capfd, monkeypatch):
    (tmp_path / "talks_at_import.py").write_text("print('importing the kernel')\n"
                                                 "from conform_hostile import prints as kernel\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["conform", "talks_at_import:kernel", "--quiet", "--json", "--budget", "1.5", "--properties",
                 "none"]) == 1
    out, err = capfd.readouterr()
    assert json.loads(out)["cases_run"] == 2
    assert "importing the kernel" in err and "the kernel says hello" in err and "C code says hello" in err


# ----------------------------------------------------------------------------- what a run keeps

@pytest.mark.slow
def test_a_ctrl_c_prints_the_cases_judged_so_far(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    record = tmp_path / "out" / "conform.jsonl"
    with subprocess.Popen([sys.executable, "-m", "numpy_attention", "conform", "conform_hostile:slow",
                           "--quiet", "--out", "out"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as process:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not record.exists() or record.read_text().count("\n") < 3):
            time.sleep(0.05)
        judged = record.read_text().count("\n") - 1                 # the settings' line, then the cases
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err.endswith("numpy-attention: interrupted\n"), err
    head, coverage = out.split("\ncoverage: ")                     # (the run's line may wrap)
    run_line = " ".join(line.strip() for line in head.splitlines()[1:])
    ran = int(run_line.split()[0])
    assert 2 <= judged <= ran < 28 and run_line.endswith("-> INCOMPLETE"), out
    assert " property trials run in " in run_line, out
    assert coverage.splitlines()[0].endswith("not enough to pass (the run was interrupted)"), out


@pytest.mark.slow
def test_a_worker_whose_run_was_killed_ends_itself(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    code = "import conform_hostile, numpy_attention as na; na.conform(conform_hostile.tells_and_hangs, properties=())"
    with subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env) as run:
        deadline = time.monotonic() + 120
        while not (tmp_path / "worker.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = int((tmp_path / "worker.pid").read_text())
        run.kill()
    deadline = time.monotonic() + SLACK
    while running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(worker)


def test_an_out_that_cannot_be_written_is_refused_before_the_sweep(tmp_path, clock, capsys):
    argv = ["conform", "conform_hostile:slow", "--quiet", "--budget", "1.5", "--out"]
    assert main(argv + ["/dev/full"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "numpy-attention conform: /dev/full: not a directory\n"
    full = tmp_path / "full"
    full.mkdir()
    (full / "conform.jsonl").symlink_to("/dev/full")                # a device with no space left
    assert main(argv + [str(full)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"numpy-attention conform: {full / 'conform.jsonl'}: No space left on device\n"


LATIN_1 = '''\
import sys
sys.stderr.buffer.write("caf\\u00e9 cr\\u00e8me\\n".encode("latin-1"))
'''


def test_a_command_may_write_any_bytes_on_stderr(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(LATIN_1 + KERNEL_SCRIPT)
    case = cases(dtypes=("float32",), supports=())[3]
    result, _ = evaluate(as_kernel(f"{sys.executable} {script} {{in}} {{out}}"), case)
    assert result.status == "PASS", result
    result, _ = evaluate(as_kernel(f"{sys.executable} {script} {{in}} {{out}} fail"), case)
    assert result.error == f"KernelError: {sys.executable} exited with status 3: cannot compute this case"
    script.write_text(LATIN_1 + "sys.exit(4)\n")
    result, _ = evaluate(as_kernel(f"{sys.executable} {script}"), case)
    assert result.error == f"KernelError: {sys.executable} exited with status 4: caf\ufffd cr\ufffdme"


def running(pid):
    """Whether process `pid` runs (a zombie, killed and not yet reaped by its new parent, does not)."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_a_hung_command_is_a_timeout_row_and_all_it_started_is_stopped(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text("import pathlib, subprocess, sys, time\n"
                      "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
                      "pathlib.Path(__file__).with_name('child').write_text(str(child.pid))\n"
                      "time.sleep(3600)\n")
    start = time.monotonic()
    result, _ = evaluate(as_kernel(f"{sys.executable} {script}", timeout=TIMEOUT), cases(supports=())[0])
    assert result.status == "TIMEOUT" and TIMEOUT <= time.monotonic() - start < TIMEOUT + SLACK
    assert result.error == f"no results within {TIMEOUT:g} s: {sys.executable} was stopped"
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + SLACK
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child)


# ----------------------------------------------------------------------------- the report

@pytest.mark.slow
def test_every_report_line_is_at_most_100_columns(clock):
    failing = na.conform(conform_bugs.scale_off, dtypes="float32", supports=("causal", "gqa", "gradients"),
                         budget=5.5, properties=())
    assert failing.failures and any(f.shrunk.report.diagnosis for f in failing.failures)
    erring = na.conform(conform_hostile.exits, budget=3.5, supports=("causal", "gqa", "window"), properties=())
    long_kernel = failing._replace(kernel=f"{sys.executable} " + " ".join(["--a-long-option-name"] * 8))
    for report in (failing, erring, long_kernel):
        lines = str(report).splitlines()
        assert max(len(line) for line in lines) <= WIDTH, max(lines, key=len)


def test_json_numbers_are_numbers_or_null(clock):
    data = json.loads(na.conform(conform_hostile.returns_nan, budget=1.5, properties=()).to_json())
    assert [case["worst_ratio"] for case in data["cases"]] == [None, None]
    assert data["cells"][0]["worst_ratio"] is None and data["cells"][0]["worst_tensor"] == "out"

    def numbers(value):
        """The values of the report's number fields, at any depth."""
        if isinstance(value, list):
            return [x for item in value for x in numbers(item)]
        if not isinstance(value, dict):
            return []
        return [x for key, item in value.items()
                for x in ([item] if key in NUMBERS else numbers(item))]
    found = numbers(data)
    assert len(found) > 10 and all(x is None or isinstance(x, (int, float)) for x in found), found


@pytest.mark.slow
def test_a_budget_that_leaves_a_role_unrun_does_not_pass(tmp_path, clock, capsys):
    argv = ["conform", "numpy_attention.conformance.examples:numpy_float32", "--dtypes", "float32",
            "--options", "causal", "--out", str(tmp_path), "--properties", "none", "--budget"]
    assert main(argv + ["0.5"]) == 1                             # one case: plain's single key
    out, err = capsys.readouterr()
    assert out.splitlines()[1].endswith(f"1 of {PER_ROLE * 14} cases of the grid run in 2 s (budget 0.5 s, "
                                        f"a case at most 60 s) -> INCOMPLETE")
    assert out.splitlines()[2] == ("coverage: 0 of 7 roles run in every cell: not enough to pass (a larger "
                                   "budget runs more)")
    assert err == ("conform: 28 cases in 2 cells; no case starts after 0.5 s, and a case runs at most 60 s; then each\n"
                   "  failing cell is shrunk, in at most 64 more runs of the kernel\n")
    assert main(argv + [f"{2 * len(ROLES) - 0.5}"]) == 0          # every role of both cells
    assert "coverage: every role of every cell run (7 of 7)" in capsys.readouterr().out
