"""Choices of the Hopper attention forward that are not layouts: tiles per head dim, register
budgets, pipeline depth, the warpgroup ping-pong. Measured on H100 / H200 (docs/attention_fwd_sm90.md)."""

from __future__ import annotations

from layouts.attention_fwd_sm90 import AttentionFwdSm90Tiles

STAGES = 2  # K / V ring depth

# (tile_m, tile_n) per (Dqk, Dv), and with a sliding window where it differs: two consumer
# warpgroups of 64 query rows, each holding S (tile_n / 2 fp32 a thread), P (tile_n / 4) and O
# (Dv / 2) in its setmaxnreg budget (ptxas reports the launch bound, 168 a thread for 384
# threads, as the kernel's count; a real spill shows as spill stores). d64: 192 x 128 with three
# consumer warpgroups (160 registers each) spilled 580 bytes and ran at 0.36x of 128 x 128 (H200,
# 16x16x2048x64); 192 x 112 and 192 x 96 no longer spill but ran no faster (0.738 ms all three).
# d128 takes 144 keys (H100, against 128: 4x32x2048x128 with 8 kv heads 0.470 / 0.474 ms,
# 8x16x4096x128 1.686 / 1.783, 2x16x8192x128 1.726 / 1.735, causal 1x32x16384 3.511 / 3.492);
# 128 x 176 and 128 x 192 spill. d96, d192, d256: FA4's sm90 tiles where its P V reads P from
# registers as ours does (its d96 is 192 x 144 with P from shared memory), not measured here yet.
# d96 128 x 144 does not spill either (a candidate), 128 x 160 spills 260 bytes. Shared memory
# bounds d192 and d256 (Q, two K / V stages, O in Q's buffer): 112 keys at Dv 192 (217 KB),
# 128 at Dv 128 (209 KB), 80 at d256 (225 KB of the 227). A window takes fewer keys a block at
# d192 / d256 (FA4's choice: less of each edge block masked off).
TILES = {
    (64, 64): (128, 128),
    (96, 96): (128, 128),
    (128, 128): (128, 144),
    (192, 192): (128, 112),
    (192, 128): (128, 128),
    (256, 256): (128, 80),
}
HEAD_DIMS = tuple(TILES)  # (Dqk, Dv) the forward compiles for; others run torch's forward
WINDOW_TILES = {(192, 192): (128, 96), (192, 128): (128, 96), (256, 256): (128, 64)}

PRODUCER_REGS = {2: 24, 3: 32}  # setmaxnreg of the producer warpgroup, by consumer warpgroups
CONSUMER_REGS = {2: 240, 3: 160}  # of each consumer warpgroup (within 64K registers a CTA)


def forward_tiles(head_dim: int, head_dim_v: int, window: bool = False) -> AttentionFwdSm90Tiles:
    """The tiles the forward compiles with for Dqk / Dv, with or without a sliding window
    (``forward_unsupported`` first)."""
    dims = (head_dim, head_dim_v)
    tile_m, tile_n = WINDOW_TILES.get(dims, TILES[dims]) if window else TILES[dims]
    return AttentionFwdSm90Tiles(head_dim, head_dim_v, tile_m, tile_n, STAGES)


def forward_unsupported(head_dim: int, head_dim_v: int):
    """Why the forward has no tiles for these head dims (None: it has)."""
    if (head_dim, head_dim_v) not in HEAD_DIMS:
        return "the forward compiles (Dqk, Dv) " + ", ".join(f"({d}, {dv})" for d, dv in HEAD_DIMS)
    return None


def pingpong(tiles: AttentionFwdSm90Tiles) -> bool:
    """Whether the consumer warpgroups take turns issuing their products (named barriers), so
    one's softmax runs while the other's wgmmas do: with two or more of them."""
    return tiles.consumer_wgs >= 2
