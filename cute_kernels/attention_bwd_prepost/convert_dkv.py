"""convert_dkv (flash-attention backward postprocess), after PyTorch's ``convert_dKV``.

    dK = dKaccum * softmax_scale / (1 - p_dropout),   dV = dVaccum / (1 - p_dropout)

One CTA per (kBlockN rows, batch, head_k): both fp32 accumulators read in the dKV tiled
MMA's fragment layout, scaled, converted, staged through shared memory (sdK, sdV side by
side as in the original) and stored with GmemTiledCopydQ, predicated on rows and head dim.
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, Int32

from layouts.attention_bwd_prepost import PrepostTiles

from .seqlen import block_coords, seq_rows
from .tile_io import accum_copy, store_accumulator


class ConvertDKV:
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
        mdKaccum: cute.Tensor,  # [B, H_k, seqlen_k_rounded, kHeadDim] fp32
        mdVaccum: cute.Tensor,  # same
        mdK: cute.Tensor,  # [B, S_k, H_k, D] or [total_k, H_k, D]
        mdV: cute.Tensor,  # same
        mCuSeqlens: cute.Tensor,  # [B + 1] int32 (varlen) or None
        scale_k: Float32,  # softmax_scale / (1 - p_dropout)
        scale_v: Float32,  # 1 / (1 - p_dropout)
        num_n_blocks: Int32,
        stream: cuda.CUstream,
    ):
        gmem_copy = self.tiles.gmem_tiled_copy_do().build(self.dtype)
        self.kernel(mdKaccum, mdVaccum, mdK, mdV, mCuSeqlens, scale_k, scale_v, gmem_copy).launch(
            grid=self.tiles.grid(num_n_blocks, mdKaccum.shape[0], mdKaccum.shape[1]),
            block=[self.tiles.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mdKaccum: cute.Tensor,
        mdVaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuSeqlens: cute.Tensor,
        scale_k: Float32,
        scale_v: Float32,
        gmem_copy: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, bidb, bidh = block_coords(self.tiles, mdKaccum.shape[1])
        tile = self.tiles.tile
        row0 = n_block * tile[0]
        mdK_b, seqlen = seq_rows(mdK, mCuSeqlens, bidb, bidh)
        mdV_b, _ = seq_rows(mdV, mCuSeqlens, bidb, bidh)

        smem = cutlass.memory.SmemAllocator()
        layout = self.tiles.smem_layout_dq().build(self.dtype)
        sdK = smem.allocate_tensor(self.dtype, layout, byte_alignment=128)
        sdV = smem.allocate_tensor(self.dtype, layout, byte_alignment=128)

        if row0 < seqlen:
            tiled_mma = self.tiles.tiled_mma().build(self.dtype)
            acc_copy = accum_copy(tiled_mma, self.tiles.accum_copy_bits())
            acc_thr = acc_copy.get_slice(tidx)
            tKg = acc_thr.partition_S(cute.local_tile(mdKaccum[bidb, bidh, None, None], tile, (n_block, 0)))
            tVg = acc_thr.partition_S(cute.local_tile(mdVaccum[bidb, bidh, None, None], tile, (n_block, 0)))
            acc_dk = cute.make_rmem_tensor_like(tKg, Float32)
            acc_dv = cute.make_rmem_tensor_like(tVg, Float32)
            cute.copy(acc_copy, tKg, acc_dk)
            cute.copy(acc_copy, tVg, acc_dv)
            bits = self.tiles.smem_copy_atom_dq_bits()
            store_accumulator(
                acc_dk,
                scale_k,
                self.dtype,
                tiled_mma,
                bits,
                sdK,
                gmem_copy,
                cute.local_tile(mdK_b, tile, (n_block, 0)),
                seqlen - row0,
                mdK_b.shape[1],
                tidx,
            )
            store_accumulator(
                acc_dv,
                scale_v,
                self.dtype,
                tiled_mma,
                bits,
                sdV,
                gmem_copy,
                cute.local_tile(mdV_b, tile, (n_block, 0)),
                seqlen - row0,
                mdV_b.shape[1],
                tidx,
            )
