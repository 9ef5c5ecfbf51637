"""Error maps (oracle/errormap.py): each entry's |err| / bound, folded to [H, rows], and its PNG.

Planted bugs give their pattern: a causal mask off by one every query row but the last,
one head's dk negated that head alone, one wrong row of out that row alone; honest
candidates stay <= 1; in bfloat16 the map crosses 1 exactly where the row-wise check fails.
"""
import sys

import numpy as np
import pytest
from optional import needs_matplotlib
from test_cli import usage_error

import numpy_attention as na
from numpy_attention.commands.cli import main
from numpy_attention.oracle import baseline, crosscheck, save_case, split_case, write_example_case
from numpy_attention.oracle.errormap import (crosscheck_errors, draw_error_maps, error_maps,
                                                 plot_error_maps)

B, H, N, D = 2, 3, 32, 8
PNG = b"\x89PNG\r\n\x1a\n"


def float32_case(seed=0, mask=None):
    """A float32 case of our own attention under `mask` (None: causal), the case saying
    causal=True: {q, k, v, dout, causal, out, lse, dq, dk, dv}, each [B, H, N, D] ([B, H, N])."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal((B, H, N, D)).astype(np.float32) for _ in range(4))
    out, cache = na.attention_forward(q, k, v, causal=mask is None, mask=mask)
    g = na.attention_backward(dout, cache)
    return dict(q=q, k=k, v=v, dout=dout, causal=True, out=out, lse=cache.lse, dq=g.dq, dk=g.dk, dv=g.dv)


def test_maps_have_one_row_per_head_and_row_and_pass_an_honest_candidate():
    maps = error_maps(**float32_case())
    assert {name: m.shape for name, m in maps.items()} == {name: (H, N) for name in
                                                          ("out", "lse", "dq", "dk", "dv")}
    assert all(m.dtype == np.float64 and 0 <= m.min() and m.max() <= 1 for m in maps.values())


def test_the_baseline_itself_is_within_half_its_bound():
    # err(baseline) / (k err(baseline) + atol) <= 1 / k, and k >= 2 for every tensor
    arrays = float32_case()
    case = split_case(arrays)
    results = baseline(case.inputs, case.options, np.float32)
    maps = error_maps(**{**arrays, **{name: results[name].astype(np.float32) for name in case.candidates}})
    assert all(m.max() <= 0.5 for m in maps.values()), {name: m.max() for name, m in maps.items()}


def test_causal_off_by_one_fails_every_query_row_but_the_last():
    # one key of the future kept: row i sees keys 0..i+1, the last row has none more to see
    arrays = float32_case(mask=np.tril(np.ones((N, N), bool), k=1))
    maps = error_maps(**arrays)
    for name in ("out", "lse", "dq"):
        assert np.all(maps[name][:, :-1] > 1) and np.all(maps[name][:, -1] <= 1), name
    assert np.all(maps["dk"] > 1) and np.all(maps["dv"] > 1)        # every key meets a new query


def test_one_head_of_dk_negated_fails_that_head_alone():
    arrays = float32_case()
    arrays["dk"] = arrays["dk"].copy()
    arrays["dk"][:, 1] *= -1
    maps = error_maps(**arrays)
    assert np.all(maps["dk"][1] > 1) and maps["dk"][[0, 2]].max() <= 1
    assert all(maps[name].max() <= 1 for name in ("out", "lse", "dq", "dv"))


def test_one_wrong_row_of_out_fails_that_row_alone():
    arrays = float32_case()
    arrays["out"] = arrays["out"].copy()
    arrays["out"][1, 2, 5, 3] += 1e-3                    # batch 1, head 2, query row 5
    maps = error_maps(**arrays)
    assert np.argwhere(maps["out"] > 1).tolist() == [[2, 5]]


def test_a_nan_is_an_infinite_ratio_where_it_lies():
    arrays = float32_case()
    arrays["lse"] = arrays["lse"].copy()
    arrays["lse"][0, 1, 7] = np.nan
    maps = error_maps(**arrays)
    assert np.argwhere(np.isinf(maps["lse"])).tolist() == [[1, 7]] and np.isfinite(maps["out"]).all()


def test_flashattentions_plus_inf_lse_of_a_fully_masked_row_is_within_the_bound():
    mask = np.tril(np.ones((N, N), bool))
    mask[4] = False                                      # query row 4 sees no key
    arrays = float32_case(mask=mask)
    arrays.pop("causal")
    arrays.update(mask=mask, lse=np.where(mask.any(-1), arrays["lse"], np.float32(np.inf)))
    assert crosscheck(**arrays) and error_maps(**arrays)["lse"].max() <= 1


def test_the_maps_are_the_reports_entries_folded_over_the_batch():
    arrays = float32_case()
    report, ratios = crosscheck_errors(**arrays)
    assert str(report) == str(crosscheck(**arrays))                   # the same verdict
    assert ratios["dq"].shape == (B, H, N, D) and ratios["lse"].shape == (B, H, N)
    assert np.array_equal(error_maps(**arrays)["dq"], ratios["dq"].max(axis=(0, 3)))
    for row in report.rows:                                            # err / bound, worst entry
        assert ratios[row.name].max() == pytest.approx(row.max_abs_err / row.bound, rel=1e-12)


def test_per_head_and_broadcast_tensors_fold_to_their_own_rows(tmp_path):
    # the example case: GQA (4 query heads, 2 kv heads, N_q 6, N_k 9) with a bias [4, 6, 9]
    maps = error_maps(**write_example_case(tmp_path / "case.npz"))
    assert {name: m.shape for name, m in maps.items()} == {
        "out": (4, 6), "lse": (4, 6), "dq": (4, 6), "dk": (2, 9), "dv": (2, 9), "dbias": (4, 6)}


def test_bfloat16_maps_cross_1_exactly_where_the_row_wise_check_fails(torch):
    """An entry of out off by half the tensor's bound passes the max-abs check; on some rows
    (whose baseline rounds finely) it fails the row-wise one. The map must say which."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, 16, dtype=torch.bfloat16) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    arrays = dict(q=q, k=k, v=v, causal=True, out=out)
    honest, _ = crosscheck_errors(**arrays)
    assert honest and error_maps(**arrays)["out"].max() <= 1
    row_failures = 0
    for i in range(N):
        bad = out.clone()
        bad[0, 1, i, 3] += 0.5 * honest.rows[0].bound
        report, ratios = crosscheck_errors(**{**arrays, "out": bad})
        failed = [] if report else [check.split()[0] for check in report.rows[0].failed]
        assert failed in ([], ["row"]), failed                       # never the max-abs check
        flagged = np.argwhere(ratios["out"].max(axis=(0, 3)) > 1).tolist()
        assert flagged == ([[1, i]] if failed else []), (i, failed, flagged)
        row_failures += bool(failed)
    assert 0 < row_failures < N                                      # both outcomes were tried


def test_torch_float32_sdpa_is_within_its_bounds_everywhere(torch):
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, 4, 48, 16, requires_grad=True) for _ in range(3))
    mask = torch.arange(48) < torch.tensor([48, 30])[:, None, None, None]     # padding of batch 1
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    dout = torch.randn_like(out)
    out.backward(dout)
    maps = error_maps(q=q, k=k, v=v, dout=dout, mask=mask, out=out, dq=q.grad, dk=k.grad, dv=v.grad)
    assert sorted(maps) == ["dk", "dq", "dv", "out"]
    assert all(m.max() <= 1 for m in maps.values()), {name: m.max() for name, m in maps.items()}


@pytest.mark.slow
@needs_matplotlib
def test_plot_writes_the_same_png_each_time(tmp_path):
    from matplotlib.image import imread
    arrays = {name: x for name, x in float32_case().items() if name not in ("lse", "dq", "dv")}
    arrays["dk"] = arrays["dk"] * np.array([1, -1, 1], np.float32)[:, None, None]
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    assert plot_error_maps(first, **arrays) == first
    plot_error_maps(second, **arrays)
    assert first.read_bytes()[:8] == PNG and first.read_bytes() == second.read_bytes()
    height, width, channels = imread(first).shape
    assert height > 2 * 100 and width > 600 and channels == 4           # two rows of panels: out, dk


@needs_matplotlib
def test_draw_refuses_a_path_that_is_not_one_and_ratios_of_another_report(tmp_path):
    report, ratios = crosscheck_errors(**float32_case())
    with pytest.raises(ValueError, match="path must be a file path"):
        draw_error_maps(3, report, ratios)
    with pytest.raises(ValueError, match="ratios must hold the report's tensors"):
        draw_error_maps(tmp_path / "x.png", report, {"out": ratios["out"]})


def test_without_matplotlib_plotting_is_one_import_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)                 # its import raises
    with pytest.raises(ImportError, match=r"^matplotlib is needed for --plot \(pip install matplotlib\)$"):
        plot_error_maps(tmp_path / "x.png", **float32_case())


@needs_matplotlib
def test_cli_plot_writes_the_picture_and_keeps_the_verdicts_exit_code(tmp_path, capsys):
    arrays = {name: x for name, x in float32_case().items() if name in ("q", "k", "v", "causal", "out")}
    save_case(tmp_path / "good.npz", **arrays)
    save_case(tmp_path / "bad.npz", **{**arrays, "out": arrays["out"] * np.float32(1.01)})
    for name, code in (("good", 0), ("bad", 1)):
        path = tmp_path / f"{name}.png"
        assert main(["crosscheck", str(tmp_path / f"{name}.npz"), "--plot", str(path)]) == code
        assert path.read_bytes()[:8] == PNG
    assert "-> FAIL" in capsys.readouterr().out


def test_cli_plot_without_matplotlib_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    save_case(tmp_path / "case.npz", **float32_case())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    err = usage_error(["crosscheck", str(tmp_path / "case.npz"), "--plot", str(tmp_path / "x.png")], capsys)
    assert err == "numpy-attention crosscheck: matplotlib is needed for --plot (pip install matplotlib)\n"
    assert not (tmp_path / "x.png").exists()


@needs_matplotlib
def test_cli_plot_to_a_file_it_cannot_write_is_one_line_exit_2(tmp_path, capsys):
    save_case(tmp_path / "case.npz", **float32_case())
    err = usage_error(["crosscheck", str(tmp_path / "case.npz"), "--plot", str(tmp_path / "no" / "x.png")],
                      capsys)
    assert err.startswith("numpy-attention crosscheck: --plot: cannot write") and "No such file" in err


@pytest.mark.slow
@needs_matplotlib
def test_a_small_case_has_whole_index_ticks_and_a_title_in_words(tmp_path, monkeypatch):
    """Three rows, two heads, a tensor of one entry per head (dsinks): every tick an integer
    index inside its panel, none across one column; the title says what the colour is."""
    from matplotlib.figure import Figure
    drawn, save = [], Figure.savefig

    def noting_savefig(fig, *args, **kwargs):
        drawn.append(fig)
        return save(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", noting_savefig)
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for _ in range(4))
    sinks = np.array([0.3, -1.0], np.float32)
    out, cache = na.attention_forward(q, k, v, sinks=sinks)
    g = na.attention_backward(dout, cache)
    plot_error_maps(tmp_path / "small.png", q=q, k=k, v=v, dout=dout, sinks=sinks, out=out, lse=cache.lse,
                    dq=g.dq, dk=g.dk, dv=g.dv, dsinks=g.dsinks)
    (fig,) = drawn
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 6 + 4                                 # six maps, four of them with features
    for ax in panels:
        for ticks, (low, high) in ((ax.get_xticks(), ax.get_xlim()), (ax.get_yticks(), ax.get_ylim())):
            inside = [t for t in ticks if min(low, high) <= t <= max(low, high)]
            assert all(float(t).is_integer() for t in inside), (ax.get_title(), list(ticks))
        columns = ax.images[0].get_array().shape[1]
        assert len([t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]) == \
            (0 if columns == 1 else columns)
    (title,) = [text.get_text() for text in fig.texts]          # the suptitle
    assert ".py" not in title and "over the bound its tensor is held to (above 1 fails)" in title
