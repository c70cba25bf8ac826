"""Torch face of the fused dropout + bias (+ activation) kernels.

``dropout_bias_backward`` is the backward kernel as a registered custom op (a byte mask, or
the forward's bit mask with ``mask_bits=True``); ``bias_dropout`` is the training op
y = dropout(act(x + bias)) whose forward (``ops.dropout_bias_forward``: the keep mask drawn on
the device and kept as bits) and backward are our kernels on CUDA; ``BiasDropout`` wraps it as
a module.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from cute_kernels.common.activation import ACTIVATIONS
from cute_kernels.dropout_bias import config as dropout_bias_config
from layouts import dropout_bias as tiling

from . import _compile as cc
from ._memo import Memo
from .dropout_bias_forward import bias_dropout_forward, mask_bytes
from ._validate import (
    check_cuda,
    check_dtype,
    check_int,
    check_probability,
    check_same_device,
    check_shape,
    check_tensor,
    rows_view,
    validate_once,
)

_MAX_VECTOR_BITS = tiling.MAX_VECTOR_BITS


def _build(dtype, dbias_dtype, activation, vec, arch, mask_bits=False):
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.dropout_bias import DropoutBiasBwd

    t = dropout_bias_config.tiles(dtype.width, vec, arch)
    rows, n, chunks = cute.sym_int(), cute.sym_int(), cute.sym_int()
    with_act = activation is not None
    return cc.compile_kernel(
        DropoutBiasBwd(dtype, dbias_dtype, activation, t, mask_bits),
        cc.fake_tensor(dtype, (rows, n), vec),  # dY
        cc.fake_tensor(cutlass.Uint8, (rows, cute.sym_int()) if mask_bits else (rows, n), 1 if mask_bits else vec),
        cc.fake_tensor(dtype, (rows, n), vec) if with_act else None,  # x
        cc.fake_tensor(dtype, (n,), vec) if with_act else None,  # bias
        cc.fake_tensor(dtype, (rows, n), vec),  # dX
        cc.fake_tensor(cutlass.Float32, (chunks, n), 1),  # partials
        cc.fake_tensor(cutlass.Int32, (cute.sym_int(),), 1),  # ticket counters
        cc.fake_tensor(dbias_dtype, (n,), 1),  # dBias
        cutlass.Float32(1.0),
        cutlass.Int32(1),
        cc.fake_stream(),
        arch=arch,
    )


compiled = cc.CompileCache("dropout_bias_bwd", _build)


def _validate(grad_out, mask, p, x, bias, activation, mask_bits=False):
    check_cuda("grad_out", grad_out)
    check_dtype("grad_out", grad_out, cc.FLOAT_DTYPES)
    if grad_out.dim() < 1:
        raise ValueError("grad_out must have at least one dimension [..., N]")
    if grad_out.shape[-1] < 1:
        raise ValueError("grad_out must have a last dimension N >= 1")
    check_same_device("mask", mask, grad_out)
    if mask_bits:
        check_dtype("mask", mask, (torch.uint8,))
        check_shape("mask", mask, (*grad_out.shape[:-1], mask_bytes(grad_out.shape[-1])))
    else:
        check_dtype("mask", mask, (torch.bool, torch.uint8))
        check_shape("mask", mask, grad_out.shape)
    check_probability("p", p)
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    n = grad_out.shape[-1]
    if activation is not None:
        if x is None or bias is None:
            raise ValueError(f"activation={activation!r} needs the pre-activation input x and bias")
        check_same_device("x", x, grad_out)
        check_shape("x", x, grad_out.shape)
        if x.dtype != grad_out.dtype:
            raise TypeError(f"x must have grad_out's dtype {grad_out.dtype}, got {x.dtype}")
    elif x is not None:
        raise ValueError("x is only used with an activation; pass activation= or drop x")
    for name, t in (("grad_out", grad_out), ("mask", mask), ("x", x)):
        if t is not None:
            rows_view(name, t)  # raises for layouts that cannot be read as [rows, N]
    if bias is not None:
        check_same_device("bias", bias, grad_out)
        check_shape("bias", bias, (n,))
        check_dtype("bias", bias, cc.FLOAT_DTYPES)
        if activation is not None and bias.dtype != grad_out.dtype:
            raise TypeError(f"with an activation, bias must have grad_out's dtype {grad_out.dtype}, got {bias.dtype}")


def _validate_cached(grad_out, mask, p, x, bias, activation, mask_bits):
    """The full checks once per metadata signature; p (a per-call value) every call."""
    validate_once(
        ("dropout_bias", grad_out, mask, x, bias, activation, mask_bits),
        lambda: _validate(grad_out, mask, p, x, bias, activation, mask_bits),
    )
    check_probability("p", p)


def _dbias_dtype(grad_out: Tensor, bias: Optional[Tensor]) -> torch.dtype:
    return bias.dtype if bias is not None else grad_out.dtype


class _Plan:
    """What a call's metadata decides: vector width, grid split, the compiled function."""

    __slots__ = ("rows", "n", "fn", "chunks", "per_chunk", "col_tiles", "plain_views")

    def __init__(self, grad_out, mask, x, bias, activation, grad_in, grad_bias, mask_bits):
        n = grad_out.shape[-1]
        dy = rows_view("grad_out", grad_out)
        m = rows_view("mask", mask)
        dx = rows_view("grad_in", grad_in)
        operands = [(dy, n), (dx, n)] if mask_bits else [(dy, n), (m, n), (dx, n)]  # bits: read a byte at a time
        if activation is not None:
            operands += [(rows_view("x", x), n), (bias.view(1, n), n)]
        vec = cc.max_vector_elems(_MAX_VECTOR_BITS, *operands)
        dev = grad_out.device.index
        arch = cc.device_arch(dev)
        t = dropout_bias_config.tiles(8 * grad_out.element_size(), vec, arch)
        self.rows, self.n = dy.shape
        self.chunks, self.per_chunk = dropout_bias_config.row_chunks(self.rows, n, t, cc.num_sms(dev))
        self.col_tiles = t.col_tiles(n)
        self.fn = compiled(
            cc.cute_dtype(grad_out.dtype), cc.cute_dtype(grad_bias.dtype), activation, vec, arch, mask_bits
        )
        # whether t.view(rows, n) already gives the strides the kernel was planned with
        self.plain_views = all(
            t.view(self.rows, t.shape[-1]).stride() == v.stride() for t, v in ((grad_out, dy), (mask, m), (grad_in, dx))
        ) and (x is None or x.view(self.rows, n).stride() == rows_view("x", x).stride())


_plans = Memo()


def _plan(grad_out, mask, x, bias, activation, grad_in, grad_bias, mask_bits) -> _Plan:
    """Plans are cached by the metadata they depend on: a repeated call is a dict lookup."""
    key = (
        grad_out.shape,
        grad_out.stride(),
        grad_out.dtype,
        grad_out.device,
        mask.stride(),
        grad_in.stride(),
        grad_bias.dtype,
        activation,
        None if x is None else x.stride(),
        None if bias is None else bias.stride(),
        grad_out.data_ptr() & 15,
        mask.data_ptr() & 15,
        grad_in.data_ptr() & 15,
        0 if x is None else x.data_ptr() & 15,
        0 if bias is None else bias.data_ptr() & 15,
        mask_bits,
    )
    plan = _plans.get(key)
    if plan is None:
        plan = _plans.put(key, _Plan(grad_out, mask, x, bias, activation, grad_in, grad_bias, mask_bits))
    return plan


def launch(
    grad_out: Tensor,
    mask: Tensor,
    p: float,
    x: Optional[Tensor],
    bias: Optional[Tensor],
    activation: Optional[str],
    grad_in: Tensor,
    grad_bias: Tensor,
    mask_bits: bool = False,
) -> None:
    """Run the kernel into preallocated grad_in (grad_out's shape) and grad_bias ([N]); the mask
    is bytes of grad_out's shape, or with ``mask_bits`` the forward's [..., ceil(N / 8)] bits."""
    if grad_out.numel() == 0:
        grad_bias.zero_()
        return
    if mask.dtype != torch.uint8:
        mask = mask.view(torch.uint8)
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    plan = _plan(grad_out, mask, x, bias, activation, grad_in, grad_bias, mask_bits)
    shape = (plan.rows, plan.n)
    if plan.plain_views:
        dy, m, dx = grad_out.view(shape), mask.view(plan.rows, mask.shape[-1]), grad_in.view(shape)
        xs = None if x is None else x.view(shape)
    else:
        dy, m, dx = rows_view("grad_out", grad_out), rows_view("mask", mask), rows_view("grad_in", grad_in)
        xs = None if x is None else rows_view("x", x)
    partials = torch.empty((plan.chunks, plan.n), dtype=torch.float32, device=grad_out.device)
    counters = cc.ticket_counters(grad_out.device, plan.col_tiles)
    plan.fn(
        dy,
        m,
        xs,
        bias if activation is not None else None,
        dx,
        partials,
        counters,
        grad_bias,
        1.0 / (1.0 - p),
        plan.per_chunk,
    )


def _dropout_bias_backward_impl(grad_out, mask, p, x, bias, activation, mask_bits=False):
    grad_in = torch.empty_like(grad_out, memory_format=torch.contiguous_format)
    grad_bias = torch.empty(grad_out.shape[-1], dtype=_dbias_dtype(grad_out, bias), device=grad_out.device)
    launch(grad_out, mask, p, x, bias, activation, grad_in, grad_bias, mask_bits)
    return grad_in, grad_bias


@torch.library.custom_op("cute_kernels::dropout_bias_backward", mutates_args=(), device_types="cuda")
def _dropout_bias_backward(
    grad_out: Tensor,
    mask: Tensor,
    p: float,
    x: Optional[Tensor],
    bias: Optional[Tensor],
    activation: Optional[str],
    mask_bits: bool = False,
) -> Tuple[Tensor, Tensor]:
    return _dropout_bias_backward_impl(grad_out, mask, p, x, bias, activation, mask_bits)


@_dropout_bias_backward.register_fake
def _(grad_out, mask, p, x, bias, activation, mask_bits=False):
    n = grad_out.shape[-1]
    return (
        torch.empty_like(grad_out, memory_format=torch.contiguous_format),
        grad_out.new_empty((n,), dtype=_dbias_dtype(grad_out, bias)),
    )


def dropout_bias_backward(
    grad_out: Tensor,
    mask: Tensor,
    p: float,
    x: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
    mask_bits: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Gradients of y = dropout(act(x + bias)) with a saved keep-mask.

    Args:
        grad_out: dY, [..., N], fp32/fp16/bf16, CUDA: any number of leading dims, read as
            rows of N (a 1-D dY is one row), as torch's ops flatten them.
        mask: keep-mask of dY's shape, bool or uint8 (nonzero = kept); with ``mask_bits``, uint8
            [..., ceil(N / 8)] of 8 keep bits a byte (bit j of byte b: column 8 b + j), as
            ``ops.dropout_bias_forward`` returns it.
        p: the drop probability used in the forward, 0 <= p < 1.
        x: the pre-activation input (activation only), dY's shape and dtype.
        bias: [N]; required with an activation, otherwise it only sets grad_bias's dtype.
        activation: None, "relu", "gelu" (tanh approximation) or "gelu_erf".

    Returns:
        (grad_in, grad_bias): dX = dY * mask / (1 - p) [* act'(x + bias)], of dY's
        shape and dtype; dBias = dX summed over all leading dims, accumulated in fp32,
        in bias's dtype (dY's without bias). Deterministic.
    """
    _validate_cached(grad_out, mask, p, x, bias, activation, mask_bits)
    if cc.eager(grad_out):
        return _dropout_bias_backward_impl(grad_out, mask, float(p), x, bias, activation, mask_bits)
    return _dropout_bias_backward(grad_out, mask, float(p), x, bias, activation, mask_bits)


# --- the training op: both directions through the kernels -------------------------


def _act_forward(z: Tensor, activation: Optional[str]) -> Tensor:
    if activation is None:
        return z
    if activation == "relu":
        return torch.relu(z)
    if activation == "gelu":
        return torch.nn.functional.gelu(z, approximate="tanh")
    return torch.nn.functional.gelu(z)


@torch.library.custom_op("cute_kernels::bias_dropout_forward", mutates_args=(), device_types="cuda")
def _bias_dropout_forward(x: Tensor, bias: Tensor, p: float, activation: Optional[str]) -> Tuple[Tensor, Tensor]:
    return bias_dropout_forward(x, bias, p, activation)


@_bias_dropout_forward.register_fake
def _(x, bias, p, activation):
    mask = x.new_empty((*x.shape[:-1], mask_bytes(x.shape[-1])), dtype=torch.uint8)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), mask


def _bias_dropout_setup(ctx, inputs, output):
    x, bias, p, activation = inputs
    _, mask = output
    ctx.p = p
    ctx.activation = activation
    ctx.bias_dtype = bias.dtype
    if activation is None:
        ctx.save_for_backward(mask)
    else:
        ctx.save_for_backward(mask, x, bias)


def _bias_dropout_backward(ctx, grad_y, grad_mask):
    del grad_mask
    if ctx.activation is None:
        (mask,) = ctx.saved_tensors
        x = bias = None
    else:
        mask, x, bias = ctx.saved_tensors
        x = x.contiguous()  # the forward takes any layout of x; the kernel reads rows
    # dY arriving from autograd may be any view: the kernel wants rows it can flatten.
    grad_y = grad_y.contiguous()
    if cc.eager(grad_y):
        grad_x, grad_bias = _dropout_bias_backward_impl(grad_y, mask, ctx.p, x, bias, ctx.activation, True)
    else:
        grad_x, grad_bias = _dropout_bias_backward(grad_y, mask, ctx.p, x, bias, ctx.activation, True)
    return grad_x, grad_bias.to(ctx.bias_dtype), None, None


torch.library.register_autograd(
    "cute_kernels::bias_dropout_forward", _bias_dropout_backward, setup_context=_bias_dropout_setup
)


def _check_forward(x, bias, p, activation) -> None:
    check_tensor("x", x)
    check_dtype("x", x, cc.FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., N]")
    check_same_device("bias", bias, x)
    if tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"bias must have shape ({x.shape[-1]},) (x's last dim), got {tuple(bias.shape)}")
    check_probability("p", p)
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    if bias.dtype != x.dtype:
        raise TypeError(f"bias must have x's dtype {x.dtype}, got {bias.dtype}")


def dropout_bias_forward(x: Tensor, bias: Tensor, p: float, activation: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """y = dropout(act(x + bias), p) and its keep mask as bits, our kernel (no autograd).

    Args:
        x: [..., N], fp32/fp16/bf16, CUDA (any layout; rows it cannot view are copied).
        bias: [N], x's dtype.
        p: drop probability, 0 <= p < 1, resolved to a multiple of 2^-16.
        activation: None, "relu", "gelu" (tanh approximation) or "gelu_erf".

    Returns:
        (y, mask): y of x's shape and dtype; mask uint8 [..., ceil(N / 8)], bit j of byte b set
        where column 8 b + j is kept (bits past N zero), what ``dropout_bias_backward(...,
        mask_bits=True)`` reads. The bits are drawn from torch's default CUDA generator
        (``torch.manual_seed`` reproduces them; a call advances its offset by 4), also under
        CUDA-graph capture, where every replay draws new ones.
    """
    check_cuda("x", x)
    _check_forward(x, bias, p, activation)
    return _bias_dropout_forward(x, bias, float(p), activation)


def bias_dropout(
    x: Tensor,
    bias: Tensor,
    p: float,
    activation: Optional[str] = None,
    training: bool = True,
) -> Tensor:
    """y = dropout(act(x + bias), p) over x's last dim N (any leading dims, a 1-D x one row).

    In training on CUDA tensors both directions run our fused kernels (the keep mask drawn from
    torch's default CUDA generator and saved as bits: ``dropout_bias_forward``); on other
    devices this is torch's own math (``torch.nn.functional.dropout``), so the module moves like
    any other."""
    _check_forward(x, bias, p, activation)
    if not training:
        return _act_forward(x + bias, activation)
    if x.device.type != "cuda":
        return torch.nn.functional.dropout(_act_forward(x + bias, activation), float(p))
    y, _ = _bias_dropout_forward(x, bias, float(p), activation)
    return y


class BiasDropout(torch.nn.Module):
    """``dropout(act(x + bias))`` with a learnt bias of size ``features``: our forward and
    backward on CUDA tensors, torch's math elsewhere (as ``ops.LayerNorm`` / ``ops.RMSNorm``)."""

    def __init__(self, features: int, p: float = 0.1, activation: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        check_int("features", features)
        check_probability("p", p)
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
        self.p = p
        self.activation = activation
        self.bias = torch.nn.Parameter(torch.zeros(features, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return bias_dropout(x, self.bias, self.p, self.activation, self.training)

    def extra_repr(self) -> str:
        return f"features={self.bias.numel()}, p={self.p}, activation={self.activation}"
