"""Shared-memory accesses the kernels make, as the warp instructions ``analysis`` counts.

Three shapes of access cover every shared-memory access of the kernels:

* ``vector``: threads of a tiled copy or an MMA fragment each move a few contiguous
  elements (cp.async, ld/st.shared, autovec copies). ``values_per_access`` consecutive
  values of a thread form one vector, so an accumulator fragment stored as pairs makes
  one instruction per pair. ``transpose`` reads the TV layout's (m, n) as the tile's
  (n, m) (an S^T accumulator stored into a (query, key) tile).
* ``matrix``: 8 x 16-byte matrices. ldmatrix / stmatrix lanes each address one
  16-byte row of an 8x8 matrix, a matrix per phase; wgmma reads its shared operands as
  8 x 16-byte core matrices, which we count the same way (one core matrix, 128 bytes,
  per phase). A matrix's 8 rows are 8 consecutive lines of the tile across its
  contiguous dimension, 16 bytes along it, whichever major mode the MMA reads (an
  MN-major view reads the same rows, only the registers differ). ``block`` is the part
  of the tile one instruction covers (16x16 for an ``.x4``, the operand slice of a wgmma).
* ``tma``: a TMA box, cut the way the DSL cuts it into boxes one swizzle span wide (the
  inner box dimension of a swizzled tensor map is at most the swizzle's 32, 64 or 128
  bytes), moved in 16-byte pieces, inner dimension first, 8 pieces (128 bytes) a phase.
  The TMA unit's own order is not documented; this is the order a box's bytes have.

The wgmma and TMA models are ours, not NVIDIA's: neither documents its shared-memory
access at bank level. They count what the canonical swizzled layouts are built to
serve: 8 rows of 16 bytes across 32 distinct banks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .algebra import AnyLayout, ComposedLayout, Layout, TVLayout
from .analysis import WarpInstruction, warp_instructions

MATRIX_ROWS = 8
ROW_BYTES = 16  # a matrix row, a TMA piece


def as_2d(layout: AnyLayout) -> AnyLayout:
    """``layout`` with its modes after the first grouped into one column mode (a rank-4
    ring (rows, cols, buffers, stages) as rows x everything else); rank 2 unchanged."""
    inner = layout.layout if isinstance(layout, ComposedLayout) else layout
    if inner.rank <= 2:
        return layout
    modes = inner.modes()
    grouped = Layout(
        (modes[0].shape, tuple(m.shape for m in modes[1:])), (modes[0].stride, tuple(m.stride for m in modes[1:]))
    )
    if isinstance(layout, ComposedLayout):
        return ComposedLayout(layout.swizzle, grouped, layout.offset)
    return grouped


def contiguous_axis(layout: AnyLayout) -> int:
    """0 when consecutive rows are consecutive elements (column-major), else 1."""
    inner = as_2d(layout.layout if isinstance(layout, ComposedLayout) else layout)
    if inner((0, 1)) - inner((0, 0)) == 1:
        return 1
    if inner((1, 0)) - inner((0, 0)) == 1:
        return 0
    raise ValueError(f"{layout} is contiguous along neither mode")


def swizzle_span(layout: AnyLayout) -> Optional[int]:
    """Elements one swizzle row spans (the XORed chunk bits' reach): 64 for bf16 S<3,3,3>
    (128 bytes); None without a swizzle (or with a 0-bit one)."""
    if not isinstance(layout, ComposedLayout) or layout.swizzle.bits == 0:
        return None
    sw = layout.swizzle
    return 1 << (sw.base + sw.bits)


def swizzle_name(layout: AnyLayout, elem_bits: int) -> str:
    span = swizzle_span(layout)
    return "no swizzle" if span is None else f"{span * elem_bits // 8}B swizzle"


@dataclass(frozen=True)
class SmemAccess:
    """One kind of instruction a kernel runs against a shared-memory tile.

    ``label`` says which (``"wgmma A read of K by S^T"``), ``detail`` how (``"K-major"``); the
    report adds the tile's swizzle. ``lane`` names a lane in pictures: T thread, R matrix
    row, P TMA piece.
    """

    label: str
    pattern: str  # "vector", "matrix" or "tma"
    detail: str = ""  # the major mode, the instruction's footprint ("K-major, 64x16 a wgmma")
    block: Optional[Tuple[int, int]] = None  # matrix / tma: (rows, cols) one instruction covers
    tv: Optional[TVLayout] = None  # vector: the threads' elements
    values_per_access: int = 0  # vector: values moved at once (0: all of a thread's)
    transpose: bool = False  # vector: the TV's (m, n) is the tile's (n, m)
    lane_name: str = ""  # how pictures name a lane; default T (thread), R (wgmma matrix row), P (TMA piece)

    def __post_init__(self):
        if self.pattern not in ("vector", "matrix", "tma"):
            raise ValueError(f"unknown access pattern {self.pattern!r}")
        if (self.pattern == "vector") != (self.tv is not None) or (self.pattern != "vector") == (self.block is None):
            raise ValueError(f"{self.label}: a vector access takes a TV layout, the others a block")

    @property
    def lane(self) -> str:
        return self.lane_name or {"vector": "T", "matrix": "R", "tma": "P"}[self.pattern]

    @property
    def unit(self) -> str:
        return {"vector": "warp instructions", "matrix": "instructions", "tma": "TMA boxes"}[self.pattern]

    @property
    def footprint(self) -> Tuple[int, int]:
        """The part of the tile one position of the access covers (``instructions`` steps by it)."""
        if self.tv is None:
            return self.block
        m, n = self.tv.tile
        return (n, m) if self.transpose else (m, n)

    def instructions(self, layout: AnyLayout, tile: Tuple[int, int], elem_bits: int) -> List[WarpInstruction]:
        """Every instruction of this access over the whole ``tile`` of ``layout``."""
        fm, fn = self.footprint
        if tile[0] % fm or tile[1] % fn:
            raise ValueError(f"{self.label}: {fm}x{fn} does not tile {tile[0]}x{tile[1]}")
        build = {"vector": self._vector, "matrix": self._matrix, "tma": self._tma}[self.pattern]
        out = []
        for i in range(tile[0] // fm):
            for j in range(tile[1] // fn):
                out.extend(build(layout, (i * fm, j * fn), elem_bits))
        return out

    # ---- the three shapes ------------------------------------------------------------
    def _vector(self, layout, origin, elem_bits) -> List[WarpInstruction]:
        return warp_instructions(self.tv, "vector", origin, self.values_per_access, self.transpose)

    def _rows(self, layout, elem_bits):
        """(contiguous axis, elements per 16-byte row)."""
        return contiguous_axis(layout), ROW_BYTES * 8 // elem_bits

    def _matrix(self, layout, origin, elem_bits) -> List[WarpInstruction]:
        axis, per_row = self._rows(layout, elem_bits)
        lines, along = (self.block[1], self.block[0]) if axis == 0 else self.block
        if lines % MATRIX_ROWS or along % per_row:
            raise ValueError(f"{self.label}: block {self.block} is not whole 8 x 16-byte matrices")
        lanes = []
        for chunk in range(along // per_row):
            for line in range(lines):
                cells = [(line, chunk * per_row + e) for e in range(per_row)]
                lanes.append(tuple(_cell(axis, line, c, origin) for line, c in cells))
        return [WarpInstruction(tuple(lanes), "matrix", origin, 0)]

    def _tma(self, layout, origin, elem_bits) -> List[WarpInstruction]:
        axis, per_row = self._rows(layout, elem_bits)
        lines, along = (self.block[1], self.block[0]) if axis == 0 else self.block
        inner = min(along, swizzle_span(layout) or along)
        lanes = []
        for box in range(along // inner):
            for line in range(lines):
                for piece in range(inner // per_row):
                    first = box * inner + piece * per_row
                    lanes.append(tuple(_cell(axis, line, first + e, origin) for e in range(per_row)))
        return [WarpInstruction(tuple(lanes), "vector", origin, 0)]


def _cell(axis: int, line: int, along: int, origin) -> Tuple[int, int]:
    """The tile cell at ``line`` across and ``along`` the contiguous axis."""
    m, n = (along, line) if axis == 0 else (line, along)
    return (m + origin[0], n + origin[1])


# ---- common accesses ------------------------------------------------------------------


def mma_c_atom() -> TVLayout:
    """One warp's 16x8 accumulator block of mma.sync m16n8k16, and of wgmma (whose warp w
    holds rows 16w..16w+15 of a 64-row tile in this same pattern): lane (g = lane / 4,
    q = lane % 4) holds rows g and g + 8, columns 2q and 2q + 1 (value pairs)."""
    from .algebra import sm80_mma_16x8x16

    return sm80_mma_16x8x16().c


def fragment(label: str, bits_per_access: int, elem_bits: int, transpose: bool = False, tv=None) -> SmemAccess:
    """An accumulator fragment (one warp's 16x8 atom, or ``tv``) stored or read
    ``bits_per_access`` at a time: bf16 pairs as 32 bits, fp32 pairs as 64."""
    per = max(1, bits_per_access // elem_bits)
    what = f"{bits_per_access}-bit" + (", transposed" if transpose else "")
    return SmemAccess(label, "vector", what, tv=tv or mma_c_atom(), values_per_access=per, transpose=transpose)


def matrix_x4(label: str, detail: str = "") -> SmemAccess:
    """ldmatrix / stmatrix .x4: four 8x8 matrices of 16-bit elements, 16x16 of the tile."""
    return SmemAccess(label, "matrix", detail, block=(16, 16), lane_name="T")  # lane t addresses row t


def wgmma(label: str, detail: str, rows: int, cols: int) -> SmemAccess:
    """One wgmma's operand slice, ``rows`` x ``cols`` of the tile, read as core matrices."""
    return SmemAccess(label, "matrix", f"{detail}, {rows}x{cols} a wgmma", block=(rows, cols))


def tma(label: str, rows: int, cols: int) -> SmemAccess:
    return SmemAccess(label, "tma", f"box {rows}x{cols}", block=(rows, cols))


def copy(label: str, spec, detail: str = "") -> SmemAccess:
    """A tiled copy's threads (``TiledCopySpec``), each moving its value block at once."""
    return SmemAccess(label, "vector", detail or f"{spec.copy_bits}-bit", tv=spec.tv_layout())
