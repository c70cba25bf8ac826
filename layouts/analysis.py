"""Memory-access analysis of tiled copies and MMA-operand loads, on a CPU.

Two questions a layout change must not get wrong:

* Shared memory: how many wavefronts does each warp instruction take against a
  given (possibly swizzled) smem layout? Shared memory has 32 banks of 4 bytes; a
  warp's request is split into phases that are served one after another: 4-byte
  accesses in 1 phase of 32 lanes, 64-bit in 2 phases of 16, 128-bit in 4 phases of
  8, and ``ldmatrix .x4`` in 4 phases, one per 8x8 matrix (8 lanes each giving one
  16-byte row). In a phase, lanes reading the same 4-byte word share it (broadcast);
  distinct words in the same bank serialise. A phase costs as many wavefronts as the
  busiest bank has distinct words; its *conflict degree* is that number (1 = free).
* Global memory: how many 32-byte sectors does each warp request touch, against the
  ideal ``ceil(bytes / 32)`` (base address taken as aligned)?

Accesses are modelled as warp instructions: one per warp of 32 threads, each lane
moving one contiguous vector (a tiled copy's whole value block, or an ldmatrix row).
Small access patterns (a 16x16 ldmatrix, a 16x64 copy) are repeated over every
position of a bigger smem tile, as a kernel's loop would.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from .algebra import AnyLayout, Layout, TVLayout

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
    kind: str = "vector"  # "vector" (ld/st/cp.async) or "ldmatrix"
    origin: Cell = (0, 0)
    warp: int = 0


def warp_instructions(tv: TVLayout, kind: str = "vector", origin: Cell = (0, 0)) -> List[WarpInstruction]:
    """Split a TV layout into warps; each thread's value block is one vector access."""
    out = []
    for w in range(-(-tv.num_threads // WARP)):
        lanes = []
        for t in range(w * WARP, min(tv.num_threads, (w + 1) * WARP)):
            lanes.append(tuple((m + origin[0], n + origin[1]) for m, n in tv.thread_coords(t)))
        out.append(WarpInstruction(tuple(lanes), kind, origin, w))
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


def _lane_bytes(layout: AnyLayout, cells: Sequence[Cell], elem_bits: int) -> Tuple[int, int]:
    """(byte address, width) of one lane's vector; it must be contiguous and aligned."""
    offs = [layout(c) for c in cells]
    if offs != list(range(offs[0], offs[0] + len(offs))):
        raise ValueError(f"cells {cells[:4]}... are not contiguous in {layout}: offsets {offs[:8]}...")
    addr = offs[0] * elem_bits // 8
    width = max(1, len(offs) * elem_bits // 8)
    if addr % width:
        raise ValueError(f"a {width}-byte access at byte {addr} is misaligned")
    return addr, width


def _phases(instr: WarpInstruction, width: int) -> List[range]:
    n = len(instr.lanes)
    if instr.kind == "ldmatrix":
        per = 8  # one 8x8 matrix (8 rows of 16 bytes) per phase
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

    def summary(self) -> str:
        n = len(self.instructions)
        return (
            f"{self.access} on {self.layout}: {n} warp instructions x {self.phases_per_instruction} phases, "
            f"{self.wavefronts / n:g} wavefronts/instr (ideal {self.ideal / n:g}), "
            f"worst conflict {self.max_degree}-way"
            + (" - conflict-free" if self.conflict_free else "")
        )


def bank_conflicts(
    instrs: Sequence[WarpInstruction], layout: AnyLayout, elem_bits: int, access: str = "", layout_name: str = ""
) -> BankConflicts:
    costs, conflicted, cell_bank, first_phase = [], set(), {}, []
    width = phases_n = 0
    for k, instr in enumerate(instrs):
        lane_bytes = [_lane_bytes(layout, cells, elem_bits) for cells in instr.lanes]
        width = lane_bytes[0][1]
        for cells in instr.lanes:
            for c in cells:
                cell_bank[c] = (layout(c) * elem_bits // 8 // BANK_BYTES) % NUM_BANKS
        phases = _phases(instr, width)
        phases_n = len(phases)
        wave, degree, ideal = 0, 1, 0
        for p, lanes in enumerate(phases):
            words = defaultdict(set)
            nbytes = set()
            for lane in lanes:
                addr, w = lane_bytes[lane]
                nbytes.update(range(addr, addr + w))
                for word in range(addr // BANK_BYTES, (addr + w - 1) // BANK_BYTES + 1):
                    words[word % NUM_BANKS].add(word)
            d = max(len(s) for s in words.values())
            wave += d
            degree = max(degree, d)
            ideal += -(-len(nbytes) // PHASE_BYTES)
            if d > 1:
                for lane in lanes:
                    conflicted.update(instr.lanes[lane])
            if k == 0 and p == 0:
                first_phase = [c for lane in lanes for c in instr.lanes[lane]]
        costs.append(InstructionCost(instr.origin, instr.warp, wave, ideal, degree))
    return BankConflicts(access, layout_name or str(layout), elem_bits, width, phases_n, costs, cell_bank,
                         conflicted, first_phase)


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

    def summary(self) -> str:
        b, s, i = max(self.bytes_per_request), max(self.sectors), max(self.ideal)
        return (
            f"{self.access}: {self.requests} warp requests of {b} bytes, {s} sectors each "
            f"(ideal {i}), efficiency {100 * self.efficiency:.0f}%"
            + (" - fully coalesced" if self.fully_coalesced else "")
        )


def coalescing(tv: TVLayout, elem_bits: int, gmem: Optional[Layout] = None, access: str = "") -> Coalescing:
    """Sectors per warp request of the copy ``tv`` over ``gmem`` (default: row-major tile)."""
    M, N = tv.tile
    gmem = gmem or Layout((M, N), (N, 1))
    nbytes, sectors, ideal, cell_sector, cell_warp = [], [], [], {}, {}
    for instr in warp_instructions(tv):
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
            cell_sector[c] = rank[a // SECTOR_BYTES]
            cell_warp[c] = instr.warp
        nbytes.append(len(touched))
        sectors.append(len(secs))
        ideal.append(-(-len(touched) // SECTOR_BYTES))
    return Coalescing(access, elem_bits, nbytes, sectors, ideal, cell_sector, cell_warp)


def analyse(entry) -> list:
    """The reports that make sense for a catalogue entry (see ``catalogue``)."""
    from . import catalogue

    reports = []
    if isinstance(entry, catalogue.CopyEntry) and entry.memory == "gmem":
        reports.append(coalescing(entry.tv(), entry.spec.elem_bits, access=entry.name))
    elif isinstance(entry, (catalogue.CopyEntry, catalogue.LdMatrixEntry)):
        for name in entry.smem_layouts:
            reports.append(smem_report(entry, catalogue.get(name)))
    elif isinstance(entry, catalogue.SmemEntry):
        for name in entry.accesses:
            reports.append(smem_report(catalogue.get(name), entry))
    return reports


def smem_report(access_entry, smem_entry) -> BankConflicts:
    """``access_entry`` (a copy or ldmatrix) repeated over all of ``smem_entry``'s tile."""
    if access_entry.elem_bits != smem_entry.elem_bits:
        raise ValueError(f"{access_entry.name} moves {access_entry.elem_bits}-bit elements, "
                         f"{smem_entry.name} holds {smem_entry.elem_bits}-bit ones")
    instrs = tiled_over(access_entry.access_tv(), smem_entry.tile, access_entry.access_kind)
    return bank_conflicts(instrs, smem_entry.layout, smem_entry.elem_bits, access_entry.name, smem_entry.name)
