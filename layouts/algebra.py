"""A small pure-Python CuTe layout algebra, for analysing and drawing layouts on a CPU.

Why not use the DSL's own algebra? ``cutlass.cute`` layouts are MLIR values: they
exist only while a ``@cute.jit`` function is being traced (``cute.make_layout`` called
from plain Python raises ``CALL_OUTSIDE_JIT``), and reading one back costs a trace and
an MLIR context. This module needs neither MLIR nor a GPU, so CI, the CLI and the
pictures run anywhere in milliseconds, and every intermediate value is an ordinary
tuple one can print, loop over and assert on.

How it is kept honest: ``tests/test_layouts_algebra.py`` traces a ``@cute.jit``
function with ``cute.compile`` that builds the same layouts with the DSL (ordered
layouts, coalesce, composition, complement, inverses, raked products, the TV layouts
of tiled copies, the SM80 MMA atom and ldmatrix), records their printed form
(``"(16,32):(32,1)"``), parses it with :func:`parse_layout` and compares the two as
functions over their whole domain (and, where the algorithms are the same, as text).

Conventions (CuTe's):

* A layout maps a coordinate to an index: ``L(c) = sum(c_i * d_i)``. Shapes and strides
  are nested tuples of ints (hierarchical modes) and must be congruent.
* A linear index ``i`` is turned into a coordinate colexicographically: the first
  mode varies fastest (``idx2crd``); the last mode takes any overflow.
* A TV layout maps ``(thread, value)`` to the column-major index ``m + M * n`` of an
  element in an ``M x N`` tile (what ``TiledCopy.layout_tv_tiled`` and
  ``TiledMma.tv_layout_A/B/C`` hold in the DSL).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple, Union

IntTuple = Union[int, tuple]

# --------------------------------------------------------------------------- tuples


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def flatten(t: IntTuple) -> tuple:
    if is_int(t):
        return (t,)
    return tuple(x for sub in t for x in flatten(sub))


def product(t: IntTuple) -> int:
    if is_int(t):
        return t
    p = 1
    for x in t:
        p *= product(x)
    return p


def congruent(a: IntTuple, b: IntTuple) -> bool:
    if is_int(a) or is_int(b):
        return is_int(a) and is_int(b)
    return len(a) == len(b) and all(congruent(x, y) for x, y in zip(a, b))


def compact_col_major(shape: IntTuple, start: int = 1) -> IntTuple:
    """Strides of the packed column-major layout of ``shape`` (first mode fastest)."""

    def walk(s, cur):
        if is_int(s):
            return (cur, cur * s)
        out = []
        for sub in s:
            d, cur = walk(sub, cur)
            out.append(d)
        return (tuple(out), cur)

    return walk(shape, start)[0]


def idx2crd(idx: int, shape: IntTuple) -> IntTuple:
    """Colexicographic split of ``idx`` over ``shape``; the last mode absorbs overflow."""
    if is_int(shape):
        return idx
    out = []
    for i, sub in enumerate(shape):
        if i == len(shape) - 1:
            out.append(idx2crd(idx, sub))
        else:
            n = product(sub)
            out.append(idx2crd(idx % n, sub))
            idx //= n
    return tuple(out)


def crd2idx(crd: IntTuple, shape: IntTuple, stride: IntTuple) -> int:
    if is_int(crd) and not is_int(shape):
        crd = idx2crd(crd, shape)
    if is_int(crd):
        return crd * stride
    if len(crd) != len(shape):
        raise ValueError(f"coordinate {crd} does not match shape {shape}")
    return sum(crd2idx(c, s, d) for c, s, d in zip(crd, shape, stride))


def _fmt(t: IntTuple) -> str:
    return str(t) if is_int(t) else "(" + ",".join(_fmt(x) for x in t) + ")"


# -------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """A CuTe layout ``shape:stride`` (nested tuples), a function from coordinates to ints."""

    shape: IntTuple
    stride: IntTuple = None

    def __post_init__(self):
        if self.stride is None:
            object.__setattr__(self, "stride", compact_col_major(self.shape))
        if not congruent(self.shape, self.stride):
            raise ValueError(f"shape {self.shape} and stride {self.stride} are not congruent")

    def __call__(self, *crd) -> int:
        crd = crd[0] if len(crd) == 1 else tuple(crd)
        return crd2idx(crd, self.shape, self.stride)

    def __str__(self) -> str:
        return f"{_fmt(self.shape)}:{_fmt(self.stride)}"

    __repr__ = __str__

    def __len__(self) -> int:
        return self.rank

    def __getitem__(self, i: int) -> "Layout":
        if is_int(self.shape):
            if i != 0:
                raise IndexError(i)
            return self
        return Layout(self.shape[i], self.stride[i])

    @property
    def rank(self) -> int:
        return 1 if is_int(self.shape) else len(self.shape)

    def modes(self) -> List["Layout"]:
        return [self[i] for i in range(self.rank)]

    def size(self) -> int:
        return product(self.shape)

    def cosize(self) -> int:
        """One past the largest index (strides may be negative only in theory here)."""
        return 1 + sum((s - 1) * abs(d) for s, d in zip(flatten(self.shape), flatten(self.stride)))

    def values(self) -> List[int]:
        return [self(i) for i in range(self.size())]

    def flat(self) -> List[Tuple[int, int]]:
        return list(zip(flatten(self.shape), flatten(self.stride)))


def make_layout(shape: IntTuple, stride: IntTuple = None) -> Layout:
    return Layout(shape, stride)


def concat(*layouts: Layout) -> Layout:
    """The layout whose modes are ``layouts`` (CuTe's ``make_layout(L0, L1, ...)``)."""
    return Layout(tuple(L.shape for L in layouts), tuple(L.stride for L in layouts))


def make_ordered_layout(shape: Sequence[int], order: Sequence[int]) -> Layout:
    """Packed layout whose mode with the smallest ``order`` is contiguous.

    ``make_ordered_layout((16, 32), order=(1, 0))`` is row-major ``(16,32):(32,1)``.
    """
    if len(shape) != len(order):
        raise ValueError("shape and order differ in rank")
    stride = [0] * len(shape)
    cur = 1
    for i in sorted(range(len(shape)), key=lambda i: order[i]):
        stride[i] = cur
        cur *= product(shape[i])
    return Layout(tuple(shape), tuple(stride))


def _from_modes(modes: Sequence[Tuple[int, int]]) -> Layout:
    if not modes:
        return Layout(1, 0)
    if len(modes) == 1:
        return Layout(*modes[0])
    return Layout(tuple(s for s, _ in modes), tuple(d for _, d in modes))


def coalesce(layout: Layout, by_mode: bool = False) -> Layout:
    """Fewest modes with the same function: drop size-1 modes, merge contiguous ones.

    ``by_mode`` coalesces each top-level mode on its own and keeps the rank
    (CuTe's ``coalesce(L, tuple_repeat<R>(_1{}))``).
    """
    if by_mode and not is_int(layout.shape):
        return concat(*(coalesce(m) for m in layout.modes()))
    out: List[List[int]] = []
    for s, d in layout.flat():
        if s == 1:
            continue
        if out and out[-1][0] * out[-1][1] == d:
            out[-1][0] *= s
        else:
            out.append([s, d])
    return _from_modes([tuple(m) for m in out])


def complement(layout: Layout, cotarget: int) -> Layout:
    """The layout that fills the index space up to ``cotarget`` around ``layout``."""
    modes = sorted(((s, d) for s, d in layout.flat() if s != 1 and d != 0), key=lambda m: (m[1], m[0]))
    out = []
    cur = 1
    for s, d in modes:
        if d % cur:
            raise ValueError(f"complement: {layout} is not injective/ordered at stride {d}")
        out.append((d // cur, cur))
        cur = s * d
    out.append((-(-cotarget // cur), cur))
    return coalesce(_from_modes(out))


def _compose_int(a: Layout, s: int, d: int) -> Layout:
    """``a`` composed with the single mode ``s:d``: ``x -> a(d * x)`` for x < s."""
    if s == 1:
        return Layout(1, 0)
    if d == 0:
        return Layout(s, 0)
    modes = coalesce(a).flat()
    # Step 1: skip the first d indices' worth of modes (divide a's shape by d).
    strided = []
    r = d
    for i, (si, di) in enumerate(modes):
        last = i == len(modes) - 1
        if r == 1:
            strided.append((si, di))
        elif last:
            strided.append((max(1, si // r), di * r))
            r = 1
        elif si % r == 0:
            strided.append((si // r, di * r))
            r = 1
        elif r % si == 0:
            r //= si
        else:
            raise ValueError(f"composition: stride {d} does not divide the shape of {a}")
    # Step 2: keep the first s elements (take a prefix of the remaining shape).
    out = []
    r = s
    for i, (si, di) in enumerate(strided):
        if r == 1:
            break
        last = i == len(strided) - 1
        if last or si >= r:
            if not last and si % r:
                raise ValueError(f"composition: shape {s} does not divide the shape of {a}")
            out.append((r, di))
            r = 1
        else:
            if r % si:
                raise ValueError(f"composition: shape {s} does not divide the shape of {a}")
            out.append((si, di))
            r //= si
    return _from_modes([m for m in out if m[0] != 1])


def composition(a: Layout, b: Union[Layout, int, tuple]) -> Layout:
    """``a o b``: the layout ``c -> a(b(c))``, shaped like ``b``.

    ``b`` may be a layout, an int (``b:1``) or a tuple tiler (one per mode of ``a``,
    composed mode by mode; modes of ``a`` beyond the tiler are kept).
    """
    if is_int(b):
        b = Layout(b, 1)
    if isinstance(b, tuple):
        modes = [composition(a[i], bi) if bi is not None else a[i] for i, bi in enumerate(b)]
        modes += a.modes()[len(b) :]
        return concat(*modes)
    if is_int(b.shape):
        return _compose_int(a, b.shape, b.stride)
    return concat(*(composition(a, m) for m in b.modes()))


def right_inverse(layout: Layout) -> Layout:
    """``R`` with ``layout(R(i)) == i`` for i in ``range(size(R))`` (largest such prefix)."""
    flat = coalesce(layout).flat()
    pos = compact_col_major(tuple(s for s, _ in flat))
    pos = (pos,) if is_int(pos) else pos
    out = []
    cur = 1
    for i in sorted(range(len(flat)), key=lambda i: flat[i][1]):
        s, d = flat[i]
        if d == 0 or s == 1:
            continue
        if d != cur:
            break
        out.append((s, pos[i]))
        cur *= s
    return coalesce(_from_modes(out))


def left_inverse(layout: Layout) -> Layout:
    """``L`` with ``L(layout(i)) == i`` for every i (``layout`` injective)."""
    return right_inverse(concat(layout, complement(layout, layout.cosize())))


def logical_product(a: Layout, b: Layout) -> Layout:
    """``(a, b')``: ``a`` repeated at the positions ``b`` enumerates."""
    return concat(a, composition(complement(a, a.size() * b.cosize()), b))


def _append_rank(layout: Layout, rank: int) -> Layout:
    modes = layout.modes()
    return concat(*(modes + [Layout(1, 0)] * (rank - len(modes))))


def raked_product(block: Layout, tiler: Layout) -> Layout:
    """Mode i is ``(tiler_i', block_i)``: each block element is raked across the tiler.

    ``raked_product(thr, val)`` gives, for each tile coordinate ``m = v + V * t``, the
    index ``thr(t) + size(thr) * val(v)``: the (thread, value) pair owning it.
    """
    rank = max(block.rank, tiler.rank)
    prod = logical_product(_append_rank(block, rank), _append_rank(tiler, rank))
    zipped = concat(*(concat(prod[1][i], prod[0][i]) for i in range(rank)))
    return coalesce(zipped, by_mode=True)


def blocked_product(block: Layout, tiler: Layout) -> Layout:
    """Mode i is ``(block_i, tiler_i')``: whole blocks laid out by the tiler."""
    rank = max(block.rank, tiler.rank)
    prod = logical_product(_append_rank(block, rank), _append_rank(tiler, rank))
    zipped = concat(*(concat(prod[0][i], prod[1][i]) for i in range(rank)))
    return coalesce(zipped, by_mode=True)


# ------------------------------------------------------------------------- swizzles


@dataclass(frozen=True)
class Swizzle:
    """CuTe's ``Swizzle<B, M, S>``: XOR ``B`` bits taken at ``M + S`` into bits at ``M``.

    ``y = x ^ ((x & yyy) >> S)`` with ``yyy = ((1 << B) - 1) << (M + S)`` (for S >= 0),
    i.e. ``y = x ^ ((x >> S) & (((1 << B) - 1) << M))``. The low ``M`` bits (a unit of
    ``2**M`` elements) are never touched, so vectors of that size stay contiguous.
    Example, fp16 ``Swizzle<3,3,3>`` over rows of 64 elements (128 bytes): the row
    index mod 8 (bits 6..8) is XORed into the 16-byte chunk index (bits 3..5).
    A negative ``S`` shifts left instead, as in CuTe.
    """

    bits: int
    base: int
    shift: int

    def __post_init__(self):
        if self.bits < 0 or self.base < 0 or abs(self.shift) < self.bits:
            raise ValueError(f"Swizzle<{self.bits},{self.base},{self.shift}> overlaps itself")

    @property
    def yyy_mask(self) -> int:
        return ((1 << self.bits) - 1) << (self.base + max(0, self.shift))

    @property
    def zzz_mask(self) -> int:
        return ((1 << self.bits) - 1) << (self.base - min(0, self.shift))

    def __call__(self, x: int) -> int:
        y = x & self.yyy_mask
        y = y >> self.shift if self.shift >= 0 else y << -self.shift
        return x ^ y

    def __str__(self) -> str:
        return f"S<{self.bits},{self.base},{self.shift}>"

    __repr__ = __str__


@dataclass(frozen=True)
class ComposedLayout:
    """``swizzle o offset o layout``: ``c -> swizzle(offset + layout(c))`` (DSL's order)."""

    swizzle: Swizzle
    layout: Layout
    offset: int = 0

    def __call__(self, *crd) -> int:
        return self.swizzle(self.offset + self.layout(*crd))

    @property
    def shape(self) -> IntTuple:
        return self.layout.shape

    @property
    def rank(self) -> int:
        return self.layout.rank

    def size(self) -> int:
        return self.layout.size()

    def cosize(self) -> int:
        return 1 + max(self(i) for i in range(self.size()))

    def values(self) -> List[int]:
        return [self(i) for i in range(self.size())]

    def __str__(self) -> str:
        return f"{self.swizzle} o {self.offset} o {self.layout}"

    __repr__ = __str__


AnyLayout = Union[Layout, ComposedLayout]

# -------------------------------------------------------------------------- parsing

_TOKEN = re.compile(r"\s*(\(|\)|,|-?\d+)")


def parse_int_tuple(text: str) -> IntTuple:
    """``"((4,8),2)"`` -> ``((4, 8), 2)``; DSL prints of ``Int`` like ``16:1`` are not tuples."""
    tokens = [t for t in _TOKEN.findall(text.replace(" ", ""))]

    def walk(i):
        if tokens[i] == "(":
            out, i = [], i + 1
            while tokens[i] != ")":
                item, i = walk(i)
                out.append(item)
                if tokens[i] == ",":
                    i += 1
            return tuple(out), i + 1
        return int(tokens[i]), i + 1

    value, end = walk(0)
    if end != len(tokens):
        raise ValueError(f"trailing text in {text!r}")
    return value


def parse_layout(text: str) -> AnyLayout:
    """Parse CuTe's printed form: ``"(16,32):(32,1)"`` or ``"S<3,3,3> o 0 o (8,64):(64,1)"``."""
    text = text.strip()
    m = re.fullmatch(r"S<(-?\d+),(-?\d+),(-?\d+)>\s*o\s*(-?\d+)\s*o\s*(.+)", text)
    if m:
        b, base, s, off, rest = m.groups()
        return ComposedLayout(Swizzle(int(b), int(base), int(s)), parse_layout(rest), int(off))
    shape, stride = text.split(":")
    return Layout(parse_int_tuple(shape), parse_int_tuple(stride))


# ----------------------------------------------------------------------- TV layouts


@dataclass(frozen=True)
class TVLayout:
    """``(thread, value) -> element`` of an ``M x N`` tile (a tiled copy or MMA fragment).

    ``layout`` has two modes (threads, values) and returns the column-major index
    ``m + M * n``; ``coord(t, v)`` returns ``(m, n)``.
    """

    layout: Layout
    tile: Tuple[int, int]

    @property
    def num_threads(self) -> int:
        return self.layout[0].size()

    @property
    def num_values(self) -> int:
        return self.layout[1].size()

    def coord(self, thread: int, value: int) -> Tuple[int, int]:
        i = self.layout((thread, value))
        return (i % self.tile[0], i // self.tile[0])

    def thread_coords(self, thread: int) -> List[Tuple[int, int]]:
        return [self.coord(thread, v) for v in range(self.num_values)]

    def owners(self) -> List[List[List[Tuple[int, int]]]]:
        """``owners()[m][n]``: every (thread, value) mapped to element (m, n)."""
        grid = [[[] for _ in range(self.tile[1])] for _ in range(self.tile[0])]
        for t in range(self.num_threads):
            for v in range(self.num_values):
                m, n = self.coord(t, v)
                grid[m][n].append((t, v))
        return grid

    def same_function(self, other: "TVLayout") -> bool:
        return (
            self.tile == other.tile
            and all(
                self.coord(t, v) == other.coord(t, v) for t in range(self.num_threads) for v in range(self.num_values)
            )
            and (self.num_threads, self.num_values) == (other.num_threads, other.num_values)
        )

    def __str__(self) -> str:
        return f"TV {self.layout} over {self.tile[0]}x{self.tile[1]}"


def make_tiled_copy_tv(thr_layout: Layout, val_layout: Layout) -> TVLayout:
    """The TV layout of ``cute.make_tiled_copy_tv(atom, thr_layout, val_layout)``.

    ``thr_layout`` maps a thread's (m, n) position in the grid of threads to its
    index; ``val_layout`` maps a value's (m, n) inside one thread's block to its
    index. The tile is ``thr_shape * val_shape`` elementwise; element
    ``(tm * V0 + vm, tn * V1 + vn)`` belongs to thread ``thr(tm, tn)``, value
    ``val(vm, vn)``. As CuTe: ``right_inverse(raked_product(thr, val))`` reshaped to
    ``(size(thr), size(val))``.
    """
    raked = raked_product(thr_layout, val_layout)
    tile = tuple(product(raked[i].shape) for i in range(raked.rank))
    tv = composition(right_inverse(raked), Layout((thr_layout.size(), val_layout.size())))
    return TVLayout(tv, tile)


def tiled_copy_tv_direct(thr_layout: Layout, val_layout: Layout) -> Callable[[int, int], Tuple[int, int]]:
    """The same map written out element by element (the definition the algebra must meet)."""
    (T0, T1), (V0, V1) = thr_layout.shape, val_layout.shape
    thr_pos = {thr_layout((tm, tn)): (tm, tn) for tm in range(T0) for tn in range(T1)}
    val_pos = {val_layout((vm, vn)): (vm, vn) for vm in range(V0) for vn in range(V1)}

    def coord(t, v):
        (tm, tn), (vm, vn) = thr_pos[t], val_pos[v]
        return (tm * V0 + vm, tn * V1 + vn)

    return coord


# ---------------------------------------------------------- SM80 warp-level atoms
#
# mma.sync.aligned.m16n8k16.row.col {f16,bf16} (PTX ISA, "Matrix Fragments for
# mma.m16n8k16 with floating point type"). With groupID = lane >> 2 and
# tig = lane % 4 (thread in group):
#   A (16 x 16, M x K), 8 halves a0..a7 per thread:
#       row = groupID + 8 * ((i >> 1) & 1),  col = 2 * tig + (i & 1) + 8 * (i >> 2)
#   B (16 x 8, K x N), 4 halves b0..b3:
#       row (k) = 2 * tig + (i & 1) + 8 * (i >> 1),  col (n) = groupID
#   C/D (16 x 8, M x N), 4 values c0..c3:
#       row = groupID + 8 * (i >> 1),  col = 2 * tig + (i & 1)
# so thread 0 holds C[0,0], C[0,1], C[8,0], C[8,1].
# As CuTe, B is kept as an N x K tile (the DSL's tv_layout_B is over (N, K)).
# The TV layouts below spell these maps as strides: thread mode (4, 8) = (tig,
# groupID), value modes one per bit of i.


def ptx_mma_m16n8k16_a(lane: int, i: int) -> Tuple[int, int]:
    g, tig = lane >> 2, lane % 4
    return (g + 8 * ((i >> 1) & 1), 2 * tig + (i & 1) + 8 * (i >> 2))


def ptx_mma_m16n8k16_b(lane: int, i: int) -> Tuple[int, int]:
    """(k, n) of b_i, as the PTX ISA writes it (K x N)."""
    g, tig = lane >> 2, lane % 4
    return (2 * tig + (i & 1) + 8 * (i >> 1), g)


def ptx_mma_m16n8k16_c(lane: int, i: int) -> Tuple[int, int]:
    g, tig = lane >> 2, lane % 4
    return (g + 8 * (i >> 1), 2 * tig + (i & 1))


@dataclass(frozen=True)
class MmaAtom:
    """A warp MMA instruction: its (M, N, K) and the A/B/C fragments as TV layouts."""

    name: str
    shape_mnk: Tuple[int, int, int]
    a: TVLayout  # M x K
    b: TVLayout  # N x K
    c: TVLayout  # M x N


def sm80_mma_16x8x16() -> MmaAtom:
    """``mma.sync.m16n8k16`` for f16/bf16 inputs (f16 or f32 accumulators)."""
    a = Layout(((4, 8), (2, 2, 2)), ((32, 1), (16, 8, 128)))  # into 16 x 16 (m + 16 k)
    b = Layout(((4, 8), (2, 2)), ((16, 1), (8, 64)))  # into 8 x 16 (n + 8 k)
    c = Layout(((4, 8), (2, 2)), ((32, 1), (16, 8)))  # into 16 x 8 (m + 16 n)
    return MmaAtom("SM80_16x8x16", (16, 8, 16), TVLayout(a, (16, 16)), TVLayout(b, (8, 16)), TVLayout(c, (16, 8)))


# ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8j..8j+7 give the addresses of the
# 8 rows (16 bytes each) of matrix j; afterwards register j of lane t holds row t // 4,
# columns 2 * (t % 4) + {0, 1} of matrix j. Feeding the MMA's A operand (16 x 16),
# matrices 0..3 are the quadrants (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
# (8-15, 8-15): lane t points at row t % 16, columns 8 * (t // 16) .. +7, and the
# destination registers are then exactly the MMA's A fragment.


@dataclass(frozen=True)
class LdMatrixAtom:
    name: str
    num_matrices: int
    src: TVLayout  # lane -> the 8 elements (16 bytes) of the row it addresses
    dst: TVLayout  # lane -> the elements it receives


def sm75_ldmatrix_x4() -> LdMatrixAtom:
    src = Layout(((16, 2), 8), ((1, 128), 16))
    return LdMatrixAtom("SM75_U32x4_LDSM_N", 4, TVLayout(src, (16, 16)), sm80_mma_16x8x16().a)


def sm80_tiled_mma_c(atom_layout: Tuple[int, int, int], permutation: Tuple[int, int, int]) -> TVLayout:
    """The C (accumulator) TV layout of ``make_tiled_mma(mma.m16n8k16, atom_layout,
    permutation_mnk=permutation)`` (the DSL's ``tv_layout_C_tiled``): warps column-major over
    (M, N), each repeating its 16x8 atom over the permutation tile, a warp's repeats
    ``16 * wm`` rows and ``8 * wn`` columns apart. Thread (q, g, wm_i, wn_i) holds rows
    g + 8 h + 16 wm_i (+ 16 wm i) and columns 2 q + p + 8 wn_i (+ 8 wn j)."""
    wm, wn, _ = atom_layout
    pm, pn, _ = permutation
    rm, rn = pm // (16 * wm), pn // (8 * wn)
    if rm * 16 * wm != pm or rn * 8 * wn != pn:
        raise ValueError(f"permutation {permutation} is not whole 16x8 atoms of {atom_layout} warps")
    layout = Layout(((4, 8, wm, wn), ((2, 2), (rm, rn))), ((2 * pm, 1, 16, 8 * pm), ((pm, 8), (16 * wm, 8 * wn * pm))))
    return TVLayout(layout, (pm, pn))
