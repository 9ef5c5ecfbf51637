"""The 1/sqrt(d_k) study: its numbers, its gradient verification, its CLI."""
import csv
import json
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from optional import needs_matplotlib

from numpy_attention import attention_backward, attention_forward
from numpy_attention.commands.cli import main
from numpy_attention.experiments import compare, directional_error, measure, scale_sweep, sweep, train
from test_cli import usage_error

KEYS = {"d_k": int, "n_keys": int, "scaled": bool, "logit_var": float, "entropy": float,
        "max_weight": float, "jacobian_norm": float, "grad_norm": float,
        "complex_step_err": float, "central_diff_err": float}


def cell(records, d_k, n_keys, scaled):
    (record,) = [r for r in records if (r["d_k"], r["n_keys"], r["scaled"]) == (d_k, n_keys, scaled)]
    return record


# trials chosen so that 5% is >= 5 standard errors of the pooled variance: per trial the
# relative variance of the estimate is about 2/d_k + 2/N_k (3(1 + 2/N_k) - 1 at d_k = 1)
@pytest.mark.parametrize("d_k, n_keys, trials", [(1, 8, 30000), (64, 8, 3000), (256, 128, 300)])
def test_logit_variance_is_d_k_unscaled_and_1_scaled(d_k, n_keys, trials):
    scaled, unscaled = measure(d_k, n_keys, (d_k ** -0.5, 1.0), trials, seed=3)
    assert unscaled["logit_var_theory"] == d_k and scaled["logit_var_theory"] == pytest.approx(1.0)
    for record in (scaled, unscaled):
        assert record["logit_var"] == pytest.approx(record["logit_var_theory"], rel=0.05)


def test_unscaled_gradient_vanishes_with_8_keys_scaled_does_not():
    records = sweep(d_ks=(64, 1024), n_keys=(8,), trials=100)
    unscaled = cell(records, 64, 8, False)["grad_norm"] / cell(records, 1024, 8, False)["grad_norm"]
    scaled = cell(records, 64, 8, True)["grad_norm"] / cell(records, 1024, 8, True)["grad_norm"]
    assert unscaled > 1e3
    assert 1 / 3 < scaled < 3


def test_complex_step_verifies_every_cell_central_differences_cannot():
    records = sweep(d_ks=(1, 16, 256, 4096), n_keys=(8, 128), trials=20)
    for r in records:
        assert r["complex_step_err"] < 1e-13, r
    vanished = [r for r in records if r["grad_norm_min"] < 1e-12]
    assert vanished                                   # the check did meet vanished gradients
    assert max(r["central_diff_err"] for r in vanished) > 1e-2      # where the central check is blind


def test_directional_error_sees_a_gradient_wrong_by_one_part_in_a_million():
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((4, 1, 64)), rng.standard_normal((4, 8, 64))
    v, dout = rng.standard_normal((4, 8, 3)), rng.standard_normal((4, 1, 3))
    w = rng.standard_normal((4, 1, 64))
    w /= np.linalg.norm(w, axis=-1, keepdims=True)
    dq = attention_backward(dout, attention_forward(q, k, v, scale=1.0)[1]).dq
    assert np.all(directional_error(q, k, v, dout, w, 1.0, dq, "complex") < 1e-14)
    wrong = dq + 1e-6 * np.linalg.norm(dq, axis=-1, keepdims=True) * w   # error 1e-6 ||dq|| along w
    assert np.all(directional_error(q, k, v, dout, w, 1.0, wrong, "complex") > 0.5e-6)


def test_many_keys_small_d_k_unscaled_jacobian_is_larger():
    # a near-uniform softmax has ||J||_F ~ 1/sqrt(N_k): saturating a little first *raises* it
    records = sweep(d_ks=(16,), n_keys=(128,), trials=200)
    assert cell(records, 16, 128, False)["jacobian_norm"] > 2 * cell(records, 16, 128, True)["jacobian_norm"]
    assert cell(records, 16, 128, True)["jacobian_norm"] == pytest.approx(128 ** -0.5, rel=0.6)


def test_scale_sweep_alpha_half_preserves_variance_larger_alpha_flattens():
    by_alpha = {r["alpha"]: r for r in scale_sweep(256, n_keys=(8,), trials=400)}
    assert by_alpha[0.5]["logit_var"] == pytest.approx(1.0, rel=0.1)
    assert by_alpha[0.0]["max_weight"] > 0.99                       # saturated
    assert by_alpha[1.0]["entropy"] == pytest.approx(np.log(8), rel=0.01)   # near uniform
    grads = [by_alpha[a]["grad_norm"] for a in (0.5, 0.75, 1.0)]
    assert grads[0] > grads[1] > grads[2]                           # dL/dq shrinks with the scale


def test_each_cell_is_reproducible_on_its_own():
    alone = sweep(d_ks=(16,), n_keys=(8,), trials=30, seed=5)
    among = sweep(d_ks=(4, 16), n_keys=(8,), trials=30, seed=5)
    assert alone == [r for r in among if r["d_k"] == 16]
    assert alone != sweep(d_ks=(16,), n_keys=(8,), trials=30, seed=6)


@pytest.mark.parametrize("kwargs, name", [({"trials": 0}, "trials"), ({"d_ks": ()}, "d_ks"),
                                          ({"n_keys": (8, -1)}, "n_keys")])
def test_sweep_rejects_bad_arguments_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        sweep(**kwargs)


def test_cli_json_and_csv_schema(tmp_path, capsys):
    path_json, path_csv = tmp_path / "v.json", tmp_path / "v.csv"
    assert main(["vanishing", "--d-k", "4,64", "--n-keys", "8", "--trials", "10",
                 "--json", str(path_json), "--csv", str(path_csv)]) == 0
    assert "err CS" in capsys.readouterr().out                      # the table
    records = json.loads(path_json.read_text())
    assert isinstance(records, list) and len(records) == 4
    for r in records:
        for key, kind in KEYS.items():
            assert isinstance(r[key], kind), (key, r[key])
    assert {(r["d_k"], r["scaled"]) for r in records} == {(4, True), (4, False), (64, True), (64, False)}
    with open(path_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(records[0]) and len(rows) == 4
    assert float(rows[1]["grad_norm"]) == records[1]["grad_norm"]


def test_cli_json_to_stdout_is_pure_json(capsys):
    assert main(["vanishing", "--d-k", "4", "--n-keys", "8", "--trials", "5", "--json", "-"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 2


@pytest.mark.parametrize("argv, option", [(["--d-k", "abc"], "--d-k"), (["--trials", "0"], "--trials"),
                                          (["--n-keys", "8,0"], "--n-keys"), (["--lr", "x"], "--lr")])
def test_cli_bad_arguments_exit_2_with_one_line(argv, option, capsys):
    assert main(["vanishing", *argv]) == 2
    err = capsys.readouterr().err
    assert option in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


SMALL = ["vanishing", "--d-k", "4", "--n-keys", "8", "--trials", "2"]


@pytest.mark.parametrize("argv", [["--lr", "inf"], ["--lr", "0.1,nan"], ["--lr", "-1"], ["--lr", "0"]])
def test_cli_training_refuses_a_learning_rate_that_is_not_finite_and_positive(argv, capsys):
    assert "--lr" in usage_error(["vanishing", "--train", *argv], capsys)


@needs_matplotlib
def test_cli_plot_of_an_unknown_format_is_refused_before_the_work(tmp_path, capsys):
    err = usage_error([*SMALL, "--plot", str(tmp_path / "x.xyz")], capsys)
    assert "--plot" in err and "'xyz'" in err
    assert not (tmp_path / "x.xyz").exists()


@pytest.mark.parametrize("option, name", [("--json", "no-such-dir/x.json"), ("--csv", "no-such-dir/x.csv"),
                                          ("--plot", "no-such-dir/x.png"), ("--json", ".")])
def test_cli_unwritable_output_is_one_line_exit_2(option, name, tmp_path, capsys):
    err = usage_error([*SMALL, option, str(tmp_path / name)], capsys)
    assert option in err and "cannot write" in err


@pytest.mark.parametrize("argv, option", [
    (["--train", "--json", "x.json"], "--json belongs to the sweep"),
    (["--train", "--d-k", "4"], "--d-k belongs to the sweep"),
    (["--train", "--trials", "3"], "--trials belongs to the sweep"),
    (["--lr", "0.1"], "--lr needs --train"), (["--steps", "3"], "--steps needs --train"),
    (["--optimizer", "adam"], "--optimizer needs --train")])
def test_cli_an_option_of_the_other_mode_is_refused(argv, option, capsys):
    assert option in usage_error(["vanishing", *argv], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--d-k", "99999999999999999999999"], "at most 2147483647"),
    (["--alpha-d-k", "99999999999999999999"], "in [1, 2147483647]"),
    (["--trials", "99999999999999999999"], "in [1, 2147483647]")])
def test_cli_sizes_beyond_an_array_axis_are_refused(argv, message, capsys):
    assert message in usage_error(["vanishing", *argv], capsys)


def test_cli_sizes_too_large_for_memory_are_one_line_exit_2(monkeypatch, capsys):
    from numpy_attention.experiments import measurements as vanishing

    def huge(*args, **kwargs):
        raise MemoryError("Unable to allocate 59.6 GiB for an array with shape (1, 8, 1000000000)")
    monkeypatch.setattr(vanishing, "sweep", huge)            # as numpy does for --d-k 1000000000
    assert "not enough memory for these sizes: Unable to allocate 59.6 GiB" in usage_error([*SMALL], capsys)

    def bare(*args, **kwargs):
        raise MemoryError()
    monkeypatch.setattr(vanishing, "sweep", bare)
    assert usage_error([*SMALL], capsys).endswith("not enough memory for these sizes: MemoryError\n")


@pytest.mark.parametrize("argv, message", [
    (["--json", "-", "--csv", "-"], "--json and --csv name the same output (stdout)"),
    (["--json", "o.json", "--csv", "./o.json"], "--json and --csv name the same output"),
    (["--json", ""], "--json: cannot write '': empty path"),
    (["--plot", "-"], "--plot: a figure needs a file path")])
def test_cli_outputs_that_collide_or_are_empty_are_refused(argv, message, capsys):
    assert message in usage_error([*SMALL, *argv], capsys)


@needs_matplotlib
def test_cli_writes_exactly_the_paths_it_names(tmp_path, capsys):
    figure, case = tmp_path / "figure", tmp_path / "case"
    assert main([*SMALL, "--plot", str(figure)]) == 0
    assert main(["crosscheck", "--write-example", str(case)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and case.read_bytes()[:2] == b"PK"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["case", "figure"]
    assert f"wrote {figure}" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_training_with_a_diverging_learning_rate_warns_nothing(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # any RuntimeWarning fails the run
        assert main(["vanishing", "--train", "--steps", "3", "--lr", "1e300"]) == 0
    assert "Warning" not in capsys.readouterr().err          # (progress lines may appear after 1 s)


@needs_matplotlib
def test_plot_leaves_the_callers_matplotlib_backend_alone(tmp_path, monkeypatch):
    import matplotlib
    monkeypatch.setitem(matplotlib.rcParams, "backend", "pdf")      # e.g. a notebook's choice
    path = tmp_path / "v.png"
    assert main([*SMALL, "--plot", str(path)]) == 0
    assert matplotlib.rcParams["backend"] == "pdf"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mode", [[], ["--train", "--steps", "2"]])
def test_cli_plot_without_matplotlib_is_one_line_exit_2_before_the_work(mode, tmp_path, monkeypatch, capsys):
    """Where matplotlib is missing (simulated here: its import fails), --plot names the extra."""
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)    # import raises
    argv = [*SMALL, "--plot", str(tmp_path / "v.png")] if not mode else ["vanishing", *mode, "--plot",
                                                                         str(tmp_path / "v.png")]
    err = usage_error(argv, capsys)
    assert err.startswith("numpy-attention vanishing: --plot: plotting needs matplotlib")
    assert "pip install 'numpy-attention[plot]'" in err and not (tmp_path / "v.png").exists()


@needs_matplotlib
def test_cli_plot_writes_a_png(tmp_path):
    path = tmp_path / "v.png"
    assert main(["vanishing", "--d-k", "4,64", "--n-keys", "8", "--trials", "5", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_training_unscaled_stalls_where_scaled_learns():
    # same initialization, data and learning rate (SGD, lr 1): the unscaled model saturates
    # onto wrong keys and its gradient vanishes; the scaled one learns the retrieval
    scaled = train(scaled=True, lr=1.0, steps=40, eval_every=20)
    unscaled = train(scaled=False, lr=1.0, steps=40, eval_every=20)
    assert scaled.accuracy[-1] > 0.9 and scaled.loss[-1] < 0.2 * scaled.loss[0]
    assert unscaled.accuracy[-1] < 0.3 and unscaled.vanished > 0.3


@pytest.mark.slow
@needs_matplotlib
def test_cli_training_prints_curves_and_plots(tmp_path, capsys):
    path = tmp_path / "t.png"
    assert main(["vanishing", "--train", "--steps", "4", "--lr", "0.1", "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "unscaled" in out and "held-out loss" in out
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_library_sweeps_refuse_a_negative_seed():
    from numpy_attention.experiments.measurements import scale_sweep, sweep
    with pytest.raises(ValueError, match="seed"):
        sweep(d_ks=(4,), n_keys=(8,), trials=2, seed=-1)
    with pytest.raises(ValueError, match="seed"):
        scale_sweep(d_k=4, n_keys=(8,), trials=2, seed=-1)


@pytest.mark.slow
def test_cli_sweep_tables_fit_in_100_columns(capsys):
    """Var S's theory and log N_k are said above the table, not in columns of their own."""
    assert main(["vanishing", "--d-k", "1,4096", "--n-keys", "8,128", "--trials", "20"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100, out
    assert "theory: Var S = d_k unscaled, 1 scaled; entropy <= log N_k: 2.08 (8 keys), 4.85 (128 keys)" in out


def test_cli_training_tables_fit_in_100_columns(monkeypatch, capsys):
    """300 steps evaluated every 25: 13 losses per curve, of which step 0, 25, then every other
    one to 300 are shown (8 columns); the figure of --plot draws them all."""
    from numpy_attention.commands import vanishing as command
    from numpy_attention.experiments import Curve
    steps = np.arange(0, 301, 25)
    curves = [Curve(scaled, lr, steps, np.geomspace(6.51, 4.98e-06, 13), np.linspace(0.1, 1, 13), 0.34)
              for scaled in (True, False) for lr in (0.001, 0.01, 0.1, 1.0)]
    monkeypatch.setattr(command.training, "compare", lambda *args, **kwargs: curves)
    assert main(["vanishing", "--train"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100, lines
    header = next(line for line in lines if line.startswith("scale") and "300" in line)
    assert header.split() == ["scale", "lr", "0", "25", "50", "100", "150", "200", "250", "300"]
    row = next(line for line in lines if line.startswith("unscaled") and " 0.01 " in line)
    assert row.split()[2:] == [f"{curves[5].loss[i]:.3g}" for i in (0, 1, 2, 4, 6, 8, 10, 12)]


@pytest.mark.slow
def test_training_reports_progress_after_every_step():
    calls = []
    compare(lrs=(0.1,), steps=3, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(done, 6) for done in range(1, 7)]


def test_cli_progress_waits_a_second_then_says_at_most_one_line_every_few_seconds(monkeypatch, capsys):
    """A short run prints no progress; a long one a line after a second, then one per 5 s."""
    from numpy_attention.commands import vanishing as command
    clock = iter([0.0, 0.5, 1.5, 3.0, 6.6, 7.0, 11.7])
    monkeypatch.setattr(command, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    progress = command._progress("training", " steps")
    for done in range(1, 7):
        progress(done, 6)
    assert capsys.readouterr().err.splitlines() == ["training: 2/6 steps, 2 s", "training: 4/6 steps, 7 s",
                                                    "training: 6/6 steps, 12 s"]
