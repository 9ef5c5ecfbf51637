"""numpy_attention: Transformer multi-head attention in NumPy, with every backward written by hand.

Public API (re-exports only; see README.md and docs/derivations.md):

    linear_forward / linear_backward          Y = X W + b
    softmax_forward / softmax_backward         p = softmax(z), dz = p * (dp - sum(dp * p))
    softmax_jacobian, logsumexp                J = diag(p) - p p^T
    split_heads / merge_heads                  [B, N, D] <-> [B, H, N, D/H]
    attention_forward / attention_backward     softmax(scale * q k^T + ...) v (textbook, blocked, tiled)
    attention_options, AttentionOptions        the options, checked once, as one frozen record
    combine_forward / combine_backward         split-KV merge of partial (out, lse)
    MultiHeadAttention                         the seed's module
    gradcheck, taylor_test                     finite-difference checks (directional_derivative)
    crosscheck, from_torch                     judge another attention against the oracle
"""
from .attention import (AttentionCache, AttentionGrads, AttentionStages, TiledAttentionCache,
                        attention_backward, attention_forward)
from .options import AttentionOptions, attention_options
from .combine import CombineCache, combine_backward, combine_forward
from .crosscheck import CrosscheckReport, crosscheck, from_torch
from .gradcheck import GradcheckError, GradcheckReport, directional_derivative, gradcheck, taylor_test
from .heads import merge_heads, split_heads
from .linear import LinearCache, linear_backward, linear_forward
from .multihead import MultiHeadAttention, multihead_backward, multihead_forward
from .softmax import SoftmaxCache, logsumexp, softmax_backward, softmax_forward, softmax_jacobian

__version__ = "0.1.0"

__all__ = [
    "linear_forward", "linear_backward", "LinearCache",
    "softmax_forward", "softmax_backward", "softmax_jacobian", "logsumexp", "SoftmaxCache",
    "split_heads", "merge_heads",
    "attention_forward", "attention_backward", "AttentionCache", "AttentionGrads", "AttentionStages",
    "TiledAttentionCache", "AttentionOptions", "attention_options",
    "combine_forward", "combine_backward", "CombineCache",
    "MultiHeadAttention", "multihead_forward", "multihead_backward",
    "gradcheck", "taylor_test", "directional_derivative", "GradcheckReport", "GradcheckError",
    "crosscheck", "CrosscheckReport", "from_torch",
]
