"""Use the float64 oracle to check other attention implementations.

    case.py       the .npz exchange format: split_case, load_case, save_case, write_example_case
    storage.py    how a case stores its arrays (ml_dtypes, raw bits, floats) and its precision
    precision.py  the precisions and their recipes: what a kernel at float16, bfloat16, float8 does
    rule.py       the tolerance rule: err(candidate) <= k * err(baseline) + atol
    naive.py      the naive baseline: head-width sums left to right, FlashAttention's backward
    rotary.py     rotary embeddings in a case: q and k turned as the candidate's precision turns them
    blocks.py     a large case in blocks of query rows: O(N) memory for oracle and baselines
    npz.py        reading a case file from a stranger: checked before any data is read
    diagnosis.py  which convention mix-up a failing candidate matches instead
    tangents.py   forward mode: a candidate's out_dot, lse_dot along q_dot, k_dot, v_dot
    runs.py       the oracle, the baselines and the term magnitudes of a case: whole, in slices, on threads
    check.py      crosscheck(**arrays): oracle + baseline + rule -> CrosscheckReport
    errormap.py   error_maps, plot_error_maps: each entry's |err| / bound by head and row, a PNG
    importers.py  torch modules (the seed's class, nn.MultiheadAttention) -> our modules
    (the command `numpy-attention crosscheck CASE.npz [--json]` is numpy_attention/commands/crosscheck.py)
"""
from .case import CaseError, load_case, save_case, split_case, write_example_case
from .check import crosscheck
from .importers import TorchMultiheadAttention, from_torch
from .rule import CrosscheckReport, TensorVerdict, judge
from .runs import baseline, baselines, reference

__all__ = ["crosscheck", "reference", "baseline", "baselines", "from_torch", "TorchMultiheadAttention", "judge", "CrosscheckReport", "TensorVerdict",
           "CaseError", "load_case", "save_case", "split_case", "write_example_case"]
