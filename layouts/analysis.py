"""Memory-access analysis of tiled copies and MMA-operand loads, on a CPU.

Two questions a layout change must not get wrong:

* Shared memory: how many wavefronts does each warp instruction take against a
  given (possibly swizzled) smem layout? Shared memory has 32 banks of 4 bytes; a
  warp's request is split into phases that are served one after another: 4-byte
  accesses in 1 phase of 32 lanes, 64-bit in 2 phases of 16, 128-bit in 4 phases of
  8, and ``ldmatrix`` / ``stmatrix .x4`` in 4 phases, one per 8x8 matrix (8 lanes each
  giving one 16-byte row); wgmma core matrices and TMA pieces are counted the same way
  (``layouts.access`` says how). A lane's byte address is its first element's offset
  through the layout, swizzle included. In a phase, lanes reading the same 4-byte word
  share it (broadcast); distinct words in the same bank serialise. A phase costs as many
  wavefronts as the busiest bank has distinct words; its *conflict degree* is that
  number (1 = free). The tile's base is taken as 1024-byte aligned (the kernels' shared
  buffers are, so that a swizzle on addresses acts as the one on offsets).
* Global memory: how many 32-byte sectors does each warp request touch, against the
  ideal ``ceil(bytes / 32)`` (base address taken as aligned)?

Accesses are modelled as instructions: one per warp of 32 threads and vector, each lane
moving one contiguous vector (a tiled copy's value block, a fragment's pair, an
ldmatrix row), or one per wgmma operand slice / TMA box. Small access patterns (a 16x16
ldmatrix, a 16x64 copy) are repeated over every position of a bigger smem tile, as a
kernel's loop would.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .algebra import AnyLayout, ComposedLayout, Layout, TVLayout, flatten

WARP = 32
NUM_BANKS = 32
BANK_BYTES = 4
PHASE_BYTES = NUM_BANKS * BANK_BYTES  # 128 bytes served per wavefront at best
SECTOR_BYTES = 32

Cell = Tuple[int, int]


@dataclass(frozen=True)
class WarpInstruction:
    """One warp-wide access: ``lanes[i]`` is the cells lane i moves, in vector order."""

    lanes: Tuple[Tuple[Cell, ...], ...]
    kind: str = "vector"  # "vector" (ld/st/cp.async) or "matrix" (ldmatrix, stmatrix, wgmma core matrices)
    origin: Cell = (0, 0)
    warp: int = 0
    group: int = 0  # which of a thread's vectors (a fragment stored as pairs makes several)


def _mode_offsets(shape, stride, n: int) -> np.ndarray:
    """Offsets of the linear indices 0..n-1 of one (possibly nested) mode, colexicographic."""
    idx, out = np.arange(n), np.zeros(n, dtype=np.int64)
    for s, d in zip(flatten(shape), flatten(stride)):
        out += (idx % s) * d
        idx //= s
    return out


@functools.lru_cache(maxsize=256)
def offset_table(layout: AnyLayout, rows: int, cols: int) -> np.ndarray:
    """``layout((m, n))`` for every cell of a rows x cols tile, swizzle included: the same
    numbers as calling the layout, vectorised (the analysis asks for every cell many times)."""
    inner = layout.layout if isinstance(layout, ComposedLayout) else layout
    m, n = inner.modes()
    table = _mode_offsets(m.shape, m.stride, rows)[:, None] + _mode_offsets(n.shape, n.stride, cols)[None, :]
    if isinstance(layout, ComposedLayout):
        sw, x = layout.swizzle, table + layout.offset
        y = x & sw.yyy_mask
        table = x ^ (y >> sw.shift if sw.shift >= 0 else y << -sw.shift)
    return table


@functools.lru_cache(maxsize=256)
def tv_table(tv: TVLayout) -> np.ndarray:
    """(threads, values, 2): the (m, n) of every (thread, value), vectorised ``tv.coord``."""
    t, v = tv.num_threads, tv.num_values
    th, va = tv.layout[0], tv.layout[1]
    idx = _mode_offsets(th.shape, th.stride, t)[:, None] + _mode_offsets(va.shape, va.stride, v)[None, :]
    return np.stack([idx % tv.tile[0], idx // tv.tile[0]], axis=-1)


def warp_instructions(
    tv: TVLayout, kind: str = "vector", origin: Cell = (0, 0), values_per_access: int = 0, transpose: bool = False
) -> List[WarpInstruction]:
    """Split a TV layout into warps; ``values_per_access`` consecutive values of a thread
    (all of them by default) are one vector access, so a thread holding 4 accumulator
    values stored as pairs makes 2 instructions. ``transpose``: the TV's (m, n) is (n, m)."""
    per = values_per_access or tv.num_values
    coords = tv_table(tv)[:, :, ::-1] if transpose else tv_table(tv)
    coords = (coords + np.array(origin)).tolist()
    out = []
    for w in range(-(-tv.num_threads // WARP)):
        threads = range(w * WARP, min(tv.num_threads, (w + 1) * WARP))
        for g in range(tv.num_values // per):
            lanes = tuple(tuple(tuple(c) for c in coords[t][g * per : (g + 1) * per]) for t in threads)
            out.append(WarpInstruction(lanes, kind, origin, w, g))
    return out


def tiled_over(tv: TVLayout, shape: Tuple[int, int], kind: str = "vector") -> List[WarpInstruction]:
    """Every warp instruction of ``tv`` repeated at each tile position inside ``shape``."""
    M, N = tv.tile
    if shape[0] % M or shape[1] % N:
        raise ValueError(f"access tile {M}x{N} does not divide the layout {shape[0]}x{shape[1]}")
    out = []
    for i in range(shape[0] // M):
        for j in range(shape[1] // N):
            out.extend(warp_instructions(tv, kind, (i * M, j * N)))
    return out


def _lane_bytes(offset, cells: Sequence[Cell], elem_bits: int) -> Tuple[int, int]:
    """(byte address, width) of one lane's vector; it must be contiguous and aligned.
    ``offset(cell)`` is the element offset through the layout (and its swizzle)."""
    offs = [offset(c) for c in cells]
    if offs != list(range(offs[0], offs[0] + len(offs))):
        raise ValueError(f"cells {cells[:4]}... are not contiguous: offsets {offs[:8]}...")
    addr = offs[0] * elem_bits // 8
    width = max(1, len(offs) * elem_bits // 8)
    if addr % width:
        raise ValueError(f"a {width}-byte access at byte {addr} is misaligned")
    return addr, width


def _phases(instr: WarpInstruction, width: int) -> List[range]:
    n = len(instr.lanes)
    if instr.kind in ("matrix", "ldmatrix"):
        per = 8  # one 8 x 16-byte matrix per phase (ldmatrix / stmatrix, a wgmma core matrix)
    else:
        per = WARP if width <= BANK_BYTES else max(1, PHASE_BYTES // width)
    return [range(i, min(n, i + per)) for i in range(0, n, per)]


@dataclass
class InstructionCost:
    origin: Cell
    warp: int
    wavefronts: int
    ideal: int
    degree: int  # worst phase
    group: int = 0

    def where(self, kind: str) -> str:
        """Which instruction: thread accesses by warp and vector, the others by position."""
        if kind == "vector":
            return f"at {self.origin}, warp {self.warp}, vector {self.group}"
        return f"at {self.origin}"


@dataclass
class BankConflicts:
    """Bank-conflict figures of one access pattern against one smem layout."""

    access: str
    layout: str
    elem_bits: int
    width_bytes: int
    phases_per_instruction: int
    instructions: List[InstructionCost]
    cell_bank: Dict[Cell, int] = field(repr=False)
    conflicted: set = field(repr=False)  # cells read in a phase of degree > 1
    first_phase: List[Cell] = field(repr=False)  # cells of instruction 0, phase 0 (for pictures)
    first_instruction: Optional[WarpInstruction] = field(default=None, repr=False)
    first_conflicted: set = field(default_factory=set, repr=False)  # cells of instruction 0 in conflicted phases
    unit: str = "warp instructions"
    lane: str = "T"  # how pictures name a lane: T thread, R matrix row, P TMA piece
    label: str = ""  # the report's name of the access; default "<access> on <layout>"

    @property
    def wavefronts(self) -> int:
        return sum(i.wavefronts for i in self.instructions)

    @property
    def ideal(self) -> int:
        return sum(i.ideal for i in self.instructions)

    @property
    def max_degree(self) -> int:
        return max(i.degree for i in self.instructions)

    @property
    def conflict_free(self) -> bool:
        return self.wavefronts == self.ideal

    @property
    def name(self) -> str:
        return self.label or f"{self.access} on {self.layout}"

    @property
    def kind(self) -> str:
        return self.first_instruction.kind if self.first_instruction else "vector"

    def summary(self) -> str:
        n, phases = len(self.instructions), self.phases_per_instruction
        unit = self.unit if n > 1 else _SINGULAR.get(self.unit, self.unit)
        return (
            f"{self.name}: {n} {unit} x {phases} phase{'s' if phases > 1 else ''}, "
            f"{self.wavefronts / n:g} wavefronts/instr (ideal {self.ideal / n:g}), "
            f"worst conflict {self.max_degree}-way" + (" - conflict-free" if self.conflict_free else "")
        )

    def worst(self, count: int = 4) -> List[InstructionCost]:
        """Up to ``count`` instructions of the worst conflict degree (none when conflict-free)."""
        if self.conflict_free:
            return []
        return [i for i in self.instructions if i.degree == self.max_degree][:count]


_SINGULAR = {"warp instructions": "warp instruction", "instructions": "instruction", "TMA boxes": "TMA box"}


def _phase_cost(lanes: Sequence[Tuple[int, int]]) -> Tuple[int, int]:
    """(wavefronts, ideal) of one phase of (byte address, width) lane accesses: the busiest
    bank's distinct words (lanes on one word share it), against 128 bytes a wavefront."""
    words = defaultdict(set)
    nbytes = set()
    for addr, w in lanes:
        nbytes.update(range(addr, addr + w))
        for word in range(addr // BANK_BYTES, (addr + w - 1) // BANK_BYTES + 1):
            words[word % NUM_BANKS].add(word)
    return max(len(s) for s in words.values()), -(-len(nbytes) // PHASE_BYTES)


def bank_conflicts(
    instrs: Sequence[WarpInstruction],
    layout: AnyLayout,
    elem_bits: int,
    access: str = "",
    layout_name: str = "",
    **labels,
) -> BankConflicts:
    """Wavefronts of each instruction against ``layout`` (element offsets, swizzle
    included: the byte address of a lane is its first element's offset through the
    swizzle). ``labels``: BankConflicts' unit / lane / label."""
    rows = 1 + max(c[0] for i in instrs for lane in i.lanes for c in lane)
    cols = 1 + max(c[1] for i in instrs for lane in i.lanes for c in lane)
    table = offset_table(layout, rows, cols).tolist()
    offsets: Dict[Cell, int] = {}

    def offset(c):
        o = offsets[c] = table[c[0]][c[1]]
        return o

    costs, conflicted, first_phase, first_conflicted = [], set(), [], set()
    width = phases_n = 0
    for k, instr in enumerate(instrs):
        lane_bytes = [_lane_bytes(offset, cells, elem_bits) for cells in instr.lanes]
        width = lane_bytes[0][1]
        phases = _phases(instr, width)
        phases_n = len(phases)
        wave = ideal = 0
        degree = 1
        for p, lanes in enumerate(phases):
            d, i = _phase_cost([lane_bytes[lane] for lane in lanes])
            wave, ideal, degree = wave + d, ideal + i, max(degree, d)
            if d > 1:
                for lane in lanes:
                    conflicted.update(instr.lanes[lane])
                    if k == 0:
                        first_conflicted.update(instr.lanes[lane])
            if k == 0 and p == 0:
                first_phase = [c for lane in lanes for c in instr.lanes[lane]]
        costs.append(InstructionCost(instr.origin, instr.warp, wave, ideal, degree, instr.group))
    cell_bank = {c: (o * elem_bits // 8 // BANK_BYTES) % NUM_BANKS for c, o in offsets.items()}
    return BankConflicts(
        access,
        layout_name or str(layout),
        elem_bits,
        width,
        phases_n,
        costs,
        cell_bank,
        conflicted,
        first_phase,
        instrs[0] if instrs else None,
        first_conflicted,
        **labels,
    )


@dataclass
class Coalescing:
    """Global-memory sectors per warp request of a tiled copy."""

    access: str
    elem_bits: int
    bytes_per_request: List[int]
    sectors: List[int]
    ideal: List[int]
    cell_sector: Dict[Cell, int] = field(repr=False)  # sector index within its request
    cell_warp: Dict[Cell, int] = field(repr=False)

    @property
    def requests(self) -> int:
        return len(self.sectors)

    @property
    def efficiency(self) -> float:
        return sum(self.ideal) / sum(self.sectors)

    @property
    def fully_coalesced(self) -> bool:
        return self.sectors == self.ideal

    @property
    def name(self) -> str:
        return self.access

    def summary(self) -> str:
        b, s, i = max(self.bytes_per_request), max(self.sectors), max(self.ideal)
        return (
            f"{self.access}: {self.requests} warp requests of {b} bytes, {s} sectors each "
            f"(ideal {i}), efficiency {100 * self.efficiency:.0f}%"
            + (" - fully coalesced" if self.fully_coalesced else "")
        )


def coalescing(
    tv: TVLayout, elem_bits: int, gmem: Optional[Layout] = None, access: str = "", values_per_access: int = 0
) -> Coalescing:
    """Sectors per warp request of the copy ``tv`` over ``gmem`` (default: row-major tile);
    ``values_per_access`` as in ``warp_instructions``."""
    M, N = tv.tile
    gmem = gmem or Layout((M, N), (N, 1))
    nbytes, sectors, ideal, cell_sector, cell_warp = [], [], [], {}, {}
    for instr in warp_instructions(tv, values_per_access=values_per_access):
        touched = set()
        cell_addr = {}
        for cells in instr.lanes:
            for c in cells:
                addr = gmem(c) * elem_bits // 8
                touched.update(range(addr, addr + max(1, elem_bits // 8)))
                cell_addr[c] = addr
        secs = sorted({a // SECTOR_BYTES for a in touched})
        rank = {s: i for i, s in enumerate(secs)}
        for c, a in cell_addr.items():
            cell_sector.setdefault(c, rank[a // SECTOR_BYTES])
            cell_warp.setdefault(c, instr.warp)
        nbytes.append(len(touched))
        sectors.append(len(secs))
        ideal.append(-(-len(touched) // SECTOR_BYTES))
    return Coalescing(access, elem_bits, nbytes, sectors, ideal, cell_sector, cell_warp)


def analyse(entry) -> list:
    """The reports that make sense for a catalogue entry (see ``catalogue``)."""
    return list(_analyse(entry))


@functools.lru_cache(maxsize=None)  # entries are frozen: the CLI, pictures and tests ask again
def _analyse(entry) -> tuple:
    from . import catalogue

    reports = []
    if isinstance(entry, catalogue.CopyEntry) and entry.memory == "gmem":
        reports.append(
            coalescing(
                entry.tv(),
                entry.spec.elem_bits,
                entry.gmem(),
                access=entry.name,
                values_per_access=entry.values_per_access,
            )
        )
    elif isinstance(entry, (catalogue.CopyEntry, catalogue.LdMatrixEntry)):
        for name in entry.smem_layouts:
            reports.append(smem_report(entry, catalogue.get(name)))
    elif isinstance(entry, catalogue.SmemEntry):
        for acc in entry.accesses:
            named = isinstance(acc, str)  # a copy / ldmatrix entry, or an access described in place
            reports.append(smem_report(catalogue.get(acc), entry) if named else access_report(acc, entry))
    return tuple(reports)


def no_access_reason(entry) -> str:
    """Why ``analyse(entry)`` has nothing to report (the entry touches no memory itself)."""
    from . import catalogue

    if isinstance(entry, catalogue.MmaEntry):
        return "register layout (MMA fragments): no shared-memory access"
    if isinstance(entry, catalogue.LayoutEntry):
        return entry.no_access or "plain layout: no memory access of its own"
    if isinstance(entry, catalogue.SmemEntry):
        return "shared-memory tile with no access described"
    return "no memory access to analyse"


def smem_report(access_entry, smem_entry) -> BankConflicts:
    """``access_entry`` (a copy or ldmatrix) repeated over all of ``smem_entry``'s tile."""
    if access_entry.elem_bits != smem_entry.elem_bits:
        raise ValueError(
            f"{access_entry.name} moves {access_entry.elem_bits}-bit elements, "
            f"{smem_entry.name} holds {smem_entry.elem_bits}-bit ones"
        )
    instrs = tiled_over(access_entry.access_tv(), smem_entry.tile, access_entry.access_kind)
    return bank_conflicts(instrs, smem_entry.view, smem_entry.elem_bits, access_entry.name, smem_entry.name)


def access_report(access, smem_entry) -> BankConflicts:
    """A ``layouts.access.SmemAccess`` over all of ``smem_entry``'s tile, labelled with the
    tile's swizzle ("wgmma A read of K (K-major, 128B swizzle)")."""
    from .access import swizzle_name

    view, bits = smem_entry.view, smem_entry.elem_bits
    instrs = access.instructions(view, smem_entry.tile, bits)
    label = f"{access.label} ({', '.join(filter(None, (access.detail, swizzle_name(view, bits))))})"
    return bank_conflicts(
        instrs, view, bits, access.label, smem_entry.name, unit=access.unit, lane=access.lane, label=label
    )
