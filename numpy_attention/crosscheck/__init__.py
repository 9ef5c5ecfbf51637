"""Use the float64 oracle to check other attention implementations.

    case.py       the .npz exchange format: split_case, load_case, save_case, write_example_case
    rule.py       the tolerance rule: err(candidate) <= k * err(baseline) + atol
    naive.py      the naive baseline: every sum left to right, FlashAttention's backward
    check.py      crosscheck(**arrays): oracle + baseline + rule -> CrosscheckReport
    importers.py  torch modules (the seed's class, nn.MultiheadAttention) -> our modules
    (the command `numpy-attention crosscheck CASE.npz [--json]` is numpy_attention/commands/crosscheck.py)
"""
from .case import CaseError, load_case, save_case, split_case, write_example_case
from .check import baseline, baselines, crosscheck, reference
from .importers import TorchMultiheadAttention, from_torch
from .rule import CrosscheckReport, TensorVerdict, judge

__all__ = ["crosscheck", "reference", "baseline", "baselines", "from_torch", "TorchMultiheadAttention", "judge", "CrosscheckReport", "TensorVerdict",
           "CaseError", "load_case", "save_case", "split_case", "write_example_case"]
