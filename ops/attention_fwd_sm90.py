"""Torch face of the Hopper-native attention forward (``cute_kernels.attention_sm90.attention_forward_sm90``).

``attention_forward_sm90(query, key, value, ...)`` returns O and the LSE in the layouts of
``aten._efficient_attention_forward`` ([B, Mq, H, Dv] and fp32 [B, H, round_up(Mq, 32)], +inf
on the padded rows), which the backwards read. ``unsupported`` says why the kernel cannot take a
problem (None: it can); the attention ops then run torch's forward and log the reason.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import cutlass
import cutlass.cute as cute
import torch
from torch import Tensor

from cute_kernels.attention_sm90.attention_forward_sm90 import AttentionForwardSm90
from cute_kernels.attention_sm90.forward_config import forward_tiles, forward_unsupported
from layouts.attention_fwd_sm90 import tma_align_elems

from . import _compile as cc
from ._memo import Memo
from .attention_common import lse_rows, remembered_verdict, tma_misaligned

DTYPES = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """One compiled forward: element type, head dims, mask (0 none, 1 causal top-left, 2
    bottom-right), whether a sliding window applies, variable lengths, the DSL target."""

    dtype: type
    head_dim: int
    head_dim_v: int
    mask_type: int
    window: bool
    varlen: bool
    arch: str


def _build(config: ForwardConfig):
    c = config
    tiles = forward_tiles(c.head_dim, c.head_dim_v, c.window)
    kernel = AttentionForwardSm90(c.dtype, tiles, c.mask_type, c.window, c.varlen)
    b, h, hk, mq, mk, lse_rows = (cute.sym_int() for _ in range(6))
    seqs = cute.sym_int() if c.varlen else b  # the LSE's rows: per sequence
    vec = tma_align_elems(c.dtype.width)
    q = cc.fake_tensor(c.dtype, (b, mq, h, c.head_dim), vec)
    k = cc.fake_tensor(c.dtype, (b, mk, hk, c.head_dim), vec)
    v = cc.fake_tensor(c.dtype, (b, mk, hk, c.head_dim_v), vec)
    o = cc.fake_tensor(c.dtype, (b, mq, h, c.head_dim_v), vec)
    lse = cc.fake_tensor(cutlass.Float32, (seqs, h, lse_rows), 1)
    cu_q, cu_k = (cc.fake_tensor(cutlass.Int32, (cute.sym_int(),), 1) if c.varlen else None for _ in range(2))
    return cc.compile_kernel(
        kernel,
        q,
        k,
        v,
        o,
        lse,
        cu_q,
        cu_k,
        cutlass.Int32(0),
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cc.fake_stream(),
        arch=c.arch,
    )


compiled = cc.CompileCache("attention_fwd_sm90", _build)


_verdicts = Memo()  # unsupported's answers for plain CUDA tensors at TMA-aligned addresses, by metadata


def unsupported(query, key, value, *, mask_type=0, bias=None, dropout_p=0.0, arch=None) -> Optional[str]:
    """Why the forward kernel cannot take this problem (None: it can); no CUDA call for CPU,
    meta or fake tensors (they get the reason of their missing arch unless ``arch`` is given).
    Remembered per metadata for plain CUDA tensors (``attention_common.remembered_verdict``)."""
    return remembered_verdict(
        _verdicts,
        (query, key, value),
        (arch, mask_type, bias is not None, dropout_p > 0.0),
        lambda: _unsupported(query, key, value, mask_type, bias, dropout_p, arch),
    )


def _unsupported(query, key, value, mask_type, bias, dropout_p, arch) -> Optional[str]:
    """unsupported's checks, all of them."""
    arch = arch or cc.tensor_arch(query)
    if arch != "sm_90a":
        return f"needs sm_90a, the device is {arch or f'{query.device} (no CUDA arch known)'}"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype} (fp16 / bf16 only)"
    why = forward_unsupported(query.shape[-1], value.shape[-1])
    if why is not None:
        return f"head dims {query.shape[-1]} / {value.shape[-1]} ({why})"
    if bias is not None:
        return "attention bias (not in the forward kernel yet)"
    if dropout_p > 0.0:
        return "dropout (not in the forward kernel yet)"
    if key.shape[2] == 0 or query.shape[2] % key.shape[2]:
        return f"query heads {query.shape[2]} not a multiple of key heads {key.shape[2]}"
    if mask_type not in (0, 1, 2):
        return f"mask type {mask_type}"
    return tma_misaligned((("query", query), ("key", key), ("value", value)))


def attention_forward_sm90(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: Optional[float] = None,
    mask_type: int = 0,
    window_size: int = 0,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
) -> Tuple[Tensor, Tensor]:
    """O [B, Mq, H, Dv] and LSE [B, H, round_up(Mq, 32)] (natural log, fp32) of q [B, Mq, H, D],
    k [B, Mk, Hk, D], v [B, Mk, Hk, Dv] (``unsupported`` first). ``window_size`` > 0 (with a
    causal mask): key k also needs k > q + offset - window_size. Variable lengths: B = 1,
    int32 ``cu_seqlens_q / _k`` [sequences + 1], the LSE [sequences, H, round_up(max_seqlen_q, 32)]."""
    b, mq, h, d = query.shape
    varlen = cu_seqlens_q is not None
    seqs, rows_q = (cu_seqlens_q.shape[0] - 1, int(max_seqlen_q)) if varlen else (b, mq)
    out = torch.empty((b, mq, h, value.shape[3]), dtype=query.dtype, device=query.device)
    lse = torch.empty((seqs, h, lse_rows(rows_q)), dtype=torch.float32, device=query.device)
    if out.numel() == 0 or key.shape[1] == 0 or seqs == 0:  # no launch: nothing to compute, or no key to see
        return out.zero_(), _empty_lse(lse, mq, cu_seqlens_q)
    config = ForwardConfig(
        cc.cute_dtype(query.dtype), d, value.shape[3], int(mask_type), window_size > 0, varlen, cc.tensor_arch(query)
    )
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    compiled(config)(query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, rows_q, scale, int(window_size))
    return out, lse


def _empty_lse(lse: Tensor, mq: int, cu_seqlens_q: Optional[Tensor]) -> Tensor:
    """The LSE of queries that see no key: 0 on each sequence's rows, +inf on the padding."""
    rows = torch.arange(lse.shape[-1], device=lse.device)
    if cu_seqlens_q is None:
        lengths = torch.full((lse.shape[0], 1), mq, device=lse.device)
    else:
        lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).view(-1, 1)
    inside = (rows.view(1, -1) < lengths).unsqueeze(1).expand(lse.shape)
    return lse.fill_(math.inf).masked_fill_(inside, 0.0)


def benchmark_configurations(cases, arch: str) -> list:
    """The ``compiled`` keys of a suite's cases ((B, H, S, D), dtype name, causal[, features]):
    features ``kv<N>`` (grouped-query heads: compiled alike), ``dv<N>``, ``window<N>``,
    ``varlen``, joined by ':'; none off sm_90a or for head dims the forward does not compile."""
    if arch != "sm_90a":
        return []
    keys = set()
    for (_, _, _, d), dtype, causal, *features in cases:
        tokens = features[0].split(":") if features and features[0] else []
        dv = next((int(t[2:]) for t in tokens if t.startswith("dv")), d)
        if forward_unsupported(d, dv) is not None:
            continue
        window = any(t.startswith("window") for t in tokens)
        varlen = "varlen" in tokens
        keys.add(ForwardConfig(cc.cute_dtype(getattr(torch, dtype)), d, dv, 1 if causal else 0, window, varlen, arch))
    return sorted(keys, key=repr)
