"""Plain torch references: the ground truth of the tests and the 'torch' peer of the benchmarks."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from layouts.attention_bwd_prepost import VARLEN_ACCUM_PAD, seqlen_rounded


def activation_grad_ref(z: Tensor, activation: Optional[str]) -> Tensor:
    """act'(z) in z's dtype (pass fp64 for a reference)."""
    if activation is None:
        return torch.ones_like(z)
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":
        k = math.sqrt(2.0 / math.pi)
        t = torch.tanh(k * (z + 0.044715 * z**3))
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * k * (1 + 3 * 0.044715 * z * z)
    if activation == "gelu_erf":
        return 0.5 * (1 + torch.erf(z / math.sqrt(2.0))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    raise ValueError(f"unknown activation {activation!r}")


def dropout_bias_backward_ref(
    grad_out: Tensor,
    mask: Tensor,
    p: float,
    x: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> Tuple[Tensor, Tensor]:
    """(dX, dBias) computed in ``compute_dtype``, returned in that dtype."""
    g = grad_out.to(compute_dtype) * mask.to(compute_dtype) * (1.0 / (1.0 - p))
    if activation is not None:
        g = g * activation_grad_ref(x.to(compute_dtype) + bias.to(compute_dtype), activation)
    return g, g.reshape(-1, g.shape[-1]).sum(0)


def dropout_bias_backward_torch(grad_out, mask, p, x=None, bias=None, activation=None):
    """What a torch user writes (the eager / torch.compile peer): fp32 math, outputs in dY's dtype."""
    g = grad_out.float() * mask * (1.0 / (1.0 - p))
    if activation is not None:
        g = g * activation_grad_ref(x.float() + bias.float(), activation)
    return g.to(grad_out.dtype), g.reshape(-1, g.shape[-1]).sum(0).to(grad_out.dtype)


# ------------------------------------------------------- attention backward pre/post


def _seq_bounds(cu_seqlens: Tensor):
    """[(start, length)] of each packed sequence."""
    cu = cu_seqlens.tolist()
    return [(cu[b], cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]


def attention_delta_ref(
    out: Tensor,
    grad_out: Tensor,
    scale: float = 1.0,
    cu_seqlens_q: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    rounded: bool = True,
) -> Tensor:
    """Δ = scale * rowsum(out * grad_out) in fp64, [batch, heads, seqlen], zero past each sequence.

    ``rounded``: seqlen is round_up(max seqlen, 128) (attention_bwd_preprocess's Δ), else the
    max seqlen itself (attention_bwd_compute_delta's). Inputs [B, S, H, D], or packed
    [total, H, D] with ``cu_seqlens_q`` and ``max_seqlen_q``.
    """
    rows = scale * (out.double() * grad_out.double()).sum(-1)  # [B, S, H] or [total, H]
    if cu_seqlens_q is None:
        seqs = [r.t() for r in rows]  # [H, S] each
        s = out.shape[1]
    else:
        seqs = [rows[start : start + n].t() for start, n in _seq_bounds(cu_seqlens_q)]
        s = int(max_seqlen_q)
    delta = rows.new_zeros((len(seqs), out.shape[-2], seqlen_rounded(s) if rounded else s))
    for b, d in enumerate(seqs):
        delta[b, :, : d.shape[1]] = d
    return delta


def attention_delta_torch(out: Tensor, grad_out: Tensor) -> Tensor:
    """What a torch user writes (the eager / torch.compile peer): fp32 rowsum, [B, S, H]."""
    return (out.float() * grad_out.float()).sum(-1)


def convert_dq_ref(
    dq_accum: Tensor,
    softmax_scale: float,
    *,
    head_dim: int,
    seqlen_q: Optional[int] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    p_dropout: float = 0.0,
) -> Tensor:
    """dQ in fp64: the split partials summed, scaled by softmax_scale / (1 - p_dropout).

    ``dq_accum``: [(nsplits,) B, S_r, H, D_r] -> [B, seqlen_q, H, head_dim]; with
    ``cu_seqlens_q`` [(nsplits,) total_q + 128 B, H, D_r] -> [total_q, H, head_dim], sequence
    b's rows starting at cu_seqlens_q[b] + 128 b.
    """
    acc = dq_accum.double()
    if acc.dim() == (3 if cu_seqlens_q is not None else 4):
        acc = acc.unsqueeze(0)
    acc = acc.sum(0) * (softmax_scale / (1.0 - p_dropout))
    if cu_seqlens_q is None:
        return acc[:, :seqlen_q, :, :head_dim]
    parts = [acc[start + VARLEN_ACCUM_PAD * b : start + VARLEN_ACCUM_PAD * b + n] for b, (start, n) in enumerate(_seq_bounds(cu_seqlens_q))]
    return torch.cat(parts)[..., :head_dim]


def convert_dq_torch(dq_accum: Tensor, softmax_scale: float, seqlen_q: int, head_dim: int, dtype=torch.bfloat16) -> Tensor:
    """What a torch user writes for convert_dq ([nsplits, B, S_r, H, D_r] in): the benchmark peer."""
    return (dq_accum.sum(0)[:, :seqlen_q, :, :head_dim] * softmax_scale).to(dtype)


def convert_dkv_ref(
    dk_accum: Tensor,
    dv_accum: Tensor,
    softmax_scale: float,
    *,
    head_dim: int,
    seqlen_k: int,
    cu_seqlens_k: Optional[Tensor] = None,
    p_dropout: float = 0.0,
) -> Tuple[Tensor, Tensor]:
    """(dK, dV) in fp64 from [B, H_k, S_k_r, D_r] accumulators.

    dK = dk_accum * softmax_scale / (1 - p), dV = dv_accum / (1 - p); [B, seqlen_k, H_k,
    head_dim], or with ``cu_seqlens_k`` packed [seqlen_k (= total_k), H_k, head_dim] where
    sequence b's row j is accumulator row (b, :, j).
    """
    rp = 1.0 / (1.0 - p_dropout)

    def convert(acc, scale):
        acc = acc.double()[..., :head_dim] * scale
        if cu_seqlens_k is None:
            return acc[:, :, :seqlen_k].transpose(1, 2)
        parts = [acc[b, :, :n].transpose(0, 1) for b, (_, n) in enumerate(_seq_bounds(cu_seqlens_k))]
        return torch.cat(parts)

    return convert(dk_accum, softmax_scale * rp), convert(dv_accum, rp)


def convert_dkv_torch(dk_accum: Tensor, dv_accum: Tensor, softmax_scale: float, seqlen_k: int, head_dim: int, dtype=torch.bfloat16):
    """What a torch user writes for convert_dkv (the benchmark peer)."""
    fmt = torch.contiguous_format  # [B, S, H, D] in memory, as ours
    dk = (dk_accum[:, :, :seqlen_k, :head_dim] * softmax_scale).transpose(1, 2).to(dtype, memory_format=fmt)
    dv = dv_accum[:, :, :seqlen_k, :head_dim].transpose(1, 2).to(dtype, memory_format=fmt)
    return dk, dv


def norm_backward_ref(
    grad_out: Tensor,
    x: Tensor,
    weight: Optional[Tensor],
    mean: Optional[Tensor],
    rstd: Tensor,
    has_bias: bool,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """LayerNorm (mean given) / RMSNorm (mean None) backward in fp64 from the saved statistics."""
    n = x.shape[-1]
    x64, dz = x.double().reshape(-1, n), grad_out.double().reshape(-1, n)
    rs = rstd.double().reshape(-1, 1)
    y = (x64 if mean is None else x64 - mean.double().reshape(-1, 1)) * rs
    dy = dz * weight.double() if weight is not None else dz
    dx = dy - (dy * y).mean(-1, keepdim=True) * y
    if mean is not None:
        dx = dx - dy.mean(-1, keepdim=True)
    dx = (dx * rs).reshape(x.shape)
    dw = (dz * y).sum(0) if weight is not None else None
    db = dz.sum(0) if has_bias else None
    return dx, dw, db
