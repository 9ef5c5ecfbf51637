"""Every code block of README.md and docs/*.md runs as written, and what it shows is what it prints.

Blocks by their fence:
    python  run as a user runs them: a file's blocks, in order, saved as one script (a later
            block may use an earlier block's names) and run by `python` in a scratch
            directory, so that what only fails in a script fails here too (worker processes
            import the script: an unguarded LocalCluster). Blocks from the first that imports
            an optional extra this Python lacks on are not run: the test skips, naming it.
    text    output or a listing, not run. A text block right after a python block is that
            block's output and must equal what it printed: words and fixed-point numbers
            exactly, numbers in e-notation to within a factor of 10 (they are rounding
            errors, which differ in their last digits from machine to machine).
    bash    each line is a command (after `#`: a comment), handled by `check_command`:
            `numpy-attention ...` runs as `python -m numpy_attention ...` in a scratch
            directory (where the file's Python blocks that write files, each
            self-contained, ran first) and must exit 0, except the slow ones (see
            SLOW_COMMANDS); benchmark scripts and pytest runs are checked, not run (see there).
README's first bash block is the install-and-test pair; it is not run here, it is
compared with what CI runs (.ci/run).
Some documented outputs come from commands too slow to run here in full; the
`test_*_key_lines` tests run a small part of them and compare it with the doc. The
benchmark outputs of docs/performance.md must name their machine, and every
`module.py: name` reference must name a function that exists.
"""
import importlib.util
import json
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from optional import DASK_REASON, JAX_REASON, MATPLOTLIB_REASON, TORCH_REASON

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README] + sorted((ROOT / "docs").glob("*.md"))
# The optional extras a documented block may import, by module: how to install each.
EXTRAS = {"torch": TORCH_REASON, "jax": JAX_REASON, "matplotlib": MATPLOTLIB_REASON,
          "distributed": DASK_REASON, "dask": DASK_REASON}
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
E_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?e[-+]?\d+")

# `numpy-attention vanishing` takes about half a minute and `--train` as long; the test
# suite must stay fast, so these commands are checked like the benchmarks (their options
# exist in --help), and test_vanishing_key_lines runs a few cells of them against the doc.
SLOW_COMMANDS = {"vanishing"}


def blocks(path):
    """[(language, code, follows_previous)]: follows_previous is True when only blank
    lines separate the block from the one before it."""
    text = path.read_text()
    found, end = [], None
    for m in FENCE.finditer(text):
        follows = end is not None and text[end:m.start()].strip() == ""
        found.append((m.group(1), m.group(2), follows))
        end = m.end()
    return found


def doc_id(path):
    return str(path.relative_to(ROOT))


# ----------------------------------------------------------------------------- output blocks

def same_output(expected, actual):
    """True if `actual` (printed) matches `expected` (the doc's text block): see the module
    docstring. Returns (ok, the first differing line pair)."""
    exp_lines = [l.rstrip() for l in expected.strip("\n").splitlines()]
    act_lines = [l.rstrip() for l in actual.strip("\n").splitlines()]
    if len(exp_lines) != len(act_lines):
        return False, (expected, actual)
    for e, a in zip(exp_lines, act_lines):
        if not same_line(e, a):
            return False, (e, a)
    return True, None


def same_line(expected, actual, loose=None):
    """Words and fixed-point numbers equal; e-notation numbers within a factor of 10
    (`loose`: when given, a predicate on the token index that says which tokens are loose
    instead, for whitespace-separated tables)."""
    if loose is not None:
        e, a = expected.split(), actual.split()
        return len(e) == len(a) and all(within_10x(x, y) if loose(i, len(e)) else x == y
                                        for i, (x, y) in enumerate(zip(e, a)))
    if E_NUMBER.sub("#", expected).split() != E_NUMBER.sub("#", actual).split():
        return False
    return all(within_10x(x, y) for x, y in zip(E_NUMBER.findall(expected), E_NUMBER.findall(actual)))


def within_10x(expected, actual):
    x, y = float(expected), float(actual)
    if x == y:
        return True
    return x != 0 and y != 0 and (x > 0) == (y > 0) and 0.1 <= y / x <= 10


def test_same_output_can_fail():
    assert same_output("a 1.5 2e-16\n", "a 1.5 9e-16")[0]
    assert not same_output("a 1.5 2e-16", "a 1.6 2e-16")[0]
    assert not same_output("a 1.5 2e-16", "a 1.5 2e-14")[0]
    assert not same_output("True", "False")[0]
    assert not same_output("x\ny", "x")[0]


# ----------------------------------------------------------------------------- python blocks

def missing_extra(code):
    """How to install an optional extra that `code` imports and this Python lacks, or None."""
    for name in re.findall(r"^\s*(?:import|from)\s+(\w+)", code, flags=re.M):
        if name in EXTRAS and importlib.util.find_spec(name) is None:
            return EXTRAS[name]
    return None


END_OF_BLOCK = "----- end of a documented python block -----"


def run_as_script(name, codes, cwd):
    """Run `codes` (Python blocks) saved as one script `cwd/name` by `python`, as a user does;
    returns what each block printed. After each block the script prints END_OF_BLOCK (in the
    main process only: a worker process that imports the script prints nothing)."""
    end = f'\nif __name__ == "__main__":\n    print({END_OF_BLOCK!r}, flush=True)\n'
    script = cwd / name
    script.write_text("".join(code + end for code in codes))
    res = subprocess.run([sys.executable, script.name], cwd=cwd, capture_output=True, text=True,
                         timeout=600)
    outputs = res.stdout.split(END_OF_BLOCK + "\n")
    assert res.returncode == 0, (f"{name}: python block {len(outputs)} exited {res.returncode}:\n"
                                 f"{res.stderr[-3000:]}")
    assert len(outputs) == len(codes) + 1 and outputs[-1] == "", res.stdout
    return outputs[:-1]


def test_run_as_script_can_fail(tmp_path):
    assert run_as_script("ok.py", ["print(1)", "x = 2", "print(x)"], tmp_path) == ["1\n", "", "2\n"]
    with pytest.raises(AssertionError, match="python block 2 exited 1"):
        run_as_script("fails.py", ["print(1)", "raise SystemExit(1)"], tmp_path)
    # A process started at a script's top level: the child imports the script and starts one
    # in turn, which fails (what an unguarded LocalCluster does); exec in one process did not.
    start = ("child = multiprocessing.get_context('spawn').Process(target=print); "
             "child.start(); child.join(); assert child.exitcode == 0\n")
    with pytest.raises(AssertionError, match="python block 1 exited 1"):
        run_as_script("unguarded.py", ["import multiprocessing\n" + start], tmp_path)
    guarded = "import multiprocessing\nif __name__ == '__main__':\n    " + start
    run_as_script("guarded.py", [guarded], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOCS if "```python" in p.read_text()], ids=doc_id)
def test_python_blocks_run_and_print_what_the_doc_shows(path, tmp_path):
    found = blocks(path)
    python = [i for i, (language, _, _) in enumerate(found) if language == "python"]
    reasons = [missing_extra(found[i][1]) for i in python]
    skip = next((reason for reason in reasons if reason), None)
    runnable = python[:reasons.index(skip)] if skip else python
    outputs = run_as_script(f"{path.stem}_blocks.py", [found[i][1] for i in runnable], tmp_path)
    for i, output in zip(runnable, outputs):
        if i + 1 < len(found) and found[i + 1][0] == "text" and found[i + 1][2]:
            ok, diff = same_output(found[i + 1][1], output)
            assert ok, f"{doc_id(path)}: the output shown differs from what the block prints: {diff}"
    if skip:
        pytest.skip(f"{doc_id(path)}: python block {len(runnable) + 1} and the ones after it: {skip}")


# ----------------------------------------------------------------------------- shell blocks

def run_cli(args, cwd, timeout=120):
    return subprocess.run([sys.executable, "-m", "numpy_attention", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def help_options(argv):
    """The --options that `argv --help` lists."""
    res = subprocess.run(argv + ["--help"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return set(re.findall(r"--[\w-]+", res.stdout))


def used_options(args):
    return {a.split("=")[0] for a in args if a.startswith("--")}


def check_command(line, cwd):
    """Run or check one documented command line; returns a note of what was done."""
    args = shlex.split(line)
    if args[0] == "numpy-attention":
        if args[1] in SLOW_COMMANDS:
            missing = used_options(args) - help_options([sys.executable, "-m", "numpy_attention", args[1]])
            assert not missing, f"{line!r}: options not in --help: {missing}"
            return "options"
        res = run_cli(args[1:], cwd)
        assert res.returncode == 0, f"{line!r} exited {res.returncode}: {res.stderr}"
        return "ran"
    if args[:3] == ["python3", "-m", "pytest"] and "--attention-kernel" in args:
        # The pytest plugin on a kernel: run, in an empty directory (its items alone).
        res = subprocess.run([sys.executable, *args[1:], "-p", "no:cacheprovider"], cwd=cwd,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0 and " passed" in res.stdout, f"{line!r}: {res.stdout}{res.stderr}"
        return "ran"
    if args[:2] == ["python3", "-m"] and args[2] == "pytest":
        # The test suite's own files: this suite runs them; here they must exist.
        files = [a.split("::")[0] for a in args[3:] if not a.startswith("-")]
        assert files and all((ROOT / f).is_file() for f in files), line
        return "exists"
    if args[0] == "python3" and args[1].startswith("benchmarks/"):
        # A benchmark takes minutes, and the tests never time anything: the script's --help
        # must work and list every option the doc uses.
        missing = used_options(args[2:]) - help_options([sys.executable, str(ROOT / args[1])])
        assert not missing, f"{line!r}: options not in --help: {missing}"
        return "options"
    raise AssertionError(f"no rule for the documented command {line!r}: add one to test_docs.py")


def commands(code):
    lines = (line.split("#")[0].strip() for line in code.splitlines())
    return [line for line in lines if line]


def shell_blocks(path):
    found = [code for language, code, _ in blocks(path) if language == "bash"]
    return found[1:] if path == README else found          # README's first: test_top_commands...


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOCS if shell_blocks(p)], ids=doc_id)
def test_shell_blocks_run(path, tmp_path):
    # The files the commands read (my_case.npz): the blocks that write them, each self-contained.
    writers = [code for language, code, _ in blocks(path) if language == "python" and "np.savez" in code]
    run_as_script(f"{path.stem}_files.py", writers, tmp_path)
    done = [check_command(line, tmp_path) for code in shell_blocks(path) for line in commands(code)]
    assert done


@pytest.mark.slow
def test_check_command_can_fail(tmp_path):
    with pytest.raises(AssertionError):
        check_command("numpy-attention crosscheck missing.npz", tmp_path)          # exit 2
    with pytest.raises(AssertionError):
        check_command("numpy-attention vanishing --no-such-option", tmp_path)
    with pytest.raises(AssertionError):
        check_command("python3 benchmarks/bench_mha.py --no-such-option", tmp_path)
    with pytest.raises(AssertionError):
        check_command("make docs", tmp_path)


# ----------------------------------------------------------------------------- README and CI

def test_top_commands_and_ci_agree():
    first_block = next(code for language, code, _ in blocks(README) if language == "bash").splitlines()
    assert first_block[0] == "pip install . && numpy-attention demo"
    test_command = first_block[1].split("&&")[-1].strip()
    assert test_command == "python3 -m pytest -q"
    # .ci/run's two legs, each ending in the README's test command exactly: the README's
    # installs, then '.[test]' alone in a fresh venv.
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    runs = [i for i, line in enumerate(ci) if line == test_command]
    assert len(runs) == 2, ".ci/run must run the README's test command in each of its two legs"
    every_extra, test_alone = ci[:runs[0]], ci[runs[0] + 1:runs[1]]
    installs = [f"python3 -m {command.strip()}" for command in first_block[1].split("&&")[:-1]]
    assert [line for line in every_extra if "pip install" in line] == installs
    assert [line for line in test_alone if line and not line.startswith("#")] == [
        'venv=$(mktemp -d)', 'trap \'rm -rf "$venv"\' EXIT', 'python3 -m venv "$venv"',
        'source "$venv/bin/activate"', "python3 -m pip install '.[test]'"]


def test_readme_is_short_and_names_the_blog_post():
    text = README.read_text()
    assert len(text.encode()) <= 12 * 1024
    assert "从点积到信息检索" in text and "tests/seed_model.py" in text


@pytest.mark.slow
def test_readme_command_list_matches_the_cli():
    listing = next(code for language, code, _ in blocks(README)
                   if language == "text" and code.startswith("numpy-attention"))
    documented = {line.split()[1] for line in listing.splitlines()}
    res = run_cli(["--help"], ROOT)
    listed = set(re.search(r"\{([\w,]+)\}", res.stdout).group(1).split(","))
    assert documented == listed


def test_docs_links_resolve():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{doc_id(path)} links to a missing {target}"


def test_user_docs_have_no_history_or_machine_paths():
    for path in DOCS:
        text = path.read_text()
        for phrase in ("/work/", "issue", "target", "earlier version", "was wrong", "no longer"):
            assert phrase not in text.lower(), f"{doc_id(path)} says {phrase!r}"


# ----------------------------------------------------------------------------- key lines of slow outputs

def doc_text_blocks(name):
    return [code for language, code, _ in blocks(ROOT / "docs" / name) if language == "text"]


@pytest.mark.slow
def test_vanishing_key_lines(tmp_path):
    """Cells d_k = 16 and 1024 with 8 keys (each cell has its own seed, so they print what
    the full sweep prints) and the alpha table, against the doc's table: every column
    exactly, but the two err columns (rounding errors) within a factor of 10."""
    res = run_cli(["vanishing", "--d-k", "16,1024", "--n-keys", "8"], tmp_path)
    assert res.returncode == 0, res.stderr
    shown = doc_text_blocks("vanishing.md")[0].splitlines()
    rows = [l for l in res.stdout.splitlines() if re.match(r"\s*\d", l)]
    assert len(rows) == 4 + 5                             # 2 cells x (scaled, unscaled); 5 alphas
    for row in rows:
        key = row.split()[:3] if len(row.split()) == 13 else row.split()[:4]
        match = [l for l in shown if l.split()[:len(key)] == key and len(l.split()) == len(row.split())]
        assert len(match) == 1, f"no row {key} in docs/vanishing.md"
        assert same_line(match[0], row, loose=lambda i, n: i >= n - 2), (match[0], row)


@pytest.mark.slow
def test_training_key_lines(tmp_path):
    """The first 25 steps at lr 0.001 (the run is deterministic and its first steps do not
    depend on how many follow) against the doc's SGD table: losses at steps 0 and 25."""
    res = run_cli(["vanishing", "--train", "--lr", "0.001", "--steps", "25"], tmp_path)
    assert res.returncode == 0, res.stderr
    sgd = next(block for block in doc_text_blocks("vanishing.md") if "optimizer sgd" in block)
    for row in [l for l in res.stdout.splitlines() if re.match(r"(1/sqrt|unscaled)\S*\s+0\.001\s+\d", l)][:2]:
        prefix = row.split()
        shown = [l.split() for l in sgd.splitlines() if l.split()[:2] == prefix[:2]][0]
        assert shown[:len(prefix)] == prefix, (shown, prefix)


@pytest.mark.slow
def test_crosscheck_exit_codes(tmp_path):
    """README and docs/crosscheck.md: 0 pass, 1 a tensor fails, 2 bad input."""
    assert run_cli(["crosscheck", "--write-example", "case.npz"], tmp_path).returncode == 0
    res = run_cli(["crosscheck", "case.npz", "--json"], tmp_path)
    assert res.returncode == 0 and json.loads(res.stdout)["passed"] is True
    case = dict(np.load(tmp_path / "case.npz"))
    case["out"] = case["out"] * 1.01
    np.savez(tmp_path / "wrong.npz", **case)
    res = run_cli(["crosscheck", "wrong.npz"], tmp_path)
    assert res.returncode == 1 and "FAIL" in res.stdout
    del case["q"]
    np.savez(tmp_path / "bad.npz", **case)
    res = run_cli(["crosscheck", "bad.npz"], tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "q" in res.stderr


def test_benchmark_tables_name_their_machine():
    """Every benchmark output shown in docs/performance.md (its text blocks that are not a
    Python block's output) starts with the machine line the scripts print and ends with how
    much CPU other processes took during the run (benchmarks/_common.py)."""
    outputs = [code for language, code, follows in blocks(ROOT / "docs" / "performance.md")
               if language == "text" and not follows]
    assert len(outputs) >= 3
    for block in outputs:
        lines = block.strip().splitlines()
        assert re.match(r"machine: .+, \d+ cores; Python [\d.]+, numpy [\d.]+.*, torch", lines[0]), lines[0]
        assert re.match(r"other processes used \d+ CPU-s of the \d+ available", lines[-1]), lines[-1]


# ----------------------------------------------------------------------------- code references

CODE_REF = re.compile(r"`(?:numpy_attention/)?((?:\w+/)*\w+\.py): (\w+)")


def test_code_references_name_functions_that_exist():
    """`module.py: name` in README and docs (the math-to-code table, derivations.md) names a
    function or class defined in that module of the package, or a table it assigns at the top
    (options.py: OPTIONS)."""
    refs = [(doc_id(path), m.group(1), m.group(2)) for path in DOCS for m in CODE_REF.finditer(path.read_text())]
    assert len(refs) >= 20
    for doc, module, name in refs:
        source = ROOT / "numpy_attention" / module
        assert source.is_file(), f"{doc}: no module numpy_attention/{module}"
        assert re.search(rf"^(\s*(def|class) {name}\b|{name} = )", source.read_text(), flags=re.M), \
            f"{doc}: numpy_attention/{module} defines no {name}"


def test_readme_table_points_at_the_textbook():
    table = README.read_text().split("## Learner")[1].split("```")[0]
    for name in ("textbook.py: plain_attention_forward", "textbook.py: plain_attention_backward",
                 "textbook.py: textbook_forward", "textbook.py: textbook_backward", "scores.py: attention_scores",
                 "softmax.py: softmax_forward", "softmax.py: softmax_backward"):
        assert name in table
