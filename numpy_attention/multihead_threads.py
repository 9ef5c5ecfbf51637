"""MultiHeadAttention's five steps on threads: multihead.py's textbook pair, faster.

The same steps as multihead.py's textbook_multihead_forward / textbook_multihead_backward
(shape legend there), with:
- the projections on `workers` threads, each product in blocks of rows with BLAS on one
  thread (engines/projections.py), so the threads share them evenly; the blocks depend on
  the shapes alone, and the results are bitwise the same for any number of workers;
- the three splits and merges of heads (Q, K, V; dQ, dK, dV) on those threads too, one task
  each, when they are large (plan.PARALLEL_HEAD_COPIES);
- BLAS on one thread from the start of a forward or backward to its end (one setting of its
  threads instead of one per step);
- in the backward, dW_o and db_o (which no later step needs) computed with the input
  projections' products, on the same threads.
The attention takes `workers` as given, so by default its own rule (many scores).
"""
from .attention import attention_backward, attention_forward
from .caches import MultiHeadCache
from .engines.parallel import blas_on_one_thread, run_tasks
from .engines.plan import PARALLEL_HEAD_COPIES
from .engines.projections import projections_backward, projections_forward
from .heads import merge_heads, split_heads
from .params import state_dict_grads


def threaded_multihead_forward(query, key, value, params, num_heads, workers, mask, attention_options):
    """multihead.py's five steps with the projections and the heads' copies on `workers`
    threads; arguments checked by multihead_forward. Returns (out [B, N_q, D], MultiHeadCache)."""
    with blas_on_one_thread():
        # 1. linear projections (math layout W = weight^T)
        (Q, cq), (K, ck), (V, cv) = projections_forward([
            (query, params["W_q.weight"].T, params["W_q.bias"]),     # [B, N_q, D]
            (key, params["W_k.weight"].T, params["W_k.bias"]),       # kdim -> [B, N_k, D]
            (value, params["W_v.weight"].T, params["W_v.bias"])], workers)   # vdim -> [B, N_k, D]
        # 2. split heads: [B, N, D] -> [B, H, N, d_k]
        Qh, Kh, Vh = run_tasks(split_heads, [(x, num_heads) for x in (Q, K, V)], _copying(workers, Q))
        # 3. attention per head
        attn, ca = attention_forward(Qh, Kh, Vh, mask=mask, **attention_options)   # [B, H, N_q, d_k]
        # 4. merge heads: [B, H, N_q, d_k] -> [B, N_q, D]
        concat = merge_heads(attn)
        # 5. output projection
        [(out, co)] = projections_forward([(concat, params["W_o.weight"].T, params["W_o.bias"])],
                                          workers)                                   # [B, N_q, D]
    return out, MultiHeadCache(q=cq, k=ck, v=cv, attention=ca, o=co, num_heads=num_heads, workers=workers)


def threaded_multihead_backward(dout, cache):
    """threaded_multihead_forward's gradients, multihead.py's steps in reverse."""
    H, workers = cache.num_heads, cache.workers                          # the forward's threads
    with blas_on_one_thread():
        [(dconcat, _, _)] = projections_backward([(dout, cache.o, "dx")], workers)  # 5. output projection
        dattn = split_heads(dconcat, H)                                  # 4. merge_heads' backward
        g = attention_backward(dattn, cache.attention)                   # 3. attention
        dQ, dK, dV = run_tasks(merge_heads, [(g.dq,), (g.dk,), (g.dv,)],    # 2. split_heads' backward
                               _copying(workers, g.dq))
        dWo, (dquery, dWq, dbq), (dkey, dWk, dbk), (dvalue, dWv, dbv) = projections_backward(
            [(dout, cache.o, "dW"),                    # 5.'s dW_o, db_o: first, a large task early
             (dQ, cache.q), (dK, cache.k), (dV, cache.v)], workers)            # 1. input projections
    return state_dict_grads((dquery, dkey, dvalue), ((dWq, dbq), (dWk, dbk), (dWv, dbv), dWo[1:]), g.dbias)


def _copying(workers, heads):
    """The threads for splitting or merging `heads` (an array of three alike): `workers` from
    plan.PARALLEL_HEAD_COPIES bytes up, else 1 (a thread's task there costs more than the copy)."""
    return workers if heads.nbytes >= PARALLEL_HEAD_COPIES else 1
