"""Use the float64 oracle to check other attention implementations.

    schema.py     the .npz exchange format: its keys, Case, CaseError, the options' decoding
    case.py       reading a case: split_case, load_case, save_case, write_example_case
    transforms.py a case's inputs as the kernel used them: float8's descales, MLA's kv, top-k, a paged cache
    storage.py    how a case stores its arrays (ml_dtypes, raw bits, floats) and its precision
    precision.py  the precisions, and the baseline each one is held to
    recipe.py     the recipe: what a kernel at float16, bfloat16, float8 does, step by step
    rule.py       the tolerance rule: err(candidate) <= k * err(baseline) + atol
    naive.py      the naive baseline: head-width sums left to right, FlashAttention's backward
    rotary.py     rotary embeddings in a case: q and k turned as the candidate's precision turns them
    row_blocks.py a large case in blocks of query rows: O(N) memory for oracle and baselines
    npz.py        reading a case file from a stranger: checked before any data is read
    diagnosis.py  which convention mix-up a failing candidate matches instead
    mixups.py     the mix-ups diagnosis.py tries: which apply to a case, the oracle rerun under one
    tangents.py   forward mode: a candidate's out_dot, lse_dot along q_dot, k_dot, v_dot
    runs.py       the oracle, the baselines and the term magnitudes of a case: whole, in slices, on threads
    verdicts.py   crosscheck(**arrays): oracle + baseline + rule -> CrosscheckReport
    split_keys.py crosscheck_merged: calls on parts of the keys, merged by lse, against all the keys
    errormap.py   error_maps, plot_error_maps: each entry's |err| / bound by head and row, a PNG
    importers.py  torch modules (the seed's class, nn.MultiheadAttention) -> our modules
    (the command `numpy-attention crosscheck CASE.npz [--json]` is numpy_attention/commands/crosscheck.py)
"""
from .case import load_case, save_case, split_case, write_example_case
from .verdicts import crosscheck
from .split_keys import crosscheck_merged
from .importers import TorchMultiheadAttention, from_torch
from .rule import CrosscheckReport, TensorVerdict, judge
from .runs import baseline, baselines, reference
from .schema import CaseError

__all__ = ["crosscheck", "crosscheck_merged", "reference", "baseline", "baselines", "from_torch",
           "TorchMultiheadAttention", "judge",
           "CrosscheckReport", "TensorVerdict", "CaseError", "load_case", "save_case", "split_case",
           "write_example_case"]
