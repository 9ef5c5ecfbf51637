"""magnitudes.term_sums (row sums and matrix-vector products) against the terms written out one
by one, as magnitudes.py defines them: each entry's sum of |terms|, to rounding."""
import numpy as np
import pytest

from numpy_attention.oracle.magnitudes import EXPONENT_ULPS, term_sums
from numpy_attention.oracle.rule import ATOL_ULPS

B, H, H_KV, N_Q, N_K, D = 2, 4, 2, 7, 9, 5
WHOLE = (Ellipsis, slice(None), slice(None))


def stages_of(rng, dropout=False, nan_row=False):
    """Random float64 stages [B, H, N_q, N_k] of a masked case: S (-inf where masked), P, P~,
    dP, D and lse, with a fully masked row of uniform weights; nan_row: one row of NaN weights
    and D (the 'nan' policy's fully masked row)."""
    s = rng.standard_normal((B, H, N_Q, N_K)) * 30
    s[rng.random(s.shape) < 0.3] = -np.inf
    lse = rng.standard_normal((B, H, N_Q)) * 20
    p = np.where(np.isneginf(s), 0, rng.random(s.shape)) / N_K
    s[0, 1, 2], lse[0, 1, 2], p[0, 1, 2] = -np.inf, -np.inf, 1 / N_K   # the 'uniform' policy's masked row
    d_out = rng.standard_normal((B, H, N_Q))
    if nan_row:
        p[1, 2, 3], d_out[1, 2, 3] = np.nan, np.nan
    p_drop = p * (rng.random(s.shape) < 0.8) / 0.8 if dropout else p
    return {"S": s, "P": p, "P~": p_drop, "lse": lse, "dP": rng.standard_normal(s.shape), "D": d_out}


def direct_sums(stages, inputs, options):
    """The sums of magnitudes.py's terms, each term formed: its definition, in float64."""
    c = EXPONENT_ULPS / ATOL_ULPS
    s, lse = stages["S"], stages["lse"]
    w = 1 + c * (np.where(np.isfinite(s), np.abs(s), 0) + np.where(np.isfinite(lse), np.abs(lse), 0)[..., None])
    p, p_drop = (np.nan_to_num(stages[name]) for name in ("P", "P~"))
    v_len = np.repeat(np.linalg.norm(inputs["v"], axis=-1), H // H_KV, axis=-2)[..., None, :]   # [B, H, 1, N_k]
    dout_len = np.linalg.norm(inputs["dout"], axis=-1)[..., None]
    dots = dout_len * (v_len + np.sum(p_drop * v_len, -1, keepdims=True))
    terms = np.nan_to_num(stages["P"] * ((np.abs(stages["dP"]) + np.abs(stages["D"])[..., None]) * w + dots))
    kv_cols = lambda x: x.sum(-2).reshape(B, H_KV, -1, N_K).sum(-2).max()
    sums = {"out": np.sum(p_drop * w, -1).max(), "lse": np.abs(s[np.isfinite(s)]).max(),
            "dq": terms.sum(-1).max(), "dv": kv_cols(p_drop * w), "dk": kv_cols(terms)}
    if "bias" in options:
        sums["dbias"] = terms.sum(0).max() if np.ndim(options["bias"]) == 3 else terms.max()
    if "sinks" in options:
        sums["dsinks"] = np.sum(np.clip(1 - p.sum(-1), 0, None) * np.abs(stages["D"]), -1).sum(0).max()
    if "alibi_slopes" in options:
        sums["dalibi_slopes"] = ((N_Q + N_K) * terms.sum((-2, -1))).sum(0).max()
    return sums


@pytest.mark.parametrize("dropout, nan_row, options", [
    (False, False, {}), (True, False, {}), (False, True, {}),
    (False, False, {"bias": np.zeros((H, N_Q, N_K)), "sinks": np.zeros(H), "alibi_slopes": np.ones(H)}),
    (True, False, {"bias": np.zeros((B, H, N_Q, N_K))})])
def test_term_sums_are_the_sums_of_the_terms_formed_one_by_one(dropout, nan_row, options):
    rng = np.random.default_rng([dropout, nan_row, len(options)])
    stages = stages_of(rng, dropout, nan_row)
    inputs = {"q": rng.standard_normal((B, H, N_Q, D)), "k": rng.standard_normal((B, H_KV, N_K, D)),
              "v": rng.standard_normal((B, H_KV, N_K, D)), "dout": rng.standard_normal((B, H, N_Q, D))}
    expected = direct_sums(stages, inputs, options)
    whole = term_sums([(WHOLE, stages)], inputs, options)
    rows = [slice(0, 3), slice(3, N_Q)]                         # two blocks of query rows
    in_blocks = term_sums([((Ellipsis, r, slice(None)), {name: x[..., r] if x.ndim == 3 else x[..., r, :]
                                                          for name, x in stages.items()}) for r in rows],
                          inputs, options)
    for sums in (whole, in_blocks):
        assert sorted(sums) == sorted(expected)
        for name, value in expected.items():
            assert sums[name] == pytest.approx(value, rel=1e-12), name


@pytest.mark.parametrize("options", [{"causal": np.array(True)}, {"bias": "bias", "sinks": "sinks"},
                                     {"alibi_slopes": "alibi_slopes", "window": np.array([5, 3])}])
def test_a_large_case_s_magnitudes_in_blocks_and_slices_are_its_whole_ones(monkeypatch, options):
    """A case over blocks.SCORE_BUDGET: its stages recomputed block by block, on 2 threads in
    (batch index, kv head) slices (runs.case_magnitudes), sum to the magnitudes of its stages whole."""
    from numpy_attention.oracle import row_blocks as blocks, runs
    from numpy_attention.oracle.case import split_case
    rng = np.random.default_rng(len(options))
    n_q = 70                                           # over 2 blocks of 32 rows
    draws = {"bias": lambda: rng.standard_normal((H, n_q, N_K)) * 3, "sinks": lambda: rng.standard_normal(H),
             "alibi_slopes": lambda: 2.0 ** -np.arange(1, H + 1)}
    arrays = {"q": rng.standard_normal((B, H, n_q, D)), "k": rng.standard_normal((B, H_KV, N_K, D)) * 2,
              "v": rng.standard_normal((B, H_KV, N_K, D)), "dout": rng.standard_normal((B, H, n_q, D)),
              **{name: draws[x]() if isinstance(x, str) else x for name, x in options.items()}}
    arrays = {name: x.astype(np.float32) if x.dtype == np.float64 else x for name, x in arrays.items()}
    arrays.update(out=np.zeros((B, H, n_q, D), np.float32), dq=np.zeros((B, H, n_q, D), np.float32),
                  dk=np.zeros((B, H_KV, N_K, D), np.float32), dv=np.zeros((B, H_KV, N_K, D), np.float32))
    case = split_case(arrays, precision="float32")
    truth = runs.reference(case.inputs, case.options, np.dtype(np.float64), True)
    whole = runs.case_magnitudes(case, truth, True, None, None, 1)
    monkeypatch.setattr(blocks, "SCORE_BUDGET", 64)
    monkeypatch.setattr(runs, "PARALLEL_SCORES", 1)
    block_rows = runs.case_block_rows(case)
    assert block_rows == 32
    tiled = runs.reference(case.inputs, case.options, np.dtype(np.float64), True, stages=False)
    for workers in (1, 2):
        large = runs.case_magnitudes(case, tiled, False, block_rows, None, workers)
        assert sorted(large) == sorted(whole)
        for name, value in whole.items():
            assert large[name] == pytest.approx(value, rel=1e-12), name
