"""Choices of the Hopper attention forward that are not layouts: tiles per head dim, register
budgets, pipeline depth, the warpgroup ping-pong. Measured on H100 / H200 (docs/attention_fwd_sm90.md)."""

from __future__ import annotations

import functools

from layouts.attention_fwd_sm90 import AttentionFwdSm90Tiles

STAGES = 2  # K / V ring depth

# (tile_m, tile_n) per (Dqk, Dv), and with a sliding window where it differs. Consumer warpgroups
# of 64 query rows (tile_m / 64 of them) each hold S (tile_n / 2 fp32 a thread), P (tile_n / 4)
# and O (Dv / 2) in their setmaxnreg budget (ptxas reports the launch bound as the kernel's
# count; a real spill shows as spill stores). d64 takes three consumer warpgroups (160 registers
# each; 128 x 128 leaves the exp unit idle while one warpgroup's short products run): 192 x 128,
# H200, against 128 x 128: 16x16x2048x64 0.605 / 0.670 ms, 4x16x8192x64 causal 1.173 / 1.292.
# d128: 128 x 160, H200, against 144 / 128 / 176 keys (ms): 4x32x2048x128 with 8 kv heads
# 0.447 / 0.463 / 0.447 / 0.456, 8x16x4096x128 1.617 / 1.732 / 1.719 / 1.642, causal 1x32x16384
# 3.377 / 3.374 / 3.673 / 3.569 (FA4 within 1% across the runs). Again with the two-chain row
# sum, 160 against 176 / 144 keys (ms, two rounds): 2x16x4096x128 0.413-0.412 / 0.420-0.422 /
# 0.422-0.428, 1x16x8192x128 0.781-0.803 / 0.811-0.849 / 0.811-0.832. d96, d192, d256: FA4's sm90
# tiles where its P V reads P from registers as ours does (its d96 is 192 x 144 with P from
# shared memory), not measured here yet; d96 128 x 144 does not spill either (a candidate).
# Shared memory bounds d192 and d256 (Q, two K / V stages, O in Q's buffer): 112 keys at Dv 192
# (217 KB), 128 at Dv 128 (209 KB), 80 at d256 (225 KB of the 227). A window takes fewer keys a
# block at d192 / d256 (FA4's choice: less of each edge block masked off).
TILES = {
    (64, 64): (192, 128),
    (96, 96): (128, 128),
    (128, 128): (128, 160),
    (192, 192): (128, 112),
    (192, 128): (128, 128),
    (256, 256): (128, 80),
}
HEAD_DIMS = tuple(TILES)  # (Dqk, Dv) the forward compiles for; others run torch's forward
# d128 with a 512-key window, H200 (ms; FA4's sm90 choice there is 128 x 128): 128 x 128 0.198 / 0.196,
# 128 x 144 0.228 / 0.229, 128 x 160 0.230 / 0.232 (two rounds). Causal without a window:
# SHORT_CAUSAL_TILES below.
WINDOW_TILES = {(128, 128): (128, 128), (192, 192): (128, 96), (192, 128): (128, 96), (256, 256): (128, 64)}
# Features that hold more a thread or take shared memory bound the tile further (the smallest
# bound that applies wins): a bias fragment (read before the softmax, beside S, P and O) spills
# at d64 192 x 128 (204 bytes) and d128 128 x 160 (184), 0 and 16 bytes (with dropout too) at
# 128 x 128; d96 / d192 keep theirs at 8 bytes. Dropout's keep flags (two buffers of
# tile_m x tile_n / 8 bytes) do not fit beside d256's 128 x 80 tiles.
BIAS_TILES = {(64, 64): (128, 128), (128, 128): (128, 128)}
# Causal over at most SHORT_CAUSAL_KEYS keys: d128 takes FA4's 128 x 128 (less of each diagonal
# block masked off); longer, 128 x 160's interior blocks win. H200, kernel alone, 160 / 128 keys a
# block, two rounds (ms): 2x16x4096x128 0.243-0.243 / 0.238-0.238, 6x16x4096x128 0.770-0.782 /
# 0.733-0.754, 4x32x2048x128 with 8 kv heads 0.295-0.310 / 0.290-0.293, packed sequences (32768
# tokens, longest 5590) 0.904-0.909 / 0.878-0.886, 1x16x8192x128 0.473-0.473 / 0.473-0.476,
# 1x32x16384x128 3.60-3.89 / 3.96-4.06.
SHORT_CAUSAL_KEYS = 8192
SHORT_CAUSAL_TILES = {(128, 128): (128, 128)}
DROPOUT_TILES = {(256, 256): (128, 64)}

PRODUCER_REGS = {2: 24, 3: 32}  # setmaxnreg of the producer warpgroup, by consumer warpgroups
CONSUMER_REGS = {2: 240, 3: 160}  # of each consumer warpgroup (within 64K registers a CTA)


def forward_tiles(
    head_dim: int,
    head_dim_v: int,
    window: bool = False,
    bias: bool = False,
    dropout: bool = False,
    short_causal: bool = False,
) -> AttentionFwdSm90Tiles:
    """The tiles the forward compiles with for Dqk / Dv and the features that bound them (a sliding
    window, an attention bias, dropout, a causal mask over few keys; ``forward_unsupported``
    first)."""
    dims = (head_dim, head_dim_v)
    bounds = [TILES[dims]]
    features = (
        (window, WINDOW_TILES),
        (bias, BIAS_TILES),
        (dropout, DROPOUT_TILES),
        (short_causal, SHORT_CAUSAL_TILES),
    )
    for on, table in features:
        if on and dims in table:
            bounds.append(table[dims])
    tile_m, tile_n = min(bounds, key=lambda t: t[0] * t[1])
    return AttentionFwdSm90Tiles(head_dim, head_dim_v, tile_m, tile_n, STAGES)


def short_causal(
    head_dim: int, head_dim_v: int, causal: bool, rows_k: int, window: bool, bias: bool, dropout: bool
) -> bool:
    """Whether a causal mask over ``rows_k`` keys (the longest sequence's) takes
    SHORT_CAUSAL_TILES: only where they differ from the tiles the other features give."""
    if not causal or rows_k > SHORT_CAUSAL_KEYS or (head_dim, head_dim_v) not in SHORT_CAUSAL_TILES:
        return False
    return _short_tiles_differ(head_dim, head_dim_v, window, bias, dropout)


@functools.lru_cache(maxsize=None)
def _short_tiles_differ(head_dim: int, head_dim_v: int, window: bool, bias: bool, dropout: bool) -> bool:
    """(Asked on every causal call: the tiles are built once per feature set.)"""
    short = forward_tiles(head_dim, head_dim_v, window, bias, dropout, True)
    return short != forward_tiles(head_dim, head_dim_v, window, bias, dropout)


def forward_unsupported(head_dim: int, head_dim_v: int):
    """Why the forward has no tiles for these head dims (None: it has)."""
    if (head_dim, head_dim_v) not in HEAD_DIMS:
        return "the forward compiles (Dqk, Dv) " + ", ".join(f"({d}, {dv})" for d, dv in HEAD_DIMS)
    return None


def pingpong(tiles: AttentionFwdSm90Tiles) -> bool:
    """Whether the consumer warpgroups take turns issuing their products (named barriers), so
    one's softmax runs while the other's wgmmas do: with two or more of them."""
    return tiles.consumer_wgs >= 2


def sum_chains(tiles: AttentionFwdSm90Tiles) -> int:
    """Independent chains of a softmax row's sum (1, 2 or 4). One chain (FA4's form) makes ptxas
    space the exp2s out, each beside the add that waits on it: the faster form with d64's three
    consumer warpgroups. With two (d96-d256) two chains run faster. H200 ms, kernel alone, 1 / 2 /
    4 chains, two interleaved rounds: 16x16x2048x64 0.563-0.564 / 0.570-0.588 / 0.599-0.612,
    2x16x4096x64 causal 0.169-0.170 / 0.171-0.172 / 0.175; 2x16x4096x128 0.430-0.433 /
    0.406-0.407 / 0.407-0.412, 1x16x8192x128 0.835-0.838 / 0.778-0.802 / 0.789-0.796,
    2x16x4096x128 causal 0.260-0.261 / 0.254-0.258 / 0.254-0.255, 2x16x4096x192 causal
    0.331-0.336 / 0.330-0.333 / 0.336-0.346."""
    return 1 if tiles.consumer_wgs >= 3 else 2


# What a chunk of the causal heavy-first order may keep of K / V in L2 (H100 50 MB, H200 60 MB).
# All (batch, head) pairs in one chunk read every head's K / V at once: 2x16x4096x128 causal
# streamed K / V from DRAM (ncu, H200: DRAM 72% busy against FA4's 14%).
LPT_L2_BYTES = 40 << 20


def lpt_heads_per_chunk(rows_k: int, head_dim: int, head_dim_v: int, group: int, elem_bytes: int, pairs: int) -> int:
    """(batch, query head) pairs a chunk of the heavy-first order: as many as have their K / V
    rows (``rows_k`` keys; ``group`` query heads share a key head) fit LPT_L2_BYTES, rounded
    down to a power of two key heads, at least one key head, at most ``pairs``."""
    per_kv_head = max(1, rows_k * (head_dim + head_dim_v) * elem_bytes)
    fit = max(1, LPT_L2_BYTES // per_kv_head)
    return max(1, min(pairs, (1 << (fit.bit_length() - 1)) * group))
