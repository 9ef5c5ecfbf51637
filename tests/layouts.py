"""Random float64 inputs in the three batch layouts attention takes, drawn from
numpy.random.default_rng(seed) in the order returned, for the test files that share them:

    grouped_inputs   a dense batch with grouped-query heads: 2 sequences, 4 query heads on 2 kv heads
    packed_inputs    packed variable-length sequences (LEN_Q, LEN_K, USED; CU_Q, CU_K the cu_seqlens)
    paged_inputs     a paged KV cache of 7 pages of 4 rows (TABLE, LENGTHS; gathered reads a sequence's keys)
"""
import numpy as np

LEN_Q, LEN_K, USED = [3, 0, 4, 2], [5, 2, 3, 6], [4, 1, 3, 6]        # sequence 1 has no query
CU_Q, CU_K = np.concatenate([[0], np.cumsum(LEN_Q)]), np.concatenate([[0], np.cumsum(LEN_K)])
TABLE = np.array([[0, 3, 5], [6, 1, 0], [2, 2, 4]])    # sequence 2 reads page 2 twice
LENGTHS = np.array([9, 4, 12])                         # page size 4: 3, 1 and 3 pages in use


def _draw(seed, shapes):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape) for shape in shapes)


def grouped_inputs(seed=0, n_q=4, n_k=6, d=3, d_v=2):
    """q [2, 4, N_q, d], k [2, 2, N_k, d], v [2, 2, N_k, d_v], dout [2, 4, N_q, d_v], dlse [2, 4, N_q]."""
    return _draw(seed, [(2, 4, n_q, d), (2, 2, n_k, d), (2, 2, n_k, d_v), (2, 4, n_q, d_v), (2, 4, n_q)])


def packed_inputs(seed=0):
    """q [4, total_q, 3], k [2, total_k, 3], v [2, total_k, 2], dout [4, total_q, 2], dlse [4, total_q]."""
    return _draw(seed, [(4, CU_Q[-1], 3), (2, CU_K[-1], 3), (2, CU_K[-1], 2), (4, CU_Q[-1], 2), (4, CU_Q[-1])])


def paged_inputs(seed=0, d_v=5):
    """q [3, 4, 2, 8], k_cache [7, 2, 4, 8], v_cache [7, 2, 4, d_v], dout [3, 4, 2, d_v]: 3 sequences
    decoding 2 queries each, on pages [num_pages, H_kv, page, d]."""
    return _draw(seed, [(3, 4, 2, 8), (7, 2, 4, 8), (7, 2, 4, d_v), (3, 4, 2, d_v)])


def gathered(x, b):
    """Sequence b's keys from its pages: [H_kv, L_b, d]."""
    return np.concatenate([x[page] for page in TABLE[b]], axis=1)[:, :LENGTHS[b]]
