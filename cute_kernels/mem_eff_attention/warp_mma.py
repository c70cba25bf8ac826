"""Warp-level MMA helpers shared by the five matmuls of the attention backward."""

import cutlass
import cutlass.cute as cute


def col_chunk(t: cute.Tensor, cols: int, index: int) -> cute.Tensor:
    """Columns [index * cols, (index + 1) * cols) of a (rows x max_k) shared tile: the
    column loops' operand chunk (no data moves)."""
    return cute.local_tile(t, (cute.size(t, mode=[0]), cols), (0, index))


@cute.jit
def gemm_smem(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA, tCrB, tCsA, tCsB, s2r_A, s2r_B):
    """acc += A·B with both operands in shared memory, k-block by k-block.

    The ldmatrix of k-block k + 1 is issued before the MMAs of k-block k, so shared
    loads overlap tensor-core work (the C++ ``MmaPipelined`` warp loop). Without
    copies (``s2r_A is None``: the SIMT path) the MMA's own partitions are loaded
    element by element.
    """
    num_k = cute.size(tCsA.shape[2])
    if cutlass.const_expr(s2r_A is None):
        # A rolled loop (fully unrolled SIMT matmuls take minutes to compile); one
        # k-block of registers, reused.
        for k in cutlass.range(num_k, unroll=1):
            _load_elementwise(tCsA[None, None, k], tCrA[None, None, 0])
            _load_elementwise(tCsB[None, None, k], tCrB[None, None, 0])
            cute.gemm(tiled_mma, acc, tCrA[None, None, 0], tCrB[None, None, 0], acc)
    else:
        tCrA_view = s2r_A.retile(tCrA)
        tCrB_view = s2r_B.retile(tCrB)
        cute.copy(s2r_A, tCsA[None, None, 0], tCrA_view[None, None, 0])
        cute.copy(s2r_B, tCsB[None, None, 0], tCrB_view[None, None, 0])
        for k in cutlass.range_constexpr(num_k):
            if cutlass.const_expr(k + 1 < num_k):
                cute.copy(s2r_A, tCsA[None, None, k + 1], tCrA_view[None, None, k + 1])
                cute.copy(s2r_B, tCsB[None, None, k + 1], tCrB_view[None, None, k + 1])
            cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def _load_elementwise(src: cute.Tensor, dst: cute.Tensor):
    for i in cutlass.range_constexpr(cute.size(dst)):
        dst[i] = src[i]
