"""The sm90 backward's dK / dV epilogues: by rows from registers, through shared memory by
TMA or 16-byte vectors, and the persistent CTAs' staged tiles."""

import functools

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import cpasync

from cute_kernels.attention.named_barrier import NamedBarrier
from cute_kernels.common.convert import convert_packed

from .arguments import DkvOut


class EpilogueMixin:
    """dK / dV out of the consumers' accumulators (``AttentionBackwardSm90``'s configuration)."""

    @cute.jit
    def epilogue(
        self,
        acc_dK,
        acc_dV,
        dkv_out: DkvOut,
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
        stored, rows past seqlen_k dropped."""
        t = self.tiles
        mdK, mdV = dkv_out.mdK, dkv_out.mdV
        self.grad_bias_wait(tidx % 128 == 0)
        acc_dK.store(acc_dK.load() * softmax_scale)
        by_rows = functools.partial(
            self.store_dkv_rows,
            acc_dK=acc_dK,
            acc_dV=acc_dV,
            mdK=mdK,
            mdV=mdV,
            tiled_mma_dkv=tiled_mma_dkv,
            tiled_mma_dv=tiled_mma_dv,
            tidx=tidx,
            n_block=n_block,
            head_kv=head_kv,
            batch=batch,
            offset_k=rows.offset_k,
            seqlen_k=seqlen_k,
        )
        by_tma = functools.partial(
            self.store_tiles_tma,
            acc_dK=acc_dK,
            acc_dV=acc_dV,
            dkv_tma=dkv_out.tma,
            sK=sK,
            sV=sV,
            tiled_mma_dkv=tiled_mma_dkv,
            tiled_mma_dv=tiled_mma_dv,
            tidx=tidx,
            n_block=n_block,
            head_kv=head_kv,
            batch=batch,
            offset_k=rows.offset_k,
        )
        if const_expr(not t.dkv_tma_store):
            by_rows()
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
                rows.offset_k,
                seqlen_k,
            )
        elif const_expr(self.varlen):
            # TMA drops rows past the tensor's end, not past a packed sequence's: a block
            # reaching past seqlen_k takes the row-predicated stores
            if (n_block + 1) * t.tile_n <= seqlen_k:
                by_tma()
            else:
                by_rows()
        else:
            by_tma()

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
            convert_packed(acc, rOut)
            cute.copy(r2s, thr.retile(rOut), thr.partition_D(s))

    @cute.jit
    def store_tiles_tma(
        self, acc_dK, acc_dV, dkv_tma, sK, sV, tiled_mma_dkv, tiled_mma_dv, tidx, n_block, head_kv, batch, offset_k
    ):
        """dK / dV (cast) into K's / V's shared memory, then one thread's TMA stores: the rows
        leave as whole 128-byte lines and the warps are done at once (H100, 8x16x1024x64: 0.246
        ms against 0.260 with 32-bit stores straight from registers, docs/attention_sm90.md)."""
        t = self.tiles
        tma_dK, gdK_tma, tma_dV, gdV_tma = dkv_tma.tma_dK, dkv_tma.gdK, dkv_tma.tma_dV, dkv_tma.gdV
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
        convert_packed(acc, rOut)
        tOr = thr.retile(rOut)
        if (n_block + 1) * t.tile_n <= seqlen_k:
            cute.copy(r2g, tOr, tOg)
        else:
            # element by element: a copy vector's values need not share a row
            for e in cutlass.range_constexpr(cute.size(tOr)):
                if tOc[e][0] < seqlen_k:
                    tOg[e] = tOr[e]
