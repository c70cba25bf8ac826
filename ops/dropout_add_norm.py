"""Fused dropout + residual add + LayerNorm / RMSNorm (flash-attention's ``dropout_add_layer_norm``):

    r = dropout(x + x_bias, p) + residual        y = norm(r) * weight (+ bias)

``dropout_add_layer_norm`` / ``dropout_add_rms_norm`` are autograd ops (the custom op
``cute_kernels::dropout_add_norm_forward``, whose backward is ``..._backward``): on CUDA one
forward kernel and one backward row kernel (plus the fold of the column sums), the keep mask
drawn on the device from torch's CUDA generator and kept as bits (``ops.dropout_bias_forward``'s
draw and format); on the CPU torch's math. ``DropoutAddLayerNorm`` / ``DropoutAddRMSNorm`` are
the modules (p applies in training mode only).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _compile as cc
from . import dropout_add_norm_kernels as K
from ._validate import (
    check_dtype,
    check_float,
    check_probability,
    check_same_device,
    check_shape,
    check_tensor,
    validate_once,
)


@torch.library.custom_op("cute_kernels::dropout_add_norm_forward", mutates_args=(), device_types="cuda")
def _forward_op(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    x_bias: Optional[Tensor],
    p: float,
    eps: float,
    is_rms: bool,
    residual_in_fp32: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return K.forward(x, residual, weight, bias, x_bias, p, eps, is_rms, residual_in_fp32)


@_forward_op.register_fake
def _(x, residual, weight, bias, x_bias, p, eps, is_rms, residual_in_fp32):
    n = x.shape[-1]
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    mask = x.new_empty((*x.shape[:-1], (n + 7) // 8) if p > 0.0 else (0,), dtype=torch.uint8)
    r = x.new_empty(x.shape, dtype=K.r_dtype(x, residual, residual_in_fp32))
    mean = x.new_empty((0,), dtype=torch.float32) if is_rms else stats.clone()
    return x.new_empty(x.shape), r, mask, mean, stats


@torch.library.custom_op("cute_kernels::dropout_add_norm_backward", mutates_args=(), device_types="cuda")
def _backward_op(
    grad_y: Tensor,
    grad_r: Optional[Tensor],
    r: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    mean: Optional[Tensor],
    rstd: Tensor,
    mask: Tensor,
    p: float,
    is_rms: bool,
    x_dtype: torch.dtype,
    res_dtype: Optional[torch.dtype],
    xb_dtype: Optional[torch.dtype],
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return K.backward(grad_y, grad_r, r, weight, bias, mean, rstd, mask, p, is_rms, x_dtype, res_dtype, xb_dtype)


@_backward_op.register_fake
def _(grad_y, grad_r, r, weight, bias, mean, rstd, mask, p, is_rms, x_dtype, res_dtype, xb_dtype):
    n = r.shape[-1]
    vec = lambda t, dt: r.new_empty(n if t else 0, dtype=dt)  # noqa: E731
    return (
        r.new_empty(r.shape, dtype=x_dtype),
        r.new_empty(r.shape if res_dtype is not None else (0,), dtype=res_dtype or x_dtype),
        vec(weight is not None, weight.dtype if weight is not None else x_dtype),
        vec(bias is not None, bias.dtype if bias is not None else x_dtype),
        vec(xb_dtype is not None, xb_dtype or x_dtype),
    )


def _setup(ctx, inputs, output):
    x, residual, weight, bias, x_bias, p, eps, is_rms, residual_in_fp32 = inputs
    _, r, mask, mean, rstd = output
    ctx.p, ctx.is_rms = p, is_rms
    ctx.x_dtype = x.dtype
    ctx.res_dtype = None if residual is None else residual.dtype
    ctx.xb_dtype = None if x_bias is None else x_bias.dtype
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
    ctx.save_for_backward(r, weight, bias, mean, rstd, mask)
    if mean is None:  # the eager path's RMSNorm
        ctx.mark_non_differentiable(mask, rstd)
    else:
        ctx.mark_non_differentiable(mask, mean, rstd)
    ctx.set_materialize_grads(False)  # no zero fills for the outputs that reach no loss


def _backward(ctx, grad_y, grad_r, grad_mask, grad_mean, grad_rstd):
    del grad_mask, grad_mean, grad_rstd
    if grad_y is None and grad_r is None:
        return (None,) * 9
    r, weight, bias, mean, rstd, mask = ctx.saved_tensors
    if grad_y is None:  # a loss on the residual alone (y is x's dtype)
        grad_y = torch.zeros(r.shape, dtype=ctx.x_dtype, device=r.device)
    # autograd hands gradients in any layout (``.sum()``'s expanded one included)
    grad_y = grad_y.contiguous()
    grad_r = None if grad_r is None else grad_r.contiguous()
    args = (grad_y, grad_r, r, weight, bias, None if ctx.is_rms else mean, rstd, mask, ctx.p, ctx.is_rms)
    args += (ctx.x_dtype, ctx.res_dtype, ctx.xb_dtype)
    if cc.eager(grad_y):  # absent gradients come back as None
        dx, dres, dw, db, dxb = K.backward(*args, False)
    else:
        dx, dres, dw, db, dxb = _backward_op(*args)
    pick = lambda g, on: g if on else None  # noqa: E731
    return (
        dx,
        pick(dres, ctx.res_dtype is not None),
        pick(dw, ctx.has_weight),
        pick(db, ctx.has_bias),
        pick(dxb, ctx.xb_dtype is not None),
        None,
        None,
        None,
        None,
    )


torch.library.register_autograd("cute_kernels::dropout_add_norm_forward", _backward, setup_context=_setup)

# the op's eager path with a gradient (the body looked up at call time, as the op's is)
# (RMSNorm's mean None there: the eager paths need no stand-in tensor for it)
_Eager = cc.eager_autograd("_DropoutAddNormEager", lambda *inputs: K.forward(*inputs, False), _setup, _backward)


def _requires_grad(t) -> bool:
    return t is not None and t.requires_grad


def _cuda_call(x, residual, weight, bias, x_bias, p, eps, is_rms, residual_in_fp32):
    args = (x, residual, weight, bias, x_bias, float(p), float(eps), is_rms, residual_in_fp32)
    if not cc.eager(x):
        return _forward_op(*args)
    if torch.is_grad_enabled() and (
        x.requires_grad
        or _requires_grad(residual)
        or _requires_grad(weight)
        or _requires_grad(bias)
        or _requires_grad(x_bias)
    ):
        return _Eager.apply(*args)
    return K.forward(*args, False)


def _torch_call(x, residual, weight, bias, x_bias, p, eps, is_rms, residual_in_fp32):
    """torch's math (CPU tensors): the same composition, the keep mask from torch's CPU generator."""
    from .reference import pack_mask

    n = x.shape[-1]
    h = x.float() if x_bias is None else x.float() + x_bias.float()
    mask = x.new_empty((0,), dtype=torch.uint8)
    if p > 0.0:
        keep = torch.rand(x.shape, device=x.device) >= p
        h = h * keep / (1.0 - p)
        mask = pack_mask(keep)
    r = (h if residual is None else h + residual.float()).to(K.r_dtype(x, residual, residual_in_fp32))
    w32, b32 = (None if t is None else t.float() for t in (weight, bias))
    if is_rms:
        y = torch.nn.functional.rms_norm(r.float(), (n,), w32, eps)
    else:
        y = torch.nn.functional.layer_norm(r.float(), (n,), w32, b32, eps)
    return y.to(x.dtype), r, mask


def _check(x, residual, weight, bias, x_bias, p, eps, rowscale, is_rms):
    """The call's checks: the tensors' in full once per metadata signature (``validate_once``:
    host time matters), the values' on every call."""
    validate_once(
        ("dropout_add_norm", x, residual, weight, bias, x_bias),
        lambda: _check_tensors(x, residual, weight, bias, x_bias),
    )
    if type(p) is not float or not 0.0 <= p < 1.0:  # the check names what is wrong (ints pass)
        check_probability("p", p)
    if type(eps) is not float or eps - eps != 0.0:  # not a finite float
        check_float("eps", eps)
    if rowscale is not None:
        raise NotImplementedError("rowscale is not supported by the fused dropout + add + norm")
    if is_rms and bias is not None:
        raise NotImplementedError("dropout_add_rms_norm takes no bias (RMSNorm without a shift)")


def _check_tensors(x, residual, weight, bias, x_bias):
    check_tensor("x", x)
    check_dtype("x", x, cc.FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have a last dimension N >= 1 to normalise, got shape {tuple(x.shape)}")
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"x must be a CUDA or CPU tensor, got one on {x.device}")
    n = x.shape[-1]
    if residual is not None:
        check_same_device("residual", residual, x)
        check_dtype("residual", residual, cc.FLOAT_DTYPES)
        check_shape("residual", residual, x.shape)
    for name, t in (("weight", weight), ("bias", bias), ("x_bias", x_bias)):
        if t is not None:
            check_same_device(name, t, x)
            check_dtype(name, t, cc.FLOAT_DTYPES)
            check_shape(name, t, (n,))


def _dropout_add_norm(x, residual, weight, bias, p, eps, x_bias, rowscale, prenorm, residual_in_fp32, ret_mask, is_rms):
    _check(x, residual, weight, bias, x_bias, p, eps, rowscale, is_rms)
    args = (x, residual, weight, bias, x_bias, p, eps, is_rms, bool(residual_in_fp32))
    if x.is_cuda:
        y, r, mask = _cuda_call(*args)[:3]
    else:
        y, r, mask = _torch_call(*args)
    out = (y, r) if prenorm else (y,)
    if ret_mask:
        if mask.numel() == 0:  # p = 0: nothing was drawn, all kept
            from .reference import pack_mask

            mask = pack_mask(torch.ones(x.shape, dtype=torch.bool, device=x.device))
        out += (mask,)
    return out[0] if len(out) == 1 else out


def dropout_add_layer_norm(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    p: float,
    eps: float = 1e-5,
    *,
    x_bias: Optional[Tensor] = None,
    rowscale: Optional[Tensor] = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    return_dropout_mask: bool = False,
):
    """y = layer_norm(r) * weight + bias with r = dropout(x + x_bias, p) + residual, fused.

    Args:
        x: [..., N], fp32 / fp16 / bf16, CUDA (our kernels) or CPU (torch's math).
        residual: x's shape, fp32 / fp16 / bf16, or None (r = dropout(x + x_bias)).
        weight, bias: [N] (any float dtype each) or None.
        p: drop probability, 0 <= p < 1 (on CUDA resolved to a multiple of 2^-16; the mask is
            drawn from torch's default CUDA generator: ``torch.manual_seed`` reproduces it).
        x_bias: [N] added to x before the dropout, or None.
        rowscale: not supported (raises ``NotImplementedError``).
        prenorm: also return r.
        residual_in_fp32: without a residual, r in fp32 (with one, r has the residual's dtype).
        return_dropout_mask: also return the keep mask as bits, uint8 [..., ceil(N / 8)]
            (bit j of byte b keeps column 8 b + j; ``ops.dropout_bias_forward``'s format).

    Returns:
        y (x's dtype), then r with ``prenorm``, then the mask with ``return_dropout_mask``.
    """
    return _dropout_add_norm(
        x, residual, weight, bias, p, eps, x_bias, rowscale, prenorm, residual_in_fp32, return_dropout_mask, False
    )


def dropout_add_rms_norm(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    p: float,
    eps: float = 1e-6,
    *,
    x_bias: Optional[Tensor] = None,
    rowscale: Optional[Tensor] = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    return_dropout_mask: bool = False,
):
    """``dropout_add_layer_norm`` with RMSNorm: y = rms_norm(r) * weight; ``bias`` must be None."""
    return _dropout_add_norm(
        x, residual, weight, bias, p, eps, x_bias, rowscale, prenorm, residual_in_fp32, return_dropout_mask, True
    )


class DropoutAddLayerNorm(torch.nn.Module):
    """``forward(x, residual=None)``: ``dropout_add_layer_norm`` with this module's weight and bias;
    p applies in training mode only."""

    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-5, residual_in_fp32=False, device=None, dtype=None):
        super().__init__()
        check_probability("p", p)
        self.prenorm, self.p, self.eps, self.residual_in_fp32 = prenorm, p, eps, residual_in_fp32
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        p = self.p if self.training else 0.0
        return dropout_add_layer_norm(
            x,
            residual,
            self.weight,
            self.bias,
            p,
            self.eps,
            prenorm=self.prenorm,
            residual_in_fp32=self.residual_in_fp32,
        )

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, p={self.p}, eps={self.eps}, prenorm={self.prenorm}"


class DropoutAddRMSNorm(torch.nn.Module):
    """``forward(x, residual=None)``: ``dropout_add_rms_norm`` with this module's weight; p applies
    in training mode only."""

    def __init__(self, hidden_size, prenorm=False, p=0.0, eps=1e-6, residual_in_fp32=False, device=None, dtype=None):
        super().__init__()
        check_probability("p", p)
        self.prenorm, self.p, self.eps, self.residual_in_fp32 = prenorm, p, eps, residual_in_fp32
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        p = self.p if self.training else 0.0
        return dropout_add_rms_norm(
            x, residual, self.weight, None, p, self.eps, prenorm=self.prenorm, residual_in_fp32=self.residual_in_fp32
        )

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, p={self.p}, eps={self.eps}, prenorm={self.prenorm}"


__all__ = ["DropoutAddLayerNorm", "DropoutAddRMSNorm", "dropout_add_layer_norm", "dropout_add_rms_norm"]
