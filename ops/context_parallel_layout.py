"""The head-tail sequence layout of context parallelism, its per-rank attention calls and the
collectives that move tensors in and out of it.

N ranks share a global sequence of S tokens cut into 2N chunks of C = S / 2N; rank r holds
chunks r and 2N - 1 - r, in that order, as its local [B, 2C, ...] slice. Under a causal mask
chunk j sees (j + 1) C keys, so every rank's pair sees 2N + 1 chunks' worth of keys: the same
work on every rank (torch's ``context_parallel`` balances its ring the same way).

A buffer in the ranks' order ("slots") is [N, B, 2C, ...]: rank r's local slice at [r], what
an all-gather gives and what a reduce-scatter takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 names them *_single (the *_tensor names warn there); 2.11 has only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rank_chunks(rank: int, world: int) -> Tuple[int, int]:
    """The two global chunks rank ``rank`` of ``world`` holds, in their local order."""
    return rank, 2 * world - 1 - rank


@dataclass(frozen=True)
class ChunkCall:
    """One per-rank attention call: the local query rows [q_start, q_end) against the keys
    [k_start, k_end) of the gathered sequence, with mask ``mask_type`` (0: none, 2: causal
    from the bottom right, i.e. aligned on the last query and last key of the call)."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    mask_type: int


def chunk_calls(rank: int, world: int, local_len: int, causal: bool, window: int = 0) -> List[ChunkCall]:
    """The attention calls of rank ``rank``.

    Causal: one per local chunk j, keys up to the chunk's end ((j + 1) C), bottom-right mask so
    that query j C + n sees keys up to j C + n. A window of w keys starts them at j C + 1 - w
    (the keys no query of the chunk sees are not passed). Without a mask: one call of all local
    queries against all S keys, left in the ranks' order (unmasked attention does not change
    when its keys and values are permuted alike)."""
    c = local_len // 2
    if not causal:
        return [ChunkCall(0, local_len, 0, 2 * world * c, 0)]
    calls = []
    for h, j in enumerate(rank_chunks(rank, world)):
        start = max(0, j * c + 1 - window) if window > 0 else 0
        calls.append(ChunkCall(h * c, (h + 1) * c, start, (j + 1) * c, 2))
    return calls


# --------------------------------------------------------------- layout (no collectives)


def shard_for(x: Tensor, rank: int, world: int, dim: int = 1) -> Tensor:
    """Rank ``rank``'s local slice of the full-sequence ``x`` (sequence along ``dim``)."""
    s = x.shape[dim]
    if s % (2 * world):
        raise ValueError(f"the sequence ({s} along dim {dim}) must split into 2 x {world} ranks = {2 * world} chunks")
    c = s // (2 * world)
    return torch.cat([x.narrow(dim, j * c, c) for j in rank_chunks(rank, world)], dim=dim)


def slots_to_global(slots: Tensor) -> Tensor:
    """[N, B, 2C, ...] in the ranks' order -> [B, S, ...] in the global order (one copy)."""
    n, b, local = slots.shape[:3]
    c = local // 2
    out = slots.new_empty((b, n * local, *slots.shape[3:]))
    for r in range(n):
        for h, j in enumerate(rank_chunks(r, n)):
            out[:, j * c : (j + 1) * c] = slots[r, :, h * c : (h + 1) * c]
    return out


def slots_as_sequence(slots: Tensor) -> Tensor:
    """[N, B, 2C, ...] -> [B, N 2C, ...] keeping the ranks' order (a view when B == 1)."""
    return slots.movedim(0, 1).flatten(1, 2)


def add_keys_to_slots(acc: Tensor, grad: Tensor, start: int, global_order: bool) -> None:
    """``acc`` [N, B, 2C, ...] += ``grad`` [B, L, ...], the gradient of the gathered keys
    [start, start + L) (global positions, or positions in the ranks' order)."""
    n, _, local = acc.shape[:3]
    if not global_order:  # the call saw all keys in the ranks' order
        acc.add_(grad.unflatten(1, (n, local)).movedim(1, 0))
        return
    c, end = local // 2, start + grad.shape[1]
    for r in range(n):
        for h, j in enumerate(rank_chunks(r, n)):
            lo, hi = max(start, j * c), min(end, (j + 1) * c)
            if lo < hi:
                acc[r, :, h * c + lo - j * c : h * c + hi - j * c] += grad[:, lo - start : hi - start]


# ------------------------------------------------------------------------ collectives


def group_shape(group) -> Tuple[int, int]:
    """(rank, world size) in ``group`` (None: the default group)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context parallelism needs torch.distributed initialised (dist.init_process_group)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise RuntimeError("this process is not a member of the group")
    return rank, dist.get_world_size(group)


def gather_slots(x: Tensor, group, world: int):
    """(slots [N, *x.shape], work handle): an asynchronous all-gather of every rank's ``x``."""
    x = x.contiguous()
    slots = x.new_empty((world, *x.shape))
    # the concatenated form (gloo takes no stacked one)
    return slots, _all_gather(slots.flatten(0, 1), x, group=group, async_op=True)


def reduce_scatter_slots(slots: Tensor, group):
    """(this rank's sum over ranks of ``slots[rank]``, work handle), asynchronous."""
    out = slots.new_empty(slots.shape[1:])
    return out, _reduce_scatter(out, slots.flatten(0, 1), group=group, async_op=True)


def shard(x: Tensor, group=None, dim: int = 1) -> Tensor:
    """This rank's head-tail slice of the full sequence ``x`` (the same ``x`` on every rank, the
    sequence along ``dim``, its length a multiple of 2 x the group's size): chunks r and
    2N - 1 - r of 2N. Differentiable (slices and a concatenation); no communication."""
    rank, world = group_shape(group)
    return shard_for(x, rank, world, dim)


@torch.no_grad()
def unshard(x: Tensor, group=None, dim: int = 1) -> Tensor:
    """The full sequence from every rank's head-tail slice ``x`` (sequence along ``dim``): an
    all-gather, the same result on every rank. Not differentiable."""
    _, world = group_shape(group)
    seq_first = x.movedim(dim, 0).unsqueeze(0)  # [1, 2C, ...]: the slots' batch of one
    slots, work = gather_slots(seq_first, group, world)
    work.wait()
    return slots_to_global(slots).squeeze(0).movedim(0, dim)
