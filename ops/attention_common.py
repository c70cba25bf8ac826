"""What the attention ops (``ops.attention``) and their two backends share.

* ``AttentionBackwardArgs``: one attention backward's arguments as one object. Its fields
  are the ``cute_kernels::efficient_attention_backward`` op's arguments in the op's order:
  the op stays flat for torch.library, the Python layers behind it take the object.
* ``check_backward_args`` / ``check_bias``: the checks of what the caller passed.
* ``grad_bias_buffer``: the bias gradient either backend writes.
* ``max_head_dim``: the widest head dim of all backends.
* ``lse_rows``: the logsumexp's padded rows; ``tma_misaligned`` / ``remembered_verdict``: the
  TMA-alignment reason and the per-metadata memo of the Hopper kernels' ``unsupported``.
* ``subtract_grad_lse``: Δ - dLSE, a loss on the logsumexp, where a backend takes Δ from torch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from cute_kernels.mem_eff_attention import config as mem_eff_config
from layouts.attention_bwd_prepost import round_up
from layouts.attention_sm90 import TMA_ALIGN_BYTES, tma_align_elems

from . import _compile as cc
from ._validate import check_cuda, check_dtype, check_same_device, check_tensor, validate_once

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LSE_ALIGN = 32  # kAlignLSE of torch's forward: logsumexp rows are padded to a multiple of it


def softmax_scale(scale, head_dim: int) -> float:
    """The softmax scale a call asked for, as a float; None: 1 / sqrt(head_dim), torch's default."""
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def lse_rows(max_seqlen_q: int) -> int:
    """The logsumexp's rows for ``max_seqlen_q`` queries (torch's padding)."""
    return (max_seqlen_q + LSE_ALIGN - 1) // LSE_ALIGN * LSE_ALIGN


def tma_misaligned(named_tensors) -> Optional[str]:
    """The reason the first of (name, tensor) TMA cannot read (last stride 1, the other strides
    and the address multiples of TMA_ALIGN_BYTES), or None. Fake and meta tensors have no
    address to check (their real counterparts are checked at run time)."""
    for name, t in named_tensors:
        vec = tma_align_elems(8 * t.element_size())
        address = 0 if t.device.type == "meta" or cc.is_fake_tensor(t) else t.data_ptr()
        if t.stride(-1) != 1 or address % TMA_ALIGN_BYTES or any(s % vec for s in t.stride()[:-1]):
            return (
                f"{name} is not TMA-aligned (last stride 1, other strides and address multiples of "
                f"{TMA_ALIGN_BYTES} bytes)"
            )
    return None


def remembered_verdict(memo, tensors, flags, check) -> Optional[str]:
    """``check()``, an ``unsupported`` reason (None: supported). For plain CUDA tensors at
    TMA-aligned addresses the answer is remembered by ``flags`` and the tensors' metadata (the
    whole check costs ~15-30 us of host time); the addresses are checked on every call."""
    sig = None
    if cc.eager(tensors[0]) and all(type(t) is Tensor and t.is_cuda for t in tensors):
        addresses = 0
        for t in tensors:
            addresses |= t.data_ptr()
        if addresses % TMA_ALIGN_BYTES == 0:  # else the whole check names the tensor
            sig = (*flags, *((t.shape, t.stride(), t.dtype, t.device) for t in tensors))
            if sig in memo:
                return memo[sig]
    reason = check()
    return reason if sig is None else memo.put(sig, reason)


@dataclass(frozen=True, eq=False, kw_only=True)
class AttentionBackwardArgs:
    """One attention backward: ``aten._efficient_attention_backward``'s arguments, the backend
    asked for and deterministic mode; beyond aten's, for ``memory_efficient_attention``'s own
    backward only, the gradient of the returned logsumexp (``grad_lse``, the LSE's shape; None:
    no loss on it), the forward's softcap (``softcap`` c > 0: the scores were c tanh(s / c);
    0: none), its used lengths (``seqused_q / _k``: int32 [sequences], both or neither) and its
    learnable sink (``sink``, [H]: its gradient is returned too; None: none).
    ``efficient_attention_backward`` builds it from what the caller passed,
    checks it and normalises it (``normalized``). Tensors make an equality elementwise, so
    instances compare by identity (``eq=False``)."""

    grad_out: Tensor
    query: Tensor
    key: Tensor
    value: Tensor
    out: Tensor
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    max_seqlen_q: Optional[int] = None
    max_seqlen_k: Optional[int] = None
    logsumexp: Tensor
    custom_mask_type: int = 0
    scale: Optional[float] = None
    num_splits_key: Optional[int] = None
    window_size: Optional[int] = None
    shared_storage_dqdkdv: bool = False
    bias: Optional[Tensor] = None
    bias_requires_grad: bool = False
    dropout_p: float = 0.0
    philox_seed: Optional[Tensor] = None
    philox_offset: Optional[Tensor] = None
    backend: str = "auto"
    deterministic: bool = False
    grad_lse: Optional[Tensor] = None
    softcap: float = 0.0
    seqused_q: Optional[Tensor] = None
    seqused_k: Optional[Tensor] = None
    sink: Optional[Tensor] = None

    @classmethod
    def from_op(cls, *flat, **named) -> AttentionBackwardArgs:
        """The object of the op's arguments (positional ones in the op's order)."""
        return cls(**dict(zip(OP_FIELDS, flat)), **named)

    def op_args(self) -> tuple:
        """The op's flat arguments, in its order."""
        return tuple(getattr(self, name) for name in OP_FIELDS)

    def normalized(self, scale: float) -> AttentionBackwardArgs:
        """The checked arguments as the backends take them: Python scalars, the softmax
        ``scale`` resolved, the philox tensors only with dropout. (A constructor call, not
        ``dataclasses.replace``: this runs on every call, and replace costs twice the time.)"""
        dropout = float(self.dropout_p) > 0.0
        return AttentionBackwardArgs(
            grad_out=self.grad_out,
            query=self.query,
            key=self.key,
            value=self.value,
            out=self.out,
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            max_seqlen_q=_optional_int(self.max_seqlen_q),
            max_seqlen_k=_optional_int(self.max_seqlen_k),
            logsumexp=self.logsumexp,
            custom_mask_type=int(self.custom_mask_type),
            scale=float(scale),
            num_splits_key=_optional_int(self.num_splits_key),
            window_size=_optional_int(self.window_size),
            shared_storage_dqdkdv=bool(self.shared_storage_dqdkdv),
            bias=self.bias,
            bias_requires_grad=bool(self.bias_requires_grad),
            dropout_p=float(self.dropout_p),
            philox_seed=self.philox_seed if dropout else None,
            philox_offset=self.philox_offset if dropout else None,
            backend=self.backend,
            deterministic=self.deterministic,
            grad_lse=self.grad_lse,
            softcap=float(self.softcap),
            seqused_q=self.seqused_q,
            seqused_k=self.seqused_k,
            sink=self.sink,
        )

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def seqused(self) -> bool:
        """Used lengths given (``seqused_q`` and ``seqused_k``, int32 [sequences])."""
        return self.seqused_q is not None

    @property
    def window(self) -> int:
        """The window as an int (0: none)."""
        return int(self.window_size or 0)

    @property
    def dropout(self) -> bool:
        return float(self.dropout_p) > 0.0


OP_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionBackwardArgs))


def _optional_int(x) -> Optional[int]:
    return None if x is None else int(x)


def grad_bias_buffer(query: Tensor, mk: int, mask_type: int) -> Tensor:
    """The bias gradient [B, H, Mq, Mk] either backend writes: rows padded to 128 bits, as
    torch pads them (the memory-efficient epilogue's vector stores; the sm90 kernel's TMA
    stores need 16-byte rows too); zeros where a mask may leave tiles unvisited."""
    b, mq, h, _ = query.shape
    padded = round_up(mk, 128 // torch.finfo(query.dtype).bits)
    alloc = torch.zeros if int(mask_type) != 0 else torch.empty  # masked tiles are never written
    return alloc((b, h, mq, padded), dtype=query.dtype, device=query.device)[..., :mk]


def subtract_grad_lse(delta: Tensor, grad_lse: Tensor, cu_seqlens_q: Optional[Tensor]) -> None:
    """Δ -= dLSE in place (a loss on the logsumexp: d LSE_i / d S_ij = P_ij, so dS = P (dP - (Δ -
    dLSE))) on each sequence's rows of ``delta`` [sequences, H, rows]; ``grad_lse`` has the
    LSE's layout ([sequences, H, >= rows], any strides). Rows past a packed sequence keep their
    Δ (0): dLSE there is the padding's."""
    rows = delta.shape[-1]
    dlse = grad_lse[..., :rows]
    if cu_seqlens_q is not None:
        lengths = cu_seqlens_q.diff().view(-1, 1, 1)
        inside = torch.arange(rows, device=delta.device).view(1, 1, -1) < lengths
        dlse = torch.where(inside, dlse, 0.0)
    delta.sub_(dlse)


def max_head_dim(dtype: torch.dtype) -> int:
    """The largest head dim the memory-efficient backward takes (the widest of all backends)."""
    return mem_eff_config.MAX_K_FP32 if dtype == torch.float32 else mem_eff_config.MAX_K


# -------------------------------------------------------------------------- checks


def check_bias(bias: Tensor, query: Tensor, key: Tensor, cu_seqlens_q, name: str = "bias") -> None:
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


def check_backward_args(a: AttentionBackwardArgs) -> None:
    """efficient_attention_backward's checks of tensor metadata and flags, once per signature
    of them (the per-call values, dropout_p, scale and the philox tensors, are the caller's
    to check at each call)."""
    parts = (
        "eff_bwd",
        a.grad_out,
        a.query,
        a.key,
        a.value,
        a.out,
        a.logsumexp,
        a.cu_seqlens_q,
        a.cu_seqlens_k,
        a.max_seqlen_q,
        a.max_seqlen_k,
        a.bias,
        a.bias_requires_grad,
        a.custom_mask_type,
        a.window_size,
        a.num_splits_key,
        a.deterministic,
        a.grad_lse,
        a.softcap,
    )
    validate_once(parts, lambda: _check_metadata(a))


def _check_metadata(a: AttentionBackwardArgs) -> None:
    named = (("grad_out_", a.grad_out), ("query", a.query), ("key", a.key), ("value", a.value), ("out", a.out))
    for name, t in named + (("logsumexp", a.logsumexp),):
        check_tensor(name, t)
    if a.bias_requires_grad and a.bias is None:
        raise ValueError("bias_requires_grad needs a bias")
    _check_flags(a)
    _check_tensors(a)
    check_cuda("logsumexp", a.logsumexp)
    check_same_device("logsumexp", a.logsumexp, a.query)
    if a.logsumexp.dtype != torch.float32:
        raise TypeError(f"logsumexp must be float32, got {a.logsumexp.dtype}")
    _check_varlen(a)
    _check_logsumexp_shape(a)
    if a.grad_lse is not None:
        _check_grad_lse(a)
    if a.bias is not None:
        check_cuda("bias", a.bias)
        check_bias(a.bias, a.query, a.key, a.cu_seqlens_q)
    limit = max_head_dim(a.query.dtype)
    if max(a.query.shape[-1], a.value.shape[-1]) > limit:
        raise NotImplementedError(
            f"head dims above {limit} are not implemented for {a.query.dtype} yet "
            f"(query's {a.query.shape[-1]}, value's {a.value.shape[-1]})"
        )


def _is_int(x) -> bool:
    """A Python / numpy / symbolic int, not a bool (int() would take floats and strings too)."""
    return not isinstance(x, bool) and hasattr(x, "__index__")


def _check_flags(a: AttentionBackwardArgs) -> None:
    mask, window, splits = a.custom_mask_type, a.window_size, a.num_splits_key
    if not _is_int(mask) or int(mask) not in (0, 1, 2):
        raise ValueError(
            f"custom_mask_type must be 0 (none), 1 (causal from top-left) or 2 (causal from bottom-right), got {mask!r}"
        )
    if window is not None and (not _is_int(window) or int(window) < 0):
        raise ValueError(f"window_size must be None or a non-negative int, got {window!r}")
    if window is not None and int(window) > 0 and int(mask) == 0:
        raise ValueError("window_size needs a causal custom_mask_type (1 or 2)")
    if splits is not None and (not _is_int(splits) or int(splits) < 1):
        raise ValueError(f"num_splits_key must be a positive int, got {splits!r}")
    if isinstance(a.softcap, bool) or not isinstance(a.softcap, numbers.Real) or not a.softcap >= 0.0:
        raise ValueError(f"softcap must be a float >= 0 (0: none), got {a.softcap!r}")
    if a.deterministic and splits is not None and int(splits) > 1:
        raise ValueError(f"deterministic needs num_splits_key None or 1 (key splits add dQ in any order), got {splits}")


def _check_rank4(name: str, t: Tensor) -> None:
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D [batch, seqlen, heads, head_dim], got shape {tuple(t.shape)}")
    if t.shape[-1] > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


def _check_tensors(a: AttentionBackwardArgs) -> None:
    """query, key, value, out and grad_out: CUDA, 4-D, one dtype, shapes that agree."""
    query = a.query
    named = (("query", query), ("key", a.key), ("value", a.value), ("out", a.out), ("grad_out", a.grad_out))
    for name, t in named:
        check_cuda(name, t)
        check_same_device(name, t, query)
        _check_rank4(name, t)
        check_dtype(name, t, DTYPES)
        if t.dtype != query.dtype:
            raise TypeError(f"{name} must have the dtype of query ({query.dtype}), got {t.dtype}")
    b, mq, h, dqk = query.shape
    mk, hk = a.key.shape[1], a.key.shape[2]
    dv = a.value.shape[3]
    # grouped-query heads: each key / value head serves h // hk consecutive query heads
    if hk < 1 or h % hk:
        raise ValueError(
            f"key must have a number of heads that divides query's {h} (grouped-query heads), got shape {tuple(a.key.shape)}"
        )
    expect = {"key": (b, mk, hk, dqk), "value": (b, mk, hk, dv), "out": (b, mq, h, dv), "grad_out": (b, mq, h, dv)}
    for name, t in named[1:]:
        if tuple(t.shape) != expect[name]:
            raise ValueError(
                f"{name} must have shape {expect[name]} (from query {tuple(query.shape)} and key/value), got {tuple(t.shape)}"
            )


def _check_varlen(a: AttentionBackwardArgs) -> None:
    """cu_seqlens_q / _k (together, int32 [sequences + 1], contiguous) and max_seqlen_q / _k."""
    if (a.cu_seqlens_q is None) != (a.cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
    if a.cu_seqlens_q is None:
        return
    if a.query.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch dimension of query must be 1, got {a.query.shape[0]}")
    for name, cu in (("cu_seqlens_q", a.cu_seqlens_q), ("cu_seqlens_k", a.cu_seqlens_k)):
        check_cuda(name, cu)
        check_same_device(name, cu, a.query)
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(
                f"{name} must be a 1-D int32 tensor of sequences + 1 offsets, got {cu.dtype} {tuple(cu.shape)}"
            )
        if cu.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {cu.stride(0)}")
    if a.cu_seqlens_q.numel() != a.cu_seqlens_k.numel():
        raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")
    for name, m in (("max_seqlen_q", a.max_seqlen_q), ("max_seqlen_k", a.max_seqlen_k)):
        if not _is_int(m) or int(m) < 0:
            raise ValueError(f"{name} must be a non-negative int with cu_seqlens, got {m!r}")


def _check_logsumexp_shape(a: AttentionBackwardArgs) -> None:
    """logsumexp [sequences, H, >= query rows], contiguous along the rows."""
    lse, h = a.logsumexp, a.query.shape[2]
    if a.cu_seqlens_q is not None:
        seqs, rows_q = a.cu_seqlens_q.numel() - 1, int(a.max_seqlen_q)
    else:
        seqs, rows_q = a.query.shape[0], a.query.shape[1]
    if lse.dim() != 3 or lse.shape[0] != seqs or lse.shape[1] != h or lse.shape[2] < rows_q:
        raise ValueError(
            f"logsumexp must have shape [{seqs}, {h}, >= {rows_q}] (sequences, heads, queries), got {tuple(lse.shape)}"
        )
    if lse.stride(-1) != 1:
        raise ValueError("logsumexp must be contiguous along queries")


def _check_grad_lse(a: AttentionBackwardArgs) -> None:
    """The logsumexp's gradient: fp32, on its device, of its shape (any strides)."""
    g = a.grad_lse
    check_tensor("grad_lse", g)
    check_same_device("grad_lse", g, a.logsumexp)
    if g.dtype != torch.float32:
        raise TypeError(f"grad_lse must be float32, as the logsumexp, got {g.dtype}")
    if g.shape != a.logsumexp.shape:
        raise ValueError(f"grad_lse must have the logsumexp's shape {tuple(a.logsumexp.shape)}, got {tuple(g.shape)}")
