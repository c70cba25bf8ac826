"""Positive controls for ``python -m benchmarks.sanitize``: a CuTe DSL kernel with a planted bug.

A sanitizer run that reports nothing means something only if the tool was seen to fire
on a DSL kernel through the same kernel filter: ``kind="oob"`` writes 64 floats just past
the end of its tensor (memcheck: invalid __global__ write), ``kind="race"`` has each
thread read a shared-memory slot that a thread of the other warp writes, with no barrier
between (racecheck: a read-after-write hazard).
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, const_expr

THREADS = 64


class Canary:
    def __init__(self, kind: str):
        if kind not in ("oob", "race"):
            raise ValueError(f"kind must be 'oob' or 'race', got {kind!r}")
        self.kind = kind

    @cute.jit
    def __call__(self, mX: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mX).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if const_expr(self.kind == "oob"):
            n = mX.shape[0]
            mX[n + tidx] = Float32(1.0)  # past the end: every thread writes out of bounds
        else:
            smem = cutlass.memory.SmemAllocator()
            sBuf = smem.allocate_tensor(Float32, cute.make_layout(THREADS), byte_alignment=16)
            sBuf[tidx] = Float32(tidx)
            # no cute.arch.sync_threads() here: the other warp's write may not have happened
            mX[tidx] = sBuf[(tidx + THREADS // 2) % THREADS]
