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

Chosen on the H100 (docs/dropout_bias.md): 16 x 32 threads with 8
rows in flight and one CTA per SM beat 8 x 32 / 4 rows and more CTAs per SM by 1-5%
at 16384 x 4096; L1/L2 cache hints (no-allocate, streaming, evict-first) cost 1-3%.

N (or a stride or an address) not a multiple of the vector falls back to the widest
vector that divides it, down to one element, so no access straddles a row end.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import TiledCopySpec

MAX_VECTOR_BITS = 128
THREADS = (16, 32)  # (rows, cols) of threads in a CTA
ROWS_IN_FLIGHT = 8  # row blocks loaded before the first use (memory-level parallelism)
# Cache hints: every byte is touched once, so nothing is worth keeping in L1.
LOAD_HINTS = dict(op="universal")
STORE_HINTS = dict(op="universal")


@dataclass(frozen=True)
class DropoutBiasBwdTiles:
    elem_bits: int
    vec: int
    threads: tuple = THREADS
    rows_in_flight: int = ROWS_IN_FLIGHT

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
    return DropoutBiasBwdTiles(elem_bits=elem_bits, vec=vec)
