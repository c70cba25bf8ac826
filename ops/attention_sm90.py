"""Torch face of the Hopper-native attention backward (``cute_kernels.attention_sm90``).

Three launches: our preprocess (Δ = rowsum(dO∘O) and a zeroed fp32 dQ accumulator),
the sm90 kernel (dK, dV, dQ added into the accumulator), our ``convert_dq``.
``unsupported`` says why this path cannot take a problem (None: it can);
``ops.efficient_attention_backward`` and ``ops.memory_efficient_attention`` choose
between it and the sm80-structured kernel (``backend=``, see ``ops.mem_eff_attention``).
dQ is summed by TMA reduce-adds in whatever order the key blocks finish (not bitwise
reproducible from run to run) unless ``deterministic``: then in a fixed key-block order.
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90
from cute_kernels.attention_sm90.attention_backward_sm90_wide import AttentionBackwardSm90Wide
from layouts import attention_sm90 as tiling

from . import _compile as cc

DTYPES = (torch.float16, torch.bfloat16)


def _build(dtype, head_dim: int, head_dim_v: int, mask_type: int, has_window: bool, arch: str,
           deterministic: bool = False, varlen: bool = False):  # fmt: skip
    """One configuration; ``head_dim`` is Dqk (Q, K), ``head_dim_v`` Dv (V, dO)."""
    tiles = tiling.attention_sm90_tiles(head_dim, head_dim_v=head_dim_v)
    # a head dim above 128: the 64 x 64 decomposition (P^T / dS^T through shared memory)
    cls = AttentionBackwardSm90Wide if isinstance(tiles, tiling.AttentionSm90WideTiles) else AttentionBackwardSm90
    kernel = cls(dtype, tiles, mask_type, has_window, deterministic, varlen)
    b, h, hk, mq, mk = (cute.sym_int() for _ in range(5))
    # TMA: last stride 1, the other strides and the addresses multiples of TMA_ALIGN_BYTES
    vec, vec32 = tiling.tma_align_elems(dtype.width), tiling.tma_align_elems(32)
    q = cc.fake_tensor(dtype, (b, mq, h, head_dim), vec)
    do = cc.fake_tensor(dtype, (b, mq, h, head_dim_v), vec)
    k, dk = (cc.fake_tensor(dtype, (b, mk, hk, head_dim), vec) for _ in range(2))
    v, dv = (cc.fake_tensor(dtype, (b, mk, hk, head_dim_v), vec) for _ in range(2))
    # per-sequence tensors: with varlen the sequences are not the packed tensors' batch (1)
    seqs = cute.sym_int() if varlen else b
    lse, delta = (cc.fake_tensor(cutlass.Float32, (seqs, h, cute.sym_int()), vec32) for _ in range(2))
    dq_accum = cc.fake_tensor(cutlass.Float32, (b, cute.sym_int(), h, head_dim), vec32)
    semaphore = cc.fake_tensor(cutlass.Int32, (seqs, h, cute.sym_int()), 1) if deterministic else None
    cu_q, cu_k = (cc.fake_tensor(cutlass.Int32, (cute.sym_int(),), 1) if varlen else None for _ in range(2))
    return cc.compile_kernel(
        kernel, q, k, v, do, lse, delta, dq_accum, dk, dv, semaphore, cu_q, cu_k, cutlass.Float32(1.0),
        cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(1), cc.fake_stream(), arch=arch,
    )  # fmt: skip


compiled = cc.CompileCache("attention_bwd_sm90", _build)


def compile_for_benchmark_cases(cases, arch: str) -> int:
    """The configurations the ``attention_bwd`` suite's ours_sm90 rows run: ((B, H, S, D),
    dtype, causal[, feature]) without a feature, head dims of the path; none for an arch
    other than sm_90a (the path does not run there)."""
    if arch != "sm_90a":
        return 0
    keys = set()
    for (_, _, _, d), dtype_name, causal, *feature in cases:
        if (feature and feature[0] is not None) or d not in tiling.HEAD_DIMS:
            continue
        keys.add((cc.cute_dtype(getattr(torch, dtype_name)), d, d, 1 if causal else 0, False, arch))  # causal: top-left
    for key in sorted(keys, key=str):
        compiled(*key)
    return len(keys)


def unsupported(query, key, value, grad_out, out, *, mask_type=0, window_size=None, bias=None, dropout_p=0.0,
                arch=None) -> Optional[str]:  # fmt: skip
    """Why the sm90 path cannot take this problem (None: it can).

    ``arch``: the DSL target to judge for; by default the device's, known only for real
    CUDA tensors (no CUDA call for CPU, meta or fake ones: they get a reason)."""
    arch = arch or cc.tensor_arch(query)
    if arch != "sm_90a":
        return f"needs sm_90a, the device is {arch or f'{query.device} (no CUDA arch known)'}"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype} (fp16 / bf16 only)"
    d, dv = query.shape[-1], value.shape[-1]
    why = tiling.head_dims_unsupported(d, dv)
    if why is not None:
        return f"head dims {d} / {dv} ({why})"
    if key.shape[2] == 0 or query.shape[2] % key.shape[2]:
        return f"query heads {query.shape[2]} not a multiple of key heads {key.shape[2]}"
    if bias is not None:
        return "attention bias (not yet on this path)"
    if dropout_p:
        return "dropout (not yet on this path)"
    if mask_type not in (0, 1, 2):
        return f"mask type {mask_type}"
    vec = tiling.tma_align_elems(8 * query.element_size())
    for name, t in (("query", query), ("key", key), ("value", value), ("grad_out", grad_out), ("out", out)):
        # fake / meta tensors have no address to check (their real counterparts are checked at run time)
        address = 0 if t.device.type == "meta" or is_fake(t) else t.data_ptr()
        if t.stride(-1) != 1 or address % tiling.TMA_ALIGN_BYTES or any(s % vec for s in t.stride()[:-1]):
            return (f"{name} is not TMA-aligned (last stride 1, other strides and address multiples of "
                    f"{tiling.TMA_ALIGN_BYTES} bytes)")  # fmt: skip
    return None


def _tma_stats(x: Tensor) -> Tensor:
    """An fp32 [B, H, S] statistic whose row stride and address TMA accepts (padded copy if not)."""
    vec = tiling.tma_align_elems(32)
    if x.stride(-1) == 1 and x.stride(1) % vec == 0 and x.stride(0) % vec == 0 and x.data_ptr() % tiling.TMA_ALIGN_BYTES == 0:
        return x
    s = x.shape[-1]
    padded = x.new_zeros(x.shape[:-1] + (-(-s // vec) * vec,))
    padded[..., :s] = x
    return padded


def attention_backward_sm90(grad_out, query, key, value, out, logsumexp, scale: float, mask_type: int = 0,
                            window_size: int = 0, deterministic: bool = False, cu_seqlens_q=None, cu_seqlens_k=None,
                            max_seqlen_q=None, max_seqlen_k=None):  # fmt: skip
    """(dq, dk, dv) of softmax(scale Q K^T [+ causal mask [+ window]]) V; tensors [B, S, H, D]
    (key / value / dk / dv [B, S, Hk, D] with grouped-query heads: H a multiple of Hk; value,
    out, grad_out and dv have the head dim Dv, which may differ from query's and key's).
    ``window_size`` > 0 (with a causal mask): key k sees query q when
    q + offset - window_size < k <= q + offset, as the memory-efficient kernel.

    ``logsumexp``: the forward's natural-log row statistics [B, H, >= Sq] fp32. The caller
    has checked ``unsupported(...) is None``. ``deterministic``: dQ's fp32 sums in a fixed
    order (the same bits from run to run; a zeroed semaphore per query block, and key
    blocks wait for their turn).

    Variable lengths (the memory-efficient op's convention): B == 1, sequence i is rows
    cu_seqlens_q[i] .. cu_seqlens_q[i + 1] (keys alike) of the packed tensors, bounded by
    ``max_seqlen_q / _k``; logsumexp [sequences, H, >= max_seqlen_q]. Masks are per sequence."""
    from .attention_bwd_prepost import _convert_dq_impl, _preprocess_impl

    varlen = cu_seqlens_q is not None
    b, sq, h, d = query.shape
    sk, d_v = key.shape[1], value.shape[-1]
    seqs = cu_seqlens_q.numel() - 1 if varlen else b
    rows_q = int(max_seqlen_q) if varlen else sq
    rows_k = int(max_seqlen_k) if varlen else sk
    # fresh [B, S, H, D] tensors whatever the inputs' strides, as aten's backward (and the
    # fake implementation of the op that calls this) allocates them
    dk = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    dv = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    if min(seqs, h, sq, sk, rows_q, rows_k) == 0:
        return torch.zeros_like(query), dk.zero_(), dv.zero_()
    # the pre / postprocess take packed sequences as [total, H, D]
    pack = (lambda x: x[0]) if varlen else (lambda x: x)
    # Δ from out / dO (Dv wide), the zeroed dQ accumulator as query (Dqk wide)
    delta, dq_accum = _preprocess_impl(pack(out), pack(grad_out), 1.0, cu_seqlens_q, max_seqlen_q, True, dq_head_dim=d)
    window = int(window_size or 0)
    arch = cc.device_arch(query.device.index)
    fn = compiled(cc.cute_dtype(query.dtype), d, d_v, int(mask_type), window > 0, arch, bool(deterministic), varlen)
    tiles = tiling.attention_sm90_tiles(d, head_dim_v=d_v)
    semaphore = None
    if deterministic:
        semaphore = torch.zeros((seqs, h, -(-rows_q // tiles.tile_m)), dtype=torch.int32, device=query.device)
    chunk = tiles.lpt_heads_per_chunk(rows_q, h // key.shape[2], query.element_size())
    fn(query, key, value, grad_out, _tma_stats(logsumexp.float()), delta, dq_accum.unsqueeze(0) if varlen else dq_accum,
       dk, dv, semaphore, cu_seqlens_q, cu_seqlens_k, float(scale), window, rows_k, chunk)  # fmt: skip
    dq = _convert_dq_impl(dq_accum, float(scale), d, sq, cu_seqlens_q, max_seqlen_q, 0.0, query.dtype)
    return (dq.unsqueeze(0) if varlen else dq), dk, dv
