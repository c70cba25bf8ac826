"""compute_dot_do_o (flash-attention backward preprocess), after PyTorch's
``flash_bwd_preprocess_kernel.h``.

    Δ[b, h, i] = scale * Σ_d dO[b, i, h, d] * O[b, i, h, d]     (fp32)

One CTA per (tiles_per_cta x kBlockM rows, batch, head). Each thread loads its vectors of O and dO
(GmemTiledCopydO, rows past the sequence and columns past the head dim read as
zeros), multiplies, sums its columns, and the threads of a row finish the sum with a
shuffle-xor butterfly (``Allreduce<THREADS_PER_ROW>``). Rows from the sequence end to
seqlen_q_rounded get Δ = 0. With ``clear_dq_accum`` the same launch zeroes the CTA's
rows of the fp32 dQ accumulator (``Clear_dQaccum``). With ``lse_log2`` it also writes the
forward's LSE in log2 units, LSE * log2(e), into an array shaped as Δ (0 past the sequence
end): the sm90 kernel's exp2 then needs no multiply per query (FA4's preprocess does the same).
That variant serves the sm90 kernel only and takes part in programmatic dependent launch
(sm_90): launched early, it waits for the previous kernel before touching memory, and lets
the sm90 kernel launch once its loads are done (that kernel waits for this one's results
before it reads them): the launch gaps and the sm90 kernel's prologue overlap this one.
With ``grad_lse`` (a loss on the forward's LSE too; lse_log2 only) Δ becomes Δ - dLSE on each
sequence's rows: dS = P (dP - Δ) + dLSE P, as d LSE_i / d S_ij = P_ij.
With ``sink`` (lse_log2 only) it also writes each row's term of a learnable sink's gradient,
P_sink (dLSE - Δ) with P_sink = exp(s_h - LSE) (0 past the sequence end), shaped as Δ: d s_h is
their sum over batch and rows, without another pass over O and dO.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.common.log2_units import LOG2_E
from cute_kernels.common.row_reduce import row_allreduce_sum
from layouts.attention_bwd_prepost import VARLEN_ACCUM_PAD, PrepostTiles

from .seqlen import block_coords, seq_rows
from .tile_io import clear_tile, load_tile


class ComputeDotDoO:
    """Configuration: element dtype of O/dO, tiles, variable length, fused dQaccum clear."""

    def __init__(
        self,
        dtype,
        tiles: PrepostTiles,
        varlen: bool,
        clear_dq_accum: bool,
        lse_log2: bool = False,
        grad_lse: bool = False,
        sink: bool = False,
    ):
        if dtype.width != tiles.elem_bits:
            raise ValueError(f"tiles are for {tiles.elem_bits}-bit elements, dtype is {dtype}")
        if grad_lse and not lse_log2:
            raise ValueError("grad_lse is read beside the forward's LSE: it needs lse_log2")
        if sink and not lse_log2:
            raise ValueError("the sink's terms take the forward's LSE: they need lse_log2")
        self.dtype = dtype
        self.tiles = tiles
        self.varlen = varlen
        self.clear_dq_accum = clear_dq_accum
        self.lse_log2 = lse_log2
        self.grad_lse = grad_lse
        self.sink = sink

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # [B, S, H, D] or [total_q, H, D]
        mdO: cute.Tensor,  # same shape as mO
        mDelta: cute.Tensor,  # [B, H, seqlen_q_rounded] fp32
        mdQaccum: cute.Tensor,  # [B, seqlen_q_rounded, H, kHeadDim] or [total_q + 128 B, H, kHeadDim]; or None
        mCuSeqlens: cute.Tensor,  # [B + 1] int32 (varlen) or None
        mLSE: cute.Tensor,  # the forward's [B, H, >= seqlen_q] fp32 (lse_log2) or None
        mLSElog2: cute.Tensor,  # [B, H, seqlen_q_rounded] fp32 (lse_log2) or None
        mdLSE: cute.Tensor,  # the LSE's gradient, shaped as mLSE, any strides (grad_lse) or None
        mSink: cute.Tensor,  # [H] fp32, a sink logit per head (sink) or None
        mSinkTerms: cute.Tensor,  # shaped as mDelta, the sink gradient's row terms (sink) or None
        scale: Float32,
        num_m_blocks: Int32,  # CTAs along the rows: ceil(rows / (kBlockM * tiles_per_cta))
        stream: cuda.CUstream,
    ):
        copy = self.tiles.gmem_tiled_copy_do(load=True).build(self.dtype)
        copy_acc = self.tiles.gmem_tiled_copy_dq_accum().build(Float32)
        args = (mO, mdO, mDelta, mdQaccum, mCuSeqlens, mLSE, mLSElog2, mdLSE, mSink, mSinkTerms)
        self.kernel(*args, scale, copy, copy_acc).launch(
            grid=self.tiles.grid(num_m_blocks, mDelta.shape[0], mDelta.shape[1]),
            block=[self.tiles.num_threads, 1, 1],
            stream=stream,
            use_pdl=self.lse_log2,
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mDelta: cute.Tensor,
        mdQaccum: cute.Tensor,
        mCuSeqlens: cute.Tensor,
        mLSE: cute.Tensor,
        mLSElog2: cute.Tensor,
        mdLSE: cute.Tensor,
        mSink: cute.Tensor,
        mSinkTerms: cute.Tensor,
        scale: Float32,
        copy: cute.TiledCopy,
        copy_acc: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        group, bidb, bidh = block_coords(self.tiles, mDelta.shape[1])
        if const_expr(self.lse_log2):  # launched early (PDL): the previous kernel's outputs first
            cute.arch.griddepcontrol_wait()
        tile = self.tiles.tile
        block_m = tile[0]
        n = self.tiles.tiles_per_cta
        delta_rows = mDelta.shape[2]  # seqlen_q_rounded

        mO_b, seqlen = seq_rows(mO, mCuSeqlens, bidb, bidh)
        mdO_b, _ = seq_rows(mdO, mCuSeqlens, bidb, bidh)
        head_dim = mO_b.shape[1]
        thr = copy.get_slice(tidx)
        tOc = thr.partition_S(cute.make_identity_tensor(tile))
        gDelta = mDelta[bidb, bidh, None]

        # The CTA's ``n`` row blocks, software-pipelined: block j + 1's loads are issued
        # before block j is reduced (two register buffers). Rows past the sequence load
        # as zeros, so every row below seqlen_q_rounded gets its Δ (0 past the end).
        tOg = [thr.partition_S(cute.local_tile(mO_b, tile, (group * n + j, 0))) for j in range(n)]
        tdOg = [thr.partition_S(cute.local_tile(mdO_b, tile, (group * n + j, 0))) for j in range(n)]
        bufs = [(cute.make_rmem_tensor_like(tOg[0]), cute.make_rmem_tensor_like(tdOg[0])) for _ in range(min(n, 2))]
        load_tile(copy, tOg[0], bufs[0][0], tOc, seqlen - group * n * block_m, head_dim)
        load_tile(copy, tdOg[0], bufs[0][1], tOc, seqlen - group * n * block_m, head_dim)
        for j in cutlass.range_constexpr(n):
            row0 = (group * n + j) * block_m
            if const_expr(j + 1 < n):
                nxt = bufs[(j + 1) % 2]
                load_tile(copy, tOg[j + 1], nxt[0], tOc, seqlen - row0 - block_m, head_dim)
                load_tile(copy, tdOg[j + 1], nxt[1], tOc, seqlen - row0 - block_m, head_dim)
            tOr, tdOr = bufs[j % 2]
            # dot_do_o: this thread's columns, then the row's threads
            prod = tOr.load().to(Float32) * tdOr.load().to(Float32)
            rSum = cute.make_rmem_tensor(cute.size(tOr, mode=[1]), Float32)
            rSum.store(prod.reduce(cute.ReductionOp.ADD, init_val=0.0, reduction_profile=(0, None, 1)))
            for m in cutlass.range_constexpr(cute.size(rSum)):
                rSum[m] = row_allreduce_sum(rSum[m], self.tiles.threads_per_row) * scale
            if tOc[0, 0, 0][1] == 0:  # the first thread of each row writes it
                for m in cutlass.range_constexpr(cute.size(rSum)):
                    r = row0 + tOc[0, m, 0][0]
                    if r < delta_rows:
                        delta = rSum[m]
                        if const_expr(self.lse_log2):
                            lse = Float32(0.0)
                            if r < seqlen:
                                lse = mLSE[bidb, bidh, r] * LOG2_E
                                if const_expr(self.grad_lse):  # (past the sequence: padding, left 0)
                                    delta = delta - mdLSE[bidb, bidh, r]
                            mLSElog2[bidb, bidh, r] = lse
                            if const_expr(self.sink):  # P_sink (dLSE - Δ); delta is Δ - dLSE here
                                term = Float32(0.0)
                                if r < seqlen:
                                    p_sink = cute.math.exp2(mSink[bidh] * LOG2_E - lse, fastmath=True)
                                    term = -p_sink * delta
                                mSinkTerms[bidb, bidh, r] = term
                        gDelta[r] = delta

        if const_expr(self.lse_log2):
            # every load of this CTA is done: the sm90 kernel may launch (it waits for this
            # grid's completion before reading Δ, LSE or the accumulator)
            cute.arch.griddepcontrol_launch_dependents()
        if const_expr(self.clear_dq_accum):
            mAcc_b, _ = seq_rows(mdQaccum, mCuSeqlens, bidb, bidh, VARLEN_ACCUM_PAD if self.varlen else 0)
            acc_rows = seqlen + VARLEN_ACCUM_PAD if const_expr(self.varlen) else mdQaccum.shape[1]
            thr_acc = copy_acc.get_slice(tidx)
            tAc = thr_acc.partition_D(cute.make_identity_tensor(tile))
            for j in cutlass.range_constexpr(n):
                m_block = group * n + j
                tAg = thr_acc.partition_D(cute.local_tile(mAcc_b, tile, (m_block, 0)))
                clear_tile(copy_acc, tAg, tAc, acc_rows - m_block * block_m)
