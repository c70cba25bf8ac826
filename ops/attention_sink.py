"""The learnable sink's gradient for ``memory_efficient_attention(sink=)``.

The forward (``ops.attention_fwd_sm90``) puts e^(s_h) into every row's softmax denominator, so
the LSE it saves includes the sink; both backwards take P from that LSE and need nothing else
for dQ / dK / dV. The sink's own gradient is d s_h = sum over the rows of head h of
P_sink (dLSE - Δ), with P_sink = e^(s_h - LSE) the sink's probability and Δ = rowsum(dO ∘ O)
(O as returned, dropout included), computed here in fp32 from the saved output and LSE.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def sink_grad(
    sink: Tensor,
    out: Tensor,
    grad_out: Optional[Tensor],
    lse: Tensor,
    grad_lse: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
) -> Tensor:
    """d sink [H] in the sink's dtype. ``out`` / ``grad_out`` [B, Mq, H, Dv] (None: no loss on
    out), ``lse`` / ``grad_lse`` in the op's LSE layout ([B, H, >= Mq], or [sequences, H, >= max
    length] with ``cu_seqlens_q``; None: no loss on it). Rows past each sequence take no part."""
    g = None
    if grad_out is not None:  # -Δ, [B, Mq, H]
        g = -(grad_out.float() * out.float()).sum(-1)
    if cu_seqlens_q is None:
        mq = out.shape[1]
        rows_lse = lse[..., :mq].transpose(1, 2)
        if grad_lse is not None:
            g = _plus(g, grad_lse[..., :mq].transpose(1, 2).float())
        if g is None:
            return torch.zeros_like(sink)
        p_sink = torch.exp(sink.float() - rows_lse)
        return (p_sink * g).sum((0, 1)).to(sink.dtype)
    # packed rows: row t of sequence i = searchsorted(cu, t) - 1 is the LSE's [i, :, t - cu[i]]
    t = torch.arange(out.shape[1], device=out.device)
    cu = cu_seqlens_q.long()
    seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(0, cu.shape[0] - 2)
    inside = t < cu[-1]
    pos = (t - cu[seq]).clamp(0, lse.shape[-1] - 1)
    if grad_lse is not None:
        g = _plus(None if g is None else g[0], grad_lse[seq, :, pos].float())
    elif g is not None:
        g = g[0]
    if g is None:
        return torch.zeros_like(sink)
    p_sink = torch.exp(sink.float() - lse[seq, :, pos])
    # (where, not a product: rows past the last sequence may hold anything, NaN included)
    return torch.where(inside[:, None], p_sink * g, 0.0).sum(0).to(sink.dtype)


def _plus(a: Optional[Tensor], b: Tensor) -> Tensor:
    return b if a is None else a + b
