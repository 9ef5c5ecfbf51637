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
    linear_jvp, softmax_jvp, attention_jvp     forward mode; attention_hvp: second order
    gradcheck, jvpcheck, taylor_test           finite-difference checks (directional_derivative)
    crosscheck, from_torch                     judge another attention against the oracle
"""
from .attention import (AttentionCache, AttentionGrads, AttentionStages, TiledAttentionCache,
                        attention_backward, attention_forward)
from .options import AttentionOptions, attention_options
from .combine import CombineCache, combine_backward, combine_forward
from .crosscheck import CrosscheckReport, crosscheck, from_torch
from .forward_mode import attention_hvp, attention_jvp
from .gradcheck import (GradcheckError, GradcheckReport, directional_derivative, gradcheck, jvpcheck,
                        taylor_test)
from .heads import merge_heads, split_heads
from .linear import LinearCache, linear_backward, linear_forward, linear_jvp
from .multihead import MultiHeadAttention, multihead_backward, multihead_forward
from .softmax import (SoftmaxCache, logsumexp, softmax_backward, softmax_forward, softmax_jacobian,
                      softmax_jvp)

__version__ = "0.1.0"

__all__ = [
    "linear_forward", "linear_backward", "linear_jvp", "LinearCache",
    "softmax_forward", "softmax_backward", "softmax_jvp", "softmax_jacobian", "logsumexp", "SoftmaxCache",
    "split_heads", "merge_heads",
    "attention_forward", "attention_backward", "AttentionCache", "AttentionGrads", "AttentionStages",
    "TiledAttentionCache", "AttentionOptions", "attention_options",
    "combine_forward", "combine_backward", "CombineCache",
    "MultiHeadAttention", "multihead_forward", "multihead_backward",
    "attention_jvp", "attention_hvp", "gradcheck", "jvpcheck", "taylor_test", "directional_derivative", "GradcheckReport", "GradcheckError",
    "crosscheck", "CrosscheckReport", "from_torch",
]
