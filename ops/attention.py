"""The attention ops and the choice of their backends.

* ``memory_efficient_attention(q, k, v, ...)``: an autograd op in the [B, M, H, K] layout
  of ``torch.ops.aten._efficient_attention_forward``. Its forward is ours
  (``ops.attention_fwd_sm90``) where that kernel applies (sm_90a, fp16 / bf16, head dims 64 /
  128, bias and dropout included; dropout not under CUDA-graph capture; not with
  ``backend="mem_eff"``), else torch's
  ``aten._efficient_attention_forward``, logged at DEBUG on ``cute_kernels.attention``; its
  backward is ``efficient_attention_backward``. Registered as ``cute_kernels::memory_efficient_attention``
  (with a fake implementation and its autograd formula), so ``torch.compile(fullgraph=True)``
  captures it as one node. ``return_lse=True`` returns the logsumexp too, and a loss on it is
  differentiated (Δ - dLSE in either backward). ``softcap=c`` caps the scaled logits at
  c tanh(s / c) before bias and mask: our forward and the sm90 backward only (NotImplementedError
  elsewhere: torch's forward and the memory-efficient backward have no cap). ``seqused_q /
  seqused_k`` (int32 [B], or [num_seqs] with cu_seqlens) bound each sequence's used rows
  (FlashAttention-3's): the rest of its buffer is padding (read by the tiles that straddle
  the end, with weight 0: it must hold finite values), out 0 and logsumexp +inf on the
  padding rows, their gradients 0; our forward and the sm90 backward only. ``sink=`` (a [H]
  tensor, one learnable logit per query head in every row's softmax denominator, gpt-oss) needs
  our forward (NotImplementedError elsewhere; with ``backend="mem_eff"`` ours runs too) and
  trains through either backward: they take P from the sink-including LSE, and d sink is
  computed beside them (``ops.attention_sink``).
* ``efficient_attention_backward(...)``: a drop-in for ``aten._efficient_attention_backward``
  (same arguments, layouts and outputs: grad_q, grad_k, grad_v, grad_bias; with
  ``bias_requires_grad`` grad_bias has the bias's shape, summed over its broadcast dims),
  registered as ``cute_kernels::efficient_attention_backward``. Beyond aten: grouped-query
  key / value heads, ``backend=`` and ``deterministic=``.
* ``backend=`` ("auto" | "sm90" | "mem_eff"): which backward runs (``choose_backend``).
  "mem_eff" is ``ops.mem_eff_attention`` (any arch, fp16 / bf16 / fp32, head dims up to 512,
  key splits, shared dQ / dK / dV storage); "sm90" the Hopper-native ``ops.attention_sm90``
  (sm_90a, fp16 / bf16, head dims 64 / 96 / 128 / 192 / 256, V's may differ from Q's / K's
  (cute_kernels.attention_sm90.backward_config.HEAD_DIM_PAIRS), masks 0 / 1 / 2 with or without a window,
  grouped-query heads, deterministic mode, variable lengths, bias (with its gradient; not
  with variable lengths), dropout, TMA-aligned inputs); "auto" (default, and
  ``use_for_sdpa``'s) takes sm90 where ``attention_sm90.unsupported`` finds no reason
  against it, else mem_eff. Asking for "sm90" where it does not apply raises
  NotImplementedError with the reason. The choice is logged at DEBUG on logger
  ``cute_kernels.attention`` (one line per call).

Conventions (torch's, checked on torch 2.11 and 2.13):

* q [B, Mq, H, K], k [B, Mk, Hk, K], v [B, Mk, Hk, Kv], out [B, Mq, H, Kv]; grouped-query
  heads: Hk divides H, key head j serves query heads j*H/Hk .. (j+1)*H/Hk - 1 (torch's
  forward gets key / value repeated per query head; the sm90 backward reads them as they
  are, the memory-efficient one repeats them and sums dK / dV back); any strides
  whose last is 1. Variable lengths: B == 1, the sequences packed along M, int32
  ``cu_seqlens_q`` / ``cu_seqlens_k`` [num_seqs + 1] and the longest lengths
  ``max_seqlen_q`` / ``max_seqlen_k``.
* logsumexp (natural log, fp32): [B, H, round_up(Mq, 32)] dense, [num_seqs, H,
  round_up(max_seqlen_q, 32)] with variable lengths (sequence i's query j at [i, :, j]).
  Rows past Mq read +inf (dense; with variable lengths only up to the sequence's next
  multiple of 32, later entries are left unwritten). A query row that sees no key has
  out 0 and logsumexp 0.
* attn_bias: broadcastable to [B, H, Mq, Mk], query's dtype, added to the scaled logits
  (not with variable lengths); dropout_p: the keep mask of torch's forward (philox seed /
  offset from the default CUDA generator, as torch's forward takes them; ours draws the same
  bits, and our backward redraws them).
* causal: False (custom_mask_type 0), True / "top_left" (1: key m masked if m > n),
  "bottom_right" (2: masked if m > n + Mk - Mq, per sequence); ``window_size`` w > 0
  (causal only) also masks m <= n + shift - w.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor

from layouts.attention_bwd_prepost import round_up
from layouts.attention_sm90 import TMA_ALIGN_BYTES  # the kernels' widest access: gradients are made dense otherwise

from . import _compile as cc
from . import attention_fwd_sm90 as fwd_sm90
from . import attention_sm90 as sm90
from . import mem_eff_attention as mem_eff
from .attention_checks import check_seqused, check_sink, check_softcap, validate_call
from .attention_sink import sink_grad
from ._validate import check_float, check_int, kernel_ready, validate_once
from .attention_common import (
    AttentionBackwardArgs,
    check_backward_args,
    check_bias,
    lse_rows,
    max_head_dim,
    softmax_scale,
)

logger = logging.getLogger("cute_kernels")
log = logging.getLogger("cute_kernels.attention")  # the backend each backward runs on

BACKENDS = ("auto", "sm90", "mem_eff")


# ---------------------------------------------------------------------- autograd op


def _mea_impl(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    custom_mask_type: int,
    window_size: int,
    scale: Optional[float],
    attn_bias: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    backend: str = "auto",  # "mem_eff": torch's forward; else ours where it applies (in the schema for graphs)
    deterministic: bool = False,  # the backward's (in the schema so that graphs keep it)
    softcap: float = 0.0,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's body: our forward where it applies, torch's otherwise (``deterministic`` is the
    backward's, kept for it). A softcap, used lengths or a sink need ours: torch's forward has none."""
    del deterministic
    reason = forward_unsupported(
        query, key, value, custom_mask_type, attn_bias, dropout_p, backend, sink=sink is not None
    )
    features = (  # (asked for, what it is called, what torch's forward lacks)
        (softcap > 0.0, "softcap needs", "softcap"),
        (seqused_q is not None, "seqused_q / seqused_k need", "used lengths"),
        (sink is not None, "sink needs", "sink"),
    )
    for on, name, what in features:
        if on and reason is not None:
            raise NotImplementedError(f"{name} our forward (torch's has no {what}), which does not apply: {reason}")
    if log.isEnabledFor(logging.DEBUG):
        log.debug("attention forward: %s", "sm90" if reason is None else f"torch's ({reason})")
    if reason is None:
        seed = offset = None
        if dropout_p > 0.0:  # from the generator as torch's forward takes them
            words = fwd_sm90.dropout_words(query, key, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
            seed, offset = fwd_sm90.philox_state(query.device, words)
        out, lse = fwd_sm90.attention_forward_sm90(
            query,
            key,
            value,
            scale,
            custom_mask_type,
            window_size,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            attn_bias,
            dropout_p,
            seed,
            offset,
            softcap,
            seqused_q,
            seqused_k,
            sink,
        )
        return out, lse, *_rng_on_device(seed, offset, dropout_p, query.device)
    if dropout_p > 0.0 and cu_seqlens_q is not None:
        # torch's forward gives every (sequence, head) the same stretch of the stream with
        # cu_seqlens, while the backwards (torch's and ours) redraw (i H + h) max_q max_k on
        raise NotImplementedError(
            "dropout with variable lengths needs our forward, whose keep mask the backward replays "
            f"(torch's forward draws another); ours does not apply here: {reason}"
        )
    return _torch_forward(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        custom_mask_type,
        window_size,
        scale,
        attn_bias,
        dropout_p,
    )


# the op wraps the body; _mea_impl stays a plain function, which the eager path below calls
_mea_forward = torch.library.custom_op(
    "cute_kernels::memory_efficient_attention", mutates_args=(), device_types="cuda"
)(_mea_impl)


def forward_unsupported(
    query, key, value, mask_type, attn_bias, dropout_p, backend, arch=None, sink=False
) -> Optional[str]:
    """Why the op's forward is torch's (None: ours, ``ops.attention_fwd_sm90``). ``arch``: as
    ``attention_fwd_sm90.unsupported`` takes it (the device's by default). ``sink``: ours
    wherever it applies, ``backend="mem_eff"`` too (torch's forward has no sink)."""
    if backend == "mem_eff" and not sink:
        return "backend='mem_eff'"
    return fwd_sm90.unsupported(query, key, value, mask_type=mask_type, bias=attn_bias, dropout_p=dropout_p, arch=arch)


def _torch_forward(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    custom_mask_type,
    window_size,
    scale,
    attn_bias,
    dropout_p,
):
    """``aten._efficient_attention_forward`` (an sm80-era kernel) for what our forward does not take."""
    varlen = cu_seqlens_q is not None
    group = query.shape[2] // key.shape[2]
    if group > 1:  # torch's forward has one key head per query head
        key, value = (t.repeat_interleave(group, dim=2) for t in (key, value))
    out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        query,
        key,
        value,
        attn_bias,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q if varlen else None,
        max_seqlen_k if varlen else None,
        dropout_p,
        custom_mask_type,
        True,
        scale=scale,
        window_size=window_size if window_size > 0 else None,
    )
    return out, lse, *_rng_on_device(seed, offset, dropout_p, query.device)


def _rng_on_device(seed: Tensor, offset: Tensor, dropout_p: float, device) -> Tuple[Tensor, Tensor]:
    """The philox seed / offset on the query's device, where the backward kernel reads them:
    torch's forward returns them there under CUDA-graph capture, on the host otherwise, so
    one place for them keeps graphs (torch.compile's included) the same either way. The
    host values go up through pinned memory, so the copies do not wait for the stream."""
    if dropout_p == 0.0:  # torch returns empty scalars nobody reads
        return tuple(torch.empty((), dtype=torch.int64, device=device) for _ in range(2))
    if seed.device == device:
        return seed, offset
    # two allocations: an op's outputs may not alias one another
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in (seed, offset))


@_mea_forward.register_fake
def _(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    custom_mask_type,
    window_size,
    scale,
    attn_bias=None,
    dropout_p=0.0,
    backend="auto",
    deterministic=False,
    softcap=0.0,
    seqused_q=None,
    seqused_k=None,
    sink=None,
):
    b, mq, h, _ = query.shape
    out = query.new_empty((b, mq, h, value.shape[3]))
    rows = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else b
    lse = query.new_empty((rows, h, lse_rows(max_seqlen_q)), dtype=torch.float32)
    seed, offset = (query.new_empty((), dtype=torch.int64) for _ in range(2))
    return out, lse, seed, offset


def _mea_setup(ctx, inputs, output):
    query, key, value, cu_q, cu_k, max_q, max_k, mask_type, window_size, scale, attn_bias, dropout_p, *flags = inputs
    backend, det, softcap, used_q, used_k, sink = flags
    out, lse, seed, offset = output
    ctx.save_for_backward(query, key, value, out, lse, cu_q, cu_k, attn_bias, seed, offset, used_q, used_k, sink)
    ctx.max_seqlens = (max_q, max_k)
    ctx.mask_type, ctx.window_size, ctx.scale, ctx.dropout_p = mask_type, window_size, scale, dropout_p
    ctx.backend, ctx.deterministic, ctx.softcap = backend, det, softcap
    ctx.mark_non_differentiable(seed, offset)
    ctx.set_materialize_grads(False)


def _mea_backward(ctx, grad_out, grad_lse, grad_seed, grad_offset):
    del grad_seed, grad_offset
    query, key, value, out, lse, cu_q, cu_k, attn_bias, seed, offset, used_q, used_k, sink = ctx.saved_tensors
    # (set_materialize_grads(False): an output's gradient is None unless it reached the loss)
    if grad_out is None and grad_lse is None:
        return (None,) * 18
    if grad_out is not None:
        grad_out = kernel_ready(grad_out, TMA_ALIGN_BYTES // grad_out.element_size())
    sink_wanted = sink is not None and ctx.needs_input_grad[17]
    if not any(ctx.needs_input_grad[i] for i in (0, 1, 2, 10)):  # the sink's alone
        dsink = sink_grad(sink, out, grad_out, lse, grad_lse, cu_q, ctx.max_seqlens[0]) if sink_wanted else None
        return (None,) * 17 + (dsink,)
    if grad_out is None:  # a loss on the logsumexp alone: dO = 0, so dV = 0 and dS = P dLSE
        grad_out = torch.zeros_like(out)  # (out's layout, which the kernels read)
    bias_grad = attn_bias is not None and ctx.needs_input_grad[10]
    # already as ``AttentionBackwardArgs.normalized`` makes them: the forward checked and
    # converted each value (``_backward`` then skips that step)
    scale = softmax_scale(ctx.scale, query.shape[-1])
    args = AttentionBackwardArgs(
        grad_out=grad_out,
        query=query,
        key=key,
        value=value,
        out=out,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=ctx.max_seqlens[0],
        max_seqlen_k=ctx.max_seqlens[1],
        logsumexp=lse,
        custom_mask_type=ctx.mask_type,
        scale=scale,
        window_size=ctx.window_size if ctx.window_size > 0 else None,
        bias=attn_bias,
        bias_requires_grad=bias_grad,
        dropout_p=ctx.dropout_p,
        philox_seed=seed,  # (read only with dropout)
        philox_offset=offset,
        backend=ctx.backend,
        deterministic=ctx.deterministic,
        grad_lse=grad_lse,
        softcap=ctx.softcap,
        seqused_q=used_q,
        seqused_k=used_k,
        sink=sink if sink_wanted else None,
    )
    dq, dk, dv, db, dsink = _backward(args, checked=True)
    return (dq, dk, dv) + (None,) * 7 + (db,) + (None,) * 6 + (dsink,)


torch.library.register_autograd("cute_kernels::memory_efficient_attention", _mea_backward, setup_context=_mea_setup)


# the op's eager path (cc.eager_autograd; the body looked up at call time, as the op's is)
_MeaEager = cc.eager_autograd("_MeaEager", lambda *inputs: _mea_impl(*inputs), _mea_setup, _mea_backward)


def memory_efficient_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: Union[bool, str] = False,
    window_size: Union[None, int, Tuple[int, int]] = None,
    scale: Optional[float] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    attn_bias: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    deterministic: Optional[bool] = None,
    return_lse: bool = False,
    softcap: Optional[float] = None,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """dropout(softmax(scale q kᵀ + bias + mask)) v in the [B, M, H, K] layout; with ``softcap``
    c, dropout(softmax(c tanh(scale q kᵀ / c) + bias + mask)) v.

    Args:
        query: [B, Mq, H, K] fp16 / bf16 / fp32, CUDA, last dim contiguous.
        key: [B, Mk, Hk, K]; value: [B, Mk, Hk, Kv] (Kv may differ from K; Hk divides H:
            grouped-query / multi-query heads); query's dtype and device.
        causal: False, True / "top_left" (query n sees keys m <= n) or "bottom_right"
            (m <= n + Mk - Mq, per sequence; needs Mq <= Mk, see the module notes).
        window_size: sliding window: an int w (causal masks only) keeps, for query n, the w keys
            n + shift - w < m <= n + shift (shift = 0 top-left, Mk - Mq bottom-right); or
            FlashAttention's (left, right) with -1 for unbounded: (left, 0) is w = left + 1,
            aligned bottom-right when ``causal`` is False, as FlashAttention aligns it;
            windows reaching past the diagonal (right > 0) raise NotImplementedError.
        scale: the softmax scale, default 1 / sqrt(K).
        cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1] for variable lengths (B == 1,
            sequences packed along M; each attends only within itself).
        max_seqlen_q, max_seqlen_k: the longest sequences; read from cu_seqlens when omitted
            (a device synchronisation, and impossible under torch.compile).
        attn_bias: added to the scaled logits; broadcastable to [B, H, Mq, Mk], query's dtype
            (not with cu_seqlens). With requires_grad it gets its gradient (summed over
            the broadcast dims, as autograd does).
        dropout_p: dropout on the probabilities (torch's forward's mask for the generator's
            philox state; the backward redraws it bit for bit from the forward's seed and offset).
        backend: the backward's kernel: "auto" (the Hopper-native sm90 kernel where it
            applies, else the memory-efficient one), "sm90" (the backward raises
            NotImplementedError where it does not apply) or "mem_eff"; see the
            module notes.
        deterministic: the backward's gradients the same bits from run to run (default:
            ``torch.are_deterministic_algorithms_enabled()`` when this is called).
        return_lse: also return the logsumexp (fp32, natural log, the layout of the module
            notes). A loss on it is differentiated too, by either backward: d lse_n / d s_nm =
            P_nm, so the backward's Δ becomes Δ - dlse (rows past each sequence and rows that
            see no key take none).
        softcap: c > 0 caps the scaled logits at c tanh(scale q kᵀ / c) before the bias and
            the mask (Gemma 2, Grok; FlashAttention's order); None or 0: no cap. Our forward and
            the sm90 backward only (sm_90a, fp16 / bf16, their head dims, no bias gradient):
            elsewhere NotImplementedError, before the forward where it can tell.
        seqused_q, seqused_k: used lengths, int32 [B] (with cu_seqlens [num_seqs]) on query's
            device, either or both: sequence b's first seqused_q[b] queries and seqused_k[b] keys
            are its sequence, the rest of its rows padding (the masks, windows and bottom-right
            alignment take the used lengths). Out is 0 and the logsumexp +inf on the padding
            rows, their gradients (dQ, and dK / dV of padding keys) 0. Values are clamped to
            [0, the sequence's length] on the device. The padding must hold finite values: the
            tiles that straddle a used length load it with weight 0. Our forward and the sm90
            backward only (sm_90a, fp16 / bf16, their head dims; not with ``attn_bias`` or
            dropout): elsewhere NotImplementedError, ``backend="mem_eff"`` included.
        sink: a learnable sink per query head, [H] fp32 / fp16 / bf16 on query's device (gpt-oss;
            FlashAttention's ``learnable_sink``): e^sink_h joins every row's softmax denominator
            without a value row, so the logsumexp includes it and a row that sees no key has
            out 0 and logsumexp sink_h. With requires_grad it gets its gradient. Our forward
            only (sm_90a, fp16 / bf16, its head dims; elsewhere NotImplementedError), either
            backward (``backend="mem_eff"`` runs our forward and the memory-efficient backward).

    Returns:
        out [B, Mq, H, Kv] in query's dtype (with ``return_lse``: (out, logsumexp)). Eager varlen
        calls read each cu_seqlens tensor back once to check it (non-decreasing from 0, within M,
        within max_seqlen): a device synchronisation the first time a tensor is passed (and after
        an in-place change), none when the same tensor comes again (the layers of a step).
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    out, lse, _, _, _, _ = _forward(
        query,
        key,
        value,
        causal,
        window_size,
        scale,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        attn_bias,
        dropout_p,
        backend,
        deterministic,
        softcap,
        seqused_q,
        seqused_k,
        sink,
    )
    return (out, lse) if return_lse else out


def _forward(
    query,
    key,
    value,
    causal,
    window_size,
    scale,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    attn_bias,
    dropout_p,
    backend,
    deterministic,
    softcap=None,
    seqused_q=None,
    seqused_k=None,
    sink=None,
):
    """The checks of ``memory_efficient_attention``, then its op: (out, lse, philox seed, philox
    offset, max_seqlen_q, max_seqlen_k) with the longest lengths resolved."""
    check_backend(backend)
    softcap = check_softcap(softcap)
    deterministic = resolve_deterministic(deterministic)
    mask_type, window_size, max_q, max_k, scale = validate_call(
        query, key, value, causal, window_size, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k
    )
    seqused_q, seqused_k = check_seqused(seqused_q, seqused_k, query, key, cu_seqlens_q, cu_seqlens_k)
    seqused = seqused_q is not None
    if seqused and (attn_bias is not None or float(dropout_p) > 0.0):
        raise NotImplementedError("seqused_q / seqused_k with attn_bias or dropout are not implemented")
    if sink is not None:
        validate_once(("mea_sink", sink, query), lambda: check_sink(sink, query))
    check_float("dropout_p", dropout_p)
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if attn_bias is not None:
        attn_bias = _prepare_bias(attn_bias, query, key, cu_seqlens_q)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, attn_bias) if t is not None):
        bias_grad = attn_bias is not None and attn_bias.requires_grad  # (not in a tensor's metadata)
        validate_once(  # by metadata: the backward checks each call's addresses again
            (
                "mea_bwd",
                query,
                key,
                value,
                attn_bias,
                bias_grad,
                mask_type,
                window_size,
                dropout_p > 0.0,
                backend,
                softcap > 0.0,
                seqused,
            ),
            lambda: _check_backward_runs(
                query, key, value, mask_type, window_size, attn_bias, dropout_p, backend, softcap, seqused
            ),
        )
    mea = _MeaEager.apply if query.is_cuda and cc.eager(query) else _mea_forward
    out, lse, seed, offset = mea(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        max_q,
        max_k,
        mask_type,
        window_size,
        scale,
        attn_bias,
        dropout_p,
        backend,
        deterministic,
        softcap,
        seqused_q,
        seqused_k,
        sink,
    )
    return out, lse, seed, offset, max_q, max_k


_CAUSAL = {0: False, 1: "top_left", 2: "bottom_right"}


def efficient_attention_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    dropout_p: float,
    custom_mask_type: int,
    compute_log_sumexp: bool = False,
    *,
    scale: Optional[float] = None,
    seqlen_k: Optional[Tensor] = None,
    window_size: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, int, int]:
    """Our ``aten::_efficient_attention_forward``: (output, logsumexp, philox_seed, philox_offset,
    max_seqlen_batch_q, max_seqlen_batch_k), same arguments and layouts. The forward is ours
    where it applies (module notes), torch's otherwise; autograd differentiates it with our
    backward. Beyond aten: grouped-query key / value heads. The logsumexp has no rows (its
    last dim 0) unless ``compute_log_sumexp``; ``seqlen_k`` (per-batch key lengths) is not
    taken (NotImplementedError: aten's op takes it)."""
    if seqlen_k is not None:
        raise NotImplementedError("seqlen_k (per-batch key lengths) is not taken; aten._efficient_attention_forward is")
    check_int("custom_mask_type", custom_mask_type)
    if int(custom_mask_type) not in _CAUSAL:
        raise ValueError(f"custom_mask_type must be 0, 1 or 2, got {custom_mask_type}")
    out, lse, seed, offset, max_q, max_k = _forward(
        query,
        key,
        value,
        _CAUSAL[int(custom_mask_type)],
        window_size or None,
        scale,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        bias,
        dropout_p,
        "auto",
        resolve_deterministic(None),
    )
    if not compute_log_sumexp:
        lse = lse.new_empty((*lse.shape[:-1], 0))
    return out, lse, seed, offset, max_q, max_k


def _check_backward_runs(
    query, key, value, mask_type, window_size, attn_bias, dropout_p, backend, softcap, seqused=False
) -> None:
    """Raise before the forward what the backward would raise: a training step should fail
    before it spends a forward. Checked on real tensors (a trace's fail at run time): the
    backend asked for, and with a softcap or used lengths whether the sm90 backward (the only
    one with them) takes the problem."""
    limit = max_head_dim(query.dtype)
    if max(query.shape[-1], value.shape[-1]) > limit:
        raise NotImplementedError(
            f"the backward takes head dims up to {limit} for {query.dtype}, got query's {query.shape[-1]} and "
            f"value's {value.shape[-1]} (no gradients through this call; run it under torch.no_grad())"
        )
    if seqused and backend == "mem_eff":
        raise NotImplementedError(_SEQUSED_MEM_EFF.format(why="backend='mem_eff'"))
    if (backend != "sm90" and softcap == 0.0 and not seqused) or not query.is_cuda or not cc.eager(query):
        return
    # out's shape is all that counts (the choice reads no logsumexp: out stands in for it)
    out = torch.empty((*query.shape[:3], value.shape[3]), dtype=query.dtype, device="meta")
    args = AttentionBackwardArgs(
        grad_out=out,
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=out,
        custom_mask_type=mask_type,
        window_size=window_size,
        bias=attn_bias,
        bias_requires_grad=attn_bias is not None and attn_bias.requires_grad,
        dropout_p=dropout_p,
        backend=backend,
        softcap=softcap,
        seqused_q=out[:, 0, 0, 0] if seqused else None,  # (stands in: the choice reads its presence)
        seqused_k=out[:, 0, 0, 0] if seqused else None,
    )
    choose_backend(args, arch=cc.tensor_arch(query))


BIAS_ALIGN = 16  # elements: torch's forward wants the bias rows 128-bit aligned (SDPA pads them alike)


def _prepare_bias(attn_bias: Tensor, query: Tensor, key: Tensor, cu_seqlens_q) -> Tensor:
    """The [B, H, Mq, Mk] view torch's forward takes: broadcast dims expanded (stride 0),
    rows padded to 16 elements when they are not (differentiable ops, so autograd sums
    and crops the gradient back to ``attn_bias``'s shape)."""
    check_bias(attn_bias, query, key, cu_seqlens_q, name="attn_bias")
    b, mq, h, _ = query.shape
    mk = key.shape[1]
    full = (b, h, mq, mk)
    bias = attn_bias.expand(full)
    aligned = bias.stride(-1) == 1 and all(st % BIAS_ALIGN == 0 for st in bias.stride()[:-1])
    if not aligned:
        padded = round_up(mk, BIAS_ALIGN)
        bias = torch.nn.functional.pad(attn_bias.expand(full), (0, padded - mk))[..., :mk]
    return bias


# ------------------------------------------------------- the backward and its backends


def check_backend(backend) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")


def resolve_deterministic(deterministic) -> bool:
    """``deterministic=`` of the attention entry points: None follows torch's flag at the call."""
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool or None, got {deterministic!r}")
    return deterministic


def choose_backend(args: AttentionBackwardArgs, arch: Optional[str] = None) -> Tuple[str, str]:
    """(backend, why) for one backward asking for ``args.backend``: "sm90" or "mem_eff" and
    the reason, as logged.

    ``arch`` defaults to the device's, known only for real CUDA tensors (CPU, meta and
    fake tensors are never sm90 unless ``arch`` says so). NotImplementedError when
    ``args.backend == "sm90"`` and the sm90 path cannot take the problem, and for a softcap or
    used lengths the sm90 path cannot take (the memory-efficient kernel has neither)."""
    backend = args.backend
    check_backend(backend)
    if backend == "mem_eff":
        if args.softcap > 0.0:
            raise NotImplementedError(_SOFTCAP_MEM_EFF.format(why="backend='mem_eff'"))
        if args.seqused:
            raise NotImplementedError(_SEQUSED_MEM_EFF.format(why="backend='mem_eff'"))
        return "mem_eff", "backend='mem_eff'"
    reason = _not_on_sm90(args, arch)
    if reason is None:
        return "sm90", f"backend={backend!r}, supported"
    if backend == "sm90":
        raise NotImplementedError(f"backend='sm90' cannot take this attention backward: {reason}")
    if args.softcap > 0.0:
        raise NotImplementedError(_SOFTCAP_MEM_EFF.format(why=f"the sm90 backward does not apply: {reason}"))
    if args.seqused:
        raise NotImplementedError(_SEQUSED_MEM_EFF.format(why=f"the sm90 backward does not apply: {reason}"))
    return "mem_eff", f"backend='auto', not on sm90: {reason}"


_SOFTCAP_MEM_EFF = "softcap: the memory-efficient backward has no softcap ({why})"
_SEQUSED_MEM_EFF = "seqused_q / seqused_k: the memory-efficient backward has no used lengths ({why})"


def _not_on_sm90(a: AttentionBackwardArgs, arch: Optional[str]) -> Optional[str]:
    """Why the sm90 path cannot take ``a`` (None: it can)."""
    # what the op offers beyond unsupported()'s list: the sm90 kernel neither splits keys
    # nor writes dQ / dK / dV into one packed buffer
    if a.num_splits_key is not None:
        return f"num_splits_key={a.num_splits_key} (the sm90 path does not split keys)"
    if a.shared_storage_dqdkdv:
        return "shared_storage_dqdkdv (the sm90 path has no packed dQ / dK / dV outputs)"
    return sm90.unsupported(
        a.query,
        a.key,
        a.value,
        a.grad_out,
        a.out,
        mask_type=int(a.custom_mask_type),
        window_size=a.window_size,
        bias=a.bias,
        dropout_p=float(a.dropout_p),
        arch=arch,
        softcap=a.softcap,
        grad_bias=a.bias is not None and bool(a.bias_requires_grad),
    )


def run_backward(args: AttentionBackwardArgs):
    """The backend choice (logged), then that backend's launches: (grad_q, grad_k, grad_v, grad_bias,
    grad_sink); grad_sink None without ``args.sink`` (the sm90 backward's preprocess writes its
    terms, else ``attention_sink.sink_grad``)."""
    choice, why = choose_backend(args)
    if log.isEnabledFor(logging.DEBUG):  # (the arguments cost host time on every call)
        b, mq, h, d = args.query.shape
        mask, mk = int(args.custom_mask_type), args.key.shape[1]
        log.debug("attention backward: %s (%s; B=%d Mq=%d Mk=%d H=%d D=%d mask %d)", choice, why, b, mq, mk, h, d, mask)
    if choice == "sm90":
        return sm90.attention_backward_sm90(args)
    grads = mem_eff.attention_backward_mem_eff(args)
    if args.sink is None:
        return (*grads, None)
    a = args
    return (*grads, sink_grad(a.sink, a.out, a.grad_out, a.logsumexp, a.grad_lse, a.cu_seqlens_q, a.max_seqlen_q))


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
    grad_lse: Optional[Tensor] = None,
    softcap: float = 0.0,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    sink: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # the parameters are AttentionBackwardArgs' fields, in order (the op's schema is flat); the
    # backend is chosen here, at run time, on the real tensors (their device's arch)
    gq, gk, gv, gb, gs = run_backward(AttentionBackwardArgs(**locals()))
    # an op returns tensors: no bias or sink gradient is an empty one (the wrapper gives None),
    # one each: an op's outputs may not alias one another
    gb = query.new_empty((0,)) if gb is None else gb
    return gq, gk, gv, gb, query.new_empty((0,)) if gs is None else gs


@_op.register_fake
def _(*flat, **named):
    a = AttentionBackwardArgs.from_op(*flat, **named)
    query = a.query
    gb = query.new_empty((0,))
    if a.bias is not None and a.bias_requires_grad:
        b, mq, h, _ = query.shape
        gb = query.new_empty((b, h, mq, a.key.shape[1]))
    gs = query.new_empty((0,)) if a.sink is None else a.sink.new_empty(a.sink.shape)
    # either backend: fresh contiguous [B, M, H, D] gradients, whatever the inputs' strides
    return query.new_empty(query.shape), a.key.new_empty(a.key.shape), a.value.new_empty(a.value.shape), gb, gs


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
    check_backend(backend)
    deterministic = resolve_deterministic(deterministic)
    _check_dropout(dropout_p, philox_seed, philox_offset)
    given = AttentionBackwardArgs(
        grad_out=grad_out_,
        query=query,
        key=key,
        value=value,
        out=out,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        logsumexp=logsumexp,
        custom_mask_type=custom_mask_type,
        scale=scale,
        num_splits_key=num_splits_key,
        window_size=window_size,
        shared_storage_dqdkdv=shared_storage_dqdkdv,
        bias=bias,
        bias_requires_grad=bias_requires_grad,
        dropout_p=dropout_p,
        philox_seed=philox_seed,
        philox_offset=philox_offset,
        backend=backend,
        deterministic=deterministic,
    )
    return _backward(given)[:4]


def _backward(
    given: AttentionBackwardArgs, checked: bool = False
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """``efficient_attention_backward``'s body on its arguments, checked here unless ``checked``;
    also ``memory_efficient_attention``'s backward, with what aten's signature has no room for
    (the logsumexp's gradient, a learnable sink's). (grad_q, grad_k, grad_v, grad_bias,
    grad_sink). ``checked``: the op's own backward, whose inputs its forward checked (and that
    the backward runs on them) and whose gradients autograd gives out's and the LSE's shape,
    dtype and device (``kernel_ready`` their strides)."""
    query, bias = given.query, given.bias
    if checked:  # built normalized by the op's backward (``_mea_backward``)
        args = given
    else:
        check_backward_args(given)
        if given.scale is not None:
            check_float("scale", given.scale)
        args = given.normalized(softmax_scale(given.scale, query.shape[-1]))
    grad_q, grad_k, grad_v, grad_bias, grad_sink = run_backward(args) if cc.eager(query) else _op(*args.op_args())
    if given.sink is None:
        grad_sink = None
    if bias is None or not given.bias_requires_grad:
        return grad_q, grad_k, grad_v, None, grad_sink
    if tuple(bias.shape) != tuple(grad_bias.shape):  # a broadcast bias: autograd's gradient
        grad_bias = grad_bias.sum_to_size(bias.shape)
    return grad_q, grad_k, grad_v, grad_bias, grad_sink


def _check_dropout(dropout_p, philox_seed, philox_offset) -> None:
    """dropout_p in [0, 1); with dropout, the philox seed and offset the forward returned."""
    check_float("dropout_p", dropout_p)
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if float(dropout_p) == 0.0:
        return
    for name, t in (("philox_seed", philox_seed), ("philox_offset", philox_offset)):
        if not isinstance(t, Tensor) or t.numel() != 1 or t.dtype != torch.int64:
            raise ValueError(f"dropout needs {name} as the forward returned it (an int64 scalar tensor), got {t!r}")


__all__: List[str] = ["efficient_attention_backward", "efficient_attention_forward", "memory_efficient_attention"]
