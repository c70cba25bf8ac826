"""Torch face of the LayerNorm / RMSNorm forward kernel (``cute_kernels.layer_norm.LnFwd``).

``unsupported(x, weight, bias)`` says why the kernel cannot take a call (None: it can);
``forward(x, weight, bias, eps, is_rms)`` runs it and returns y (x's dtype and shape,
contiguous) with the statistics the backward reads: mean (LayerNorm; an empty tensor for
RMSNorm) and rstd in fp32 of shape x.shape[:-1], as torch's ``native_layer_norm`` /
``_fused_rms_norm`` save them less their trailing 1. ``ops.norm``'s autograd ops call it and
run torch's forward where ``unsupported`` gives a reason.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from cute_kernels.layer_norm import config as ln_config
from layouts import layer_norm as tiling

from . import _compile as cc
from ._memo import Memo
from ._validate import rows_view

SUPPORTED_ARCH_MAJORS = (8, 9)  # built and tested for sm_80 (no clusters) and sm_90a


def _build(dtype, w_dtype, b_dtype, tiles, is_rms, arch, fuse=None, rng_on_device=False):
    """The forward kernel; ``fuse`` (a ``DropoutAdd``) adds the dropout + residual add in front
    (``ops.dropout_add_norm``), its Philox seed and offset on the device with ``rng_on_device``."""
    import cutlass
    import cutlass.cute as cute

    from cute_kernels.layer_norm import LnFwd

    vec = tiles.vec
    rows, n = cute.sym_int(), cute.sym_int()
    f32 = cutlass.Float32
    rows_n = lambda dt: cc.fake_tensor(dt, (rows, n), vec)  # noqa: E731
    res = r = xb = mask = seed = offset = None
    if fuse is not None:
        res = None if fuse.res_dtype is None else rows_n(fuse.res_dtype)
        xb = None if fuse.xb_dtype is None else cc.fake_tensor(fuse.xb_dtype, (n,), vec)
        r = rows_n(fuse.r_dtype)
        if fuse.dropout:
            mask = cc.fake_tensor(cutlass.Uint8, (rows, cute.sym_int()), 1)
            seed, offset, _, _, _ = cc.fake_rng_args(rng_on_device)
    return cc.compile_kernel(
        LnFwd(dtype, w_dtype, b_dtype, tiles, is_rms, fuse),
        rows_n(dtype),  # x
        cc.fake_tensor(w_dtype, (n,), vec) if w_dtype is not None else None,  # gamma
        cc.fake_tensor(b_dtype, (n,), vec) if b_dtype is not None else None,  # beta
        rows_n(dtype),  # y
        None if is_rms else cc.fake_tensor(f32, (rows,), 1),  # mean
        cc.fake_tensor(f32, (rows,), 1),  # rstd
        f32(1e-5),  # eps
        cutlass.Int32(1),  # ctas_per_col
        res,
        xb,
        r,
        mask,
        seed,
        offset,
        cutlass.Int32(0),  # threshold
        f32(1.0),  # 1 / (1 - p)
        cc.fake_stream(),
        arch=arch,
    )


compiled = cc.CompileCache("ln_fwd", _build)


def _arch_major(arch: str) -> int:
    """8 for sm_80 / sm_86 / sm_89, 9 for sm_90a, 10 for sm_100a, 12 for sm_120a."""
    return int(arch[3:].rstrip("af")) // 10


def _param_bits(weight, bias) -> int:
    return sum(8 * t.element_size() for t in (weight, bias) if t is not None)


_verdicts = Memo()  # unsupported's answers, by what they depend on


def unsupported(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], arch: Optional[str] = None
) -> Optional[str]:
    """Why the forward kernel cannot take this call (None: it can). No CUDA call for CPU, meta
    or fake tensors: they get the reason of their missing arch unless ``arch`` is given."""
    arch = arch or cc.tensor_arch(x)
    if arch is None:
        return f"x is on {x.device} (no CUDA arch known)"
    key = (
        arch,
        x.dtype,
        x.shape[-1] if x.dim() else None,
        None if weight is None else weight.dtype,
        None if bias is None else bias.dtype,
    )
    reason = _verdicts.get(key, False)
    if reason is False:
        reason = _verdicts.put(key, _unsupported(x, weight, bias, arch))
    return reason


def _unsupported(x, weight, bias, arch) -> Optional[str]:
    if _arch_major(arch) not in SUPPORTED_ARCH_MAJORS:
        return f"built for sm_80 / sm_90, the device is {arch}"
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and t.dtype not in cc.FLOAT_DTYPES:
            return f"{name} dtype {t.dtype} (fp32 / fp16 / bf16 only)"
    if x.dim() < 1 or x.shape[-1] < 1:
        return "no last dimension to normalise (N = 0)"
    n = x.shape[-1]
    try:
        ln_config.ln_fwd_tiles(n, 8 * x.element_size(), _param_bits(weight, bias), 1, arch)
    except NotImplementedError as e:
        return str(e)
    return None


def _rows(x: Tensor) -> Tensor:
    """x as [rows, N] without a copy where its strides allow, else a contiguous copy."""
    try:
        return rows_view("x", x)
    except ValueError:
        return rows_view("x", x.contiguous())


def _vec(xs: Tensor, weight, bias) -> int:
    """The widest vector x allows, narrowed until gamma and beta (read as vec-element chunks) allow it too."""
    return cc.narrow_vector_for_params(cc.max_vector_elems(tiling.MAX_VECTOR_BITS, (xs, xs.shape[1])), weight, bias)


class _Plan:
    """What a call's metadata decides: the tiles' grid and the compiled function."""

    __slots__ = ("fn", "ctas_per_col")

    def __init__(self, xs, weight, bias, is_rms):
        rows, n = xs.shape
        dev = xs.device.index
        arch = cc.device_arch(dev)
        dt = cc.cute_dtype(xs.dtype)
        w_dt, b_dt = (None if t is None else cc.cute_dtype(t.dtype) for t in (weight, bias))
        t = ln_config.ln_fwd_tiles(n, dt.width, _param_bits(weight, bias), _vec(xs, weight, bias), arch)
        self.ctas_per_col = ln_config.ctas_per_col(rows, t, cc.num_sms(dev))
        self.fn = compiled(dt, w_dt, b_dt, t, is_rms, arch)


_plans = Memo()


def _plan(xs, weight, bias, is_rms) -> _Plan:
    key = (
        xs.shape,
        xs.stride(),
        xs.dtype,
        xs.device,
        is_rms,
        # a vector of 8 fp32 parameters is 32 bytes: their addresses' low 5 bits matter
        None if weight is None else (weight.dtype, weight.data_ptr() & 31),
        None if bias is None else (bias.dtype, bias.data_ptr() & 31),
        xs.data_ptr() & 15,
    )
    plan = _plans.get(key)
    if plan is None:
        plan = _plans.put(key, _Plan(xs, weight, bias, is_rms))
    return plan


def _shaped(t: Tensor, shape) -> Tensor:
    """``t`` viewed as ``shape``, itself where it has it (a view costs microseconds a call)."""
    return t if t.shape == shape else t.view(shape)


def launch(x: Tensor, weight, bias, eps: float, is_rms: bool, y: Tensor, mean: Optional[Tensor], rstd: Tensor) -> None:
    """Run the kernel into preallocated y (x's shape and dtype, contiguous), mean (None for
    RMSNorm) and rstd (fp32, x.shape[:-1], contiguous)."""
    if x.numel() == 0:
        return
    if weight is not None and weight.stride(0) != 1:
        weight = weight.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    xs = _rows(x)
    rows, n = xs.shape
    plan = _plan(xs, weight, bias, is_rms)
    mu = None if mean is None else _shaped(mean, (rows,))
    plan.fn(
        xs, weight, bias, _shaped(y, (rows, n)), mu, _shaped(rstd, (rows,)), eps, plan.ctas_per_col,
        None, None, None, None, None, None, 0, 1.0,
    )  # fmt: skip


def forward(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, is_rms: bool, stub_mean: bool = True
) -> Tuple[Tensor, ...]:
    """(y, mean, rstd) of x [..., N] over N (``unsupported`` first: None); RMSNorm's mean an empty
    tensor with ``stub_mean``, else None."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    if is_rms:
        mean = x.new_empty((0,), dtype=torch.float32) if stub_mean else None
    else:
        mean = torch.empty_like(rstd)
    launch(x, weight, bias, eps, is_rms, y, None if is_rms else mean, rstd)
    return y, mean, rstd
