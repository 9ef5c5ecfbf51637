"""Engines: attention.py's textbook computed faster or in less memory, each tested equal to it.

    blocked.py   the textbook's steps on blocks of query rows; P is stored whole
    tiled.py     FlashAttention's online softmax over tiles: O(N) memory, no [N_q, N_k] array

Each engine is a pair engine_forward(q, k, v, options) -> (out, cache) and
engine_backward(dout, cache, method, return_stages) -> AttentionGrads, called by
attention_forward / attention_backward after every argument has been checked.
"""
