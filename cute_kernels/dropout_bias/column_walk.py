"""What the dropout + bias forward and backward share of their walk: each CTA owns a column
tile and a chunk of row blocks, each thread one vector of columns, so both load the bias
(broadcast over rows) once and split their row blocks the same way."""

import cutlass
import cutlass.cute as cute


@cute.jit
def load_bias_row(copy: cute.TiledCopy, thr, mBias: cute.Tensor, rows, n, tile, col_tile, col_ok):
    """The thread's vector of ``mBias`` [N] for column tile ``col_tile`` (zeros past N): a
    [rows, N] view with row stride 0 partitioned as the rows are."""
    mBiasRows = cute.make_tensor(mBias.iterator, cute.make_layout((rows, n), stride=(0, 1)))
    tBg = thr.partition_S(cute.local_tile(mBiasRows, tile, (0, col_tile)))
    rBias = cute.make_rmem_tensor_like(tBg[None, 0, 0])
    rBias.fill(0.0)
    if col_ok:
        cute.copy(copy, tBg[None, 0, 0], rBias)
    return rBias


@cute.jit
def row_block_range(rows, tile_m, chunk, blocks_per_chunk, in_flight):
    """(first, batched end, end) of the CTA's row blocks: [first, batched end) are whole blocks
    inside the tensor in groups of ``in_flight`` (loaded before their first use), the rest up
    to the end one at a time (the ragged last block among them)."""
    num_blocks = cute.ceil_div(rows, tile_m)
    full_blocks = rows // tile_m
    rb_begin = chunk * blocks_per_chunk
    rb_end = cutlass.min(rb_begin + blocks_per_chunk, num_blocks)
    batched_end = rb_begin + (cutlass.max(cutlass.min(rb_end, full_blocks) - rb_begin, 0) // in_flight) * in_flight
    return rb_begin, batched_end, rb_end
