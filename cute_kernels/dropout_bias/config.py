"""Choices of the dropout + bias backward that are not layouts: how the rows of a column tile
split over CTAs (the grid the op launches). The tiles are ``layouts/dropout_bias.py``."""

from __future__ import annotations

from layouts.dropout_bias import DropoutBiasBwdTiles

CTAS_PER_SM = 1  # CTAs per SM when sizing the grid (512 threads at ~100 registers: one fits)
MIN_ROWS_PER_CTA = 256  # below this a CTA's fixed cost (partials, reduction) dominates


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
