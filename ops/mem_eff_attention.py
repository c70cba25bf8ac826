"""Torch face of the memory-efficient attention backward (``AttentionBackwardKernel``).

``efficient_attention_backward`` is a drop-in for
``torch.ops.aten._efficient_attention_backward``: same arguments, same layouts
(query [B, Mq, H, K], key [B, Mk, H, K], value [B, Mk, H, Kv], out / grad_out
[B, Mq, H, Kv], logsumexp fp32 [B, H, >= Mq]; with cu_seqlens B == 1, rows packed,
logsumexp [sequences, H, >= max_seqlen_q]), same outputs (grad_q, grad_k, grad_v,
grad_bias). Any strides whose last is 1 (packed QKV, [B, H, M, K] transposed views).
Beyond aten: key / value may have Hk heads, Hk dividing H (grouped-query / multi-query
attention, key head j serving query heads j*H/Hk ..); grad_k / grad_v then sum over each
group (the memory-efficient kernel runs on key / value repeated per query head).

fp32 inputs run SIMT FMA matmuls (fp32 accuracy, no tensor cores). Head dims up to 512
for fp16 / bf16 (above 256: dK / dV accumulated in an fp32 workspace; on sm_80 shared
memory serves up to 384), up to 256 for fp32.

Attention bias: any tensor broadcastable to [B, H, Mq, Mk] in query's dtype (strides
of 0 for broadcast dims are read as such; a last stride of 1 with 128-bit aligned
strides takes cp.async, anything else one element per access). With
``bias_requires_grad`` grad_bias has the bias's shape: [B, H, Mq, Mk] for a 4-D bias
(as aten, also when expanded), else summed over the broadcast dims. Not with cu_seqlens.

Dropout: the keep mask of torch's forward for ``philox_seed`` / ``philox_offset`` (int64
scalar tensors, CPU or CUDA; read on the host), redrawn per block with Philox4x32-10.
Bit-identical to torch for Mq * Mk and H * Mq * Mk below 2^31 (torch's kernels index
the stream with 32-bit products; ours are 64-bit).

Backends (``backend=``): "mem_eff" is the kernel above; "sm90" the Hopper-native one
(``ops.attention_sm90``: sm_90a, fp16 / bf16, head dims 64 / 96 / 128 / 192 / 256, V's may differ from Q's / K's
(layouts.attention_sm90.HEAD_DIM_PAIRS),
masks 0 / 1 / 2 with or without a window, grouped-query heads, deterministic mode,
variable lengths, bias (with its gradient; not with variable lengths), dropout with this
module's mask, TMA-aligned inputs; no fp32, key splits or shared dQ / dK / dV storage);
"auto" (default) takes sm90 where it applies, else mem_eff.
Asking for "sm90" where it does not apply raises NotImplementedError with the reason.
The choice is logged at DEBUG on logger ``cute_kernels.attention`` (one line per call).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Optional, Tuple

import cutlass
import cutlass.cute as cute
import numpy as np
import torch
from torch import Tensor

from cute_kernels.mem_eff_attention.attention_backward_kernel import AttentionBackwardKernel
from cute_kernels.mem_eff_attention.params import Params, choose_num_splits_key
from layouts import mem_eff_attention as tiling
from layouts.attention_bwd_prepost import round_up

from . import _compile as cc
from . import attention_sm90 as sm90
from ._validate import check_cuda, check_dtype, check_float, check_same_device, check_tensor, validate_once

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BACKENDS = ("auto", "sm90", "mem_eff")

log = logging.getLogger("cute_kernels.attention")


# ----------------------------------------------------------------------------- compile


def _build(
    dtype,
    cfg: tiling.AttentionBackwardConfig,
    varlen: bool,
    computes_delta: bool,
    arch: str,
    rng_on_device: bool = False,
):
    """Compile one configuration; bias, its gradient and dropout are the config's flags.
    ``rng_on_device``: the dropout seed and offset are read from device tensors (``_compile.dropout_args``)."""
    vec = cfg.vec
    kernel = AttentionBackwardKernel(dtype, cfg, varlen, computes_delta)
    b, h, mq, mk, dqk, dv = (cute.sym_int() for _ in range(6))
    # One fake per argument: each gets its own symbolic strides (packed QKV views,
    # transposed grad_out, gradients laid out unlike the inputs).
    q, gq = (cc.fake_tensor(dtype, (b, mq, h, dqk), vec) for _ in range(2))
    k, gk = (cc.fake_tensor(dtype, (b, mk, h, dqk), vec) for _ in range(2))
    v, gv = (cc.fake_tensor(dtype, (b, mk, h, dv), vec) for _ in range(2))
    o, do = (cc.fake_tensor(dtype, (b, mq, h, dv), vec) for _ in range(2))
    seqs, lq = cute.sym_int(), cute.sym_int()
    lse = cc.fake_tensor(cutlass.Float32, (seqs, h, lq), 1)
    delta = cc.fake_tensor(cutlass.Float32, (seqs, h, cute.sym_int()), 1)
    words = cfg.grad_q_temp_storage_words
    ws = cute.runtime.make_fake_tensor(
        cutlass.Float32,
        (cute.sym_int(), cute.sym_int(), words),
        stride=(cute.sym_int64(divisibility=4), words, 1),
        assumed_align=16,
    )
    ws_kv = None  # dK / dV accumulators (head dims above 256): [B * H, splits, 2 * words]
    if not cfg.output_in_rf:
        kv_words = 2 * cfg.grad_kv_accum_words
        ws_kv = cute.runtime.make_fake_tensor(
            cutlass.Float32,
            (cute.sym_int(), cute.sym_int(), kv_words),
            stride=(cute.sym_int64(divisibility=4), kv_words, 1),
            assumed_align=16,
        )
    cu_q, cu_k = (cc.fake_tensor(cutlass.Int32, (cute.sym_int(),), 1) if varlen else None for _ in range(2))
    bias = grad_bias = None
    if cfg.has_bias:
        # aligned: last stride 1, the others multiples of 128 bits (0 for broadcast dims);
        # else any strides (a last stride of 0 broadcasts over keys)
        bias_vec = 128 // cfg.elem_bits if cfg.bias_aligned else 1
        bias = cc.fake_tensor(dtype, (b, h, mq, mk), bias_vec, leading_dim=-1 if cfg.bias_aligned else None)
    if cfg.grad_bias:
        grad_bias = cc.fake_tensor(dtype, (b, h, mq, mk), 128 // cfg.elem_bits)
    rng = cc.fake_rng_args(rng_on_device) if cfg.apply_dropout else (None,) * 5
    return cc.compile_kernel(
        kernel,
        q,
        k,
        v,
        o,
        do,
        lse,
        delta,
        gq,
        gk,
        gv,
        ws,
        ws_kv,
        cu_q,
        cu_k,
        bias,
        grad_bias,
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(0),
        cutlass.Int32(1),
        *rng,
        cc.fake_stream(),
        arch=arch,
    )


compiled = cc.CompileCache("mem_eff_attention_bwd", _build)


def _build_dropout_mask(arch: str):
    from cute_kernels.mem_eff_attention.dropout_mask import DropoutMaskKernel

    s = [cute.sym_int() for _ in range(4)]
    mask = cute.runtime.make_fake_tensor(
        cutlass.Uint8, tuple(s), stride=(cute.sym_int64(), cute.sym_int64(), cute.sym_int64(), 1), assumed_align=1
    )
    return cc.compile_kernel(
        DropoutMaskKernel(), mask, cutlass.Int64(0), cutlass.Int64(0), cutlass.Float32(0.5), cc.fake_stream(), arch=arch
    )


compiled_dropout_mask = cc.CompileCache("mem_eff_dropout_mask", _build_dropout_mask)


def mem_eff_dropout_mask(shape, dropout_p: float, philox_seed: int, philox_offset: int, device=None) -> Tensor:
    """The keep mask [B, H, Mq, Mk] (bool) torch's memory-efficient attention draws for
    (seed, offset), from our Philox (the backward's device function): for tests and
    debugging. ``torch.ops.aten._fill_mem_eff_dropout_mask_`` gives torch's uniforms."""
    b, h, mq, mk = (int(x) for x in shape)
    mask = torch.empty((b, h, mq, mk), dtype=torch.uint8, device=device or "cuda")
    if mask.numel():
        fn = compiled_dropout_mask(cc.device_arch(mask.device.index))
        fn(mask, int(philox_seed), int(philox_offset), float(np.float32(dropout_p)))
    return mask.bool()


def compile_configurations(arch: str, dtypes=(cutlass.Float16, cutlass.BFloat16), head_dims=(64, 128, 256, 512)) -> int:
    """Compile the configurations serving ``head_dims`` (CPU compile checks, benchmarks).

    Head dims whose tiles the arch's shared memory cannot hold (above 384 on sm_80:
    the config raises NotImplementedError) are skipped."""
    n = 0
    for dt in dtypes:
        for d in head_dims:
            try:
                cfg = tiling.attention_backward_config(dt.width, d, d, True, arch)
            except NotImplementedError:
                continue
            for varlen in (False, True):
                for computes_delta in (False, True):
                    compiled(dt, cfg, varlen, computes_delta, arch, False)
                    n += 1
    return n


def benchmark_configurations(cases, arch: str) -> list:
    """The compile keys of ``compiled`` the ``attention_bwd`` suite runs, each once: ((B, H, S, D),
    dtype, causal[, feature]) with feature None, "bias", "bias_grad" or "dropout" (the suite's
    dense [B, H, S, S] bias)."""
    keys = {}
    for (_, _, _, d), dtype_name, _, *feature in cases:
        feature = feature[0] if feature else None
        features = {
            None: {},
            "dropout": dict(apply_dropout=True),
            "bias": dict(has_bias=True, bias_aligned=True),
            "bias_grad": dict(has_bias=True, bias_aligned=True, grad_bias=True),
        }[feature]
        dt = cc.cute_dtype(getattr(torch, dtype_name))
        cfg = tiling.attention_backward_config(dt.width, d, d, True, arch, **features)
        for computes_delta in (False, True):
            # the philox seed / offset as host values (the suite's forward runs outside capture)
            keys[(dt, cfg, False, computes_delta, arch, False)] = None
    return list(keys)


def compile_for_benchmark_cases(cases, arch: str) -> int:
    """Compile ``benchmark_configurations(cases, arch)``; the count compiled."""
    keys = benchmark_configurations(cases, arch)
    for key in keys:
        compiled(*key)
    return len(keys)


# -------------------------------------------------------------------------- validation


def _check_rank4(name: str, t: Tensor) -> None:
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape {tuple(t.shape)}")
    if t.shape[-1] > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


def _is_int(x) -> bool:
    """A Python / numpy / symbolic int, not a bool (int() would take floats and strings too)."""
    return not isinstance(x, bool) and hasattr(x, "__index__")


def _check_inputs(grad_out, query, key, value, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, logsumexp):
    for name, t in (("query", query), ("key", key), ("value", value), ("out", out), ("grad_out", grad_out)):
        check_cuda(name, t)
        check_same_device(name, t, query)
        _check_rank4(name, t)
        check_dtype(name, t, INPUT_DTYPES)
        if t.dtype != query.dtype:
            raise TypeError(f"{name} must have the dtype of query ({query.dtype}), got {t.dtype}")
    b, mq, h, dqk = query.shape
    mk, hk = key.shape[1], key.shape[2]
    dv = value.shape[3]
    # grouped-query heads: each key / value head serves h // hk consecutive query heads
    if hk < 1 or h % hk:
        raise ValueError(
            f"key must have a number of heads that divides query's {h} (grouped-query heads), got shape {tuple(key.shape)}"
        )
    expect = {
        "key": (b, mk, hk, dqk),
        "value": (b, mk, hk, dv),
        "out": (b, mq, h, dv),
        "grad_out": (b, mq, h, dv),
    }
    for name, t in (("key", key), ("value", value), ("out", out), ("grad_out", grad_out)):
        if tuple(t.shape) != expect[name]:
            raise ValueError(
                f"{name} must have shape {expect[name]} (from query {tuple(query.shape)} and key/value), got {tuple(t.shape)}"
            )
    check_cuda("logsumexp", logsumexp)
    check_same_device("logsumexp", logsumexp, query)
    if logsumexp.dtype != torch.float32:
        raise TypeError(f"logsumexp must be float32, got {logsumexp.dtype}")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if cu_seqlens_q is not None:
        if b != 1:
            raise ValueError(f"with cu_seqlens the batch dimension of query must be 1, got {b}")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            check_cuda(name, cu)
            check_same_device(name, cu, query)
            if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
                raise ValueError(
                    f"{name} must be a 1-D int32 tensor of sequences + 1 offsets, got {cu.dtype} {tuple(cu.shape)}"
                )
            if cu.stride(0) != 1:
                raise ValueError(f"{name} must be contiguous, got stride {cu.stride(0)}")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if not _is_int(m) or int(m) < 0:
                raise ValueError(f"{name} must be a non-negative int with cu_seqlens, got {m!r}")
        seqs = cu_seqlens_q.numel() - 1
        rows_q = int(max_seqlen_q)
    else:
        seqs, rows_q = b, mq
    if logsumexp.dim() != 3 or logsumexp.shape[0] != seqs or logsumexp.shape[1] != h or logsumexp.shape[2] < rows_q:
        raise ValueError(
            f"logsumexp must have shape [{seqs}, {h}, >= {rows_q}] (sequences, heads, queries), got {tuple(logsumexp.shape)}"
        )
    if logsumexp.stride(-1) != 1:
        raise ValueError("logsumexp must be contiguous along queries")


def _check_bias(bias: Tensor, query: Tensor, key: Tensor, cu_seqlens_q, name: str = "bias") -> None:
    """A tensor on query's device, of its dtype, that broadcasts to [B, H, Mq, Mk]; no variable lengths."""
    check_same_device(name, bias, query)
    if bias.dtype != query.dtype:
        raise TypeError(f"{name} must have the dtype of query ({query.dtype}), got {bias.dtype}")
    if cu_seqlens_q is not None:
        raise NotImplementedError(f"{name} with cu_seqlens is not supported (torch's forward refuses it too)")
    b, mq, h, _ = query.shape
    full = (b, h, mq, key.shape[1])
    try:
        ok = bias.dim() <= 4 and torch.broadcast_shapes(tuple(bias.shape), full) == full
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(bias.shape)} does not broadcast to [B, H, Mq, Mk] = {full}")


# ------------------------------------------------------------------------------ launch


@functools.lru_cache(maxsize=1024)
def _plan(
    elem_bits,
    dqk,
    dv,
    aligned,
    arch,
    seqs,
    h,
    rows_q,
    rows_k,
    mask_type,
    window,
    varlen,
    num_splits_key,
    sms,
    bias_mode=None,
    dropout=False,
):
    """Config, split count and checked Params of one problem shape (kept off the per-call path).

    ``bias_mode``: None, or (bias_aligned, grad_bias)."""
    features = dict(apply_dropout=bool(dropout))
    if bias_mode is not None:
        features.update(has_bias=True, bias_aligned=bias_mode[0], grad_bias=bias_mode[1])
    cfg = tiling.attention_backward_config(elem_bits, dqk, dv, aligned, arch, **features)
    params = Params(
        cfg,
        seqs,
        h,
        rows_q,
        rows_k,
        dqk,
        dv,
        mask_type,
        window,
        varlen=varlen,
        dropout_prob=0.5 if dropout else 0.0,
        has_bias=bias_mode is not None,
    )
    # An explicit split count is clamped to one split per key block, as torch's launcher does.
    params.num_splits_key = (
        choose_num_splits_key(params, sms) if num_splits_key is None else min(num_splits_key, params.max_splits_key())
    )
    params.check_supported()
    return params


def _bias_aligned(bias: Tensor, vec: int) -> bool:
    """BiasLoader's 128-bit path: last stride 1, the others and the address multiples of
    128 bits, rows a whole number of vectors (a vector never crosses the row's end)."""
    if bias.shape[-1] % vec or bias.stride(-1) != 1 or bias.data_ptr() % 16:
        return False
    return all(st % vec == 0 for n, st in zip(bias.shape[:-1], bias.stride()[:-1]) if n > 1)


def grad_bias_buffer(query: Tensor, mk: int, mask_type: int) -> Tensor:
    """The bias gradient [B, H, Mq, Mk] either backend writes: rows padded to 128 bits, as
    torch pads them (the memory-efficient epilogue's vector stores; the sm90 kernel's TMA
    stores need 16-byte rows too); zeros where a mask may leave tiles unvisited."""
    b, mq, h, _ = query.shape
    padded = round_up(mk, 128 // torch.finfo(query.dtype).bits)
    alloc = torch.zeros if int(mask_type) != 0 else torch.empty  # masked tiles are never written
    return alloc((b, h, mq, padded), dtype=query.dtype, device=query.device)[..., :mk]


def _check_call(
    grad_out,
    query,
    key,
    value,
    bias,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    logsumexp,
    custom_mask_type,
    bias_requires_grad,
    window_size,
    num_splits_key,
    deterministic,
):
    """efficient_attention_backward's checks of tensor metadata and flags (the per-call
    values, dropout_p, scale and the philox tensors, are checked at each call)."""
    for name, t in (
        ("grad_out_", grad_out),
        ("query", query),
        ("key", key),
        ("value", value),
        ("out", out),
        ("logsumexp", logsumexp),
    ):
        check_tensor(name, t)
    if bias_requires_grad and bias is None:
        raise ValueError("bias_requires_grad needs a bias")
    if not _is_int(custom_mask_type) or int(custom_mask_type) not in (0, 1, 2):
        raise ValueError(
            f"custom_mask_type must be 0 (none), 1 (causal from top-left) or 2 (causal from bottom-right), got {custom_mask_type!r}"
        )
    if window_size is not None and (not _is_int(window_size) or int(window_size) < 0):
        raise ValueError(f"window_size must be None or a non-negative int, got {window_size!r}")
    if window_size is not None and int(window_size) > 0 and int(custom_mask_type) == 0:
        raise ValueError("window_size needs a causal custom_mask_type (1 or 2)")
    if num_splits_key is not None and (not _is_int(num_splits_key) or int(num_splits_key) < 1):
        raise ValueError(f"num_splits_key must be a positive int, got {num_splits_key!r}")
    if deterministic and num_splits_key is not None and int(num_splits_key) > 1:
        raise ValueError(
            f"deterministic needs num_splits_key None or 1 (key splits add dQ in any order), got {num_splits_key}"
        )
    _check_inputs(grad_out, query, key, value, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, logsumexp)
    if bias is not None:
        check_cuda("bias", bias)
        _check_bias(bias, query, key, cu_seqlens_q)
    limit = max_head_dim(query.dtype)
    if max(query.shape[-1], value.shape[-1]) > limit:
        raise NotImplementedError(
            f"head dims above {limit} are not implemented for {query.dtype} yet "
            f"(query's {query.shape[-1]}, value's {value.shape[-1]})"
        )


def max_head_dim(dtype: torch.dtype) -> int:
    """The largest head dim the memory-efficient backward takes (the widest of all backends)."""
    return tiling.MAX_K_FP32 if dtype == torch.float32 else tiling.MAX_K


def _check_backend(backend) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")


def _resolve_deterministic(deterministic) -> bool:
    """``deterministic=`` of the attention entry points: None follows torch's flag at the call."""
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool or None, got {deterministic!r}")
    return deterministic


def choose_backend(
    backend,
    grad_out,
    query,
    key,
    value,
    out,
    *,
    custom_mask_type=0,
    window_size=None,
    bias=None,
    dropout_p=0.0,
    num_splits_key=None,
    shared_storage_dqdkdv=False,
    arch=None,
) -> Tuple[str, str]:
    """(backend, why) for one backward: "sm90" or "mem_eff" and the reason, as logged.

    ``arch`` defaults to the device's, known only for real CUDA tensors (CPU, meta and
    fake tensors are never sm90 unless ``arch`` says so). NotImplementedError when
    ``backend == "sm90"`` and the sm90 path cannot take the problem."""
    _check_backend(backend)
    if backend == "mem_eff":
        return "mem_eff", "backend='mem_eff'"
    # what the op offers beyond unsupported()'s list: the sm90 kernel neither splits keys
    # nor writes dQ / dK / dV into one packed buffer
    if num_splits_key is not None:
        reason = f"num_splits_key={num_splits_key} (the sm90 path does not split keys)"
    elif shared_storage_dqdkdv:
        reason = "shared_storage_dqdkdv (the sm90 path has no packed dQ / dK / dV outputs)"
    else:
        reason = sm90.unsupported(
            query,
            key,
            value,
            grad_out,
            out,
            mask_type=int(custom_mask_type),
            window_size=window_size,
            bias=bias,
            dropout_p=float(dropout_p),
            arch=arch,
        )
    if reason is None:
        return "sm90", f"backend={backend!r}, supported"
    if backend == "sm90":
        raise NotImplementedError(f"backend='sm90' cannot take this attention backward: {reason}")
    return "mem_eff", f"backend='auto', not on sm90: {reason}"


def _impl(
    grad_out,
    query,
    key,
    value,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    logsumexp,
    custom_mask_type,
    scale,
    num_splits_key,
    window_size,
    shared_storage_dqdkdv,
    bias=None,
    bias_requires_grad=False,
    dropout_p=0.0,
    philox_seed=None,
    philox_offset=None,
    backend="auto",
    deterministic=False,
):
    """The backend choice (logged), then that backend's launches."""
    choice, why = choose_backend(
        backend,
        grad_out,
        query,
        key,
        value,
        out,
        custom_mask_type=custom_mask_type,
        window_size=window_size,
        bias=bias,
        dropout_p=dropout_p,
        num_splits_key=num_splits_key,
        shared_storage_dqdkdv=shared_storage_dqdkdv,
    )
    if log.isEnabledFor(logging.DEBUG):  # (the arguments cost host time on every call)
        b, mq, h, d = query.shape
        log.debug(
            "attention backward: %s (%s; B=%d Mq=%d Mk=%d H=%d D=%d mask %d)",
            choice,
            why,
            b,
            mq,
            key.shape[1],
            h,
            d,
            int(custom_mask_type),
        )
    if choice == "sm90":
        return sm90.attention_backward_sm90(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            scale,
            int(custom_mask_type),
            int(window_size or 0),
            deterministic=bool(deterministic),
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            bias=bias,
            bias_requires_grad=bool(bias_requires_grad),
            dropout_p=float(dropout_p),
            philox_seed=philox_seed,
            philox_offset=philox_offset,
        )
    if deterministic:  # one key split: each query block's dQ is summed by one CTA, in order
        num_splits_key = 1
    return _mem_eff_impl(
        grad_out,
        query,
        key,
        value,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        logsumexp,
        custom_mask_type,
        scale,
        num_splits_key,
        window_size,
        shared_storage_dqdkdv,
        bias,
        bias_requires_grad,
        dropout_p,
        philox_seed,
        philox_offset,
    )


def _mem_eff_impl(
    grad_out,
    query,
    key,
    value,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    logsumexp,
    custom_mask_type,
    scale,
    num_splits_key,
    window_size,
    shared_storage_dqdkdv,
    bias=None,
    bias_requires_grad=False,
    dropout_p=0.0,
    philox_seed=None,
    philox_offset=None,
):
    """The memory-efficient kernel (``AttentionBackwardKernel``)."""
    if key.shape[2] != query.shape[2]:
        return _mem_eff_grouped(
            grad_out,
            query,
            key,
            value,
            out,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            logsumexp,
            custom_mask_type,
            scale,
            num_splits_key,
            window_size,
            shared_storage_dqdkdv,
            bias,
            bias_requires_grad,
            dropout_p,
            philox_seed,
            philox_offset,
        )
    b, mq, h, dqk = query.shape
    mk, dv = key.shape[1], value.shape[3]
    varlen = cu_seqlens_q is not None
    seqs = cu_seqlens_q.numel() - 1 if varlen else b
    rows_q = int(max_seqlen_q) if varlen else mq
    rows_k = int(max_seqlen_k) if varlen else mk

    if shared_storage_dqdkdv:
        if mq != mk or dqk != dv:
            raise ValueError("shared_storage_dqdkdv needs queries and keys of one length and one head dim")
        packed = torch.empty((b, mq, 3, h, dqk), dtype=query.dtype, device=query.device)
        grad_q, grad_k, grad_v = packed.unbind(2)
    else:
        grad_q, grad_k, grad_v = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (query, key, value))
    grad_bias = None
    bias_mode = None
    vec = 128 // torch.finfo(query.dtype).bits
    if bias is not None:
        bias = bias.expand(b, h, mq, mk)  # a view: broadcast dims get stride 0
        if bias_requires_grad:
            grad_bias = grad_bias_buffer(query, mk, custom_mask_type)
        bias_mode = (_bias_aligned(bias, vec), bool(bias_requires_grad))
    if min(b, h, mq, mk, dqk, dv, seqs) == 0 or rows_q == 0 or rows_k == 0:
        for g in (grad_q, grad_k, grad_v) + (() if grad_bias is None else (grad_bias,)):
            g.zero_()
        return grad_q, grad_k, grad_v, grad_bias

    elem_bits = torch.finfo(query.dtype).bits
    arch = cc.device_arch(query.device.index)
    # kIsAligned: 128-bit accesses on every tensor (head dims, strides, addresses)
    tensors = (query, key, value, out, grad_out, grad_q, grad_k, grad_v)
    aligned = cc.max_vector_elems(128, *((t, t.shape[-1]) for t in tensors)) * elem_bits == 128
    dropout = float(dropout_p) > 0.0
    params = _plan(
        elem_bits,
        dqk,
        dv,
        aligned,
        arch,
        seqs,
        h,
        rows_q,
        rows_k,
        int(custom_mask_type),
        int(window_size or 0),
        varlen,
        num_splits_key,
        cc.num_sms(query.device.index),
        bias_mode,
        dropout,
    )
    cfg = params.cfg

    # Query rows no key block reaches (fully masked rows, empty key sequences) get no
    # dQ write: start from zeros there.
    unvisited = varlen or params.window_size > 0 or (params.custom_mask_type == 2 and rows_q > rows_k)
    if unvisited:
        grad_q.zero_()
    from .attention_bwd_prepost import compute_delta, may_have_blind_rows, zero_blind_delta

    # rows that see no key may hold an unwritten O (zero_blind_delta): their Δ is zeroed after
    # its own launch, so the kernel does not compute it there
    blind_rows = may_have_blind_rows(params.custom_mask_type, params.window_size, rows_q, rows_k, varlen)
    computes_delta = cfg.kernel_computes_delta and params.num_splits_key == 1 and not blind_rows
    if computes_delta:
        delta = torch.empty((seqs, h, rows_q), dtype=torch.float32, device=query.device)
    else:
        if varlen:
            delta = compute_delta(out[0], grad_out[0], cu_seqlens_q, rows_q)
        else:
            delta = compute_delta(out, grad_out, None, None)
        zero_blind_delta(delta, params.custom_mask_type, params.window_size, mq, mk, cu_seqlens_q, cu_seqlens_k)
    alloc = torch.zeros if params.should_zero_workspace() else torch.empty
    workspace = alloc(
        (seqs * h, params.num_query_blocks(), cfg.grad_q_temp_storage_words), dtype=torch.float32, device=query.device
    )
    workspace_kv = None
    if not cfg.output_in_rf:  # each split's dK_j / dV_j accumulators (no zeroing: first query block stores)
        workspace_kv = torch.empty(
            (seqs * h, params.num_splits_key, 2 * cfg.grad_kv_accum_words), dtype=torch.float32, device=query.device
        )
    rng = (None,) * 5
    if dropout:
        rng = cc.dropout_args(dropout_p, philox_seed, philox_offset, rows_q, rows_k)
    on_device = dropout and cc.rng_on_device(philox_seed, philox_offset)
    fn = compiled(cc.cute_dtype(query.dtype), cfg, varlen, computes_delta, arch, on_device)
    fn(
        query,
        key,
        value,
        out,
        grad_out,
        logsumexp,
        delta,
        grad_q,
        grad_k,
        grad_v,
        workspace,
        workspace_kv,
        cu_seqlens_q,
        cu_seqlens_k,
        bias,
        grad_bias,
        float(scale),
        params.custom_mask_type,
        params.window_size,
        params.num_splits_key,
        *rng,
    )
    return grad_q, grad_k, grad_v, grad_bias


def _mem_eff_grouped(
    grad_out,
    query,
    key,
    value,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    logsumexp,
    custom_mask_type,
    scale,
    num_splits_key,
    window_size,
    shared_storage_dqdkdv,
    *features,
):
    """Grouped-query heads on the memory-efficient kernel (which has one key head per query
    head): key and value repeated per query head, dK and dV summed back over each group
    (in fp32). ``features``: _mem_eff_impl's bias / dropout arguments, passed on."""
    if shared_storage_dqdkdv:
        raise ValueError("shared_storage_dqdkdv needs as many key heads as query heads")
    b, mk, hk, _ = key.shape
    group = query.shape[2] // hk
    key_x, value_x = (t.repeat_interleave(group, dim=2) for t in (key, value))
    grad_q, grad_k, grad_v, grad_bias = _mem_eff_impl(
        grad_out,
        query,
        key_x,
        value_x,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        logsumexp,
        custom_mask_type,
        scale,
        num_splits_key,
        window_size,
        shared_storage_dqdkdv,
        *features,
    )
    grad_k, grad_v = (g.float().unflatten(2, (hk, group)).sum(3).to(g.dtype) for g in (grad_k, grad_v))
    return grad_q, grad_k, grad_v, grad_bias


@torch.library.custom_op("cute_kernels::efficient_attention_backward", mutates_args=())
def _op(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    logsumexp: Tensor,
    custom_mask_type: int,
    scale: float,
    num_splits_key: Optional[int],
    window_size: Optional[int],
    shared_storage_dqdkdv: bool,
    bias: Optional[Tensor],
    bias_requires_grad: bool,
    dropout_p: float,
    philox_seed: Optional[Tensor],
    philox_offset: Optional[Tensor],
    backend: str,
    deterministic: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    # the backend is chosen here, at run time, on the real tensors (their device's arch)
    gq, gk, gv, gb = _impl(
        grad_out,
        query,
        key,
        value,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        logsumexp,
        custom_mask_type,
        scale,
        num_splits_key,
        window_size,
        shared_storage_dqdkdv,
        bias,
        bias_requires_grad,
        dropout_p,
        philox_seed,
        philox_offset,
        backend,
        deterministic,
    )
    # an op returns tensors: no bias gradient is an empty one (the wrapper gives None)
    return gq, gk, gv, query.new_empty((0,)) if gb is None else gb


@_op.register_fake
def _(
    grad_out,
    query,
    key,
    value,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    logsumexp,
    custom_mask_type,
    scale,
    num_splits_key,
    window_size,
    shared_storage_dqdkdv,
    bias,
    bias_requires_grad,
    dropout_p,
    philox_seed,
    philox_offset,
    backend,
    deterministic=False,
):
    gb = query.new_empty((0,))
    if bias is not None and bias_requires_grad:
        b, mq, h, _ = query.shape
        gb = query.new_empty((b, h, mq, key.shape[1]))
    # either backend: fresh contiguous [B, M, H, D] gradients, whatever the inputs' strides
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), gb


def efficient_attention_backward(
    grad_out_: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: Optional[Tensor],
    out: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    logsumexp: Tensor,
    dropout_p: float,
    philox_seed: Optional[Tensor],
    philox_offset: Optional[Tensor],
    custom_mask_type: int,
    bias_requires_grad: bool,
    *,
    scale: Optional[float] = None,
    num_splits_key: Optional[int] = None,
    window_size: Optional[int] = None,
    shared_storage_dqdkdv: bool = False,
    backend: str = "auto",
    deterministic: Optional[bool] = None,
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Our ``aten::_efficient_attention_backward``: (grad_q, grad_k, grad_v, grad_bias).

    ``backend``: "auto" (the sm90 kernel where it applies, else the memory-efficient
    one), "sm90" (NotImplementedError where it does not apply) or "mem_eff"; see the
    module notes. The choice is made when the backward runs (under torch.compile: at run
    time, on the real tensors).

    ``deterministic`` (default: ``torch.are_deterministic_algorithms_enabled()``): the
    gradients are the same bits from run to run. The sm90 kernel adds dQ's partial sums
    in key-block order (semaphores; slower), the memory-efficient kernel runs one key
    split (``num_splits_key`` must be None or 1)."""
    _check_backend(backend)
    deterministic = _resolve_deterministic(deterministic)
    check_float("dropout_p", dropout_p)
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    dropout = float(dropout_p) > 0.0
    if dropout:
        for name, t in (("philox_seed", philox_seed), ("philox_offset", philox_offset)):
            if not isinstance(t, Tensor) or t.numel() != 1 or t.dtype != torch.int64:
                raise ValueError(f"dropout needs {name} as the forward returned it (an int64 scalar tensor), got {t!r}")
    # what depends on tensor metadata and flags only: once per signature
    validate_once(
        (
            "eff_bwd",
            grad_out_,
            query,
            key,
            value,
            out,
            logsumexp,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            bias,
            bias_requires_grad,
            custom_mask_type,
            window_size,
            num_splits_key,
            deterministic,
        ),
        lambda: _check_call(
            grad_out_,
            query,
            key,
            value,
            bias,
            out,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            logsumexp,
            custom_mask_type,
            bias_requires_grad,
            window_size,
            num_splits_key,
            deterministic,
        ),
    )
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    check_float("scale", scale)
    args = (
        grad_out_,
        query,
        key,
        value,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        None if max_seqlen_q is None else int(max_seqlen_q),
        None if max_seqlen_k is None else int(max_seqlen_k),
        logsumexp,
        int(custom_mask_type),
        float(scale),
        None if num_splits_key is None else int(num_splits_key),
        None if window_size is None else int(window_size),
        bool(shared_storage_dqdkdv),
        bias,
        bool(bias_requires_grad),
        float(dropout_p),
        philox_seed if float(dropout_p) > 0.0 else None,
        philox_offset if float(dropout_p) > 0.0 else None,
        backend,
        deterministic,
    )
    grad_q, grad_k, grad_v, grad_bias = _impl(*args) if cc.eager(query) else _op(*args)
    if bias is None or not bias_requires_grad:
        return grad_q, grad_k, grad_v, None
    if tuple(bias.shape) != tuple(grad_bias.shape):  # a broadcast bias: autograd's gradient
        grad_bias = grad_bias.sum_to_size(bias.shape)
    return grad_q, grad_k, grad_v, grad_bias
