"""Choices of the Hopper attention forward that are not layouts: tiles per head dim, register
budgets, pipeline depth, the warpgroup ping-pong. Measured on H100 / H200 (docs/attention_sm90.md)."""

from __future__ import annotations

from layouts.attention_fwd_sm90 import AttentionFwdSm90Tiles

HEAD_DIMS = (64, 128)  # Dqk = Dv the forward compiles for; others run torch's forward
STAGES = 2  # K / V ring depth

# (tile_m, tile_n) per head dim: two consumer warpgroups. ptxas allocates a kernel's registers
# by its launch bound (168 a thread for 384 threads, 128 for 512), not by setmaxnreg, so S, P
# and O of a 64-row warpgroup must fit 168: 128 keys a block (192 x 128 with three consumer
# warpgroups spills 580 bytes and ran at 0.36x of 128 x 128, H200, 16x16x2048x64). d128 takes
# 144 keys (H100, against 128: 4x32x2048x128 with 8 kv heads 0.470 / 0.474 ms, 8x16x4096x128
# 1.686 / 1.783, 2x16x8192x128 1.726 / 1.735, causal 1x32x16384 3.511 / 3.492); d64's 192 x 112
# and 192 x 96 no longer spill but ran no faster than 128 x 128 (16x16x2048x64 0.738 ms all three)
TILES = {64: (128, 128), 128: (128, 144)}

PRODUCER_REGS = {2: 24, 3: 32}  # setmaxnreg of the producer warpgroup, by consumer warpgroups
CONSUMER_REGS = {2: 240, 3: 160}  # of each consumer warpgroup (within 64K registers a CTA)


def forward_tiles(head_dim: int, head_dim_v: int) -> AttentionFwdSm90Tiles:
    """The tiles the forward compiles with for Dqk / Dv (``forward_unsupported`` first)."""
    tile_m, tile_n = TILES[head_dim]
    return AttentionFwdSm90Tiles(head_dim, head_dim_v, tile_m, tile_n, STAGES)


def forward_unsupported(head_dim: int, head_dim_v: int):
    """Why the forward has no tiles for these head dims (None: it has)."""
    if head_dim != head_dim_v or head_dim not in HEAD_DIMS:
        return f"the forward compiles head dims {HEAD_DIMS} with Dqk = Dv"
    return None


def pingpong(tiles: AttentionFwdSm90Tiles) -> bool:
    """Whether the consumer warpgroups take turns issuing their products (named barriers), so
    one's softmax runs while the other's wgmmas do: with two or more of them."""
    return tiles.consumer_wgs >= 2
