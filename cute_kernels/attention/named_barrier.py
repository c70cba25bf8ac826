"""Named-barrier ids of the Hopper attention kernels (0 is __syncthreads; the hardware has 16)."""

from enum import IntEnum

import cutlass.cute as cute


class NamedBarrier(IntEnum):
    """Every id the kernels use, one name each (a pair per warpgroup or buffer is two names)."""

    PDS = 1  # both consumer warpgroups wrote dS (with pds_split / dq_defer: warpgroup 0's even steps)
    DQ_EMPTY = 2  # the dQ staging buffer is free (with dq_per_wg: warpgroup 0's)
    DQ_FULL = 3  # dQ is staged (with dq_per_wg: warpgroup 0's)
    PDS_WG1 = 4  # pds_split / dq_defer: warpgroup 1 announces its dS here (even steps)
    DQ_EMPTY_WG1 = 5  # dq_per_wg: warpgroup 1's pair
    DQ_FULL_WG1 = 6
    KEEP_FLAGS = 7  # dropout: warpgroup 0's keep flags of the block are drawn
    KEEP_FLAGS_WG1 = 8  # ... warpgroup 1's
    EPILOGUE = 9  # dkv_tma_store: both warpgroups done with K / V, then their dK / dV written
    PDS_ODD = 10  # dq_defer: warpgroup 0's odd steps
    PDS_WG1_ODD = 11  # dq_defer: warpgroup 1's odd steps
    DKV_STAGED = 12  # persistent CTAs: a tile's dK / dV are staged in K / V buffer 0's smem
    DKV_STAGED_BUF1 = 13  # ... in buffer 1's
    DS_FREE = 14  # carry_dq: the store warps have read the staged dK out of its dS buffer
    K_FREE = 15  # carry_dq: the consumers' last product on the previous tile's K is done


class NamedBarrierFwd(IntEnum):
    """The Hopper forward's ids. A consumer warpgroup w's turn is TURN_WG0 + w, its keep flags'
    barrier KEEP_FLAGS_WG0 + w (consecutive ids: the warpgroup index is a runtime value)."""

    EPILOGUE = 1  # the consumers: every product has read Q, then O is staged in its buffer
    EPILOGUE_STAGED = 2  # the consumers: O is staged, one thread stores it
    TURN_WG0 = 3  # ping-pong: consumer warpgroup 0 may issue its products
    TURN_WG1 = 4  # ... warpgroup 1
    TURN_WG2 = 5  # ... warpgroup 2 (tiles of three consumer warpgroups)
    KEEP_FLAGS_WG0 = 6  # dropout: consumer warpgroup 0 drew its keep flags of the block
    KEEP_FLAGS_WG1 = 7  # ... warpgroup 1
    KEEP_FLAGS_WG2 = 8  # ... warpgroup 2


def named_barrier(barrier_id: int, threads: int, arrive: bool):
    """Arrive at named barrier ``barrier_id`` (and go on) or wait there for ``threads`` in all."""
    if arrive:
        cute.arch.barrier_arrive(barrier_id=int(barrier_id), number_of_threads=threads)
    else:
        cute.arch.barrier(barrier_id=int(barrier_id), number_of_threads=threads)


def cyclic(i, n: int):
    """i mod n for a step count (never negative): a mask where n is a power of two (the
    signed remainder costs sign fix-ups in every step)."""
    return i & (n - 1) if n & (n - 1) == 0 else i % n
