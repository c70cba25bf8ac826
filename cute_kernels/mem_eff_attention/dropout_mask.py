"""``DropoutMaskKernel``: the keep mask of torch's memory-efficient attention, written out.

The attention backward redraws Zij block by block (``draw_zij``); this kernel draws the
whole [B, H, Mq, Mk] mask with the same device function (``keep_flags_quads``), one
thread per run of 8 keys of one query row, so tests can hold it against torch's
``_fill_mem_eff_dropout_mask_`` and the CPU twin bit for bit.
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32, Uint64

from cute_kernels.common.philox import keep_flags_quads

THREADS = 128
QUADS = 2  # keys per thread: 4 * QUADS


class DropoutMaskKernel:
    @cute.jit
    def __call__(self, mMask: cute.Tensor, philox_seed, philox_offset, dropout_p, stream: cuda.CUstream):
        """mMask: [B, H, Mq, Mk] uint8 (1 = kept), rows contiguous."""
        b, h, mq, mk = mMask.shape
        runs = (mk + 4 * QUADS - 1) // (4 * QUADS)
        blocks = (mq * runs + THREADS - 1) // THREADS
        self.kernel(mMask, philox_seed, philox_offset, dropout_p).launch(
            grid=[blocks, h, b], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mMask: cute.Tensor, philox_seed, philox_offset, dropout_p):
        tidx, _, _ = cute.arch.thread_idx()
        bx, head, batch = cute.arch.block_idx()
        _, heads, mq, mk = mMask.shape
        runs = (mk + 4 * QUADS - 1) // (4 * QUADS)
        item = bx * THREADS + tidx
        if item < mq * runs:
            row = item // runs
            col = (item % runs) * (4 * QUADS)
            seed = Int64(philox_seed)
            base = Int64(philox_offset) + (Int64(batch) * Int64(heads) + Int64(head)) * (Int64(mq) * Int64(mk))
            word = base + Int64(row) * Int64(mk) + Int64(col)
            flags = keep_flags_quads(Uint64(word), Uint32(seed), Uint32(seed >> Int64(32)), dropout_p, QUADS)
            out = mMask[batch, head, row, None]
            for c in cutlass.range_constexpr(QUADS):
                for j in cutlass.range_constexpr(4):
                    key = col + Int32(4 * c + j)
                    if key < mk:
                        out[key] = cutlass.Uint8((flags[c] >> Uint32(8 * j)) & Uint32(1))
