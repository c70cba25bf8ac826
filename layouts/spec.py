"""Plain-Python descriptions of the layouts our kernels use.

A spec is data (shapes, orders, widths), so it can be listed, drawn and analysed on a
CPU without tracing a kernel; ``build()`` turns it into the CuTe DSL object inside a
``@cute.jit`` function, which is how every kernel takes its layouts from this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


_EVICT = {"normal": "EVICT_NORMAL", "first": "EVICT_FIRST", "last": "EVICT_LAST", "no_allocate": "NO_ALLOCATE"}


@dataclass(frozen=True)
class TiledCopySpec:
    """A tiled copy: a grid of threads, each moving a small block of values.

    ``thr_shape``/``thr_order`` place the threads over the tile (order (1, 0) is
    row-major: consecutive threads walk along columns); ``val_shape`` is the block of
    consecutive elements one thread moves per copy instruction of ``copy_bits``.
    """

    thr_shape: Tuple[int, int]
    val_shape: Tuple[int, int]
    elem_bits: int
    thr_order: Tuple[int, int] = (1, 0)
    op: str = "universal"  # universal, g2r (loads), r2g (stores), cp.async
    l1_evict: str = "normal"  # g2r/r2g: normal, first, last, no_allocate (cache eviction priority)
    load_cache: str = "always"  # g2r / cp.async: always (.ca), global (.cg), streaming (.cs), last_use (.lu)

    def __post_init__(self):
        if self.copy_bits not in (8, 16, 32, 64, 128) and self.copy_bits != self.elem_bits:
            raise ValueError(f"a copy of {self.copy_bits} bits is not a legal access width")

    @property
    def num_threads(self) -> int:
        return self.thr_shape[0] * self.thr_shape[1]

    @property
    def copy_bits(self) -> int:
        return self.val_shape[0] * self.val_shape[1] * self.elem_bits

    @property
    def tiler(self) -> Tuple[int, int]:
        """The (rows, cols) tile that one application of the copy covers."""
        return (self.thr_shape[0] * self.val_shape[0], self.thr_shape[1] * self.val_shape[1])

    def thr_layout(self):
        """The pure-Python thread layout (``layouts.algebra``) that ``build`` passes the DSL."""
        from .algebra import make_ordered_layout

        return make_ordered_layout(self.thr_shape, self.thr_order)

    def tv_layout(self):
        """The pure-Python TV layout of the copy ``build`` makes (for analysis, pictures)."""
        from .algebra import make_layout, make_tiled_copy_tv

        return make_tiled_copy_tv(self.thr_layout(), make_layout(self.val_shape))

    def build(self, dtype):
        """The ``cute.TiledCopy`` for ``dtype`` (call inside a ``@cute.jit`` function)."""
        import cutlass.cute as cute
        from cutlass.cute.nvgpu import cpasync

        if dtype.width != self.elem_bits:
            raise ValueError(f"spec is for {self.elem_bits}-bit elements, got {dtype}")
        nv = cute.nvgpu
        attrs = {}
        if self.op == "universal":
            op = nv.CopyUniversalOp()
        elif self.op == "cp.async":
            op = cpasync.CopyG2SOp(cache_mode=getattr(cpasync.LoadCacheMode, self.load_cache.upper()))
        elif self.op in ("g2r", "r2g"):
            op = nv.CopyG2ROp() if self.op == "g2r" else nv.CopyR2GOp()
            attrs["l1c_evict_priority"] = getattr(nv.CacheEvictionPriority, _EVICT[self.l1_evict])
            if self.op == "g2r":
                attrs["load_cache_mode"] = getattr(nv.LoadCacheMode, self.load_cache.upper())
        else:
            raise ValueError(f"unknown copy op {self.op!r}")
        atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=self.copy_bits, **attrs)
        thr = cute.make_ordered_layout(self.thr_shape, order=self.thr_order)
        val = cute.make_layout(self.val_shape)
        return cute.make_tiled_copy_tv(atom, thr, val)


@dataclass(frozen=True)
class SmemLayoutSpec:
    """A shared-memory tile: a swizzled (rows x cols) row-major atom tiled over ``shape``.

    ``swizzle`` is CuTe's Swizzle<B, M, S> on element offsets; (3, 3, 3) on 16-bit
    elements permutes the 16-byte chunks of 8 consecutive 128-byte rows, so a column
    of 8 rows read or written by 8 threads hits 8 different bank groups.
    """

    atom: Tuple[int, int]
    swizzle: Optional[Tuple[int, int, int]]  # None: a plain row-major tile, rows padded by ``pad``
    shape: Tuple[int, int]
    elem_bits: int
    pad: int = 0
    stages: int = 1  # > 1: a third mode of that many copies of the tile (pipeline buffers)

    def __post_init__(self):
        if self.shape[0] % self.atom[0] or self.shape[1] % self.atom[1]:
            raise ValueError(f"atom {self.atom} does not tile {self.shape}")

    @property
    def bytes(self) -> int:
        return self.stages * self.shape[0] * (self.shape[1] + self.pad) * self.elem_bits // 8

    def layout(self):
        """The pure-Python form (``layouts.algebra``): the swizzle over the tiled atom."""
        from .algebra import ComposedLayout, Swizzle, blocked_product, make_layout

        if self.swizzle is None:
            return make_layout(self.shape, (self.shape[1] + self.pad, 1))
        rows, cols = self.atom
        atom = make_layout((rows, cols), (cols, 1))
        tiled = blocked_product(atom, make_layout((self.shape[0] // rows, self.shape[1] // cols)))
        return ComposedLayout(Swizzle(*self.swizzle), tiled)

    def build(self, dtype):
        import cutlass.cute as cute

        if dtype.width != self.elem_bits:
            raise ValueError(f"spec is for {self.elem_bits}-bit elements, got {dtype}")
        if self.swizzle is None:
            if self.stages > 1:
                raise ValueError("staged tiles must be swizzled")
            return cute.make_layout(self.shape, stride=(self.shape[1] + self.pad, 1))
        rows, cols = self.atom
        atom = cute.make_composed_layout(
            cute.make_swizzle(*self.swizzle), 0, cute.make_layout((rows, cols), stride=(cols, 1))
        )
        if self.stages > 1:
            return cute.tile_to_shape(atom, (*self.shape, self.stages), (0, 1, 2))
        return cute.tile_to_shape(atom, self.shape, (0, 1))


@dataclass(frozen=True)
class TiledMmaSpec:
    """A tiled MMA: sm80 ``mma.sync`` m16n8k16 (fp32 accumulators) or SIMT FMA.

    ``op="mma.sync"``: ``atom_layout`` places warps over (M, N, K). ``op="fma"``: the
    atom is one thread's 1x1x1 fp32 FMA and ``atom_layout`` places threads (the SIMT
    path of fp32 inputs). ``permutation`` is the tile the atoms cover together. Kernels
    that only need the accumulator's thread/value layout (to partition a tile the way
    an MMA would hold it) build it without running an MMA.
    """

    atom_layout: Tuple[int, int, int]
    permutation: Tuple[int, int, int]
    shape_mnk: Tuple[int, int, int] = (16, 8, 16)
    op: str = "mma.sync"

    def __post_init__(self):
        if self.op not in ("mma.sync", "fma"):
            raise ValueError(f"op must be 'mma.sync' or 'fma', got {self.op!r}")

    @property
    def num_threads(self) -> int:
        m, n, k = self.atom_layout
        return (1 if self.op == "fma" else 32) * m * n * k

    def c_tv(self):
        """The pure-Python C TV layout over the permutation tile (``tv_layout_C_tiled``)."""
        from .algebra import sm80_tiled_mma_c

        if self.op != "mma.sync" or self.shape_mnk != (16, 8, 16):
            raise NotImplementedError("the pure-Python C layout is written for mma.sync m16n8k16")
        return sm80_tiled_mma_c(self.atom_layout, self.permutation)

    def build(self, ab_dtype):
        import cutlass
        import cutlass.cute as cute

        if self.op == "fma":
            op = cute.nvgpu.MmaUniversalOp(cutlass.Float32)
        else:
            op = cute.nvgpu.warp.MmaF16BF16Op(ab_dtype, cutlass.Float32, self.shape_mnk)
        return cute.make_tiled_mma(op, self.atom_layout, permutation_mnk=self.permutation)


@dataclass(frozen=True)
class FragmentCopySpec:
    """A copy in a tiled MMA's accumulator layout (``make_tiled_copy_C``): every thread moves
    its fragment ``copy_bits`` at a time (fp32 pairs as 64 bits, bf16 pairs as 32)."""

    mma: TiledMmaSpec
    elem_bits: int
    copy_bits: int
    mma_dtype: str = "bf16"  # the MMA's input type (the tiled MMA is built for it)

    @property
    def num_threads(self) -> int:
        return self.mma.num_threads

    @property
    def tiler(self) -> Tuple[int, int]:
        return self.mma.permutation[:2]

    @property
    def values_per_access(self) -> int:
        return self.copy_bits // self.elem_bits

    def tv_layout(self):
        return self.mma.c_tv()

    def build(self, dtype):
        import cutlass
        import cutlass.cute as cute

        ab = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[self.mma_dtype]
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=self.copy_bits)
        return cute.make_tiled_copy_C(atom, self.mma.build(ab))
