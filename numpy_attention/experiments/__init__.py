"""Experiments: the 1/sqrt(d_k) vanishing-gradient study (library code; the CLI calls it).

    measurements.py sweep (d_k x N_k x scaled/unscaled) and scale_sweep (scale = d_k^-alpha)
    training.py    a retrieval task trained by hand, scaled vs unscaled
    tables.py      table, JSON and CSV;   plot.py  figures (matplotlib, lazily)
    (the command `numpy-attention vanishing` is numpy_attention/commands/vanishing.py)
"""
from .training import Curve, Task, compare, train
from .measurements import directional_error, measure, scale_sweep, sweep

__all__ = ["sweep", "scale_sweep", "measure", "directional_error", "train", "compare", "Task", "Curve"]
