"""Hopper-native attention backward: dK, dV and the fp32 dQ accumulator of one key block per CTA.

The decomposition (warpgroups, products, shared-memory operands) is in
``layouts/attention_sm90.py``. Δ comes from our preprocess (``compute_dot_do_o``,
which also zeroes the dQ accumulator unless ``store_first``) and dQ from our ``convert_dq``;
this kernel adds ``dS K`` of every (query block, key block) pair into the accumulator with TMA
reduce-adds (with ``store_first`` a query block's first one is a TMA store).

Shared memory (one phase: everything lives for the whole CTA)::

    sQ, sdO   [tile_m, d | dv, stages]  TMA ring, mbarrier pipelines (with sLSE, sDelta)
    sK, sV    [tile_n, d | dv]          loaded once (kv mbarrier); with dkv_tma_store dK / dV
                                        staged there after the last block, for a TMA store or
                                        (dkv_vector_store) every consumer thread's 16-byte stores
    sdS       [tile_m, tile_n, 2]       dS of the block, A operand of dQ = dS K (with the bias
                                        gradient keys contiguous: also its TMA-store source)
    sdQ       [tile_m, d, dq_stages] fp32   the block's dQ, source of the TMA reduce-add
    sKeep     [tile_m, tile_n / 8, 2]   dropout only: keep-flag bits of the block

(d = Dqk, the head dim of Q, K, dQ, dK; dv = Dv, of V, dO, dV; equal unless the tiles
say otherwise.)

Synchronisation: the Q / dO pipelines (full: TMA transaction bytes, empty: the 8
consumer warps); named barriers PDS (both consumer warpgroups wrote dS; with pds_split
one one-way barrier per warpgroup; with dq_defer a pair per warpgroup, even and odd steps,
as dQ waits for the other half a step later), DQ_EMPTY and DQ_FULL (sdQ handed between the
consumers and the dQ-store warp; with dq_per_wg a pair per warpgroup), KEEP_FLAGS (dropout:
a warpgroup's flags of the block are drawn; one per warpgroup), EPILOGUE (dkv_tma_store:
both warpgroups are done with K / V, then their dK / dV are written and, with
dkv_vector_store, read back). Options and their
measurements: layouts/attention_sm90.py, docs/attention_sm90.md.

With ``tail_m`` (d128's tiles, the host's choice per sequence length) the partial last query
block's step runs on tiled MMAs tail_m queries wide (``tail_operands``, ``steps_with_tail``):
its S^T / dP^T / dQ^T need 16-64 columns of 80 and dV / dK one to four k-blocks of five.

Launched with programmatic dependent launch behind the preprocess launch, which triggers
it once its loads are done: K / V loads and the CTA's set-up overlap the preprocess's
tail; the producer and the dQ-store warp wait for the preprocess grid (griddepcontrol)
before reading Δ / LSE or adding into the accumulator. Launch it right behind that
preprocess (nothing in between on the stream).

With ``dq_ready`` every CTA lets the launch behind it go at its start
(griddepcontrol.launch_dependents) and counts its key block into a zeroed int32 per
(sequence, key head) once its dQ adds are written (release): ``ConvertDQReady``, launched
behind as a programmatic dependent, converts a head's dQ as soon as all its key blocks are
counted, on the multiprocessors this grid's last wave leaves idle.
"""

import dataclasses
from typing import Any, NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Int64, Uint8, Uint16, Uint32, Uint64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from cute_kernels.common.log2_units import LOG2_E
from cute_kernels.common.philox import keep_flags_quads, philox_scalar
from cute_kernels.common.views import rows_view, select_modes, transpose_view
from layouts.attention_bwd_prepost import SEQLEN_ROUND, VARLEN_ACCUM_PAD
from layouts.attention_sm90 import (
    CONSUMER_REGS,
    GRAD_BIAS_BOX_KEYS,
    KEEP_FLAG_BUFFERS,
    PRODUCER_REGS,
    PRODUCER_REGS_PERSISTENT,
    CONSUMER_REGS_PERSISTENT,
    DKV_STORE_WARPS,
    SMEM_ALIGN,
    SMEM_LIMIT,
    STATS_ALIGN,
    TAIL_ROWS_ALIGN,
    AttentionSm90Tiles,
)

from cute_kernels.attention.mask import AttentionMask
from cute_kernels.attention.seqlen_info import SeqlenInfo
from cute_kernels.attention.named_barrier import NamedBarrier, cyclic, named_barrier

from .wgmma import acc_as_operand_a, acc_mn_layout, wgmma


class StepOperands(NamedTuple):
    """One kind of consumer step's products (``block_step``): tiled MMAs, operand fragments,
    accumulators and register-to-shared copies of a whole query block, or of a partial one
    (``tail_operands``)."""

    tiled_mma_sdp: Any
    acc_S: Any
    acc_dP: Any
    tSrK: Any
    tSrQ: Any
    tPrV: Any
    tPrdO: Any
    shape_sdp: Any
    cS_mn: Any
    tVrdO: Any
    tKrQ: Any
    tiled_mma_dq: Any
    tQrdS: Any
    tQrK: Any
    tQrK_both: Any
    shape_dq: Any
    r2s_ds: Any
    thr_r2s_ds: Any
    tdSs: Any
    r2s_dq: Any
    thr_r2s_dq: Any
    tdQs: Any


class StepEnv(NamedTuple):
    """What every consumer step of a tile shares (``mma``, ``block_step``)."""

    pipe_q: Any
    pipe_do: Any
    state_next: Any
    sLSE: Any
    sDelta: Any
    sdS: Any
    feat: Any
    tiled_mma_dkv: Any
    tiled_mma_dv: Any
    acc_dV: Any
    acc_dK: Any
    wg: Any
    tidx: Any
    n_block: Any
    key0: Any
    offset: Any
    seqlen_q: Any
    seqlen_k: Any
    window_size: Any
    scale_log2: Any
    steps: Any
    carry: Any
    kv_state: Any
    done: Any


class AttentionBackwardSm90:
    """Configuration: element type, tiles, mask (0 none, 1 causal from the top-left, 2 from the
    bottom-right) and, with a causal mask, a sliding window (key k sees query q when
    q + offset - window_size < k <= q + offset; the window's size is a runtime argument).

    ``deterministic``: each query block's dQ is added by the key blocks that see it in a
    fixed order (ascending without a mask, descending with one; a semaphore per query
    block and query head counts the adds), so the fp32 sums, and dQ, are the same bits
    from run to run.

    ``varlen``: sequences of different lengths packed along the rows of batch-1 tensors
    (``cu_seqlens_q / _k``: int32 [sequences + 1], sequence b is rows cu[b] .. cu[b + 1]);
    the grid's z is the sequence and every mask is per sequence. A tile that runs past its
    sequence reads the next one's rows (or TMA's zeros past the end): masked like rows
    past seqlen. The dQ accumulator gives each sequence VARLEN_ACCUM_PAD rows of slack
    (our preprocess / convert_dq layout), so whole-tile reduce-adds stay in its rows.

    ``has_bias``: B [B, H, Sq, Sk] (any strides, 0 for broadcast dims) is added to the
    scaled scores before the softmax, as the forward did; each thread reads the values of
    its S^T fragment from global memory while S^T is computed. ``grad_bias``: dB = dS (before
    the softmax scale) leaves by TMA stores from the dS tile in shared memory, whose keys are
    then contiguous (``tiles.ds_keys_contiguous``): once a warpgroup has seen the other's half
    of dS written (the dS barrier it waits at anyway), one of its threads stores that half.

    ``dropout``: the keep mask Z of torch's memory-efficient forward (curand's Philox, one
    stream word per (query, key): ``common/philox.py``) is redrawn per block: each consumer
    thread draws ``keep_flag_keys`` consecutive keys of one query row (4 per Philox call)
    into a bit buffer in shared memory, and reads its fragment's bits back after its
    warpgroup's barrier. dV += (P∘Z)^T dO and dS = P∘(Z∘dP - Δ), Z = 0 or 1 / (1 - p);
    Δ = rowsum(dO∘O) as without dropout (O holds the dropped P).

    ``carry_dq`` (persistent CTAs over equal tiles, asked for where tiles are short): a tile's
    last block's dQ is the next tile's step 0 product (with ``dq_defer`` step 0 had none), on the
    finished tile's K, which stays in its buffer until then; that tile's dK is staged in the dS
    buffer its next block writes, and the store warps read it out first (``NamedBarrier.DS_FREE``) and
    free the K / V buffer once step 0 is done with K (``NamedBarrier.K_FREE``). The CTA's last tile runs
    its last dQ after the loop (``carried_dq_tail``).

    ``store_first`` (the caller asks for it where every query block is seen by some key block):
    the accumulator is not zeroed; the first key block to reach a query block stores its dQ
    there (a TMA store instead of a reduce-add) and publishes it, the others add once it is
    published. A zeroed int32 per (batch, query head, query block) is 0 (free), 1 (claimed by
    the CTA storing it) or 2 (stored). The dQ-store warp claims a block by compare-and-swap
    before its dQ is staged; without a mask key block n walks its query blocks from
    n * blocks / key blocks on (``work_item``), so claims rarely meet.

    ``zero_ahead`` (persistent CTAs over equal tiles, "persistent" schedule): the accumulator is
    not zeroed by the preprocess either; the kernel zeroes it a round of tiles ahead. Each query block is
    owned by one key block of its head (a contiguous share, ``owned_blocks``); the producer
    warpgroup's dK / dV store warps, idle while a tile runs, zero the blocks their CTA's next tile
    owns (the first tile's at the CTA's start), each block claimed on its flag first (a zeroed
    int32 per (batch, query head, query block): 0 untouched, 1 being zeroed, 2 zeroed). The
    dQ-store warp reads a tile's flags 32 blocks at a time, without waiting, and looks at a
    block not yet seen zeroed again only when its copy is due (``wait_zeroed``): still untouched,
    it zeroes the block itself, so no CTA ever waits for one that has not started (persistent
    CTAs need not all be resident); being zeroed, it waits for the running zeroing warp. Blocks
    owned by a head's other tiles are zeroed a round ahead as long as a head's key blocks fit
    the grid, which the caller keeps (else the store warps would zero most blocks late). With
    tiles from the counter (causal masks) a CTA learns its next tile only near the end of the
    current one, so the zeroing warps of every CTA instead zero all blocks at the kernel's
    start, taking them from a second counter in the order the heavy-first walk reaches their
    heads (``zero_jobs``); the dQ-store warps' takeover is the same."""

    def __init__(
        self,
        dtype,
        tiles: AttentionSm90Tiles,
        mask_type: int,
        has_window: bool = False,
        deterministic: bool = False,
        varlen: bool = False,
        has_bias: bool = False,
        grad_bias: bool = False,
        dropout: bool = False,
        carry_dq: bool = False,
        dq_ready: bool = False,
        store_first: bool = False,
        zero_ahead: bool = False,
        tail_m: int = 0,
    ):
        if has_window and mask_type == 0:
            raise ValueError("a sliding window needs a causal mask (mask_type 1 or 2)")
        if grad_bias and not has_bias:
            raise ValueError("grad_bias needs has_bias")
        if grad_bias and not tiles.ds_keys_contiguous:
            # the TMA stores of the bias gradient read dS rows of keys (without it either layout
            # serves: H100, same speed to 1%)
            raise ValueError("grad_bias needs tiles.ds_keys_contiguous")
        if tiles.dq_defer and (has_bias or dropout):
            # its dS barriers do not order the bias gradient's stores or the keep-flag buffers
            raise ValueError("tiles.dq_defer is built for runs without a bias or dropout")
        if has_bias and varlen:
            raise NotImplementedError("attention bias with variable lengths (torch's forward refuses it too)")
        if dropout and tiles.smem_bytes(dtype.width // 8, dropout=True) > SMEM_LIMIT:
            raise ValueError("the dropout keep flags do not fit in shared memory beside these tiles")
        self.dtype = dtype
        self.tiles = tiles
        self.mask_type = mask_type
        self.has_window = has_window
        self.deterministic = deterministic
        self.varlen = varlen
        self.mask = AttentionMask(tiles.tile_m, tiles.tile_n, mask_type, has_window, varlen)
        self.has_bias = has_bias
        self.grad_bias = grad_bias
        self.dropout = dropout
        # heavy-first CTA order for causal masks (cta_coords); deterministic mode keeps the
        # launch order its dQ turns are built on (a CTA must never wait for one not launched)
        self.lpt = tiles.lpt and mask_type != 0 and not deterministic
        schedule = self.tile_schedule(tiles, mask_type, has_window, deterministic, varlen, has_bias, dropout)
        self.persistent = schedule != "grid"
        self.dynamic_tiles = schedule == "dynamic"
        # persistent CTAs over equal tiles (every tile has steps): the last block's dQ of a tile
        # is the next tile's step 0 product (dK staged in a free dS buffer, K kept until then);
        # the caller asks for it where tiles are short (tiles.carries_dq)
        if carry_dq and (schedule != "persistent" or tiles.dq_swapab):
            raise ValueError(f"carry_dq needs persistent CTAs over equal tiles (schedule {schedule!r}) and dQ = dS K")
        self.carry_dq = carry_dq
        if dq_ready and self.persistent:
            # their tails are short (a CTA per multiprocessor runs to the end): the per-tile
            # counts cost what the overlap saves (H100: 8x16x1024x64 -0.7%, 16x16x512x64 +-0)
            raise ValueError(f"dq_ready counts a CTA per tile (schedule 'grid'), not {schedule!r}")
        self.dq_ready = dq_ready
        if store_first and (deterministic or varlen):
            # determinism orders the adds by turns; varlen's accumulator rows are per sequence
            raise ValueError("store_first is built for runs without deterministic mode or varlen")
        self.store_first = store_first
        # store_first without a mask: key block n starts n / key blocks of the way through its
        # query blocks, so each block's first writer is nearly always alone there (a causal
        # mask staggers them already: key block n starts at its diagonal)
        self.rotates = store_first and mask_type == 0
        if zero_ahead and (schedule == "grid" or has_window or store_first):
            # persistent CTAs (a CTA's next tile is known, or the warps that zero take blocks from a
            # counter), and every query block reached by some key block (the caller checks the corners)
            raise ValueError(f"zero_ahead needs persistent CTAs (schedule {schedule!r}), no window, not store_first")
        if zero_ahead and SEQLEN_ROUND % tiles.tile_m:
            # zero_block writes whole tile_m blocks of rows: they must end within the accumulator's rounded rows
            raise ValueError(
                f"zero_ahead zeroes whole blocks of {tiles.tile_m} rows: the accumulator's rows are "
                f"rounded to {SEQLEN_ROUND}"
            )
        self.zero_ahead = zero_ahead
        if varlen and tiles.tile_m > VARLEN_ACCUM_PAD:
            raise ValueError(f"tile_m {tiles.tile_m} overruns the dQ accumulator's {VARLEN_ACCUM_PAD} rows of slack")
        if tail_m and not (tiles.tail_block and tail_m % TAIL_ROWS_ALIGN == 0 and 0 < tail_m < tiles.tile_m):
            raise ValueError(
                f"tail_m {tail_m}: tiles.tail_block and a multiple of {TAIL_ROWS_ALIGN} below tile_m "
                f"{tiles.tile_m} (tiles.tail_rows)"
            )
        if tail_m and not self.takes_tail(tiles, schedule, varlen, has_bias, dropout):
            raise ValueError("tail_m is built for a CTA per tile without varlen, bias, dropout, overlap or dq_defer")
        # the partial last query block's products are tail_m queries wide (tail_operands)
        self.tail_m = tail_m

    @staticmethod
    def takes_tail(
        tiles: AttentionSm90Tiles, schedule: str, varlen: bool = False, has_bias: bool = False, dropout: bool = False
    ) -> bool:
        """Whether a partial last query block can run on narrower products (``tail_m``): tiles
        that ask for it (``tiles.tail_block``), a CTA per tile ("grid"), one partial block a
        sequence end known to the host (not varlen's per packed sequence), every wgmma of a step
        inside the step (no overlap or dq_defer: the partial block's step sits between loops of
        whole blocks), no bias or dropout (their tiles are tile_m wide)."""
        return (
            tiles.tail_block
            and schedule == "grid"
            and not (varlen or has_bias or dropout)
            and tiles.overlap == "none"
            and not tiles.dq_defer
        )

    @staticmethod
    def tile_schedule(
        tiles: AttentionSm90Tiles,
        mask_type: int,
        has_window: bool = False,
        deterministic: bool = False,
        varlen: bool = False,
        has_bias: bool = False,
        dropout: bool = False,
    ) -> str:
        """How CTAs meet tiles: "grid" (a CTA a tile, placed by the hardware), "persistent" (a CTA
        per multiprocessor walking tiles c, c + grid, ...: equal tiles, no mask) or "dynamic"
        (persistent, each next tile taken from a zeroed counter in the heavy-first order: causal
        tiles differ in work). Persistent CTAs need tiles.kv_buffers 2 (the next tile's K / V load
        while a tile runs) and none of the paths with per-CTA state of their own (varlen offsets,
        determinism's turns, bias, dropout). A key block no query sees (a window, top-left
        Sq < Sk) is a tile without steps: K / V loaded, zero dK / dV stored."""
        if tiles.kv_buffers != 2 or deterministic or varlen or has_bias or dropout:
            return "grid"
        return "dynamic" if mask_type != 0 else "persistent"

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, Sq, H, D] (varlen: [1, total_q, H, D])
        mK: cute.Tensor,  # [B, Sk, Hk, D], H a multiple of Hk (grouped-query heads)
        mV: cute.Tensor,  # [B, Sk, Hk, Dv]
        mdO: cute.Tensor,  # [B, Sq, H, Dv]
        mLSE: cute.Tensor,  # [B, H, >= Sq] fp32, in log2 units: LSE * log2(e) (varlen: [sequences, H, >= max_seqlen_q])
        mDelta: cute.Tensor,  # [B, H, >= Sq] fp32 (varlen: as LSE)
        mdQaccum: cute.Tensor,  # [B, round_up(Sq, tile_m), H, D] fp32, zeroed unless store_first / zero_ahead (varlen: [1, total_q + pad * sequences, H, D])
        mdK: cute.Tensor,  # [B, Sk, Hk, D]
        mdV: cute.Tensor,  # [B, Sk, Hk, Dv]
        mSemaphore: Optional[cute.Tensor],  # [B, H, query blocks] int32, zeroed (deterministic), or None
        mTileCounter: Optional[cute.Tensor],  # [1] int32, zeroed (tile_schedule "dynamic"), or None
        mDqReady: Optional[cute.Tensor],  # [sequences, Hk] int32, zeroed (dq_ready): key blocks whose dQ is added
        # [B, H, query blocks] int32, zeroed: store_first 0 free, 1 claimed, 2 stored; zero_ahead 0 untouched, 1 being zeroed, 2 zeroed
        mDqFirst: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],  # [sequences + 1] int32 (varlen), or None
        mCuSeqlensK: Optional[cute.Tensor],
        mBias: Optional[cute.Tensor],  # [B, H, Sq, Sk] (has_bias), or None
        mdBias: Optional[cute.Tensor],  # [B, H, Sq, Sk] (grad_bias), or None
        softmax_scale: Float32,
        window_size: Int32,  # used with has_window
        max_seqlen_k: Int32,  # varlen: sizes the grid
        heads_per_chunk: Int32,  # the heavy-first order's L2 chunk (``lpt``; see cta_coords)
        num_ctas: Int32,  # persistent CTAs: how many (the multiprocessors' count)
        philox_seed,  # dropout (None without): Int64 seed and offset (or Int64 [1] device tensors),
        philox_offset,  # p and 1 / (1 - p) (Float32), the stream words of one (batch, head): Mq * Mk (Int64)
        dropout_p,
        dropout_scale,
        dropout_bh_elems,
        stream: cuda.CUstream,
    ):
        t = self.tiles
        d, dv = t.head_dim, t.head_dim_v
        # (seq, d, heads, batch) and (seq, heads, batch): TMA tiles the first modes
        mQ, mK, mV, mdO, mdQaccum, mdK, mdV = [
            select_modes(x, (1, 3, 2, 0)) for x in (mQ, mK, mV, mdO, mdQaccum, mdK, mdV)
        ]
        mLSE, mDelta = [select_modes(x, (2, 1, 0)) for x in (mLSE, mDelta)]
        if const_expr(self.deterministic):
            mSemaphore = select_modes(mSemaphore, (2, 1, 0))  # (query blocks, heads, batch)
        if const_expr(self.store_first or self.zero_ahead):
            mDqFirst = select_modes(mDqFirst, (2, 1, 0))  # (query blocks, heads, batch)

        sQ_layout = t.smem_layout_q(self.dtype)
        sdO_layout = t.smem_layout_do(self.dtype)
        sK_layout = t.smem_layout_k(self.dtype)
        sV_layout = t.smem_layout_v(self.dtype)
        sdS_layout = t.smem_layout_ds(self.dtype)
        sdQ_layout = t.smem_layout_dq()
        sStat_layout = cute.make_layout((t.tile_m, t.stages), stride=(1, t.stats_stage_stride))

        tma_Q, gQ_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, cute.select(sQ_layout, mode=[0, 1]), (t.tile_m, d)
        )
        tma_dO, gdO_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mdO, cute.select(sdO_layout, mode=[0, 1]), (t.tile_m, dv)
        )
        sK_one, sV_one = sK_layout, sV_layout  # one K / V buffer
        if const_expr(t.kv_buffers > 1):
            sK_one, sV_one = cute.select(sK_layout, mode=[0, 1]), cute.select(sV_layout, mode=[0, 1])
        tma_K, gK_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mK, sK_one, (t.tile_n, d))
        tma_V, gV_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mV, sV_one, (t.tile_n, dv))
        tma_LSE, gLSE_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mLSE, cute.make_layout(t.tile_m), (t.tile_m,)
        )
        tma_Delta, gDelta_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mDelta, cute.make_layout(t.tile_m), (t.tile_m,)
        )
        # the reduce-add of a block's dQ, and with store_first the plain store of its first one
        dq_box = (
            (t.smem_layout_dq_sub(), t.dq_sub_tile)
            if const_expr(t.dq_per_wg)
            else (cute.select(sdQ_layout, mode=[0, 1]), (t.tile_m, d))
        )
        tma_dQ, gdQ_tma = cpasync.make_tiled_tma_atom(cpasync.CopyReduceBulkTensorTileS2GOp(), mdQaccum, *dq_box)
        tma_dQ_store = None
        if const_expr(self.store_first):
            tma_dQ_store, _ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mdQaccum, *dq_box)

        dkv_tma = None  # (the vector stores read sK / sV and write mdK / mdV directly)
        if const_expr(t.dkv_by_tma):
            tma_dK, gdK_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mdK, sK_layout, (t.tile_n, d)
            )
            tma_dV, gdV_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mdV, sV_layout, (t.tile_n, dv)
            )
            dkv_tma = (tma_dK, gdK_tma, tma_dV, gdV_tma)

        tma_dB = gdB_tma = None
        if const_expr(self.grad_bias):  # (queries, keys, heads, batch): boxes of the keys-contiguous dS tile
            tma_dB, gdB_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(),
                select_modes(mdBias, (2, 3, 1, 0)),
                t.smem_layout_grad_bias_box(self.dtype),
                (t.tile_m, GRAD_BIAS_BOX_KEYS),
            )

        elem = self.dtype.width // 8
        self.q_bytes = t.tile_m * d * elem + t.tile_m * 4  # Q + LSE
        self.do_bytes = t.tile_m * dv * elem + t.tile_m * 4  # dO + Δ
        self.kv_bytes = t.tile_n * (d + dv) * elem

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * t.stages]
            mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * t.stages]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, t.kv_barriers]
            if const_expr(t.tile_ring > 0):  # (reserved with two K / V buffers: smem_bytes counts it)
                mbar_tile: cute.struct.MemRange[cutlass.Int64, 2 * t.tile_ring]
                sTile: cute.struct.MemRange[Int32, t.tile_ring]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStat_layout)], STATS_ALIGN]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStat_layout)], STATS_ALIGN]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], SMEM_ALIGN]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], SMEM_ALIGN]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], SMEM_ALIGN]
            if const_expr(self.dropout):  # no placeholder without it: a byte there rounds the struct up by 1 KiB
                sKeep: cute.struct.Align[
                    cute.struct.MemRange[Uint8, KEEP_FLAG_BUFFERS * t.keep_flag_bytes], STATS_ALIGN
                ]

        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        # one CTA per (key block, key head): it walks the query blocks of every query head
        # of its group, so dK / dV sum over the group in registers
        group = mQ.shape[2] // mK.shape[2]
        n_blocks = cute.ceil_div(max_seqlen_k if const_expr(self.varlen) else seqlen_k, t.tile_n)
        heads_kv = mK.shape[2]
        batches = mCuSeqlensK.shape[0] - 1 if const_expr(self.varlen) else mK.shape[3]
        grid = (n_blocks, heads_kv, batches)
        if const_expr(self.lpt):
            grid = (n_blocks * heads_kv * batches, 1, 1)
        if const_expr(self.persistent):
            tiles_total = n_blocks * heads_kv * batches
            grid = (cutlass.min(tiles_total, num_ctas), 1, 1)
        sched = (n_blocks, heads_kv, batches, heads_per_chunk)
        rng = None
        if const_expr(self.dropout):
            rng = (philox_seed, philox_offset, dropout_p, dropout_scale, dropout_bh_elems)
        self.kernel(
            gQ_tma,
            gdO_tma,
            gK_tma,
            gV_tma,
            gLSE_tma,
            gDelta_tma,
            gdQ_tma,
            mdK,
            mdV,
            mSemaphore,
            mTileCounter,
            mDqReady,
            (mDqFirst, tma_dQ_store, mdQaccum),
            mCuSeqlensQ,
            mCuSeqlensK,
            mBias,
            (tma_dB, gdB_tma),
            dkv_tma,
            tma_Q,
            tma_dO,
            tma_K,
            tma_V,
            tma_LSE,
            tma_Delta,
            tma_dQ,
            sQ_layout,
            sdO_layout,
            sK_layout,
            sV_layout,
            sdS_layout,
            sdQ_layout,
            sStat_layout,
            t.tiled_mma_sdp(self.dtype),
            t.tiled_mma_dkv(self.dtype),
            t.tiled_mma_dkv(self.dtype, dv),
            t.tiled_mma_dq(self.dtype),
            seqlen_q,
            seqlen_k,
            group,
            softmax_scale,
            window_size,
            sched,
            rng,
            SharedStorage,
        ).launch(grid=grid, block=[t.num_threads, 1, 1], min_blocks_per_mp=1, stream=stream, use_pdl=True)

    # ------------------------------------------------------------------------------ kernel
    @cute.kernel
    def kernel(
        self,
        gQ_tma: cute.Tensor,
        gdO_tma: cute.Tensor,
        gK_tma: cute.Tensor,
        gV_tma: cute.Tensor,
        gLSE_tma: cute.Tensor,
        gDelta_tma: cute.Tensor,
        gdQ_tma: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mSemaphore: Optional[cute.Tensor],
        mTileCounter: Optional[cute.Tensor],
        mDqReady: Optional[cute.Tensor],
        dq_first: tuple,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mBias: Optional[cute.Tensor],
        grad_bias_tma: tuple,
        dkv_tma: Optional[tuple],
        tma_Q: cute.CopyAtom,
        tma_dO: cute.CopyAtom,
        tma_K: cute.CopyAtom,
        tma_V: cute.CopyAtom,
        tma_LSE: cute.CopyAtom,
        tma_Delta: cute.CopyAtom,
        tma_dQ: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        sStat_layout: cute.Layout,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        seqlen_q: Int32,
        seqlen_k: Int32,
        group: Int32,
        softmax_scale: Float32,
        window_size: Int32,
        sched: tuple,
        rng: Optional[tuple],
        SharedStorage: cutlass.Constexpr,
    ):
        t = self.tiles
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = self.cta_coords(sched)
        if warp_idx == 0:
            if const_expr(self.dq_ready):
                # ConvertDQReady, behind on the stream, may take the multiprocessors this grid's
                # CTAs leave once every one has started (it waits for each head's count)
                cute.arch.griddepcontrol_launch_dependents()
            for atom in (tma_Q, tma_dO, tma_K, tma_V, tma_LSE, tma_Delta, tma_dQ):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.grad_bias):
                cpasync.prefetch_descriptor(grad_bias_tma[0])
            if const_expr(self.store_first):
                cpasync.prefetch_descriptor(dq_first[1])
            if const_expr(t.dkv_by_tma):
                cpasync.prefetch_descriptor(dkv_tma[0])
                cpasync.prefetch_descriptor(dkv_tma[2])

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        sLSE = storage.sLSE.get_tensor(sStat_layout)
        sDelta = storage.sDelta.get_tensor(sStat_layout)
        mbar_kv = storage.mbar_kv.data_ptr()
        sdK_carry = None
        if const_expr(self.carry_dq):
            # carry_dq stages a tile's dK in the dS buffer its next block will write (K's layout)
            sdK_carry = storage.sdS.get_tensor(
                cute.append(cute.select(sK_layout.outer, mode=[0, 1]), cute.select(sdS_layout.outer, mode=[2])),
                swizzle=sK_layout.inner,
            )
        sKeep = None
        if const_expr(self.dropout):  # bytes; keep_flag_halves views them
            sKeep = storage.sKeep.get_tensor(cute.make_layout(KEEP_FLAG_BUFFERS * t.keep_flag_bytes))

        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, t.num_mma_threads // 32)
        pipe_kv = None
        if const_expr(self.persistent):
            # K / V double-buffered across the CTA's tiles; a buffer is free once the dK / dV
            # store warps have read the tile's dK / dV staged there
            pipe_kv = pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar_kv,
                num_stages=t.kv_buffers,
                producer_group=producer,
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, len(DKV_STORE_WARPS)),
                tx_count=self.kv_bytes,
                defer_sync=True,
            )
        else:
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(mbar_kv, 1)
            if const_expr(t.kv_buffers > 1):  # one tile a CTA: the first buffer alone
                sK, sV = sK[None, None, 0], sV[None, None, 0]
        tiles_args = None  # persistent CTAs: (tile ring pipeline, its slots, the tile counter)
        if const_expr(self.dynamic_tiles):
            # the producer warp takes tiles from the counter and hands them to the other warps
            pipe_tile = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_tile.data_ptr(),
                num_stages=t.tile_ring,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, t.num_threads - 32),
                defer_sync=True,
            )
            tiles_args = (pipe_tile, storage.sTile.get_tensor(cute.make_layout(t.tile_ring)), mTileCounter)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_q.data_ptr(),
            num_stages=t.stages,
            producer_group=producer,
            consumer_group=consumers,
            tx_count=self.q_bytes,
            defer_sync=True,
        )
        pipe_do = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_do.data_ptr(),
            num_stages=t.stages,
            producer_group=producer,
            consumer_group=consumers,
            tx_count=self.do_bytes,
            defer_sync=True,
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # where the CTA's sequence starts in the packed rows (varlen) and its lengths
        cu_seqlens = (mCuSeqlensQ, mCuSeqlensK) if const_expr(self.varlen) else (None, None)
        seq = SeqlenInfo.create(batch, seqlen_q, seqlen_k, *cu_seqlens)
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        rows = (seq.offset_q, seq.offset_k)
        # the CTA's work: (query head of the group, query block) pairs, heads outer
        work = self.work_of(n_block, head_kv, group, seqlen_q, seqlen_k, window_size)

        if const_expr(self.persistent):
            self.persistent_roles(
                warp_idx,
                tidx,
                sched,
                group,
                seqlen_q,
                seqlen_k,
                window_size,
                softmax_scale,
                tiles_args,
                (
                    gQ_tma,
                    gdO_tma,
                    gK_tma,
                    gV_tma,
                    gLSE_tma,
                    gDelta_tma,
                    sQ,
                    sdO,
                    sK,
                    sV,
                    sLSE,
                    sDelta,
                    tma_Q,
                    tma_dO,
                    tma_K,
                    tma_V,
                    tma_LSE,
                    tma_Delta,
                    pipe_q,
                    pipe_do,
                    pipe_kv,
                ),
                (gdQ_tma, sdQ, tma_dQ, mSemaphore, dq_first),
                (
                    sQ,
                    sdO,
                    sdS,
                    sdQ,
                    sLSE,
                    sDelta,
                    (mdK, mdV, dkv_tma),
                    tiled_mma_sdp,
                    tiled_mma_dkv,
                    tiled_mma_dv,
                    tiled_mma_dq,
                    pipe_q,
                    pipe_do,
                    mbar_kv,
                ),
                sdK_carry,
            )
        elif warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self.load(
                    gQ_tma,
                    gdO_tma,
                    gK_tma,
                    gV_tma,
                    gLSE_tma,
                    gDelta_tma,
                    sQ,
                    sdO,
                    sK,
                    sV,
                    sLSE,
                    sDelta,
                    tma_Q,
                    tma_dO,
                    tma_K,
                    tma_V,
                    tma_LSE,
                    tma_Delta,
                    pipe_q,
                    pipe_do,
                    mbar_kv,
                    n_block,
                    batch,
                    work,
                    rows,
                )
            if warp_idx == 1:
                self.store_dq(
                    gdQ_tma, sdQ, tma_dQ, mSemaphore, n_block, batch, work, rows, seqlen_q, seqlen_k, mDqReady, dq_first
                )
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            feat = self.features(mBias, grad_bias_tma, sKeep, rng, batch, group * sched[1])  # query heads
            dkv_out = (mdK, mdV, dkv_tma)
            self.mma(
                sQ,
                sdO,
                sK,
                sV,
                sdS,
                sdQ,
                sLSE,
                sDelta,
                dkv_out,
                tiled_mma_sdp,
                tiled_mma_dkv,
                tiled_mma_dv,
                tiled_mma_dq,
                pipe_q,
                pipe_do,
                mbar_kv,
                tidx - 128,
                n_block,
                batch,
                work,
                rows,
                seqlen_q,
                seqlen_k,
                softmax_scale,
                window_size,
                feat,
            )

    @cute.jit
    def persistent_roles(
        self,
        warp_idx,
        tidx,
        sched,
        group,
        seqlen_q,
        seqlen_k,
        window_size,
        softmax_scale,
        tiles_args,
        load_args,
        store_args,
        mma_args,
        sdK_carry,
    ):
        """Persistent CTAs (``self.persistent``): CTA c runs tiles c, c + grid, ... in launch
        order (key blocks of a head side by side, as the hardware would place them), or with
        ``dynamic_tiles`` tile c, then whichever the tile counter hands out next (grid + k, in
        the heavy-first order of causal masks: list scheduling, as the hardware does it for a
        CTA per tile). The Q / dO pipelines run on across tiles; K / V alternate between two
        buffers, so the producer loads the next tile's while this one runs. The consumers stage a
        tile's dK / dV in its buffer and go on with the next tile; warps 2 and 3 store them to
        global memory and free the buffer (measured: ~2 us of a 24 us CTA at 8x16x1024x64 waited
        for K / V, ~1 us stored dK / dV; docs/attention_sm90.md)."""
        t = self.tiles
        n_blocks, heads_kv, batches, _ = sched
        total = n_blocks * heads_kv * batches
        first, _, _ = cute.arch.block_idx()
        step, _, _ = cute.arch.grid_dim()
        rows = (Int32(0), Int32(0))
        ring = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, max(t.tile_ring, 1))
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS_PERSISTENT)
            if warp_idx == 0:
                ring = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, max(t.tile_ring, 1))
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.stages)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.kv_buffers)
                tile = first
                while tile < total:
                    ring = self.publish_tile(tiles_args, tile, ring)
                    n_block, batch, work = self.tile_work(sched, tile, group, seqlen_q, seqlen_k, window_size)
                    state, kv_state = self.load(
                        *load_args[:-1], None, n_block, batch, work, rows, kv=(load_args[-1], kv_state, state)
                    )
                    tile = self.fetch_tile(tiles_args, tile, step)
                ring = self.publish_tile(tiles_args, total, ring)  # the end, for the other warps
            if warp_idx == 1:
                gdQ_tma, sdQ, tma_dQ, mSemaphore, dq_first = store_args
                pending = Int32(-1)  # store_first: published across tiles
                tile, ring = self.take_tile(tiles_args, first - step, step, ring)
                while tile < total:
                    n_block, batch, work = self.tile_work(sched, tile, group, seqlen_q, seqlen_k, window_size)
                    pending = self.store_dq(
                        gdQ_tma,
                        sdQ,
                        tma_dQ,
                        mSemaphore,
                        n_block,
                        batch,
                        work,
                        rows,
                        seqlen_q,
                        seqlen_k,
                        None,
                        dq_first,
                        pending,
                    )
                    tile, ring = self.take_tile(tiles_args, tile, step, ring)
                if const_expr(self.store_first):
                    self.publish_stored(dq_first[0], pending, cute.arch.lane_idx(), 0)
            if warp_idx >= DKV_STORE_WARPS[0]:
                # each tile's dK / dV from the K / V buffer the consumers staged them in, while
                # the consumers go on with the next tile; then the buffer is free for the producer
                pipe_kv = load_args[-1]
                sK, sV = load_args[8], load_args[9]
                mdK, mdV, _ = mma_args[6]
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.kv_buffers)
                store_threads = t.dkv_store_threads
                store_tidx = tidx - 32 * DKV_STORE_WARPS[0]
                done = Int32(0)  # carry_dq: the steps of the tiles before (dK's dS buffer)
                tile, ring = self.take_tile(tiles_args, first - step, step, ring)
                zeroing = warp_idx - DKV_STORE_WARPS[0]  # zero_ahead: this warp's share of the owned blocks
                if const_expr(self.zero_ahead):
                    cute.arch.griddepcontrol_wait()  # (the flags' zeroing is before the preprocess)
                    if const_expr(self.dynamic_tiles):
                        # causal: every block at the start, from a counter of zeroing jobs (a CTA
                        # learns its next tile only near the end of the current one)
                        self.zero_jobs(store_args[4], tiles_args[2].iterator + 1, sched, group, seqlen_q)
                    else:
                        if tile < total:
                            self.zero_owned(store_args[4], sched, tile, group, seqlen_q, seqlen_k, zeroing)
                while tile < total:
                    if const_expr(self.zero_ahead and not self.dynamic_tiles):
                        # the CTA's next tile's blocks: the tiles that add there run a round later
                        if tile + step < total:
                            self.zero_owned(store_args[4], sched, tile + step, group, seqlen_q, seqlen_k, zeroing)
                    n_block, batch, work = self.tile_work(sched, tile, group, seqlen_q, seqlen_k, window_size)
                    head_kv = work[0]
                    b = kv_state.index
                    self.dkv_staged_barrier(b, False)
                    if const_expr(self.carry_dq):
                        # dK first: the consumers' next block writes its dS where dK is staged
                        done += work[1] * (work[3] - work[2])
                        self.store_staged_tile(
                            sdK_carry[None, None, done % t.ds_stages],
                            mdK,
                            store_tidx,
                            store_threads,
                            n_block,
                            head_kv,
                            batch,
                            Int32(0),
                            seqlen_k,
                        )
                        if tile + step < total:
                            named_barrier(NamedBarrier.DS_FREE, t.dkv_handoff_threads, True)
                        self.store_staged_tile(
                            sV[None, None, b],
                            mdV,
                            store_tidx,
                            store_threads,
                            n_block,
                            head_kv,
                            batch,
                            Int32(0),
                            seqlen_k,
                        )
                        # K stays until the consumers' product on it (the next tile's step 0) is done
                        named_barrier(NamedBarrier.K_FREE, t.dkv_handoff_threads, False)
                    else:
                        self.store_staged_dkv(
                            sK[None, None, b],
                            sV[None, None, b],
                            mdK,
                            mdV,
                            store_tidx,
                            store_threads,
                            n_block,
                            head_kv,
                            batch,
                            Int32(0),
                            seqlen_k,
                        )
                    pipe_kv.consumer_release(kv_state)
                    kv_state.advance()
                    tile, ring = self.take_tile(tiles_args, tile, step, ring)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS_PERSISTENT)
            sQ, sdO, sdS, sdQ, sLSE, sDelta, dkv_out, mma_sdp, mma_dkv, mma_dv, mma_dq, pipe_q, pipe_do, _ = mma_args
            pipe_kv = load_args[-1]
            sK, sV = load_args[8], load_args[9]
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.kv_buffers)
            done = Int32(0)  # carry_dq: the steps of the tiles before
            tile, ring = self.take_tile(tiles_args, first - step, step, ring)
            while tile < total:
                n_block, batch, work = self.tile_work(sched, tile, group, seqlen_q, seqlen_k, window_size)
                b = kv_state.index
                state, kv_state, done = self.mma(
                    sQ,
                    sdO,
                    sK[None, None, b],
                    sV[None, None, b],
                    sdS,
                    sdQ,
                    sLSE,
                    sDelta,
                    dkv_out,
                    mma_sdp,
                    mma_dkv,
                    mma_dv,
                    mma_dq,
                    pipe_q,
                    pipe_do,
                    None,
                    tidx - 128,
                    n_block,
                    batch,
                    work,
                    rows,
                    seqlen_q,
                    seqlen_k,
                    softmax_scale,
                    window_size,
                    None,
                    kv=(pipe_kv, kv_state, state),
                    carry=(done, sK, sdK_carry) if const_expr(self.carry_dq) else None,
                )
                tile, ring = self.take_tile(tiles_args, tile, step, ring)
            if const_expr(self.carry_dq):
                self.carried_dq_tail(sK, sdS, sdQ, mma_dq, tidx - 128, done, kv_state, first < total)

    @cute.jit
    def tile_work(self, sched, tile, group, seqlen_q, seqlen_k, window_size):
        """Persistent CTAs: (key block, batch, work) of tile ``tile``; work as ``kernel``'s:
        (key head, group, first and end query block)."""
        n_block, head_kv, batch = self.coords_of(sched, tile)
        return n_block, batch, self.work_of(n_block, head_kv, group, seqlen_q, seqlen_k, window_size)

    @cute.jit
    def work_of(self, n_block, head_kv, group, seqlen_q, seqlen_k, window_size):
        """(key head, group, first and end query block, rotation) of key block ``n_block``: its
        steps walk the group's query heads, each from query block first + rotation round to
        it (``work_item``; the rotation is 0 unless ``rotates``)."""
        m_min, m_max = self.mask.m_block_range(n_block, seqlen_q, seqlen_k, window_size)
        rot = Int32(0)
        if const_expr(self.rotates):
            rot = n_block * (m_max - m_min) // cute.ceil_div(seqlen_k, self.tiles.tile_n)
        return (head_kv, group, m_min, m_max, rot)

    @cute.jit
    def publish_tile(self, tiles_args, tile, ring):
        """``dynamic_tiles``: the producer warp hands ``tile`` to the other warps through the ring."""
        if const_expr(self.dynamic_tiles):
            pipe_tile, sTile, _ = tiles_args
            pipe_tile.producer_acquire(ring)
            with cute.arch.elect_one():
                sTile[ring.index] = tile
                pipe_tile.producer_commit(ring)
            ring.advance()
        return ring

    @cute.jit
    def fetch_tile(self, tiles_args, tile, step):
        """The producer warp's next tile: tile + step, or with ``dynamic_tiles`` the counter's next
        (the first ``step`` tiles are the CTAs' own)."""
        if const_expr(self.dynamic_tiles):
            taken = Int32(0)
            if cute.arch.lane_idx() == 0:
                taken = cute.arch.atomic_add(tiles_args[2].iterator, Int32(1), sem="relaxed", scope="gpu")
            tile = cute.arch.shuffle_sync(taken, 0) + step
        else:
            tile = tile + step
        return tile

    @cute.jit
    def take_tile(self, tiles_args, tile, step, ring):
        """Every other warp's next tile: tile + step, or with ``dynamic_tiles`` the ring's next."""
        if const_expr(self.dynamic_tiles):
            pipe_tile, sTile, _ = tiles_args
            pipe_tile.consumer_wait(ring)
            tile = sTile[ring.index]
            pipe_tile.consumer_release(ring)
            ring.advance()
        else:
            tile = tile + step
        return tile, ring

    @cute.jit
    def cta_coords(self, sched):
        """(key block, key head, batch) of this CTA. With ``lpt`` (causal masks) the 1-D grid
        is walked heavy-first: key block n sees the query blocks from its diagonal on, so
        block 0 carries the most work; all (batch, head) pairs of a chunk of
        ``heads_per_chunk`` take block 0, then block 1, ... (the light blocks fill the last
        wave instead of a head's block 0 starting late). The chunk keeps the Q / dO / dQ
        rows the running CTAs share within L2."""
        if const_expr(not self.lpt):
            return cute.arch.block_idx()
        cta, _, _ = cute.arch.block_idx()
        return self.coords_of(sched, cta)

    @cute.jit
    def coords_of(self, sched, cta):
        """(key block, key head, batch) of the CTA (or persistent tile) of linear index ``cta``:
        ``cta_coords``'s heavy-first order with ``lpt``, else the grid's (key blocks fastest)."""
        n_blocks, heads_kv, batches, heads_per_chunk = sched
        if const_expr(not self.lpt):
            bh = cta // n_blocks
            batch = bh // heads_kv
            return cta - bh * n_blocks, bh - batch * heads_kv, batch
        per_chunk = heads_per_chunk * n_blocks
        chunk = cta // per_chunk
        r = cta - chunk * per_chunk
        first = chunk * heads_per_chunk
        width = heads_kv * batches - first  # the last chunk may hold fewer heads
        if width > heads_per_chunk:
            width = heads_per_chunk
        n_block = r // width
        bh = first + r - n_block * width
        batch = bh // heads_kv
        return n_block, bh - batch * heads_kv, batch

    @cute.jit
    def seq_tile_view(self, g, head, batch, row0):
        """(rows, d) view of one head of one sequence: the batch index, or with varlen the
        packed rows from ``row0`` on (a TMA coordinate tensor or a global tensor alike)."""
        if const_expr(self.varlen):
            return cute.domain_offset((row0, 0), g[None, None, head, 0])
        return g[None, None, head, batch]

    @cute.jit
    def work_item(self, work, i):
        """(query head, query block) of the CTA's i-th step."""
        head_kv, group, m_min, m_max, rot = work
        g = i // (m_max - m_min)
        r = i - g * (m_max - m_min)
        if const_expr(self.rotates):
            r = r + rot
            if r >= m_max - m_min:
                r = r - (m_max - m_min)
        return head_kv * group + g, m_min + r

    @cute.jit
    def next_work_item(self, work, head, m_block):
        """The step after (head, m_block) in ``work_item``'s order, without its division (the
        consumers carry the pair from step to step: ~20 instructions a step less)."""
        _, _, m_min, m_max, rot = work
        m_block = m_block + 1
        if const_expr(self.rotates):
            if m_block == m_max:
                m_block = m_min
            if m_block == m_min + rot:  # round to where the head began
                head = head + 1
        else:
            if m_block == m_max:
                m_block = m_min
                head = head + 1
        return head, m_block

    # ---------------------------------------------------------------------------- producer
    @cute.jit
    def load(
        self,
        gQ_tma,
        gdO_tma,
        gK_tma,
        gV_tma,
        gLSE_tma,
        gDelta_tma,
        sQ,
        sdO,
        sK,
        sV,
        sLSE,
        sDelta,
        tma_Q,
        tma_dO,
        tma_K,
        tma_V,
        tma_LSE,
        tma_Delta,
        pipe_q,
        pipe_do,
        mbar_kv,
        n_block,
        batch,
        work,
        rows,
        kv=None,
    ):
        """K / V, then each step's Q / LSE and dO / Δ. ``kv``: persistent CTAs' (K / V pipeline,
        its state, the Q / dO pipelines' state), both states returned advanced past the tile."""
        t = self.tiles
        head_kv, group, m_min, m_max, _ = work
        offset_q, offset_k = rows
        one = cute.make_layout(1)
        gK = cute.local_tile(self.seq_tile_view(gK_tma, head_kv, batch, offset_k), (t.tile_n, t.head_dim), (n_block, 0))
        gV = cute.local_tile(
            self.seq_tile_view(gV_tma, head_kv, batch, offset_k), (t.tile_n, t.head_dim_v), (n_block, 0)
        )
        tKs, tKg = cpasync.tma_partition(tma_K, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_V, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        if const_expr(self.persistent):  # K / V also for a tile without steps (the consumers wait for it)
            pipe_kv, kv_state, q_state = kv
            pipe_kv.producer_acquire(kv_state)  # the dK / dV store warps freed it two tiles back
            bar = pipe_kv.producer_get_barrier(kv_state)
            cute.copy(tma_K, tKg, tKs[None, kv_state.index], tma_bar_ptr=bar)
            cute.copy(tma_V, tVg, tVs[None, kv_state.index], tma_bar_ptr=bar)
            kv_state.advance()
            cute.arch.griddepcontrol_wait()  # (the first tile's: the preprocess may still run)
            for i in cutlass.range(group * (m_max - m_min), unroll=1):
                head, m_block = self.work_item(work, i)
                self.load_step(
                    gQ_tma,
                    gdO_tma,
                    gLSE_tma,
                    gDelta_tma,
                    sQ,
                    sdO,
                    sLSE,
                    sDelta,
                    tma_Q,
                    tma_dO,
                    tma_LSE,
                    tma_Delta,
                    pipe_q,
                    pipe_do,
                    q_state,
                    head,
                    batch,
                    offset_q,
                    m_block,
                )
                q_state.advance()
            return q_state, kv_state
        if m_min < m_max:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar_kv, self.kv_bytes)
            cute.copy(tma_K, tKg, tKs, tma_bar_ptr=mbar_kv)
            cute.copy(tma_V, tVg, tVs, tma_bar_ptr=mbar_kv)
            # LSE and Δ come from the preprocess launch just before (PDL: it may still run)
            cute.arch.griddepcontrol_wait()
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.stages)
            for i in cutlass.range(group * (m_max - m_min), unroll=1):
                head, m_block = self.work_item(work, i)
                self.load_step(
                    gQ_tma,
                    gdO_tma,
                    gLSE_tma,
                    gDelta_tma,
                    sQ,
                    sdO,
                    sLSE,
                    sDelta,
                    tma_Q,
                    tma_dO,
                    tma_LSE,
                    tma_Delta,
                    pipe_q,
                    pipe_do,
                    state,
                    head,
                    batch,
                    offset_q,
                    m_block,
                )
                state.advance()

    @cute.jit
    def load_step(
        self,
        gQ_tma,
        gdO_tma,
        gLSE_tma,
        gDelta_tma,
        sQ,
        sdO,
        sLSE,
        sDelta,
        tma_Q,
        tma_dO,
        tma_LSE,
        tma_Delta,
        pipe_q,
        pipe_do,
        state,
        head,
        batch,
        offset_q,
        m_block,
    ):
        """One step's Q / LSE and dO / Δ (query block ``m_block`` of ``head``) into the stage of ``state``."""
        pipe_q.producer_acquire(state)
        bar = pipe_q.producer_get_barrier(state)
        self.tma_load_block(tma_Q, gQ_tma, sQ, head, batch, offset_q, m_block, state.index, bar)
        self.tma_load_block(tma_LSE, gLSE_tma, sLSE, head, batch, offset_q, m_block, state.index, bar)
        pipe_do.producer_acquire(state)
        bar = pipe_do.producer_get_barrier(state)
        self.tma_load_block(tma_dO, gdO_tma, sdO, head, batch, offset_q, m_block, state.index, bar)
        self.tma_load_block(tma_Delta, gDelta_tma, sDelta, head, batch, offset_q, m_block, state.index, bar)

    @cute.jit
    def tma_load_block(self, atom, g_tma, s, head, batch, offset_q, m_block, stage, bar):
        """Query block ``m_block`` of ``head`` (rows x head dim, or a statistic's rows) into stage
        ``stage``. Statistics are [sequences, H, rows] also with varlen (no packed offset)."""
        t = self.tiles
        if const_expr(cute.rank(s) == 3):  # (rows, d, stages): Q's d is Dqk, dO's Dv
            tile = (t.tile_m, cute.size(s, mode=[1]))
            g = cute.local_tile(self.seq_tile_view(g_tma, head, batch, offset_q), tile, (m_block, 0))
            ts, tg = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
            )
        else:  # (rows, stages)
            g = cute.local_tile(g_tma[None, head, batch], (t.tile_m,), (m_block,))
            ts, tg = cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 1), cute.group_modes(g, 0, 1)
            )
        cute.copy(atom, tg, ts[None, stage], tma_bar_ptr=bar)

    @cute.jit
    def store_dq(
        self,
        gdQ_tma,
        sdQ,
        tma_dQ,
        mSemaphore,
        n_block,
        batch,
        work,
        rows,
        seqlen_q,
        seqlen_k,
        mDqReady=None,
        dq_first=(None, None),
        pending=None,
    ):
        """Add each query block's dQ (staged in sdQ by the consumers) into the fp32 accumulator
        (``store_first``: store it where this CTA claimed the block); with ``dq_ready`` then
        count the key block into its (sequence, key head)'s counter. ``pending`` (persistent
        CTAs, store_first): the last stored block's flag of the tile before, published here;
        this tile's is returned unpublished (the next tile's first handoff publishes it)."""
        t = self.tiles
        head_kv, group, m_min, m_max, _ = work
        # varlen: sequence b's accumulator rows start VARLEN_ACCUM_PAD * b rows further down
        acc_row0 = rows[0] + batch * VARLEN_ACCUM_PAD if const_expr(self.varlen) else rows[0]
        handoff = t.dq_handoff_threads
        am, an = t.dq_atoms
        sub = t.dq_sub_tile
        lane = cute.arch.lane_idx()
        mDqFirst, tma_dQ_store = dq_first[0], dq_first[1]
        # store_first: the flag of the block this CTA stored last, published once the next
        # block's copies are issued (its store has landed by then: no wait on the handoff's path)
        groups = 2 if const_expr(t.dq_per_wg) else 1  # bulk groups a block
        carried = pending is not None
        if const_expr(not carried):
            pending = Int32(-1)
        # the preprocess launch has zeroed the accumulator, or the store_first flags (PDL)
        cute.arch.griddepcontrol_wait()
        seen = Int32(0)  # zero_ahead: the blocks of the current 32-block window seen zeroed
        for i in cutlass.range(group * (m_max - m_min), unroll=1):
            head, m_block = self.work_item(work, i)
            sem = None
            if const_expr(self.deterministic):
                sem = mSemaphore.iterator + cute.crd2idx((m_block, head, batch), mSemaphore.layout)
            flag = Int32(0)
            claim = Int32(0)  # store_first: the flag's value before this CTA's claim (0: stored here)
            if const_expr(self.store_first):
                flag = Int32(cute.crd2idx((m_block, head, batch), mDqFirst.layout))
            if const_expr(t.dq_per_wg):
                # each warpgroup's part of a block's dQ is its own reduce-add and handoff
                gdQ = cute.local_tile(
                    self.seq_tile_view(gdQ_tma, head, batch, acc_row0), sub, (None, None)
                )  # (rows, cols, m, n)
                if const_expr(t.dq_empty_early):
                    # both buffers free before waiting for either: a warpgroup never waits for
                    # the other's handoff (the reduce-add of w's buffer dq_stages blocks back
                    # was committed 2 dq_stages - 1 - w groups ago)
                    for w in cutlass.range_constexpr(2):
                        cute.arch.cp_async_bulk_wait_group(2 * t.dq_stages - 1 - w, read=True)
                        cute.arch.barrier_arrive(
                            barrier_id=NamedBarrier.DQ_EMPTY if w == 0 else NamedBarrier.DQ_EMPTY_WG1,
                            number_of_threads=handoff,
                        )
                    if const_expr(self.store_first):
                        claim = self.claim_block(mDqFirst.iterator + flag, lane)
                    seen = self.wait_zeroed(dq_first, work, batch, i, seen, lane)
                for w in cutlass.range_constexpr(2):
                    wm, wn = (w, 0) if am == 2 else (0, w)
                    sdQ_w = cute.local_tile(sdQ[None, None, i % t.dq_stages], sub, (wm, wn))
                    tdQs, tdQg = cpasync.tma_partition(
                        tma_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ_w, 0, 2), cute.group_modes(gdQ, 0, 2)
                    )
                    if const_expr(not t.dq_empty_early):
                        # this part's reduce-add dq_stages blocks back has read it (two groups a block)
                        cute.arch.cp_async_bulk_wait_group(2 * t.dq_stages - 1, read=True)
                        cute.arch.barrier_arrive(
                            barrier_id=NamedBarrier.DQ_EMPTY if w == 0 else NamedBarrier.DQ_EMPTY_WG1,
                            number_of_threads=handoff,
                        )
                        if const_expr(self.store_first and w == 0):
                            claim = self.claim_block(mDqFirst.iterator + flag, lane)
                        if const_expr(w == 0):
                            seen = self.wait_zeroed(dq_first, work, batch, i, seen, lane)
                    cute.arch.barrier(
                        barrier_id=NamedBarrier.DQ_FULL if w == 0 else NamedBarrier.DQ_FULL_WG1,
                        number_of_threads=handoff,
                    )
                    if const_expr(self.deterministic and w == 0):
                        self.spin_until(sem, self.dq_turn(m_block, n_block, seqlen_q, seqlen_k), lane)
                    if const_expr(self.store_first and w == 0):
                        claim, pending = self.wait_stored(mDqFirst, flag, claim, pending, lane)
                    self.copy_dq(tma_dQ, tma_dQ_store, tdQs, tdQg[None, m_block * am + wm, wn], claim)
                    cute.arch.cp_async_bulk_commit_group()
            else:
                gdQ = cute.local_tile(
                    self.seq_tile_view(gdQ_tma, head, batch, acc_row0), (t.tile_m, t.head_dim), (m_block, 0)
                )
                tdQs, tdQg = cpasync.tma_partition(
                    tma_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2), cute.group_modes(gdQ, 0, 2)
                )
                # the buffer of this block is free once the reduce-add dq_stages blocks back has read it
                cute.arch.cp_async_bulk_wait_group(t.dq_stages - 1, read=True)
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.DQ_EMPTY, number_of_threads=handoff)
                if const_expr(self.store_first):
                    claim = self.claim_block(mDqFirst.iterator + flag, lane)
                seen = self.wait_zeroed(dq_first, work, batch, i, seen, lane)
                cute.arch.barrier(barrier_id=NamedBarrier.DQ_FULL, number_of_threads=handoff)
                if const_expr(self.deterministic):
                    self.spin_until(sem, self.dq_turn(m_block, n_block, seqlen_q, seqlen_k), lane)
                if const_expr(self.store_first):
                    claim, pending = self.wait_stored(mDqFirst, flag, claim, pending, lane)
                self.copy_dq(tma_dQ, tma_dQ_store, tdQs[None, i % t.dq_stages], tdQg, claim)
                cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.store_first):
                # the block stored a step back: its store is older than this block's groups
                pending = self.publish_stored(mDqFirst, pending, lane, groups)
                if claim == 0:
                    pending = flag
            if const_expr(self.deterministic):
                # the adds are done (written, not only read) before the next key block's turn
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                if lane == 0:
                    cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")
        if const_expr(self.store_first and not carried):
            pending = self.publish_stored(mDqFirst, pending, lane, 0)
        if const_expr(self.dq_ready):
            cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds written, not only read
            self.count_dq_ready(mDqReady, Int32(cute.crd2idx((batch, head_kv), mDqReady.layout)), lane)
        else:
            # sdQ read before the CTA leaves; the adds themselves are complete with the grid
            # (the next kernel, convert_dq, is stream-ordered behind it), as after a TMA store
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        return pending

    @cute.jit
    def wait_zeroed(self, dq_first, work, batch, i, seen, lane):
        """zero_ahead, before the copies of a tile's block ``i``: returns ``seen``, a bit per block
        of i's 32-block window whose flag read zeroed (2). Each window is read once, at its first
        block, without waiting; a block not seen then is looked at again only when its copy is
        due (its owner may run a little behind: waiting for every block at the tile's start held
        up the first one behind the latest owner). A block still untouched then (0: its owner's
        CTA may not even be resident, e.g. beside another kernel or under MPS) is zeroed here
        (``zero_block`` claims it first); one being zeroed (1) is waited for, its zeroing warp is
        running. The zeros (generic stores) and the reduce-adds (async proxy) are fenced on both
        sides: the zeroing warp before its release, this warp after its acquire (measured: the
        same speed with the writers' fence alone). Placed where claim_block is: after the staging
        buffer's handback."""
        if const_expr(self.zero_ahead):
            mFlags = dq_first[0]
            w = cyclic(i, 32)
            if w == 0:
                j = i + lane
                ok = Int32(1)
                if j < work[1] * (work[3] - work[2]):
                    ok = Int32(
                        cute.arch.load(self.zero_flag(mFlags, work, batch, j), Int32, sem="acquire", scope="gpu") == 2
                    )
                seen = cute.arch.vote_ballot_sync(ok != 0)
                cute.arch.fence_proxy("async.global")
            if (seen >> w) & 1 == 0:
                head, m_block = self.work_item(work, i)
                if not self.zero_block(dq_first, head, batch, m_block, lane):
                    self.spin_until(self.zero_flag(mFlags, work, batch, i), Int32(2), lane)
                cute.arch.fence_proxy("async.global")
        return seen

    @cute.jit
    def zero_flag(self, mFlags, work, batch, j):
        """zero_ahead: the flag of the tile's j-th block (``work_item``'s order, no rotation)."""
        head_kv, group, m_min, m_max, _ = work
        blocks = m_max - m_min
        g = j // blocks
        m = m_min + j - g * blocks
        return mFlags.iterator + cute.crd2idx((m, head_kv * group + g, batch), mFlags.layout)

    @cute.jit
    def owned_blocks(self, n_block, seqlen_q, seqlen_k):
        """zero_ahead without a mask: the query blocks key block ``n_block`` zeroes, [lo, hi) (of
        every query head of its group): the key blocks split a head's query blocks into
        contiguous shares, each block owned once (none where there are more key blocks than
        query blocks)."""
        t = self.tiles
        m_blocks = cute.ceil_div(seqlen_q, t.tile_m)
        n_blocks = cute.ceil_div(seqlen_k, t.tile_n)
        lo = (n_block * m_blocks + n_blocks - 1) // n_blocks
        hi = ((n_block + 1) * m_blocks + n_blocks - 1) // n_blocks
        return lo, hi

    @cute.jit
    def zero_jobs(self, dq_first, counter, sched, group, seqlen_q):
        """Causal zero_ahead (tiles from the counter): the zeroing warps of every CTA take query
        blocks from a second counter, in the order the heavy-first walk reaches their heads
        ((batch, key head) pairs, their query heads, blocks ascending), and zero them at the
        kernel's start, until none is left; the dQ-store warps zero a block nobody has reached
        yet themselves (``wait_zeroed``)."""
        t = self.tiles
        _, heads_kv, batches, _ = sched
        m_blocks = cute.ceil_div(seqlen_q, t.tile_m)
        per_pair = group * m_blocks
        total = batches * heads_kv * per_pair
        lane = cute.arch.lane_idx()
        j = self.take_job(counter, lane)
        while j < total:
            pair = j // per_pair
            r = j - pair * per_pair
            g = r // m_blocks
            batch = pair // heads_kv
            self.zero_block(dq_first, (pair - batch * heads_kv) * group + g, batch, r - g * m_blocks, lane)
            j = self.take_job(counter, lane)

    @cute.jit
    def take_job(self, counter, lane):
        """Causal zero_ahead: the next zeroing job (a query block's index) for this warp."""
        taken = Int32(0)
        if lane == 0:
            taken = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
        return cute.arch.shuffle_sync(taken, 0)

    @cute.jit
    def zero_owned(self, dq_first, sched, tile, group, seqlen_q, seqlen_k, part):
        """zero_ahead: zero the accumulator blocks tile ``tile`` owns, the two zeroing warps taking
        every other one (``part``); a block someone else claimed is skipped."""
        n_block, head_kv, batch = self.coords_of(sched, tile)
        lo, hi = self.owned_blocks(n_block, seqlen_q, seqlen_k)
        lane = cute.arch.lane_idx()
        for k in cutlass.range(part, group * (hi - lo), len(DKV_STORE_WARPS), unroll=1):
            g = k // (hi - lo)
            self.zero_block(dq_first, head_kv * group + g, batch, lo + k - g * (hi - lo), lane)

    @cute.jit
    def zero_block(self, dq_first, head, batch, m_block, lane):
        """zero_ahead: claim query block ``m_block`` of ``head`` (its flag 0 -> 1, compare-and-swap)
        and, if this warp got it, zero its accumulator rows by 16-byte stores, fence them for the
        async proxy and publish it (release 2: the warp's barrier orders its lanes' stores before
        lane 0's release). Returns whether this warp zeroed it."""
        t = self.tiles
        mFlags, mAcc = dq_first[0], dq_first[2]
        flag = mFlags.iterator + cute.crd2idx((m_block, head, batch), mFlags.layout)
        old = Int32(0)
        if lane == 0:
            old = cute.arch.atomic_cas(flag, cmp=Int32(0), val=Int32(1), sem="relaxed", scope="gpu")
        mine = cute.arch.shuffle_sync(old, 0) == 0
        if mine:
            zero_copy = t.dq_accum_zero_copy()
            tG = zero_copy.get_slice(lane).partition_D(
                cute.local_tile(mAcc[None, None, head, batch], (t.tile_m, t.head_dim), (m_block, 0))
            )
            zeros = cute.make_fragment_like(tG[None, 0, None])
            zeros.fill(0.0)
            for r in cutlass.range(cute.size(tG, mode=[1]), unroll=1):
                cute.copy(zero_copy, zeros, tG[None, r, None])
            # the zeros (generic proxy) ordered before the reduce-adds (async proxy) that the flag
            # releases, as threads fence their shared-memory writes before a TMA store
            cute.arch.fence_proxy("async.global")
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.store(flag, Int32(2), sem="release", scope="gpu")
            cute.arch.sync_warp()
        return mine

    @cute.jit
    def claim_block(self, flag, lane):
        """store_first: the block's flag before this CTA's compare-and-swap 0 -> 1, in lane 0
        (0: this CTA stores the block's first dQ; 1: another CTA is storing it; 2: stored, add).
        Issued once the staging buffer is handed back (a barrier arrive waits for the lane's
        memory operations before it: ahead of it the round trip held up the consumers, H100
        8x16x1024x64 -9%); the barrier for the staged dQ waits for it. ``wait_stored`` hands
        the result to the warp."""
        old = Int32(0)
        if lane == 0:
            # acquire: where the block is already stored (2), the adds come after that store
            old = cute.arch.atomic_cas(flag, cmp=Int32(0), val=Int32(1), sem="acquire", scope="gpu")
        return old

    @cute.jit
    def publish_stored(self, mDqFirst, pending, lane, newer: cutlass.Constexpr):
        """store_first: mark the block of flag index ``pending`` (-1: none) stored once its
        stores are written, all bulk groups but the ``newer`` last ones (a release after the async
        proxy's writes, as count_dq_ready); returns -1."""
        if pending >= 0:
            cute.arch.cp_async_bulk_wait_group(newer, read=False)
            cute.arch.fence_proxy("async.global")
            if lane == 0:
                cute.arch.store(mDqFirst.iterator + pending, Int32(2), sem="release", scope="gpu")
            cute.arch.sync_warp()
        return Int32(-1)

    @cute.jit
    def wait_stored(self, mDqFirst, flag, old, pending, lane):
        """store_first, before a block's copies: (the claim's result for the warp, ``pending``).
        Where another CTA claimed the block (1), this CTA's own stored block is published first
        (so no two CTAs wait for each other), then the claimer's store is waited for: a claimer
        publishes without waiting for any other CTA. The acquire orders the reduce-add after
        the store, as deterministic mode's turns do."""
        claim = cute.arch.shuffle_sync(old, 0)
        if claim == 1:
            pending = self.publish_stored(mDqFirst, pending, lane, 0)
            self.spin_until(mDqFirst.iterator + flag, Int32(2), lane)
        return claim, pending

    @cute.jit
    def copy_dq(self, tma_dQ, tma_dQ_store, src, dst, claim):
        """A block's dQ (part) into the accumulator: added, or stored where ``claim`` is 0
        (store_first, this CTA claimed the block)."""
        if const_expr(self.store_first):
            if claim == 0:
                cute.copy(tma_dQ_store, src, dst)
            else:
                cute.copy(tma_dQ, src, dst)
        else:
            cute.copy(tma_dQ, src, dst)

    @cute.jit
    def count_dq_ready(self, mDqReady, index, lane):
        """dq_ready: count a key block whose dQ adds are written (the caller waited for them)
        into entry ``index`` of mDqReady, with release semantics."""
        cute.arch.fence_proxy("async.global")  # the async proxy's adds, then the generic release
        if lane == 0:
            # release, not relaxed: the bulk adds' completion alone does not make them visible
            # to other CTAs (H100, a relaxed count let convert read partial sums: 6.5e-2 error)
            cute.arch.atomic_add(mDqReady.iterator + index, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def spin_until(self, ptr, value, lane):
        """Lane 0 polls the int32 at ``ptr`` (acquire, gpu scope) until it reads ``value``, then
        the warp goes on: deterministic mode's turns (``value`` key blocks have added into the
        query block), a store_first block stored, a zero_ahead block zeroed (2)."""
        if lane == 0:
            while cute.arch.load(ptr, Int32, sem="acquire", scope="gpu") != value:
                cute.arch.inline_ptx("nanosleep.u32 20;")
        cute.arch.sync_warp()

    @cute.jit
    def dq_turn(self, m_block, n_block, seqlen_q, seqlen_k):
        """Deterministic mode: how many key blocks add into query block ``m_block`` before
        key block ``n_block``. Without a mask every key block sees every query block and
        they go in ascending order, the order CTAs are launched (a CTA never waits for one
        not yet resident behind it). With a causal mask key block n starts at the diagonal,
        so the last key block that sees a query block reaches it first: descending order.
        The key blocks that see a query block are consecutive (a window cuts the low end)."""
        t = self.tiles
        turn = n_block
        if const_expr(self.mask_type != 0):
            n_last = cute.ceil_div(seqlen_k, t.tile_n) - 1
            # the block's last query sees keys up to here (>= 0 for a block some key block sees)
            reach = (m_block + 1) * t.tile_m - 1 + self.mask.causal_offset(seqlen_q, seqlen_k)
            if reach // t.tile_n < n_last:
                n_last = reach // t.tile_n
            turn = n_last - n_block
        return turn

    # --------------------------------------------------------------------------- consumers
    @cute.jit
    def mma(
        self,
        sQ,
        sdO,
        sK,
        sV,
        sdS,
        sdQ,
        sLSE,
        sDelta,
        dkv_out,
        tiled_mma_sdp,
        tiled_mma_dkv,
        tiled_mma_dv,
        tiled_mma_dq,
        pipe_q,
        pipe_do,
        mbar_kv,
        tidx,
        n_block,
        batch,
        work,
        rows,
        seqlen_q,
        seqlen_k,
        softmax_scale,
        window_size,
        feat,
        kv=None,
        carry=None,
    ):
        """The consumers' steps of one tile, then its dK / dV. ``kv``: persistent CTAs' (K / V
        pipeline, its state, the Q / dO pipelines' state), both returned advanced past the tile
        with the steps done so far; sK / sV are then the tile's buffer. ``carry`` (carry_dq):
        (the steps of the CTA's tiles before, both K buffers, dK's staging view over the dS
        buffers): step 0 computes the previous tile's last dQ on its K, dS buffers and named
        barriers alternate with the CTA's step count, and dK is staged in a dS buffer."""
        t = self.tiles
        head_kv, group, m_min, m_max, _ = work
        steps = group * (m_max - m_min)
        wg = cute.arch.make_warp_uniform(tidx // 128)
        scale_log2 = softmax_scale * LOG2_E

        # S^T = K Q^T, dP^T = V dO^T (this warpgroup's 64 keys); dV += P^T dO, dK += dS^T Q (B operands
        # the transposed views of dO / Q); dQ = dS K; registers -> shared: dS^T into sdS, dQ into sdQ
        done = Int32(0)
        sK_both = None
        if const_expr(carry is not None):
            done, sK_both, sdK_both = carry
        full_ops = self.step_operands(
            tiled_mma_sdp,
            tiled_mma_dq,
            tiled_mma_dkv,
            tiled_mma_dv,
            tidx,
            wg,
            sQ,
            sdO,
            sK,
            sV,
            sdS,
            sdQ,
            sK_both=sK_both,
        )
        acc_dV, acc_dK = self.dkv_accumulators(tiled_mma_dkv, tiled_mma_dv, tidx)
        tSrK, tSrQ, tPrV, tPrdO, acc_S, acc_dP = (
            full_ops.tSrK,
            full_ops.tSrQ,
            full_ops.tPrV,
            full_ops.tPrdO,
            full_ops.acc_S,
            full_ops.acc_dP,
        )

        offset = self.mask.causal_offset(seqlen_q, seqlen_k)
        key0 = n_block * t.tile_n
        if const_expr(self.persistent):
            pipe_kv, kv_state, state = kv
            state_next = state  # (no overlap with dq_defer)
        else:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
            state_next = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        # overlap "none": S^T is issued at the top of each step. "s" / "sdp" issue the next
        # step's S^T (and dP^T) behind this step's dK; ptxas does not follow wgmma groups
        # across the loop's back edge and serialises every wgmma of the kernel (warnings
        # C7514 / C7515; also when the issue is made unconditional with a repeated last Q
        # block). Measured: d128 gains 16% without it, d64 loses 4% (docs/attention_sm90.md).
        prefetch = const_expr(t.overlap != "none")
        if const_expr(self.persistent):
            pipe_kv.consumer_wait(kv_state)  # also for a tile without steps (dK / dV zeros)
        elif m_min < m_max:
            cute.arch.mbarrier_wait(mbar_kv, 0)
            if const_expr(prefetch):
                self.issue_s(pipe_q, state_next, tiled_mma_sdp, acc_S, tSrK, tSrQ)
                if const_expr(t.overlap == "sdp"):
                    self.issue_dp(pipe_do, state_next, tiled_mma_sdp, acc_dP, tPrV, tPrdO)
                state_next.advance()
        env = StepEnv(
            pipe_q=pipe_q,
            pipe_do=pipe_do,
            state_next=state_next,
            sLSE=sLSE,
            sDelta=sDelta,
            sdS=sdS,
            feat=feat,
            tiled_mma_dkv=tiled_mma_dkv,
            tiled_mma_dv=tiled_mma_dv,
            acc_dV=acc_dV,
            acc_dK=acc_dK,
            wg=wg,
            tidx=tidx,
            n_block=n_block,
            key0=key0,
            offset=offset,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            window_size=window_size,
            scale_log2=scale_log2,
            steps=steps,
            carry=carry,
            kv_state=kv_state if const_expr(self.persistent) else None,
            done=done,
        )
        # the loop stays outside that if (it runs 0 steps without work): nested in it, ptxas
        # spilled 384 bytes in d64 and the kernel ran ~10% slower (docs/attention_sm90.md)
        head, m_block = self.work_item(work, 0)
        # carry_dq counts the CTA's steps (dS buffers and barriers alternate with it)
        first_step = done if const_expr(carry is not None) else 0
        if const_expr(self.tail_m > 0):
            # the partial last query block on products tail_m queries wide, its step peeled out of
            # the loops of whole blocks (one loop taking either kind of step made ptxas rebuild the
            # whole blocks' wgmma descriptors every step: ~40 instructions a step more)
            self.steps_with_tail(
                full_ops,
                env,
                work,
                state,
                head,
                m_block,
                seqlen_q,
                (tidx, wg, sQ, sdO, sK, sV, sdS, sdQ, tiled_mma_dkv, tiled_mma_dv),
            )
        else:
            for i in cutlass.range(first_step, first_step + steps, unroll=1):
                self.block_step(full_ops, env, i, state, head, m_block)
                state.advance()
                head, m_block = self.next_work_item(work, head, m_block)

        if const_expr(t.dq_defer and carry is None):
            # the last block's dQ (computed without a block, and not staged, when there is none)
            last = steps - 1
            if steps > 0:
                self.ds_half_barrier(1 - wg, last, False)
            acc_dQ = self.issue_dq(
                tiled_mma_dq, full_ops.shape_dq, full_ops.tQrdS, full_ops.tQrK, (last + t.ds_stages) % t.ds_stages
            )
            warpgroup.wait_group(0)
            if steps > 0:
                self.stage_dq(acc_dQ, full_ops.r2s_dq, full_ops.thr_r2s_dq, full_ops.tdQs, last % t.dq_stages, wg)
        if const_expr(self.persistent):
            # dK / dV staged in this tile's K / V buffer for the store warps, which free it
            acc_dK.store(acc_dK.load() * softmax_scale)
            if const_expr(carry is not None):
                # K stays for the next step 0: dK goes to the dS buffer the last block left free
                done += steps
                self.stage_dkv(
                    acc_dK, acc_dV, sdK_both[None, None, done % t.ds_stages], sV, tiled_mma_dkv, tiled_mma_dv, tidx
                )
            else:
                self.stage_dkv(acc_dK, acc_dV, sK, sV, tiled_mma_dkv, tiled_mma_dv, tidx)
            self.dkv_staged_barrier(kv_state.index, True)
            kv_state.advance()
            return state, kv_state, done
        self.epilogue(
            acc_dK,
            acc_dV,
            dkv_out,
            sK,
            sV,
            tiled_mma_dkv,
            tiled_mma_dv,
            tidx,
            n_block,
            head_kv,
            batch,
            rows,
            seqlen_k,
            softmax_scale,
        )

    @cute.jit
    def steps_with_tail(self, full_ops, env, work, state, head, m_block, seqlen_q, tail_args):
        """``mma``'s steps with ``tail_m``: each query head's walk (``work_item``'s order: from
        its rotation round) as the whole blocks before the partial one, the partial block on
        ``tail_operands``, the whole blocks after it. A key block whose query blocks stop
        short of the partial one (a window) walks whole blocks only."""
        t = self.tiles
        _, group, m_min, m_max, rot = work
        blocks = m_max - m_min
        m_tail = seqlen_q // t.tile_m  # the partial block (the caller's tail_m says there is one)
        before = blocks
        after = Int32(0)
        if m_min <= m_tail and m_tail < m_max:
            before = m_tail - m_min
            if const_expr(self.rotates):
                before = before - rot
                if before < 0:
                    before = before + blocks
            after = blocks - before - 1
        i = Int32(0)
        # (one loop of whole blocks run twice a head, before and after the partial block: with a
        # second copy of it ptxas built that copy's wgmma descriptors less well, +17 instructions a step)
        for _g in cutlass.range(group, unroll=1):
            for part in cutlass.range(2, unroll=1):
                run = cutlass.select_(part == 0, before, after)
                for _b in cutlass.range(run, unroll=1):
                    self.block_step(full_ops, env, i, state, head, m_block)
                    state.advance()
                    head, m_block = self.next_work_item(work, head, m_block)
                    i = i + 1
                if part == 0 and before < blocks:
                    self.block_step(self.tail_operands(*tail_args), env, i, state, head, m_block)
                    state.advance()
                    head, m_block = self.next_work_item(work, head, m_block)
                    i = i + 1

    @cute.jit
    def block_step(self, ops, env, i, state, head, m_block):
        """The consumers' step ``i``: query block ``m_block`` of query head ``head`` (Q / dO in
        pipeline ``state``). ``ops``: ``StepOperands`` of a whole block, or ``tail_operands``'
        for a partial last block; ``env``: ``StepEnv``, what every step shares (both unpacked in
        their fields' order)."""
        t = self.tiles
        (
            tiled_mma_sdp,
            acc_S,
            acc_dP,
            tSrK,
            tSrQ,
            tPrV,
            tPrdO,
            shape_sdp,
            cS_mn,
            tVrdO,
            tKrQ,
            tiled_mma_dq,
            tQrdS,
            tQrK,
            tQrK_both,
            shape_dq,
            r2s_ds,
            thr_r2s_ds,
            tdSs,
            r2s_dq,
            thr_r2s_dq,
            tdQs,
        ) = ops
        (
            pipe_q,
            pipe_do,
            state_next,
            sLSE,
            sDelta,
            sdS,
            feat,
            tiled_mma_dkv,
            tiled_mma_dv,
            acc_dV,
            acc_dK,
            wg,
            tidx,
            n_block,
            key0,
            offset,
            seqlen_q,
            seqlen_k,
            window_size,
            scale_log2,
            steps,
            carry,
            kv_state,
            done,
        ) = env
        prefetch = const_expr(t.overlap != "none")
        stage = state.index
        ds_stage = i % t.ds_stages
        q0 = m_block * t.tile_m
        if const_expr(not prefetch):
            self.issue_s(pipe_q, state, tiled_mma_sdp, acc_S, tSrK, tSrQ)
        lse = self.read_stats(sLSE, stage, cS_mn) if const_expr(t.stats_early) else None
        # S^T (and with overlap "sdp" dP^T) of this block are in flight already
        if const_expr(t.overlap != "sdp"):
            self.issue_dp(pipe_do, state, tiled_mma_sdp, acc_dP, tPrV, tPrdO)
        # bias values and dropout flags while the tensor cores work (None without)
        rBias, keep = self.block_features(feat, head, i, q0, key0, seqlen_q, seqlen_k, cS_mn, shape_sdp, wg, tidx)

        warpgroup.wait_group(1)
        self.probs(acc_S, cS_mn, sLSE, stage, q0, key0, seqlen_q, seqlen_k, offset, window_size, scale_log2, rBias, lse)
        delta = self.read_stats(sDelta, stage, cS_mn) if const_expr(t.stats_early) else None
        warpgroup.wait_group(0)
        self.grad_scores(acc_dP, acc_S, cS_mn, sDelta, stage, keep, feat, delta)
        # (converted before the dP^T wait instead, ptxas sinks it below the wait: same SASS)
        rP = self.p_operand(acc_S, cS_mn, keep, feat)

        # dV += P^T dO (P^T from registers); dS^T -> sdS; once both warpgroups' halves are
        # there (and visible to the async proxy): dQ = dS K, then dK += dS^T Q, so dQ can
        # leave while dK runs. With dq_defer the dQ is the previous block's (deferred_step)
        rdS = cute.make_rmem_tensor(shape_sdp, self.dtype)
        if const_expr(t.dq_defer):
            rdS.store(acc_dP.load().to(self.dtype))
        else:
            if const_expr(t.ds_before_dv):
                rdS.store(acc_dP.load().to(self.dtype))
                cute.copy(r2s_ds, thr_r2s_ds.retile(rdS), tdSs[None, None, None, ds_stage])
            wgmma(
                tiled_mma_dv,
                acc_dV,
                cute.make_tensor(rP.iterator, acc_as_operand_a(rP.layout)),
                tVrdO[None, None, None, stage],
                zero_init=False,
            )
            if const_expr(not t.ds_before_dv):
                rdS.store(acc_dP.load().to(self.dtype))
                cute.copy(r2s_ds, thr_r2s_ds.retile(rdS), tdSs[None, None, None, ds_stage])
            cute.arch.fence_view_async_shared()
        dbias = (feat, sdS, head, m_block, n_block)  # the bias gradient's stores (grad_bias)
        if const_expr(t.dq_defer):
            carry_in = None
            tQrK_step = tQrK
            if const_expr(carry is not None):
                # step 0's product is the previous tile's last block, on that tile's K
                kb = kv_state.index
                tQrK_step = tQrK_both[None, None, None, cutlass.select_(i > done, kb, 1 - kb)]
                carry_in = (i, done)
            self.deferred_step(
                i,
                wg,
                stage,
                tiled_mma_dq,
                tiled_mma_dv,
                tiled_mma_dkv,
                acc_dV,
                acc_dK,
                rP,
                rdS,
                tVrdO,
                tKrQ,
                tQrdS,
                tQrK_step,
                shape_dq,
                r2s_ds,
                thr_r2s_ds,
                tdSs,
                r2s_dq,
                thr_r2s_dq,
                tdQs,
                carry_in,
            )
            pipe_do.consumer_release(state)
            pipe_q.consumer_release(state)
        elif const_expr(t.pds_split):
            acc_dQ = self.dq_dk_split(
                wg, stage, ds_stage, tiled_mma_dq, tiled_mma_dkv, acc_dK, rdS, tKrQ, tQrdS, tQrK, shape_dq, tidx, dbias
            )
            pipe_do.consumer_release(state)
            pipe_q.consumer_release(state)
            if const_expr(prefetch):
                if i + 1 < steps:
                    self.issue_s(pipe_q, state_next, tiled_mma_sdp, acc_S, tSrK, tSrQ)
                    state_next.advance()
            self.stage_dq(acc_dQ, r2s_dq, thr_r2s_dq, tdQs, i % t.dq_stages, wg)
        else:
            self.grad_bias_wait(tidx == 0)
            cute.arch.barrier(barrier_id=NamedBarrier.PDS, number_of_threads=t.num_mma_threads)
            if const_expr(self.grad_bias):
                if tidx == 0:  # both halves are written
                    self.store_grad_bias(
                        feat, sdS, ds_stage, list(range(t.tile_n // GRAD_BIAS_BOX_KEYS)), head, m_block, n_block
                    )
            acc_dQ = self.issue_dq(tiled_mma_dq, shape_dq, tQrdS, tQrK, ds_stage)
            wgmma(
                tiled_mma_dkv,
                acc_dK,
                cute.make_tensor(rdS.iterator, acc_as_operand_a(rdS.layout)),
                tKrQ[None, None, None, stage],
                zero_init=False,
            )
            warpgroup.wait_group(1)  # dV and dQ done
            pipe_do.consumer_release(state)

            # dQ -> sdQ for the store warp's reduce-add, while dK runs
            self.stage_dq(acc_dQ, r2s_dq, thr_r2s_dq, tdQs, i % t.dq_stages, wg)
            # the next block's S^T (and dP^T) go to the tensor cores behind dK
            if const_expr(prefetch):
                if i + 1 < steps:
                    self.issue_s(pipe_q, state_next, tiled_mma_sdp, acc_S, tSrK, tSrQ)
                    if const_expr(t.overlap == "sdp"):
                        self.issue_dp(pipe_do, state_next, tiled_mma_sdp, acc_dP, tPrV, tPrdO)
                        warpgroup.wait_group(2)  # dK done
                    else:
                        warpgroup.wait_group(1)
                    state_next.advance()
                else:
                    warpgroup.wait_group(0)
            else:
                warpgroup.wait_group(0)
            pipe_q.consumer_release(state)

    @cute.jit
    def epilogue(
        self,
        acc_dK,
        acc_dV,
        dkv_out,
        sK,
        sV,
        tiled_mma_dkv,
        tiled_mma_dv,
        tidx,
        n_block,
        head_kv,
        batch,
        rows,
        seqlen_k,
        softmax_scale,
    ):
        """After the last block: the bias-gradient stores have read shared memory (a thread
        without any returns at once); dK scaled by the softmax scale (dS was not) and dK / dV
        stored, rows past seqlen_k dropped. ``dkv_out``: (mdK, mdV, their TMA atoms and
        coordinate tensors or None)."""
        t = self.tiles
        mdK, mdV, dkv_tma = dkv_out
        self.grad_bias_wait(tidx % 128 == 0)
        acc_dK.store(acc_dK.load() * softmax_scale)
        by_rows = (
            acc_dK,
            acc_dV,
            mdK,
            mdV,
            tiled_mma_dkv,
            tiled_mma_dv,
            tidx,
            n_block,
            head_kv,
            batch,
            rows[1],
            seqlen_k,
        )
        by_tma = (acc_dK, acc_dV, dkv_tma, sK, sV, tiled_mma_dkv, tiled_mma_dv, tidx, n_block, head_kv, batch, rows[1])
        if const_expr(not t.dkv_tma_store):
            self.store_dkv_rows(*by_rows)
        elif const_expr(t.dkv_vector_store):
            self.store_tiles_vectors(
                acc_dK,
                acc_dV,
                mdK,
                mdV,
                sK,
                sV,
                tiled_mma_dkv,
                tiled_mma_dv,
                tidx,
                n_block,
                head_kv,
                batch,
                rows[1],
                seqlen_k,
            )
        elif const_expr(self.varlen):
            # TMA drops rows past the tensor's end, not past a packed sequence's: a block
            # reaching past seqlen_k takes the row-predicated stores
            if (n_block + 1) * t.tile_n <= seqlen_k:
                self.store_tiles_tma(*by_tma)
            else:
                self.store_dkv_rows(*by_rows)
        else:
            self.store_tiles_tma(*by_tma)

    @cute.jit
    def store_dkv_rows(
        self, acc_dK, acc_dV, mdK, mdV, tiled_mma_dkv, tiled_mma_dv, tidx, n_block, head_kv, batch, offset_k, seqlen_k
    ):
        """dK / dV straight from registers (``store_rows``)."""
        self.store_rows(acc_dK, mdK, tiled_mma_dkv, tidx, n_block, head_kv, batch, offset_k, seqlen_k)
        self.store_rows(acc_dV, mdV, tiled_mma_dv, tidx, n_block, head_kv, batch, offset_k, seqlen_k)

    @cute.jit
    def stage_dkv(self, acc_dK, acc_dV, sK, sV, tiled_mma_dkv, tiled_mma_dv, tidx):
        """dK / dV (cast) into K's / V's shared memory by stmatrix, once the other warpgroup's
        last wgmmas (dQ's K, dP^T's V) have read K and V."""
        t = self.tiles
        cute.arch.barrier(barrier_id=NamedBarrier.EPILOGUE, number_of_threads=t.num_mma_threads)
        for acc, s, tiled_mma in ((acc_dK, sK, tiled_mma_dkv), (acc_dV, sV, tiled_mma_dv)):
            r2s = t.r2s_copy_dkv(self.dtype, tiled_mma)
            thr = r2s.get_slice(tidx)
            rOut = cute.make_rmem_tensor(acc.shape, self.dtype)
            rOut.store(acc.load().to(self.dtype))
            cute.copy(r2s, thr.retile(rOut), thr.partition_D(s))

    @cute.jit
    def store_tiles_tma(
        self, acc_dK, acc_dV, dkv_tma, sK, sV, tiled_mma_dkv, tiled_mma_dv, tidx, n_block, head_kv, batch, offset_k
    ):
        """dK / dV (cast) into K's / V's shared memory, then one thread's TMA stores: the rows
        leave as whole 128-byte lines and the warps are done at once (H100, 8x16x1024x64: 0.246
        ms against 0.260 with 32-bit stores straight from registers, docs/attention_sm90.md)."""
        t = self.tiles
        tma_dK, gdK_tma, tma_dV, gdV_tma = dkv_tma
        self.stage_dkv(acc_dK, acc_dV, sK, sV, tiled_mma_dkv, tiled_mma_dv, tidx)
        cute.arch.fence_view_async_shared()  # visible to the TMA unit
        cute.arch.barrier(barrier_id=NamedBarrier.EPILOGUE, number_of_threads=t.num_mma_threads)
        if tidx == 0:
            for atom, g_tma, s in ((tma_dK, gdK_tma, sK), (tma_dV, gdV_tma, sV)):
                tile = (t.tile_n, cute.size(s, mode=[1]))
                g = cute.local_tile(self.seq_tile_view(g_tma, head_kv, batch, offset_k), tile, (n_block, 0))
                ts, tg = cpasync.tma_partition(
                    atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
                )
                cute.copy(atom, ts, tg)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # shared memory stays until read

    @cute.jit
    def store_tiles_vectors(
        self,
        acc_dK,
        acc_dV,
        mdK,
        mdV,
        sK,
        sV,
        tiled_mma_dkv,
        tiled_mma_dv,
        tidx,
        n_block,
        head_kv,
        batch,
        offset_k,
        seqlen_k,
    ):
        """dK / dV (cast) into K's / V's shared memory as for the TMA store, then every consumer
        thread stores 16-byte vectors of whole rows (rows past seqlen_k dropped: also a packed
        sequence's partial block): nothing waits behind the dQ-store warp's reduce-adds in the
        TMA queue, and the CTA leaves without waiting for a TMA store to read shared memory."""
        t = self.tiles
        self.stage_dkv(acc_dK, acc_dV, sK, sV, tiled_mma_dkv, tiled_mma_dv, tidx)
        cute.arch.barrier(barrier_id=NamedBarrier.EPILOGUE, number_of_threads=t.num_mma_threads)
        self.store_staged_dkv(sK, sV, mdK, mdV, tidx, t.num_mma_threads, n_block, head_kv, batch, offset_k, seqlen_k)

    @cute.jit
    def store_staged_dkv(
        self, sK, sV, mdK, mdV, tidx, threads: cutlass.Constexpr, n_block, head_kv, batch, offset_k, seqlen_k
    ):
        """The staged dK / dV tiles from shared to global memory by ``threads`` threads (``tidx``
        among them), 16-byte row pieces, rows past seqlen_k dropped."""
        for s, mOut in ((sK, mdK), (sV, mdV)):
            self.store_staged_tile(s, mOut, tidx, threads, n_block, head_kv, batch, offset_k, seqlen_k)

    @cute.jit
    def store_staged_tile(self, s, mOut, tidx, threads: cutlass.Constexpr, n_block, head_kv, batch, offset_k, seqlen_k):
        """One staged tile (``store_staged_dkv``)."""
        t = self.tiles
        cols = mOut.shape[1]
        tile = (t.tile_n, cols)
        gOut = cute.local_tile(self.seq_tile_view(mOut, head_kv, batch, offset_k), tile, (n_block, 0))
        cOut = cute.local_tile(cute.make_identity_tensor((seqlen_k, cols)), tile, (n_block, 0))
        s2g = t.s2g_copy_dkv(self.dtype, cols, threads)
        thr = s2g.get_slice(tidx)
        tS, tG, tC = thr.partition_S(s), thr.partition_D(gOut), thr.partition_D(cOut)
        if const_expr(threads == t.num_mma_threads):
            for r in cutlass.range_constexpr(cute.size(tS, mode=[1])):
                if tC[0, r, 0][0] < seqlen_k:
                    cute.copy(s2g, tS[None, r, None], tG[None, r, None])
        else:  # the producer warpgroup's few registers: a rolled loop
            for r in cutlass.range(cute.size(tS, mode=[1]), unroll=1):
                if tC[0, r, 0][0] < seqlen_k:
                    cute.copy(s2g, tS[None, r, None], tG[None, r, None])

    @cute.jit
    def probs(
        self,
        acc_S,
        cS_mn,
        sLSE,
        stage,
        q0,
        key0,
        seqlen_q,
        seqlen_k,
        offset,
        window_size,
        scale_log2,
        rBias=None,
        lse=None,
    ):
        """P^T = exp(S^T * scale [+ B^T] - LSE) in place of S^T, zero where masked (after the exp:
        LSE may be +-inf there); computed as exp2 with sLSE in log2 units. ``cS_mn``: (key, query)
        in the block of each value, rows x columns. ``lse``: the columns' LSE already read
        (``read_stats``), else read here."""
        t = self.tiles
        S = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
        B = None
        if const_expr(self.has_bias):
            B = cute.make_tensor(rBias.iterator, acc_mn_layout(rBias.layout))
        need_mask = self.mask.needs_masking(q0, key0, seqlen_q, seqlen_k, offset, window_size)
        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
            q_local = cS_mn[0, c][1]
            # already in log2 units: one multiply a column less
            lse_log2 = lse[c] if const_expr(lse is not None) else sLSE[q_local, stage]
            for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
                x = S[r, c] * scale_log2 - lse_log2
                if const_expr(self.has_bias):  # in log2 units, as the scores
                    x = x + B[r, c].to(Float32) * LOG2_E
                S[r, c] = cute.math.exp2(x, fastmath=True)
        if need_mask:
            self.mask.apply_transposed(S, cS_mn, q0, key0, seqlen_q, seqlen_k, offset, window_size)

    @cute.jit
    def grad_scores(self, acc_dP, acc_P, cS_mn, sDelta, stage, keep=None, feat=None, delta=None):
        """dS^T = P^T (dP^T - Δ) in place of dP^T (P undropped; with dropout dP^T is first
        the dropped product's gradient Z∘dP^T). ``delta``: the columns' Δ already read."""
        P = cute.make_tensor(acc_P.iterator, acc_mn_layout(acc_P.layout))
        dP = cute.make_tensor(acc_dP.iterator, acc_mn_layout(acc_dP.layout))
        rows = cute.size(dP, mode=[0])
        for c in cutlass.range_constexpr(cute.size(dP, mode=[1])):
            d = delta[c] if const_expr(delta is not None) else sDelta[cS_mn[0, c][1], stage]
            for r in cutlass.range_constexpr(rows):
                dp = dP[r, c]
                if const_expr(self.dropout):
                    dp = self.dropped(keep, c * rows + r, dp, feat)
                dP[r, c] = P[r, c] * (dp - d)

    @cute.jit
    def read_stats(self, s, stage, cS_mn):
        """LSE or Δ of the fragment's query columns from stage ``stage`` into registers."""
        vals = []
        for c in cutlass.range_constexpr(cute.size(cS_mn, mode=[1])):
            vals.append(s[cS_mn[0, c][1], stage])
        return vals

    # ------------------------------------------------------------ bias and dropout
    @cute.jit
    def features(self, mBias, grad_bias_tma, sKeep, rng, batch, heads):
        """What the consumers need of bias and dropout, per CTA (None where unused): the
        batch's bias view (H, Sq, Sk), the bias gradient's TMA atom and (Sq, Sk, H) view, the
        keep-flag buffers and the Philox key, this batch's first stream word, p, 1 / (1 - p)
        and the words per head."""
        bias = mBias[batch, None, None, None] if const_expr(self.has_bias) else None
        grad_bias = None
        if const_expr(self.grad_bias):
            grad_bias = (grad_bias_tma[0], grad_bias_tma[1][None, None, None, batch])
        philox = None
        if const_expr(self.dropout):
            seed, offset, p, scale, bh_elems = rng
            seed = philox_scalar(seed)
            # curand_init(seed, 0, offset + (batch * H + head) * Mq * Mk), as the forward
            base = philox_scalar(offset) + Int64(batch) * Int64(heads) * Int64(bh_elems)
            philox = (Uint32(seed), Uint32(seed >> Int64(32)), base, Float32(p), Float32(scale), Int64(bh_elems))
        return bias, grad_bias, sKeep, philox

    @cute.jit
    def block_features(self, feat, head, i, q0, key0, seqlen_q, seqlen_k, cS_mn, shape_sdp, wg, tidx):
        """(bias fragment, keep bits) of step ``i``'s block (None where unused)."""
        rBias, keep = None, None
        if const_expr(self.has_bias):
            rBias = self.load_bias(feat[0], head, q0, key0, seqlen_q, seqlen_k, cS_mn, shape_sdp)
        if const_expr(self.dropout):
            self.draw_keep_flags(feat, head, i, q0, key0, seqlen_k, wg, tidx)
            keep = self.keep_bits(feat, i, cS_mn, wg)
        return rBias, keep

    @cute.jit
    def load_bias(self, bias, head, q0, key0, seqlen_q, seqlen_k, cS_mn, shape_sdp):
        """B^T of the thread's S^T fragment. Positions past the sequences read the last row /
        key instead (never out of bounds; probs zeroes them)."""
        gB = bias[head, None, None]
        rB = cute.make_rmem_tensor(shape_sdp, self.dtype)
        B = cute.make_tensor(rB.iterator, acc_mn_layout(rB.layout))
        for c in cutlass.range_constexpr(cute.size(B, mode=[1])):
            q = cutlass.min(q0 + cS_mn[0, c][1], seqlen_q - 1)
            for r in cutlass.range_constexpr(cute.size(B, mode=[0])):
                B[r, c] = gB[q, cutlass.min(key0 + cS_mn[r, c][0], seqlen_k - 1)]
        return rB

    @cute.jit
    def store_grad_bias(self, feat, sdS, buf, boxes, head, m_block, n_block):
        """dB = dS: TMA stores of dS buffer ``buf``'s key boxes ``boxes`` (GRAD_BIAS_BOX_KEYS
        keys each; an index or a list) to query block m_block, key block n_block (TMA drops
        what lies past the sequences). Called by one thread after dS is written and fenced."""
        t = self.tiles
        tma_dB, gdB = feat[1]
        box = (t.tile_m, GRAD_BIAS_BOX_KEYS)
        per_block = t.tile_n // GRAD_BIAS_BOX_KEYS
        g = cute.local_tile(gdB[None, None, head], box, (None, None))  # (rows, keys, m, n)
        s = cute.local_tile(sdS[None, None, buf], box, (0, None))  # (rows, keys, box)
        ts, tg = cpasync.tma_partition(
            tma_dB, 0, cute.make_layout(1), cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
        )
        for b in boxes if isinstance(boxes, list) else [boxes]:
            cute.copy(tma_dB, ts[None, b], tg[None, m_block, n_block * per_block + b])
        cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def grad_bias_wait(self, storing):
        """Before a thread announces its next dS: its last bias-gradient store has read the
        buffer (the dS barriers then order the buffer's next write after that read)."""
        if const_expr(self.grad_bias):
            if storing:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def draw_keep_flags(self, feat, head, i, q0, key0, seqlen_k, wg, tidx):
        """Dropout: the warpgroup draws its part of step ``i``'s block into keep-flag buffer
        i % 2: thread t the ``keep_flag_keys`` consecutive keys of one query row (curand's
        words q * Sk + k of the (batch, head) stream, 4 per Philox call), as bits (bit k % 16
        of half-word k / 16 of row q). Called while the tensor cores compute the block's S^T and
        dP^T (drawing a step ahead, behind the gradient products, measured no faster: the Philox
        rounds cost issue slots, not latency; docs/attention_sm90.md)."""
        t = self.tiles
        k0, k1, base, p, _, bh_elems = feat[3]
        keys, _ = t.sdp_wg_tile
        per_thread = t.keep_flag_keys
        key_org, q_org = t.sdp_wg_origin(wg)
        lt = tidx % 128
        row = q_org + lt // (keys // per_thread)
        col = key_org + (lt % (keys // per_thread)) * per_thread
        word = base + Int64(head) * bh_elems + Int64(q0 + row) * Int64(seqlen_k) + Int64(key0 + col)
        flags = keep_flags_quads(Uint64(word), k0, k1, p, per_thread // 4)
        s16 = self.keep_flag_halves(feat[2])
        # flag j of quad c is bit 8 j of flags[c]: 4 quads make a 16-bit half-word
        for h in cutlass.range_constexpr(per_thread // 16):
            half = Uint32(0)
            for c in cutlass.range_constexpr(4):
                f = flags[4 * h + c]
                nibble = (f | (f >> Uint32(7)) | (f >> Uint32(14)) | (f >> Uint32(21))) & Uint32(0xF)
                half = half | (nibble << Uint32(4 * c))
            s16[row, col // 16 + h, i % KEEP_FLAG_BUFFERS] = Uint16(half)

    def keep_flag_halves(self, sKeep):
        """The keep-flag buffers as (query, 16-key half-word, buffer) Uint16."""
        t = self.tiles
        layout = cute.make_layout(
            (t.tile_m, t.tile_n // 16, KEEP_FLAG_BUFFERS), stride=(t.tile_n // 16, 1, t.tile_m * t.tile_n // 16)
        )
        return cute.make_tensor(cute.recast_ptr(sKeep.iterator, dtype=Uint16), layout)

    @cute.jit
    def keep_bits(self, feat, i, cS_mn, wg):
        """Dropout keep flags of the thread's S^T fragment, one bit each (Uint32 words in the
        fragment's rows x columns order), from buffer i % 2 after the warpgroup's barrier (all
        its threads drew step i). With two buffers the one barrier suffices: a warpgroup draws
        into buffer i % 2 again (step i + 2) after all its threads passed step i + 1's
        barrier, i.e. read step i's bits.

        Rows 2 m and 2 m + 1 of a wgmma accumulator fragment are keys 8 apart in one 16-key
        group (row r0 * 8 + lane / 4 of the warp's 16), so one half-word serves both."""
        s16 = self.keep_flag_halves(feat[2])
        buf = i % KEEP_FLAG_BUFFERS
        # static barrier ids (a register id makes ptxas reserve all 16)
        if wg == 0:
            cute.arch.barrier(barrier_id=NamedBarrier.KEEP_FLAGS, number_of_threads=128)
        else:
            cute.arch.barrier(barrier_id=NamedBarrier.KEEP_FLAGS_WG1, number_of_threads=128)
        rows = cute.size(cS_mn, mode=[0])
        n = rows * cute.size(cS_mn, mode=[1])
        words = [Uint32(0) for _ in range((n + 31) // 32)]
        for c in cutlass.range_constexpr(cute.size(cS_mn, mode=[1])):
            for r in cutlass.range_constexpr(0, rows, 2):
                k, q = cS_mn[r, c]
                half = Uint32(s16[q, k // 16, buf]) >> Uint32(k % 16)
                for r0 in cutlass.range_constexpr(2):
                    e = c * rows + r + r0
                    words[e // 32] = words[e // 32] | (((half >> Uint32(8 * r0)) & Uint32(1)) << Uint32(e % 32))
        return words

    @cute.jit
    def dropped(self, keep, e, x, feat):
        """x / (1 - p) where element ``e`` of the fragment is kept, else 0."""
        kept = (keep[e // 32] & Uint32(1 << (e % 32))) != Uint32(0)
        return Float32(cutlass.select_(kept, x * feat[3][4], Float32(0.0)))

    @cute.jit
    def p_operand(self, acc_P, cS_mn, keep, feat):
        """P^T in the element type, the A operand of dV += P^T dO: with dropout P∘Z."""
        rP = cute.make_rmem_tensor(acc_P.layout.shape, self.dtype)
        if const_expr(self.dropout):
            P = cute.make_tensor(acc_P.iterator, acc_mn_layout(acc_P.layout))
            Pd = cute.make_tensor(rP.iterator, acc_mn_layout(rP.layout))
            rows = cute.size(P, mode=[0])
            for c in cutlass.range_constexpr(cute.size(P, mode=[1])):
                for r in cutlass.range_constexpr(rows):
                    Pd[r, c] = self.dropped(keep, c * rows + r, P[r, c], feat).to(self.dtype)
        else:
            rP.store(acc_P.load().to(self.dtype))
        return rP

    @cute.jit
    def sdp_operands(self, tiled_mma_sdp, tidx, wg, sK, sQ, sV, sdO, tile_m: cutlass.Constexpr = None):
        """S^T = K Q^T, dP^T = V dO^T: the warpgroup's operand fragments, the thread's
        accumulator shape and the (key, query) coordinate of each accumulator value as
        rows x columns (``tile_m``: a partial block's queries, else the tiles')."""
        t = self.tiles
        tile_m = t.tile_m if const_expr(tile_m is None) else tile_m
        wg_sdp = tiled_mma_sdp.get_slice(wg * 128)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ))
        tPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tPrdO = wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO))
        shape_sdp = thr_sdp.partition_shape_C((t.tile_n, tile_m))
        cS = thr_sdp.partition_C(cute.make_identity_tensor((t.tile_n, tile_m)))
        return tSrK, tSrQ, tPrV, tPrdO, shape_sdp, cute.make_tensor(cS.iterator, acc_mn_layout(cS.layout))

    @cute.jit
    def dkv_operands(self, tiled_mma_dkv, tiled_mma_dv, tidx, wg, sQ, sdO):
        """dV += P^T dO, dK += dS^T Q: the B fragments (transposed views of dO / Q) and the
        zeroed dV, dK accumulators (the A operand, P^T / dS^T, differs per kernel).
        ``tiled_mma_dkv`` is dK's product (N = Dqk), ``tiled_mma_dv`` dV's (N = Dv)."""
        tVrdO, tKrQ = self.dkv_b_operands(tiled_mma_dkv, tiled_mma_dv, wg, sQ, sdO)
        acc_dV, acc_dK = self.dkv_accumulators(tiled_mma_dkv, tiled_mma_dv, tidx)
        return tVrdO, tKrQ, acc_dV, acc_dK

    @cute.jit
    def dkv_accumulators(self, tiled_mma_dkv, tiled_mma_dv, tidx):
        """The thread's zeroed dV and dK accumulators."""
        t = self.tiles
        acc_dV = cute.make_rmem_tensor(
            tiled_mma_dv.get_slice(tidx).partition_shape_C((t.tile_n, t.head_dim_v)), Float32
        )
        acc_dK = cute.make_rmem_tensor(tiled_mma_dkv.get_slice(tidx).partition_shape_C((t.tile_n, t.head_dim)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        return acc_dV, acc_dK

    @cute.jit
    def dkv_b_operands(self, tiled_mma_dkv, tiled_mma_dv, wg, sQ, sdO):
        """dV += P^T dO, dK += dS^T Q: the warpgroup's B fragments, the transposed views of dO / Q."""
        wg_dk = tiled_mma_dkv.get_slice(wg * 128)
        wg_dv = tiled_mma_dv.get_slice(wg * 128)
        tVrdO = wg_dv.make_fragment_B(wg_dv.partition_B(transpose_view(sdO)))
        tKrQ = wg_dk.make_fragment_B(wg_dk.partition_B(transpose_view(sQ)))
        return tVrdO, tKrQ

    @cute.jit
    def step_operands(
        self,
        tiled_mma_sdp,
        tiled_mma_dq,
        tiled_mma_dkv,
        tiled_mma_dv,
        tidx,
        wg,
        sQ,
        sdO,
        sK,
        sV,
        sdS,
        sdQ,
        tile_m: cutlass.Constexpr = None,
        sK_both=None,
    ):
        """``block_step``'s ``StepOperands`` over blocks of ``tile_m`` queries (the tiles' by
        default; a partial block's with its own S^T / dP^T / dQ^T tiled MMAs and the shared
        tiles' first rows, ``tail_operands``). ``sK_both``: carry_dq's two K buffers (dQ's K
        fragments over both)."""
        tSrK, tSrQ, tPrV, tPrdO, shape_sdp, cS_mn = self.sdp_operands(tiled_mma_sdp, tidx, wg, sK, sQ, sV, sdO, tile_m)
        tVrdO, tKrQ = self.dkv_b_operands(tiled_mma_dkv, tiled_mma_dv, wg, sQ, sdO)
        tQrdS, tQrK, shape_dq = self.dq_operands(tiled_mma_dq, tidx, wg, sK, sdS, tile_m)
        tQrK_both = None
        if const_expr(sK_both is not None):
            tQrK_both = self.dq_operands(tiled_mma_dq, tidx, wg, sK_both, sdS)[1]
        r2s_ds = self.tiles.r2s_copy_ds(self.dtype, tiled_mma_sdp)
        thr_r2s_ds = r2s_ds.get_slice(tidx)
        tdSs = thr_r2s_ds.partition_D(transpose_view(sdS))
        r2s_dq, thr_r2s_dq, tdQs = self.dq_staging(tiled_mma_dq, tidx, sdQ)
        acc_S = cute.make_rmem_tensor(shape_sdp, Float32)
        acc_dP = cute.make_rmem_tensor(shape_sdp, Float32)
        return StepOperands(
            tiled_mma_sdp=tiled_mma_sdp,
            acc_S=acc_S,
            acc_dP=acc_dP,
            tSrK=tSrK,
            tSrQ=tSrQ,
            tPrV=tPrV,
            tPrdO=tPrdO,
            shape_sdp=shape_sdp,
            cS_mn=cS_mn,
            tVrdO=tVrdO,
            tKrQ=tKrQ,
            tiled_mma_dq=tiled_mma_dq,
            tQrdS=tQrdS,
            tQrK=tQrK,
            tQrK_both=tQrK_both,
            shape_dq=shape_dq,
            r2s_ds=r2s_ds,
            thr_r2s_ds=thr_r2s_ds,
            tdSs=tdSs,
            r2s_dq=r2s_dq,
            thr_r2s_dq=thr_r2s_dq,
            tdQs=tdQs,
        )

    @cute.jit
    def tail_operands(self, tidx, wg, sQ, sdO, sK, sV, sdS, sdQ, tiled_mma_dkv, tiled_mma_dv):
        """``step_operands`` for a partial last query block (``tail_m``): S^T, dP^T and dQ^T
        tail_m queries wide (their own tiled MMAs), dV / dK over tail_m queries (the first
        k-blocks of Q / dO's transposed views), the shared tiles' first tail_m rows (the TMA
        loads fill whole blocks, zeros past the end; the store warp adds the whole staging
        buffer, whose rows past tail_m land beyond the sequence, in the accumulator's padding
        or past its end)."""
        tail_tiles = dataclasses.replace(self.tiles, tile_m=self.tail_m)
        sQ_t, sdO_t, sdS_t, sdQ_t = (rows_view(x, self.tail_m) for x in (sQ, sdO, sdS, sdQ))
        return self.step_operands(
            tail_tiles.tiled_mma_sdp(self.dtype),
            tail_tiles.tiled_mma_dq(self.dtype),
            tiled_mma_dkv,
            tiled_mma_dv,
            tidx,
            wg,
            sQ_t,
            sdO_t,
            sK,
            sV,
            sdS_t,
            sdQ_t,
            self.tail_m,
        )

    @cute.jit
    def stage_dq(self, acc_dQ, r2s_dq, thr_r2s_dq, tdQs, buf, wg):
        """dQ -> staging buffer ``buf`` for the store warp's reduce-add."""
        handoff = self.tiles.dq_handoff_threads
        if const_expr(self.tiles.dq_per_wg):
            # only this warpgroup and the store warp meet
            if wg == 0:
                cute.arch.barrier(barrier_id=NamedBarrier.DQ_EMPTY, number_of_threads=handoff)
            else:
                cute.arch.barrier(barrier_id=NamedBarrier.DQ_EMPTY_WG1, number_of_threads=handoff)
            cute.copy(r2s_dq, thr_r2s_dq.retile(acc_dQ), tdQs[None, None, None, buf])
            cute.arch.fence_view_async_shared()
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.DQ_FULL, number_of_threads=handoff)
            else:
                cute.arch.barrier_arrive(barrier_id=NamedBarrier.DQ_FULL_WG1, number_of_threads=handoff)
        else:
            cute.arch.barrier(barrier_id=NamedBarrier.DQ_EMPTY, number_of_threads=handoff)
            cute.copy(r2s_dq, thr_r2s_dq.retile(acc_dQ), tdQs[None, None, None, buf])
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.DQ_FULL, number_of_threads=handoff)

    @cute.jit
    def dq_dk_split(
        self, wg, stage, ds_stage, tiled_mma_dq, tiled_mma_dkv, acc_dK, rdS, tKrQ, tQrdS, tQrK, shape_dq, tidx, dbias
    ):
        """dS handoff by two one-way barriers: each warpgroup announces its half of dS, issues
        dK (registers only) and only then waits for the other half, so the wait overlaps dK.
        A warpgroup announces block i+1 after its dQ of block i completed (and, with the bias
        gradient, its store of the other half of block i has read it), which keeps the two dS
        buffers safe. Returns dQ with dK and dQ both done."""
        t = self.tiles
        storing = tidx % 128 == 0  # the bias gradient: this warpgroup's thread that stores the other half
        self.grad_bias_wait(storing)
        if wg == 0:
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.PDS, number_of_threads=t.num_mma_threads)
        else:
            cute.arch.barrier_arrive(barrier_id=NamedBarrier.PDS_WG1, number_of_threads=t.num_mma_threads)
        wgmma(
            tiled_mma_dkv,
            acc_dK,
            cute.make_tensor(rdS.iterator, acc_as_operand_a(rdS.layout)),
            tKrQ[None, None, None, stage],
            zero_init=False,
        )
        if wg == 0:
            cute.arch.barrier(barrier_id=NamedBarrier.PDS_WG1, number_of_threads=t.num_mma_threads)
        else:
            cute.arch.barrier(barrier_id=NamedBarrier.PDS, number_of_threads=t.num_mma_threads)
        if const_expr(self.grad_bias):
            if storing:  # the other warpgroup's keys: its half is written and fenced
                feat, sdS, head, m_block, n_block = dbias
                self.store_grad_bias(feat, sdS, ds_stage, 1 - wg, head, m_block, n_block)
        if const_expr(t.dq_wait_dkv):
            warpgroup.wait_group(0)  # P^T / dS^T operand registers free before dQ's accumulator
        acc_dQ = self.issue_dq(tiled_mma_dq, shape_dq, tQrdS, tQrK, ds_stage)
        warpgroup.wait_group(0)
        return acc_dQ

    @cute.jit
    def deferred_step(
        self,
        i,
        wg,
        stage,
        tiled_mma_dq,
        tiled_mma_dv,
        tiled_mma_dkv,
        acc_dV,
        acc_dK,
        rP,
        rdS,
        tVrdO,
        tKrQ,
        tQrdS,
        tQrK,
        shape_dq,
        r2s_ds,
        thr_r2s_ds,
        tdSs,
        r2s_dq,
        thr_r2s_dq,
        tdQs,
        carry_in=None,
    ):
        """The products of step ``i`` once its dS is in registers (``dq_defer``): this block's
        dS^T stored (after the other warpgroup announced block i - 1, a step ago as a rule: it
        announces a block only once its dQ of the block before has read the buffer written
        here), the previous block's dQ and this block's dV issued, this half announced once
        that dQ has read its buffer (the other warpgroup writes block i + 1 there), dK issued
        and the previous block's dQ staged. Step 0 has no previous block: its dQ product runs
        on the unused buffer and is dropped, which keeps the wgmma groups the same every step
        (ptxas serialises wgmmas whose issue depends on a branch). Returns with all done.
        ``carry_in`` (carry_dq): (this step's index among the CTA's steps, the tile's first):
        the previous block may be the previous tile's last (tQrK is then that tile's K); its
        dS buffer is the one the store warps read the previous tile's dK from."""
        t = self.tiles
        n_handoff = t.dkv_handoff_threads
        g = i
        if const_expr(carry_in is not None):
            g = carry_in[0]
        prev = g - 1
        if g > 0:
            self.ds_half_barrier(1 - wg, prev, False)
            if const_expr(carry_in is not None):
                if g == carry_in[1]:  # the tile's step 0: the previous tile's dK has left this buffer
                    named_barrier(NamedBarrier.DS_FREE, n_handoff, False)
        cute.copy(r2s_ds, thr_r2s_ds.retile(rdS), tdSs[None, None, None, cyclic(g, t.ds_stages)])
        acc_dQ = self.issue_dq(tiled_mma_dq, shape_dq, tQrdS, tQrK, cyclic(g + t.ds_stages - 1, t.ds_stages))
        wgmma(
            tiled_mma_dv,
            acc_dV,
            cute.make_tensor(rP.iterator, acc_as_operand_a(rP.layout)),
            tVrdO[None, None, None, stage],
            zero_init=False,
        )
        warpgroup.wait_group(1)  # dQ of block i - 1 done: its dS buffer is read
        if const_expr(carry_in is not None):
            if g > 0:
                if g == carry_in[1]:  # ... and the previous tile's K: its buffer may be refilled
                    named_barrier(NamedBarrier.K_FREE, n_handoff, True)
        cute.arch.fence_view_async_shared()
        self.ds_half_barrier(wg, g, True)
        wgmma(
            tiled_mma_dkv,
            acc_dK,
            cute.make_tensor(rdS.iterator, acc_as_operand_a(rdS.layout)),
            tKrQ[None, None, None, stage],
            zero_init=False,
        )
        if g > 0:
            self.stage_dq(acc_dQ, r2s_dq, thr_r2s_dq, tdQs, cyclic(prev, t.dq_stages), wg)
        warpgroup.wait_group(0)

    @cute.jit
    def dq_operands(self, tiled_mma_dq, tidx, wg, sK, sdS, tile_m: cutlass.Constexpr = None):
        """dQ = dS K: the warpgroup's operand fragments (dS's and K's, with their stage / buffer
        modes) and the thread's accumulator shape. With ``dq_swapab`` dQ^T = K^T dS^T: A = K's
        (d, keys) view, B = dS (queries, keys). ``tile_m``: a partial block's queries."""
        t = self.tiles
        tile_m = t.tile_m if const_expr(tile_m is None) else tile_m
        wg_dq = tiled_mma_dq.get_slice(wg * 128)
        thr_dq = tiled_mma_dq.get_slice(tidx)
        if const_expr(t.dq_swapab):
            tQrK = wg_dq.make_fragment_A(wg_dq.partition_A(transpose_view(sK)))
            tQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdS))
            shape_dq = thr_dq.partition_shape_C((t.head_dim, tile_m))
        else:
            tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
            tQrK = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
            shape_dq = thr_dq.partition_shape_C((tile_m, t.head_dim))
        return tQrdS, tQrK, shape_dq

    @cute.jit
    def dq_staging(self, tiled_mma_dq, tidx, sdQ):
        """The copy of the dQ accumulator into the staging buffers sdQ and this thread's part of
        them (transposed with ``dq_swapab``)."""
        r2s_dq = self.tiles.r2s_copy_dq(tiled_mma_dq)
        thr_r2s_dq = r2s_dq.get_slice(tidx)
        return (
            r2s_dq,
            thr_r2s_dq,
            thr_r2s_dq.partition_D(transpose_view(sdQ) if const_expr(self.tiles.dq_swapab) else sdQ),
        )

    @cute.jit
    def carried_dq_tail(self, sK, sdS, sdQ, tiled_mma_dq, tidx, done, kv_state, any_tile):
        """carry_dq, after the CTA's last tile: that tile's last block's dQ (on its K, still in
        its buffer), staged for the store warp; then the K buffer is released. A CTA without
        tiles issues the product on whatever the buffers hold and stages nothing (no wgmma
        under a branch)."""
        t = self.tiles
        wg = cute.arch.make_warp_uniform(tidx // 128)
        tQrdS, tQrK, shape_dq = self.dq_operands(tiled_mma_dq, tidx, wg, sK, sdS)
        r2s_dq, thr_r2s_dq, tdQs = self.dq_staging(tiled_mma_dq, tidx, sdQ)
        last = done - 1
        if any_tile:
            self.ds_half_barrier(1 - wg, last, False)
        acc_dQ = self.issue_dq(
            tiled_mma_dq,
            shape_dq,
            tQrdS,
            tQrK[None, None, None, 1 - kv_state.index],
            (last + t.ds_stages) % t.ds_stages,
        )
        warpgroup.wait_group(0)
        if any_tile:
            self.stage_dq(acc_dQ, r2s_dq, thr_r2s_dq, tdQs, last % t.dq_stages, wg)
            named_barrier(NamedBarrier.K_FREE, t.dkv_handoff_threads, True)

    @cute.jit
    def dkv_staged_barrier(self, buffer, arrive: cutlass.Constexpr):
        """Persistent CTAs: the consumers have staged a tile's dK / dV in K / V buffer
        ``buffer`` (``arrive``), or the store warps wait for it. An id per buffer: the consumers
        stage into a buffer again only after the store warps freed it."""
        n = self.tiles.dkv_handoff_threads
        if buffer == 0:
            named_barrier(NamedBarrier.DKV_STAGED, n, arrive)
        else:
            named_barrier(NamedBarrier.DKV_STAGED_BUF1, n, arrive)

    @cute.jit
    def ds_half_barrier(self, owner, i, arrive: cutlass.Constexpr):
        """``dq_defer``: warpgroup ``owner``'s half of block i's dS is written and fenced:
        announced by it (``arrive``) or waited for by the other warpgroup. Static ids (a
        register id makes ptxas reserve all 16), alternating by step."""
        n = self.tiles.num_mma_threads
        if owner == 0:
            if cyclic(i, 2) == 0:
                named_barrier(NamedBarrier.PDS, n, arrive)
            else:
                named_barrier(NamedBarrier.PDS_ODD, n, arrive)
        else:
            if cyclic(i, 2) == 0:
                named_barrier(NamedBarrier.PDS_WG1, n, arrive)
            else:
                named_barrier(NamedBarrier.PDS_WG1_ODD, n, arrive)

    @cute.jit
    def issue_dq(self, tiled_mma_dq, shape_dq, tQrdS, tQrK, ds_stage):
        """dQ = dS K of dS buffer ``ds_stage`` into a fresh accumulator (dQ^T = K^T dS^T with
        ``dq_swapab``), issued, not waited for."""
        acc_dQ = cute.make_rmem_tensor(shape_dq, Float32)
        if const_expr(self.tiles.dq_swapab):
            wgmma(tiled_mma_dq, acc_dQ, tQrK, tQrdS[None, None, None, ds_stage], zero_init=True)
        else:
            wgmma(tiled_mma_dq, acc_dQ, tQrdS[None, None, None, ds_stage], tQrK, zero_init=True)
        return acc_dQ

    @cute.jit
    def issue_s(self, pipe_q, state, tiled_mma_sdp, acc_S, tSrK, tSrQ):
        """S^T = K Q^T of the block in pipeline ``state``: one wgmma group."""
        pipe_q.consumer_wait(state)
        wgmma(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, state.index], zero_init=True)

    @cute.jit
    def issue_dp(self, pipe_do, state, tiled_mma_sdp, acc_dP, tPrV, tPrdO):
        """dP^T = V dO^T of the block in pipeline ``state``: one wgmma group."""
        pipe_do.consumer_wait(state)
        wgmma(tiled_mma_sdp, acc_dP, tPrV, tPrdO[None, None, None, state.index], zero_init=True)

    @cute.jit
    def store_rows(self, acc, mOut, tiled_mma, tidx, n_block, head, batch, offset_k, seqlen_k):
        """fp32 accumulator -> element type -> global rows n_block * tile_n + .. of the sequence
        (predicated on seqlen_k: with varlen the next sequence's rows follow)."""
        t = self.tiles
        cols = mOut.shape[1]  # static: dK's Dqk or dV's Dv
        tile = (t.tile_n, cols)
        gOut = cute.local_tile(self.seq_tile_view(mOut, head, batch, offset_k), tile, (n_block, 0))
        cOut = cute.local_tile(cute.make_identity_tensor((seqlen_k, cols)), tile, (n_block, 0))
        r2g = t.r2g_copy_dkv(self.dtype, tiled_mma)
        thr = r2g.get_slice(tidx)
        tOg = thr.partition_D(gOut)
        tOc = thr.partition_D(cOut)
        rOut = cute.make_rmem_tensor(acc.shape, self.dtype)
        rOut.store(acc.load().to(self.dtype))
        tOr = thr.retile(rOut)
        if (n_block + 1) * t.tile_n <= seqlen_k:
            cute.copy(r2g, tOr, tOg)
        else:
            # element by element: a copy vector's values need not share a row
            for e in cutlass.range_constexpr(cute.size(tOr)):
                if tOc[e][0] < seqlen_k:
                    tOg[e] = tOr[e]
