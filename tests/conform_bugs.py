"""Planted bugs for the conformance run's tests: numpy kernels (kernels.py's 'numpy' kind) that
are examples.numpy_float32 with one mistake each, the mistakes kernel authors make.

    scale_off       the softmax scale 1% too large
    causal_shifted  top-left causal one key too far: query i also sees key i + 1
    gqa_interleaved query head h reads kv head h % H_kv, not h // (H / H_kv)
    dk_negated      kv head 0's dk with the wrong sign (the forward is right)
"""
import math

import numpy as np

from numpy_attention.conformance import declare
from numpy_attention.conformance.examples import numpy_float32

SUPPORTS = ("causal", "gqa", "gradients")


@declare(kind="numpy", supports=SUPPORTS)
def scale_off(q, k, v, dout=None, scale=None, **options):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return numpy_float32(q, k, v, dout=dout, scale=1.01 * scale, **options)


@declare(kind="numpy", supports=SUPPORTS)
def causal_shifted(q, k, v, dout=None, causal=False, **options):
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        options["mask"] = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + 1
    return numpy_float32(q, k, v, dout=dout, **options)


@declare(kind="numpy", supports=SUPPORTS)
def gqa_interleaved(q, k, v, dout=None, **options):
    groups = q.shape[-3] // k.shape[-3]
    tiled = lambda x: np.concatenate([x] * groups, axis=-3)        # head h: kv head h % H_kv
    results = numpy_float32(q, tiled(k), tiled(v), dout=dout, **options)
    if dout is not None:                                           # each kv head's copies summed back
        fold = lambda x: x.reshape(x.shape[:-3] + (groups, -1) + x.shape[-2:]).sum(axis=-4).astype(x.dtype)
        results.update(dk=fold(results["dk"]), dv=fold(results["dv"]))
    return results


@declare(kind="numpy", supports=SUPPORTS)
def dk_negated(q, k, v, dout=None, **options):
    results = numpy_float32(q, k, v, dout=dout, **options)
    if dout is not None:
        dk = results["dk"].copy()
        dk[..., 0, :, :] = -dk[..., 0, :, :]
        results["dk"] = dk
    return results
