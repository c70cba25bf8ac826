"""The learnable sink's gradient for ``memory_efficient_attention(sink=)``.

The forward (``ops.attention_fwd_sm90``) puts e^(s_h) into every row's softmax denominator, so
the LSE it saves includes the sink; both backwards take P from that LSE and need nothing else
for dQ / dK / dV. The sink's own gradient is d s_h = sum over the rows of head h of
P_sink (dLSE - Δ), with P_sink = e^(s_h - LSE) the sink's probability and Δ = rowsum(dO ∘ O)
(O as returned, dropout included). On sm_90 one launch of the backwards' preprocess kernel
(``compute_dot_do_o`` with its sink terms: one pass over O and dO) writes each row's term, and
a sum over batch and rows gives d s_h; on CPU tensors torch ops in fp32 compute the same.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _compile as cc
from . import attention_bwd_prepost as P
from .reference import attention_delta_ref


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
    out; on CUDA with the kernels' layout, ``kernel_ready``), ``lse`` / ``grad_lse`` in the op's
    LSE layout ([B, H, >= Mq], or [sequences, H, >= max length] with ``cu_seqlens_q``; None: no
    loss on it). Rows past each sequence take no part."""
    if grad_out is None and grad_lse is None:
        return torch.zeros_like(sink)
    if grad_out is None:  # a loss on the LSE alone: dO = 0
        grad_out = torch.zeros_like(out)
    rows = out.shape[1]
    if cu_seqlens_q is not None:
        rows = lse.shape[-1] if max_seqlen_q is None else min(int(max_seqlen_q), lse.shape[-1])
    args = (sink, out, grad_out, lse, grad_lse, cu_seqlens_q, rows)
    if not out.is_cuda:
        return _sink_grad_torch(*args)
    return _sink_grad_cuda(*args) if cc.eager(out) else _sink_grad_op(*args)


def _sink_grad_cuda(sink, out, grad_out, lse, grad_lse, cu_seqlens_q, rows: int) -> Tensor:
    """The row terms from the preprocess kernel's variant that reads the LSE (sm_90a, as the
    forward that takes a sink), summed."""
    varlen = cu_seqlens_q is not None
    o, do = (out.squeeze(0), grad_out.squeeze(0)) if varlen else (out, grad_out)  # ([1, total, H, D])
    batch = cu_seqlens_q.shape[0] - 1 if varlen else out.shape[0]
    # Δ and the LSE in log2 units (the kernel's by-products, unused here) and the terms: one allocation
    buf = out.new_empty((3,) + P.delta_shape(batch, out.shape[-2], rows), dtype=torch.float32)
    delta, lse_log2, terms = buf.unbind(0)
    s = sink.float().contiguous()
    P.launch_preprocess(o, do, delta, None, 1.0, cu_seqlens_q, rows, lse, lse_log2, grad_lse, s, terms)
    return terms.sum((0, 2)).to(sink.dtype)


@torch.library.custom_op("cute_kernels::attention_sink_grad", mutates_args=())
def _sink_grad_op(
    sink: Tensor,
    out: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    grad_lse: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    rows: int,
) -> Tensor:
    return _sink_grad_cuda(sink, out, grad_out, lse, grad_lse, cu_seqlens_q, rows)


@_sink_grad_op.register_fake
def _(sink, out, grad_out, lse, grad_lse, cu_seqlens_q, rows):
    return sink.new_empty(sink.shape)


def _sink_grad_torch(sink, out, grad_out, lse, grad_lse, cu_seqlens_q, rows: int) -> Tensor:
    """The same in torch ops, fp32."""
    if cu_seqlens_q is not None:
        lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    else:
        lens = torch.full((out.shape[0],), rows, device=out.device)
    g = -delta_rows(out, grad_out, cu_seqlens_q, rows)[..., :rows]
    if grad_lse is not None:
        g = g + grad_lse[..., :rows].float()
    inside = torch.arange(rows, device=out.device).view(1, 1, -1) < lens.view(-1, 1, 1)
    p_sink = torch.exp(sink.float().view(1, -1, 1) - lse[..., :rows])
    # (where, not a product: rows past each sequence may hold anything, NaN included)
    return torch.where(inside, p_sink * g, 0.0).sum((0, 2)).to(sink.dtype)


def delta_rows(out: Tensor, grad_out: Tensor, cu_seqlens_q: Optional[Tensor], rows: int) -> Tensor:
    """Δ = rowsum(dO ∘ O) in fp32 in the LSE's layout: [B, H, Mq], or [sequences, H, rows] with
    ``cu_seqlens_q`` (0 past each sequence's rows): ``reference.attention_delta_ref`` (fp64, CPU
    tensors here) in fp32."""
    if cu_seqlens_q is None:
        return attention_delta_ref(out, grad_out, rounded=False).float()
    return attention_delta_ref(out[0], grad_out[0], 1.0, cu_seqlens_q, rows, rounded=False).float()
