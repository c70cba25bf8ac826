"""Plain-Python descriptions of the layouts our kernels use.

A spec is data (shapes, orders, widths), so it can be listed, drawn and analysed on a
CPU without tracing a kernel; ``build()`` turns it into the CuTe DSL object inside a
``@cute.jit`` function, which is how every kernel takes its layouts from this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


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
    load_cache: str = "always"  # g2r: always (.ca), global (.cg), streaming (.cs), last_use (.lu)

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
            op = cpasync.CopyG2SOp()
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
