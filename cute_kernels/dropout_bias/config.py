"""Choices of the dropout + bias backward that are not layouts: the threads and rows in flight
of its tiles (``tiles``, measured on the H100: docs/dropout_bias.md) and how the rows of a column
tile split over CTAs (the grid the op launches). The tiles themselves are
``layouts/dropout_bias.py``."""

from __future__ import annotations

from layouts.dropout_bias import MAX_VECTOR_BITS, DropoutBiasBwdTiles

THREADS = (16, 32)  # (rows, cols) of threads in a CTA
ROWS_IN_FLIGHT = 8  # row blocks loaded before the first use (memory-level parallelism)
CTAS_PER_SM = 1  # CTAs per SM when sizing the grid (512 threads at ~100 registers: one fits)
MIN_ROWS_PER_CTA = 256  # below this a CTA's fixed cost (partials, reduction) dominates


def tiles(elem_bits: int, vec: int, arch: str = "sm_90a") -> DropoutBiasBwdTiles:
    """Tiles for ``elem_bits``-bit elements moved ``vec`` at a time on ``arch``.

    ``vec`` is the widest vector (at most 128 bits) that the row length, the strides
    and the addresses allow; the host finds it. sm_80 and sm_90 use the same tiles:
    a pure streaming kernel is served best on both by 128-bit accesses and enough
    rows in flight.
    """
    del arch
    if vec < 1 or vec & (vec - 1) or vec * elem_bits > MAX_VECTOR_BITS:
        raise ValueError(f"vector of {vec} x {elem_bits} bits is not a legal access")
    return DropoutBiasBwdTiles(elem_bits=elem_bits, vec=vec, threads=THREADS, rows_in_flight=ROWS_IN_FLIGHT)


def row_chunks(rows: int, n: int, tiles_: DropoutBiasBwdTiles, num_sms: int) -> tuple:
    """(chunks, row blocks per chunk): how the rows of a column tile split over CTAs.

    Enough CTAs to keep ``CTAS_PER_SM`` resident per SM, each with at least
    ``MIN_ROWS_PER_CTA`` rows, a whole number of ``rows_in_flight`` batches, and none
    empty. ``chunks`` is also the leading dim of the fp32 partials.
    """
    tile_m, tile_n = tiles_.tile
    col_tiles = tiles_.col_tiles(n)
    row_blocks = max(1, -(-rows // tile_m))
    target = max(1, (num_sms * CTAS_PER_SM) // col_tiles)
    per_chunk = max(-(-MIN_ROWS_PER_CTA // tile_m), -(-row_blocks // target))
    per_chunk = -(-per_chunk // tiles_.rows_in_flight) * tiles_.rows_in_flight
    return -(-row_blocks // per_chunk), per_chunk
