"""Other libraries' names for attention's options, and what to pass here instead.

A leaf module (it imports nothing of the package). An entry point that takes attention's options
(attention_forward, attention_jvp, MultiHeadAttention, mla_forward) answers torch's attn_mask or
FlashAttention's window_size with the advice below, as crosscheck answers a case key of that
name; any other unknown name gets difflib's closest known one.
"""
import difflib

# another library's name -> how to pass it here (a call's keyword; a case's key where it differs)
NEAR_MISSES = {
    "attn_mask": "a boolean attn_mask is mask= (True = attend), a float one is bias=",
    "is_causal": "torch's is_causal is causal= (True is top-left, as in torch)",
    "causal_mask": "causal=True draws the causal mask; a mask tensor is mask= (bool, True = attend) "
                   "or bias= (float, 0 / -inf)",
    "key_padding_mask": "torch's key_padding_mask [B, N_k] is True = ignore: pass "
                        "mask=~key_padding_mask[:, None, None, :]",
    "softmax_scale": "FlashAttention's softmax_scale is scale=",
    "softmax_lse": "FlashAttention's softmax_lse is lse= (a case's key; attention_forward's cache.lse)",
    "window_size": "FlashAttention's window_size is window= with align='bottom_right' (its diagonal)",
    "alibi": "ALiBi's slopes are alibi_slopes= ([H] or [B, H])",
    "dropout": "dropout is dropout_p= with the kernel's dropout_mask= (the oracle needs the kept entries)",
    "interleaved": "FlashAttention's rotary interleaved=True is rope_layout='interleaved' in a case, "
                   "rope={'layout': 'interleaved'} in a call (False: 'half')",
    "rotary_dim": "the rotary width is rope_rotary_dim= (with rope_layout=) in a case, rope={'rotary_dim': ...} "
                  "in a call",
    "rope_theta": "Hugging Face's rope_theta is rope_base= in a case, rope={'base': ...} in a call",
}

# another library's name for an option of the table (options.OPTIONS) -> the option's
OTHER_NAMES = {"softmax_scale": "scale", "window_size": "window", "local_window_size": "window"}


def near_miss(name, known=()):
    """How to pass `name` here: NEAR_MISSES' advice, or 'did you mean X=?' for the closest of the
    names `known`, or None."""
    close = difflib.get_close_matches(name, known, n=1)
    return NEAR_MISSES.get(name) or (f"did you mean {close[0]}=?" if close else None)


def unexpected_keyword(name, known=()):
    """The TypeError for a keyword argument `name` that an entry point does not take, with
    near_miss's advice (the entry point's own name left out: the caller may have called it
    through another, MultiHeadAttention through attention_forward)."""
    hint = near_miss(name, known)
    return TypeError(f"unexpected keyword argument {name!r}" + (f": {hint}" if hint else ""))
