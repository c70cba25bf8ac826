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

Launched with programmatic dependent launch behind the preprocess launch, which triggers
it once its loads are done: K / V loads and the CTA's set-up overlap the preprocess's
tail; the producer and the dQ-store warp wait for the preprocess grid (griddepcontrol)
before reading Δ / LSE or adding into the accumulator. Launch it right behind that
preprocess (nothing in between on the stream).
(``dq_ready``, ``tail_m``: ``DqAccumulatorMixin``, ``ConsumerStepsMixin``.)
"""

from dataclasses import dataclass
from typing import Any, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, Uint8, const_expr
from cutlass.cute.nvgpu import cpasync

from cute_kernels.attention.dropout import PhiloxArgs
from cute_kernels.attention.mask import AttentionMask
from cute_kernels.attention.seqlen_info import Rows, SeqlenInfo
from cute_kernels.attention.tile_scheduler import TileRing, TileSchedulerParams, tile_scheduler
from cute_kernels.common.views import select_modes
from layouts.attention_bwd_prepost import SEQLEN_ROUND, VARLEN_ACCUM_PAD
from layouts.attention_sm90 import (
    GRAD_BIAS_BOX_KEYS,
    KEEP_FLAG_BUFFERS,
    SMEM_ALIGN,
    SMEM_LIMIT,
    STATS_ALIGN,
    TAIL_ROWS_ALIGN,
)

from .arguments import DkvOut, DkvTma, DqFirst, GradBiasTma, LoadArgs, MmaArgs, StoreArgs
from .backward_config import (
    CONSUMER_REGS,
    DKV_STORE_WARPS,
    PRODUCER_REGS,
    AttentionSm90Tiles,
)
from .consumer import ConsumerMixin
from .consumer_steps import ConsumerStepsMixin
from .dq_accumulator import DqAccumulatorMixin
from .epilogue import EpilogueMixin
from .features import FeaturesMixin
from .operands import OperandsMixin
from .persistent import PersistentRolesMixin
from .producer import ProducerMixin
from .work import WorkMixin


@dataclass(frozen=True)
class KernelPipelines:
    """The CTA's pipelines: Q / LSE and dO / Δ, K / V (persistent CTAs, else None) and the tile
    ring (``dynamic_tiles``: ``TileRing``, else None)."""

    q: Any
    do: Any
    kv: Any
    tile_ring: Any


@dataclass(frozen=True)
class OutputAtoms:
    """What the kernel writes by TMA: the dQ accumulator's reduce-add (atom, coordinate tensor),
    store_first's plain store (else None), dK / dV's ``DkvTma`` (else None) and the bias
    gradient's ``GradBiasTma``."""

    tma_dQ: Any
    gdQ_tma: Any
    tma_dQ_store: Any
    dkv_tma: Any
    grad_bias_tma: Any


class AttentionBackwardSm90(
    ConsumerMixin,
    DqAccumulatorMixin,
    EpilogueMixin,
    FeaturesMixin,
    OperandsMixin,
    ConsumerStepsMixin,
    ProducerMixin,
    PersistentRolesMixin,
    WorkMixin,
):
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

    ``softcap``: the forward capped the scores, s -> c tanh(s / c) before bias and mask (c a
    runtime argument); P^T is recomputed from tanh(S^T scale / c) and dS^T takes 1 - tanh², tanh
    recovered from P (``cute_kernels/attention/softcap.py``). Not with ``grad_bias``: dB is the
    gradient of the capped scores, dQ / dK need it times 1 - tanh², and one dS tile serves both.

    ``seqused``: int32 [sequences] used lengths of queries and keys (``SeqlenInfo``), read on the
    device as varlen's lengths are (a CTA per tile, no store_first or tail block): masks and walks
    take them; a straddling tile loads the padding (finite there) with weight 0, and dK / dV rows
    past them are zeros (the host zeroes what the predicated stores leave).

    ``carry_dq``, ``store_first``, ``zero_ahead``: ``ConsumerStepsMixin``, ``DqAccumulatorMixin``."""

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
        softcap: bool = False,
        seqused: bool = False,
    ):
        if has_window and mask_type == 0:
            raise ValueError("a sliding window needs a causal mask (mask_type 1 or 2)")
        if softcap and grad_bias:
            raise ValueError("softcap with grad_bias: dB and dQ / dK would need two dS tiles (the cap's derivative)")
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
        if seqused and (has_bias or dropout or dq_ready):
            # dq_ready's counts take every key block of the grid, not those of the used keys
            raise NotImplementedError("used lengths (seqused) with an attention bias, dropout or dq_ready")
        if dropout and tiles.smem_bytes(dtype.width // 8, dropout=True) > SMEM_LIMIT:
            raise ValueError("the dropout keep flags do not fit in shared memory beside these tiles")
        self.dtype = dtype
        self.tiles = tiles
        self.mask_type = mask_type
        self.has_window = has_window
        self.deterministic = deterministic
        self.varlen = varlen
        self.seqused = seqused
        # lengths per sequence, read on the device (cu_seqlens, seqused): a key block of the grid
        # may lie past its sequence's keys, and the host knows no sequence's end
        per_seq = varlen or seqused
        self.mask = AttentionMask(tiles.tile_m, tiles.tile_n, mask_type, has_window, per_seq)
        self.has_bias = has_bias
        self.grad_bias = grad_bias
        self.dropout = dropout
        self.softcap = softcap
        # heavy-first CTA order for causal masks (cta_coords); deterministic mode keeps the
        # launch order its dQ turns are built on (a CTA must never wait for one not launched)
        self.lpt = tiles.lpt and mask_type != 0 and not deterministic
        schedule = self.tile_schedule(tiles, mask_type, has_window, deterministic, per_seq, has_bias, dropout)
        self.persistent = schedule != "grid"
        self.dynamic_tiles = schedule == "dynamic"
        self.scheduler = tile_scheduler(schedule, self.lpt)
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
        if store_first and (deterministic or per_seq):
            # determinism orders the adds by turns; varlen's accumulator rows are per sequence;
            # query blocks past the used lengths are never stored
            raise ValueError("store_first is built for runs without deterministic mode, varlen or seqused")
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
        if tail_m and not self.takes_tail(tiles, schedule, per_seq, has_bias, dropout):
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
        softcap: Float32,  # the cap c (softcap; unused without)
        mSeqUsedQ: Optional[cute.Tensor],  # seqused: int32 [sequences], each one's used query rows (else None)
        mSeqUsedK: Optional[cute.Tensor],  # ... used key rows
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
        out = self.output_atoms(mdQaccum, mdK, mdV, mdBias, sdQ_layout, sK_layout, sV_layout)
        tma_dQ, gdQ_tma, tma_dQ_store, dkv_tma = out.tma_dQ, out.gdQ_tma, out.tma_dQ_store, out.dkv_tma

        elem = self.dtype.width // 8
        self.q_bytes = t.tile_m * d * elem + t.tile_m * 4  # Q + LSE
        self.do_bytes = t.tile_m * dv * elem + t.tile_m * 4  # dO + Δ
        self.kv_bytes = t.tile_n * (d + dv) * elem

        SharedStorage = self.shared_storage(
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout, sStat_layout
        )

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
        sched = TileSchedulerParams(n_blocks, heads_kv, batches, heads_per_chunk)
        rng = None
        if const_expr(self.dropout):
            rng = PhiloxArgs(philox_seed, philox_offset, dropout_p, dropout_scale, dropout_bh_elems)
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
            DqFirst(mDqFirst, tma_dQ_store, mdQaccum),
            mCuSeqlensQ,
            mCuSeqlensK,
            mBias,
            out.grad_bias_tma,
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
            softcap,
            mSeqUsedQ,
            mSeqUsedK,
            SharedStorage,
        ).launch(grid=grid, block=[t.num_threads, 1, 1], min_blocks_per_mp=1, stream=stream, use_pdl=True)

    @cute.jit
    def output_atoms(self, mdQaccum, mdK, mdV, mdBias, sdQ_layout, sK_layout, sV_layout) -> OutputAtoms:
        """The TMA atoms and coordinate tensors of what the kernel writes (``OutputAtoms``)."""
        t = self.tiles
        d, dv = t.head_dim, t.head_dim_v
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
            dkv_tma = DkvTma(tma_dK, gdK_tma, tma_dV, gdV_tma)

        tma_dB = gdB_tma = None
        if const_expr(self.grad_bias):  # (queries, keys, heads, batch): boxes of the keys-contiguous dS tile
            tma_dB, gdB_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(),
                select_modes(mdBias, (2, 3, 1, 0)),
                t.smem_layout_grad_bias_box(self.dtype),
                (t.tile_m, GRAD_BIAS_BOX_KEYS),
            )
        return OutputAtoms(tma_dQ, gdQ_tma, tma_dQ_store, dkv_tma, GradBiasTma(tma_dB, gdB_tma))

    def shared_storage(self, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout, sStat_layout):
        """The kernel's shared memory (the module docstring's table): mbarriers, the tile ring,
        the statistics, the operand tiles, the dQ staging buffers and the keep flags."""
        t = self.tiles

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

        return SharedStorage

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
        dq_first: DqFirst,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mBias: Optional[cute.Tensor],
        grad_bias_tma: GradBiasTma,
        dkv_tma: Optional[DkvTma],
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
        sched: TileSchedulerParams,
        rng: Optional[PhiloxArgs],
        softcap: Float32,
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        SharedStorage: cutlass.Constexpr,
    ):
        t = self.tiles
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = self.scheduler.cta_coords(sched)
        if warp_idx == 0:
            self.warp0_start(
                (tma_Q, tma_dO, tma_K, tma_V, tma_LSE, tma_Delta, tma_dQ), grad_bias_tma, dq_first, dkv_tma
            )

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

        pipes = self.make_pipelines(storage, warp_idx, mbar_kv, mTileCounter)
        pipe_q, pipe_do, pipe_kv, tiles_args = pipes.q, pipes.do, pipes.kv, pipes.tile_ring
        if const_expr(not self.persistent and t.kv_buffers > 1):  # one tile a CTA: the first buffer alone
            sK, sV = sK[None, None, 0], sV[None, None, 0]

        # where the CTA's sequence starts in the packed rows (varlen) and its (used) lengths
        cu_seqlens_q = mCuSeqlensQ if const_expr(self.varlen) else None
        cu_seqlens_k = mCuSeqlensK if const_expr(self.varlen) else None
        seqused_q = mSeqUsedQ if const_expr(self.seqused) else None
        seqused_k = mSeqUsedK if const_expr(self.seqused) else None
        seq = SeqlenInfo.create(batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        rows = Rows(seq.offset_q, seq.offset_k)
        # the CTA's work: (query head of the group, query block) pairs, heads outer
        work = self.work_of(n_block, head_kv, group, seqlen_q, seqlen_k, window_size)

        load_args = LoadArgs(
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
            pipe_kv,
        )
        store_args = StoreArgs(gdQ_tma, sdQ, tma_dQ, mSemaphore, dq_first, mDqReady)
        mma_args = MmaArgs(
            sQ,
            sdO,
            sK,
            sV,
            sdS,
            sdQ,
            sLSE,
            sDelta,
            DkvOut(mdK, mdV, dkv_tma),
            tiled_mma_sdp,
            tiled_mma_dkv,
            tiled_mma_dv,
            tiled_mma_dq,
            pipe_q,
            pipe_do,
            mbar_kv,
            pipe_kv,
            softcap,
        )
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
                load_args,
                store_args,
                mma_args,
                sdK_carry,
            )
        else:
            self.tile_roles(
                warp_idx,
                tidx,
                load_args,
                store_args,
                mma_args,
                n_block,
                batch,
                work,
                rows,
                group,
                sched,
                seqlen_q,
                seqlen_k,
                softmax_scale,
                window_size,
                mBias,
                grad_bias_tma,
                sKeep,
                rng,
            )

    @cute.jit
    def tile_roles(
        self,
        warp_idx,
        tidx,
        load_args: LoadArgs,
        store_args: StoreArgs,
        mma_args: MmaArgs,
        n_block,
        batch,
        work,
        rows,
        group,
        sched,
        seqlen_q,
        seqlen_k,
        softmax_scale,
        window_size,
        mBias,
        grad_bias_tma,
        sKeep,
        rng,
    ):
        """A CTA per tile: the producer warp's loads, the dQ-store warp's adds and the consumers'
        steps (with the bias and dropout of the CTA's batch, ``features``)."""
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == 0:
                self.load(load_args, n_block, batch, work, rows)
            if warp_idx == 1:
                self.store_dq(store_args, n_block, batch, work, rows, seqlen_q, seqlen_k)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            feat = self.features(mBias, grad_bias_tma, sKeep, rng, batch, group * sched.heads_kv)  # query heads
            self.mma(
                mma_args,
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
    def warp0_start(self, atoms, grad_bias_tma: GradBiasTma, dq_first: DqFirst, dkv_tma: Optional[DkvTma]):
        """Warp 0 at the CTA's start: with dq_ready the dependent launch let go; the TMA
        descriptors of ``atoms`` and of the features in use prefetched."""
        t = self.tiles
        if const_expr(self.dq_ready):
            # ConvertDQReady, behind on the stream, may take the multiprocessors this grid's
            # CTAs leave once every one has started (it waits for each head's count)
            cute.arch.griddepcontrol_launch_dependents()
        for atom in atoms:
            cpasync.prefetch_descriptor(atom)
        if const_expr(self.grad_bias):
            cpasync.prefetch_descriptor(grad_bias_tma.atom)
        if const_expr(self.store_first):
            cpasync.prefetch_descriptor(dq_first.tma_store)
        if const_expr(t.dkv_by_tma):
            cpasync.prefetch_descriptor(dkv_tma.tma_dK)
            cpasync.prefetch_descriptor(dkv_tma.tma_dV)

    @cute.jit
    def make_pipelines(self, storage, warp_idx, mbar_kv, mTileCounter) -> KernelPipelines:
        """The Q / dO pipelines, K / V's (persistent CTAs; else the one mbarrier ``mbar_kv``
        initialised) and the tile ring's (``dynamic_tiles``), initialised and visible to the CTA."""
        t = self.tiles
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
        tiles_args = None  # dynamic_tiles: TileRing
        if const_expr(self.dynamic_tiles):
            # the producer warp takes tiles from the counter and hands them to the other warps
            pipe_tile = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_tile.data_ptr(),
                num_stages=t.tile_ring,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, t.num_threads - 32),
                defer_sync=True,
            )
            tiles_args = TileRing(pipe_tile, storage.sTile.get_tensor(cute.make_layout(t.tile_ring)), mTileCounter)
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
        return KernelPipelines(pipe_q, pipe_do, pipe_kv, tiles_args)
