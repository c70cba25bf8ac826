"""The catalogue: every layout our kernels use, by name, plus reference entries.

Names read ``<kernel>.<arch>.<dtype>.<what>`` (``dropout_bias_bwd.sm90.bf16.gmem_dy``)
or ``reference.<...>`` for textbook layouts the known-answer tests pin down. The
kernel entries are built from the same functions the kernels call
(``cute_kernels.dropout_bias.config.tiles(...)``), so what is drawn and analysed here is what runs.

An entry gives its pure-Python form (``layouts.algebra``) for analysis and pictures,
and ``build()``, the DSL object, to be called inside a ``@cute.jit`` function. The
kernels' entries are registered by ``kernel_entries`` on the first ``get`` / ``names`` (it
reads the kernels' configuration modules, ``cute_kernels.<family>.*config``, which import
layouts from here: registering them while ``layouts`` is imported would be a cycle); a shared-memory tile lists the
accesses the kernel makes to it (``layouts.access``), which ``analysis`` counts.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from .access import SmemAccess, as_2d, tma, wgmma
from .algebra import (
    AnyLayout,
    ComposedLayout,
    Layout,
    LdMatrixAtom,
    MmaAtom,
    Swizzle,
    TVLayout,
    product,
    sm75_ldmatrix_x4,
    sm80_mma_16x8x16,
)
from .spec import FragmentCopySpec, TiledCopySpec, TiledMmaSpec

DTYPES = {"fp32": 32, "fp16": 16, "bf16": 16, "u8": 8}
ARCHS = {"sm80": "sm_80", "sm90": "sm_90a"}


def cute_dtype(name: str):
    import cutlass

    return {"fp32": cutlass.Float32, "fp16": cutlass.Float16, "bf16": cutlass.BFloat16, "u8": cutlass.Uint8}[name]


def _dsl_layout(layout: Layout):
    import cutlass.cute as cute

    return cute.make_layout(layout.shape, stride=layout.stride)


@dataclass(frozen=True)
class LayoutEntry:
    """A plain layout over a 2-D shape (index per coordinate)."""

    name: str
    description: str
    layout: Layout
    no_access: str = ""  # why it has no memory access of its own (a register or gmem tiling)
    kind = "layout"

    @property
    def tile(self) -> Tuple[int, int]:
        return self.layout.shape

    def build(self):
        return _dsl_layout(self.layout)


@dataclass(frozen=True)
class SmemEntry:
    """A shared-memory tile layout (element offsets, possibly swizzled).

    ``accesses``: what the kernel does to the tile, analysed for bank conflicts: names of
    copy / ldmatrix entries, or ``layouts.access.SmemAccess`` descriptions. A layout of
    rank > 2 (a ring of buffers) is analysed and drawn as rows x the rest (``view``).
    """

    name: str
    description: str
    layout: AnyLayout
    dtype: str
    accesses: Tuple[Union[str, SmemAccess], ...] = ()
    kind = "smem"

    @property
    def elem_bits(self) -> int:
        return DTYPES[self.dtype]

    @property
    def view(self) -> AnyLayout:
        return as_2d(self.layout)

    @property
    def tile(self) -> Tuple[int, int]:
        # a tiled atom has nested modes, e.g. ((8, 16), (64, 2)): the tile is their sizes
        return tuple(product(m) for m in self.view.shape)

    def build(self):
        import cutlass.cute as cute

        if isinstance(self.layout, ComposedLayout):
            sw = self.layout.swizzle
            return cute.make_composed_layout(
                cute.make_swizzle(sw.bits, sw.base, sw.shift), self.layout.offset, _dsl_layout(self.layout.layout)
            )
        return _dsl_layout(self.layout)


@dataclass(frozen=True)
class CopyEntry:
    """A tiled copy (``TiledCopySpec``) between registers and ``memory`` ("gmem"/"smem").

    Global copies are analysed for coalescing; shared ones for bank conflicts
    against each of ``smem_layouts``.
    """

    name: str
    description: str
    spec: Union[TiledCopySpec, FragmentCopySpec]
    dtype: str
    memory: str = "gmem"
    smem_layouts: Tuple[str, ...] = ()
    gmem_row_stride: int = 0  # elements between rows in global memory (0: the tile's width)
    kind = "copy"
    access_kind = "vector"

    @property
    def values_per_access(self) -> int:
        """Values a thread moves per instruction (0: its whole block at once)."""
        return getattr(self.spec, "values_per_access", 0)

    def gmem(self) -> Layout:
        rows, cols = self.tile
        return Layout((rows, cols), (self.gmem_row_stride or cols, 1))

    @property
    def elem_bits(self) -> int:
        return self.spec.elem_bits

    @property
    def tile(self) -> Tuple[int, int]:
        return self.spec.tiler

    def tv(self) -> TVLayout:
        return self.spec.tv_layout()

    def src_tv(self) -> TVLayout:
        return self.tv()

    def dst_tv(self) -> TVLayout:
        return self.tv()

    def access_tv(self) -> TVLayout:
        return self.tv()

    def build(self):
        return self.spec.build(cute_dtype(self.dtype))


@dataclass(frozen=True)
class LdMatrixEntry:
    """``ldmatrix`` feeding an MMA operand: source rows (smem) and destination fragment."""

    name: str
    description: str
    atom: LdMatrixAtom
    dtype: str
    smem_layouts: Tuple[str, ...] = ()
    kind = "ldmatrix"
    access_kind = "ldmatrix"

    @property
    def elem_bits(self) -> int:
        return DTYPES[self.dtype]

    @property
    def tile(self) -> Tuple[int, int]:
        return self.atom.src.tile

    def src_tv(self) -> TVLayout:
        return self.atom.src

    def dst_tv(self) -> TVLayout:
        return self.atom.dst

    def access_tv(self) -> TVLayout:
        return self.atom.src

    def build(self):
        """The ldmatrix tiled copy for the A operand of the SM80 16x8x16 MMA."""
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.nvgpu import warp

        dt = cute_dtype(self.dtype)
        mma = cute.make_tiled_mma(warp.MmaF16BF16Op(dt, cutlass.Float32, (16, 8, 16)))
        atom = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, self.atom.num_matrices), dt)
        return cute.make_tiled_copy_A(atom, mma)


@dataclass(frozen=True)
class MmaEntry:
    """A warp MMA atom; its A (M x K), B (N x K) and C (M x N) fragments. With ``tiled``,
    the tiled MMA a kernel builds (warps, permutation): its C fragment over the whole tile."""

    name: str
    description: str
    atom: MmaAtom
    dtype: str
    acc_dtype: str = "fp32"
    tiled: Optional[TiledMmaSpec] = None
    kind = "mma"

    @property
    def tile(self) -> Tuple[int, int]:
        return self.tiled.permutation[:2] if self.tiled else self.atom.c.tile

    def tiled_c(self) -> Optional[TVLayout]:
        return self.tiled.c_tv() if self.tiled else None

    def build(self):
        import cutlass.cute as cute
        from cutlass.cute.nvgpu import warp

        if self.tiled:
            return self.tiled.build(cute_dtype(self.dtype))
        op = warp.MmaF16BF16Op(cute_dtype(self.dtype), cute_dtype(self.acc_dtype), self.atom.shape_mnk)
        return cute.make_tiled_mma(op)


_REGISTRY: Dict[str, object] = {}


def register(entry) -> None:
    if entry.name in _REGISTRY:
        raise ValueError(f"{entry.name} is already registered")
    _REGISTRY[entry.name] = entry


_KERNELS_REGISTERED = []


def _registry() -> Dict[str, object]:
    """Every entry: the kernels' are registered on the first call (module docstring)."""
    if not _KERNELS_REGISTERED:
        _KERNELS_REGISTERED.append(True)
        from . import kernel_entries

        kernel_entries.register_all()
    return _REGISTRY


def get(name: str):
    try:
        return _registry()[name]
    except KeyError:
        close = difflib.get_close_matches(name, _REGISTRY, n=3)
        raise KeyError(f"no layout {name!r}" + (f"; did you mean {', '.join(close)}?" if close else "")) from None


def names(prefix: Optional[str] = None) -> List[str]:
    return sorted(n for n in _registry() if prefix is None or n.startswith(prefix))


# --------------------------------------------------------------- reference entries

SMEM_64 = ("reference.smem.fp16_64x64.unswizzled", "reference.smem.fp16_64x64.swizzle333")
# the two copies by name, and a wgmma and a TMA load described in place
ACCESSES_64 = (
    "reference.sm80.ldmatrix_x4",
    "reference.sm80.cp_async_128b.fp16_16x64",
    wgmma("wgmma A read, m64k16", "K-major", 64, 16),
    tma("TMA load", 64, 64),
)


def _register_reference() -> None:
    register(LayoutEntry("reference.rowmajor_8x8", "row-major 8x8: (8,8):(8,1)", Layout((8, 8), (8, 1))))
    register(
        MmaEntry(
            "reference.sm80.mma_16x8x16.f16",
            "mma.sync.m16n8k16 f16 inputs, f32 accumulators",
            sm80_mma_16x8x16(),
            "fp16",
        )
    )
    register(
        LdMatrixEntry(
            "reference.sm80.ldmatrix_x4",
            "ldmatrix.x4 (4 8x8 b16 matrices) loading the 16x16 A operand of the 16x8x16 MMA",
            sm75_ldmatrix_x4(),
            "fp16",
            SMEM_64,
        )
    )
    register(
        CopyEntry(
            "reference.sm80.cp_async_128b.fp16_16x64",
            "cp.async of a 16x64 fp16 tile, 128 threads x 8 elements (row-major threads)",
            TiledCopySpec((16, 8), (1, 8), 16, op="cp.async"),
            "fp16",
            "smem",
            SMEM_64,
        )
    )
    row_major = Layout((64, 64), (64, 1))
    register(SmemEntry(SMEM_64[0], "64x64 fp16, row-major, 128-byte rows, no swizzle", row_major, "fp16", ACCESSES_64))
    register(
        SmemEntry(
            SMEM_64[1],
            "64x64 fp16, row-major with S<3,3,3> (16-byte chunk ^= row % 8)",
            ComposedLayout(Swizzle(3, 3, 3), row_major),
            "fp16",
            ACCESSES_64,
        )
    )


_register_reference()
