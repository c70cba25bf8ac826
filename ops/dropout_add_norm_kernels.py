"""Launches of the fused dropout + residual add + LayerNorm / RMSNorm: the LayerNorm forward and
backward row kernels with their ``DropoutAdd`` switches (``cute_kernels/layer_norm/dropout_add.py``),
the backward's column partials folded by the finalize kernel (dgamma, dbeta, dx_bias).

``forward`` returns (y, r, mask, mean, rstd); ``backward`` (dx, dresidual, dweight, dbias,
dx_bias). The callers (``ops.dropout_add_norm``) validate; ``unsupported`` says why the kernels
cannot take a call (None: they can).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from cute_kernels.common.philox import keep_threshold
from cute_kernels.layer_norm import config as ln_config
from layouts import layer_norm as tiling

from . import _compile as cc
from . import norm as norm_bwd
from . import norm_forward
from ._memo import Memo
from ._validate import rows_view
from .dropout_bias_forward import PHILOX_WORDS, mask_bytes
from .philox import philox_seed_offset, philox_state_captured


def r_dtype(x: Tensor, residual: Optional[Tensor], residual_in_fp32: bool) -> torch.dtype:
    """r's dtype: the residual's; without one fp32 with ``residual_in_fp32``, else x's."""
    if residual is not None:
        return residual.dtype
    return torch.float32 if residual_in_fp32 else x.dtype


def _bits(*ts) -> int:
    return sum(8 * t.element_size() for t in ts if t is not None)


def _cute(t: Optional[Tensor]):
    return None if t is None else cc.cute_dtype(t.dtype)


def _fuse(x_dtype, res_dtype, r_dt, xb_dtype, dropout: bool, dr_dtype=None):
    from cute_kernels.layer_norm.dropout_add import DropoutAdd

    c = lambda d: None if d is None else cc.cute_dtype(d)  # noqa: E731
    return DropoutAdd(c(x_dtype), c(res_dtype), c(r_dt), c(xb_dtype), dropout, c(dr_dtype))


def _rows(name: str, t: Optional[Tensor]) -> Optional[Tensor]:
    if t is None:
        return None
    try:
        return rows_view(name, t)
    except ValueError:
        return rows_view(name, t.contiguous())


def _contiguous_param(t: Optional[Tensor]) -> Optional[Tensor]:
    return t if t is None or t.stride(0) == 1 else t.contiguous()


_verdicts = Memo()


def unsupported(x: Tensor, residual, weight, bias, x_bias, residual_in_fp32: bool, arch=None) -> Optional[str]:
    """Why the fused kernels cannot take this call (None: they can): the plain forward's
    reasons (arch, N), then the tiles of the fused configuration; remembered by arch, N and
    dtypes (a tensor without an arch is answered afresh: the reason names its device)."""
    arch = arch or cc.tensor_arch(x)
    if arch is None:
        return norm_forward.unsupported(x, weight, bias, arch)
    key = (arch, x.dtype, x.shape[-1] if x.dim() else None, _dtype(residual), _dtype(weight), _dtype(bias))
    key += (_dtype(x_bias),)
    reason = _verdicts.get(key, False)
    if reason is False:
        reason = _verdicts.put(key, _unsupported(x, residual, weight, bias, x_bias, arch))
    return reason


def _unsupported(x, residual, weight, bias, x_bias, arch) -> Optional[str]:
    reason = norm_forward.unsupported(x, weight, bias, arch)
    if reason is not None:
        return reason
    try:
        bits = _bits(residual) if residual is not None else 0
        ln_config.ln_fwd_tiles(x.shape[-1], 8 * x.element_size(), _bits(weight, bias, x_bias), 1, arch, bits)
    except NotImplementedError as e:
        return str(e)
    return None


class _FwdPlan:
    __slots__ = ("fn_key", "ctas_per_col", "fns")

    def __init__(self, xs, res, weight, bias, x_bias, ys, rs, is_rms, dropout):
        rows, n = xs.shape
        dev = xs.device.index
        arch = cc.device_arch(dev)
        ops_ = [(t, n) for t in (xs, res, ys, rs) if t is not None]
        vec = cc.narrow_vector_for_params(cc.max_vector_elems(tiling.MAX_VECTOR_BITS, *ops_), weight, bias, x_bias)
        extra = _bits(res) if res is not None else 0
        t = ln_config.ln_fwd_tiles(n, 8 * xs.element_size(), _bits(weight, bias, x_bias), vec, arch, extra)
        self.ctas_per_col = ln_config.ctas_per_col(rows, t, cc.num_sms(dev))
        fuse = _fuse(xs.dtype, None if res is None else res.dtype, rs.dtype, _dtype(x_bias), dropout)
        self.fn_key = (cc.cute_dtype(xs.dtype), _cute(weight), _cute(bias), t, is_rms, arch, fuse)
        self.fns = {}  # the compiled kernel by rng_on_device: looked up once, not every call

    def fn(self, on_device: bool):
        fn = self.fns.get(on_device)
        if fn is None:
            fn = self.fns[on_device] = norm_forward.compiled(*self.fn_key, on_device)
        return fn


def _dtype(t: Optional[Tensor]):
    return None if t is None else t.dtype


def _meta(t: Optional[Tensor], align: int = 15):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() & align)


def _param_meta(t: Optional[Tensor]):
    """What a plan reads of a contiguous [N] parameter: its dtype and its address's low 5 bits
    (a vector of 8 fp32 parameters is 32 bytes)."""
    return None if t is None else (t.dtype, t.data_ptr() & 31)


_fwd_plans = Memo()


def forward(
    x, residual, weight, bias, x_bias, p: float, eps: float, is_rms: bool, residual_in_fp32: bool, stub_mean=True
):
    """(y, r, mask, mean, rstd): y in x's dtype, r in ``r_dtype``, both x's shape, contiguous;
    the keep bits uint8 [..., ceil(N / 8)] (empty where p = 0: nothing is drawn); mean
    (LayerNorm; else an empty tensor with ``stub_mean``, the custom op's output, or None) and
    rstd fp32 of x.shape[:-1]."""
    reason = unsupported(x, residual, weight, bias, x_bias, residual_in_fp32)
    if reason is not None:  # torch's math would need the same mask: none to fall back on
        raise NotImplementedError(f"dropout_add_{'rms' if is_rms else 'layer'}_norm on this call: {reason}")
    n = x.shape[-1]
    contiguous = torch.contiguous_format
    y = torch.empty_like(x, memory_format=contiguous)
    r_dt = r_dtype(x, residual, residual_in_fp32)
    r = torch.empty_like(x, dtype=r_dt, memory_format=contiguous)
    dropout = p > 0.0
    stats = x.shape[:-1]
    mask = x.new_empty((*stats, mask_bytes(n)) if dropout else (0,), dtype=torch.uint8)
    rstd = x.new_empty(stats, dtype=torch.float32)
    if is_rms:
        mean = x.new_empty((0,), dtype=torch.float32) if stub_mean else None
    else:
        mean = torch.empty_like(rstd)
    if x.numel() == 0:
        return y, r, mask, mean, rstd
    weight, bias, x_bias = _contiguous_param(weight), _contiguous_param(bias), _contiguous_param(x_bias)
    xs, res = _rows("x", x), _rows("residual", residual)
    rows = xs.shape[0]
    if x.dim() == 2:  # y, r, mask [rows, ...] and the statistics [rows] already: no views
        ys, rs, mr, rstds, means = y, r, mask, rstd, mean
    else:
        ys, rs, rstds = y.view(rows, n), r.view(rows, n), rstd.view(rows)
        mr = mask.view(rows, -1) if dropout else None
        means = None if is_rms else mean.view(rows)
    dev = x.device
    key = (_meta(xs), _meta(res), _param_meta(weight), _param_meta(bias), _param_meta(x_bias), dev, is_rms, r_dt)
    key += (dropout,)
    plan = _fwd_plans.get(key)
    if plan is None:
        plan = _fwd_plans.put(key, _FwdPlan(xs, res, weight, bias, x_bias, ys, rs, is_rms, dropout))
    seed = offset = None
    on_device = dropout and cc.capturing_on(x)
    fn = plan.fn(on_device)  # before the draw: a failed compile leaves the generator
    if dropout:
        seed, offset = philox_state_captured(dev) if on_device else philox_seed_offset(dev, PHILOX_WORDS)
    fn(
        xs, weight, bias, ys, None if is_rms else means, rstds, eps, plan.ctas_per_col,
        res, x_bias, rs, mr if dropout else None, seed, offset,
        keep_threshold(p), 1.0 / (1.0 - p),
    )  # fmt: skip
    return y, r, mask, mean, rstd


class _BwdPlan:
    __slots__ = ("fn", "finalize", "ctas_per_col")

    def __init__(self, dys, dr_in, rs, weight, bias, x_bias, dxs, dres, is_rms, dropout):
        rows, n = rs.shape
        dev = rs.device.index
        arch = cc.device_arch(dev)
        ops_ = [(t, n) for t in (dys, dr_in, rs, dxs, dres) if t is not None]
        vec = cc.narrow_vector_for_params(cc.max_vector_elems(tiling.MAX_VECTOR_BITS, *ops_), weight)
        has_g, has_b, has_xb = weight is not None, bias is not None, x_bias is not None
        in_dt, out_dt = cc.cute_dtype(rs.dtype), cc.cute_dtype(dys.dtype)
        w_dt = cc.cute_dtype(weight.dtype if has_g else rs.dtype)
        t = ln_config.ln_bwd_tiles(
            n, max(in_dt.width, 8 * dxs.element_size()), out_dt.width, w_dt.width, vec, arch,
            num_partials=max(1, has_g + has_b + has_xb), extra_bits=_bits(dr_in) if dr_in is not None else 0,
        )  # fmt: skip
        self.ctas_per_col = ln_config.ctas_per_col(rows, t, cc.num_sms(dev))
        fuse = _fuse(dxs.dtype, _dtype(dres), rs.dtype, _dtype(x_bias), dropout, _dtype(dr_in))
        self.fn = norm_bwd.compiled(in_dt, out_dt, w_dt, t, is_rms, has_g, has_b, arch, fuse)
        self.finalize = None
        if has_g or has_b or has_xb:
            b_dt = cc.cute_dtype(bias.dtype if has_b else rs.dtype)
            ft = ln_config.finalize_tiles(n)
            self.finalize = norm_bwd.compiled_finalize(w_dt, b_dt, ft, has_g, has_b, arch, _cute(x_bias))


_bwd_plans = Memo()


def backward(dy, dr_in, r, weight, bias, mean, rstd, mask, p, is_rms, x_dtype, res_dtype, xb_dtype, stub=True):
    """(dx, dresidual, dweight, dbias, dx_bias); absent ones (no residual, weight, bias,
    x_bias) as empty tensors with ``stub`` (the custom op's outputs), else None. ``dy`` and
    ``dr_in`` (the gradient of r, or None) contiguous; ``bias`` only tells dbias's presence and
    dtype."""
    n = r.shape[-1]
    contiguous = torch.contiguous_format
    dx = torch.empty_like(r, dtype=x_dtype, memory_format=contiguous)
    absent = (lambda dt: r.new_empty((0,), dtype=dt)) if stub else (lambda dt: None)  # noqa: E731
    dres = absent(x_dtype) if res_dtype is None else torch.empty_like(r, dtype=res_dtype, memory_format=contiguous)
    dw = absent(x_dtype) if weight is None else torch.empty_like(weight, memory_format=contiguous)
    db = absent(x_dtype) if bias is None else torch.empty_like(bias, memory_format=contiguous)
    dxb = absent(x_dtype) if xb_dtype is None else r.new_empty((n,), dtype=xb_dtype)
    if r.numel() == 0:
        for g in (dw, db, dxb):
            if g is not None:
                g.zero_()
        return dx, dres, dw, db, dxb
    weight = _contiguous_param(weight)
    rs, dys, drs = rows_view("r", r), rows_view("grad_y", dy), None if dr_in is None else rows_view("grad_r", dr_in)
    rows = rs.shape[0]
    dropout = mask.numel() > 0
    if r.dim() == 2:  # dx, dresidual and the mask [rows, ...] already: no views
        dxs, dress, mr = dx, dres if res_dtype is not None else None, mask
    else:
        dxs = dx.view(rows, n)
        dress = dres.view(rows, n) if res_dtype is not None else None
        mr = mask.view(rows, -1) if dropout else None
    x_bias = dxb if xb_dtype is not None else None  # its dtype and presence
    key = (
        _meta(rs),
        _meta(dys),
        _meta(drs),
        _param_meta(weight),
        _dtype(bias),
        x_dtype,
        res_dtype,
        xb_dtype,
        is_rms,
        dropout,
    )
    plan = _bwd_plans.get(key)
    if plan is None:
        plan = _bwd_plans.put(key, _BwdPlan(dys, drs, rs, weight, bias, x_bias, dxs, dress, is_rms, dropout))
    part = lambda on: r.new_empty((plan.ctas_per_col, n), dtype=torch.float32) if on else None  # noqa: E731
    part_g, part_b, part_xb = part(weight is not None), part(bias is not None), part(xb_dtype is not None)
    mu = None if is_rms else norm_bwd.stat_view("mean", mean, rows)
    plan.fn(
        rs, dys, weight, mu, norm_bwd.stat_view("rstd", rstd, rows), dxs, part_g, part_b, plan.ctas_per_col,
        drs, mr if dropout else None, dress, part_xb, 1.0 / (1.0 - p),
    )  # fmt: skip
    if plan.finalize is not None:
        plan.finalize(
            part_g, part_b, dw if weight is not None else None, db if bias is not None else None, part_xb, x_bias
        )
    return dx, dres, dw, db, dxb
