"""What a kernel author trips over when handing a case to crosscheck, each refused in one
line that says how to pass it: torch's float attn_mask (0 / -inf) given as mask=, torch's
and FlashAttention's keyword names, FlashAttention's Triton lse padded to 128 rows.
"""
import numpy as np
import pytest

from numpy_attention import attention_forward
from numpy_attention.commands.cli import main
from numpy_attention.oracle import CaseError, crosscheck, write_example_case

RNG = np.random.default_rng(0)
Q, K, V = (RNG.standard_normal((1, 2, 100, 8)) for _ in range(3))
KEEP = np.tril(np.ones((100, 100), bool))


def refusal(**arrays):
    """The CaseError message crosscheck gives for these arrays (fails if it gives none)."""
    with pytest.raises(CaseError) as info:
        crosscheck(**arrays)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("masked, shown", [(-np.inf, "-inf"), (np.finfo(np.float32).min, "-3.4028234663852886e+38"),
                                           (0.5, "0.5")])
def test_a_float_mask_other_than_0_and_1_is_refused(masked, shown):
    """0 / -inf (torch's), 0 / finfo.min (Hugging Face's): nonzero would read as attend."""
    additive = np.where(KEEP, 0.0, masked).astype(np.float32)
    out, _ = attention_forward(Q, K, V, mask=KEEP)
    message = refusal(q=Q, k=K, v=V, out=out, mask=additive)
    assert message == (f"mask of shape (100, 100) and dtype float32 holds entries other than 0 and 1 "
                       f"(mask[0, 1] = {shown}, mask[0, 2] = {shown}, mask[0, 3] = {shown}, ... (4950 entries)): "
                       f"a float mask is a keep-mask of 0 and 1 (1 = keep); a float mask of 0 and -inf (or -1e9) "
                       f"is an additive bias: pass it as bias=")
    for keep in (KEEP, KEEP.astype(np.float32), KEEP.astype(int)):            # still keep-masks
        assert crosscheck(q=Q, k=K, v=V, out=out, mask=keep)
    assert crosscheck(q=Q, k=K, v=V, out=out, bias=np.where(KEEP, 0.0, -np.inf))


def test_torch_float_attn_mask_is_a_bias_not_a_mask(torch):
    q, k, v = (torch.from_numpy(x) for x in (Q, K, V))
    keep = torch.from_numpy(KEEP)
    additive = torch.zeros(100, 100, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive)
    for dtype in (torch.float64, torch.bfloat16):
        assert "pass it as bias=" in refusal(q=q, k=k, v=v, out=out, mask=additive.to(dtype))
    assert crosscheck(q=q, k=k, v=v, out=out, bias=additive)
    assert crosscheck(q=q, k=k, v=v, out=out, mask=keep)        # a boolean attn_mask is mask=


@pytest.mark.parametrize("key, hint", [
    ("attn_mask", "a boolean attn_mask is mask= (True = attend), a float one is bias="),
    ("is_causal", "torch's is_causal is causal= (True is top-left, as in torch)"),
    ("softmax_scale", "FlashAttention's softmax_scale is scale="),
    ("softmax_lse", "FlashAttention's softmax_lse is lse="),
    ("window_size", "FlashAttention's window_size is window= with align='bottom_right' (its diagonal)"),
    ("alibi", "ALiBi's slopes are alibi_slopes= ([H] or [B, H])"),
    ("dropout", "dropout is dropout_p= with the kernel's dropout_mask= (the oracle needs the kept entries)"),
    ("causal_mask", "causal=True draws the causal mask"),
    ("key_padding_mask", "True = ignore: pass mask=~key_padding_mask[:, None, None, :]"),
    ("casual", "did you mean causal=?"),                          # typos: difflib's closest key
    ("dropout_pp", "did you mean dropout_p=?"),
    ("sm_scale", "did you mean scale=?"),
])
def test_another_librarys_name_for_a_key_says_which_key(key, hint):
    message = refusal(q=Q, k=K, v=V, out=Q, **{key: np.array(True)})
    assert message.startswith(f"unknown key {key!r}: ") and hint in message
    assert "a case has keys" not in message


def test_a_key_like_none_still_lists_the_keys():
    message = refusal(q=Q, k=K, v=V, out=Q, zzz=np.array(True))
    assert message.startswith("unknown key 'zzz'; a case has keys q, k, v, dout")


def test_a_case_file_with_torchs_name_gets_the_hint(tmp_path, capsys):
    arrays = write_example_case(tmp_path / "good.npz")
    np.savez(tmp_path / "bad.npz", **arrays, is_causal=np.array(True))
    assert main(["crosscheck", str(tmp_path / "bad.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'is_causal': torch's is_causal is causal=" in err


@pytest.mark.parametrize("n_q", [1, 100, 129])
def test_flash_triton_lse_padded_to_128_rows_says_how_to_slice(n_q):
    q = RNG.standard_normal((1, 2, n_q, 8))
    out, cache = attention_forward(q, K, V)
    rows = -(-n_q // 128) * 128
    padded = np.concatenate([cache.lse, np.zeros((1, 2, rows - n_q))], axis=-1)
    assert refusal(q=q, k=K, v=V, out=out, lse=padded) == (
        f"lse has {rows} rows, N_q = {n_q}: FlashAttention's Triton kernel pads to a multiple of 128; "
        f"pass lse[..., :{n_q}]")
    assert crosscheck(q=q, k=K, v=V, out=out, lse=padded[..., :n_q])                  # as advised
    wider = np.zeros((1, 2, rows + 128))                         # no kernel's padding: the plain error
    assert refusal(q=q, k=K, v=V, out=out, lse=wider) == f"lse must have shape (1, 2, {n_q}), got {wider.shape}"
