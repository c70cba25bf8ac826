"""BlockInfo: where a (batch, head) slice of a [batch, seq, heads, dim] or packed
[total, heads, dim] tensor starts, and how many rows it has.

With ``cu_seqlens`` (int32 [batch + 1]) sequence b is rows cu_seqlens[b] ..
cu_seqlens[b + 1] of the packed tensor; without, every sequence has the tensor's
seq dim. Plain functions: they are traced into the calling kernel.
"""

import cutlass.cute as cute
from cutlass import Int32, const_expr


def seq_rows(mX: cute.Tensor, mCuSeqlens, batch, head, pad_rows: int = 0):
    """(rows, dim) view of sequence ``batch``, head ``head``, and the sequence length.

    ``pad_rows`` shifts packed sequence b down by ``pad_rows * b`` rows (the variable-
    length dQ accumulator gives every sequence that much slack).
    """
    if const_expr(mCuSeqlens is None):
        return mX[batch, None, head, None], mX.shape[1]
    start = mCuSeqlens[batch]
    seqlen = mCuSeqlens[batch + 1] - start
    row0 = start + batch * pad_rows if const_expr(pad_rows) else start
    mSeq = cute.domain_offset((row0, 0, 0), mX)
    return mSeq[None, head, None], seqlen


def seqlen_of(mCuSeqlens, batch, static_seqlen) -> Int32:
    if const_expr(mCuSeqlens is None):
        return static_seqlen
    return mCuSeqlens[batch + 1] - mCuSeqlens[batch]


def block_coords(tiles, heads):
    """(row block, batch, head) of this CTA under ``tiles.grid``'s raster order (backwards
    with ``tiles.last_first``: ``PrepostTiles.block_coords``)."""
    return tiles.block_coords(cute.arch.block_idx(), cute.arch.grid_dim(), heads)
