"""Tiles of the fused dropout + bias backward (seed: LightSeq ``ls_dropout_bias_bwd``).

The seed uses a (8 x 128) thread block, one column per thread and a serial walk over
rows. We keep the idea (threads walk rows, accumulating column sums in registers) but
give every thread a 128-bit vector of columns, so each warp moves 512 contiguous bytes
of dY per row, and split the rows over several CTAs per column tile whose per-column
partials the last-arriving CTA sums in a fixed order (``common/column_partials``).

| dtype | vector (elems) | threads (rows x cols) | CTA tile (rows x cols) | rows in flight / thread |
|-------|----------------|-----------------------|------------------------|-------------------------|
| fp32  | 4              | 16 x 32               | 16 x 128               | 8                       |
| fp16  | 8              | 16 x 32               | 16 x 256               | 8                       |
| bf16  | 8              | 16 x 32               | 16 x 256               | 8                       |

The threads and rows in flight are chosen by ``tiles`` in ``cute_kernels/dropout_bias/config.py``,
on the H100 (docs/dropout_bias.md): 16 x 32 threads with 8
rows in flight and one CTA per SM beat 8 x 32 / 4 rows and more CTAs per SM by 1-5%
at 16384 x 4096; L1/L2 cache hints (no-allocate, streaming, evict-first) cost 1-3%.

N (or a stride or an address) not a multiple of the vector falls back to the widest
vector that divides it, down to one element, so no access straddles a row end.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import TiledCopySpec

MAX_VECTOR_BITS = 128
# Cache hints: every byte is touched once, so nothing is worth keeping in L1.
LOAD_HINTS = dict(op="universal")
STORE_HINTS = dict(op="universal")


@dataclass(frozen=True)
class DropoutBiasBwdTiles:
    elem_bits: int
    vec: int
    threads: tuple  # (rows, cols) of threads in a CTA
    rows_in_flight: int  # row blocks loaded before the first use

    @property
    def num_threads(self) -> int:
        return self.threads[0] * self.threads[1]

    @property
    def tile(self) -> tuple:
        return (self.threads[0], self.threads[1] * self.vec)

    def gmem_load(self) -> TiledCopySpec:
        """dY / x: one 128-bit (or narrower) vector per thread per row, read once."""
        return TiledCopySpec(self.threads, (1, self.vec), self.elem_bits, **LOAD_HINTS)

    def gmem_load_mask(self) -> TiledCopySpec:
        """The keep mask (one byte per element) with the same thread/value layout."""
        return TiledCopySpec(self.threads, (1, self.vec), 8, **LOAD_HINTS)

    def gmem_store(self) -> TiledCopySpec:
        """dX, the same thread/value layout as the loads."""
        return TiledCopySpec(self.threads, (1, self.vec), self.elem_bits, **STORE_HINTS)

    def col_tiles(self, n: int) -> int:
        return -(-n // self.tile[1])
