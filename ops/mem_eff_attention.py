"""The memory-efficient attention backward (``AttentionBackwardKernel``): a backend of
``ops.attention.efficient_attention_backward`` (``backend="mem_eff"``, and "auto" where the
sm90 kernel does not apply), taking its checked ``AttentionBackwardArgs``.

Any strides whose last is 1 (packed QKV, [B, H, M, K] transposed views). Grouped-query
heads (Hk dividing H) run on key / value repeated per query head, and grad_k / grad_v are
summed back over each group.

fp32 inputs run SIMT FMA matmuls (fp32 accuracy, no tensor cores). Head dims up to 512
for fp16 / bf16 (above 256: dK / dV accumulated in an fp32 workspace; on sm_80 shared
memory serves up to 384), up to 256 for fp32.

Attention bias: any tensor broadcastable to [B, H, Mq, Mk] in query's dtype (strides
of 0 for broadcast dims are read as such; a last stride of 1 with 128-bit aligned
strides takes cp.async, anything else one element per access); its gradient [B, H, Mq, Mk]
(``attention_common.grad_bias_buffer``). Not with cu_seqlens.

Dropout: the keep mask of torch's forward for ``philox_seed`` / ``philox_offset`` (int64
scalar tensors, CPU or CUDA; read on the host), redrawn per block with Philox4x32-10.
Bit-identical to torch for Mq * Mk and H * Mq * Mk below 2^31 (torch's kernels index
the stream with 32-bit products; ours are 64-bit).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import numpy as np
import torch
from torch import Tensor

from cute_kernels.mem_eff_attention import config as mem_eff_config
from cute_kernels.mem_eff_attention.attention_backward_kernel import AttentionBackwardKernel
from cute_kernels.mem_eff_attention.params import Params, choose_num_splits_key

from . import _compile as cc
from .attention_bwd_prepost import compute_delta, may_have_blind_rows, zero_blind_delta
from .attention_common import AttentionBackwardArgs, grad_bias_buffer, subtract_grad_lse

# ----------------------------------------------------------------------------- compile


@dataclass(frozen=True)
class MemEffConfig:
    """One compiled configuration, the ``compiled`` key: bias, its gradient and dropout are
    ``kernel_config``'s flags (``cute_kernels.mem_eff_attention.config.AttentionBackwardConfig``);
    ``computes_delta``: the kernel computes Δ itself; ``rng_on_device``: the dropout seed and
    offset are read from device tensors (``_compile.dropout_args``)."""

    dtype: type
    kernel_config: mem_eff_config.AttentionBackwardConfig
    varlen: bool
    computes_delta: bool
    arch: str
    rng_on_device: bool = False


def _build(config: MemEffConfig):
    """Compile one configuration (``MemEffConfig``)."""
    dtype, cfg, varlen = config.dtype, config.kernel_config, config.varlen
    vec = cfg.vec
    kernel = AttentionBackwardKernel(dtype, cfg, varlen, config.computes_delta)
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
    ws, ws_kv = _fake_workspaces(cfg)
    cu_q, cu_k = (cc.fake_tensor(cutlass.Int32, (cute.sym_int(),), 1) if varlen else None for _ in range(2))
    bias = grad_bias = None
    if cfg.has_bias:
        # aligned: last stride 1, the others multiples of 128 bits (0 for broadcast dims);
        # else any strides (a last stride of 0 broadcasts over keys)
        bias_vec = 128 // cfg.elem_bits if cfg.bias_aligned else 1
        bias = cc.fake_tensor(dtype, (b, h, mq, mk), bias_vec, leading_dim=-1 if cfg.bias_aligned else None)
    if cfg.grad_bias:
        grad_bias = cc.fake_tensor(dtype, (b, h, mq, mk), 128 // cfg.elem_bits)
    rng = cc.fake_rng_args(config.rng_on_device) if cfg.apply_dropout else (None,) * 5
    tensors = (q, k, v, o, do, lse, delta, gq, gk, gv, ws, ws_kv, cu_q, cu_k, bias, grad_bias)
    scalars = (cutlass.Float32(1.0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(1))
    return cc.compile_kernel(kernel, *tensors, *scalars, *rng, cc.fake_stream(), arch=config.arch)


def _fake_workspaces(cfg: mem_eff_config.AttentionBackwardConfig) -> tuple:
    """The fp32 dQ workspace [B * H, query blocks, words] and, with dK / dV outside the
    registers (head dims above 256), their accumulators [B * H, splits, 2 * words]."""
    words = cfg.grad_q_temp_storage_words
    ws = cute.runtime.make_fake_tensor(
        cutlass.Float32,
        (cute.sym_int(), cute.sym_int(), words),
        stride=(cute.sym_int64(divisibility=4), words, 1),
        assumed_align=16,
    )
    if cfg.output_in_rf:
        return ws, None
    kv_words = 2 * cfg.grad_kv_accum_words
    ws_kv = cute.runtime.make_fake_tensor(
        cutlass.Float32,
        (cute.sym_int(), cute.sym_int(), kv_words),
        stride=(cute.sym_int64(divisibility=4), kv_words, 1),
        assumed_align=16,
    )
    return ws, ws_kv


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
                cfg = mem_eff_config.attention_backward_config(dt.width, d, d, True, arch)
            except NotImplementedError:
                continue
            for varlen in (False, True):
                for computes_delta in (False, True):
                    compiled(MemEffConfig(dt, cfg, varlen, computes_delta, arch))
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
        cfg = mem_eff_config.attention_backward_config(dt.width, d, d, True, arch, **features)
        for computes_delta in (False, True):
            # the philox seed / offset as host values (the suite's forward runs outside capture)
            keys[MemEffConfig(dt, cfg, False, computes_delta, arch)] = None
    return list(keys)


def compile_for_benchmark_cases(cases, arch: str) -> int:
    """Compile ``benchmark_configurations(cases, arch)``; the count compiled."""
    keys = benchmark_configurations(cases, arch)
    for key in keys:
        compiled(key)
    return len(keys)


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
    cfg = mem_eff_config.attention_backward_config(elem_bits, dqk, dv, aligned, arch, **features)
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


def attention_backward_mem_eff(args: AttentionBackwardArgs):
    """(grad_q, grad_k, grad_v, grad_bias) on the memory-efficient kernel. Deterministic mode
    runs one key split: each query block's dQ is summed by one CTA, in order."""
    if args.deterministic:
        args = dataclasses.replace(args, num_splits_key=1)
    if args.key.shape[2] != args.query.shape[2]:
        return _backward_grouped(args)
    return _backward(args)


def _backward_grouped(args: AttentionBackwardArgs):
    """Grouped-query heads on the memory-efficient kernel (which has one key head per query
    head): key and value repeated per query head, dK and dV summed back over each group
    (in fp32)."""
    if args.shared_storage_dqdkdv:
        raise ValueError("shared_storage_dqdkdv needs as many key heads as query heads")
    hk = args.key.shape[2]
    group = args.query.shape[2] // hk
    key_x, value_x = (t.repeat_interleave(group, dim=2) for t in (args.key, args.value))
    grad_q, grad_k, grad_v, grad_bias = _backward(dataclasses.replace(args, key=key_x, value=value_x))
    grad_k, grad_v = (g.float().unflatten(2, (hk, group)).sum(3).to(g.dtype) for g in (grad_k, grad_v))
    return grad_q, grad_k, grad_v, grad_bias


def _backward(a: AttentionBackwardArgs):
    """The kernel's launches (``AttentionBackwardKernel``), one key head per query head."""
    query = a.query
    b, mq, h, dqk = query.shape
    mk, dv = a.key.shape[1], a.value.shape[3]
    seqs = a.cu_seqlens_q.numel() - 1 if a.varlen else b
    rows_q = int(a.max_seqlen_q) if a.varlen else mq
    rows_k = int(a.max_seqlen_k) if a.varlen else mk
    grads = _gradients(a)
    bias, grad_bias, bias_mode = _bias_parts(a)
    if min(b, h, mq, mk, dqk, dv, seqs) == 0 or rows_q == 0 or rows_k == 0:
        for g in grads + (() if grad_bias is None else (grad_bias,)):
            g.zero_()
        return (*grads, grad_bias)
    params = _plan_call(a, grads, seqs, rows_q, rows_k, bias_mode)
    cfg = params.cfg
    # Query rows no key block reaches (fully masked rows, empty key sequences) get no
    # dQ write: start from zeros there.
    if a.varlen or params.window_size > 0 or (params.custom_mask_type == 2 and rows_q > rows_k):
        grads[0].zero_()
    delta, computes_delta = _delta(a, params, seqs, rows_q, rows_k)
    workspace, workspace_kv = _workspaces(params, seqs * h, query.device)
    rng = (None,) * 5
    if a.dropout:
        rng = cc.dropout_args(a.dropout_p, a.philox_seed, a.philox_offset, rows_q, rows_k)
    on_device = a.dropout and cc.rng_on_device(a.philox_seed, a.philox_offset)
    arch = cc.device_arch(query.device.index)
    fn = compiled(MemEffConfig(cc.cute_dtype(query.dtype), cfg, a.varlen, computes_delta, arch, on_device))
    fn(
        query,
        a.key,
        a.value,
        a.out,
        a.grad_out,
        a.logsumexp,
        delta,
        *grads,
        workspace,
        workspace_kv,
        a.cu_seqlens_q,
        a.cu_seqlens_k,
        bias,
        grad_bias,
        float(a.scale),
        params.custom_mask_type,
        params.window_size,
        params.num_splits_key,
        *rng,
    )
    return (*grads, grad_bias)


def _gradients(a: AttentionBackwardArgs) -> tuple:
    """Fresh (grad_q, grad_k, grad_v), or views of one packed buffer (``shared_storage_dqdkdv``)."""
    query = a.query
    if not a.shared_storage_dqdkdv:
        return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (query, a.key, a.value))
    b, mq, h, dqk = query.shape
    if mq != a.key.shape[1] or dqk != a.value.shape[3]:
        raise ValueError("shared_storage_dqdkdv needs queries and keys of one length and one head dim")
    packed = torch.empty((b, mq, 3, h, dqk), dtype=query.dtype, device=query.device)
    return tuple(packed.unbind(2))


def _bias_parts(a: AttentionBackwardArgs) -> tuple:
    """(bias as [B, H, Mq, Mk], its gradient's buffer, the plan's bias mode); Nones without a bias."""
    if a.bias is None:
        return None, None, None
    b, mq, h, _ = a.query.shape
    mk = a.key.shape[1]
    bias = a.bias.expand(b, h, mq, mk)  # a view: broadcast dims get stride 0
    grad_bias = grad_bias_buffer(a.query, mk, a.custom_mask_type) if a.bias_requires_grad else None
    vec = 128 // torch.finfo(a.query.dtype).bits
    return bias, grad_bias, (_bias_aligned(bias, vec), bool(a.bias_requires_grad))


def _plan_call(a: AttentionBackwardArgs, grads: tuple, seqs: int, rows_q: int, rows_k: int, bias_mode):
    """``_plan`` of this call: kIsAligned (128-bit accesses on every tensor: head dims,
    strides, addresses), the device's arch and multiprocessors."""
    query = a.query
    elem_bits = torch.finfo(query.dtype).bits
    tensors = (query, a.key, a.value, a.out, a.grad_out, *grads)
    aligned = cc.max_vector_elems(128, *((t, t.shape[-1]) for t in tensors)) * elem_bits == 128
    return _plan(
        elem_bits,
        query.shape[3],
        a.value.shape[3],
        aligned,
        cc.device_arch(query.device.index),
        seqs,
        query.shape[2],
        rows_q,
        rows_k,
        int(a.custom_mask_type),
        a.window,
        a.varlen,
        a.num_splits_key,
        cc.num_sms(query.device.index),
        bias_mode,
        a.dropout,
    )


def _delta(a: AttentionBackwardArgs, params, seqs: int, rows_q: int, rows_k: int) -> tuple:
    """(Δ, whether the kernel computes it): rows that see no key may hold an unwritten O
    (``zero_blind_delta``): their Δ is zeroed after its own launch, so the kernel does not
    compute it there. A loss on the logsumexp (``grad_lse``) takes Δ - dLSE, computed here."""
    mask, window = params.custom_mask_type, params.window_size
    blind_rows = may_have_blind_rows(mask, window, rows_q, rows_k, a.varlen)
    in_kernel = params.cfg.kernel_computes_delta and params.num_splits_key == 1
    if in_kernel and not blind_rows and a.grad_lse is None:
        h = a.query.shape[2]
        return torch.empty((seqs, h, rows_q), dtype=torch.float32, device=a.query.device), True
    if a.varlen:
        delta = compute_delta(a.out[0], a.grad_out[0], a.cu_seqlens_q, rows_q)
    else:
        delta = compute_delta(a.out, a.grad_out, None, None)
    if a.grad_lse is not None:  # before the blind rows' zeros: their LSE is a constant 0
        subtract_grad_lse(delta, a.grad_lse, a.cu_seqlens_q)
    zero_blind_delta(delta, mask, window, a.query.shape[1], a.key.shape[1], a.cu_seqlens_q, a.cu_seqlens_k)
    return delta, False


def _workspaces(params, heads: int, device) -> tuple:
    """The fp32 dQ workspace (zeroed where the plan needs it) and, with dK / dV outside the
    registers, each split's dK_j / dV_j accumulators (no zeroing: the first query block stores)."""
    cfg = params.cfg
    alloc = torch.zeros if params.should_zero_workspace() else torch.empty
    workspace = alloc(
        (heads, params.num_query_blocks(), cfg.grad_q_temp_storage_words), dtype=torch.float32, device=device
    )
    workspace_kv = None
    if not cfg.output_in_rf:
        words = 2 * cfg.grad_kv_accum_words
        workspace_kv = torch.empty((heads, params.num_splits_key, words), dtype=torch.float32, device=device)
    return workspace, workspace_kv
