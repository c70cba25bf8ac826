"""Hopper-native attention forward: O = softmax(Q K^T * scale) V and its LSE, a query block per CTA.

The decomposition (warpgroups, products, shared memory) is in ``layouts/attention_fwd_sm90.py``.
The producer warp loads Q once and the key / value blocks through a TMA ring; each consumer
warpgroup owns 64 query rows and walks the key blocks from the last one the mask lets its
block see down to the first, overlapping within itself the next block's S = Q K^T with the
previous block's O += P V (the softmax of block j runs while P V of block j - 1 is in flight)
and, with two or more consumer warpgroups, taking turns with the others to issue products
(named barriers), so one's softmax hides behind another's tensor-core work.

The softmax is online and in log2 units: per row the running max m and sum l; each block's
scores are exp2(S * scale * log2(e) - m * scale * log2(e)), O and l are rescaled when m grows;
at the end O / l and LSE = (m * scale * log2(e) + log2(l)) * ln(2) (natural log, as torch's).
A row that sees no key has O = 0 and LSE = 0, as torch's forward writes (every one of its
probabilities is masked in the backward too).

An additive bias enters the scores in log2 units (S * scale * log2(e) + B * log2(e), the softmax
then with scale 1); dropout zeroes the probabilities fed to P V where torch's memory-efficient
forward drops them (its Philox draw, per block into shared memory) while the row sums and the
LSE stay the undropped softmax's, and O takes the 1 / (1 - p) at the end
(``forward_features.py``). A softcap c caps S * scale at c tanh(S * scale / c) before the bias
and the mask: tanh takes S * scale / c in place, and the softmax's log2 multiplier is c log2(e)
instead of scale log2(e) (``cute_kernels/attention/softcap.py``).

A learnable sink s_h (one logit per query head, no value row) joins each row's softmax
denominator in ``finalize``: l' = l 2^(m' - r) + 2^(s_h log2(e) - r) with m' the row max in log2
units and r = max(m', s_h log2(e)) (no overflow either way), O scaled by 2^(m' - r) / l', LSE =
(r + log2 l') ln 2. A row that saw no key (m' = -inf) gets O = 0 and LSE = s_h.

O leaves through shared memory (Q's buffer where Dv <= Dqk, which every product has read by
then) by a TMA store; the LSE rows [B, H, lse_rows] are written by the threads that own them,
+inf past the sequence (torch's padded rows).
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from cute_kernels.attention.dropout import PhiloxArgs
from cute_kernels.attention.mask import AttentionMask
from cute_kernels.attention.named_barrier import NamedBarrierFwd
from cute_kernels.attention.seqlen_info import Rows, SeqlenInfo
from cute_kernels.attention.softcap import cap_scores
from cute_kernels.attention.tile_scheduler import GridTileScheduler, TileSchedulerParams
from cute_kernels.attention.varlen_scheduler import VarlenTileParams, VarlenTileScheduler, varlen_grid_ctas
from cute_kernels.common.convert import convert_packed
from cute_kernels.common.log2_units import LN_2, LOG2_E
from cute_kernels.common.views import select_modes, transpose_view
from layouts.attention_fwd_sm90 import (
    KEEP_FLAG_ALIGN,
    KEEP_FLAG_BUFFERS,
    SMEM_ALIGN,
    SMEM_LIMIT,
    AttentionFwdSm90Tiles,
)

from .forward_arguments import Atoms, Globals, QueryBlock, Scalars, Smem
from .forward_config import CONSUMER_REGS, LPT_L2_BYTES, PRODUCER_REGS, pingpong, sum_chains
from .forward_features import ForwardFeaturesMixin
from .wgmma import acc_as_operand_a, acc_mn_layout, wgmma

PARTIALS = 4  # independent max chains of a softmax row


def pairwise(values: list, combine=lambda a, b: a + b):
    """values[0] combined with values[1], ... as a tree (neighbours first; traced: the list's
    length is static): independent chains meet in log2(len) steps."""
    while len(values) > 1:
        values = [combine(*values[i : i + 2]) if i + 1 < len(values) else values[i] for i in range(0, len(values), 2)]
    return values[0]


class AttentionForwardSm90(ForwardFeaturesMixin):
    """Configuration: element type, tiles, mask (0 none, 1 causal from the top-left, 2 from the
    bottom-right: key k sees query q when k <= q + offset, offset = Sk - Sq for 2) and, with a
    causal mask, a sliding window (also k > q + offset - window_size; a runtime argument).
    Key / value heads serve ``group`` consecutive query heads each (grouped-query attention).

    ``varlen``: sequences of different lengths packed along the rows of batch-1 tensors
    (``cu_seqlens_q / _k``: int32 [sequences + 1]); the grid's batch is the sequence, every
    mask is per sequence, a query block past its sequence's end does nothing, and O's rows
    leave by vector stores that stop at the sequence's end. The LSE is [sequences, H, rows].

    ``has_bias``: B [B, H, Sq, Sk] (any strides, 0 for broadcast dims; not with varlen) is added to
    the scaled scores, read per block from global memory. ``dropout``: P V takes torch's
    memory-efficient forward's keep mask (curand's Philox, one stream word per (query, key):
    ``common/philox.py``), the same bits the sm90 backward redraws; the LSE is the undropped
    softmax's. ``softcap``: the scores are capped (module notes), the cap c a runtime argument.

    ``seqused``: int32 [sequences] used lengths of queries and keys (``SeqlenInfo``): each
    sequence's lengths are its used ones, for the masks too; rows past them are padding. A tile
    straddling the end still loads it (TMA takes whole tiles): padding keys are masked, padding
    values get weight 0 (so they must be finite), padding query rows get O := 0 before the store;
    a query block wholly past the used rows does nothing (the host zeroes O and fills the LSE).
    ``sink``: a learnable sink per query head (fp32 [H], module notes) joins every row's sum."""

    def __init__(
        self,
        dtype,
        tiles: AttentionFwdSm90Tiles,
        mask_type: int,
        has_window: bool = False,
        varlen: bool = False,
        has_bias: bool = False,
        dropout: bool = False,
        softcap: bool = False,
        seqused: bool = False,
        sink: bool = False,
    ):
        if has_window and mask_type == 0:
            raise ValueError("a sliding window needs a causal mask (mask_type 1 or 2)")
        if mask_type not in (0, 1, 2):
            raise ValueError(f"mask type {mask_type}")
        if has_bias and varlen:
            raise NotImplementedError("attention bias with variable lengths (torch's forward refuses it too)")
        if seqused and (has_bias or dropout):
            raise NotImplementedError("used lengths (seqused) with an attention bias or dropout")
        if tiles.smem_bytes(dtype.width // 8, dropout=dropout) > SMEM_LIMIT:
            raise ValueError(f"tiles {tiles} need more shared memory than a CTA has (dropout: {dropout})")
        self.dtype = dtype
        self.tiles = tiles
        self.mask_type = mask_type
        self.has_window = has_window
        self.varlen = varlen
        self.has_bias = has_bias
        self.dropout = dropout
        self.softcap = softcap
        self.seqused = seqused
        self.sink = sink
        self.mask = AttentionMask(tiles.tile_m, tiles.tile_n, mask_type, has_window, varlen)
        self.scheduler = GridTileScheduler(lpt=mask_type != 0)
        if varlen:  # a CTA a real query block, the sequences' heads in sections that fit L2
            self.scheduler = VarlenTileScheduler(tiles.tile_m, lpt=mask_type != 0)
        self.pingpong = pingpong(tiles)
        self.sum_chains = sum_chains(tiles)

    # ---------------------------------------------------------------------------- launch
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, Sq, H, Dqk]
        mK: cute.Tensor,  # [B, Sk, Hk, Dqk]
        mV: cute.Tensor,  # [B, Sk, Hk, Dv]
        mO: cute.Tensor,  # [B, Sq, H, Dv]
        mLSE: cute.Tensor,  # [B, H, lse_rows] fp32, lse_rows >= Sq (varlen: [sequences, H, lse_rows])
        mCuSeqlensQ: Optional[cute.Tensor],  # varlen: int32 [sequences + 1] (else None)
        mCuSeqlensK: Optional[cute.Tensor],
        max_seqlen_q: Int32,  # varlen: the longest sequence's queries (unused: the grid comes from the lengths)
        softmax_scale: Float32,
        window_size: Int32,
        heads_per_chunk: Int32,  # causal: (batch, head) pairs a chunk of the heavy-first order (>= 1)
        mBias: Optional[cute.Tensor],  # [B, H, Sq, Sk] (has_bias), or None
        philox_seed,  # dropout (None without): Int64 seed and offset, p and 1 / (1 - p) (Float32),
        philox_offset,  # the stream words of one (batch, head): Mq * Mk (varlen: max_seqlen_q * max_seqlen_k)
        dropout_p,
        dropout_scale,
        dropout_bh_elems,
        softcap: Float32,  # the cap c (softcap; unused without)
        mSeqUsedQ: Optional[cute.Tensor],  # seqused: int32 [sequences], each one's used query rows (else None)
        mSeqUsedK: Optional[cute.Tensor],  # ... used key rows
        mSink: Optional[cute.Tensor],  # fp32 [H], natural-log units (sink), or None
        stream: cuda.CUstream,
    ):
        t = self.tiles
        # (seq, d, heads, batch): TMA tiles the first two modes
        mQ, mK, mV, mO = [select_modes(x, (1, 3, 2, 0)) for x in (mQ, mK, mV, mO)]
        sQ_layout = t.smem_layout_q(self.dtype)
        sK_layout = t.smem_layout_k(self.dtype)
        sV_layout = t.smem_layout_v(self.dtype)
        sO_layout = t.smem_layout_o(self.dtype)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_Q, gQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ, sQ_layout, (t.tile_m, t.head_dim))
        tma_K, gK_tma = cpasync.make_tiled_tma_atom(
            g2s, mK, cute.select(sK_layout, mode=[0, 1]), (t.tile_n, t.head_dim)
        )
        tma_V, gV_tma = cpasync.make_tiled_tma_atom(
            g2s, mV, cute.select(sV_layout, mode=[0, 1]), (t.tile_n, t.head_dim_v)
        )
        tma_O, gO_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sO_layout, (t.tile_m, t.head_dim_v)
        )
        elem = self.dtype.width // 8
        self.q_bytes = t.tile_m * t.head_dim * elem
        self.k_bytes = t.tile_n * t.head_dim * elem
        self.v_bytes = t.tile_n * t.head_dim_v * elem

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 1]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * t.stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * t.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], SMEM_ALIGN]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], SMEM_ALIGN]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], SMEM_ALIGN]
            if const_expr(not t.o_in_q):
                sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], SMEM_ALIGN]
            if const_expr(self.dropout):
                sKeep: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Uint8, KEEP_FLAG_BUFFERS * t.keep_flag_bytes], KEEP_FLAG_ALIGN
                ]

        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        heads, batches = mQ.shape[2], mQ.shape[3]
        m_blocks = cute.ceil_div(seqlen_q, t.tile_m)
        # causal: a 1-D grid in the scheduler's heavy-first order, the longest query blocks (the
        # last) first within each chunk of (batch, head) pairs whose K / V fit L2 together; else a
        # head's blocks are neighbours in launch order, so its K / V stay in L2 between them
        sched = TileSchedulerParams(m_blocks, heads, batches, heads_per_chunk)
        grid = (sched.total, 1, 1) if const_expr(self.scheduler.lpt) else (m_blocks, heads, batches)
        if const_expr(self.varlen):  # a 1-D grid over the sequences' real blocks
            batches = mCuSeqlensQ.shape[0] - 1
            l2_rows = Int32(LPT_L2_BYTES // ((t.head_dim + t.head_dim_v) * elem)) * (heads // mK.shape[2])
            sched = VarlenTileParams(batches, heads, l2_rows)
            grid = (varlen_grid_ctas(seqlen_q, batches, heads, t.tile_m), 1, 1)
        rng = None
        if const_expr(self.dropout):
            rng = PhiloxArgs(philox_seed, philox_offset, dropout_p, dropout_scale, dropout_bh_elems)
        scale_log2, tanh_scale = softmax_scale * LOG2_E, softmax_scale
        if const_expr(self.softcap):  # tanh(S scale / c), then c log2(e) in the softmax
            scale_log2, tanh_scale = softcap * LOG2_E, softmax_scale / softcap
        self.kernel(
            gQ_tma,
            gK_tma,
            gV_tma,
            gO_tma,
            mO,
            mLSE,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedQ,
            mSeqUsedK,
            mBias,
            mSink,
            rng,
            tma_Q,
            tma_K,
            tma_V,
            tma_O,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            t.tiled_mma_qk(self.dtype),
            t.tiled_mma_pv(self.dtype),
            seqlen_q,
            seqlen_k,
            heads // mK.shape[2],
            sched,
            scale_log2,
            tanh_scale,
            window_size,
            SharedStorage,
        ).launch(grid=grid, block=[t.num_threads, 1, 1], min_blocks_per_mp=1, stream=stream)

    # ---------------------------------------------------------------------------- kernel
    @cute.kernel
    def kernel(
        self,
        gQ_tma: cute.Tensor,
        gK_tma: cute.Tensor,
        gV_tma: cute.Tensor,
        gO_tma: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mBias: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],
        rng: Optional[PhiloxArgs],
        tma_Q: cute.CopyAtom,
        tma_K: cute.CopyAtom,
        tma_V: cute.CopyAtom,
        tma_O: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        seqlen_q: Int32,
        seqlen_k: Int32,
        group: Int32,
        sched,  # TileSchedulerParams; VarlenTileParams with packed sequences
        scale_log2: Float32,
        tanh_scale: Float32,
        window_size: Int32,
        SharedStorage: cutlass.Constexpr,
    ):
        t = self.tiles
        if const_expr(self.varlen):
            m_block, head, batch = self.scheduler.cta_coords(sched, mCuSeqlensQ, mCuSeqlensK)
        else:
            m_block, head, batch = self.scheduler.cta_coords(sched)
            if const_expr(self.scheduler.lpt):  # heavy-first: the last query blocks see the most keys
                m_block = sched.n_blocks - 1 - m_block
        # where the CTA's sequence starts in the packed rows (varlen) and its (used) lengths
        seq = SeqlenInfo.create(
            batch,
            seqlen_q,
            seqlen_k,
            mCuSeqlensQ if const_expr(self.varlen) else None,
            mCuSeqlensK if const_expr(self.varlen) else None,
            mSeqUsedQ if const_expr(self.seqused) else None,
            mSeqUsedK if const_expr(self.seqused) else None,
        )
        offset_q, offset_k, seqlen_q, seqlen_k = seq.offset_q, seq.offset_k, seq.seqlen_q, seq.seqlen_k
        if m_block * t.tile_m < seqlen_q:  # (varlen: a block past its sequence does nothing)
            self.tile(
                Globals(gQ_tma, gK_tma, gV_tma, gO_tma, mO, mLSE, mBias, mSink, rng),
                Atoms(
                    tma_Q, tma_K, tma_V, tma_O, sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma_qk, tiled_mma_pv
                ),
                QueryBlock(m_block, head, batch, Rows(offset_q, offset_k), seqlen_q, seqlen_k),
                Scalars(group, scale_log2, tanh_scale, window_size),
                SharedStorage,
            )

    @cute.jit
    def tile(self, g: Globals, atoms: Atoms, block: QueryBlock, scalars: Scalars, SharedStorage: cutlass.Constexpr):
        """One query block: the shared memory, the pipelines, then the producer and consumer roles."""
        t = self.tiles
        m_block, head, batch = block.m_block, block.head, block.batch
        offset_q, offset_k = block.rows.offset_q, block.rows.offset_k
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (atoms.tma_Q, atoms.tma_K, atoms.tma_V, atoms.tma_O):
                cpasync.prefetch_descriptor(atom)
        smem = self.shared(atoms, warp_idx, SharedStorage)

        n_min, n_max = self.mask.n_block_range(m_block, block.seqlen_q, block.seqlen_k, scalars.window_size)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS[t.consumer_wgs])
            if warp_idx == 0:
                q_tile = cute.local_tile(
                    self.seq_view(g.gQ_tma, head, batch, offset_q), (t.tile_m, t.head_dim), (m_block, 0)
                )
                kv_head = head // scalars.group
                self.load(
                    q_tile,
                    self.seq_view(g.gK_tma, kv_head, batch, offset_k),
                    self.seq_view(g.gV_tma, kv_head, batch, offset_k),
                    smem,
                    atoms,
                    n_min,
                    n_max,
                )
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS[t.consumer_wgs])
            feat = self.features(g.mBias, smem.sKeep, g.rng, batch, head, g.mLSE.shape[1], g.mSink)
            acc_O, row_sum = self.mma(smem, atoms, block, scalars, n_min, n_max, feat)
            self.stage_o(acc_O, smem.sO, atoms.tiled_mma_pv)
            if const_expr(self.varlen):
                o_rows = cute.local_tile(
                    self.seq_view(g.mO, head, batch, offset_q), (t.tile_m, t.head_dim_v), (m_block, 0)
                )
                self.store_o_rows(smem.sO, o_rows, m_block, block.seqlen_q)
            else:
                o_tile = cute.local_tile(g.gO_tma[None, None, head, batch], (t.tile_m, t.head_dim_v), (m_block, 0))
                self.store_o_tma(smem.sO, o_tile, atoms.tma_O)
            self.store_lse(row_sum, g.mLSE, atoms.tiled_mma_qk, m_block, head, batch, block.seqlen_q)

    @cute.jit
    def shared(self, atoms: Atoms, warp_idx, SharedStorage: cutlass.Constexpr) -> Smem:
        """The CTA's shared memory as tensors, Q's mbarrier and the K / V pipelines, initialised
        (a barrier before any role uses them)."""
        t = self.tiles
        sQ_layout, sK_layout, sV_layout, sO_layout = atoms.sQ_layout, atoms.sK_layout, atoms.sV_layout, atoms.sO_layout
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(t.o_in_q):
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sKeep = None
        if const_expr(self.dropout):
            sKeep = storage.sKeep.get_tensor(cute.make_layout(KEEP_FLAG_BUFFERS * t.keep_flag_bytes))
        mbar_q = storage.mbar_q.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_q, 1)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, t.num_mma_threads // 32)
        pipe_k, pipe_v = (
            pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(),
                num_stages=t.stages,
                producer_group=producer,
                consumer_group=consumers,
                tx_count=nbytes,
                defer_sync=True,
            )
            for mbar, nbytes in ((storage.mbar_k, self.k_bytes), (storage.mbar_v, self.v_bytes))
        )
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return Smem(sQ, sK, sV, sO, sKeep, mbar_q, pipe_k, pipe_v)

    @cute.jit
    def seq_view(self, g, head, batch, row0):
        """(rows, d) view of one head of one sequence: the batch index, or with varlen the
        packed rows from ``row0`` on (a TMA coordinate tensor or a global tensor alike)."""
        if const_expr(self.varlen):
            return cute.domain_offset((row0, 0), g[None, None, head, 0])
        return g[None, None, head, batch]

    @cute.jit
    def load(self, q_tile, gK, gV, smem: Smem, atoms: Atoms, n_min, n_max):
        """Q, then the key / value blocks n_max - 1 down to n_min through the rings."""
        t = self.tiles
        sQ, sK, sV, mbar_q, pipe_k, pipe_v = smem.sQ, smem.sK, smem.sV, smem.mbar_q, smem.pipe_k, smem.pipe_v
        tma_Q, tma_K, tma_V = atoms.tma_Q, atoms.tma_K, atoms.tma_V
        one = cute.make_layout(1)
        tQs, tQg = cpasync.tma_partition(tma_Q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(q_tile, 0, 2))
        gK_blocks = cute.local_tile(gK, (t.tile_n, t.head_dim), (None, 0))  # (tile_n, d, blocks)
        gV_blocks = cute.local_tile(gV, (t.tile_n, t.head_dim_v), (None, 0))
        tKs, tKg = cpasync.tma_partition(tma_K, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK_blocks, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_V, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV_blocks, 0, 2))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_q, self.q_bytes)
        cute.copy(tma_Q, tQg, tQs, tma_bar_ptr=mbar_q)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.stages)
        for i in cutlass.range(n_max - n_min, unroll=1):
            n_block = n_max - 1 - i
            pipe_k.producer_acquire(state)
            cute.copy(tma_K, tKg[None, n_block], tKs[None, state.index], tma_bar_ptr=pipe_k.producer_get_barrier(state))
            pipe_v.producer_acquire(state)
            cute.copy(tma_V, tVg[None, n_block], tVs[None, state.index], tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()

    # -------------------------------------------------------------------------- consumers
    @cute.jit
    def mma(self, smem: Smem, atoms: Atoms, block: QueryBlock, scalars: Scalars, n_min, n_max, feat):
        """The warpgroup's O (normalised) and its rows' LSE, over the key blocks the query block sees
        (``feat``: the CTA's ``ForwardFeatures``; ``scalars.tanh_scale``: scale / c with a softcap,
        whose ``scalars.scale_log2`` is then c log2(e))."""
        t = self.tiles
        sQ, sK, sV, mbar_q, pipe_k, pipe_v = smem.sQ, smem.sK, smem.sV, smem.mbar_q, smem.pipe_k, smem.pipe_v
        tiled_mma_qk, tiled_mma_pv = atoms.tiled_mma_qk, atoms.tiled_mma_pv
        m_block, seqlen_q, seqlen_k = block.m_block, block.seqlen_q, block.seqlen_k
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(transpose_view(sV)))
        shape_S = thr_qk.partition_shape_C((t.tile_m, t.tile_n))
        acc_S = cute.make_rmem_tensor(shape_S, Float32)
        acc_O = cute.make_rmem_tensor(tiled_mma_pv.get_slice(tidx).partition_shape_C((t.tile_m, t.head_dim_v)), Float32)
        acc_O.fill(0.0)
        rP = cute.make_rmem_tensor(shape_S, self.dtype)
        tOrP = cute.make_tensor(rP.iterator, acc_as_operand_a(rP.layout))
        # the mask compares thread 0's columns, compile-time constants (AttentionMask.apply)
        cS = self.coords_mn(tiled_mma_qk.get_slice(tidx), (t.tile_m, t.tile_n))
        t0S = self.coords_mn(tiled_mma_qk.get_slice(0), (t.tile_m, t.tile_n))
        S = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
        rows = cute.size(S, mode=[0])
        row_max = cute.make_rmem_tensor(rows, Float32)
        row_sum = cute.make_rmem_tensor(rows, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        row_scale = cute.make_rmem_tensor(rows, Float32)
        q0 = m_block * t.tile_m
        offset = self.mask.causal_offset(seqlen_q, seqlen_k)
        # with a bias the scores enter the softmax already in log2 units
        sm_scale = 1.0 if const_expr(self.has_bias) else scalars.scale_log2

        self.take_turn_init(wg)
        cute.arch.mbarrier_wait(mbar_q, 0)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        if n_min < n_max:
            # the last block the query block sees: always masked (sequence end, diagonal)
            key0 = (n_max - 1) * t.tile_n
            pipe_k.consumer_wait(state)
            wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
            if const_expr(self.dropout):  # while the tensor cores compute S
                self.draw_keep_flags(feat, 0, q0, key0, seqlen_k, tidx)
            warpgroup.wait_group(0)
            pipe_k.consumer_release(state)
            self.scores(acc_S, S, cS, t0S, feat, q0, key0, offset, block, scalars, first=True)
            self.online_softmax(S, row_max, row_sum, sm_scale, None)
            if const_expr(self.dropout):
                self.keep_probs(S, feat, 0, cS, t0S, wg)
            convert_packed(acc_S, rP)
            for i in cutlass.range(1, n_max - n_min, unroll=1):
                key0 = (n_max - 1 - i) * t.tile_n
                if const_expr(self.dropout):  # before the turn: P and O are all the registers held
                    self.draw_keep_flags(feat, i, q0, key0, seqlen_k, tidx)
                state_v = state.clone()
                state.advance()
                pipe_k.consumer_wait(state)
                self.take_turn(wg)
                wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
                pipe_v.consumer_wait(state_v)
                wgmma(tiled_mma_pv, acc_O, tOrP, tOrV[None, None, None, state_v.index], zero_init=False)
                self.pass_turn(wg)
                warpgroup.wait_group(1)  # S done, P V may still run
                pipe_k.consumer_release(state)
                self.scores(acc_S, S, cS, t0S, feat, q0, key0, offset, block, scalars, first=False)
                self.online_softmax(S, row_max, row_sum, sm_scale, row_scale)
                warpgroup.wait_group(0)  # P V has read P
                pipe_v.consumer_release(state_v)
                self.rescale_rows(acc_O, row_scale)
                if const_expr(self.dropout):
                    self.keep_probs(S, feat, i, cS, t0S, wg)
                convert_packed(acc_S, rP)
            pipe_v.consumer_wait(state)
            wgmma(tiled_mma_pv, acc_O, tOrP, tOrV[None, None, None, state.index], zero_init=False)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(state)
        o_scale = feat.philox.scale if const_expr(self.dropout) else None
        lse = self.finalize(acc_O, row_max, row_sum, sm_scale, o_scale, feat.sink)
        if const_expr(self.seqused):  # a straddling block's padding rows leave by the TMA store too
            self.zero_rows_past(acc_O, cS, q0, seqlen_q)
        return acc_O, lse

    @cute.jit
    def scores(self, acc_S, S, cS, t0S, feat, q0, key0, offset, block, scalars, first: cutlass.Constexpr):
        """The key block's scores after S = Q K^T: capped (softcap), with the bias, masked. The
        first block the query block sees (the last key block) is always masked: it holds the
        sequence's end and the diagonal; the keys of every later one lie before the end, so it
        is masked only where it crosses the diagonal or the window's edge. ``S``: acc_S as rows x
        columns; ``cS`` / ``t0S``: this thread's and thread 0's coordinates."""
        if const_expr(self.softcap):
            cap_scores(acc_S, scalars.tanh_scale)
        if const_expr(self.has_bias):
            self.add_bias(acc_S, S, feat, cS, q0, key0, block.seqlen_q, block.seqlen_k, scalars.scale_log2)
        if const_expr(first):
            self.mask.apply(S, cS, t0S, q0, key0, block.seqlen_k, offset, scalars.window_size)
        elif const_expr(self.mask.causal or self.mask.has_window):
            if self.mask.crosses_diagonal(q0, key0, offset, scalars.window_size):
                self.mask.apply(S, cS, t0S, q0, key0, block.seqlen_k, offset, scalars.window_size)

    @cute.jit
    def zero_rows_past(self, acc_O, cS, q0, seqlen_q):
        """O := 0 on the rows past the sequence's queries (``cS``: S's coordinates, whose rows O's
        share). A select, not a scale: those rows attended with whatever the padding holds."""
        A = cute.make_tensor(acc_O.iterator, acc_mn_layout(acc_O.layout))
        for r in cutlass.range_constexpr(cute.size(A, mode=[0])):
            if q0 + cS[r, 0][0] >= seqlen_q:
                for c in cutlass.range_constexpr(cute.size(A, mode=[1])):
                    A[r, c] = Float32(0.0)

    @staticmethod
    def coords_mn(thr_mma, shape):
        """(row, column) in the block of each accumulator value of ``thr_mma``'s thread, rows x columns."""
        c = thr_mma.partition_C(cute.make_identity_tensor(shape))
        return cute.make_tensor(c.iterator, acc_mn_layout(c.layout))

    @cute.jit
    def online_softmax(self, S, row_max, row_sum, scale_log2, row_scale):
        """S <- exp2(S * scale_log2 - m * scale_log2) per row with the running max m (over the
        four threads of a row), the running sum kept per thread (summed over them at the end).
        ``row_scale``: where O must be rescaled by exp2((m_old - m) * scale_log2) (None: the
        first block, nothing to rescale). The maxima run as PARTIALS independent chains, the sum
        as ``sum_chains`` (forward_config): one chain (l * scale + p_0 + p_1 + ...) spaces the
        exp2s out, each beside the add that waits on it."""
        cols = cute.size(S, mode=[1])
        for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
            part = [S[r, i] for i in range(PARTIALS)]
            for c in cutlass.range_constexpr(PARTIALS, cols):
                part[c % PARTIALS] = cute.arch.fmax(part[c % PARTIALS], S[r, c])
            m = pairwise(part, cute.arch.fmax)
            m = cute.arch.fmax(m, row_max[r])
            m = cute.arch.warp_reduction_max(m, threads_in_group=4)
            m_old = row_max[r]
            row_max[r] = m
            m_safe = m
            if m == -Float32.inf:  # a row with nothing seen yet
                m_safe = Float32(0.0)
            m_scaled = m_safe * scale_log2
            for c in cutlass.range_constexpr(cols):
                S[r, c] = cute.math.exp2(S[r, c] * scale_log2 - m_scaled, fastmath=True)
            # the rescaled running sum opens the one chain (l * scale + p_0 + ...), or joins the
            # chains' total (the forms timed in forward_config.sum_chains)
            n = self.sum_chains
            part = [S[r, i] for i in range(n)]
            if const_expr(row_scale is not None):
                scale = cute.math.exp2((m_old - m_safe) * scale_log2, fastmath=True)
                row_scale[r] = scale
                if const_expr(n == 1):
                    part[0] = row_sum[r] * scale + part[0]
            for c in cutlass.range_constexpr(n, cols):
                part[c % n] = part[c % n] + S[r, c]
            total = pairwise(part)
            if const_expr(row_scale is not None and n > 1):
                total = row_sum[r] * scale + total
            row_sum[r] = total

    @cute.jit
    def rescale_rows(self, acc, row_scale):
        A = cute.make_tensor(acc.iterator, acc_mn_layout(acc.layout))
        cols = cute.size(A, mode=[1])
        for r in cutlass.range_constexpr(cute.size(A, mode=[0])):
            for c0 in cutlass.range_constexpr(0, cols, 32):  # (the DSL warns of a static loop of 64: d256's O)
                for c in cutlass.range_constexpr(c0, min(c0 + 32, cols)):
                    A[r, c] = A[r, c] * row_scale[r]

    @cute.jit
    def finalize(self, acc_O, row_max, row_sum, scale_log2, o_scale=None, sink_log2=None):
        """O / l in place and the rows' LSE (natural log; 0 where the row saw no key). ``o_scale``:
        dropout's 1 / (1 - p) on O (None without). ``sink_log2``: the head's sink in log2 units,
        joining every row's sum (module notes; None without)."""
        scale = cute.make_rmem_tensor(cute.size(row_sum), Float32)
        lse = cute.make_rmem_tensor(cute.size(row_sum), Float32)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
            m = row_max[r] * scale_log2  # the unit of O and total (-inf: no key seen)
            o_unit = Float32(1.0)
            if const_expr(sink_log2 is not None):
                ref = cute.arch.fmax(m, sink_log2)
                if ref == -Float32.inf:  # no key and a sink of -inf: nothing at all (LSE 0, O 0)
                    ref = Float32(0.0)
                o_unit = cute.math.exp2(m - ref, fastmath=True)
                total = total * o_unit + cute.math.exp2(sink_log2 - ref, fastmath=True)
                m = ref
            scale[r] = Float32(0.0)
            lse[r] = Float32(0.0)
            if total > 0.0:
                scale[r] = cute.arch.rcp_approx(total)
                if const_expr(sink_log2 is not None):
                    scale[r] = scale[r] * o_unit
                if const_expr(o_scale is not None):
                    scale[r] = scale[r] * o_scale
                lse[r] = (m + cute.math.log2(total, fastmath=True)) * LN_2
        self.rescale_rows(acc_O, scale)
        return lse

    # --------------------------------------------------------------------- ping-pong turns
    @cute.jit
    def take_turn_init(self, wg):
        """Warpgroup 0 takes the first turn: its own barrier's other half is this arrival."""
        if const_expr(self.pingpong):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=int(NamedBarrierFwd.TURN_WG0), number_of_threads=256)

    @cute.jit
    def take_turn(self, wg):
        """Wait until the previous warpgroup has issued its products."""
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=int(NamedBarrierFwd.TURN_WG0) + wg, number_of_threads=256)

    @cute.jit
    def pass_turn(self, wg):
        """Let the next warpgroup issue its products."""
        if const_expr(self.pingpong):
            nxt = wg + 1
            if nxt == self.tiles.consumer_wgs:
                nxt = 0
            cute.arch.barrier_arrive(barrier_id=int(NamedBarrierFwd.TURN_WG0) + nxt, number_of_threads=256)

    # ------------------------------------------------------------------------- epilogue
    @cute.jit
    def stage_o(self, acc_O, sO, tiled_mma_pv):
        """O (cast) into its staging buffer by stmatrix, once every consumer's products have
        read Q (whose buffer it may be)."""
        t = self.tiles
        tidx = cute.arch.thread_idx()[0] - 128
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE), number_of_threads=t.num_mma_threads)
        r2s = t.r2s_copy_o(self.dtype, tiled_mma_pv)
        thr = r2s.get_slice(tidx)
        rO = cute.make_rmem_tensor(acc_O.shape, self.dtype)
        convert_packed(acc_O, rO)
        cute.copy(r2s, thr.retile(rO), thr.partition_D(sO))

    @cute.jit
    def store_o_tma(self, sO, o_tile, tma_O):
        """The staged O by one TMA store (rows past the tensor are clipped by the TMA unit)."""
        t = self.tiles
        cute.arch.fence_view_async_shared()  # visible to the TMA unit
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE_STAGED), number_of_threads=t.num_mma_threads)
        if cute.arch.thread_idx()[0] == 128:
            ts, tg = cpasync.tma_partition(
                tma_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(o_tile, 0, 2)
            )
            cute.copy(tma_O, ts, tg)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def store_o_rows(self, sO, o_rows, m_block, seqlen_q):
        """The staged O by every consumer thread's 16-byte stores, rows up to the sequence's end."""
        t = self.tiles
        tidx = cute.arch.thread_idx()[0] - 128
        cute.arch.barrier(barrier_id=int(NamedBarrierFwd.EPILOGUE_STAGED), number_of_threads=t.num_mma_threads)
        tile = (t.tile_m, t.head_dim_v)
        cO = cute.local_tile(cute.make_identity_tensor((seqlen_q, t.head_dim_v)), tile, (m_block, 0))
        s2g = t.s2g_copy_o(self.dtype)
        thr = s2g.get_slice(tidx)
        tS, tG, tC = thr.partition_S(sO), thr.partition_D(o_rows), thr.partition_D(cO)
        for r in cutlass.range_constexpr(cute.size(tS, mode=[1])):
            if tC[0, r, 0][0] < seqlen_q:
                cute.copy(s2g, tS[None, r, None], tG[None, r, None])

    @cute.jit
    def store_lse(self, lse, mLSE, tiled_mma_qk, m_block, head, batch, seqlen_q):
        """Each row's LSE by the first of its four threads; +inf on the padded rows past Sq."""
        t = self.tiles
        tidx = cute.arch.thread_idx()[0] - 128
        cS_mn = self.coords_mn(tiled_mma_qk.get_slice(tidx), (t.tile_m, t.tile_n))
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                q = m_block * t.tile_m + cS_mn[r, 0][0]
                if q < mLSE.shape[2]:
                    value = lse[r]
                    if q >= seqlen_q:
                        value = Float32.inf
                    mLSE[batch, head, q] = value
