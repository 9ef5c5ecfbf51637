"""nn.MultiheadAttention with a fully masked query row: what the module gives depends on
need_weights, and from_torch gives the same, forward and backward."""
import numpy as np
import pytest
from optional import TORCH_REASON

import numpy_attention as na

torch = pytest.importorskip("torch", reason=TORCH_REASON)


def _module():
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    with torch.no_grad():
        module.out_proj.bias.copy_(torch.randn(8, dtype=torch.float64))     # nonzero: it is the output
        module.in_proj_bias.copy_(torch.randn(24, dtype=torch.float64))
    return module


ATTN_MASK = np.array([[False, True, True], [True, True, True], [False, False, True]])  # True = ignore


def test_need_weights_false_gives_zero_attention_and_out_proj_bias_like_torch():
    module = _module()
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    out, weights = module(x, x, x, attn_mask=torch.from_numpy(ATTN_MASK), need_weights=False)
    dout = torch.randn_like(out)
    out.backward(dout)
    ours = na.from_torch(module)
    ours_out, ours_weights = ours(x.detach().numpy(), x.detach().numpy(), x.detach().numpy(),
                                  attn_mask=ATTN_MASK, need_weights=False)
    assert weights is None and ours_weights is None
    np.testing.assert_allclose(ours_out[:, 1], np.broadcast_to(module.out_proj.bias.detach().numpy(), (2, 8)),
                               rtol=0, atol=1e-15)                     # the fully masked row
    np.testing.assert_allclose(ours_out, out.detach().numpy(), rtol=1e-12, atol=1e-13)
    grads = ours.backward(dout.numpy())
    dx = grads["query"] + grads["key"] + grads["value"]
    assert np.isfinite(dx).all()
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=1e-11, atol=1e-12)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-11, atol=1e-12, err_msg=name)


def test_need_weights_true_gives_nan_for_the_row_like_torch():
    module = _module()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    out, _ = module(x, x, x, attn_mask=torch.from_numpy(ATTN_MASK), need_weights=True)
    out = out.detach()
    ours_out, _ = na.from_torch(module)(x.numpy(), x.numpy(), x.numpy(), attn_mask=ATTN_MASK)
    assert np.isnan(out[:, 1].numpy()).all() and np.isnan(ours_out[:, 1]).all()
    np.testing.assert_allclose(ours_out[:, [0, 2]], out[:, [0, 2]].numpy(), rtol=1e-12, atol=1e-13)
