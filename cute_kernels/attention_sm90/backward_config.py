"""Choices of the Hopper attention backward that are not layouts: the tiles and algorithm
switches per head dim (``attention_sm90_tiles``), register budgets, warp roles, the host's
scratch alignment and the op's dispatch thresholds. Measured on H100 (docs/attention_sm90.md).
The decomposition, the shared-memory layouts, swizzle atoms and tiled MMAs / copies are
``layouts/attention_sm90.py`` (``AttentionSm90Layouts``, which ``AttentionSm90Tiles`` extends).

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

Head dims 192 and 256 (``AttentionSm90WideTiles``): shared memory decides the stages: Q, dO, K and V are 24 (d192) / 32 KiB
(d256) each per stage, P / dS 4 x 8 KiB, dQ staging 48 / 64 KiB. d192 fits two Q / dO
stages (226 of 227 KiB); d256 only one (225 KiB; two would be 257 KiB), so its producer
loads block i+1 only once block i is released (dO after dV, Q after dK): correctness
first, no benchmark case uses these head dims.

Dqk != Dv: both must be one of HEAD_DIMS and the wider picks the tiles
by the rules above (the 64 x 64 tiles above 128, two Q / dO stages where they fit). A
thread holds (Dqk + Dv) / 2 fp32 of dK and dV with the base tiles and (Dqk + Dv) / 4 with
the wide ones, never more than the wider head dim's
equal configuration. Dqk 96 with a Dv above 128 is refused: the wide tiles' dQ quarters
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

(tests/test_attention_sm90_tiles_cpu.py checks the table.) Everything else takes the
sm80-structured memory-efficient kernel (``ops`` dispatch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from layouts.attention_sm90 import (
    DKV_VECTOR_BITS,
    NUM_CONSUMER_WG,
    SMEM_LIMIT,
    TAIL_ROWS_ALIGN,
    AttentionSm90Layouts,
    AttentionSm90WideLayouts,
)

HEAD_DIMS = (64, 96, 128, 192, 256)  # Dqk = Dv; HEAD_DIM_PAIRS (below) the (Dqk, Dv) pairs with Dqk != Dv
WIDE_FROM = 128  # head dims above this take AttentionSm90WideTiles / AttentionBackwardSm90Wide
PRODUCER_REGS = 24  # setmaxnreg for the producer warpgroup
# persistent CTAs, whose warps 2 and 3 also store dK / dV (at 24 they spilled): the three
# warpgroups share the launch's 3 x 168 registers a thread slot (setmaxnreg.inc waits for
# registers the others freed: 32 + 2 x 240 would hang)
PRODUCER_REGS_PERSISTENT = 40
CONSUMER_REGS_PERSISTENT = 232
CONSUMER_REGS = 240  # for each consumer warpgroup (24 + 2 x 240 <= 504 per thread-slot budget)
STORE_WARP_THREADS = 32  # the producer warpgroup's dQ-store warp
DKV_STORE_WARPS = (2, 3)  # persistent CTAs: the producer warpgroup's warps that store dK / dV
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
LPT_L2_BYTES = 24 << 20  # of the H100's 50 MiB L2: what a chunk of the heavy-first CTA order may keep in it
# the host's one scratch allocation per call (Δ, the LSE, the zeroed int32s, the dQ accumulator):
# each part starts on a whole L2 line, as a fresh allocation would (a multiple of TMA_ALIGN_BYTES)
SCRATCH_ALIGN_BYTES = 128


@dataclass(frozen=True)
class AttentionSm90Tiles(AttentionSm90Layouts):
    """What the kernel reads: the layouts' geometry (``AttentionSm90Layouts``) and the
    algorithm switches below; ``attention_sm90_tiles`` picks both per head dim."""

    # what of block i+1 goes to the tensor cores before block i's dK is waited for:
    # "none", "s" (S^T) or "sdp" (S^T and dP^T; more live registers). "s" / "sdp" make ptxas
    # serialise the kernel's wgmmas (see the kernel); d64 is still faster with "s"
    overlap: str = "s"
    pds_split: bool = False  # one-way dS barriers per warpgroup, dK issued before waiting for the other half
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
    # FA4's step order, each its own switch for A/B: LSE read into registers once S^T is
    # issued and Δ after the exp (not from shared memory at their use) ...
    stats_early: bool = False
    # ... dS^T stored before dV is issued (the fence after it: the stores have landed by then) ...
    ds_before_dv: bool = False
    # ... and the store warp frees both warpgroups' dQ buffers before waiting for either
    dq_empty_early: bool = False
    # a query block cut short by the sequence's end (Sq not a multiple of tile_m) runs on
    # products only ``tail_rows`` queries wide instead of tile_m with the rest masked: the kernel
    # compiles the narrower tiled MMAs beside the full ones (AttentionBackwardSm90's ``tail_m``)
    tail_block: bool = False

    def carries_dq(self, steps_per_tile: int) -> bool:
        """Whether persistent CTAs over equal tiles of ``steps_per_tile`` steps (query blocks x
        query heads of a key head) compute a tile's last dQ in the next tile's step 0."""
        return self.kv_buffers == 2 and self.dq_defer and 0 < steps_per_tile <= CARRY_DQ_MAX_STEPS

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
        those whose modelled makespan is shortest (``lpt_order.py`` beside this module: a last, partial
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

    def dq_accum_zero_copy(self):
        """zero_ahead: one warp's 16-byte stores of fp32 zeros into a query block's accumulator
        rows (``s2g_copy_dkv``'s row pieces, head_dim fp32 wide, a warp's lanes)."""
        from cutlass import Float32

        return self.s2g_copy_dkv(Float32, self.head_dim, STORE_WARP_THREADS)


@dataclass(frozen=True)
class AttentionSm90WideTiles(AttentionSm90WideLayouts, AttentionSm90Tiles):
    """d192 / d256, or a Dqk / Dv pair with one of them (``AttentionBackwardSm90Wide``): 64 keys
    x 64 queries, both warpgroups own all 64 keys and split the other dimension of every
    product (module docstring)."""


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
