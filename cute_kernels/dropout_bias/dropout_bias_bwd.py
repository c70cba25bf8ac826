"""Fused dropout + bias backward, after LightSeq's ``ls_dropout_bias_bwd_kernel``.

    dX    = dY * mask * 1/(1-p)                       (plain)
    dX    = dY * mask * 1/(1-p) * act'(x + bias)      (``ls_dropout_act_bias_bwd``)
    dBias = sum over rows of dX

for dY of shape [rows, N], the mask one byte per element or (``mask_bits``) one bit per
element, rows of ceil(N / 8) bytes as ``DropoutBiasFwd`` stores it. One pass over dY (and mask, x): every thread owns one
vector of columns and walks rows, writing dX and keeping its column sums in fp32
registers; the CTA folds its row-threads through shared memory into one partial per
column, and the last CTA of each column tile sums the partials in a fixed order
(``ColumnPartials``: deterministic, one launch).

Grid: (column tiles, row chunks). A row chunk is a run of ``blocks_per_chunk`` row
blocks (a row block is the CTA tile's rows); the host sizes it to fill the GPU.
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, Int32, Uint32, const_expr

from cute_kernels.common.activation import ACTIVATIONS, activation_grad
from cute_kernels.common.column_partials import ColumnPartials
from cute_kernels.dropout_bias.column_walk import load_bias_row, row_block_range
from layouts.dropout_bias import DropoutBiasBwdTiles


class DropoutBiasBwd:
    """Configuration: element dtype (dY, x, dX), bias-gradient dtype, activation, tiles, and
    the mask's form: bytes of dY's shape (uint8; a torch bool tensor is passed as its uint8 view)
    or, with ``mask_bits``, [rows, ceil(N / 8)] bytes of 8 keep bits (bit j: column 8 b + j).
    """

    def __init__(self, dtype, dbias_dtype, activation, tiles: DropoutBiasBwdTiles, mask_bits: bool = False):
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        if dtype.width != tiles.elem_bits:
            raise ValueError(f"tiles are for {tiles.elem_bits}-bit elements, dtype is {dtype}")
        self.dtype = dtype
        self.dbias_dtype = dbias_dtype
        self.activation = activation
        self.tiles = tiles
        self.mask_bits = mask_bits

    @cute.jit
    def __call__(
        self,
        mDY: cute.Tensor,  # [rows, N]
        mMask: cute.Tensor,  # [rows, N] uint8, or [rows, ceil(N / 8)] uint8 with mask_bits
        mX: cute.Tensor,  # [rows, N] pre-activation input (activation only, else None)
        mBias: cute.Tensor,  # [N] (activation only, else None)
        mDX: cute.Tensor,  # [rows, N]
        mPartial: cute.Tensor,  # [chunks, N] fp32 workspace
        mCounter: cute.Tensor,  # [>= column tiles] int32, zero; left zero
        mDBias: cute.Tensor,  # [N]
        scale: Float32,  # 1 / (1 - p)
        blocks_per_chunk: Int32,
        stream: cuda.CUstream,
    ):
        copy = self.tiles.gmem_load().build(self.dtype)
        copy_mask = None
        if const_expr(not self.mask_bits):
            copy_mask = self.tiles.gmem_load_mask().build(cutlass.Uint8)
        copy_out = self.tiles.gmem_store().build(self.dtype)
        tile_n = self.tiles.tile[1]
        self.kernel(
            mDY,
            mMask,
            mX,
            mBias,
            mDX,
            mPartial,
            mCounter,
            mDBias,
            scale,
            blocks_per_chunk,
            copy,
            copy_mask,
            copy_out,
        ).launch(
            grid=[cute.ceil_div(mDY.shape[1], tile_n), mPartial.shape[0], 1],
            block=[self.tiles.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mDY: cute.Tensor,
        mMask: cute.Tensor,
        mX: cute.Tensor,
        mBias: cute.Tensor,
        mDX: cute.Tensor,
        mPartial: cute.Tensor,
        mCounter: cute.Tensor,
        mDBias: cute.Tensor,
        scale: Float32,
        blocks_per_chunk: Int32,
        copy: cute.TiledCopy,
        copy_mask: cute.TiledCopy,
        copy_out: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        col_tile, chunk, _ = cute.arch.block_idx()
        tile = self.tiles.tile
        rows, n = mDY.shape
        in_flight = self.tiles.rows_in_flight

        # (tile_m, tile_n, row blocks) views of this CTA's column tile
        gDY = cute.local_tile(mDY, tile, (None, col_tile))
        gDX = cute.local_tile(mDX, tile, (None, col_tile))
        cRC = cute.local_tile(cute.make_identity_tensor(mDY.shape), tile, (None, col_tile))

        thr = copy.get_slice(tidx)
        tDYg = thr.partition_S(gDY)  # (CPY, 1, 1, row blocks)
        tMg = None
        if const_expr(not self.mask_bits):
            tMg = copy_mask.get_slice(tidx).partition_S(cute.local_tile(mMask, tile, (None, col_tile)))
        tDXg = copy_out.get_slice(tidx).partition_D(gDX)
        tRC = thr.partition_S(cRC)
        row0, col = tRC[0, 0, 0, 0]  # this thread's row in a block, first column
        col_ok = col < n  # the vector divides N: the whole vector is in or out

        tXg = None
        rBias = None
        if const_expr(self.activation is not None):
            gX = cute.local_tile(mX, tile, (None, col_tile))
            tXg = thr.partition_S(gX)
            rBias = load_bias_row(copy, thr, mBias, rows, n, tile, col_tile, col_ok)

        acc = cute.make_rmem_tensor_like(tDYg[None, 0, 0, 0], Float32)
        acc.fill(0.0)

        rb_begin, batched_end, rb_end = row_block_range(rows, tile[0], chunk, blocks_per_chunk, in_flight)

        if col_ok:
            # Row blocks entirely inside the tensor: load ``in_flight`` of them before
            # the first use, so each thread keeps several 128-bit loads outstanding.
            for rb in cutlass.range(rb_begin, batched_end, in_flight):
                rDY = [cute.make_rmem_tensor_like(tDYg[None, 0, 0, 0]) for _ in range(in_flight)]
                rM = [None] * in_flight
                rX = [None] * in_flight
                for i in cutlass.range_constexpr(in_flight):
                    cute.copy(copy, tDYg[None, 0, 0, rb + i], rDY[i])
                    rM[i] = self.load_mask(mMask, tMg, copy_mask, rb + i, (rb + i) * tile[0] + row0, col)
                    if const_expr(self.activation is not None):
                        rX[i] = cute.make_rmem_tensor_like(tXg[None, 0, 0, 0])
                        cute.copy(copy, tXg[None, 0, 0, rb + i], rX[i])
                for i in cutlass.range_constexpr(in_flight):
                    self.grad_block(rDY[i], rM[i], rX[i], rBias, scale, acc, copy_out, tDXg[None, 0, 0, rb + i])
            # The rest of the chunk, one row block at a time, rows guarded.
            for rb in cutlass.range(batched_end, rb_end):
                if rb * tile[0] + row0 < rows:
                    rDY = cute.make_rmem_tensor_like(tDYg[None, 0, 0, 0])
                    cute.copy(copy, tDYg[None, 0, 0, rb], rDY)
                    rM = self.load_mask(mMask, tMg, copy_mask, rb, rb * tile[0] + row0, col)
                    rX = None
                    if const_expr(self.activation is not None):
                        rX = cute.make_rmem_tensor_like(tXg[None, 0, 0, 0])
                        cute.copy(copy, tXg[None, 0, 0, rb], rX)
                    self.grad_block(rDY, rM, rX, rBias, scale, acc, copy_out, tDXg[None, 0, 0, rb])

        # dBias: fold the CTA's row-threads through shared memory (the seed's tile[8][129]
        # step), then the last CTA of this column tile adds all chunks' partials.
        tile_m, tile_n = tile
        partials = ColumnPartials(tile_m, tile_n, self.tiles.num_threads)
        smem = cutlass.memory.SmemAllocator()
        sAcc = smem.allocate_tensor(Float32, cute.make_ordered_layout(tile, order=(1, 0)), byte_alignment=16)
        sFold = smem.allocate_tensor(
            Float32, cute.make_ordered_layout((partials.lanes, tile_n), order=(1, 0)), byte_alignment=16
        )
        sFlag = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)
        # the gmem copy's thread/value layout on fp32: one 128-bit-aligned vector per thread
        cute.autovec_copy(acc, thr.partition_D(sAcc)[None, 0, 0])
        cute.arch.sync_threads()
        partials.store(sAcc, mPartial, chunk, col_tile, tidx)
        partials.finish(mPartial, mCounter, mDBias, col_tile, tidx, sFold, sFlag)

    def load_mask(self, mMask, tMg, copy_mask, rb, row, col):
        """One row block's keep flags of this thread's vector: its mask bytes in registers, or
        (``mask_bits``) the byte holding its bits shifted down to bit 0 (a Uint32)."""
        if const_expr(self.mask_bits):
            return Uint32(mMask[row, col // 8]) >> Uint32(col % 8)
        rM = cute.make_rmem_tensor_like(tMg[None, 0, 0, 0])
        cute.copy(copy_mask, tMg[None, 0, 0, rb], rM)
        return rM

    def keep_scaled(self, rM, rDY, scale):
        """keep / (1 - p) per element of the vector, fp32."""
        if const_expr(not self.mask_bits):
            return rM.load().to(Float32) * scale
        rK = cute.make_rmem_tensor_like(rDY, Float32)
        for i in range(cute.size(rK)):  # a plain helper: unrolled as it is traced
            kept = ((rM >> Uint32(i)) & Uint32(1)) != Uint32(0)
            rK[i] = cutlass.select_(kept, scale, Float32(0.0))
        return rK.load()

    def grad_block(self, rDY, rM, rX, rBias, scale, acc, copy, tDXg_block):
        """dX for one vector: registers in, dX stored, column sums accumulated."""
        g = rDY.load().to(Float32) * self.keep_scaled(rM, rDY, scale)
        if const_expr(self.activation is not None):
            z = rX.load().to(Float32) + rBias.load().to(Float32)
            g = g * activation_grad(self.activation, z)
        rDX = cute.make_rmem_tensor_like(rDY)
        rDX.store(g.to(self.dtype))
        cute.copy(copy, rDX, tDXg_block)
        acc.store(acc.load() + g)
