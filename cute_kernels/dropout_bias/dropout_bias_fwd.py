"""Fused bias + activation + dropout forward, after LightSeq's ``ls_dropout_act_bias_fwd``:

    y    = act(x + bias) * keep / (1 - p)        (act: none, relu, gelu, gelu_erf)
    mask = keep, one bit per element

for x of shape [rows, N]. The keep bits are drawn on the device from Philox
(``common/philox.keep_byte``: one call per 8 elements, keyed by the flat byte index of the
mask) and stored as rows of ceil(N / 8) bytes, bit j of byte b being column 8 b + j (bits
past N zero). The backward (``DropoutBiasBwd`` with ``mask_bits``) reads them back.

Tiles and grid are the backward's (``layouts/dropout_bias.py``): every thread owns one vector
of columns and walks rows, ``rows_in_flight`` row blocks loaded before the first use. A
thread whose vector is narrower than a byte draws the whole byte (the draw depends only on
the byte), uses its own bits, and the thread at the byte's first column stores it: no
exchange between threads.
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, Int32, Uint8, Uint32, Uint64, const_expr

from cute_kernels.common.activation import ACTIVATIONS, activation
from cute_kernels.common.philox import keep_byte, keep_byte_key
from cute_kernels.dropout_bias.column_walk import load_bias_row, row_block_range
from layouts.dropout_bias import DropoutBiasBwdTiles


class DropoutBiasFwd:
    """Configuration: element dtype (x, bias, y), activation, tiles. The Philox seed and offset
    are Int64 values, or Int64 [1] device tensors (CUDA-graph capture)."""

    def __init__(self, dtype, activation_name, tiles: DropoutBiasBwdTiles):
        if activation_name is not None and activation_name not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation_name!r}; expected one of {ACTIVATIONS}")
        if dtype.width != tiles.elem_bits:
            raise ValueError(f"tiles are for {tiles.elem_bits}-bit elements, dtype is {dtype}")
        self.dtype = dtype
        self.activation = activation_name
        self.tiles = tiles

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [rows, N]
        mBias: cute.Tensor,  # [N]
        mY: cute.Tensor,  # [rows, N]
        mMask: cute.Tensor,  # [rows, ceil(N / 8)] uint8
        seed,  # Int64, or Int64 [1] on the device
        offset,  # Int64, or Int64 [1] on the device
        threshold: Int32,  # keep where a 16-bit half >= threshold (``keep_threshold(p)``)
        scale: Float32,  # 1 / (1 - p)
        chunks: Int32,
        blocks_per_chunk: Int32,
        stream: cuda.CUstream,
    ):
        copy = self.tiles.gmem_load().build(self.dtype)
        copy_out = self.tiles.gmem_store().build(self.dtype)
        self.kernel(mX, mBias, mY, mMask, seed, offset, threshold, scale, blocks_per_chunk, copy, copy_out).launch(
            grid=[cute.ceil_div(mX.shape[1], self.tiles.tile[1]), chunks, 1],
            block=[self.tiles.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mBias: cute.Tensor,
        mY: cute.Tensor,
        mMask: cute.Tensor,
        seed,
        offset,
        threshold: Int32,
        scale: Float32,
        blocks_per_chunk: Int32,
        copy: cute.TiledCopy,
        copy_out: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        col_tile, chunk, _ = cute.arch.block_idx()
        tile = self.tiles.tile
        rows, n = mX.shape
        in_flight = self.tiles.rows_in_flight

        gX = cute.local_tile(mX, tile, (None, col_tile))
        gY = cute.local_tile(mY, tile, (None, col_tile))
        cRC = cute.local_tile(cute.make_identity_tensor(mX.shape), tile, (None, col_tile))
        thr = copy.get_slice(tidx)
        tXg = thr.partition_S(gX)  # (CPY, 1, 1, row blocks)
        tYg = copy_out.get_slice(tidx).partition_D(gY)
        row0, col = thr.partition_S(cRC)[0, 0, 0, 0]
        col_ok = col < n  # the vector divides N: the whole vector is in or out

        rBias = load_bias_row(copy, thr, mBias, rows, n, tile, col_tile, col_ok)

        rng = keep_byte_key(seed, offset, threshold)
        byte = col // 8
        # this thread's bits within its byte, and the byte's columns inside the row
        shift = Uint32(col % 8)
        in_row = cutlass.min(n - byte * 8, 8)
        valid = (Uint32(1) << Uint32(in_row)) - Uint32(1)
        writes_byte = col % 8 == 0

        rb_begin, batched_end, rb_end = row_block_range(rows, tile[0], chunk, blocks_per_chunk, in_flight)

        if col_ok:
            for rb in cutlass.range(rb_begin, batched_end, in_flight):
                rX = [cute.make_rmem_tensor_like(tXg[None, 0, 0, 0]) for _ in range(in_flight)]
                for i in cutlass.range_constexpr(in_flight):
                    cute.copy(copy, tXg[None, 0, 0, rb + i], rX[i])
                for i in cutlass.range_constexpr(in_flight):
                    row = (rb + i) * tile[0] + row0
                    bits = self.draw(mMask, row, byte, rng) & valid
                    self.store_block(rX[i], rBias, bits >> shift, scale, copy_out, tYg[None, 0, 0, rb + i])
                    if writes_byte:
                        mMask[row, byte] = Uint8(bits)
            for rb in cutlass.range(batched_end, rb_end):
                row = rb * tile[0] + row0
                if row < rows:
                    rX = cute.make_rmem_tensor_like(tXg[None, 0, 0, 0])
                    cute.copy(copy, tXg[None, 0, 0, rb], rX)
                    bits = self.draw(mMask, row, byte, rng) & valid
                    self.store_block(rX, rBias, bits >> shift, scale, copy_out, tYg[None, 0, 0, rb])
                    if writes_byte:
                        mMask[row, byte] = Uint8(bits)

    @staticmethod
    def draw(mMask, row, byte, rng):
        """The keep bits of byte ``byte`` of ``row`` (its flat index in a dense mask)."""
        k0, k1, counter, threshold = rng
        index = Uint64(row) * Uint64(mMask.shape[1]) + Uint64(byte)
        return keep_byte(k0, k1, counter, index, threshold)

    def store_block(self, rX, rBias, bits, scale, copy, tYg_block):
        """y for one vector: bit i of ``bits`` keeps element i."""
        z = rX.load().to(Float32) + rBias.load().to(Float32)
        if const_expr(self.activation is not None):
            z = activation(self.activation, z)
        rA = cute.make_rmem_tensor_like(rX, Float32)
        rA.store(z * scale)
        for i in range(cute.size(rA)):  # a plain helper: unrolled as it is traced
            kept = ((bits >> Uint32(i)) & Uint32(1)) != Uint32(0)
            rA[i] = cutlass.select_(kept, rA[i], Float32(0.0))
        rY = cute.make_rmem_tensor_like(rX)
        rY.store(rA.load().to(self.dtype))
        cute.copy(copy, rY, tYg_block)
