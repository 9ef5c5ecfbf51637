"""Training by hand on a retrieval task: does the 1/sqrt(d_k) scale matter for learning?

Task (fixed seeds). Each example has N_k keys x_j ~ N(0, I_D) with values y_j ~ N(0, I_dv);
the query is a noisy rotated copy of one of them, x_q = x_{j*} R + 0.3 noise, R a fixed
random rotation: the rule the model must learn is "find the key whose rotation is the query".

Model (one head, no value or output projection), B examples per batch:

    q = x_q W_q   [B, 1, d_k]        k = X W_k   [B, N_k, d_k]        (linear_forward)
    out = softmax(scale * q k^T) Y   [B, 1, d_v]                       (attention_forward)
    loss = 1/(2B) sum_b ||out_b - y_{j*}||^2      the right key's value must be retrieved

Backward: attention_backward, then linear_backward for dW_q, dW_k. Optimizers, written out
(g the gradient, t = 1, 2, ...):

    sgd    m = 0.9 m + g;  W = W - lr m                                 (heavy-ball momentum)
    adam   m = 0.9 m + 0.1 g;  s = 0.999 s + 0.001 g^2;
           W = W - lr (m / (1 - 0.9^t)) / (sqrt(s / (1 - 0.999^t)) + 1e-8)

Initialization: W_q, W_k ~ N(0, 1/D), so q and k have unit-variance entries, the seed's
premise; unscaled logits then start with variance d_k. (With W ~ N(0, 1/(D sqrt(d_k)))
the unscaled model would start where the scaled one does.)
"""
from typing import NamedTuple

import numpy as np

from .._checks import require_choice, require_positive_int
from ..attention import attention_backward, attention_forward
from ..linear import linear_backward, linear_forward

OPTIMIZERS = ("sgd", "adam")
LEARNING_RATES = (0.001, 0.01, 0.1, 1.0)
VANISHED = 1e-8                  # a step whose ||dW|| is below this learned nothing


class Task(NamedTuple):
    d_model: int = 32            # D, the width of keys and query
    d_k: int = 512
    d_v: int = 8
    n_keys: int = 8
    noise: float = 0.3


class Curve(NamedTuple):
    scaled: bool
    lr: float
    steps: np.ndarray            # [E] the steps at which the held-out batch was evaluated
    loss: np.ndarray             # [E] held-out loss
    accuracy: np.ndarray         # [E] held-out fraction with argmax_j P = j*
    vanished: float              # fraction of training steps with ||dW|| < VANISHED


def make_batch(rng, task, rotation, batch):
    """(x_q [B, 1, D], X [B, N_k, D], Y [B, N_k, d_v], target [B, 1, d_v], j* [B])."""
    X = rng.standard_normal((batch, task.n_keys, task.d_model))
    Y = rng.standard_normal((batch, task.n_keys, task.d_v))
    right = rng.integers(task.n_keys, size=batch)
    rows = np.arange(batch)
    x_q = X[rows, right] @ rotation + task.noise * rng.standard_normal((batch, task.d_model))
    return x_q[:, None, :], X, Y, Y[rows, right][:, None, :], right


def loss_and_grads(W_q, W_k, batch, scale):
    """(loss, accuracy, dW_q, dW_k) on one batch: the forward, then the backward in reverse."""
    x_q, X, Y, target, right = batch
    q, cache_q = linear_forward(x_q, W_q)                        # [B, 1, d_k]
    k, cache_k = linear_forward(X, W_k)                          # [B, N_k, d_k]
    out, cache = attention_forward(q, k, Y, scale=scale)         # [B, 1, d_v]
    n = len(x_q)
    loss = 0.5 * np.sum((out - target) ** 2) / n
    accuracy = np.mean(np.argmax(cache.weights[:, 0, :], axis=-1) == right)
    grads = attention_backward((out - target) / n, cache)        # dloss/dout = (out - target) / B
    return loss, accuracy, linear_backward(grads.dq, cache_q)[1], linear_backward(grads.dk, cache_k)[1]


def optimizer_step(name, W, g, state, lr, t):
    """One update of W by `name` (module docstring); returns (new W, new state)."""
    m, s = state
    if name == "sgd":
        m = 0.9 * m + g
        return W - lr * m, (m, s)
    m, s = 0.9 * m + 0.1 * g, 0.999 * s + 0.001 * g ** 2
    return W - lr * (m / (1 - 0.9 ** t)) / (np.sqrt(s / (1 - 0.999 ** t)) + 1e-8), (m, s)


def train(task=Task(), *, scaled=True, lr=0.1, optimizer="sgd", steps=300, batch=64,
          eval_every=25, seed=0, progress=None):
    """Train W_q, W_k from the same initialization and data whatever scaled, lr and optimizer;
    progress(t), if given, is called after each step t = 1 .. steps."""
    require_choice(optimizer, "optimizer", OPTIMIZERS)
    steps, batch = require_positive_int(steps, "steps"), require_positive_int(batch, "batch")
    eval_every = require_positive_int(eval_every, "eval_every")
    init = np.random.default_rng([seed, 0])
    rotation = np.linalg.qr(init.standard_normal((task.d_model, task.d_model)))[0]
    weights = [init.standard_normal((task.d_model, task.d_k)) / np.sqrt(task.d_model) for _ in "qk"]
    states = [(np.zeros_like(W), np.zeros_like(W)) for W in weights]
    held_out = make_batch(np.random.default_rng([seed, 1]), task, rotation, 512)
    data = np.random.default_rng([seed, 2])
    scale = task.d_k ** -0.5 if scaled else 1.0
    evaluate = lambda t: (t, *loss_and_grads(*weights, held_out, scale)[:2])
    evals, vanished = [evaluate(0)], 0
    for t in range(1, steps + 1):                    # t: the number of updates after this one
        *_, dW_q, dW_k = loss_and_grads(*weights, make_batch(data, task, rotation, batch), scale)
        vanished += np.sqrt(np.sum(dW_q ** 2) + np.sum(dW_k ** 2)) < VANISHED
        for i, g in enumerate((dW_q, dW_k)):
            weights[i], states[i] = optimizer_step(optimizer, weights[i], g, states[i], lr, t)
        if t % eval_every == 0 or t == steps:
            evals.append(evaluate(t))
        if progress:
            progress(t)
    steps_, loss, accuracy = (np.array(c) for c in zip(*evals))
    return Curve(scaled, lr, steps_, loss, accuracy, vanished / steps)


def compare(task=Task(), *, lrs=LEARNING_RATES, optimizer="sgd", steps=300, seed=0, progress=None):
    """Curves for scaled and unscaled at every learning rate: a list of Curve. progress(done,
    total), if given, is called after every step of every run: done of the total steps."""
    curves, total = [], 2 * len(lrs) * steps
    for scaled in (True, False):
        for lr in lrs:
            done = len(curves) * steps
            step = (lambda t, done=done: progress(done + t, total)) if progress else None
            curves.append(train(task, scaled=scaled, lr=lr, optimizer=optimizer, steps=steps, seed=seed,
                                progress=step))
    return curves
