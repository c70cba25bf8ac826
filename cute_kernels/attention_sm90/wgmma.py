"""Warpgroup MMA helpers of the sm90 attention backward: one asynchronous wgmma batch,
and the register views of an accumulator (rows x columns; the A operand of the next product)."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor, zero_init: cutlass.Constexpr):
    """acc (+)= A B over every k-block of the fragments; committed as one group, not waited for."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom: its accumulate field changes below
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """wgmma accumulator ((2, 2, V), MMA_M, MMA_N) -> ((2, MMA_M), (2, V, MMA_N)): rows x columns.

    Value (c, r, v) of a thread sits at row r * 8 + lane / 4 and column v * 8 + (lane % 4) * 2 + c."""
    lay = cute.make_layout(acc_layout.shape)  # compact, to rebuild its strides
    shape = ((lay.shape[0][1], lay.shape[1]), (lay.shape[0][0], lay.shape[0][2], lay.shape[2]))
    stride = ((lay.stride[0][1], lay.stride[1]), (lay.stride[0][0], lay.stride[0][2], lay.stride[2]))
    return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))


def acc_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """Accumulator ((2, 2, V), MMA_M, MMA_N) of one product as the register A operand of the
    next, ((2, 2, 2), MMA_M, (V / 2, MMA_N)): a 16-wide k-block is two 8-column groups."""
    lay = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    shape = ((lay.shape[0][0], lay.shape[0][1], lay.shape[0][2][0]), lay.shape[1], (lay.shape[0][2][1], lay.shape[2]))
    stride = (
        (lay.stride[0][0], lay.stride[0][1], lay.stride[0][2][0]),
        lay.stride[1],
        (lay.stride[0][2][1], lay.stride[2]),
    )
    return cute.make_layout(shape, stride=stride)
