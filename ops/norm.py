"""Torch face of the LayerNorm / RMSNorm: the backward's kernels, the autograd ops, the modules.

``layer_norm_backward`` / ``rms_norm_backward`` are the backward kernels as registered
custom ops; ``layer_norm`` / ``rms_norm`` are autograd ops (the custom op
``cute_kernels::norm_forward``, whose backward is ours) whose forward is our kernel
(``ops.norm_forward``) where ``forward_unsupported`` finds no reason against it, else
torch's (``aten.native_layer_norm`` / ``aten._fused_rms_norm``, or their math in fp32 for
mixed dtypes), the reason logged at DEBUG on ``cute_kernels.norm``. Both return the
statistics the backward reads. ``LayerNorm`` / ``RMSNorm`` are drop-in subclasses of
``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` (same parameters, same state_dict keys).
"""

from __future__ import annotations

import logging
import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from cute_kernels.layer_norm import config as ln_config
from layouts import layer_norm as tiling

from . import _compile as cc
from . import norm_forward
from ._memo import Memo
from ._validate import check_cuda, check_dtype, check_float, check_same_device, check_tensor, rows_view, validate_once

_MAX_VECTOR_BITS = tiling.MAX_VECTOR_BITS
log = logging.getLogger("cute_kernels.norm")  # which forward each call runs (DEBUG)


def _build(in_dtype, out_dtype, w_dtype, tiles, is_rms, has_gamma, has_dbeta, arch, fuse=None):
    """The backward row kernel; ``fuse`` (a ``DropoutAdd``) adds the dropout + residual add's
    gradients (``ops.dropout_add_norm``)."""
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.layer_norm import LnBwd

    vec = tiles.vec
    rows, n, ctas = cute.sym_int(), cute.sym_int(), cute.sym_int()
    f32 = cutlass.Float32
    rows_n = lambda dt: cc.fake_tensor(dt, (rows, n), vec)  # noqa: E731
    dr_in = mask = dres = dxb = None
    dx_dtype = in_dtype
    if fuse is not None:
        dx_dtype = fuse.x_dtype
        dr_in = None if fuse.dr_dtype is None else rows_n(fuse.dr_dtype)
        mask = cc.fake_tensor(cutlass.Uint8, (rows, cute.sym_int()), 1) if fuse.dropout else None
        dres = None if fuse.res_dtype is None else rows_n(fuse.res_dtype)
        dxb = None if fuse.xb_dtype is None else cc.fake_tensor(f32, (ctas, n), vec)
    return cc.compile_kernel(
        LnBwd(in_dtype, out_dtype, w_dtype, tiles, is_rms, has_gamma, has_dbeta, fuse),
        rows_n(in_dtype),  # x
        rows_n(out_dtype),  # dz
        cc.fake_tensor(w_dtype, (n,), vec) if has_gamma else None,  # gamma
        None if is_rms else cc.fake_tensor(f32, (rows,), 1),  # mean
        cc.fake_tensor(f32, (rows,), 1),  # rstd
        rows_n(dx_dtype),  # dx
        cc.fake_tensor(f32, (ctas, n), vec) if has_gamma else None,  # dgamma partials
        cc.fake_tensor(f32, (ctas, n), vec) if has_dbeta else None,  # dbeta partials
        cutlass.Int32(1),
        dr_in,
        mask,
        dres,
        dxb,  # dx_bias partials
        f32(1.0),  # 1 / (1 - p)
        cc.fake_stream(),
        arch=arch,
    )


def _build_finalize(w_dtype, b_dtype, ftiles, has_gamma, has_beta, arch, xb_dtype=None):
    """The fold of the column partials; ``xb_dtype``: also dx_bias's, into that dtype."""
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.layer_norm import LnBwdFinalize

    ctas, n = cute.sym_int(), cute.sym_int()
    vec = ftiles.vec
    f32 = cutlass.Float32
    has_xbias = xb_dtype is not None
    return cc.compile_kernel(
        LnBwdFinalize(ftiles, has_gamma, has_beta, has_xbias),
        cc.fake_tensor(f32, (ctas, n), vec) if has_gamma else None,
        cc.fake_tensor(f32, (ctas, n), vec) if has_beta else None,
        cc.fake_tensor(w_dtype, (n,), 1) if has_gamma else None,
        cc.fake_tensor(b_dtype, (n,), 1) if has_beta else None,
        cc.fake_tensor(f32, (ctas, n), vec) if has_xbias else None,
        cc.fake_tensor(xb_dtype, (n,), 1) if has_xbias else None,
        cc.fake_stream(),
        arch=arch,
    )


compiled = cc.CompileCache("ln_bwd", _build)
compiled_finalize = cc.CompileCache("ln_bwd_finalize", _build_finalize)


def stat_view(name: str, s: Tensor, rows: int) -> Tensor:
    """mean / rstd as a contiguous fp32 [rows] vector (aten keeps a trailing 1)."""
    if s.numel() != rows:
        raise ValueError(f"{name} must have one value per row ({rows}), got shape {tuple(s.shape)}")
    v = s if s.dim() == 1 else s.reshape(rows)
    return v if v.stride(0) == 1 or rows <= 1 else v.contiguous()


def _validate(grad_out, x, weight, mean, rstd, bias):
    check_cuda("x", x)
    check_dtype("x", x, cc.FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., N]")
    n = x.shape[-1]
    if n < 1:
        raise ValueError("x must have a last dimension N >= 1")
    check_same_device("grad_out", grad_out, x)
    check_dtype("grad_out", grad_out, cc.FLOAT_DTYPES)
    if tuple(grad_out.shape) != tuple(x.shape):
        raise ValueError(f"grad_out must have x's shape {tuple(x.shape)}, got {tuple(grad_out.shape)}")
    rows = x.numel() // n
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_same_device(name, t, x)
            check_dtype(name, t, cc.FLOAT_DTYPES)
            if tuple(t.shape) != (n,):
                raise ValueError(f"{name} must have shape ({n},) (x's last dim), got {tuple(t.shape)}")
    for name, s in (("mean", mean), ("rstd", rstd)):
        if s is None:
            continue
        check_same_device(name, s, x)
        if s.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (the forward's statistics), got {s.dtype}")
        stat_view(name, s, rows)
    for name, t in (("x", x), ("grad_out", grad_out)):
        rows_view(name, t)


def _validate_cached(grad_out, x, weight, mean, rstd, bias, is_rms):
    for name, t in (("grad_out", grad_out), ("x", x), ("rstd", rstd)):
        check_tensor(name, t)
    if not is_rms:
        check_tensor("mean", mean)
    validate_once(
        ("ln_bwd", grad_out, x, weight, mean, rstd, bias), lambda: _validate(grad_out, x, weight, mean, rstd, bias)
    )


class _Plan:
    """What a call's metadata decides: tiles, grid, the compiled functions."""

    __slots__ = ("rows", "n", "fn", "finalize", "ctas_per_col")

    def __init__(self, grad_out, x, weight, bias, is_rms, dx):
        n = x.shape[-1]
        xs, dzs, dxs = rows_view("x", x), rows_view("grad_out", grad_out), rows_view("grad_in", dx)
        # the weight is read as vec-element chunks too
        vec = cc.narrow_vector_for_params(cc.max_vector_elems(_MAX_VECTOR_BITS, (xs, n), (dzs, n), (dxs, n)), weight)
        dev = x.device.index
        arch = cc.device_arch(dev)
        has_gamma, has_dbeta = weight is not None, bias is not None
        in_dt, out_dt = cc.cute_dtype(x.dtype), cc.cute_dtype(grad_out.dtype)
        w_dt = cc.cute_dtype(weight.dtype if has_gamma else x.dtype)
        t = ln_config.ln_bwd_tiles(
            n, in_dt.width, out_dt.width, w_dt.width, vec, arch, num_partials=max(1, int(has_gamma) + int(has_dbeta))
        )
        self.rows, self.n = xs.shape
        self.ctas_per_col = ln_config.ctas_per_col(self.rows, t, cc.num_sms(dev))
        self.fn = compiled(in_dt, out_dt, w_dt, t, is_rms, has_gamma, has_dbeta, arch)
        self.finalize = None
        if has_gamma or has_dbeta:
            b_dt = cc.cute_dtype(bias.dtype if has_dbeta else x.dtype)
            self.finalize = compiled_finalize(w_dt, b_dt, ln_config.finalize_tiles(n), has_gamma, has_dbeta, arch)


_plans = Memo()


def _plan(grad_out, x, weight, bias, is_rms, dx) -> _Plan:
    key = (
        x.shape,
        x.stride(),
        x.dtype,
        x.device,
        grad_out.stride(),
        grad_out.dtype,
        dx.stride(),
        is_rms,
        None if weight is None else (weight.dtype, weight.data_ptr() & 15),
        None if bias is None else bias.dtype,
        x.data_ptr() & 15,
        grad_out.data_ptr() & 15,
        dx.data_ptr() & 15,
    )
    plan = _plans.get(key)
    if plan is None:
        plan = _plans.put(key, _Plan(grad_out, x, weight, bias, is_rms, dx))
    return plan


def launch(grad_out, x, weight, mean, rstd, bias, is_rms, dx, dweight, dbias) -> None:
    """Run the kernels into preallocated dx (x's shape), dweight and dbias ([N] or None)."""
    if x.numel() == 0:
        for g in (dweight, dbias):
            if g is not None:
                g.zero_()
        return
    if weight is not None and weight.stride(0) != 1:
        weight = weight.contiguous()
    plan = _plan(grad_out, x, weight, bias, is_rms, dx)
    rows, n = plan.rows, plan.n
    xs, dzs, dxs = rows_view("x", x), rows_view("grad_out", grad_out), rows_view("grad_in", dx)
    rs = stat_view("rstd", rstd, rows)
    mu = None if is_rms else stat_view("mean", mean, rows)
    part_g = part_b = None
    if weight is not None:
        part_g = torch.empty((plan.ctas_per_col, n), dtype=torch.float32, device=x.device)
    if bias is not None:
        part_b = torch.empty((plan.ctas_per_col, n), dtype=torch.float32, device=x.device)
    plan.fn(xs, dzs, weight, mu, rs, dxs, part_g, part_b, plan.ctas_per_col, None, None, None, None, 1.0)
    if plan.finalize is not None:
        plan.finalize(part_g, part_b, dweight, dbias, None, None)


def _outputs(grad_out, x, weight, bias, stub=True):
    """dx, dweight, dbias: dx contiguous in x's shape and dtype, dweight / dbias as the (checked:
    [N], on x's device) weight / bias. An absent gradient is an empty tensor with ``stub`` (the
    custom op returns tensors), else None."""
    contiguous = torch.contiguous_format
    dx = torch.empty_like(x, memory_format=contiguous)
    if weight is not None:
        dweight = torch.empty_like(weight, memory_format=contiguous)
    else:
        dweight = x.new_empty((0,)) if stub else None
    if bias is not None:
        dbias = torch.empty_like(bias, memory_format=contiguous)
    else:
        dbias = x.new_empty((0,)) if stub else None
    return dx, dweight, dbias


def _norm_backward_impl(grad_out, x, weight, mean, rstd, bias, is_rms, stub=True):
    dx, dweight, dbias = _outputs(grad_out, x, weight, bias, stub)
    launch(
        grad_out,
        x,
        weight,
        mean,
        rstd,
        bias,
        is_rms,
        dx,
        dweight if weight is not None else None,
        dbias if bias is not None else None,
    )
    return dx, dweight, dbias


@torch.library.custom_op("cute_kernels::norm_backward", mutates_args=(), device_types="cuda")
def _norm_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    mean: Optional[Tensor],
    rstd: Tensor,
    bias: Optional[Tensor],
    is_rms: bool,
) -> Tuple[Tensor, Tensor, Tensor]:
    return _norm_backward_impl(grad_out, x, weight, mean, rstd, bias, is_rms)


@_norm_backward.register_fake
def _(grad_out, x, weight, mean, rstd, bias, is_rms):
    return _outputs(grad_out, x, weight, bias)


def _norm_backward_call(grad_out, x, weight, mean, rstd, bias, is_rms):
    if cc.eager(x):  # absent gradients come back as None
        return _norm_backward_impl(grad_out, x, weight, mean, rstd, bias, is_rms, False)
    dx, dw, db = _norm_backward(grad_out, x, weight, mean, rstd, bias, is_rms)
    return dx, dw if weight is not None else None, db if bias is not None else None


def layer_norm_backward(
    grad_out: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    bias: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Gradients of z = (x - mean) * rstd * weight + bias over the last dim N.

    Args:
        grad_out: dz, x's shape, fp32/fp16/bf16 (may differ from x's dtype).
        x: the forward's input [..., N], fp32/fp16/bf16, CUDA.
        weight: gamma [N] (any float dtype) or None (no affine weight).
        mean, rstd: the forward's fp32 statistics, one per row ([...] or [..., 1]).
        bias: beta [N] or None; only its presence and dtype matter (dbias is wanted).

    Returns:
        (dx, dweight, dbias): dx in x's dtype; dweight / dbias in the weight's / bias's
        dtype, accumulated in fp32, deterministic; None where weight / bias is None.
    """
    _validate_cached(grad_out, x, weight, mean, rstd, bias, False)
    return _norm_backward_call(grad_out, x, weight, mean, rstd, bias, False)


def rms_norm_backward(
    grad_out: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor
) -> Tuple[Tensor, Optional[Tensor]]:
    """Gradients of z = x * rstd * weight over the last dim (``layer_norm_backward`` without the mean)."""
    _validate_cached(grad_out, x, weight, None, rstd, None, True)
    dx, dw, _ = _norm_backward_call(grad_out, x, weight, None, rstd, None, True)
    return dx, dw


# --- the training ops: our forward (torch's where it does not apply), our backward ---


def _stats(x32: Tensor, eps: float, is_rms: bool):
    if is_rms:
        return None, torch.rsqrt(x32.square().mean(-1) + eps)
    var, mean = torch.var_mean(x32, -1, correction=0)
    return mean, torch.rsqrt(var + eps)


def _torch_forward(x, weight, bias, eps, is_rms):
    """torch's forward: aten's kernels where they take the dtypes, else the same math in fp32."""
    n = x.shape[-1]
    same = all(t is None or t.dtype == x.dtype for t in (weight, bias))
    if same and not is_rms:
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, [n], weight, bias, eps)
        if mean.dtype == torch.float32:
            return out.contiguous(), mean.reshape(x.shape[:-1]), rstd.reshape(x.shape[:-1])
    if same and is_rms:
        out, rstd = torch.ops.aten._fused_rms_norm(x, [n], weight, eps)
        if rstd.dtype == torch.float32:
            return out.contiguous(), x.new_empty((0,), dtype=torch.float32), rstd.reshape(x.shape[:-1])
    # mixed dtypes (e.g. bf16 x with fp32 weight): the whole forward in (at least) fp32
    acc = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(acc)
    mean, rstd = _stats(x32, eps, is_rms)
    y = (x32 if mean is None else x32 - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    mean = None if mean is None else mean.float()
    rstd = rstd.float()
    mean = x.new_empty((0,), dtype=torch.float32) if mean is None else mean
    return y.to(x.dtype).contiguous(), mean, rstd


def forward_unsupported(x, weight, bias, arch=None) -> Optional[str]:
    """Why the autograd ops' forward is torch's (None: ours, ``ops.norm_forward``)."""
    return norm_forward.unsupported(x, weight, bias, arch)


def _norm_forward_impl(x, weight, bias, eps, is_rms, stub_mean=True):
    """(y, mean, rstd); RMSNorm's mean (it has none) an empty tensor with ``stub_mean`` (the
    custom op returns tensors), else None where our kernel runs (the eager paths)."""
    reason = norm_forward.unsupported(x, weight, bias)  # (``forward_unsupported``)
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "%s forward: %s",
            "rms_norm" if is_rms else "layer_norm",
            "ours" if reason is None else f"torch's ({reason})",
        )
    if reason is None:
        return norm_forward.forward(x, weight, bias, eps, is_rms, stub_mean)
    return _torch_forward(x, weight, bias, eps, is_rms)


@torch.library.custom_op("cute_kernels::norm_forward", mutates_args=(), device_types="cuda")
def _norm_forward(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, is_rms: bool
) -> Tuple[Tensor, Tensor, Tensor]:
    return _norm_forward_impl(x, weight, bias, eps, is_rms)


@_norm_forward.register_fake
def _(x, weight, bias, eps, is_rms):
    # y is contiguous whatever x's strides (both paths return it so)
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    y = x.new_empty(x.shape)
    return y, x.new_empty((0,), dtype=torch.float32) if is_rms else stats.clone(), stats


def _norm_forward_call(x, weight, bias, eps, is_rms) -> Tensor:
    """y; the custom op (autograd, graphs) unless the call is plain and eager (``cc.eager``): then
    the body itself, or with a gradient wanted ``_NormEager``."""
    if not cc.eager(x):
        return _norm_forward(x, weight, bias, eps, is_rms)[0]
    if torch.is_grad_enabled() and (
        x.requires_grad or (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad)
    ):
        return _NormEager.apply(x, weight, bias, eps, is_rms)[0]
    return _norm_forward_impl(x, weight, bias, eps, is_rms, False)[0]


def _norm_setup(ctx, inputs, output):
    x, weight, bias, eps, is_rms = inputs
    _, mean, rstd = output
    ctx.is_rms = is_rms
    ctx.has_weight = weight is not None
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    # the statistics take no gradient: without materialised zeros for them (two fills a step);
    # the eager path's RMSNorm has no mean (None)
    if mean is None:
        ctx.mark_non_differentiable(rstd)
    else:
        ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)


def _norm_autograd_backward(ctx, grad_y, grad_mean, grad_rstd):
    del grad_mean, grad_rstd
    if grad_y is None:  # (set_materialize_grads(False): y did not reach the loss)
        return None, None, None, None, None
    x, weight, bias, mean, rstd = ctx.saved_tensors
    # dz from autograd may be any view and the forward takes x in any layout: the kernel wants rows it can flatten
    grad_y, x = grad_y.contiguous(), x.contiguous()
    dx, dw, db = _norm_backward_call(grad_y, x, weight, None if ctx.is_rms else mean, rstd, bias, ctx.is_rms)
    return dx, dw, db, None, None


torch.library.register_autograd("cute_kernels::norm_forward", _norm_autograd_backward, setup_context=_norm_setup)


# the op's eager path with a gradient (the body looked up at call time, as the op's is)
_NormEager = cc.eager_autograd(
    "_NormEager", lambda *inputs: _norm_forward_impl(*inputs, False), _norm_setup, _norm_autograd_backward
)


def _flatten_normalized(x: Tensor, normalized_shape: Sequence[int], weight, bias):
    """x [..., *normalized_shape] -> [..., prod]; weight / bias flattened alike. One normalized
    dim (the usual call) reshapes nothing: each reshape would add a view and its backward node
    to a training step's graph."""
    k = len(normalized_shape)
    if tuple(x.shape[x.dim() - k :]) != tuple(normalized_shape) or x.dim() < k:
        raise ValueError(f"x of shape {tuple(x.shape)} does not end with normalized_shape {tuple(normalized_shape)}")
    n = math.prod(normalized_shape)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != tuple(normalized_shape):
            raise ValueError(f"{name} must have shape {tuple(normalized_shape)}, got {tuple(t.shape)}")
    if k == 1:
        return x, weight, bias
    flat = lambda t: None if t is None else t.reshape(n)  # noqa: E731
    return x.reshape(*x.shape[: x.dim() - k], n), flat(weight), flat(bias)


def _normalized_shape(x: Tensor, normalized_shape) -> Tuple[int, ...]:
    """normalized_shape as a tuple of ints; None means x's last dim."""
    if normalized_shape is None:
        return (x.shape[-1],)
    dims = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    if not isinstance(dims, (tuple, list, torch.Size)) or not all(
        isinstance(d, (int, torch.SymInt)) and not isinstance(d, bool) for d in dims
    ):
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    if len(dims) == 0:
        raise ValueError("normalized_shape must have at least one dimension, got ()")
    return tuple(dims)


def _check_norm_inputs(x, weight, bias, eps):
    check_cuda("x", x)
    check_dtype("x", x, cc.FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension [..., N]")
    check_float("eps", eps)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_same_device(name, t, x)
            check_dtype(name, t, cc.FLOAT_DTYPES)


_fronts = Memo()  # layer_norm / rms_norm calls' metadata whose checks passed: whether x is flattened


def _meta(t):
    return None if t is None else (type(t), t.device, t.dtype, t.shape)


def _checked(x, normalized_shape, weight, bias, eps, is_rms):
    """``_front``'s full checks, in the order of the errors they raise."""
    if is_rms:
        check_cuda("x", x)
        check_dtype("x", x, cc.FLOAT_DTYPES)  # before finfo, which would reject an int dtype less clearly
        if eps is None:
            eps = torch.finfo(x.dtype).eps
    _check_norm_inputs(x, weight, bias, eps)
    xf, wf, bf = _flatten_normalized(x, _normalized_shape(x, normalized_shape), weight, bias)
    return xf, wf, bf, float(eps)


def _shape_key(normalized_shape):
    """``normalized_shape`` in a memo key: ints only (a float or bool equal to an int would find
    that int's entry and skip the checks that refuse it); anything else raises TypeError, so the
    call takes the full checks."""
    if type(normalized_shape) is int:
        return normalized_shape
    if type(normalized_shape) in (tuple, list, torch.Size) and all(type(n) is int for n in normalized_shape):
        return tuple(normalized_shape)
    raise TypeError("not a memo key")


def _front(x, normalized_shape, weight, bias, eps, is_rms):
    """(x, weight, bias, eps) of a layer_norm / rms_norm call as the forward takes them: [..., N],
    [N] or None, a float (RMSNorm's None: x's dtype's eps, as torch).

    The checks run in full once per metadata signature (x's, weight's and bias's type, device,
    dtype and shape, and normalized_shape: host time matters), eps's on every call; a trace
    (Dynamo cannot hash) and arguments that are not tensors or not hashable always take them in
    full, which name what is wrong."""
    key = flat = None
    if not torch.compiler.is_compiling():
        try:
            key = (_shape_key(normalized_shape), _meta(x), _meta(weight), _meta(bias))
            flat = _fronts.get(key)
        except (AttributeError, TypeError):
            key = None
    if flat is None:
        out = _checked(x, normalized_shape, weight, bias, eps, is_rms)
        if key is not None:
            _fronts.put(key, out[0] is not x)
        return out
    if eps is None and is_rms:
        eps = torch.finfo(x.dtype).eps
    if type(eps) is not float or eps - eps != 0.0:  # not a finite float: the check (ints pass) says
        check_float("eps", eps)
    if flat:
        x, weight, bias = _flatten_normalized(x, _normalized_shape(x, normalized_shape), weight, bias)
    return x, weight, bias, float(eps)


def layer_norm(
    x: Tensor,
    normalized_shape: Union[int, Sequence[int], None] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
) -> Tensor:
    """``F.layer_norm`` through our forward and backward kernels (torch's forward where ours does
    not apply: ``forward_unsupported``); ``normalized_shape`` defaults to x's last dim."""
    xf, wf, bf, eps = _front(x, normalized_shape, weight, bias, eps, False)
    y = _norm_forward_call(xf, wf, bf, eps, False)
    return y if xf is x else y.reshape(x.shape)


def rms_norm(
    x: Tensor,
    normalized_shape: Union[int, Sequence[int], None] = None,
    weight: Optional[Tensor] = None,
    eps: Optional[float] = None,
) -> Tensor:
    """``F.rms_norm`` through our forward and backward kernels (as ``layer_norm``); ``eps`` None
    means ``torch.finfo(x.dtype).eps`` as torch."""
    xf, wf, _, eps = _front(x, normalized_shape, weight, None, eps, True)
    y = _norm_forward_call(xf, wf, None, eps, True)
    return y if xf is x else y.reshape(x.shape)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` whose forward and backward run our kernels on CUDA tensors."""

    def forward(self, x: Tensor) -> Tensor:
        if not x.is_cuda:
            return super().forward(x)
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose forward and backward run our kernels on CUDA tensors."""

    def forward(self, x: Tensor) -> Tensor:
        if not x.is_cuda:
            return super().forward(x)
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


__all__: List[str] = [
    "LayerNorm",
    "RMSNorm",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
]
