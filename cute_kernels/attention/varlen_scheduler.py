"""Query blocks of packed sequences (``cu_seqlens``), a CTA each, with no CTA for a block past
its sequence's end, in an order that keeps K / V in L2.

A grid of ceil(longest / tile_m) query blocks for every (sequence, head) launches a CTA for each
block past a shorter sequence's end (the attention_fwd suite's 17 sequences of 362-5590 tokens
at 128-row blocks: 11968 CTAs for 4256 blocks). Here the grid is an upper bound on the real
blocks, (rows + sequences (tile_m - 1)) // tile_m a head, and each CTA decodes its block.

Order: the sequences one after another; within sequence i (n_i query blocks, H heads), sections
of S_i heads whose K / V (the sequence's keys) fit the L2 budget together, S_i a power of two;
within a section block by block, the section's heads side by side, the last (longest, under a
causal mask: ``lpt``) block first. CTA t finds its sequence by a prefix sum of n_i H over the
sequences, 32 at a time across a warp's lanes.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Int32

WARP = cute.arch.WARP_SIZE  # lanes that each take one sequence a round of the prefix sum
PAST_THE_END = 1 << 22  # the query block a CTA past the real ones gets (x tile_m stays in int32)


@dataclass(frozen=True)
class VarlenTileParams:
    """``sequences``, query ``heads``, and ``l2_rows``: key rows x query heads whose K / V fit
    the L2 budget (a section of heads of a sequence with n keys takes l2_rows // n of them)."""

    sequences: Any
    heads: Any
    l2_rows: Any


def varlen_grid_ctas(rows, sequences, heads, tile_m: int):
    """The grid: sum_i ceil(len_i / tile_m) <= (rows + sequences (tile_m - 1)) // tile_m a head."""
    return (rows + sequences * (tile_m - 1)) // tile_m * heads


@dataclass(frozen=True)
class VarlenTileScheduler:
    """A CTA a query block of a packed sequence (module docstring); ``lpt``: a section's last
    block first."""

    tile_m: int
    lpt: bool

    @cute.jit
    def cta_coords(self, p: VarlenTileParams, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor):
        """(query block, head, sequence) of this CTA; one past the real blocks gets query block
        PAST_THE_END of sequence 0, and does nothing."""
        t, _, _ = cute.arch.block_idx()
        return self.coords_of(p, mCuSeqlensQ, mCuSeqlensK, t)

    @cute.jit
    def blocks_of(self, mCuSeqlensQ: cute.Tensor, i):
        """Query blocks of sequence ``i``."""
        return (mCuSeqlensQ[i + 1] - mCuSeqlensQ[i] + (self.tile_m - 1)) // self.tile_m

    @cute.jit
    def sequence_of(self, p: VarlenTileParams, mCuSeqlensQ: cute.Tensor, t):
        """(sequence, its first tile) for tile ``t``, in every lane; sequence -1 past the last
        tile. Lane l of round c holds sequence 32 c + l's tiles and their inclusive prefix sum."""
        lane = cute.arch.lane_idx()
        seq, first, before = Int32(-1), Int32(0), Int32(0)
        for c in cutlass.range((p.sequences + WARP - 1) // WARP, unroll=1):
            i = c * WARP + lane
            tiles = Int32(0)
            if i < p.sequences:
                tiles = self.blocks_of(mCuSeqlensQ, i) * p.heads
            upto = tiles
            for k in cutlass.range_constexpr(5):  # inclusive scan over the lanes
                below = cute.arch.shuffle_sync_up(upto, 1 << k)
                if lane >= (1 << k):
                    upto = upto + below
            reached = cute.arch.vote_ballot_sync(before + upto > t)  # lanes whose end lies past t
            if seq < 0 and reached != 0:
                hit = cute.arch.popc((reached & (Int32(0) - reached)) - 1)  # the lowest such lane
                seq = c * WARP + hit
                first = before + cute.arch.shuffle_sync(upto - tiles, hit)
            before = before + cute.arch.shuffle_sync(upto, WARP - 1)
        return seq, first

    @cute.jit
    def coords_of(self, p: VarlenTileParams, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, t):
        """(query block, head, sequence) of tile ``t`` (module docstring)."""
        seq, first = self.sequence_of(p, mCuSeqlensQ, t)
        m_block, head, batch = Int32(PAST_THE_END), Int32(0), Int32(0)
        if seq >= 0:
            n = self.blocks_of(mCuSeqlensQ, seq)
            keys = mCuSeqlensK[seq + 1] - mCuSeqlensK[seq]
            fit = p.l2_rows // cutlass.max(keys, Int32(1))
            section = Int32(1)
            if fit > 1:
                section = Int32(1) << (WARP - 1 - Int32(cute.arch.clz(fit)))  # the power of two below
            section = cutlass.min(section, p.heads)
            r = t - first
            s = r // (section * n)
            r = r - s * section * n
            width = cutlass.min(section, p.heads - s * section)  # the last section may be narrower
            block = r // width
            head = s * section + r - block * width
            m_block = n - 1 - block if self.lpt else block
            batch = seq
        return m_block, head, batch
