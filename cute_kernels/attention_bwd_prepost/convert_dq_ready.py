"""convert_dq overlapping the sm90 attention backward's last wave (``ConvertDQReady``).

The sm90 kernel (with ``dq_ready``) counts each key block into a zeroed int32 per
(sequence, key head) once that block's dQ adds are written, and lets this launch go
(programmatic dependent launch) once all its CTAs have started. Without a mask every head
is done long before the grid is: its key blocks run side by side and the heads go in
order. So this grid's CTAs, which take the multiprocessors the last wave leaves idle,
walk the (sequence, head, row block) tiles in that order from a shared tile counter and
convert each one as soon as its head's count is complete, instead of every tile waiting
for the whole grid.

The same tile conversion as ``ConvertDQ`` (one split: the sm90 accumulator). Every CTA
waits for the kernel before it to complete (griddepcontrol.wait) before it leaves, so
this grid never completes before that one: what follows on the stream sees its dK / dV.
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, Int32, const_expr

from .convert_dq import ConvertDQ


class ConvertDQReady(ConvertDQ):
    """ConvertDQ, persistent CTAs taking tiles in head order and waiting for each head."""

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # [1, B, seqlen_q_rounded, H, kHeadDim] or [1, total_q + 128 B, H, kHeadDim]
        mdQ: cute.Tensor,  # [B, S, H, D] or [total_q, H, D]
        mCuSeqlens: cute.Tensor,  # [B + 1] int32 (varlen) or None
        mTiles: cute.Tensor,  # [1] int32, zeroed: the tile counter
        mReady: cute.Tensor,  # [B, Hk] int32: key blocks counted by the kernel before
        scale: Float32,  # softmax_scale / (1 - p_dropout)
        batch: Int32,
        num_m_blocks: Int32,
        group: Int32,  # query heads per key head
        expected: Int32,  # the count that completes a head: the kernel's key blocks of a (sequence, key head)
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        gmem_copy = self.tiles.gmem_tiled_copy_do().build(self.dtype)
        heads = mdQ.shape[1] if const_expr(self.varlen) else mdQ.shape[2]
        self.kernel(
            mdQaccum, mdQ, mCuSeqlens, mTiles, mReady, scale, gmem_copy, batch, heads, num_m_blocks, group, expected
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[self.tiles.num_threads, 1, 1],
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
        mdQ: cute.Tensor,
        mCuSeqlens: cute.Tensor,
        mTiles: cute.Tensor,
        mReady: cute.Tensor,
        scale: Float32,
        gmem_copy: cute.TiledCopy,
        batch: Int32,
        heads: Int32,
        num_m_blocks: Int32,
        group: Int32,
        expected: Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        sdQ = smem.allocate_tensor(self.dtype, self.tiles.smem_layout_dq().build(self.dtype), byte_alignment=128)
        sTile = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        total = batch * heads * num_m_blocks
        tile = self.next_tile(mTiles, sTile, tidx)
        while tile < total:
            # row blocks fastest, then heads, then sequences: the order the heads complete
            bh = tile // num_m_blocks
            m_block = tile - bh * num_m_blocks
            bidb = bh // heads
            bidh = bh - bidb * heads
            if tidx == 0:
                ready = mReady.iterator + cute.crd2idx((bidb, bidh // group), mReady.layout)
                while cute.arch.load(ready, Int32, sem="acquire", scope="gpu") < expected:
                    cute.arch.inline_ptx("nanosleep.u32 200;")
            cute.arch.sync_threads()  # the head's adds, acquired by thread 0, before any thread reads
            self.convert_tile(mdQaccum, mdQ, mCuSeqlens, scale, gmem_copy, sdQ, m_block, bidb, bidh, tidx)
            cute.arch.sync_threads()  # sdQ and sTile read before they are written again
            tile = self.next_tile(mTiles, sTile, tidx)
        # leave only once the kernel before is complete (its dK / dV too): the work behind
        # this launch on the stream is ordered after this grid alone
        cute.arch.griddepcontrol_wait()

    @cute.jit
    def next_tile(self, mTiles, sTile, tidx):
        """The next tile index from the shared counter, read by thread 0 and shared."""
        if tidx == 0:
            sTile[0] = cute.arch.atomic_add(mTiles.iterator, Int32(1), sem="relaxed", scope="gpu")
        cute.arch.sync_threads()
        return sTile[0]
