"""Sum over the lanes of a warp that share a row (shuffle-xor butterfly).

Shared by every kernel whose rows are spread over consecutive lanes: the attention
pre-processing (Apex/flash ``Allreduce``) and the LayerNorm backward. Every lane ends
with the same total, added in the same order.
"""

import math

import cutlass
import cutlass.cute as cute


@cute.jit
def row_allreduce_sum(v, threads: cutlass.Constexpr):
    """Sum of ``v`` over the ``threads`` (a power of two, <= 32) consecutive lanes of a row."""
    for i in cutlass.range_constexpr(int(math.log2(threads))):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=1 << i)
    return v
