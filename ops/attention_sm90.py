"""Torch face of the Hopper-native attention backward (``cute_kernels.attention_sm90``).

Three launches: our preprocess (Δ = rowsum(dO∘O) and a zeroed fp32 dQ accumulator),
the sm90 kernel (dK, dV, dQ added into the accumulator), our ``convert_dq``.
``supported`` says which problems this path takes; the memory-efficient op and
``ops.attention`` fall back to the sm80-structured kernel for the others.
"""

from __future__ import annotations

import logging
from typing import Optional

import cutlass
import cutlass.cute as cute
import torch
from torch import Tensor

from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90
from layouts import attention_sm90 as tiling

from . import _compile as cc

log = logging.getLogger("cute_kernels.attention")

DTYPES = (torch.float16, torch.bfloat16)


def _build(dtype, head_dim: int, mask_type: int, arch: str):
    tiles = tiling.attention_sm90_tiles(head_dim)
    kernel = AttentionBackwardSm90(dtype, tiles, mask_type)
    b, h, mq, mk = (cute.sym_int() for _ in range(4))
    # TMA: last stride 1, the other strides and the addresses multiples of 16 bytes
    q, do = (cc.fake_tensor(dtype, (b, mq, h, head_dim), 8) for _ in range(2))
    k, v, dk, dv = (cc.fake_tensor(dtype, (b, mk, h, head_dim), 8) for _ in range(4))
    lse, delta = (cc.fake_tensor(cutlass.Float32, (b, h, cute.sym_int()), 4) for _ in range(2))
    dq_accum = cc.fake_tensor(cutlass.Float32, (b, cute.sym_int(), h, head_dim), 4)
    return cc.compile_kernel(
        kernel, q, k, v, do, lse, delta, dq_accum, dk, dv, cutlass.Float32(1.0), cc.fake_stream(), arch=arch
    )


compiled = cc.CompileCache("attention_bwd_sm90", _build)


def unsupported(query, key, value, grad_out, out, *, mask_type=0, window_size=None, cu_seqlens_q=None,
                bias=None, dropout_p=0.0, arch=None) -> Optional[str]:  # fmt: skip
    """Why the sm90 path cannot take this problem (None: it can)."""
    arch = arch or (cc.device_arch(query.device.index) if query.is_cuda else "cpu")
    if arch != "sm_90a":
        return f"needs sm_90a, the device is {arch}"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype} (fp16 / bf16 only)"
    d = query.shape[-1]
    if d not in tiling.HEAD_DIMS or value.shape[-1] != d:
        return f"head dims {d} / {value.shape[-1]} (supported: equal, one of {tiling.HEAD_DIMS})"
    if key.shape[2] != query.shape[2]:
        return "grouped-query heads (not yet on this path)"
    if cu_seqlens_q is not None:
        return "variable lengths (not yet on this path)"
    if window_size:
        return "sliding window (not yet on this path)"
    if bias is not None:
        return "attention bias (not yet on this path)"
    if dropout_p:
        return "dropout (not yet on this path)"
    if mask_type not in (0, 1, 2):
        return f"mask type {mask_type}"
    for name, t in (("query", query), ("key", key), ("value", value), ("grad_out", grad_out), ("out", out)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            return f"{name} is not TMA-aligned (last stride 1, other strides and address multiples of 16 bytes)"
    return None


def _tma_stats(x: Tensor) -> Tensor:
    """An fp32 [B, H, S] statistic whose row stride and address TMA accepts (padded copy if not)."""
    if x.stride(-1) == 1 and x.stride(1) % 4 == 0 and x.stride(0) % 4 == 0 and x.data_ptr() % 16 == 0:
        return x
    s = x.shape[-1]
    padded = x.new_zeros(x.shape[:-1] + (-(-s // 4) * 4,))
    padded[..., :s] = x
    return padded


def attention_backward_sm90(grad_out, query, key, value, out, logsumexp, scale: float, mask_type: int = 0):
    """(dq, dk, dv) of softmax(scale Q K^T [+ causal mask]) V; tensors [B, S, H, D].

    ``logsumexp``: the forward's natural-log row statistics [B, H, >= Sq] fp32. The caller
    has checked ``unsupported(...) is None``."""
    from .attention_bwd_prepost import _convert_dq_impl, _preprocess_impl

    b, sq, h, d = query.shape
    sk = key.shape[1]
    dk = torch.empty_like(key)
    dv = torch.empty_like(value)
    if min(b, h, sq, sk) == 0:
        return torch.zeros_like(query), dk.zero_(), dv.zero_()
    delta, dq_accum = _preprocess_impl(out, grad_out, 1.0, None, None, True)
    fn = compiled(cc.cute_dtype(query.dtype), d, int(mask_type), cc.device_arch(query.device.index))
    fn(query, key, value, grad_out, _tma_stats(logsumexp.float()), delta, dq_accum, dk, dv, float(scale))
    dq = _convert_dq_impl(dq_accum, float(scale), d, sq, None, None, 0.0, query.dtype)
    log.debug("attention backward: sm90 path (B=%d, H=%d, Sq=%d, Sk=%d, D=%d, mask %d)", b, h, sq, sk, d, mask_type)
    return dq, dk, dv
