"""Reduction of the per-CTA column partials into dgamma / dbeta (Apex ``ln_bwd_finalize_kernel``).

Apex has each warp sum a strided set of partial rows, then transposes through shared
memory so that one warp reduces one column with shuffles. We keep the two stages but
let each thread own a ``vec``-wide fp32 slice of columns: the (row threads x column
threads) CTA walks the partial rows with 128-bit coalesced loads, several rows in
flight per thread, then folds its row threads through shared memory in a fixed order
(deterministic) and converts to the weight dtype.
"""

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, const_expr

from layouts.layer_norm import LnBwdFinalizeTiles


class LnBwdFinalize:
    """Configuration: tiles, which of dgamma / dbeta / dx_bias (the fused dropout + add's);
    outputs take their tensors' dtypes."""

    def __init__(self, tiles: LnBwdFinalizeTiles, has_gamma: bool, has_beta: bool, has_xbias: bool = False):
        self.tiles = tiles
        self.has_gamma = has_gamma
        self.has_beta = has_beta
        self.has_xbias = has_xbias

    @cute.jit
    def __call__(
        self,
        mDGammaPart: cute.Tensor,  # [ctas_per_col, N] fp32 (None without weight)
        mDBetaPart: cute.Tensor,  # [ctas_per_col, N] fp32 (None without bias)
        mDGamma: cute.Tensor,  # [N]
        mDBeta: cute.Tensor,  # [N]
        mDXBiasPart: cute.Tensor,  # [ctas_per_col, N] fp32 (None without x_bias)
        mDXBias: cute.Tensor,  # [N]
        stream: cuda.CUstream,
    ):
        parts = [p for p in (mDGammaPart, mDBetaPart, mDXBiasPart) if p is not None]
        self.kernel(mDGammaPart, mDBetaPart, mDGamma, mDBeta, mDXBiasPart, mDXBias).launch(
            grid=[cute.ceil_div(parts[0].shape[1], self.tiles.tile_n), 1, 1],
            block=[self.tiles.num_threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mDGammaPart: cute.Tensor,
        mDBetaPart: cute.Tensor,
        mDGamma: cute.Tensor,
        mDBeta: cute.Tensor,
        mDXBiasPart: cute.Tensor,
        mDXBias: cute.Tensor,
    ):
        t = self.tiles
        tidx, _, _ = cute.arch.thread_idx()
        col_tile, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sAcc = smem.allocate_tensor(Float32, t.fold_layout(), byte_alignment=16)
        for mPart, mOut in partial_pairs(mDGammaPart, mDBetaPart, mDGamma, mDBeta, mDXBiasPart, mDXBias):
            fold_column_tile(t, mPart, mOut, sAcc, col_tile, tidx)
            cute.arch.sync_threads()  # sAcc is reused


def partial_pairs(mDGammaPart, mDBetaPart, mDGamma, mDBeta, mDXBiasPart=None, mDXBias=None) -> list:
    """(partials, output) of dgamma, dbeta and / or dx_bias, whichever exist."""
    pairs = []
    for mPart, mOut in ((mDGammaPart, mDGamma), (mDBetaPart, mDBeta), (mDXBiasPart, mDXBias)):
        if const_expr(mPart is not None):
            pairs.append((mPart, mOut))
    return pairs


@cute.jit
def fold_column_tile(t: cutlass.Constexpr, mPart: cute.Tensor, mOut: cute.Tensor, sAcc: cute.Tensor, col_tile, tidx):
    """mOut[tile] = column sums of mPart[:, tile] in a fixed order (deterministic), converted
    to mOut's dtype. ``sAcc`` is ``t.fold_layout()`` fp32 shared memory, free on entry."""
    row_threads, col_threads = t.threads
    vec, tile_n = t.vec, t.tile_n
    ty = tidx // col_threads
    tx = tidx % col_threads
    num_rows, n = mPart.shape
    vcol = col_tile * col_threads + tx  # this thread's vector of columns
    acc = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
    acc.fill(0.0)
    if vcol * vec < n:
        # rows ty, ty + R, ty + 2R, ...: t.rows_unroll loads issued before the adds
        full = (num_rows // (row_threads * t.rows_unroll)) * (row_threads * t.rows_unroll)
        for r0 in cutlass.range(ty, full, row_threads * t.rows_unroll, unroll=1):
            parts = [cute.make_rmem_tensor(cute.make_layout(vec), Float32) for _ in range(t.rows_unroll)]
            for u in cutlass.range_constexpr(t.rows_unroll):
                cute.autovec_copy(cute.local_tile(mPart[r0 + u * row_threads, None], (vec,), (vcol,)), parts[u])
            for u in cutlass.range_constexpr(t.rows_unroll):
                acc.store(acc.load() + parts[u].load())
        for r in cutlass.range(full + ty, num_rows, row_threads, unroll=1):
            part = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
            cute.autovec_copy(cute.local_tile(mPart[r, None], (vec,), (vcol,)), part)
            acc.store(acc.load() + part.load())
    # fold the row threads of a warp (lanes tx, tx + col_threads, ...) by a butterfly,
    # then the warps through shared memory: a fixed order either way
    for i in cutlass.range_constexpr(t.lane_fold_steps):
        for v in cutlass.range_constexpr(vec):
            acc[v] = acc[v] + cute.arch.shuffle_sync_bfly(acc[v], offset=col_threads << i)
    lane = cute.arch.lane_idx()
    if lane < t.fold_cols_per_warp:
        cute.autovec_copy(acc, cute.local_tile(sAcc[tidx // t.fold_threads_per_entry, None], (vec,), (tx,)))
    cute.arch.sync_threads()
    for j in cutlass.range_constexpr(-(-tile_n // t.num_threads)):
        c = tidx + j * t.num_threads
        gcol = col_tile * tile_n + c
        if c < tile_n and gcol < n:
            total = sAcc[0, c]
            for r in cutlass.range_constexpr(1, t.fold_rows):
                total = total + sAcc[r, c]
            mOut[gcol] = total.to(mOut.element_type)
