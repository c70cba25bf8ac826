"""``context_parallel_attention``: attention over a sequence sharded across the ranks of a
torch.distributed group, forward and backward (Llama 3's context parallelism: K / V
all-gathered, gradients reduce-scattered).

Inputs are each rank's head-tail slice of the sequence (``ops.context_parallel_layout``:
rank r of N holds chunks r and 2N - 1 - r of 2N; ``shard`` / ``unshard`` move full tensors
into and out of it).

Forward: K and V are all-gathered asynchronously (V's gather is in flight while K is put in
global order); each local query chunk attends its key range with a bottom-right causal mask
(``chunk_calls``), or all local queries attend all keys in one call without a mask. The
backward runs the attention backward per call from the saved out and logsumexp (no forward
is recomputed), sums dK / dV into a buffer in the ranks' layout (fp32 for fp16 / bf16) and
reduce-scatters it.

The per-rank attention (``ChunkAttention``) is ``ops.memory_efficient_attention`` /
``ops.efficient_attention_backward`` on CUDA tensors; on CPU tensors it is the fp64 reference of
``ops.reference`` (plain torch math of the same semantics, so that CPU runs test the host logic
and the collectives, not the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from layouts.attention_sm90 import TMA_ALIGN_BYTES  # the kernels' widest access: gradients are made dense otherwise

from . import context_parallel_layout as layout
from . import reference
from ._validate import check_dtype, check_float, check_tensor, kernel_ready
from .attention import check_backend, efficient_attention_backward, memory_efficient_attention, resolve_deterministic
from .attention_checks import mask_type_of, window_of
from .attention_common import DTYPES, softmax_scale
from .context_parallel_layout import shard, unshard

_CAUSAL = {0: False, 2: "bottom_right"}


@dataclass(frozen=True)
class ChunkAttention:
    """The attention one rank runs on its chunks.

    ``forward(q, k, v, mask_type, window, scale) -> (out, lse)``: q [B, Mq, H, D], k / v
    [B, Mk, Hk, D / Dv], mask_type 0 or 2 (bottom right), window 0 or w; lse fp32
    [B, H, >= Mq]. ``backward(grad_out, q, k, v, out, lse, mask_type, window, scale) ->
    (dq, dk, dv)`` from that out and lse."""

    forward: Callable
    backward: Callable
    name: str


def op_attention(backend: str = "auto", deterministic: Optional[bool] = None) -> ChunkAttention:
    """``ops.memory_efficient_attention`` and ``ops.efficient_attention_backward`` (CUDA), with
    the backward's ``backend`` and ``deterministic``."""
    check_backend(backend)
    deterministic = resolve_deterministic(deterministic)

    def forward(q, k, v, mask_type, window, scale):
        return memory_efficient_attention(
            q,
            k,
            v,
            causal=_CAUSAL[mask_type],
            window_size=window or None,
            scale=scale,
            backend=backend,
            deterministic=deterministic,
            return_lse=True,
        )

    def backward(grad_out, q, k, v, out, lse, mask_type, window, scale):
        grad_out = kernel_ready(grad_out, TMA_ALIGN_BYTES // grad_out.element_size())
        dq, dk, dv, _ = efficient_attention_backward(
            grad_out,
            q,
            k,
            v,
            None,
            out,
            None,
            None,
            q.shape[1],
            k.shape[1],
            lse,
            0.0,
            None,
            None,
            mask_type,
            False,
            scale=scale,
            window_size=window or None,
            backend=backend,
            deterministic=deterministic,
        )
        return dq, dk, dv

    return ChunkAttention(forward, backward, f"ops.memory_efficient_attention (backend={backend!r})")


def _ref_forward(q, k, v, mask_type, window, scale):
    return reference.attention_op_ref(q, k, v, custom_mask_type=mask_type, window_size=window, scale=scale)


def _ref_backward(grad_out, q, k, v, out, lse, mask_type, window, scale):
    del lse  # the reference recomputes the probabilities
    return reference.attention_op_backward_ref(
        grad_out, q, k, v, out, custom_mask_type=mask_type, window_size=window, scale=scale
    )


REFERENCE_ATTENTION = ChunkAttention(_ref_forward, _ref_backward, "ops.reference (fp64 torch math)")


@dataclass(frozen=True)
class _Plan:
    """What the autograd Function needs besides the tensors."""

    group: object
    world: int
    calls: Tuple[layout.ChunkCall, ...]
    global_order: bool  # keys gathered into the global sequence (a mask needs it)
    window: int
    scale: float
    attention: ChunkAttention


def _gather_kv(key: Tensor, value: Tensor, plan: _Plan) -> Tuple[Tensor, Tensor]:
    """K and V of every rank as [B, S, Hk, D]: both gathers issued at once, K reordered while
    V's is in flight."""
    k_slots, k_work = layout.gather_slots(key, plan.group, plan.world)
    v_slots, v_work = layout.gather_slots(value, plan.group, plan.world)
    arrange = layout.slots_to_global if plan.global_order else layout.slots_as_sequence
    k_work.wait()
    k_all = arrange(k_slots)
    v_work.wait()
    return k_all, arrange(v_slots)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """dK / dV are summed over calls and ranks in fp32 for 16-bit inputs (2N terms a key)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, plan: _Plan):
        k_all, v_all = _gather_kv(key, value, plan)
        outs, lses = [], []
        for call in plan.calls:
            keys = slice(call.k_start, call.k_end)
            o, lse = plan.attention.forward(
                query[:, call.q_start : call.q_end],
                k_all[:, keys],
                v_all[:, keys],
                call.mask_type,
                plan.window,
                plan.scale,
            )
            outs.append(o)
            lses.append(lse)
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        lse = torch.cat([x[..., : c.q_end - c.q_start] for x, c in zip(lses, plan.calls)], dim=-1)
        ctx.save_for_backward(query, k_all, v_all, out, *lses)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        del grad_lse  # the logsumexp is not differentiable (None)
        if grad_out is None:
            return None, None, None, None
        query, k_all, v_all, out, *lses = ctx.saved_tensors
        plan = ctx.plan
        dq, dk_slots, dv_slots = _call_gradients(plan, grad_out, query, k_all, v_all, out, lses)
        dk, dk_work = layout.reduce_scatter_slots(dk_slots, plan.group)
        dv, dv_work = layout.reduce_scatter_slots(dv_slots, plan.group)
        dq = torch.cat(dq, dim=1) if len(dq) > 1 else dq[0]  # beside the reduce-scatters
        dk_work.wait()
        dv_work.wait()
        return dq.to(query.dtype), dk.to(k_all.dtype), dv.to(v_all.dtype), None


def _call_gradients(plan: _Plan, grad_out, query, k_all, v_all, out, lses):
    """The per-call backwards: ([dQ of each call], dK slots, dV slots), the key gradients
    summed into [N, B, 2C, Hk, D] buffers in the ranks' layout."""
    acc = _accumulation_dtype(k_all.dtype)
    shape = (plan.world, *query.shape[:2])
    dk_slots = k_all.new_zeros((*shape, *k_all.shape[2:]), dtype=acc)
    dv_slots = v_all.new_zeros((*shape, *v_all.shape[2:]), dtype=acc)
    dqs = []
    for call, lse in zip(plan.calls, lses):
        rows, keys = slice(call.q_start, call.q_end), slice(call.k_start, call.k_end)
        dq, dk, dv = plan.attention.backward(
            grad_out[:, rows],
            query[:, rows],
            k_all[:, keys],
            v_all[:, keys],
            out[:, rows],
            lse,
            call.mask_type,
            plan.window,
            plan.scale,
        )
        dqs.append(dq)
        layout.add_keys_to_slots(dk_slots, dk, call.k_start, plan.global_order)
        layout.add_keys_to_slots(dv_slots, dv, call.k_start, plan.global_order)
    return dqs, dk_slots, dv_slots


def _check_inputs(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, local seqlen, heads, head_dim], got shape {tuple(t.shape)}")
        if t.device != query.device or t.dtype != query.dtype:
            raise ValueError(
                f"{name} is {t.dtype} on {t.device}, query {query.dtype} on {query.device}: they must agree"
            )
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; pass {name}.contiguous()")
    b, s, h, d = query.shape
    if s < 2 or s % 2:
        raise ValueError(f"query's local sequence must be two chunks of equal length (even, >= 2), got {s}")
    hk = key.shape[2]
    if tuple(key.shape) != (b, s, hk, d) or hk < 1 or h % hk:
        raise ValueError(
            f"key must have shape ({b}, {s}, Hk, {d}) (query's batch, local seqlen and head_dim; Hk dividing "
            f"query's {h} heads), got {tuple(key.shape)}"
        )
    if tuple(value.shape[:3]) != tuple(key.shape[:3]):
        raise ValueError(
            f"value must have key's batch, seqlen and heads {tuple(key.shape[:3])}, got {tuple(value.shape)}"
        )


def _check_group_device(group, query) -> None:
    backend = str(dist.get_backend(group))
    if backend == "nccl" and query.device.type != "cuda":
        raise ValueError(f"an NCCL group takes CUDA tensors, got them on {query.device}")


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group=None,
    causal: Union[bool, str] = False,
    window_size: Union[None, int, Tuple[int, int]] = None,
    scale: Optional[float] = None,
    backend: str = "auto",
    deterministic: Optional[bool] = None,
    return_lse: bool = False,
    attention: Optional[ChunkAttention] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Self-attention over a sequence sharded across the ranks of ``group``, differentiable.

    Every rank calls it with its head-tail slice of the global sequence (``shard``): rank r of
    N holds chunks r and 2N - 1 - r of the sequence cut into 2N equal chunks (torch's
    ``context_parallel`` load-balances alike). The group's ranks must pass the same shapes
    (not checked across ranks: a mismatch fails or hangs in the collectives).

    Args:
        query: [B, S_local, H, D] (S_local = 2 C, even); key, value: [B, S_local, Hk, D / Dv],
            Hk dividing H (grouped-query heads); one dtype and device. CUDA tensors run our
            attention op; CPU tensors run the fp64 reference of ``ops.reference`` (a test path:
            plain torch math, [H, C, S] matrices per call).
        group: the process group (default: the default group); NCCL for CUDA, gloo for CPU.
        causal: False, or True / "top_left" / "bottom_right" (the same thing here: the global
            query and key lengths are equal).
        window_size: a sliding window as in ``memory_efficient_attention`` (an int w with
            causal, or FlashAttention's (left, 0)); keys outside every query's window are not
            passed to the per-rank calls.
        scale: softmax scale, default 1 / sqrt(D).
        backend, deterministic: the CUDA backward's, as in ``memory_efficient_attention``.
        return_lse: also return the logsumexp, fp32 [B, H, S_local] in the local layout (no
            gradient flows through it).
        attention: the per-rank attention (``ChunkAttention``); default ``op_attention(backend,
            deterministic)`` on CUDA, ``REFERENCE_ATTENTION`` on CPU.

    Returns:
        this rank's out [B, S_local, H, Dv] (and its logsumexp). Memory per rank: the gathered
        K and V ([B, S, Hk, D + Dv]) live from the forward to the backward; the backward adds
        dK / dV buffers of that size (fp32 for fp16 / bf16).
    """
    _check_inputs(query, key, value)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    mask_type, window = window_of(mask_type_of(causal), window_size)
    if scale is not None:
        check_float("scale", scale)
    if attention is None:
        if query.is_cuda:  # refused here, not after the gathers
            check_dtype("query", query, DTYPES)
        attention = op_attention(backend, deterministic) if query.is_cuda else REFERENCE_ATTENTION
    elif not isinstance(attention, ChunkAttention):
        raise TypeError(f"attention must be a ChunkAttention, got {type(attention).__name__}")
    scale = softmax_scale(scale, query.shape[-1])
    plan = _plan(group, query, mask_type, window, scale, attention)
    out, lse = _ContextParallelAttention.apply(query, key, value, plan)
    return (out, lse) if return_lse else out


def _plan(group, query, mask_type, window, scale, attention) -> _Plan:
    """The group's rank and size (checked against the tensors' device) and this rank's calls."""
    rank, world = layout.group_shape(group)
    _check_group_device(group, query)
    return _Plan(
        group=group,
        world=world,
        calls=tuple(layout.chunk_calls(rank, world, query.shape[1], mask_type != 0, window)),
        global_order=mask_type != 0,
        window=window,
        scale=scale,
        attention=attention,
    )


__all__ = ["ChunkAttention", "REFERENCE_ATTENTION", "context_parallel_attention", "op_attention", "shard", "unshard"]
