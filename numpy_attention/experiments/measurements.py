"""The 1/sqrt(d_k) study: what the scale of q k^T does to the softmax and to dL/dq.

The seed (sections 3.2-3.3): with q, k ~ N(0, 1) entrywise, Var(q . k) = d_k; unscaled
logits of large variance saturate the softmax, its Jacobian J = diag(p) - p p^T nearly
vanishes, and so does the gradient; dividing by sqrt(d_k) brings the variance back to 1.

Unit of measurement, a cell: one query row against N_k keys, T independent trials.

    q [T, 1, d_k], k [T, N_k, d_k], v [T, N_k, d_v], dout [T, 1, d_v]   all ~ N(0, 1)
    S = scale * q k^T [T, 1, N_k],   P = softmax(S),   out = P v,   L = <dout, out>

d_v is held at D_V = 16 so that only d_k varies (|dL/dq| grows like sqrt(d_v)).
The scaled and unscaled columns of one (d_k, N_k) use the same samples (a paired
comparison); each (d_k, N_k) draws from its own seed, so a cell's numbers do not depend
on which other cells are swept.

Per cell (median over the T trials unless said otherwise):
    logit_var          Var of all T * N_k logits pooled (not a median of per-row variances,
                       which is biased low with few keys); theory scale^2 * d_k
    entropy            -sum_j p_j log p_j (nats), at most log N_k (uniform)
    max_weight         max_j p_j
    jacobian_norm      ||diag(p) - p p^T||_F (about 1/sqrt(N_k) for a uniform row, 0 one-hot)
    grad_norm          ||dL/dq||, through the hand-written attention_backward
    grad_norm_min      the smallest ||dL/dq|| of the cell
    complex_step_err,  the largest over the trials of the gradient's error, verified by
    central_diff_err   complex step and by central differences (see `directional_error`)
"""
import numpy as np
from scipy.special import entr

from .._checks import require_positive_int
from ..attention import attention_backward, attention_forward
from ..finite_differences import DEFAULTS, directional_derivative
from ..softmax import softmax_jacobian

D_V = 16
DEFAULT_D_K = (1, 4, 16, 64, 256, 1024, 4096)
DEFAULT_N_KEYS = (8, 128)
DEFAULT_TRIALS = 100
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
CHUNK_ENTRIES = 1 << 21        # entries of k (or of J) per chunk of trials: bounds memory
VERIFY_METHODS = {"complex_step_err": "complex", "central_diff_err": "central"}


def _draws(seed, trials, n_keys, d_k):
    """Yield (q, k, v, dout, direction) for the cell's trials, a chunk of trials at a time.

    direction [n, 1, d_k] is a random unit vector per trial, for the gradient check.
    """
    rng = np.random.default_rng([seed, d_k, n_keys])
    chunk = max(1, CHUNK_ENTRIES // (n_keys * max(d_k, n_keys)))   # k [n, N_k, d_k], J [n, N_k, N_k]
    for start in range(0, trials, chunk):
        n = min(chunk, trials - start)                               # trials in this chunk
        q, k = rng.standard_normal((n, 1, d_k)), rng.standard_normal((n, n_keys, d_k))
        v, dout = rng.standard_normal((n, n_keys, D_V)), rng.standard_normal((n, 1, D_V))
        w = rng.standard_normal((n, 1, d_k))
        yield q, k, v, dout, w / np.linalg.norm(w, axis=-1, keepdims=True)


def directional_error(q, k, v, dout, direction, scale, dq, method):
    """Per trial: |<dq, w> - D_w L| / ||dq||, D_w L by `method` ('complex' or 'central').

    D_w L = d/dt L(q + t w) is the derivative of L = <dout, out> along the trial's random
    unit direction w, by finite differences of attention_forward (gradcheck's steps:
    complex h = 1e-20, central h = 1e-6). The error is measured in units of the gradient's
    own norm (the largest D_w L can be for a unit w), so it means the same for a gradient
    of 1e-13 as for one of 1. Returns [T]; 0/0 (an exactly zero gradient, matched) is 0.
    """
    L = lambda x: np.sum(dout * attention_forward(x, k, v, scale=scale)[0], axis=(-2, -1))
    numeric = np.real(directional_derivative(L, q, direction, method, DEFAULTS[("float64", method)][0]))
    err = np.abs(np.sum(dq * direction, axis=(-2, -1)) - numeric)
    norm = np.linalg.norm(dq, axis=(-2, -1))
    return np.divide(err, norm, out=np.where(err == 0, 0.0, np.inf), where=norm > 0)


def _trial_stats(q, k, v, dout, direction, scale):
    """Per-trial measurements of one chunk: name -> [t] array (logits: [t, N_k])."""
    _, cache = attention_forward(q, k, v, scale=scale)
    p = cache.weights[:, 0, :]                                   # [t, N_k]
    dq = attention_backward(dout, cache).dq                      # [t, 1, d_k]
    stats = {"logits": cache.scores[:, 0, :],
             "entropy": entr(p).sum(axis=-1),
             "max_weight": p.max(axis=-1),
             "jacobian_norm": np.linalg.norm(softmax_jacobian(p), axis=(-2, -1)),
             "grad_norm": np.linalg.norm(dq, axis=(-2, -1))}
    for name, method in VERIFY_METHODS.items():
        stats[name] = directional_error(q, k, v, dout, direction, scale, dq, method)
    return stats


def _summary(d_k, n_keys, scale, stats):
    """One record from a cell's per-trial arrays (each concatenated over chunks)."""
    record = {"d_k": d_k, "n_keys": n_keys, "scale": scale, "trials": len(stats["grad_norm"]),
              "logit_var": float(np.var(stats["logits"])),
              "logit_var_theory": scale ** 2 * d_k,              # d_k * Var q * Var k * scale^2
              "entropy": float(np.median(stats["entropy"])),
              "log_n_keys": float(np.log(n_keys))}
    for name in ("max_weight", "jacobian_norm", "grad_norm"):
        record[name] = float(np.median(stats[name]))
    record["grad_norm_min"] = float(np.min(stats["grad_norm"]))
    for name in VERIFY_METHODS:
        record[name] = float(np.max(stats[name]))
    return record


def peak_bytes(n_keys, trials, n_scales=2):
    """About the most memory one cell of the sweep holds: per scale and trial, its logits [N_k]
    and six numbers, stored until the cell's summary, twice while they are concatenated."""
    return 2 * n_scales * trials * (n_keys + 6) * 8


def measure(d_k, n_keys, scales, trials, seed):
    """Records of one (d_k, n_keys) at each of `scales`, all on the same samples."""
    chunks = [[] for _ in scales]                    # per scale: one stats dict per chunk
    for draw in _draws(seed, trials, n_keys, d_k):
        for s, per_chunk in zip(scales, chunks):
            per_chunk.append(_trial_stats(*draw, s))
    return [_summary(d_k, n_keys, s, {name: np.concatenate([c[name] for c in per_chunk])
                                      for name in per_chunk[0]})
            for s, per_chunk in zip(scales, chunks)]


def _positive_ints(values, name):
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} must list at least one positive integer")
    return tuple(require_positive_int(x, name) for x in values)


def sweep(d_ks=DEFAULT_D_K, n_keys=DEFAULT_N_KEYS, trials=DEFAULT_TRIALS, seed=0, progress=None):
    """The d_k x n_keys x {scaled, unscaled} table: a list of records (dicts).

    Each record: d_k, n_keys, scaled (scale = 1/sqrt(d_k) if True, 1 if False) and the
    measurements listed in the module docstring. progress(done, total, d_k, n_keys) is
    called after each (d_k, n_keys), if given.
    """
    d_ks, n_keys = _positive_ints(d_ks, "d_ks"), _positive_ints(n_keys, "n_keys")
    trials, seed = require_positive_int(trials, "trials"), require_positive_int(seed, "seed", minimum=0)
    records, pairs = [], [(d, n) for n in n_keys for d in d_ks]
    for done, (d, n) in enumerate(pairs, 1):
        for scaled, record in zip((True, False), measure(d, n, (d ** -0.5, 1.0), trials, seed)):
            records.append({"scaled": scaled, **record})
        if progress:
            progress(done, len(pairs), d, n)
    return records


def scale_sweep(d_k=256, n_keys=DEFAULT_N_KEYS, alphas=ALPHAS, trials=DEFAULT_TRIALS, seed=0):
    """scale = d_k^-alpha at a fixed d_k: alpha = 0.5 is the choice that keeps Var S = 1.

    Var S = d_k^(1 - 2 alpha): alpha < 0.5 saturates the softmax (the unscaled failure),
    alpha > 0.5 flattens it toward uniform and shrinks dL/dq with the scale itself.
    Returns records with alpha added.
    """
    d_k, n_keys = require_positive_int(d_k, "d_k"), _positive_ints(n_keys, "n_keys")
    trials, alphas = require_positive_int(trials, "trials"), tuple(float(a) for a in alphas)
    seed = require_positive_int(seed, "seed", minimum=0)
    records = []
    for n in n_keys:
        for alpha, record in zip(alphas, measure(d_k, n, [d_k ** -a for a in alphas], trials, seed)):
            records.append({"alpha": alpha, **record})
    return records
