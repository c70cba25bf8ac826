"""Predicated tile copies (the original's ``flash::copy<Is_even_MN, Is_even_K, Clear_OOB_MN>``)
and the accumulator epilogue shared by ``convert_dq`` and ``convert_dkv``.

Copies are partitioned ``(CPY, M, K)``; a vector is either wholly inside the head dim
or wholly outside (the host picks a vector that divides it), so one predicate per
(m, k) is exact.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32


@cute.jit
def load_tile(copy, tSg, tSr, tSc, rows_left, cols):
    """gmem -> registers for rows < ``rows_left`` and columns < ``cols``, zeros elsewhere."""
    tSr.fill(0.0)  # Clear_OOB_MN / Clear_OOB_K
    for m in cutlass.range_constexpr(cute.size(tSg, mode=[1])):
        if tSc[0, m, 0][0] < rows_left:
            for k in cutlass.range_constexpr(cute.size(tSg, mode=[2])):
                if tSc[0, m, k][1] < cols:
                    cute.copy(copy, tSg[None, m, k], tSr[None, m, k])


@cute.jit
def store_tile(copy, tDr, tDg, tDc, rows_left, cols):
    """registers -> gmem for rows < ``rows_left`` and columns < ``cols`` (nothing else written)."""
    for m in cutlass.range_constexpr(cute.size(tDg, mode=[1])):
        if tDc[0, m, 0][0] < rows_left:
            for k in cutlass.range_constexpr(cute.size(tDg, mode=[2])):
                if tDc[0, m, k][1] < cols:
                    cute.copy(copy, tDr[None, m, k], tDg[None, m, k])


@cute.jit
def clear_tile(copy, tDg, tDc, rows_left):
    """Zeros to rows < ``rows_left`` of a full-width (accumulator) tile."""
    zero = cute.make_rmem_tensor_like(tDg[None, 0, 0], Float32)
    zero.fill(0.0)
    for m in cutlass.range_constexpr(cute.size(tDg, mode=[1])):
        if tDc[0, m, 0][0] < rows_left:
            for k in cutlass.range_constexpr(cute.size(tDg, mode=[2])):
                cute.copy(copy, zero, tDg[None, m, k])


def accum_copy(tiled_mma, bits: int):
    """The fp32 accumulator read in the MMA's fragment layout (``tiles.accum_copy_bits()``)."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=bits)
    return cute.make_tiled_copy_C(atom, tiled_mma)


@cute.jit
def store_accumulator(
    acc,
    scale,
    dtype: cutlass.Constexpr,
    tiled_mma,
    smem_bits: cutlass.Constexpr,
    sX,
    gmem_copy,
    gX,
    rows_left,
    cols,
    tidx,
):
    """acc (fp32, MMA fragment) * scale -> ``dtype`` -> smem (SmemCopyAtom) -> gmem (128-bit).

    The shared tile turns the fragment's scattered pairs into whole row vectors, so the
    global stores are coalesced and as wide as the output allows.
    """
    rX = cute.make_rmem_tensor_like(acc, dtype)
    rX.store((acc.load() * scale).to(dtype))
    s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=smem_bits)
    s_copy = cute.make_tiled_copy_C(s_atom, tiled_mma)
    s_thr = s_copy.get_slice(tidx)
    cute.copy(s_copy, s_thr.retile(rX), s_thr.partition_D(sX))
    cute.arch.sync_threads()
    g_thr = gmem_copy.get_slice(tidx)
    tXs = g_thr.partition_S(sX)
    tXr = cute.make_rmem_tensor_like(tXs)
    cute.copy(gmem_copy, tXs, tXr)
    tXg = g_thr.partition_D(gX)
    tXc = g_thr.partition_D(cute.make_identity_tensor(gX.shape))
    store_tile(gmem_copy, tXr, tXg, tXc, rows_left, cols)
