"""ops._compile.eager_autograd: the ops' eager autograd path keeps their custom ops' semantics
(setup_context's saved tensors and flags, a non-differentiable output, gradients only for the
outputs that reached the loss) without binding arguments on every call."""

from __future__ import annotations

import inspect

import torch

from ops import _compile as cc


def _body(x, w, scale):
    """A toy op in the ops' pattern: two outputs and a non-differentiable counter."""
    y = x * w * scale
    return y, (x * x).sum(-1), torch.zeros((), dtype=torch.int64)


def _setup(ctx, inputs, output):
    x, w, scale = inputs
    y, _, count = output
    ctx.save_for_backward(x, w, y)
    ctx.scale = scale
    ctx.mark_non_differentiable(count)
    ctx.set_materialize_grads(False)


def _backward(ctx, gy, gsq, gcount):
    x, w, y = ctx.saved_tensors
    gx = torch.zeros_like(x)
    if gy is not None:
        gx = gx + gy * w * ctx.scale
    if gsq is not None:
        gx = gx + 2 * x * gsq.unsqueeze(-1)
    gw = None if gy is None else (gy * x * ctx.scale).sum(0)
    return gx, gw, None


Toy = cc.eager_autograd("Toy", lambda *inputs: _body(*inputs), _setup, _backward)


def test_gradients_match_autograd_of_the_body():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: Toy.apply(a, b, 0.5)[:2], (x, w))
    y, sq, count = Toy.apply(x, w, 0.5)
    assert not count.requires_grad
    (y.sum() + sq.sum()).backward()
    ref_x, ref_w = (t.detach().clone().requires_grad_() for t in (x, w))
    ref_y, ref_sq, _ = _body(ref_x, ref_w, 0.5)
    (ref_y.sum() + ref_sq.sum()).backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)


def test_an_output_that_does_not_reach_the_loss_gets_none():
    x = torch.randn(4, 2, requires_grad=True)
    w = torch.randn(2, requires_grad=True)
    _, sq, _ = Toy.apply(x, w, 1.0)
    sq.sum().backward()  # y unused: its gradient is None (not materialised), so w gets none
    torch.testing.assert_close(x.grad, 2 * x.detach())
    assert w.grad is None


def test_apply_binds_no_signature(monkeypatch):
    """A Function with ``setup_context`` binds its inputs to the forward's signature on every
    apply; the eager path must not (it runs setup_context inside its forward)."""
    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(3, 2, requires_grad=True)
    Toy.apply(x, torch.ones(2), 1.0)[0].sum().backward()
    assert calls == []
