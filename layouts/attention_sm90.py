"""Tiles of the Hopper-native attention backward (sm_90a: TMA, wgmma, warp specialization).

One CTA owns ``tile_n`` rows of K and V (a key block) and walks the query blocks of
``tile_m`` rows that see it. It is the flash-attention-3 decomposition, in the
transposed form that keeps P and dS in registers for the dK / dV products:

* 3 warpgroups: warpgroup 0 is the producer (warp 0 issues the TMA loads of K, V once
  and of Q, LSE, dO, Δ per query block into ``stages``-deep mbarrier pipelines; warp 1
  adds each block's dQ into the fp32 accumulator with a TMA reduce-add); warpgroups 1
  and 2 are the consumers, each owning 64 of the key block's rows.
* per query block, consumer warpgroup w (keys 64w .. 64w+63):
    S^T  = K_w Q^T            (wgmma SS: A = K  smem, K-major;  B = Q  smem, K-major)
    dP^T = V_w dO^T           (wgmma SS: A = V  smem, K-major;  B = dO smem, K-major)
    P^T  = exp2(S^T * scale * log2 e - LSE * log2 e),  dS^T = P^T (dP^T - Δ)
    dV_w += P^T dO            (wgmma RS: A = P^T registers; B = dO smem, MN-major view)
    dK_w += dS^T Q            (wgmma RS: A = dS^T registers; B = Q smem, MN-major view)
    dS^T -> shared memory (m-contiguous; stmatrix), then dQ = dS K over the whole key block
                              (wgmma SS: A = dS smem, MN-major; B = K smem, MN-major view)
  the two warpgroups split dQ's columns (tile_m = 64) or rows (tile_m = 128).
* Q, dO and K are stored once, row-major and swizzled; the K-major view serves the
  first products and the transposed (MN-major) view the second ones. One swizzle atom
  (8 rows x 16 / 32 / 64 elements: 32-, 64- or 128-byte rows) is legal for both views when
  its width divides every column slice a wgmma takes of the MN-major view: all of d for
  Q / dO (dK, dV: N = d), d / 2 for K when the warpgroups split dQ's columns. So the
  atom is the widest that divides d (Q / dO) or that slice (K / V), see ``atom_cols``
  (d is one head dim here; Dqk != Dv below).

| head dim | tile_m | tile_n | Q / dO stages | dS stages | consumers | smem (bf16) |
|----------|--------|--------|---------------|-----------|-----------|-------------|
| 64       | 128    | 128    | 2             | 2         | 2 x 128   | 227 KiB     |
| 96       | 64     | 128    | 2             | 2         | 2 x 128   | 154 KiB     |
| 128      | 80     | 128    | 2             | 2         | 2 x 128   | 226 KiB     |
| 192      | 64     | 64     | 2             | 2         | 2 x 128   | 226 KiB     |
| 256      | 64     | 64     | 1             | 2         | 2 x 128   | 225 KiB     |

tile_m is 64 with a bias or dropout (d64: 114 KiB, d128: 194 KiB). d128 takes 80 with a
causal mask too (FA4 keeps 64 there; 80 measured 3-5% faster at 4096 / 8192 keys). A
sequence whose length is not a multiple of 80 ends in a partial query block: at d128
(``tail_block``) that block's step runs on products only as wide as its rows rounded up to 16
(``tail_rows``: 4096 = 51 x 80 + 16, so S^T / dP^T / dQ^T are m64n16 there and dV / dK take one
k-block of 16 instead of five), compiled beside the whole blocks' and peeled out of their loop.
d64 holds two K / V buffers (``kv_buffers``, 32 KiB of its 227): its CTAs are persistent (one
per multiprocessor; causal ones take their tiles from a counter) and load the next tile's K / V
while the current tile runs;
the consumers stage a tile's dK / dV in its K / V buffer and go on, and the producer
warpgroup's warps 2 and 3 store them and free the buffer.

Swizzle atoms: 128-byte for every tile of d128 and of d64 (on tile_m 128 the warpgroups split
dQ's rows, not its columns); d64 on tile_m 64 (bias, dropout) gives K / V the 64-byte atom
(32 columns), the warpgroups' dQ slice of K's MN-major view. d96 rows are 192 bytes, which
a 128-byte atom does not divide: Q / dO take the 64-byte atom (32 columns; dK / dV read
all 96 columns of the MN-major view), K / V the 32-byte one (16 columns: each warpgroup's
dQ takes 48 columns of K's MN-major view, and with 32-column atoms warpgroup 1's slice
would start mid-atom, which no wgmma descriptor expresses: the DSL refuses to partition
it), the fp32 dQ staging the 64-byte one (16 columns: each warpgroup's 48-column part is
whole atoms, reduce-added as three 16-column TMA boxes).

All three hand each warpgroup's dQ half to the store warp separately (``dq_per_wg``),
announce each dS half before waiting for the other (``pds_split``; d64 waits a step later,
``dq_defer`` below; d128 at tile_m 80 waits for both at one barrier and issues dQ before dK,
FA4's order), issue each block's
S^T at the top of its step (``overlap="none"``: issued a step ahead, ptxas serialises
every wgmma of the kernel, its warning C7515; d128 gained 16% without it) and store
dS^T with stmatrix (``ds_stmatrix``: four instructions for sixteen 32-bit stores and their
per-step swizzled addresses). FA4's order within a step: LSE read into registers once S^T
is issued and Δ after the exp (``stats_early``), dS^T stored before dV is issued
(``ds_before_dv``), the store warp freeing both dQ buffers before waiting for either
(``dq_empty_early``; not at d128's tile_m 80, where freeing each just before its copy
measured 0.5-4% faster). d64 without a bias or dropout issues each block's dQ a step late,
beside the next block's dV (``dq_defer``): a warpgroup then waits for the other's dS half
of a block written a step earlier, and the two stay a step apart at most instead of
meeting at every block. d64's 64 + 64 fp32 of S^T / dP^T at tile_m 128 left
ptxas short of registers in the older order (every wgmma serialised: C7515 with S^T a step
ahead, C7512 without), so d64 ran tile_m 64 for a while; with dS^T stored before dV and the
statistics read at their use it fits again (0 spills) and is 6-9% faster; a bias or dropout
still spills there and keeps 64. dK / dV leave through K's / V's shared memory (free once
both warpgroups' last wgmmas have read them) (``dkv_tma_store``): 32-bit stores from
registers cost 5% at 8x16x1024x64, where a CTA runs only 8 steps. From there every consumer
thread stores 16-byte row pieces (``dkv_vector_store``, d64 / d128 rows) rather than one
thread's TMA store, which queues behind the last dQ reduce-adds while the CTA waits for it.
Measurements: docs/attention_sm90.md.

CTA order: with a causal mask key block 0 sees the most query blocks, so the grid is 1-D
and walked heavy-first over chunks of (batch, key head) pairs whose Q / dO / dQ rows fit
LPT_L2_BYTES (``lpt``; H100, 2x16x4096x64 causal, kernel only: 0.457 vs 0.502 ms in the
launch order; d128 causal unchanged within noise; chunks of 2 heads 0.492).

Head dims 192 and 256 (``AttentionSm90WideTiles``, kernel ``AttentionBackwardSm90Wide``;
FA3's hdim-256 decomposition): with 64 keys per warpgroup each thread would hold dK and dV
of 64 x d fp32 (192 / 256 registers), over setmaxnreg's 240. So a CTA owns tile_n = 64 keys
and both consumer warpgroups own all of them, splitting the other dimension of each product:

* S^T / dP^T (64 keys x 64 queries): warpgroup w the queries 32w .. 32w+31 (m64n32, SS);
* P^T and dS^T go to shared memory (both are needed whole by both warpgroups): the sdS
  allocation holds 2 x ds_stages (tile_m, tile_n) buffers, P^T in [0, ds_stages), dS^T after;
  queries contiguous, so one layout is dV / dK's K-major A (P^T, dS^T) and dQ's MN-major A (dS);
* dV += P^T dO, dK += dS^T Q (SS): warpgroup w the head-dim columns w d/2 .. (w+1) d/2 - 1,
  2 x d / 4 fp32 registers a thread (96 for d192, 128 for d256);
* dQ = dS K in two column halves, one after the other (each warpgroup a quarter of d of
  each half): a whole dQ half per warpgroup (d / 4 registers) beside dK and dV made ptxas
  run out of registers (d256: 768 bytes of spill and every wgmma serialised, C7512), a
  quarter leaves it at 0 spills and pipelined wgmmas. Both halves are staged in sdQ and the
  store warp adds the whole tile (one joint handoff: ``dq_per_wg`` off, a warpgroup's
  columns are two quarters);
* two P / dS buffers: one barrier a block keeps a warpgroup's writes off the buffers the
  other still reads.

Swizzle atoms follow the same rule: Q / dO slices are d / 2 (dK / dV), K's and the dQ
staging's d / 4 (d192: 96 and 48 columns, so 64-byte Q / dO atoms, 32-byte K / V ones and
64-byte fp32 ones; d256: 128-byte atoms everywhere). Shared memory decides the stages: Q, dO, K and V are 24 (d192) / 32 KiB
(d256) each per stage, P / dS 4 x 8 KiB, dQ staging 48 / 64 KiB. d192 fits two Q / dO
stages (226 of 227 KiB); d256 only one (225 KiB; two would be 257 KiB), so its producer
loads block i+1 only once block i is released (dO after dV, Q after dK): correctness
first, no benchmark case uses these head dims.

Dqk != Dv (``head_dim`` = Dqk: Q, K, dQ, dK; ``head_dim_v`` = Dv: V, dO, dV; equal by
default). S^T reduces over Dqk and dP^T over Dv; dK's accumulator is Dqk wide and dV's Dv
wide, each its own tiled MMA. Both must be one of HEAD_DIMS and the wider picks the tiles
by the rules above (the 64 x 64 tiles above 128, two Q / dO stages where they fit). A
thread holds (Dqk + Dv) / 2 fp32 of dK and dV with the base tiles and (Dqk + Dv) / 4 with
the wide ones, never more than the wider head dim's
equal configuration. Atoms: Q's and K's follow Dqk's slices, dO's Dv's (dV's N); V is read
K-major only and takes the widest atom its Dv columns allow (with equal head dims it keeps
K's layout, as before). Dqk 96 with a Dv above 128 is refused: the wide tiles' dQ quarters
would be 24 columns, which no swizzle atom divides. ptxas: no spill in the consumer
warpgroups for any pair, mask, window, deterministic or varlen configuration; docs/attention_sm90.md has
the producer's few 4-byte spills.

| Dqk / Dv  | tiles | tile_m | tile_n | Q / dO stages | dK + dV fp32 a thread | smem (bf16) |
|-----------|-------|--------|--------|---------------|-----------------------|-------------|
| 64 / 96   | base  | 64     | 128    | 2             | 80                    | 130 KiB     |
| 64 / 128  | base  | 64     | 128    | 2             | 96                    | 146 KiB     |
| 96 / 64   | base  | 64     | 128    | 2             | 80                    | 138 KiB     |
| 96 / 128  | base  | 64     | 128    | 2             | 112                   | 170 KiB     |
| 128 / 64  | base  | 64     | 128    | 2             | 96                    | 162 KiB     |
| 128 / 96  | base  | 64     | 128    | 2             | 112                   | 178 KiB     |
| 64 / 192  | wide  | 64     | 64     | 2             | 64                    | 146 KiB     |
| 64 / 256  | wide  | 64     | 64     | 2             | 80                    | 170 KiB     |
| 128 / 192 | wide  | 64     | 64     | 2             | 80                    | 186 KiB     |
| 128 / 256 | wide  | 64     | 64     | 2             | 96                    | 210 KiB     |
| 192 / 64  | wide  | 64     | 64     | 2             | 64                    | 178 KiB     |
| 192 / 96  | wide  | 64     | 64     | 2             | 72                    | 190 KiB     |
| 192 / 128 | wide  | 64     | 64     | 2             | 80                    | 202 KiB     |
| 192 / 256 | wide  | 64     | 64     | 1             | 112                   | 193 KiB     |
| 256 / 64  | wide  | 64     | 64     | 2             | 80                    | 218 KiB     |
| 256 / 96  | wide  | 64     | 64     | 1             | 88                    | 185 KiB     |
| 256 / 128 | wide  | 64     | 64     | 1             | 96                    | 193 KiB     |
| 256 / 192 | wide  | 64     | 64     | 1             | 112                   | 209 KiB     |

Grouped-query heads: a CTA owns a key block of one key head and walks the query blocks of
every query head of its group (dK / dV summed in registers). Deterministic mode: the
store warp adds a query block's dQ when its turn comes (a semaphore per query block and
query head; see the kernel).

(tests/test_attention_sm90_cpu.py checks the table.) Everything else takes the
sm80-structured memory-efficient kernel (``ops`` dispatch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

SMEM_LIMIT = 227 * 1024  # bytes of shared memory an H100 CTA may use
HEAD_DIMS = (64, 96, 128, 192, 256)  # Dqk = Dv; HEAD_DIM_PAIRS (below) the (Dqk, Dv) pairs with Dqk != Dv
WIDE_FROM = 128  # head dims above this take AttentionSm90WideTiles / AttentionBackwardSm90Wide
NUM_CONSUMER_WG = 2
PRODUCER_REGS = 24  # setmaxnreg for the producer warpgroup
# persistent CTAs, whose warps 2 and 3 also store dK / dV (at 24 they spilled): the three
# warpgroups share the launch's 3 x 168 registers a thread slot (setmaxnreg.inc waits for
# registers the others freed: 32 + 2 x 240 would hang)
PRODUCER_REGS_PERSISTENT = 40
CONSUMER_REGS_PERSISTENT = 232
CONSUMER_REGS = 240  # for each consumer warpgroup (24 + 2 x 240 <= 504 per thread-slot budget)
STORE_WARP_THREADS = 32  # the producer warpgroup's dQ-store warp
DKV_STORE_WARPS = (2, 3)  # persistent CTAs: the producer warpgroup's warps that store dK / dV
TILE_RING_SLOTS = 4  # persistent CTAs: tile indices in flight from the producer warp to the others
# persistent CTAs over equal tiles (no mask): a tile's last dQ computed in the next tile's step 0
# (``carry_dq``) saves ~1 us a tile and costs ~1-2% a step (its bookkeeping), so it pays for
# tiles of a few steps. H100, full backward, CUDA-graph replay (no host time; ms, without / with;
# steps a tile; FA4 same process): 16x16x512x64 (4) 0.1541 / 0.1430 (FA4 0.1502), 8x16x1024x64
# (8) 0.2202 / 0.2174 (0.2199), 4x16x2048x64 (16) 0.375 / 0.383. The slow outliers once blamed on
# it are the host's: event-timed rounds (the suite's do_bench) scatter for both kernels alike
# when the host's CPU is slow, graph replays do not (docs/attention_sm90.md)
CARRY_DQ_MAX_STEPS = 8
# convert_dq overlapping a CTA-per-tile grid's last wave (ops.attention_sm90._overlaps_convert):
# only where a head has at most this many key blocks. Each CTA's count waits until its last dQ
# adds have landed, behind those of the head's other key blocks into the same rows (H100,
# 1x16x8192x128, 64 key blocks a head: the kernel 1-3% longer, as much as the overlap saves)
DQ_READY_MAX_KEY_BLOCKS = 32
# persistent CTAs over equal tiles zero the dQ accumulator themselves, a round of tiles ahead
# (the kernel's zero_ahead), instead of the preprocess: it saves the preprocess's zeroing (a
# fixed ~10 us at 32 MB) and costs a little per step, so the op takes it for tiles of at most
# this many steps. H100, full backward, same process (ms, preprocess zeroes / kernel zeroes, two
# runs; do_bench and CUDA-graph medians): 16x16x512x64 (4 steps) 0.1482 / 0.1420, 8x16x1024x64 (8)
# 0.2202 / 0.2165, 4x16x2048x64 (16) 0.3851 / 0.3699, 2x16x4096x64 (32) 0.7075 / 0.6980 but graph
# 0.7010 / 0.7026, 1x16x8192x64 (64) 1.3490 / 1.3665 (docs/attention_sm90.md)
ZERO_AHEAD_MAX_STEPS = 16
TAIL_ROWS_ALIGN = 16  # a partial last block's products (tail_block): N of S^T / dQ^T and dK / dV's k-blocks
SMEM_ALIGN = 1024  # bytes: every shared buffer starts on a whole 128-byte-swizzle period (8 x 128 B)
SWIZZLE_ROW_BITS = (1024, 512, 256)  # the wgmma / TMA swizzle atoms' rows (128, 64, 32 bytes), widest first
LPT_L2_BYTES = 24 << 20  # of the H100's 50 MiB L2: what a chunk of the heavy-first CTA order may keep in it
TMA_ALIGN_BYTES = 16  # TMA: global strides (but the last) and addresses, in bytes
# the host's one scratch allocation per call (Δ, the LSE, the zeroed int32s, the dQ accumulator):
# each part starts on a whole L2 line, as a fresh allocation would (a multiple of TMA_ALIGN_BYTES)
SCRATCH_ALIGN_BYTES = 128
STATS_ALIGN = 128  # bytes: the LSE / Δ stages (TMA destinations)
# registers -> memory vector widths (bits): a thread's accumulator holds column pairs
DS_STORE_BITS = 32  # dS^T pair of 16-bit values, adjacent in the query-contiguous sdS
DQ_STORE_BITS = 64  # dQ fp32 pair into the swizzled staging buffer
DKV_STORE_BITS = 32  # dK / dV pair of 16-bit values into global memory
DKV_VECTOR_BITS = 128  # dkv_vector_store: a consumer thread's copy of staged dK / dV rows to global memory
KEEP_FLAG_BUFFERS = 2  # dropout keep-flag buffers: a warpgroup draws block i+1's while it may still read block i's
GRAD_BIAS_BOX_KEYS = 64  # keys of one bias-gradient TMA store: one 128-byte swizzle atom row (16-bit types)


def tma_align_elems(elem_bits: int) -> int:
    """Elements per TMA_ALIGN_BYTES (the divisibility of strides the sm90 path needs)."""
    return TMA_ALIGN_BYTES * 8 // elem_bits


def atom_cols(cols: int, elem_bits: int) -> int:
    """Columns of the widest swizzle atom whose row divides ``cols`` elements (the rule of
    ``hopper_helpers.get_smem_layout_atom``, which the DSL side calls; the catalogue test
    checks the two agree)."""
    for row_bits in SWIZZLE_ROW_BITS:
        if cols * elem_bits % row_bits == 0:
            return row_bits // elem_bits
    raise ValueError(f"{cols} columns of {elem_bits}-bit elements fit no swizzle atom")


@dataclass(frozen=True)
class AttentionSm90Tiles:
    head_dim: int  # Dqk: Q, K, dQ, dK (and the S^T product's reduction)
    tile_m: int
    tile_n: int
    head_dim_v: Optional[int] = None  # Dv: V, dO, dV (dP^T's reduction); None: Dqk
    stages: int = 2  # Q / LSE and dO / Δ pipelines
    ds_stages: int = 2  # dS buffers: a warpgroup may write block i+1's dS while the other still reads block i's
    # what of block i+1 goes to the tensor cores before block i's dK is waited for:
    # "none", "s" (S^T) or "sdp" (S^T and dP^T; more live registers). "s" / "sdp" make ptxas
    # serialise the kernel's wgmmas (see the kernel); d64 is still faster with "s"
    overlap: str = "s"
    pds_split: bool = False  # one-way dS barriers per warpgroup, dK issued before waiting for the other half
    dq_per_wg: bool = False  # each warpgroup hands its part of dQ to the store warp alone (no joint barrier)
    dq_stages: int = 1  # dQ staging buffers (2 measured no faster: the reduce-add is read long before the next block)
    # dQ^T = K^T dS^T (warpgroups split the head dim on wgmma's M): lets tile_m be 80 (FA3's
    # non-causal d128 tile; dQ's own M would have to be a multiple of 64)
    dq_swapab: bool = False
    dq_wait_dkv: bool = False  # dV / dK complete before dQ is issued (their A operands' registers free)
    # dQ of block i issued in step i + 1, beside its dV (replaces pds_split and the joint
    # barrier): a warpgroup waits for the other's half of a block's dS a step after it was
    # written, so the two meet once a step with a step of slack (one one-way barrier a step
    # each way, ids alternating by step: an announcement can run one step ahead of its wait)
    dq_defer: bool = False
    # each query block's first dQ stored instead of added, so the accumulator needs no zeroing
    # (the kernel's store_first; the op takes it where every query block is seen)
    store_first: bool = False
    lpt: bool = True  # causal masks: heavy key blocks first over a chunk of heads (the kernel's cta_coords)
    # dS in shared memory with keys contiguous (rows as the bias gradient's: TMA stores it from
    # there) instead of queries (whose register pairs store as 32 bits); with the bias gradient
    ds_keys_contiguous: bool = False
    # dS^T into shared memory by stmatrix (4 x 8x8 matrices a warp instruction; transposed
    # when keys are contiguous) instead of one 32-bit (16-bit) store per value pair (value)
    ds_stmatrix: bool = True
    # FA4's step order, each its own switch for A/B: LSE read into registers once S^T is
    # issued and Δ after the exp (not from shared memory at their use) ...
    stats_early: bool = False
    # ... dS^T stored before dV is issued (the fence after it: the stores have landed by then) ...
    ds_before_dv: bool = False
    # ... and the store warp frees both warpgroups' dQ buffers before waiting for either
    dq_empty_early: bool = False
    # dK / dV through K's / V's shared memory (stmatrix) and a TMA store, instead of 32-bit
    # stores from registers straight to global memory
    dkv_tma_store: bool = False
    # with dkv_tma_store: the staged dK / dV leave by 128-bit stores of every consumer thread
    # instead of one thread's TMA stores, which queue behind the dQ-store warp's last reduce-adds
    # (the CTA then waits for them to read shared memory before it can leave)
    dkv_vector_store: bool = False
    # K / V buffers. 2: persistent CTAs (a CTA per multiprocessor walks the tiles) load the
    # next tile's K / V while the current tile runs, so no CTA waits for its K / V at its start
    # (measured ~2 us of a 24 us CTA at 8x16x1024x64); the kernel takes that path without a
    # window, varlen, determinism, bias or dropout (AttentionBackwardSm90.tile_schedule) and
    # otherwise uses the first buffer alone. d128 has room for one only: persistent CTAs over
    # it measured 3-7% slower than a CTA per tile (docs/attention_sm90.md)
    kv_buffers: int = 1
    # a query block cut short by the sequence's end (Sq not a multiple of tile_m) runs on
    # products only ``tail_rows`` queries wide instead of tile_m with the rest masked: the kernel
    # compiles the narrower tiled MMAs beside the full ones (AttentionBackwardSm90's ``tail_m``)
    tail_block: bool = False

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def dkv_by_tma(self) -> bool:
        """dK / dV leave by TMA stores (staged, and not by the vector stores): the kernel then
        needs their TMA atoms."""
        return self.dkv_tma_store and not self.dkv_vector_store

    def carries_dq(self, steps_per_tile: int) -> bool:
        """Whether persistent CTAs over equal tiles of ``steps_per_tile`` steps (query blocks x
        query heads of a key head) compute a tile's last dQ in the next tile's step 0."""
        return self.kv_buffers == 2 and self.dq_defer and 0 < steps_per_tile <= CARRY_DQ_MAX_STEPS

    @property
    def tile_ring(self) -> int:
        """Persistent CTAs (kv_buffers 2): slots of the shared ring through which the producer
        warp hands the tile indices it takes from the tile counter to the other warps."""
        return TILE_RING_SLOTS if self.kv_buffers == 2 else 0

    @property
    def kv_barriers(self) -> int:
        """mbarriers of K / V: one (loaded once) or a full / empty pair per buffer."""
        return 1 if self.kv_buffers == 1 else 2 * self.kv_buffers

    @property
    def stats_stage_stride(self) -> int:
        """Floats between the LSE / Δ stages: TMA destinations are 128-byte aligned (tile_m 80)."""
        return -(-self.tile_m // 32) * 32

    def lpt_heads_per_chunk(
        self,
        seqlen_q: int,
        group: int,
        elem_bytes: int = 2,
        *,
        seqlen_k: Optional[int] = None,
        pairs: int = 0,
        mask_type: int = 1,
        window: int = 0,
        num_sms: int = 0,
    ) -> int:
        """(batch, key head) pairs per chunk of the heavy-first order. At most as many as have
        their Q, dO (elem_bytes) and fp32 dQ accumulator rows fit LPT_L2_BYTES; given the
        problem (``seqlen_k``, the ``pairs`` of the grid, the mask, ``num_sms``), the size of
        those whose modelled makespan is shortest (``layouts/lpt_order.py``: a last, partial
        chunk can start its heavy key blocks late; 2x16x4096 causal d128 modelled 15% over
        the ideal with the 6 heads that fit, within 1% with 4)."""
        per_head = max(1, group * seqlen_q * (self.head_dim * (elem_bytes + 4) + self.head_dim_v * elem_bytes))
        fit = max(1, LPT_L2_BYTES // per_head)
        if seqlen_k is None or pairs <= 0 or num_sms <= 0:
            return fit
        from .lpt_order import best_heads_per_chunk

        steps = tuple(self.key_block_steps(seqlen_q, seqlen_k, group, mask_type, window))
        return best_heads_per_chunk(steps, pairs, fit, num_sms)

    def key_block_steps(self, seqlen_q: int, seqlen_k: int, group: int, mask_type: int, window: int = 0) -> list:
        """Steps (query blocks x query heads of the group) of each key block: the kernel's
        ``m_block_range`` on the host (mask 1 causal from the top-left, 2 from the
        bottom-right; ``window`` > 0 with either)."""
        m_blocks = -(-seqlen_q // self.tile_m)
        offset = seqlen_k - seqlen_q if mask_type == 2 else 0
        steps = []
        for n in range(-(-seqlen_k // self.tile_n)):
            m_min, m_max = 0, m_blocks
            if mask_type != 0:
                first_q = n * self.tile_n - offset
                if first_q > 0:
                    m_min = first_q // self.tile_m
                if window > 0:
                    last_q = n * self.tile_n + self.tile_n - 1 - offset + window - 1
                    m_max = min(m_max, last_q // self.tile_m + 1 if last_q >= 0 else 0)
            steps.append(group * max(0, m_max - m_min))
        return steps

    @property
    def num_threads(self) -> int:
        return 128 * (NUM_CONSUMER_WG + 1)

    @property
    def num_mma_threads(self) -> int:
        return 128 * NUM_CONSUMER_WG

    @property
    def dq_atoms(self) -> tuple:
        """(M, N) warpgroups of the dQ product: split rows when there are 128, else columns."""
        return (2, 1) if self.tile_m == 128 else (1, 2)

    def tail_rows(self, rows_q: int) -> int:
        """With ``tail_block``: the queries a partial last block's products cover, its rows
        rounded up to the wgmma's 16 (S^T / dP^T / dQ^T take them as N, dK / dV as K); 0 where
        every block is whole, or the rounding would leave nothing to save."""
        rest = rows_q % self.tile_m
        if not self.tail_block or rest == 0:
            return 0
        rows = -(-rest // TAIL_ROWS_ALIGN) * TAIL_ROWS_ALIGN
        return rows if rows < self.tile_m else 0

    @property
    def dkv_store_threads(self) -> int:
        """Persistent CTAs: the producer warpgroup's threads that store staged dK / dV."""
        return 32 * len(DKV_STORE_WARPS)

    @property
    def dkv_handoff_threads(self) -> int:
        """Persistent CTAs: threads meeting at a barrier between the consumers and the dK / dV
        store warps (a tile's dK / dV staged; carry_dq's dS buffer and K buffer freed)."""
        return self.num_mma_threads + self.dkv_store_threads

    @property
    def dq_handoff_threads(self) -> int:
        """Threads meeting at a dQ staging barrier: the store warp and one warpgroup
        (dq_per_wg) or both."""
        return STORE_WARP_THREADS + (128 if self.dq_per_wg else self.num_mma_threads)

    @property
    def ds_buffers(self) -> int:
        """(tile_m, tile_n) buffers of the sdS allocation: dS's stages."""
        return self.ds_stages

    @property
    def sdp_wg_tile(self) -> tuple:
        """(keys, queries) of S^T / dP^T one consumer warpgroup holds: 64 keys, every query."""
        return (self.tile_n // NUM_CONSUMER_WG, self.tile_m)

    def sdp_wg_origin(self, wg):
        """(key, query) where warpgroup ``wg``'s part of S^T starts in the block."""
        return (wg * (self.tile_n // NUM_CONSUMER_WG), 0)

    @property
    def keep_flag_keys(self) -> int:
        """Dropout: consecutive keys of one query row each consumer thread draws (a warpgroup
        draws its own part of S^T: curand's stream is key-contiguous, one Philox call per 4 keys)."""
        keys, queries = self.sdp_wg_tile
        return keys * queries // 128

    @property
    def keep_flag_bytes(self) -> int:
        """One buffer of dropout keep flags: a bit per (query, key) of the block, rows of queries."""
        return self.tile_m * self.tile_n // 8

    def smem_bytes(self, elem_bytes: int = 2, dropout: bool = False) -> int:
        """Bytes of the kernel's SharedStorage, member by member with its alignments, the
        whole rounded up to SMEM_ALIGN as the DSL sizes it (``dropout``: with the keep-flag
        buffers; d64 with dq_stages 2 came to 233472 bytes on the H100, over the limit, while
        it had a one-byte placeholder for them)."""
        d, dv = self.head_dim, self.head_dim_v

        def place(offset, size, align):
            return -(-offset // align) * align + size

        # mbarriers: Q and dO pipelines (full + empty), K/V, the tile ring's (full + empty); its slots
        off = 8 * (4 * self.stages + self.kv_barriers + 2 * self.tile_ring) + 4 * self.tile_ring
        stats = 4 * ((self.stages - 1) * self.stats_stage_stride + self.tile_m)
        off = place(off, stats, STATS_ALIGN)  # LSE
        off = place(off, stats, STATS_ALIGN)  # Δ
        q_rows = self.stages * self.tile_m
        kv_rows = self.kv_buffers * self.tile_n
        for rows, cols in ((q_rows, d), (q_rows, dv), (kv_rows, d), (kv_rows, dv)):
            off = place(off, rows * cols * elem_bytes, SMEM_ALIGN)  # Q, dO, K, V
        off = place(off, self.ds_buffers * self.tile_m * self.tile_n * elem_bytes, SMEM_ALIGN)  # dS (and P)
        off = place(off, self.dq_stages * self.tile_m * d * 4, SMEM_ALIGN)  # dQ staging
        if dropout:
            off = place(off, KEEP_FLAG_BUFFERS * self.keep_flag_bytes, STATS_ALIGN)
        # the struct's size is a multiple of its alignment (the DSL's launch checks that size)
        return -(-off // SMEM_ALIGN) * SMEM_ALIGN

    # ---- DSL objects (called while tracing) -------------------------------------------
    def tiled_mma_sdp(self, dtype):
        """S^T = K Q^T and dP^T = V dO^T: M = keys (64 per warpgroup), N = queries, K = head dim."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(NUM_CONSUMER_WG, 1, 1),
            tiler_mn=(64, self.tile_m),
        )

    def tiled_mma_dkv(self, dtype, cols: Optional[int] = None):
        """dV += P^T dO and dK += dS^T Q: A from registers, B the MN-major view of dO / Q.
        ``cols``: the product's head dim, dK's (head_dim, the default) or dV's (head_dim_v)."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            OperandMajorMode.K,
            OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(NUM_CONSUMER_WG, 1, 1),
            tiler_mn=(64, cols or self.head_dim),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def ds_major(self, as_a_of_dq: bool):
        """Major mode of the dS tile as a wgmma operand: dQ's A (queries x keys) or, transposed,
        the A of dK / dV (keys x queries, the wide kernel). K-major = contiguous along the
        product's reduction."""
        from cutlass.cute.nvgpu import OperandMajorMode

        k_major = self.ds_keys_contiguous == as_a_of_dq
        return OperandMajorMode.K if k_major else OperandMajorMode.MN

    def tiled_mma_dq(self, dtype):
        """dQ = dS K: A = dS (queries contiguous: MN-major; keys: K-major), B = K's MN-major view."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        am, an = self.dq_atoms
        if self.dq_swapab:  # A = K^T (head dim contiguous: MN-major), B = dS^T (keys contiguous: K-major)
            b_major = OperandMajorMode.K if self.ds_keys_contiguous else OperandMajorMode.MN
            return hh.make_trivial_tiled_mma(
                dtype,
                dtype,
                OperandMajorMode.MN,
                b_major,
                Float32,
                atom_layout_mnk=(an, am, 1),
                tiler_mn=(64, self.tile_m),
            )
        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            self.ds_major(True),
            OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(am, an, 1),
            tiler_mn=(64, self.head_dim // an),
        )

    def r2s_copy_ds(self, dtype, tiled_mma_sdp):
        """dS^T (the S^T / dP^T accumulator, cast) into sdS: query pairs as 32 bits, or single
        values where keys are contiguous."""
        import cutlass.cute as cute

        if self.ds_stmatrix:
            op = cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=self.ds_keys_contiguous, num_matrices=4)
            return cute.make_tiled_copy_C(cute.make_copy_atom(op, dtype), tiled_mma_sdp)
        bits = dtype.width if self.ds_keys_contiguous else DS_STORE_BITS
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
        return cute.make_tiled_copy_C(atom, tiled_mma_sdp)

    def r2s_copy_dq(self, tiled_mma_dq):
        """The dQ accumulator (fp32) into its staging buffer."""
        import cutlass.cute as cute
        from cutlass import Float32

        # dQ^T's value pairs run along queries, rows apart in the staging buffer: one value a store
        bits = 32 if self.dq_swapab else DQ_STORE_BITS
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=bits)
        return cute.make_tiled_copy_C(atom, tiled_mma_dq)

    def r2s_copy_dkv(self, dtype, tiled_mma_dkv):
        """dK / dV accumulators (cast) into K's / V's shared memory for the TMA store (stmatrix:
        rows of 8 values, as K-major swizzles keep them)."""
        import cutlass.cute as cute

        op = cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4)
        return cute.make_tiled_copy_C(cute.make_copy_atom(op, dtype), tiled_mma_dkv)

    def s2g_copy_dkv(self, dtype, cols: int, threads: Optional[int] = None):
        """Staged dK / dV rows (``cols`` wide) from shared to global memory by every consumer
        thread (or ``threads`` threads), 16 bytes a copy, a row's copies on consecutive threads
        (``dkv_vector_store``)."""
        import cutlass.cute as cute

        vec = DKV_VECTOR_BITS // dtype.width
        per_row = cols // vec
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=DKV_VECTOR_BITS)
        thr = cute.make_layout(((threads or self.num_mma_threads) // per_row, per_row), stride=(per_row, 1))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, vec)))

    def dq_accum_zero_copy(self):
        """zero_ahead: one warp's 16-byte stores of fp32 zeros into a query block's accumulator
        rows (``s2g_copy_dkv``'s row pieces, head_dim fp32 wide, a warp's lanes)."""
        from cutlass import Float32

        return self.s2g_copy_dkv(Float32, self.head_dim, STORE_WARP_THREADS)

    def r2g_copy_dkv(self, dtype, tiled_mma_dkv):
        """dK / dV accumulators (cast) straight to global memory (once per CTA)."""
        import cutlass.cute as cute

        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=DKV_STORE_BITS)
        return cute.make_tiled_copy_C(atom, tiled_mma_dkv)

    @property
    def q_slice_cols(self) -> int:
        """Columns of the narrowest slice a wgmma takes of Q's MN-major view (dK: one
        warpgroup's N is all of Dqk)."""
        return self.head_dim

    @property
    def do_slice_cols(self) -> int:
        """The same for dO (dV: all of Dv)."""
        return self.head_dim_v

    @property
    def k_slice_cols(self) -> int:
        """The same for K (B operand of dQ): one warpgroup's dQ columns."""
        return self.dq_sub_tile[1]

    @property
    def v_slice_cols(self) -> int:
        """V is only read K-major (dP^T's A), which any atom dividing its rows serves. With
        equal head dims it takes K's layout (one layout and TMA box for both, as before
        Dqk != Dv), else the widest atom for its Dv columns."""
        return self.k_slice_cols if self.head_dim_v == self.head_dim else self.head_dim_v

    def smem_layout_rows(self, dtype, rows: int, stages, slice_cols: int, cols: Optional[int] = None):
        """(rows, cols[, stages]) row-major (cols: head_dim by default), swizzle atoms as wide
        as ``slice_cols`` allows: a wgmma's MN-major slice must start on a whole atom."""
        import cutlass.cute as cute
        from cutlass.cute.nvgpu import warpgroup
        from cutlass.tensor_utils import LayoutEnum
        from cutlass.utils import hopper_helpers as hh

        cols = cols or self.head_dim
        atom = warpgroup.make_smem_layout_atom(hh.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, slice_cols), dtype)
        shape = (rows, cols) if stages is None else (rows, cols, stages)
        return cute.tile_to_shape(atom, shape, order=(0, 1) if stages is None else (0, 1, 2))

    def smem_layout_q(self, dtype):
        """Q ring: (tile_m, head_dim, stages)."""
        return self.smem_layout_rows(dtype, self.tile_m, self.stages, self.q_slice_cols)

    def smem_layout_do(self, dtype):
        """dO ring: (tile_m, head_dim_v, stages)."""
        return self.smem_layout_rows(dtype, self.tile_m, self.stages, self.do_slice_cols, self.head_dim_v)

    def smem_layout_k(self, dtype):
        """K: (tile_n, head_dim[, kv_buffers])."""
        buffers = self.kv_buffers if self.kv_buffers > 1 else None
        return self.smem_layout_rows(dtype, self.tile_n, buffers, self.k_slice_cols)

    def smem_layout_v(self, dtype):
        """V: (tile_n, head_dim_v[, kv_buffers]) (``v_slice_cols``)."""
        buffers = self.kv_buffers if self.kv_buffers > 1 else None
        return self.smem_layout_rows(dtype, self.tile_n, buffers, self.v_slice_cols, self.head_dim_v)

    def smem_layout_ds(self, dtype):
        """(tile_m, tile_n, ds_buffers), queries contiguous: dS^T's register pairs are adjacent.
        With ``ds_keys_contiguous`` rows of keys in 128-byte atoms, key-atom columns outer: each
        GRAD_BIAS_BOX_KEYS columns of a buffer are one TMA box of the bias gradient."""
        import cutlass.cute as cute
        from cutlass.cute.nvgpu import warpgroup
        from cutlass.tensor_utils import LayoutEnum
        from cutlass.utils import hopper_helpers as hh

        if self.ds_keys_contiguous:
            return cute.tile_to_shape(
                self.ds_keys_atom(dtype), (self.tile_m, self.tile_n, self.ds_buffers), order=(0, 1, 2)
            )
        atom = warpgroup.make_smem_layout_atom(hh.get_smem_layout_atom(LayoutEnum.COL_MAJOR, dtype, self.tile_m), dtype)
        return cute.tile_to_shape(atom, (self.tile_m, self.tile_n, self.ds_buffers), order=(1, 0, 2))

    def ds_keys_atom(self, dtype):
        """The keys-contiguous dS tile's swizzle atom: 8 rows of GRAD_BIAS_BOX_KEYS keys (128 bytes)."""
        from cutlass.cute.nvgpu import warpgroup
        from cutlass.tensor_utils import LayoutEnum
        from cutlass.utils import hopper_helpers as hh

        return warpgroup.make_smem_layout_atom(
            hh.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, GRAD_BIAS_BOX_KEYS), dtype
        )

    def smem_layout_grad_bias_box(self, dtype):
        """One TMA box of the bias gradient: GRAD_BIAS_BOX_KEYS columns of a keys-contiguous dS buffer."""
        import cutlass.cute as cute

        return cute.tile_to_shape(self.ds_keys_atom(dtype), (self.tile_m, GRAD_BIAS_BOX_KEYS), order=(0, 1))

    @property
    def dq_slice_cols(self) -> int:
        """Columns of one warpgroup's dQ: the register -> shared copy of its accumulator cuts
        the staging buffer into slices this wide, and dq_per_wg's reduce-add box is one."""
        return self.dq_sub_tile[1]

    def dq_atom(self):
        """fp32 swizzle atom of the dQ staging buffer: 128-byte (32 columns) where the
        warpgroup slices allow, else 64-byte (16 columns; d96's 48-column slices: with
        32-column atoms the DSL partitions neither the copy nor the box). Both put
        a warp's 64-bit accumulator pairs (8 rows x 4 pairs) in 2 wavefronts, the least
        for 256 bytes (row-major 512-byte rows were 8-way conflicts); TMA unswizzles it."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import warpgroup
        from cutlass.tensor_utils import LayoutEnum
        from cutlass.utils import hopper_helpers as hh

        return warpgroup.make_smem_layout_atom(
            hh.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, Float32, self.dq_slice_cols), Float32
        )

    def smem_layout_dq(self):
        """(tile_m, head_dim, dq_stages) fp32, swizzled (``dq_atom``)."""
        import cutlass.cute as cute

        return cute.tile_to_shape(
            self.dq_atom(), (self.tile_m, self.head_dim, self.dq_stages), order=self.dq_order + (2,)
        )

    @property
    def dq_order(self) -> tuple:
        """Tiling order of the dQ staging atoms: rows first, so a column part (dq_per_wg's
        when the warpgroups split columns) is one run and a TMA box covers one atom's columns;
        columns first when each warpgroup hands over its own rows (dq_per_wg, tile_m 128)."""
        return (1, 0) if self.dq_per_wg and self.dq_atoms == (2, 1) else (0, 1)

    @property
    def dq_sub_tile(self) -> tuple:
        """(rows, cols) of dQ one warpgroup computes."""
        am, an = self.dq_atoms
        return (self.tile_m // am, self.head_dim // an)

    def smem_layout_dq_sub(self):
        """One warpgroup's part of the dQ staging buffer (the TMA box of dq_per_wg)."""
        import cutlass.cute as cute

        return cute.tile_to_shape(self.dq_atom(), self.dq_sub_tile, order=self.dq_order)


@dataclass(frozen=True)
class AttentionSm90WideTiles(AttentionSm90Tiles):
    """d192 / d256, or a Dqk / Dv pair with one of them (``AttentionBackwardSm90Wide``): 64 keys
    x 64 queries, both warpgroups own all 64 keys and split the other dimension of every
    product (module docstring)."""

    @property
    def ds_buffers(self) -> int:
        """P^T and dS^T both go through shared memory: P in buffers [0, ds_stages), dS after."""
        return 2 * self.ds_stages

    @property
    def sdp_wg_tile(self) -> tuple:
        """All 64 keys, half of the queries."""
        return (self.tile_n, self.tile_m // NUM_CONSUMER_WG)

    def sdp_wg_origin(self, wg):
        return (0, wg * (self.tile_m // NUM_CONSUMER_WG))

    def tiled_mma_sdp(self, dtype):
        """S^T = K Q^T, dP^T = V dO^T: all 64 keys, each warpgroup half of the queries (m64n32)."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(1, NUM_CONSUMER_WG, 1),
            tiler_mn=(64, self.tile_m // NUM_CONSUMER_WG),
        )

    def tiled_mma_dkv(self, dtype, cols: Optional[int] = None):
        """dV += P^T dO, dK += dS^T Q: A = P^T / dS^T from shared memory (K-major: queries
        contiguous), B the MN-major view of dO / Q; each warpgroup half of the head dim
        (``cols``: dK's head_dim by default, dV's head_dim_v)."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            self.ds_major(False),
            OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(1, NUM_CONSUMER_WG, 1),
            tiler_mn=(64, (cols or self.head_dim) // NUM_CONSUMER_WG),
        )

    def tiled_mma_dq(self, dtype):
        """dQ = dS K in two column halves, one after the other (their accumulators would not
        fit beside dK and dV): each warpgroup a quarter of d of each half."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            self.ds_major(True),
            OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(1, NUM_CONSUMER_WG, 1),
            tiler_mn=(64, self.dq_slice_cols),
        )

    @property
    def q_slice_cols(self) -> int:
        """dK / dV: one warpgroup's N is half of Dqk / Dv."""
        return self.head_dim // NUM_CONSUMER_WG

    @property
    def do_slice_cols(self) -> int:
        """dV: one warpgroup's N is half of Dv."""
        return self.head_dim_v // NUM_CONSUMER_WG

    @property
    def dq_slice_cols(self) -> int:
        """One warpgroup's part of a dQ half: a quarter of Dqk (also K's MN-major slice)."""
        return self.head_dim // (2 * NUM_CONSUMER_WG)

    @property
    def k_slice_cols(self) -> int:
        return self.dq_slice_cols


def head_dims_unsupported(head_dim: int, head_dim_v: int) -> Optional[str]:
    """Why the tiles cannot take Dqk = ``head_dim`` with Dv = ``head_dim_v`` (None: they can).
    Both must be one of HEAD_DIMS; the larger one picks the decomposition. Base tiles (both
    up to 128): a thread holds Dqk / 2 + Dv / 2 fp32 of dK and dV, at most d128's 128. Wide
    tiles: (Dqk + Dv) / 4, at most d256's 128; their dQ quarters (Dqk / 4 columns) need a
    swizzle atom, which Dqk 96 (24 columns) has not (module docstring)."""
    if head_dim not in HEAD_DIMS or head_dim_v not in HEAD_DIMS:
        return f"the sm90 attention backward supports head dims {HEAD_DIMS}, got {head_dim} / {head_dim_v}"
    if max(head_dim, head_dim_v) > WIDE_FROM and head_dim == 96:
        return (
            f"Dqk 96 with Dv {head_dim_v}: the 64 x 64-tile kernel splits dQ into 24-column quarters, "
            "which no swizzle atom divides"
        )
    return None


# every (Dqk, Dv) with Dqk != Dv the tiles take (the module's second table)
HEAD_DIM_PAIRS = tuple((a, b) for a in HEAD_DIMS for b in HEAD_DIMS if a != b and head_dims_unsupported(a, b) is None)


def _rows_split_evenly(cols: int, elem_bits: int = 16) -> bool:
    """``dkv_vector_store``: the consumer threads (``AttentionSm90Tiles.num_mma_threads``) cover
    whole rows of ``cols`` values with ``s2g_copy_dkv``'s copies, and the tile's keys (tile_n)
    whole passes of rows (d64, d128; not d96's 12 copies a row). 16-bit values: the path's
    fp16 / bf16."""
    threads, keys = 128 * NUM_CONSUMER_WG, 64 * NUM_CONSUMER_WG  # the narrow tiles' (checked below)
    if cols * elem_bits % DKV_VECTOR_BITS:
        return False
    per_row = cols * elem_bits // DKV_VECTOR_BITS
    return threads % per_row == 0 and keys % (threads // per_row) == 0


@functools.lru_cache(maxsize=None)  # also read on the call path (deterministic mode's semaphore shape)
def attention_sm90_tiles(
    head_dim: int, *, head_dim_v: Optional[int] = None, bias_or_dropout: bool = False, **overrides
) -> AttentionSm90Tiles:
    """The tiles for Dqk = ``head_dim`` and Dv = ``head_dim_v`` (default: Dqk; see the
    module table); ``bias_or_dropout``: the kernel adds a bias or drops out (their per-value
    work needs the registers d64's 128-query step takes); ``overrides`` for sweeps. Head dims
    above 128 (either) get ``AttentionSm90WideTiles``."""
    dv = head_dim if head_dim_v is None else head_dim_v
    reason = head_dims_unsupported(head_dim, dv)
    if reason is not None:
        raise NotImplementedError(reason)
    if max(head_dim, dv) > WIDE_FROM:
        # two Q / dO stages where they fit, else one (d256: two would need 64 KiB more; module docstring)
        fields = dict(head_dim=head_dim, head_dim_v=dv, tile_m=64, tile_n=64, stages=2, overlap="none")
        if AttentionSm90WideTiles(**fields).smem_bytes(dropout=True) > SMEM_LIMIT:  # with dropout's flags
            fields["stages"] = 1
        fields.update(overrides)
        t = AttentionSm90WideTiles(**fields)
        if t.tile_m != 64 or t.tile_n != 64:
            raise ValueError(f"head dims above {WIDE_FROM} need tile_m 64 and tile_n 64, got {t.tile_m}, {t.tile_n}")
        if t.dq_defer:
            raise ValueError(f"head dims above {WIDE_FROM} issue dQ in its own step (dq_defer False)")
        if t.dkv_tma_store:
            # its dK / dV accumulators split the head dim between the warpgroups (stored from registers)
            raise ValueError(f"head dims above {WIDE_FROM} store dK / dV from registers (dkv_tma_store False)")
        if t.dq_per_wg:
            # a warpgroup's dQ columns are two quarters of d: the store warp adds the whole tile
            raise ValueError(f"head dims above {WIDE_FROM} stage dQ jointly (dq_per_wg False)")
        if t.ds_stages != 2:
            # one barrier per block keeps a warpgroup's P / dS writes off the buffers the other still reads
            raise ValueError(f"head dims above {WIDE_FROM} need ds_stages 2, got {t.ds_stages}")
    else:
        # each warpgroup hands its dQ part over alone, and announces its dS half before waiting
        # for the other's (H100, 2x16x4096x128: 1.412 vs 1.451 ms); S^T at the top of each step
        # keeps ptxas from serialising the wgmmas (1.240 vs 1.484 ms). FA4's step order
        # (stats_early, ds_before_dv, dq_empty_early above d64): 2x16x4096x128 1.323 / 1.309 vs
        # 1.348 / 1.366 ms, causal 0.783 / 0.806 vs 0.819 / 0.825; only without a bias or dropout:
        # with them it cost 5-17% (2x16x4096x128 bias 2.170 vs 1.849 ms, dropout 2.197 vs 2.090)
        # dK / dV leave through shared memory and a TMA store (8x16x1024x64 0.246 vs 0.260 ms,
        # causal 2x16x4096x64 0.409 vs 0.425)
        # ... and leave it by every consumer thread's 16-byte stores where the rows split evenly
        # between the threads (H100, same runs, TMA store vs these: 8x16x1024x64 0.2442 vs 0.2419
        # ms, 16x16x512x64 0.170 vs 0.168, 4x16x2048x128 0.682 vs 0.679, causal d64 even)
        fa4_order = not bias_or_dropout
        fields = dict(
            head_dim=head_dim,
            head_dim_v=dv,
            tile_m=64,
            tile_n=128,
            dq_per_wg=True,
            pds_split=True,
            overlap="none",
            stats_early=fa4_order,
            ds_before_dv=fa4_order,
            dq_empty_early=fa4_order and max(head_dim, dv) > 64,
            dkv_tma_store=True,
            dkv_vector_store=all(_rows_split_evenly(c) for c in (head_dim, dv)),
        )
        if head_dim == dv == 128 and not bias_or_dropout:
            # 80 queries a step with dQ^T = K^T dS^T (FA3 / FA4's non-causal d128 tile), the
            # statistics read at their use, one dS barrier for both warpgroups then dQ before dK
            # (FA4's order: dQ staged while dK runs): fits 240 registers without spilling.
            # H100, same runs: 2x16x4096x128 1.311 vs 1.338 ms at tile_m 64, 4x16x2048x128 0.741
            # vs 0.758, 1x16x8192x128 2.480 vs 2.552; the joint barrier then 1.213 vs 1.286.
            # Causal too (FA4 keeps 64 there): 2x16x4096x128 0.766 vs 0.790, 1x16x8192x128 1.374
            # vs 1.443, 4x16x2048x128 0.464 vs 0.467 (docs/attention_sm90.md). Dropout's flags would not fit
            # beside it in shared memory.
            fields.update(tile_m=80, dq_swapab=True, stats_early=False, pds_split=False)
            # store_first: H100, same run (zeroed accumulator / stored first, ms): 2x16x4096x128
            # 1.2653 / 1.2356, 4x16x2048x128 0.6720 / 0.6676, 1x16x8192x128 2.3986 / 2.3785,
            # causal 0.7203 / 0.7165 (2x16x4096x128 gained 0.4-3.3% in five runs); at d64 it
            # cost 2.6-9% (8x16x1024x64 0.2203 / 0.2307, 16x16x512x64 0.1473 / 0.1611: docs/attention_sm90.md)
            fields.update(store_first=True)
            # each warpgroup's dQ buffer freed just before its own copy, not both first: H100, two
            # runs of interleaved rounds (ms, both first / each before its copy): 4x16x2048x128
            # 0.6600 / 0.6480 and 0.6630 / 0.6509, 2x16x4096x128 1.2307 / 1.2136 and 1.2217 /
            # 1.2152, 1x16x8192x128 2.3694 / 2.3483 and 2.3710 / 2.3542, causal 2x16x4096x128
            # 0.7052 / 0.6827, 8x16x1024x128 0.3932 / 0.3881; a third run, the other way round, 1-4%
            # (docs/attention_sm90.md)
            fields.update(dq_empty_early=False)
            # the partial last query block on narrower products (2x16x4096: block 51 holds 16 rows
            # of 80; H100, Sq 4096 against 4080 (one whole block fewer) cost 1-2% more, and Sq 2048
            # (last block 48 rows) as much as 2080 (docs/attention_sm90.md)
            fields.update(tail_block=True)
        if max(head_dim, dv) <= 64 and not bias_or_dropout:
            # 128 queries a step, as FA4: fits 240 registers with dS stored before dV is issued
            # (C7512 without), the 32 + 32 statistics read at their use (8x16x1024x64 0.262 vs
            # 0.280 ms at tile_m 64, causal 2x16x4096x64 0.425 vs 0.468; with a bias or dropout
            # ptxas spills 32-880 bytes, so those keep 64). dQ a step late, both dQ buffers
            # freed first (H100, same runs: 4x16x2048x64 0.393 vs 0.404 ms, causal 2x16x4096x64
            # 0.401 vs 0.410, 8x16x1024x64 0.243 vs 0.245; at d128's tile_m 80 it spills)
            fields.update(
                tile_m=128, stats_early=False, pds_split=False, dq_defer=True, dq_empty_early=True, kv_buffers=2
            )
        fields.update(overrides)
        t = AttentionSm90Tiles(**fields)
        if t.dq_defer and t.ds_stages < 2:
            raise ValueError("dq_defer writes block i's dS while block i - 1's is read: ds_stages >= 2")
        if t.dq_defer and t.overlap != "none":
            raise ValueError("dq_defer issues every wgmma of a step within the step (overlap 'none')")
        if t.dq_defer and t.pds_split:
            raise ValueError("dq_defer has its own dS barriers (pds_split False)")
        if t.kv_buffers not in (1, 2):
            raise ValueError(f"kv_buffers must be 1 or 2, got {t.kv_buffers}")
        if t.kv_buffers == 2 and not (t.dq_defer and t.dkv_vector_store):
            raise ValueError("kv_buffers 2 (persistent CTAs) is built on dq_defer and dkv_vector_store")
        if t.dkv_vector_store and not t.dkv_tma_store:
            raise ValueError("dkv_vector_store stores the dK / dV that dkv_tma_store stages in shared memory")
        if t.dkv_vector_store and not all(_rows_split_evenly(c) for c in (t.head_dim, t.head_dim_v)):
            raise ValueError(
                f"dkv_vector_store: rows of {t.head_dim} / {t.head_dim_v} values do not split evenly "
                f"into the consumer threads' 16-byte stores"
            )
        if t.tile_m not in ((64, 80, 128) if t.dq_swapab else (64, 128)) or t.tile_n != 64 * NUM_CONSUMER_WG:
            raise ValueError(
                f"tile_m must be 64 or 128 (80 with dq_swapab) and tile_n {64 * NUM_CONSUMER_WG}, got "
                f"{t.tile_m}, {t.tile_n}"
            )
    need = t.smem_bytes(dropout=bias_or_dropout)  # with dropout its keep flags must fit too
    if need > SMEM_LIMIT:
        raise ValueError(f"tiles need {need} bytes of shared memory, more than {SMEM_LIMIT}")
    return t
