"""numpy_attention: Transformer multi-head attention in NumPy, with every backward written by hand.

Public API (re-exports only; see README.md and docs/derivations.md):

    linear_forward / linear_backward          Y = X W + b
    softmax_forward / softmax_backward         p = softmax(z), dz = p * (dp - sum(dp * p))
    softmax_jacobian, logsumexp                J = diag(p) - p p^T
    plain_softmax                              exp(z - max z) / sum: the formula in two lines
    split_heads / merge_heads                  [B, N, D] <-> [B, H, N, D/H]
    plain_attention_forward / _backward        softmax(q k^T / sqrt(d_k)) v in three lines, its backward in
                                               five: the textbook's first page (textbook.py)
    rope_forward / rope_backward / rope_jvp    rotary position embeddings (two layouts, scalings)
    attention_forward / attention_backward     softmax(scale * q k^T + ...) v (textbook, blocked, tiled, sparse)
    attention_options, AttentionOptions        the options, checked once, as one frozen record
    combine_forward / combine_backward         split-KV merge of partial (out, lse)
    mla_forward / mla_backward / mla_jvp       Multi-head Latent Attention, absorbed (one latent kv head);
    mla_unabsorbed_forward / _backward         and with per-head up-projections; mla_absorb
    sparse_attention_forward / _backward / _jvp  each query attends to the keys it lists (the sparse engine)
    MultiHeadAttention                         the seed's module
    linear_jvp, softmax_jvp, attention_jvp     forward mode; attention_hvp: second order
    gradcheck, jvpcheck, taylor_test           finite-difference checks (directional_derivative)
    crosscheck, from_torch                     judge another attention against the oracle
    conform                                    sweep a kernel over the case grid (conform.cases, .check)

Each name is imported from its module on first use (PEP 562's module __getattr__), so
`import numpy_attention` imports no numpy: the `numpy-attention` command, whose modules are
inside this package, gets control at once and handles a Ctrl-C during the heavy imports
(one line, exit 130; commands/cli.py). `import numpy_attention as na; na.attention_forward`
and `from numpy_attention import *` work as with eager imports.

Layers, bottom up: a module imports only from the lines above its own and from the names
before it on its line; a subpackage named on a line (oracle, ...) is one name there, whose
modules import each other freely (tests/test_layers.py walks every import):

    helpers      numpy_attention _checks _exits _files near_misses positions _layout engines.parallel
    ops          linear softmax heads rope params paged combine topk gate
    scores       score_mods scores softmax_row score_grads option_checks options caches
    textbook     textbook
    engines      engines engines.sparse engines.plan engines.projections engines.blocked engines.tiled
    attention    attention forward_mode sparse_attention mla multihead_threads multihead gradcheck_cases
    tools        finite_differences experiments exercises oracle conformance commands __main__
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {                                           # module of this package -> its public names
    "linear": ("linear_forward", "linear_backward", "linear_jvp", "LinearCache"),
    "softmax": ("softmax_forward", "softmax_backward", "softmax_jvp", "softmax_jacobian", "logsumexp",
                "plain_softmax", "SoftmaxCache"),
    "heads": ("split_heads", "merge_heads"),
    "textbook": ("plain_attention_forward", "plain_attention_backward"),
    "rope": ("rope_forward", "rope_backward", "rope_jvp", "RopeCache"),
    "attention": ("attention_forward", "attention_backward", "AttentionCache", "AttentionGrads",
                  "AttentionStages", "TiledAttentionCache"),
    "options": ("AttentionOptions", "attention_options"),
    "combine": ("combine_forward", "combine_backward", "CombineCache"),
    "mla": ("mla_forward", "mla_backward", "mla_jvp", "mla_absorb", "mla_unabsorbed_forward",
            "mla_unabsorbed_backward", "MlaCache", "MlaGrads", "MlaUnabsorbedCache", "MlaUnabsorbedGrads"),
    "multihead": ("MultiHeadAttention", "multihead_forward", "multihead_backward"),
    "sparse_attention": ("sparse_attention_forward", "sparse_attention_backward", "sparse_attention_jvp",
                         "SparseCache", "SparseGrads"),
    "topk": ("block_indices",),
    "forward_mode": ("attention_jvp", "attention_hvp"),
    "finite_differences": ("gradcheck", "jvpcheck", "taylor_test", "directional_derivative",
                           "GradcheckReport", "GradcheckError"),
    "oracle": ("crosscheck", "CrosscheckReport", "from_torch"),
    "conformance": ("conform",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = list(_MODULE_OF)


def __getattr__(name):
    """A public name not yet loaded: import its module, and keep the name here (later uses
    find it directly)."""
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    """The public names, loaded or not (for help() and tab completion), and the dunders."""
    return sorted([*__all__, *(name for name in globals() if name.startswith("__"))])
