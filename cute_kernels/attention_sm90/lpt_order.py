"""The heavy-first CTA order of the sm90 attention backward under a causal mask, and a model
that picks its chunk size.

The kernel's 1-D grid (``AttentionBackwardSm90.cta_coords``) walks chunks of
``heads_per_chunk`` (batch, key head) pairs; inside a chunk every pair takes key block 0,
then block 1, ... Key block n sees the query blocks from its diagonal on, so the blocks come
heaviest first and the light ones fill the last wave. The chunk keeps the Q / dO / dQ rows
the resident CTAs share within L2.

Which chunk size is best is not monotone: the hardware hands CTAs to SMs in grid order as
they free up (list scheduling), and a last, partial chunk starts its heavy blocks late.
2x16x4096 causal d128 (80-query steps, 32 key blocks of 52 .. 2 steps, 132 SMs): chunks of
6 heads (what fits 24 MiB of L2) end 15% after the ideal, chunks of 4 or 8 within 1%.
``best_heads_per_chunk`` simulates that list scheduling for every chunk size the L2 budget
allows and takes the shortest (ties: the smaller chunk).
"""

from __future__ import annotations

import functools
import heapq
from typing import Sequence

# per-CTA cost outside its steps (K / V loads, the epilogue, the CTA's launch), in steps: the
# model's makespans move little with it (0 to 4 give the same choices on the suite's shapes)
TILE_OVERHEAD_STEPS = 2
# the simulation's budget (CTAs placed, all candidates together; ~0.3 s of host time once per
# shape): past it the largest chunk that fits L2 is taken, as without the model
MAX_SIMULATED_CTAS = 1 << 18


def heavy_first_order(n_blocks: int, pairs: int, heads_per_chunk: int) -> list:
    """(key block, pair) of each CTA in grid order (the kernel's cta_coords): chunks of
    ``heads_per_chunk`` pairs, key blocks outer inside a chunk, the last chunk narrower."""
    order = []
    for first in range(0, pairs, heads_per_chunk):
        width = min(heads_per_chunk, pairs - first)
        order.extend((n, first + j) for n in range(n_blocks) for j in range(width))
    return order


def makespan(costs: Sequence[float], num_sms: int) -> float:
    """When the last CTA ends if CTAs of these costs, in this order, each take the SM that
    frees up first (one CTA per SM at a time, as the sm90 kernel's shared memory allows)."""
    free = [0.0] * max(1, num_sms)
    for c in costs:
        heapq.heapreplace(free, free[0] + c)
    return max(free)


def chunk_makespan(block_steps: Sequence[int], pairs: int, heads_per_chunk: int, num_sms: int) -> float:
    """Modelled makespan, in steps, of the heavy-first order with ``heads_per_chunk``:
    ``block_steps[n]`` steps for key block n of every pair, plus TILE_OVERHEAD_STEPS per CTA
    with work (a CTA without any returns at once)."""
    costs = [s + TILE_OVERHEAD_STEPS if s > 0 else 0.0 for s in block_steps]
    return makespan([costs[n] for n, _ in heavy_first_order(len(costs), pairs, heads_per_chunk)], num_sms)


def makespan_over_ideal(block_steps: Sequence[int], pairs: int, heads_per_chunk: int, num_sms: int) -> float:
    """chunk_makespan over the ideal: every CTA's cost spread evenly over ``num_sms``."""
    total = sum(s + TILE_OVERHEAD_STEPS for s in block_steps if s > 0) * pairs
    return chunk_makespan(block_steps, pairs, heads_per_chunk, num_sms) * max(1, num_sms) / max(total, 1)


@functools.lru_cache(maxsize=256)
def best_heads_per_chunk(block_steps: tuple, pairs: int, max_heads: int, num_sms: int) -> int:
    """The chunk size (1 .. ``max_heads``, the L2 budget) whose heavy-first order has the
    shortest modelled makespan; ``block_steps[n]``: the steps key block n runs (the same for
    every pair). Ties go to the smaller chunk (less of L2)."""
    max_heads = max(1, min(max_heads, pairs))
    # every size up to 16, then powers of two and the budget itself
    candidates = sorted(
        {h for h in range(1, min(max_heads, 16) + 1)}
        | {1 << k for k in range(max_heads.bit_length()) if 1 << k <= max_heads}
        | {max_heads}
    )
    if len(block_steps) * pairs * len(candidates) > MAX_SIMULATED_CTAS:
        return max_heads
    best, best_time = max_heads, None
    for h in candidates:
        t = chunk_makespan(block_steps, pairs, h, num_sms)
        if best_time is None or t < best_time * (1 - 1e-9):
            best, best_time = h, t
    return best
