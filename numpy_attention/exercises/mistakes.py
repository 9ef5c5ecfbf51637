"""The mistakes learners make in each exercise, planted in the reference solutions, with what
to say when a learner's function computes exactly what one of them computes, or raises exactly
the error one of them raises (a .T on an array with a batch axis): transposed products, sums
over too few, too many or the wrong axes, a lost axis, the gradient of sum().

Each entry of MISTAKES[exercise] is (function with the exercise's signature, message). The
message says which line is wrong, what the error looks like, and the right formula.
"""
import numpy as np

from . import solutions as ref


def _t(x):
    return np.swapaxes(x, -1, -2)


# ----------------------------------------------------------------------------- linear

def _linear_dx_untransposed(dy, x, W):
    _, dW, db = ref.linear_backward(dy, x, W)
    return dy @ W, dW, db


def _linear_dW_dot_T(dy, x, W):
    dx, _, db = ref.linear_backward(dy, x, W)
    return dx, x.T @ dy, db


def _linear_dW_per_batch(dy, x, W):
    dx, _, db = ref.linear_backward(dy, x, W)
    return dx, _t(x) @ dy, db


def _linear_dW_transposed(dy, x, W):
    dx, _, db = ref.linear_backward(dy, x, W)
    return dx, dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1]), db


def _linear_db_one_axis(dy, x, W):
    dx, dW, _ = ref.linear_backward(dy, x, W)
    return dx, dW, dy.sum(axis=0)


def _linear_db_last_axis(dy, x, W):
    dx, dW, _ = ref.linear_backward(dy, x, W)
    return dx, dW, dy.sum(axis=-1)


def _linear_db_every_axis(dy, x, W):
    dx, dW, _ = ref.linear_backward(dy, x, W)
    return dx, dW, dy.sum()


def _linear_dW_first_row(dy, x, W):
    dx, _, db = ref.linear_backward(dy, x, W)
    return dx, ref.linear_backward(dy[:1], x[:1], W)[1], db


# ----------------------------------------------------------------------------- softmax

def _softmax_no_rowsum(dp, p):
    return p * dp


def _softmax_diagonal(dp, p):
    return p * (1 - p) * dp


def _softmax_upstream_of_ones(dp, p):
    return ref.softmax_backward(np.ones_like(dp), p)


def _softmax_sum_whole_array(dp, p):
    return p * (dp - np.sum(p * dp))


def _softmax_sum_first_axis(dp, p):
    return p * (dp - np.sum(p * dp, axis=0, keepdims=True))


def _softmax_sum_without_keepdims(dp, p):
    return p * (dp - np.sum(p * dp, axis=-1))


# ----------------------------------------------------------------------------- attention

def _attention_no_scale(dout, q, k, v, p):
    dq, dk, dv = ref.attention_backward(dout, q, k, v, p)
    return dq * np.sqrt(q.shape[-1]), dk * np.sqrt(q.shape[-1]), dv


def _attention_from_dS(dS, dout, q, k, p):
    """(dq, dk, dv) of the reference's last steps, from a (mistaken) dS."""
    return dS @ k / np.sqrt(q.shape[-1]), _t(dS) @ q / np.sqrt(q.shape[-1]), _t(p) @ dout


def _attention_no_rowsum(dout, q, k, v, p):
    return _attention_from_dS(p * (dout @ _t(v)), dout, q, k, p)


def _attention_rowsum_over_queries(dout, q, k, v, p):
    dP = dout @ _t(v)
    return _attention_from_dS(p * (dP - np.sum(p * dP, axis=-2, keepdims=True)), dout, q, k, p)


def _attention_dP_untransposed(dout, q, k, v, p):
    return _attention_from_dS(ref.softmax_backward(dout @ v, p), dout, q, k, p)


def _attention_dP_dot_T(dout, q, k, v, p):
    return _attention_from_dS(ref.softmax_backward(dout @ v.T, p), dout, q, k, p)


def _attention_dv_dot_T(dout, q, k, v, p):
    dq, dk, _ = ref.attention_backward(dout, q, k, v, p)
    return dq, dk, p.T @ dout


def _attention_dv_untransposed(dout, q, k, v, p):
    dq, dk, _ = ref.attention_backward(dout, q, k, v, p)
    return dq, dk, p @ dout


def _attention_dq_transposed(dout, q, k, v, p):
    _, dk, dv = ref.attention_backward(dout, q, k, v, p)
    dS = ref.softmax_backward(dout @ _t(v), p)
    return dS @ _t(k) / np.sqrt(q.shape[-1]), dk, dv


def _attention_dk_untransposed(dout, q, k, v, p):
    dq, _, dv = ref.attention_backward(dout, q, k, v, p)
    dS = ref.softmax_backward(dout @ _t(v), p)
    return dq, dS @ q / np.sqrt(q.shape[-1]), dv


def _attention_upstream_of_ones(dout, q, k, v, p):
    return ref.attention_backward(np.ones_like(dout), q, k, v, p)


# ----------------------------------------------------------------------------- heads

def _split_without_transpose(x, num_heads):
    *lead, n, d_model = x.shape
    return x.reshape(*lead, num_heads, n, d_model // num_heads)


def _merge_without_transpose(xh):
    *lead, h, n, d = xh.shape
    return xh.reshape(*lead, n, h * d)


# ----------------------------------------------------------------------------- multihead

def _multihead_with(cache, dout, split=ref.split_heads, merge=ref.merge_heads, linear=ref.linear_backward):
    """multihead_backward with one of its pieces replaced by a mistaken one."""
    c, p, H = cache, cache["params"], cache["num_heads"]
    g = {}
    dconcat, g["W_o"], g["b_o"] = linear(dout, c["concat"], p["W_o"])
    dheads = split(dconcat, H)
    dQh, dKh, dVh = ref.attention_backward(dheads, c["Qh"], c["Kh"], c["Vh"], c["P"])
    dQ, dK, dV = (merge(d) for d in (dQh, dKh, dVh))
    g["query"], g["W_q"], g["b_q"] = linear(dQ, c["query"], p["W_q"])
    g["key"], g["W_k"], g["b_k"] = linear(dK, c["key"], p["W_k"])
    g["value"], g["W_v"], g["b_v"] = linear(dV, c["value"], p["W_v"])
    return g


def _multihead_merge_without_transpose(dout, cache):
    return _multihead_with(cache, dout, merge=_merge_without_transpose)


def _multihead_split_without_transpose(dout, cache):
    return _multihead_with(cache, dout, split=_split_without_transpose)


def _multihead_dx_untransposed(dout, cache):
    return _multihead_with(cache, dout, linear=_linear_dx_untransposed)


def _multihead_dW_transposed(dout, cache):
    return _multihead_with(cache, dout, linear=_linear_dW_transposed)


def _multihead_dW_per_batch(dout, cache):
    return _multihead_with(cache, dout, linear=_linear_dW_per_batch)


def _multihead_db_one_axis(dout, cache):
    return _multihead_with(cache, dout, linear=_linear_db_one_axis)


TRANSPOSE_HEADS = ("[B, H, N, d_k] must become [B, N, H, d_k] (swap the heads and length axes) "
                   "before the reshape to [B, N, D]; without the swap each row of the result mixes "
                   "different tokens")

DOT_T = (".T reverses every axis of an array, not only the last two: with a batch axis in front it "
         "is no matrix transpose; np.swapaxes(x, -1, -2) transposes the last two axes")

MISTAKES = {
    "linear_backward": (
        (_linear_dx_untransposed,
         "dx is a transposed product: y = x W gives dx = dy W^T, [..., d_out] @ [d_out, d_in]; dy W is "
         "another matrix (with a square W it even has the right shape)"),
        (_linear_dW_dot_T,
         "dW = x.T @ dy: x.T of x [B, N, d_in] is [d_in, N, B]. " + DOT_T + ", or flatten x and dy to "
         "[B N, d_in] and [B N, d_out] first, so that x^T dy also sums over every position"),
        (_linear_dW_per_batch,
         "dW is not summed over the batch: x^T dy of each batch entry is [B, d_in, d_out]; every entry "
         "multiplies the same W, so dW is their sum, [d_in, d_out] (flatten x and dy to [B N, d_in] and "
         "[B N, d_out] first)"),
        (_linear_dW_transposed,
         "dW is transposed: dy^T x is [d_out, d_in]; y = x W gives dW = x^T dy, [d_in, N] @ [N, d_out], "
         "with x and dy flattened to [N, d_in] and [N, d_out]"),
        (_linear_db_one_axis,
         "db is summed over the first axis only: b is added at every position of every leading axis, "
         "so db sums dy over all of them, down to [d_out]"),
        (_linear_db_last_axis,
         "db is summed over the last axis, d_out: b has one entry per output feature, so db sums dy "
         "over every axis but the last, down to [d_out]"),
        (_linear_db_every_axis,
         "db is summed over every axis, d_out too, to one number: b has one entry per output feature, "
         "so sum over the leading axes only, down to [d_out]"),
        (_linear_dW_first_row,
         "dW uses only the first batch entry: every position of every leading axis multiplies the same "
         "W, so dW = x^T dy sums the outer products over all of them (flatten x and dy to [N, ...])"),
    ),
    "softmax_backward": (
        (_softmax_no_rowsum,
         "the - rowsum(p * dp) term is missing: p_i depends on every z_j of its row through the "
         "normalization, so dz_i = p_i (dp_i - sum_j p_j dp_j), not p_i dp_i"),
        (_softmax_diagonal,
         "only the diagonal of the Jacobian is used: dp_i/dz_i = p_i (1 - p_i), but dp_i/dz_j = "
         "-p_i p_j for j != i too; the full product is dz = p * (dp - rowsum(p * dp))"),
        (_softmax_upstream_of_ones,
         "this is the gradient of sum(softmax(z)), an upstream gradient of ones instead of dp: it is 0 "
         "for every z (each row of p sums to 1), the same for every bug, which is why a gradient "
         "check needs a random upstream gradient; use dp"),
        (_softmax_sum_whole_array,
         "rowsum(p * dp) is summed over the whole array: each row of p depends only on its own row "
         "of z, so sum over the last axis only, np.sum(p * dp, axis=-1, keepdims=True)"),
        (_softmax_sum_first_axis,
         "rowsum(p * dp) is summed over the first axis: the softmax runs along the last axis, so "
         "sum there, np.sum(p * dp, axis=-1, keepdims=True)"),
        (_softmax_sum_without_keepdims,
         "rowsum(p * dp) lost its axis: np.sum(p * dp, axis=-1) is [..., N], and subtracting it from "
         "dp [..., N, n] lines it up with the last axis, across the rows instead of down them; keep "
         "the axis: np.sum(p * dp, axis=-1, keepdims=True)"),
    ),
    "attention_backward": (
        (_attention_no_scale,
         "dq and dk are sqrt(d_k) times too large (dv is right): S = q k^T / sqrt(d_k), so the "
         "chain rule multiplies dS k and dS^T q by 1 / sqrt(d_k) as well"),
        (_attention_no_rowsum,
         "dq and dk are wrong while dv is right: the softmax step lacks its - rowsum(P * dP) term, "
         "dS = P * (dP - rowsum(P * dP)), not P * dP"),
        (_attention_rowsum_over_queries,
         "the rowsum in dS is summed over the queries (axis -2): each row of P is a softmax over the "
         "keys, so dS = P * (dP - rowsum(P * dP)) sums over the last axis"),
        (_attention_dP_untransposed,
         "dP is a transposed product: out = P v gives dP = dout v^T, [N_q, d_v] @ [d_v, N_k]; dout v is "
         "another matrix (with d_v = N_k it even has the right shape)"),
        (_attention_dP_dot_T, "dP = dout @ v.T: " + DOT_T),
        (_attention_dv_dot_T, "P.T (or dS.T) in dv = P^T dout (or dk = dS^T q): " + DOT_T),
        (_attention_dv_untransposed,
         "dv is a transposed product: out = P v gives dv = P^T dout, [N_k, N_q] @ [N_q, d_v]; "
         "P dout is another matrix (with N_q = N_k it even has the right shape)"),
        (_attention_dq_transposed,
         "dq is a transposed product: S = q k^T / sqrt(d_k) gives dq = dS k / sqrt(d_k), "
         "[N_q, N_k] @ [N_k, d_k]; dS k^T is another matrix"),
        (_attention_dk_untransposed,
         "dk is a transposed product: S = q k^T / sqrt(d_k) gives dk = dS^T q / sqrt(d_k), "
         "[N_k, N_q] @ [N_q, d_k]; dS q is another matrix"),
        (_attention_upstream_of_ones,
         "this is the gradient of sum(out), an upstream gradient of ones instead of dout: use dout "
         "(a check needs a random upstream gradient: the gradient of sum() hides every softmax bug)"),
    ),
    "split_heads": (
        (_split_without_transpose,
         "the heads are split without the transpose: [B, N, D] must become [B, N, H, d_k] "
         "(reshape), then [B, H, N, d_k] (swap the length and heads axes); a reshape straight to "
         "[B, H, N, d_k] cuts across tokens"),
    ),
    "merge_heads": (
        (_merge_without_transpose, "the heads are merged without the transpose: " + TRANSPOSE_HEADS),
    ),
    "multihead_backward": (
        (_multihead_merge_without_transpose,
         "step 2's backward (merge_heads of dQh, dKh, dVh) merges the heads without the "
         "transpose: " + TRANSPOSE_HEADS),
        (_multihead_split_without_transpose,
         "step 4's backward (split_heads of dconcat) splits without the transpose: [B, N, D] must "
         "become [B, N, H, d_k], then [B, H, N, d_k]; only W_o and b_o (step 5) are right"),
        (_multihead_dx_untransposed,
         "the input gradients of the linear steps are transposed products: y = x W gives dx = dy W^T; "
         "every W here is square [D, D], so dy W has the right shape and wrong numbers (only W_o and b_o "
         "come out right)"),
        (_multihead_dW_per_batch,
         "every weight's gradient is not summed over the batch: x^T dy per batch entry is [B, D, D]; "
         "every entry multiplies the same W, so dW is their sum (flatten x and dy to [B N, D] first)"),
        (_multihead_dW_transposed,
         "every weight's gradient is transposed: in the math layout y = x W, dW = x^T dy is "
         "[d_in, d_out], W's own shape (torch's state_dict stores W^T: transpose only there)"),
        (_multihead_db_one_axis,
         "the bias gradients are summed over the batch axis only: each bias is added at every "
         "position [B, N], so db sums dy over both"),
    ),
}
