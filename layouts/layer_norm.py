"""Tiles of the LayerNorm / RMSNorm forward and backward (seed: Apex ``fast_layer_norm``
``ln_fwd_kernel`` / ``ln_bwd_kernel``).

``RowTiles`` is one Apex kernel-traits instance (``vec`` = ``ELTS_PER_LDG``, ``ldgs`` =
``LDGS``, ``threads_per_row`` = 32 * ``WARPS_N``, ``ctas_per_row`` = ``CTAS_PER_ROW``,
``rows_per_cta`` = ``ROWS_PER_CTA``, plus the cp.async ring's ``stages`` and the persistent
grid's ``ctas_per_sm``) with the copies and the ring that follow from it. ``LnFwdTiles`` (the
forward: a ring of x, one row sum exchanged at a time) and ``LnBwdTiles`` (the backward: x and
dz, two sums at once, the column partials' fold) add their shared-memory footprints;
``LnBwdFinalizeTiles`` is the finalize's column-sum tile and its fold. The rules that pick them
from (N, dtypes, arch), their measured constants and tables are
``cute_kernels/layer_norm/config.py`` (``ln_fwd_tiles``, ``ln_bwd_tiles``, ``finalize_tiles``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .spec import TiledCopySpec

MAX_VECTOR_BITS = 128
MAX_CLUSTER = 8  # portable cluster size on sm_90
CLUSTER_EXCHANGES = ("mbarrier", "barrier")
REG_FILE = 65536  # 32-bit registers per SM (sm_80, sm_90)
MAX_THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 16
# min blocks per SM is passed to ptxas (Apex's launch bounds); the carveout stays the driver's default
SMEM_CARVEOUT = -1
# Loads read each byte once: cp.async .cg (L2 only) where the access is 16 bytes.
STORE_HINTS = dict(op="universal")


def widest_vec(n: int, bits: int) -> int:
    """The widest vector (elements, <= 128 bits) that divides a row of ``n`` elements."""
    v = MAX_VECTOR_BITS // bits
    while n % v:
        v //= 2
    return v


@dataclass(frozen=True)
class RowTiles:
    """What the forward's and the backward's traits share (``cute_kernels/layer_norm/config.py`` has the tables)."""

    vec: int
    ldgs: int
    threads_per_row: int
    ctas_per_row: int
    rows_per_cta: int
    stages: int
    ctas_per_sm: int
    cluster_exchange: str = "mbarrier"

    def __post_init__(self):
        if self.cluster_exchange not in CLUSTER_EXCHANGES:
            raise ValueError(f"cluster_exchange must be one of {CLUSTER_EXCHANGES}, got {self.cluster_exchange!r}")

    @property
    def exchange_mbarriers(self) -> bool:
        """Whether the cluster row exchange runs through st.async + mbarriers."""
        return self.ctas_per_row > 1 and self.cluster_exchange == "mbarrier"

    @property
    def num_threads(self) -> int:
        return self.threads_per_row * self.rows_per_cta

    @property
    def warps_n(self) -> int:
        """Warps sharing a row (1 when a row has a warp or less)."""
        return max(1, self.threads_per_row // 32)

    @property
    def warps_m(self) -> int:
        return self.num_threads // 32 // self.warps_n

    @property
    def lanes_per_row(self) -> int:
        """Lanes of one warp on the same row: the width of the shuffle all-reduce."""
        return min(32, self.threads_per_row)

    @property
    def tile(self) -> tuple:
        """(rows, cols) covered by one vector access of every thread of the CTA."""
        return (self.rows_per_cta, self.threads_per_row * self.vec)

    @property
    def cols_per_cta(self) -> int:
        return self.ldgs * self.threads_per_row * self.vec

    def replace_stages(self, stages: int):
        return replace(self, stages=stages)

    @property
    def max_n(self) -> int:
        return self.cols_per_cta * self.ctas_per_row

    def col_tile(self, it, cta):
        """The row's column tile (of ``tile``'s width) that CTA ``cta`` loads at ldg ``it``: the
        row's CTAs take turns a ldg at a time (Apex's order). Python or DSL integers."""
        return it * self.ctas_per_row + cta

    def vector_index(self, col_tile, thread):
        """Thread ``thread``'s vector (of ``vec`` elements, from column index x vec) in column tile
        ``col_tile``: a tile's threads take consecutive vectors."""
        return col_tile * self.threads_per_row + thread

    def exchange_bytes(self, values: int) -> int:
        """Bytes of one row exchange of ``values`` fp32 a warp: every CTA's, every warp's, for
        the CTA's rows (a buffer's size; what one exchange brings to a CTA)."""
        return self.ctas_per_row * self.rows_per_cta * self.warps_n * values * 4

    def gmem_copy(self, elem_bits: int, load: bool) -> TiledCopySpec:
        """Row loads (into the ring) and stores: one ``vec`` vector per thread."""
        bits = elem_bits * self.vec
        if not load:
            hints = STORE_HINTS
        elif bits >= 32:  # cp.async moves 4, 8 or 16 bytes; .cg only 16
            hints = dict(op="cp.async", load_cache="global" if bits == 128 else "always")
        else:  # narrower vectors are copied synchronously through registers
            hints = dict(op="universal")
        return TiledCopySpec((self.rows_per_cta, self.threads_per_row), (1, self.vec), elem_bits, **hints)

    def ring(self) -> tuple:
        """(shape, order) of the cp.async ring: (rows, threads x vec, ldgs, stages), the
        copy's rows of threads contiguous per vector, so 16-byte accesses of consecutive
        threads hit consecutive banks."""
        return (self.rows_per_cta, self.threads_per_row * self.vec, self.ldgs, self.stages), (1, 0, 2, 3)


@dataclass(frozen=True)
class LnFwdTiles(RowTiles):
    """The forward: a ring of x and the row's exchange: each warp's sum (RMSNorm: of x^2), then
    LayerNorm's centred sum of squares in a second exchange, or with ``one_exchange`` beside the
    sum, about the warp's own mean."""

    one_exchange: bool = False

    @property
    def red_bytes(self) -> int:
        """Bytes of one buffer of the row exchange (every CTA's, every warp's fp32 values: two
        with ``one_exchange``, of which RMSNorm sends one)."""
        return self.exchange_bytes(2 if self.one_exchange else 1)

    def stage_bytes(self, in_bits: int) -> int:
        return self.rows_per_cta * self.cols_per_cta * in_bits // 8

    def smem_bytes(self, in_bits: int) -> int:
        """The ring and the row-sum exchange (double-buffered, with its two mbarriers)."""
        red = 2 * self.red_bytes + (2 * 8 if self.exchange_mbarriers else 0)
        return self.stages * self.stage_bytes(in_bits) + red


@dataclass(frozen=True)
class LnBwdTiles(RowTiles):
    """The backward: a ring of x and dz; (sum dy, sum dy * y) exchanged together; the CTA's
    rows' column partials folded through shared memory."""

    @property
    def red_bytes(self) -> int:
        """Bytes of one buffer of the row-sum exchange (every CTA's, every warp's two fp32 sums)."""
        return self.exchange_bytes(2)

    def stage_bytes(self, in_bits: int, out_bits: int) -> int:
        return self.rows_per_cta * self.cols_per_cta * (in_bits + out_bits) // 8

    def smem_bytes(self, in_bits: int, out_bits: int, num_partials: int) -> int:
        """The ring, the row-sum exchange (double-buffered, with its two mbarriers) and the
        WARPS_M fold of the partials."""
        ring = self.stages * self.stage_bytes(in_bits, out_bits)
        red = 2 * self.red_bytes + (2 * 8 if self.exchange_mbarriers else 0)
        fold = num_partials * self.rows_per_cta * self.cols_per_cta * 4 if self.rows_per_cta > 1 else 0
        return ring + red + fold


@dataclass(frozen=True)
class LnBwdFinalizeTiles:
    """Column sums of the [ctas_per_col, N] fp32 partials: row threads walk the partials."""

    vec: int
    threads: tuple  # (row threads, column threads) per CTA
    rows_unroll: int  # partial rows each thread loads before adding them

    @property
    def num_threads(self) -> int:
        return self.threads[0] * self.threads[1]

    @property
    def tile_n(self) -> int:
        return self.threads[1] * self.vec

    def col_tiles(self, n: int) -> int:
        return -(-n // self.tile_n)

    # The fold of the row threads' sums: lanes of a warp that share columns first
    # (butterfly over the lanes col_threads apart), then one entry per warp (or per
    # group of col_threads lanes when a warp spans several columns groups) meets the
    # others in shared memory.
    @property
    def lane_fold_steps(self) -> int:
        """Butterfly steps over row threads inside a warp (log2 of row threads per warp)."""
        per_warp = max(1, 32 // self.threads[1])
        return min(per_warp, self.threads[0]).bit_length() - 1

    @property
    def fold_threads_per_entry(self) -> int:
        """Threads whose sums one shared entry holds after the butterfly."""
        return self.threads[1] << self.lane_fold_steps

    @property
    def fold_cols_per_warp(self) -> int:
        """Lanes of a warp that write a shared entry (the first of each butterfly group)."""
        return min(32, self.threads[1])

    @property
    def fold_rows(self) -> int:
        return self.num_threads // self.fold_threads_per_entry

    def fold_layout(self):
        """(fold rows, tile_n) fp32 shared tile where the warps' sums meet (DSL layout)."""
        import cutlass.cute as cute

        return cute.make_ordered_layout((self.fold_rows, self.tile_n), order=(1, 0))
