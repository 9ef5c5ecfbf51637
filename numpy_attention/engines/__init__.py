"""Engines: the textbook (textbook.py, linear.py) computed faster or in less memory, each tested equal to it.

    blocked.py      the textbook's steps on blocks of query rows; P is stored whole
    tiled.py        FlashAttention's online softmax over tiles: O(N) memory, no [N_q, N_k] array
    sparse.py       top-k lists: each query's listed keys gathered, the steps on blocks of rows
    projections.py  MultiHeadAttention's linear projections in blocks of rows, on threads
    plan.py         which engine runs a call, in tiles of what size, on how many threads
    parallel.py     running an engine's slices on threads (BLAS on one thread) or on a Dask cluster

Each attention engine is a pair engine_forward(q, k, v, options) -> (out, cache) and
engine_backward(dout, cache, method, return_stages) -> AttentionGrads, called by
attention_forward / attention_backward after every argument has been checked; the
projections' pair, by multihead_threads.py.
"""
