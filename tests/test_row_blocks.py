"""The blocked engine's blocks of rows (engines/blocked.py, BLOCK_BYTES): any block size gives
the same numbers as one block, for every option; the blocks cover every row exactly once."""
import numpy as np
import pytest
from compare import assert_normwise_equal

import numpy_attention as na
from numpy_attention.engines import blocked

RTOL = 1e-13          # float64, normwise; only the order of dk's, dv's and dbias's sums differs

# block sizes in bytes: one row of scores per block, a few rows, a few heads, all at once
SIZES = {"one row": 1, "three rows": 3 * 13 * 8, "heads": 2 * 9 * 13 * 8, "one block": 1 << 40}

RNG = np.random.default_rng(3)
MASK = RNG.random((2, 1, 9, 13)) < 0.6
MASK[1, 0, 4] = False                                            # a fully masked row
BIAS = RNG.standard_normal((3, 1, 13))                           # broadcast over B and N_q
DROP = RNG.random((2, 3, 9, 13)) < 0.8

OPTIONS = {
    "plain": {},
    "mask with a dead row": {"mask": MASK},
    "bias broadcast": {"bias": BIAS},
    "bias with -inf": {"bias": np.where(MASK, 0.0, -np.inf)},
    "causal top_left": {"causal": True},
    "causal bottom_right": {"causal": "bottom_right"},
    "window": {"window": (2, 1), "align": "bottom_right"},
    "softcap": {"softcap": 2.0, "scale": 1.0},
    "dropout": {"dropout_mask": DROP, "dropout_p": 0.2},
    "uniform policy": {"mask": MASK, "fully_masked": "uniform"},
    "nan policy": {"mask": MASK, "fully_masked": "nan"},
}


def run(q, k, v, dout, method, options):
    out, cache = na.attention_forward(q, k, v, **options)
    grads = na.attention_backward(dout, cache, method=method, return_stages=True)
    return {"out": out, "lse": cache.lse, "top": cache.top, "P": cache.weights, "S": cache.scores, "dq": grads.dq,
            "dk": grads.dk, "dv": grads.dv, "dbias": grads.dbias, "dP": grads.stages.dP,
            "dS": grads.stages.dS, "D": grads.stages.D}


def inputs(heads_kv=3, dtype=np.float64):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 9, 4)).astype(dtype)
    k, v = (rng.standard_normal((2, heads_kv, 13, d)).astype(dtype) for d in (4, 5))
    return q, k, v, rng.standard_normal((2, 3, 9, 5)).astype(dtype)


@pytest.mark.parametrize("size", [s for s in SIZES if s != "one block"])
@pytest.mark.parametrize("method", ["vjp", "jacobian", "flash"])
@pytest.mark.parametrize("option", OPTIONS)
def test_any_block_size_gives_the_numbers_of_one_block(monkeypatch, option, method, size):
    q, k, v, dout = inputs()
    whole = run(q, k, v, dout, method, OPTIONS[option])
    monkeypatch.setattr(blocked, "BLOCK_BYTES", SIZES[size])
    assert_normwise_equal(whole, run(q, k, v, dout, method, OPTIONS[option]), RTOL)


@pytest.mark.parametrize("size", [s for s in SIZES if s != "one block"])
@pytest.mark.parametrize("case", ["grouped-query", "complex", "single head [N, d]"])
def test_blocks_of_grouped_complex_and_single_head_inputs(monkeypatch, case, size):
    if case == "grouped-query":                                  # G = 3 query heads per kv head
        q, k, v, dout = inputs(heads_kv=1)
    elif case == "complex":                                      # complex-step inputs
        q, k, v, dout = inputs()
        q = q + 1e-20j * np.random.default_rng(1).standard_normal(q.shape)
    else:
        q, k, v, dout = (x[0, 0] for x in inputs())
    options = {"mask": MASK[0, 0]} if case == "single head [N, d]" else {"causal": True}
    whole = run(q, k, v, dout, "vjp", options)
    monkeypatch.setattr(blocked, "BLOCK_BYTES", SIZES[size])
    assert_normwise_equal(whole, run(q, k, v, dout, "vjp", options), RTOL)


@pytest.mark.parametrize("lead, group", [((1, 1), 1), ((2, 3, 1), 1), ((2, 2, 4), 2), ((2, 2, 4), 4),
                                         ((3, 1, 2, 2), 1), ((0, 2, 1), 1), ((1, 6), 3), ((1, 6), 2)])
@pytest.mark.parametrize("n_q, n_k", [(1, 1), (7, 5), (64, 3), (0, 4), (5, 0)])
@pytest.mark.parametrize("budget", [1, 40, 300, 5000, 1 << 40])
def test_row_blocks_cover_every_row_once(monkeypatch, lead, group, n_q, n_k, budget):
    monkeypatch.setattr(blocked, "BLOCK_BYTES", budget)
    count = np.zeros(lead + (n_q,), int)
    for block in blocked.row_blocks(lead + (n_q, n_k), group, 8):
        assert all(isinstance(s, slice) for s in block) and len(block) == len(lead) + 1
        heads = range(lead[-1])[block[-2]]
        assert len(heads) == 1 or (heads.start % group == 0 and len(heads) % group == 0), heads
        count[block] += 1
        assert count[block].size * n_k * 8 <= max(budget, n_k * 8)   # within budget, or one row
    np.testing.assert_array_equal(count, 1)


def test_the_default_blocks_split_a_long_sequence_by_heads_and_rows():
    blocks = blocked.row_blocks((1, 8, 2048, 2048), 1, 8)
    rows = blocked.BLOCK_BYTES // (2048 * 8)
    assert len(blocks) == 8 * 2048 // rows                      # one head at a time, in slices of rows
    assert blocks[0] == (slice(0, 1), slice(0, 1), slice(0, rows))
    assert blocked.row_blocks((2, 8, 10, 10), 1, 8) == [(slice(None), slice(0, 8), slice(0, 10))]
    # 512 rows fit, two heads of 256: two heads a block, unless that would split a group of 4
    for group, heads in ((1, 2), (2, 2), (4, 1)):
        assert {b[-2].stop - b[-2].start for b in blocked.row_blocks((1, 8, 256, 2048), group, 8)} == {heads}


def test_a_problem_under_shares_blocks_is_cut_into_shares_blocks_of_at_least_the_minimum():
    """Scores under SHARES blocks of BLOCK_BYTES come in SHARES blocks (for the threads to share),
    but none smaller than MIN_BLOCK_BYTES; the blocks depend on the shape alone."""
    assert (blocked.SHARES, blocked.MIN_BLOCK_BYTES, blocked.BLOCK_BYTES) == (4, 2 << 20, 8 << 20)
    assert blocked.row_blocks((4, 8, 256, 256), 1, 4) == [(slice(b, b + 1), slice(0, 8), slice(0, 256))
                                                          for b in range(4)]        # 8 MiB: 4 of 2 MiB
    assert len(blocked.row_blocks((4, 8, 256, 256), 1, 8)) == 4                    # 16 MiB: 4 of 4 MiB
    assert len(blocked.row_blocks((2, 8, 256, 256), 1, 4)) == 2                    # 4 MiB: 2 of 2 MiB
    assert len(blocked.row_blocks((2, 8, 128, 256), 1, 4)) == 1                    # 2 MiB: whole
    assert len(blocked.row_blocks((1, 8, 1024, 1024), 1, 8)) == 8                  # 64 MiB: 8 MiB blocks


def test_diagonal_scores_come_in_blocks_of_a_quarter_of_the_rows_at_most():
    """Causal masking, a window or packed sequences: blocks of at most N_q / SHARES rows (so each
    skips more columns), not below MIN_BLOCK_BYTES; other scores as before."""
    rows = lambda blocks: {b[-1].stop - b[-1].start for b in blocks}
    whole_heads = blocked.row_blocks((1, 8, 1024, 1024), 1, 8)
    quarters = blocked.row_blocks((1, 8, 1024, 1024), 1, 8, diagonal=True)
    assert rows(whole_heads) == {1024} and rows(quarters) == {256} and len(quarters) == 32
    assert rows(blocked.row_blocks((1, 8, 1024, 1024), 1, 4, diagonal=True)) == {512}   # 2 MiB at least
    assert rows(blocked.row_blocks((1, 8, 4096, 4096), 1, 8, diagonal=True)) == {256}   # 8 MiB at most
    assert len(blocked.row_blocks((1, 8, 512, 512), 1, 8, diagonal=True)) == 8          # 2 MiB: a head
    assert blocked.row_blocks((2, 8, 10, 10), 1, 8, diagonal=True) == [(slice(None), slice(0, 8), slice(0, 10))]


def test_skipped_columns_weigh_exactly_zero_whatever_memory_held_before(monkeypatch):
    """Columns a block skips are never written: they are P's own zeros, not what the memory
    held (here NaN, freed just before)."""
    monkeypatch.setattr(blocked, "BLOCK_BYTES", 4 * 64 * 8)              # blocks of 4 rows
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 64, 8)) for _ in range(3))
    for _ in range(3):
        junk = np.full((2, 3, 64, 64), np.nan)
        del junk
        weights = na.attention_forward(q, k, v, causal=True)[1].weights
        below = np.tril(np.ones((64, 64), bool))
        assert np.all(weights[..., ~below] == 0) and np.all(weights[..., below] > 0)


@pytest.mark.parametrize("options, diagonal", [
    ({"causal": True}, True), ({"window": (4, 0)}, True), ({"mask": MASK}, False), ({}, False),
    ({"causal": True, "sinks": np.zeros(3)}, False), ({"causal": True, "softcap": 2.0}, False),
    ({"causal": True, "fully_masked": "uniform"}, False)])
def test_which_options_move_the_kept_columns_with_the_rows(options, diagonal):
    q, k, v, _ = inputs()
    assert blocked._diagonal(na.attention_options(q, k, v, **options)[3]) is diagonal


def test_packed_sequences_move_the_kept_columns_with_the_rows():
    q, k, v = (np.zeros((2, n, 4)) for n in (9, 13, 13))
    cu_q, cu_k = np.array([0, 4, 9]), np.array([0, 6, 13])
    options = na.attention_options(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)[3]
    assert blocked._diagonal(options) is True


@pytest.mark.parametrize("rows", [slice(None), slice(0, 5), slice(None, None, 2)])
def test_grouped_matmul_writes_into_out_or_copies_into_it(rows):
    """The blocked forward computes each block's scores straight into the weights P
    (grouped_matmul's out=): the same bits as a fresh product, whether out folds into a view
    (all rows, or one kv head) or needs the copy (a strided slice of rows under grouped-query)."""
    from numpy_attention._layout import grouped_matmul
    x, y = RNG.standard_normal((2, 4, 9, 3)), RNG.standard_normal((2, 2, 3, 7))   # H = 4, H_kv = 2
    expected = grouped_matmul(x[..., rows, :], y)
    whole = np.full((2, 4, 9, 7), np.nan)
    out = whole[..., rows, :]
    assert grouped_matmul(x[..., rows, :], y, out=out) is out
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(whole[..., rows, :], expected)                 # written in place
    assert np.isnan(np.delete(whole, np.arange(9)[rows], axis=-2)).all()        # and nowhere else


def test_kept_columns_span_every_kept_score_of_a_block():
    """A block's scores are computed only on the columns that hold its kept scores; outside
    them every score of the block is masked (weights 0, gradients 0). The options whose
    cached stages or policies cover removed scores keep every column."""
    from numpy_attention.engines.blocked import _kept_columns
    from numpy_attention.options import attention_options
    q, k = np.zeros((1, 2, 8, 4)), np.zeros((1, 2, 10, 4))

    def cols(rows, **options):
        o = attention_options(q, k, k, **options)[-1]
        columns, keep = _kept_columns(o, (1, 2, 8, 10), (slice(0, 1), slice(0, 2), rows))
        assert keep is None or keep.shape[-1] == columns.stop - columns.start   # the mask on them
        return columns
    assert cols(slice(0, 3), causal=True) == slice(0, 3)                    # top_left: j <= i
    assert cols(slice(2, 5), causal="bottom_right") == slice(0, 7)          # j <= i + 2
    assert cols(slice(4, 6), causal=True, window=(1, 0)) == slice(3, 6)     # i - 1 <= j <= i
    assert cols(slice(0, 8)) == slice(0, 10)                                # nothing masked
    mask = np.ones((8, 10), bool)
    mask[:, 7:], mask[2] = False, False
    assert cols(slice(2, 3), mask=mask) == slice(0, 0)                      # a fully masked row
    assert cols(slice(0, 8), mask=mask) == slice(0, 7)
    assert cols(slice(0, 8), mask=mask[:, 6:7]) == slice(0, 10)             # broadcast over columns
    assert cols(slice(2, 3), mask=mask[:, 6:7]) == slice(0, 0)
    for whole_rows in ({"sinks": np.zeros(2)}, {"softcap": 5.0}, {"fully_masked": "uniform"}):
        assert cols(slice(0, 3), causal=True, **whole_rows) == slice(0, 10)
