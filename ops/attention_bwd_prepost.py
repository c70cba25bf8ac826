"""Torch face of the attention-backward pre/post-processing kernels.

Tensors follow flash-attention's conventions:

* ``out``, ``grad_out`` (and the dQ / dK / dV outputs): [batch, seqlen, heads, head_dim]
  with any strides whose last is 1 (so [batch, heads, seqlen, head_dim] tensors pass as
  ``.transpose(1, 2)`` views), or packed [total, heads, head_dim] with ``cu_seqlens``
  (int32 [batch + 1], sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1]) and the
  longest sequence length ``max_seqlen``;
* Δ: [batch, heads, seqlen_rounded] fp32, seqlen_rounded = round_up(max seqlen, 128);
* the dQ accumulator: [(nsplits,) batch, seqlen_rounded, heads, head_dim_rounded] fp32,
  or [(nsplits,) total_q + 128 * batch, heads, head_dim_rounded] with variable lengths;
* dK / dV accumulators: [batch, heads_k, seqlen_k_rounded, head_dim_rounded] fp32.

head_dim_rounded = round_up(head_dim, 32); head dims 1..256. ``cu_seqlens`` must be
non-decreasing, start at 0 and end at ``total``, and ``max_seqlen`` must bound every
sequence: reading them back to check would cost a device synchronisation per call.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from cute_kernels.attention_bwd_prepost import config as prepost_config
from layouts import attention_bwd_prepost as tiling

from . import _compile as cc
from .attention_bwd_prepost_build import (  # the builds; the launches below look the caches up here
    compiled_clear_dkv_accum,
    compiled_compute_delta,
    compiled_convert_dkv,
    compiled_convert_dq,
    compiled_convert_dq_ready,
    compiled_preprocess,
)
from ._memo import Memo
from ._validate import (
    check_cuda,
    check_dtype,
    check_float,
    check_int,
    check_probability,
    check_same_device,
    check_tensor,
    validate_once,
)

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUTPUT_DTYPES = (torch.float16, torch.bfloat16)

seqlen_rounded = tiling.seqlen_rounded
head_dim_rounded = tiling.head_dim_rounded


# -------------------------------------------------------------------------- validation


def _check_last_contiguous(name, t):
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride {t.stride(-1)}); pass {name}.contiguous()")


def _check_cu_seqlens(name, cu, ref):
    check_same_device(name, cu, ref)
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor [batch + 1], got {cu.dtype} {tuple(cu.shape)}")
    if cu.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def _check_seq_pair(a_name, a, b_name, b, cu_seqlens, max_seqlen, dtypes=INPUT_DTYPES):
    """out / grad_out style inputs: same shape/dtype/device, [B,S,H,D] or [total,H,D] + cu_seqlens_q."""
    check_cuda(a_name, a)
    check_dtype(a_name, a, dtypes)
    check_same_device(b_name, b, a)
    if b.dtype != a.dtype:
        raise TypeError(f"{b_name} must have {a_name}'s dtype {a.dtype}, got {b.dtype}")
    if b.shape != a.shape:
        raise ValueError(f"{b_name} must have {a_name}'s shape {tuple(a.shape)}, got {tuple(b.shape)}")
    if cu_seqlens is None:
        if a.dim() != 4:
            raise ValueError(f"{a_name} must be [batch, seqlen, heads, head_dim], got shape {tuple(a.shape)}")
        if max_seqlen is not None:
            raise ValueError("max_seqlen_q is only used with cu_seqlens_q")
    else:
        if a.dim() != 3:
            raise ValueError(
                f"with cu_seqlens_q, {a_name} must be [total, heads, head_dim], got shape {tuple(a.shape)}"
            )
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens, a)
        if max_seqlen is None:
            raise ValueError("cu_seqlens_q needs max_seqlen_q (the longest sequence), which sizes the grid")
        check_int("max_seqlen_q", max_seqlen)
    d = a.shape[-1]
    if not 1 <= d <= tiling.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {tiling.MAX_HEAD_DIM}], got {d} (the last dim of {a_name})")
    _check_last_contiguous(a_name, a)
    _check_last_contiguous(b_name, b)


def _check_accum(name, t, rank_options, head_dim):
    check_cuda(name, t)
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.dim() not in rank_options:
        raise ValueError(f"{name} must have {' or '.join(map(str, rank_options))} dims, got shape {tuple(t.shape)}")
    dr = head_dim_rounded(head_dim)
    if t.shape[-1] != dr:
        raise ValueError(f"{name}'s last dim must be head_dim rounded up to 32 = {dr}, got {t.shape[-1]}")
    _check_last_contiguous(name, t)
    if any(s % 4 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1):
        raise ValueError(f"{name}'s strides must be multiples of 4 elements (16 bytes)")


def _check_aligned(name, t):
    """Accumulators are moved 16 bytes at a time. Checked at launch: a traced graph has no addresses."""
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned (data_ptr % 16 == {t.data_ptr() % 16})")


def _batch(x: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    return x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


def _max_seqlen(x: Tensor, cu_seqlens, max_seqlen) -> int:
    return x.shape[1] if cu_seqlens is None else int(max_seqlen)


def _vec(*tensors) -> int:
    d = tensors[0].shape[-1]
    return cc.max_vector_elems(tiling.MAX_VECTOR_BITS, *((t, d) for t in tensors))


# ----------------------------------------------------------------------- preprocessing


def dq_accum_shape(batch, seqlen_q, heads, head_dim, *, varlen=False, nsplits=None):
    """Shape of the fp32 dQ accumulator; ``seqlen_q`` is total_q with ``varlen``."""
    dr = head_dim_rounded(head_dim)
    rows = seqlen_q + tiling.VARLEN_ACCUM_PAD * batch if varlen else None
    shape = (rows, heads, dr) if varlen else (batch, seqlen_rounded(seqlen_q), heads, dr)
    return shape if nsplits is None else (nsplits,) + shape


def dkv_accum_shape(batch, heads_k, max_seqlen_k, head_dim):
    return (batch, heads_k, seqlen_rounded(max_seqlen_k), head_dim_rounded(head_dim))


def _meta(t):
    """What a launch plan depends on: shape, strides, dtype, device, 16-byte misalignment."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


_plans = Memo()


def _cached_plan(key, make):
    """Launch plans (compiled function, grid) by metadata: a repeated call is a dict lookup."""
    plan = _plans.get(key)
    if plan is None:
        plan = _plans.put(key, make())
    return plan


def launch_preprocess(
    out,
    grad_out,
    delta,
    dq_accum,
    scale,
    cu_seqlens_q,
    max_seqlen_q,
    lse=None,
    lse_log2=None,
    grad_lse=None,
    sink=None,
    sink_terms=None,
):
    """compute_dot_do_o into preallocated Δ (and dQ accumulator to clear, or None; and the
    forward's LSE ``lse`` in log2 units into ``lse_log2``, shaped as Δ, or None; with the LSE's
    gradient ``grad_lse``, shaped as ``lse``, Δ - grad_lse on each sequence's rows; with a
    learnable sink, fp32 [H] ``sink``, its gradient's row terms into ``sink_terms``, shaped as Δ)."""
    key = (
        "pre",
        _meta(out),
        _meta(grad_out),
        _meta(delta),
        _meta(dq_accum),
        cu_seqlens_q is None,
        max_seqlen_q,
        _meta(lse),
        _meta(lse_log2),
        _meta(grad_lse),
        _meta(sink),
        _meta(sink_terms),
    )
    flags = (lse is not None, grad_lse is not None, sink is not None)
    plan = _cached_plan(
        key, lambda: _plan_preprocess(out, grad_out, delta, dq_accum, cu_seqlens_q, max_seqlen_q, *flags)
    )
    if plan is None:
        for t in (delta, lse_log2, sink_terms):
            if t is not None and t.numel():
                t.zero_()
        return
    fn, num_m_blocks = plan
    if num_m_blocks:
        tensors = (out, grad_out, delta, dq_accum, cu_seqlens_q, lse, lse_log2, grad_lse, sink, sink_terms)
        fn(*tensors, float(scale), num_m_blocks)


def _plan_preprocess(
    out, grad_out, delta, dq_accum, cu_seqlens_q, max_seqlen_q, lse_log2=False, grad_lse=False, sink=False
):
    if dq_accum is not None:
        _check_aligned("dq_accum", dq_accum)
    if out.numel() == 0 and dq_accum is None:
        return None  # Δ is all zeros
    d = out.shape[-1]
    vec = _vec(out, grad_out)
    dev = out.device.index
    arch = cc.device_arch(dev)
    varlen = cu_seqlens_q is not None
    t = tiling.preprocess_tiles(8 * out.element_size(), d, vec, arch)
    rows = delta.shape[2]
    if dq_accum is not None and varlen:
        rows = max(rows, int(max_seqlen_q) + tiling.VARLEN_ACCUM_PAD)
    num_m_blocks = t.ctas_along_rows(rows)
    if delta.shape[0] == 0 or delta.shape[1] == 0:
        num_m_blocks = 0
    clear = dq_accum is not None
    fn = compiled_preprocess(cc.cute_dtype(out.dtype), t.head_dim, vec, varlen, clear, arch, lse_log2, grad_lse, sink)
    return fn, num_m_blocks


def delta_shape(batch: int, heads: int, max_seqlen_q: int) -> tuple:
    """Shape of Δ (and of the LSE in log2 units): [batch or sequences, heads, seqlen_rounded]."""
    return (batch, heads, seqlen_rounded(max_seqlen_q))


def clears_dq_accum(head_dim: int, dq_head_dim: int) -> bool:
    """Whether the preprocess launch can zero a dQ accumulator ``dq_head_dim`` wide beside Δ
    of out's ``head_dim``: the fused clear walks out's width, rounded (else zero it apart)."""
    return head_dim_rounded(dq_head_dim) == head_dim_rounded(head_dim)


def _preprocess_impl(out, grad_out, scale, cu_seqlens_q, max_seqlen_q, zero_dq_accum, dq_head_dim=None, lse=None):
    """``dq_head_dim``: the query's head dim where it differs from out's (Dqk != Dv); the
    accumulator then has its width and is zeroed apart (the fused clear walks out's width).
    ``lse``: the forward's [B, H, >= Sq] LSE; then a third result, LSE * log2(e) shaped as Δ
    (0 past each sequence's end), from the same launch."""
    b = _batch(out, cu_seqlens_q)
    h, d = out.shape[-2], out.shape[-1]
    shape_delta = delta_shape(b, h, _max_seqlen(out, cu_seqlens_q, max_seqlen_q))
    delta = torch.empty(shape_delta, dtype=torch.float32, device=out.device)
    lse_log2 = None if lse is None else torch.empty(shape_delta, dtype=torch.float32, device=out.device)
    dq_accum = None
    if zero_dq_accum:
        varlen = cu_seqlens_q is not None
        dq_d = d if dq_head_dim is None else dq_head_dim
        shape = dq_accum_shape(b, out.shape[0] if varlen else out.shape[1], h, dq_d, varlen=varlen)
        if not clears_dq_accum(d, dq_d):
            dq_accum = torch.zeros(shape, dtype=torch.float32, device=out.device)
            launch_preprocess(out, grad_out, delta, None, scale, cu_seqlens_q, max_seqlen_q, lse, lse_log2)
            return (delta, dq_accum) if lse is None else (delta, dq_accum, lse_log2)
        dq_accum = torch.empty(shape, dtype=torch.float32, device=out.device)
    launch_preprocess(out, grad_out, delta, dq_accum, scale, cu_seqlens_q, max_seqlen_q, lse, lse_log2)
    if dq_accum is None:
        dq_accum = delta.new_empty((0,))
    return (delta, dq_accum) if lse is None else (delta, dq_accum, lse_log2)


@torch.library.custom_op("cute_kernels::attention_bwd_preprocess", mutates_args=())
def _preprocess_op(
    out: Tensor,
    grad_out: Tensor,
    scale: float,
    cu_seqlens_q: Optional[Tensor],
    max_seqlen_q: Optional[int],
    zero_dq_accum: bool,
) -> Tuple[Tensor, Tensor]:
    return _preprocess_impl(out, grad_out, scale, cu_seqlens_q, max_seqlen_q, zero_dq_accum)


@_preprocess_op.register_fake
def _(out, grad_out, scale, cu_seqlens_q, max_seqlen_q, zero_dq_accum):
    b = _batch(out, cu_seqlens_q)
    h, d = out.shape[-2], out.shape[-1]
    delta = out.new_empty(delta_shape(b, h, _max_seqlen(out, cu_seqlens_q, max_seqlen_q)), dtype=torch.float32)
    if not zero_dq_accum:
        return delta, out.new_empty((0,), dtype=torch.float32)
    varlen = cu_seqlens_q is not None
    shape = dq_accum_shape(b, out.shape[0] if varlen else out.shape[1], h, d, varlen=varlen)
    return delta, out.new_empty(shape, dtype=torch.float32)


def attention_bwd_preprocess(
    out: Tensor,
    grad_out: Tensor,
    *,
    scale: float = 1.0,
    cu_seqlens_q: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    zero_dq_accum: bool = False,
):
    """Δ = scale * rowsum(grad_out * out) in fp32, [batch, heads, seqlen_q_rounded].

    ``scale`` is the keep probability 1 - p when the forward used dropout (flash-
    attention's convention), else 1. Rows past a sequence's end read as zero. With
    ``zero_dq_accum`` the same launch also returns a zeroed fp32 dQ accumulator
    (``dq_accum_shape``) and the result is ``(delta, dq_accum)``.
    """
    validate_once(
        ("pre", out, grad_out, cu_seqlens_q, max_seqlen_q),
        lambda: _check_seq_pair("out", out, "grad_out", grad_out, cu_seqlens_q, max_seqlen_q),
    )
    check_float("scale", scale)
    if cc.eager(out):
        delta, dq_accum = _preprocess_impl(out, grad_out, float(scale), cu_seqlens_q, max_seqlen_q, bool(zero_dq_accum))
    else:
        delta, dq_accum = _preprocess_op(out, grad_out, float(scale), cu_seqlens_q, max_seqlen_q, bool(zero_dq_accum))
    return (delta, dq_accum) if zero_dq_accum else delta


# -------------------------------------------------------------------- compute_delta


def compute_delta(out, grad_out, cu_seqlens_q, max_seqlen_q):
    """``attention_bwd_compute_delta`` unchecked (the attention backwards' own call)."""
    b = _batch(out, cu_seqlens_q)
    h = out.shape[-2]
    s = _max_seqlen(out, cu_seqlens_q, max_seqlen_q)
    varlen = cu_seqlens_q is not None
    # packed sequences shorter than max_seqlen leave rows unwritten: start from zeros
    delta = (torch.zeros if varlen else torch.empty)((b, h, s), dtype=torch.float32, device=out.device)
    if delta.numel() == 0 or out.numel() == 0:
        return delta.zero_()
    key = ("delta", _meta(out), _meta(grad_out), varlen)
    fn = _cached_plan(
        key,
        lambda: compiled_compute_delta(
            cc.cute_dtype(out.dtype),
            tiling.delta_head_dim_rounded(out.shape[-1]),
            _vec(out, grad_out),
            varlen,
            cc.device_arch(out.device.index),
        ),
    )
    fn(grad_out, out, delta, cu_seqlens_q)
    return delta


def may_have_blind_rows(mask_type: int, window: int, seqlen_q: int, seqlen_k: int, packed: bool) -> bool:
    """Whether some query row may see no key (``zero_blind_delta``): a bottom-right mask with
    more queries than keys (any packed sequence may have them), or a window."""
    return window > 0 or (mask_type == 2 and (packed or seqlen_q > seqlen_k))


def zero_blind_delta(
    delta: Tensor,
    mask_type: int,
    window: int,
    seqlen_q: int,
    seqlen_k: int,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
) -> None:
    """Δ := 0 in the query rows that see no key, in place. A forward may leave O unwritten
    there: torch's memory-efficient forward does for head dims above 128 (whole query blocks of
    a bottom-right mask with Sq > Sk; compute-sanitizer's initcheck flags the reads), and with
    P = 0 in such a row dS = P (dP - Δ) is NaN wherever Δ is. ``delta`` [sequences, H, rows];
    row q sees keys (q + offset - window, q + offset] of [0, Sk) (offset Sk - Sq bottom-right,
    else 0; without a window the left end is open). No mask: every row sees every key. Dense
    rows are slices (nothing to do unless bottom-right Sq > Sk or a window ends before the
    last rows); packed sequences take one masked fill when bottom-right or windowed."""
    if not may_have_blind_rows(mask_type, window, seqlen_q, seqlen_k, cu_seqlens_q is not None):
        return
    if cu_seqlens_q is None:
        offset = seqlen_k - seqlen_q if mask_type == 2 else 0
        first = max(0, -offset)  # rows q < first: q + offset < 0
        if first > 0:
            delta[..., :first].zero_()
        if window > 0:  # rows q >= last: the window starts past the last key
            last = max(first, seqlen_k + window - 1 - offset)
            if last < delta.shape[-1]:
                delta[..., last:].zero_()
        return
    sq, sk = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    offset = (sk - sq if mask_type == 2 else torch.zeros_like(sq))[:, None]
    rows = torch.arange(delta.shape[-1], device=delta.device)[None, :]
    blind = rows + offset < 0
    if window > 0:
        blind |= rows + offset - window + 1 >= sk[:, None]
    delta.masked_fill_(blind[:, None, :], 0.0)


@torch.library.custom_op("cute_kernels::attention_bwd_compute_delta", mutates_args=())
def _compute_delta_op(
    out: Tensor, grad_out: Tensor, cu_seqlens_q: Optional[Tensor], max_seqlen_q: Optional[int]
) -> Tensor:
    return compute_delta(out, grad_out, cu_seqlens_q, max_seqlen_q)


@_compute_delta_op.register_fake
def _(out, grad_out, cu_seqlens_q, max_seqlen_q):
    s = _max_seqlen(out, cu_seqlens_q, max_seqlen_q)
    return out.new_empty((_batch(out, cu_seqlens_q), out.shape[-2], s), dtype=torch.float32)


def attention_bwd_compute_delta(
    out: Tensor, grad_out: Tensor, *, cu_seqlens_q: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None
) -> Tensor:
    """The mem-eff kernel's Δ = rowsum(grad_out * out), [batch, heads, seqlen] fp32 (no rounding)."""
    validate_once(
        ("delta", out, grad_out, cu_seqlens_q, max_seqlen_q),
        lambda: _check_seq_pair("out", out, "grad_out", grad_out, cu_seqlens_q, max_seqlen_q),
    )
    if cc.eager(out):
        return compute_delta(out, grad_out, cu_seqlens_q, max_seqlen_q)
    return _compute_delta_op(out, grad_out, cu_seqlens_q, max_seqlen_q)


# -------------------------------------------------------------------------- convert_dq


def launch_convert_dq(dq_accum, dq, scale, cu_seqlens_q, max_seqlen_q=None):
    """convert_dq into a preallocated dq; ``dq_accum`` has a leading split dim."""
    key = ("dq", _meta(dq_accum), _meta(dq), cu_seqlens_q is None, max_seqlen_q)
    plan = _cached_plan(key, lambda: _plan_convert_dq(dq_accum, dq, cu_seqlens_q, max_seqlen_q))
    if plan is not None:
        fn, batch, num_m_blocks = plan
        fn(dq_accum, dq, cu_seqlens_q, float(scale), batch, num_m_blocks)


def launch_convert_dq_ready(dq_accum, dq, scale, cu_seqlens_q, max_seqlen_q, ready):
    """ConvertDQReady into a preallocated dq, launched right behind the sm90 backward that
    counts into ``ready`` = (tile counter [1], counts [sequences, Hk], query heads per key
    head, the count of a complete head), both int32 and zeroed before that kernel."""
    key = ("dq_ready", _meta(dq_accum), _meta(dq), cu_seqlens_q is None, max_seqlen_q)
    plan = _cached_plan(key, lambda: _plan_convert_dq(dq_accum, dq, cu_seqlens_q, max_seqlen_q, ready=True))
    if plan is not None:
        fn, batch, num_m_blocks = plan
        tiles, counts, group, expected = ready
        ctas = min(batch * dq.shape[-2] * num_m_blocks, cc.num_sms(dq.device.index) * prepost_config.READY_CTAS_PER_SM)
        fn(dq_accum, dq, cu_seqlens_q, tiles, counts, float(scale), batch, num_m_blocks, group, expected, ctas)


def _plan_convert_dq(dq_accum, dq, cu_seqlens_q, max_seqlen_q, ready=False):
    if dq.numel() == 0:
        return None
    _check_aligned("dq_accum", dq_accum)
    d = dq.shape[-1]
    vec = _vec(dq)
    arch = cc.device_arch(dq.device.index)
    varlen = cu_seqlens_q is not None
    t = tiling.postprocess_tiles(8 * dq.element_size(), d, vec, arch)
    batch = _batch(dq, cu_seqlens_q)
    rows = dq.shape[1] if not varlen else (max_seqlen_q if max_seqlen_q is not None else dq.shape[0])
    num_m_blocks = -(-rows // t.block_m)
    if batch == 0 or num_m_blocks == 0:
        return None
    cache = compiled_convert_dq_ready if ready else compiled_convert_dq
    return cache(cc.cute_dtype(dq.dtype), t.head_dim, vec, varlen, arch), batch, num_m_blocks


def convert_dq(dq_accum, softmax_scale, head_dim, seqlen_q, cu_seqlens_q, max_seqlen_q, p_dropout, dtype, ready=None):
    """``attention_bwd_convert_dq`` unchecked (the attention backwards' own call). ``ready``:
    ConvertDQReady's counters (``launch_convert_dq_ready``), behind the sm90 backward."""
    varlen = cu_seqlens_q is not None
    acc = dq_accum if dq_accum.dim() == (4 if varlen else 5) else dq_accum.unsqueeze(0)
    if varlen:
        b = cu_seqlens_q.numel() - 1
        shape = (acc.shape[1] - tiling.VARLEN_ACCUM_PAD * b, acc.shape[2], head_dim)
    else:
        shape = (acc.shape[1], seqlen_q, acc.shape[3], head_dim)
    dq = torch.empty(shape, dtype=dtype, device=dq_accum.device)
    if acc.shape[0] == 0:
        return dq.zero_()
    if ready is not None:
        launch_convert_dq_ready(acc, dq, softmax_scale / (1.0 - p_dropout), cu_seqlens_q, max_seqlen_q, ready)
    else:
        launch_convert_dq(acc, dq, softmax_scale / (1.0 - p_dropout), cu_seqlens_q, max_seqlen_q)
    return dq


@torch.library.custom_op("cute_kernels::attention_bwd_convert_dq", mutates_args=())
def _convert_dq_op(
    dq_accum: Tensor,
    softmax_scale: float,
    head_dim: int,
    seqlen_q: Optional[int],
    cu_seqlens_q: Optional[Tensor],
    max_seqlen_q: Optional[int],
    p_dropout: float,
    dtype: torch.dtype,
) -> Tensor:
    return convert_dq(dq_accum, softmax_scale, head_dim, seqlen_q, cu_seqlens_q, max_seqlen_q, p_dropout, dtype)


@_convert_dq_op.register_fake
def _(dq_accum, softmax_scale, head_dim, seqlen_q, cu_seqlens_q, max_seqlen_q, p_dropout, dtype):
    varlen = cu_seqlens_q is not None
    acc = dq_accum if dq_accum.dim() == (4 if varlen else 5) else dq_accum.unsqueeze(0)
    if varlen:
        shape = (acc.shape[1] - tiling.VARLEN_ACCUM_PAD * (cu_seqlens_q.shape[0] - 1), acc.shape[2], head_dim)
    else:
        shape = (acc.shape[1], seqlen_q, acc.shape[3], head_dim)
    return dq_accum.new_empty(shape, dtype=dtype)


def attention_bwd_convert_dq(
    dq_accum: Tensor,
    softmax_scale: float,
    *,
    head_dim: int,
    seqlen_q: Optional[int] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    p_dropout: float = 0.0,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """dQ = (sum of the split partials) * softmax_scale / (1 - p_dropout), in ``dtype``.

    ``dq_accum``: [(nsplits,) batch, seqlen_q_rounded, heads, head_dim_rounded] fp32
    (then ``seqlen_q`` is required), or with ``cu_seqlens_q``/``max_seqlen_q``
    [(nsplits,) total_q + 128 * batch, heads, head_dim_rounded]. Returns
    [batch, seqlen_q, heads, head_dim] or [total_q, heads, head_dim].
    """
    validate_once(
        ("dq", dq_accum, head_dim, seqlen_q, cu_seqlens_q, max_seqlen_q, dtype),
        lambda: _check_convert_dq(dq_accum, head_dim, seqlen_q, cu_seqlens_q, max_seqlen_q, dtype),
    )
    check_float("softmax_scale", softmax_scale)
    check_probability("p_dropout", p_dropout)
    args = (
        dq_accum,
        float(softmax_scale),
        int(head_dim),
        seqlen_q,
        cu_seqlens_q,
        max_seqlen_q,
        float(p_dropout),
        dtype,
    )
    if cc.eager(dq_accum):
        return convert_dq(*args)
    return _convert_dq_op(*args)


def _check_convert_dq(dq_accum, head_dim, seqlen_q, cu_seqlens_q, max_seqlen_q, dtype):
    varlen = cu_seqlens_q is not None
    _check_accum("dq_accum", dq_accum, (3, 4) if varlen else (4, 5), _checked_head_dim(head_dim))
    if dtype not in OUTPUT_DTYPES:
        raise TypeError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    if varlen:
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, dq_accum)
        if seqlen_q is not None:
            raise ValueError("with cu_seqlens_q the sequence lengths come from it; drop seqlen_q")
        if max_seqlen_q is None:
            raise ValueError("cu_seqlens_q needs max_seqlen_q")
        check_int("max_seqlen_q", max_seqlen_q)
        b = cu_seqlens_q.numel() - 1
        if dq_accum.shape[-3] < tiling.VARLEN_ACCUM_PAD * b:
            raise ValueError(f"dq_accum must have total_q + 128 * batch rows, got {dq_accum.shape[-3]} for batch {b}")
    else:
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q is only used with cu_seqlens_q")
        if seqlen_q is None:
            raise ValueError("seqlen_q is required without cu_seqlens_q (dq_accum's rows are rounded up)")
        check_int("seqlen_q", seqlen_q)
        if dq_accum.shape[-3] < seqlen_rounded(seqlen_q):
            raise ValueError(
                f"dq_accum needs round_up(seqlen_q, 128) = {seqlen_rounded(seqlen_q)} rows, got {dq_accum.shape[-3]}"
            )


def _checked_head_dim(head_dim):
    check_int("head_dim", head_dim, low=1)
    if head_dim > tiling.MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {tiling.MAX_HEAD_DIM}], got {head_dim}")
    return int(head_dim)


# ------------------------------------------------------------------------- convert_dkv


def launch_convert_dkv(dk_accum, dv_accum, dk, dv, scale_k, scale_v, cu_seqlens_k):
    key = ("dkv", _meta(dk_accum), _meta(dv_accum), _meta(dk), _meta(dv), cu_seqlens_k is None)
    plan = _cached_plan(key, lambda: _plan_convert_dkv(dk_accum, dv_accum, dk, dv, cu_seqlens_k))
    if plan is not None:
        fn, num_n_blocks = plan
        fn(dk_accum, dv_accum, dk, dv, cu_seqlens_k, float(scale_k), float(scale_v), num_n_blocks)


def _plan_convert_dkv(dk_accum, dv_accum, dk, dv, cu_seqlens_k):
    if dk.numel() == 0:
        return None
    _check_aligned("dk_accum", dk_accum)
    _check_aligned("dv_accum", dv_accum)
    vec = _vec(dk, dv)
    arch = cc.device_arch(dk.device.index)
    varlen = cu_seqlens_k is not None
    t = tiling.postprocess_tiles(8 * dk.element_size(), dk.shape[-1], vec, arch)
    num_n_blocks = -(-dk_accum.shape[2] // t.block_m)
    if dk_accum.shape[0] == 0 or dk_accum.shape[1] == 0 or num_n_blocks == 0:
        return None
    return compiled_convert_dkv(cc.cute_dtype(dk.dtype), t.head_dim, vec, varlen, arch), num_n_blocks


def _convert_dkv_impl(dk_accum, dv_accum, softmax_scale, head_dim, seqlen_k, cu_seqlens_k, p_dropout, dtype):
    b, hk = dk_accum.shape[0], dk_accum.shape[1]
    shape = (seqlen_k, hk, head_dim) if cu_seqlens_k is not None else (b, seqlen_k, hk, head_dim)
    dk = torch.empty(shape, dtype=dtype, device=dk_accum.device)
    dv = torch.empty(shape, dtype=dtype, device=dk_accum.device)
    rp = 1.0 / (1.0 - p_dropout)
    launch_convert_dkv(dk_accum, dv_accum, dk, dv, softmax_scale * rp, rp, cu_seqlens_k)
    return dk, dv


@torch.library.custom_op("cute_kernels::attention_bwd_convert_dkv", mutates_args=())
def _convert_dkv_op(
    dk_accum: Tensor,
    dv_accum: Tensor,
    softmax_scale: float,
    head_dim: int,
    seqlen_k: int,
    cu_seqlens_k: Optional[Tensor],
    p_dropout: float,
    dtype: torch.dtype,
) -> Tuple[Tensor, Tensor]:
    return _convert_dkv_impl(dk_accum, dv_accum, softmax_scale, head_dim, seqlen_k, cu_seqlens_k, p_dropout, dtype)


@_convert_dkv_op.register_fake
def _(dk_accum, dv_accum, softmax_scale, head_dim, seqlen_k, cu_seqlens_k, p_dropout, dtype):
    b, hk = dk_accum.shape[0], dk_accum.shape[1]
    shape = (seqlen_k, hk, head_dim) if cu_seqlens_k is not None else (b, seqlen_k, hk, head_dim)
    return dk_accum.new_empty(shape, dtype=dtype), dk_accum.new_empty(shape, dtype=dtype)


def attention_bwd_convert_dkv(
    dk_accum: Tensor,
    dv_accum: Tensor,
    softmax_scale: float,
    *,
    head_dim: int,
    seqlen_k: int,
    cu_seqlens_k: Optional[Tensor] = None,
    p_dropout: float = 0.0,
    dtype: torch.dtype = torch.bfloat16,
) -> Tuple[Tensor, Tensor]:
    """dK = dk_accum * softmax_scale / (1 - p), dV = dv_accum / (1 - p), in ``dtype``.

    Accumulators: [batch, heads_k, seqlen_k_rounded, head_dim_rounded] fp32. Returns
    [batch, seqlen_k, heads_k, head_dim], or with ``cu_seqlens_k`` [seqlen_k, heads_k,
    head_dim] where ``seqlen_k`` is then the total key count (and seqlen_k_rounded must
    cover the longest sequence).
    """
    validate_once(
        ("dkv", dk_accum, dv_accum, head_dim, seqlen_k, cu_seqlens_k, dtype),
        lambda: _check_convert_dkv(dk_accum, dv_accum, head_dim, seqlen_k, cu_seqlens_k, dtype),
    )
    check_float("softmax_scale", softmax_scale)
    check_probability("p_dropout", p_dropout)
    args = (
        dk_accum,
        dv_accum,
        float(softmax_scale),
        int(head_dim),
        int(seqlen_k),
        cu_seqlens_k,
        float(p_dropout),
        dtype,
    )
    if cc.eager(dk_accum):
        return _convert_dkv_impl(*args)
    return _convert_dkv_op(*args)


def _check_convert_dkv(dk_accum, dv_accum, head_dim, seqlen_k, cu_seqlens_k, dtype):
    _check_accum("dk_accum", dk_accum, (4,), _checked_head_dim(head_dim))
    _check_accum("dv_accum", dv_accum, (4,), head_dim)
    check_same_device("dv_accum", dv_accum, dk_accum)
    if dv_accum.shape != dk_accum.shape:
        raise ValueError(f"dv_accum must have dk_accum's shape {tuple(dk_accum.shape)}, got {tuple(dv_accum.shape)}")
    if dtype not in OUTPUT_DTYPES:
        raise TypeError(f"dtype must be float16 or bfloat16, got {dtype!r}")
    check_int("seqlen_k", seqlen_k)
    if cu_seqlens_k is not None:
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, dk_accum)
        if cu_seqlens_k.numel() - 1 != dk_accum.shape[0]:
            raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.numel() - 1} sequences, dk_accum {dk_accum.shape[0]}")
    elif dk_accum.shape[2] < seqlen_rounded(seqlen_k):
        raise ValueError(
            f"dk_accum needs round_up(seqlen_k, 128) = {seqlen_rounded(seqlen_k)} rows, got {dk_accum.shape[2]}"
        )


# --------------------------------------------------------------------- clear_dkv_accum


def launch_clear_dkv_accum(dk_accum, dv_accum):
    key = ("clear", _meta(dk_accum), _meta(dv_accum))
    fn = _cached_plan(key, lambda: _plan_clear_dkv_accum(dk_accum, dv_accum))
    if fn is not None:
        fn(dk_accum, dv_accum)


def _plan_clear_dkv_accum(dk_accum, dv_accum):
    if dk_accum.numel() == 0:
        return None
    _check_aligned("dk_accum", dk_accum)
    _check_aligned("dv_accum", dv_accum)
    return compiled_clear_dkv_accum(dk_accum.shape[-1], cc.device_arch(dk_accum.device.index))


@torch.library.custom_op("cute_kernels::attention_bwd_clear_dkv_accum", mutates_args=("dk_accum", "dv_accum"))
def _clear_dkv_accum_op(dk_accum: Tensor, dv_accum: Tensor) -> None:
    launch_clear_dkv_accum(dk_accum, dv_accum)


@_clear_dkv_accum_op.register_fake
def _(dk_accum, dv_accum):
    return None


def attention_bwd_clear_dkv_accum(dk_accum: Tensor, dv_accum: Tensor) -> None:
    """Zero both fp32 [batch, heads_k, seqlen_k_rounded, head_dim_rounded] accumulators in place."""
    validate_once(("clear", dk_accum, dv_accum), lambda: _check_clear_dkv_accum(dk_accum, dv_accum))
    if cc.eager(dk_accum):
        launch_clear_dkv_accum(dk_accum, dv_accum)
    else:
        _clear_dkv_accum_op(dk_accum, dv_accum)


def _check_clear_dkv_accum(dk_accum, dv_accum):
    check_tensor("dk_accum", dk_accum)
    d = dk_accum.shape[-1] if dk_accum.dim() else 0
    if d % tiling.HEAD_DIM_ROUND or not 0 < d <= tiling.MAX_HEAD_DIM:
        raise ValueError(f"dk_accum's last dim must be a multiple of 32 in [32, 256], got {d}")
    _check_accum("dk_accum", dk_accum, (4,), d)
    _check_accum("dv_accum", dv_accum, (4,), d)
    check_same_device("dv_accum", dv_accum, dk_accum)
    if dv_accum.shape != dk_accum.shape:
        raise ValueError(f"dv_accum must have dk_accum's shape {tuple(dk_accum.shape)}, got {tuple(dv_accum.shape)}")
