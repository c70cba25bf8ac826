"""The learnable sink's gradient for ``memory_efficient_attention(sink=)``.

The forward (``ops.attention_fwd_sm90``) puts e^(s_h) into every row's softmax denominator, so
the LSE it saves includes the sink; both backwards take P from that LSE and need nothing else
for dQ / dK / dV. The sink's own gradient is d s_h = sum over the rows of head h of
P_sink (dLSE - Δ), with P_sink = e^(s_h - LSE) the sink's probability and Δ = rowsum(dO ∘ O)
(O as returned, dropout included). Δ comes in the LSE's layout ([B or sequences, H, rows]):
on CUDA from the backwards' Δ kernel (``attention_bwd_prepost.delta_unchecked``: one pass over
O and dO), elsewhere from torch ops in fp32; the rest is a few ops on [*, H, rows] fp32.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import attention_bwd_prepost as P


def sink_grad(
    sink: Tensor,
    out: Tensor,
    grad_out: Optional[Tensor],
    lse: Tensor,
    grad_lse: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    max_seqlen_q: Optional[int] = None,
) -> Tensor:
    """d sink [H] in the sink's dtype. ``out`` / ``grad_out`` [B, Mq, H, Dv] (None: no loss on
    out), ``lse`` / ``grad_lse`` in the op's LSE layout ([B, H, >= Mq], or [sequences, H, >= max
    length] with ``cu_seqlens_q``; None: no loss on it). Rows past each sequence take no part."""
    if grad_out is None and grad_lse is None:
        return torch.zeros_like(sink)
    varlen = cu_seqlens_q is not None
    if varlen:
        lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        rows = lse.shape[-1] if max_seqlen_q is None else min(int(max_seqlen_q), lse.shape[-1])
    else:
        rows = out.shape[1]
        lens = torch.full((out.shape[0],), rows, device=out.device)
    g = None
    if grad_out is not None:
        g = -delta_rows(out, grad_out, cu_seqlens_q, rows)[..., :rows]
    if grad_lse is not None:
        g = grad_lse[..., :rows].float() if g is None else g + grad_lse[..., :rows].float()
    inside = torch.arange(rows, device=out.device).view(1, 1, -1) < lens.view(-1, 1, 1)
    p_sink = torch.exp(sink.float().view(1, -1, 1) - lse[..., :rows])
    # (where, not a product: rows past each sequence may hold anything, NaN included)
    return torch.where(inside, p_sink * g, 0.0).sum((0, 2)).to(sink.dtype)


def delta_rows(out: Tensor, grad_out: Tensor, cu_seqlens_q: Optional[Tensor], rows: int) -> Tensor:
    """Δ = rowsum(dO ∘ O) in fp32 in the LSE's layout: [B, H, >= Mq], or [sequences, H, >= rows]
    with ``cu_seqlens_q`` (0 past each sequence's rows)."""
    varlen = cu_seqlens_q is not None
    if out.is_cuda:
        o, do = (out.squeeze(0), grad_out.squeeze(0)) if varlen else (out, grad_out)  # ([1, total, H, D])
        return P.delta_unchecked(o, do, cu_seqlens_q, rows if varlen else None)
    per_token = (grad_out.float() * out.float()).sum(-1)  # [B, Mq, H]
    if not varlen:
        return per_token.transpose(1, 2)
    # packed rows: row t of sequence i = searchsorted(cu, t) - 1 is [i, :, t - cu[i]]
    cu = cu_seqlens_q.long()
    t = torch.arange(int(cu[-1]), device=out.device)
    seq = torch.searchsorted(cu, t, right=True) - 1
    delta = per_token.new_zeros((cu.shape[0] - 1, out.shape[2], rows))
    delta[seq, :, t - cu[seq]] = per_token[0, : t.shape[0]]
    return delta
