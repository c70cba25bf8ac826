"""Layouts the forward takes, the backward too: torch's forward takes x in any layout, so the
autograd ops' backwards must not refuse it as unflattenable."""

import pytest
import torch

import ops


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "bias_dropout"])
def test_transposed_x_through_the_autograd_ops(op):
    """torch's forward takes x in any layout; the backward must not then refuse it as unflattenable."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(64, 32, device="cuda", generator=gen)
    w = torch.randn(64, device="cuda", generator=gen)
    dy = torch.randn(32, 64, device="cuda", generator=gen)
    grads = []
    for ours in (True, False):
        x = base.clone().t().requires_grad_()  # [32, 64], column stride 32
        p = w.clone().requires_grad_()
        if op == "layer_norm":
            y = (ops.layer_norm if ours else torch.nn.functional.layer_norm)(x, (64,), p, None, 1e-5)
        elif op == "rms_norm":
            y = (ops.rms_norm if ours else torch.nn.functional.rms_norm)(x, (64,), p, 1e-5)
        else:
            y = ops.bias_dropout(x, p, 0.0, "relu") if ours else torch.relu(x + p)
        y.backward(dy)
        grads.append((x.grad, p.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
