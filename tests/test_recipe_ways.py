"""The recipe's ways of computing a 16- or 8-bit case (check._ways): the ways that share a
forward compute it once (check._forwards, precision.recipe_backwards), bitwise what each way
computed on its own gives."""
import importlib

import ml_dtypes
import numpy as np
import pytest

from numpy_attention.oracle import split_case
from numpy_attention.oracle import check
from numpy_attention.oracle.case import FLOAT_OPTIONS
from numpy_attention.oracle.precision import PRECISIONS, recipe_attention, round_to
from numpy_attention.oracle.rotary import turn_qk
from numpy_attention.options import attention_options

precision_module = importlib.import_module("numpy_attention.oracle.precision")
blocks = importlib.import_module("numpy_attention.oracle.blocks")

SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])
CASES = {                                         # q [2, 4, 70, 16] over k, v [2, 2, 90, 16] (GQA)
    "plain": {},
    "causal": {"causal": True},
    "bias per head, scale": {"bias": np.random.default_rng(1).standard_normal((4, 70, 90)), "scale": 0.4},
    "dropout, softcap": {"dropout_mask": np.random.default_rng(2).random((2, 4, 70, 90)) < 0.8,
                         "dropout_p": 0.2, "softcap": 3.0},
    "ALiBi, causal bottom_right": {"alibi_slopes": SLOPES, "causal": "bottom_right"},
    "sinks, window": {"sinks": np.array([0.3, -1.0, 0.0, 2.0]), "window": (20, 5)},
}


def inputs(precision, gqa=True):
    """q, k, v, dout stored in the precision (dout None in float8: forward only)."""
    rng = np.random.default_rng(0)
    storage = PRECISIONS[precision].storage
    h_kv = 2 if gqa else 4
    q, k, v, dout = (rng.standard_normal(shape).astype(storage) for shape in
                     ((2, 4, 70, 16), (2, h_kv, 90, 16), (2, h_kv, 90, 16), (2, 4, 70, 16)))
    if PRECISIONS[precision].forward_only:
        return dict(q=q, k=k, v=v, out=q.astype(ml_dtypes.bfloat16))
    return dict(q=q, k=k, v=v, dout=dout, out=q)


def way_alone(case, way, gradients, block_rows):
    """The baseline of one way (check._ways) by recipe_attention alone: what check computed
    way by way, each way with its own forward."""
    p = case.precision
    rounded = lambda x: None if x is None else round_to(x, p.compute)
    q, k, v, dout = (rounded(case.inputs.get(name)) for name in ("q", "k", "v", "dout"))
    options = {name: x.astype(np.float32) if name in FLOAT_OPTIONS else x for name, x in case.options.items()}
    rope = options.pop("rope", None)
    q, k, v, record = attention_options(q, k, v, **options)
    back = None
    if rope is not None:
        q, k, back = turn_qk(q, k, rope, record, p.compute)
    backward, reorder, reads, mlx, scores = check._ways(case, gradients)[way][1]
    saved = rounded(case.candidates["out"]) if reads else None
    gradients = gradients and backward is not None
    result = recipe_attention(q, k, v, record, p, dout=dout if gradients else None, backward=backward or "eager",
                              reorder=reorder, block_rows=block_rows, saved_out=saved, mlx=mlx, scores=scores)
    if back is not None and "dq" in result:
        result["dq"], result["dk"] = back(result["dq"], result["dk"])
    return result


def forwards_counted(monkeypatch):
    """A list that grows by one for each block of rows the recipe's forward computes."""
    calls = []
    forward = precision_module._forward_rows
    monkeypatch.setattr(precision_module, "_forward_rows", lambda *args: calls.append(1) or forward(*args))
    return calls


FORWARD_ONLY_OPTIONS = [name for name in CASES if name != "dropout, softcap"]   # float8's (case.py)


@pytest.mark.parametrize("gqa", [True, False])
@pytest.mark.parametrize("precision, name", [(p, name) for p in ("bfloat16", "float16") for name in CASES]
                         + [("float8_e4m3fn", name) for name in FORWARD_ONLY_OPTIONS])
def test_the_ways_that_share_a_forward_compute_it_once_with_each_ways_bits(precision, name, gqa, monkeypatch):
    """baselines: one forward for the ways that share it (scale on k with the eager backward,
    the flash one and the flash one reading the kernel's out), each way's results bitwise its
    own; the same in blocks of 32 rows (as on a large case)."""
    case = split_case({**inputs(precision, gqa), **CASES[name], "precision": precision})
    gradients = "dout" in case.inputs
    ways = check._ways(case, gradients)
    assert len(check._forwards(ways)) == len(ways) - 2 * gradients      # two ways fewer with gradients
    calls = forwards_counted(monkeypatch)
    for block_rows in (None, 32):                                      # whole, and in blocks of rows
        calls.clear()
        together = check.baselines(case, gradients, block_rows)
        rows = len(blocks.row_slices(70, block_rows))
        assert len(calls) == len(check._forwards(ways)) * rows
        for way, result in enumerate(together):
            alone = way_alone(case, way, gradients, block_rows)
            assert result.keys() == alone.keys()
            for tensor, want in alone.items():
                assert result[tensor].dtype == want.dtype
                assert np.array_equal(result[tensor], want, equal_nan=True), (ways[way][0], tensor, block_rows)


def test_baselines_gives_the_ways_asked_for_in_their_order():
    """ways=[...]: those ways' baselines only, in the order asked, each the one of all ways."""
    case = split_case({**inputs("bfloat16"), **CASES["causal"]})
    every = check.baselines(case)
    asked = [4, 0, 6]
    for way, result in zip(asked, check.baselines(case, ways=asked)):
        assert all(np.array_equal(result[t], every[way][t], equal_nan=True) for t in every[way])
