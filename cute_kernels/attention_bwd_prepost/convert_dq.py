"""convert_dq (flash-attention backward postprocess), after PyTorch's ``convert_dQ``.

    dQ = (Σ_splits dQaccum[s]) * softmax_scale / (1 - p_dropout)   -> fp16 / bf16

One CTA per (kBlockM rows, batch, head). The fp32 partials are read in the dQ tiled
MMA's accumulator layout (the layout the backward's dQ MMA holds them in), summed over
``nsplits``, scaled and converted, staged through shared memory with SmemCopyAtomdQ
(make_tiled_copy_C of TiledMmadQ), and stored with GmemTiledCopydQ, rows past the
sequence and columns past the head dim left untouched.
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, Int32, const_expr

from layouts.attention_bwd_prepost import VARLEN_ACCUM_PAD, PrepostTiles

from .seqlen import block_coords, seq_rows
from .tile_io import accum_copy, store_accumulator


class ConvertDQ:
    """Configuration: output dtype, tiles, variable length."""

    def __init__(self, dtype, tiles: PrepostTiles, varlen: bool):
        if dtype.width != tiles.elem_bits:
            raise ValueError(f"tiles are for {tiles.elem_bits}-bit elements, dtype is {dtype}")
        self.dtype = dtype
        self.tiles = tiles
        self.varlen = varlen

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # [nsplits, B, seqlen_q_rounded, H, kHeadDim] or [nsplits, total_q + 128 B, H, kHeadDim]
        mdQ: cute.Tensor,  # [B, S, H, D] or [total_q, H, D]
        mCuSeqlens: cute.Tensor,  # [B + 1] int32 (varlen) or None
        scale: Float32,  # softmax_scale / (1 - p_dropout)
        batch: Int32,
        num_m_blocks: Int32,
        stream: cuda.CUstream,
    ):
        gmem_copy = self.tiles.gmem_tiled_copy_do().build(self.dtype)
        self.kernel(mdQaccum, mdQ, mCuSeqlens, scale, gmem_copy).launch(
            grid=self.tiles.grid(num_m_blocks, batch, mdQ.shape[1] if const_expr(self.varlen) else mdQ.shape[2]),
            block=[self.tiles.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
        mdQ: cute.Tensor,
        mCuSeqlens: cute.Tensor,
        scale: Float32,
        gmem_copy: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, bidb, bidh = block_coords(self.tiles, mdQ.shape[1] if const_expr(self.varlen) else mdQ.shape[2])
        smem = cutlass.memory.SmemAllocator()
        sdQ = smem.allocate_tensor(self.dtype, self.tiles.smem_layout_dq().build(self.dtype), byte_alignment=128)
        self.convert_tile(mdQaccum, mdQ, mCuSeqlens, scale, gmem_copy, sdQ, m_block, bidb, bidh, tidx)

    @cute.jit
    def convert_tile(self, mdQaccum, mdQ, mCuSeqlens, scale, gmem_copy, sdQ, m_block, bidb, bidh, tidx):
        """Rows m_block * kBlockM ... of (sequence ``bidb``, head ``bidh``): the splits summed,
        scaled, converted and stored through ``sdQ``."""
        tile = self.tiles.tile
        row0 = m_block * tile[0]
        mdQ_b, seqlen = seq_rows(mdQ, mCuSeqlens, bidb, bidh)
        if row0 < seqlen:
            tiled_mma = self.tiles.tiled_mma().build(self.dtype)
            acc_copy = accum_copy(tiled_mma, self.tiles.accum_copy_bits())
            acc_thr = acc_copy.get_slice(tidx)
            tAg0 = acc_thr.partition_S(
                cute.local_tile(self._split_rows(mdQaccum, mCuSeqlens, 0, bidb, bidh), tile, (m_block, 0))
            )
            acc = cute.make_rmem_tensor_like(tAg0, Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor_like(tAg0, Float32)
            # Rows up to the tile's end exist in every split: the accumulator is padded
            # (seqlen_q_rounded rows, or 128 rows of slack per packed sequence).
            for s in cutlass.range(mdQaccum.shape[0]):
                mAcc = self._split_rows(mdQaccum, mCuSeqlens, s, bidb, bidh)
                tAg = acc_thr.partition_S(cute.local_tile(mAcc, tile, (m_block, 0)))
                cute.copy(acc_copy, tAg, part)
                acc.store(acc.load() + part.load())
            store_accumulator(
                acc,
                scale,
                self.dtype,
                tiled_mma,
                self.tiles.smem_copy_atom_dq_bits(),
                sdQ,
                gmem_copy,
                cute.local_tile(mdQ_b, tile, (m_block, 0)),
                seqlen - row0,
                mdQ_b.shape[1],
                tidx,
            )

    def _split_rows(self, mdQaccum, mCuSeqlens, split, bidb, bidh):
        """(rows, kHeadDim) accumulator of one split, sequence and head."""
        if const_expr(not self.varlen):
            return mdQaccum[split, bidb, None, bidh, None]
        rows, _ = seq_rows(mdQaccum[split, None, None, None], mCuSeqlens, bidb, bidh, VARLEN_ACCUM_PAD)
        return rows
