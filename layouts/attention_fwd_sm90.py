"""Layouts of the Hopper attention forward (``cute_kernels/attention_sm90/attention_forward_sm90.py``).

One CTA computes O and the LSE of one query block (``tile_m`` queries of one head) over the
key blocks it sees, ``tile_n`` keys at a time:

    consumer warpgroup w (64 query rows each, ``consumer_wgs`` = tile_m / 64 of them):
        S   = Q K^T     wgmma SS: A = Q rows w*64.. (K-major), B = K (K-major), fp32 in registers
        P   = softmax   in registers, cast to the element type as the A operand of the next product
        O  += P V       wgmma RS: A = P from registers, B = V (MN-major view: Dv contiguous)

Shared memory::

    sQ  [tile_m, Dqk]            one TMA load per CTA; O's staging (its own layout) when Dv <= Dqk
    sK  [tile_n, Dqk, stages]    TMA ring (mbarrier pipeline) of key blocks
    sV  [tile_n, Dv, stages]     TMA ring of value blocks
    sO  [tile_m, Dv]             only where Dv > Dqk
    sKeep [tile_m, tile_n / 8, 2] dropout only: a keep-flag bit per (query, key) of the block, two
                                 buffers (a warpgroup draws block j + 1's while block j's is read)

Every buffer is row-major with the widest swizzle atom its columns allow (128 bytes for a
64-element bf16 / fp16 row), the layout wgmma reads without bank conflicts.
"""

from __future__ import annotations

import dataclasses

# the Hopper kernels share these facts; the forward's kernel and host read them here
from layouts.attention_sm90 import (  # noqa: F401
    KEEP_FLAG_BUFFERS,
    SMEM_ALIGN,
    SMEM_LIMIT,
    row_major_smem_layout,
    tma_align_elems,
)

KEEP_FLAG_ALIGN = 16  # bytes: the keep-flag buffers (read as 16-bit words)

MMA_ROWS = 64  # query rows of one consumer warpgroup (the wgmma M of an m64nNk16 atom)


@dataclasses.dataclass(frozen=True)
class AttentionFwdSm90Tiles:
    """The tile shapes of one forward configuration (``cute_kernels.attention_sm90.forward_config``
    picks them per head dim)."""

    head_dim: int  # Dqk
    head_dim_v: int  # Dv
    tile_m: int  # queries of a CTA: 64 per consumer warpgroup
    tile_n: int  # keys of a block
    stages: int  # K / V ring depth

    def __post_init__(self):
        if self.tile_m % MMA_ROWS:
            raise ValueError(f"tile_m {self.tile_m}: a multiple of {MMA_ROWS} (a warpgroup's rows)")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n {self.tile_n}: a multiple of 16 up to 256 (wgmma N and P V's k-blocks)")
        for name in ("head_dim", "head_dim_v"):
            if getattr(self, name) % 16:
                raise ValueError(f"{name} {getattr(self, name)}: a multiple of 16")

    @property
    def consumer_wgs(self) -> int:
        return self.tile_m // MMA_ROWS

    @property
    def num_mma_threads(self) -> int:
        return 128 * self.consumer_wgs

    @property
    def num_threads(self) -> int:
        """The producer warpgroup (its first warp issues the TMA loads) and the consumers."""
        return 128 + self.num_mma_threads

    @property
    def o_in_q(self) -> bool:
        """O is staged in Q's buffer (no wider than Q: every product has read Q by then), else
        in its own."""
        return self.head_dim_v <= self.head_dim

    @property
    def keep_flag_bytes(self) -> int:
        """One buffer of dropout keep flags: a bit per (query, key) of the block, rows of queries."""
        return self.tile_m * self.tile_n // 8

    def smem_bytes(self, elem_bytes: int, dropout: bool = False) -> int:
        """Bytes of the kernel's shared-storage struct (barriers first, then the aligned buffers;
        ``dropout``: with the keep-flag buffers last)."""

        def place(off: int, size: int) -> int:
            return -(-off // SMEM_ALIGN) * SMEM_ALIGN + size

        off = 8 * (1 + 4 * self.stages)  # the Q barrier, the K and V rings' full / empty pairs
        off = place(off, self.tile_m * self.head_dim * elem_bytes)
        off = place(off, self.stages * self.tile_n * self.head_dim * elem_bytes)
        off = place(off, self.stages * self.tile_n * self.head_dim_v * elem_bytes)
        if not self.o_in_q:
            off = place(off, self.tile_m * self.head_dim_v * elem_bytes)
        if dropout:
            off = -(-off // KEEP_FLAG_ALIGN) * KEEP_FLAG_ALIGN + KEEP_FLAG_BUFFERS * self.keep_flag_bytes
        return -(-off // SMEM_ALIGN) * SMEM_ALIGN

    # ---- DSL objects (called while tracing) -------------------------------------------
    def smem_layout_q(self, dtype):
        return row_major_smem_layout(dtype, self.tile_m, self.head_dim)

    def smem_layout_k(self, dtype):
        return row_major_smem_layout(dtype, self.tile_n, self.head_dim, self.stages)

    def smem_layout_v(self, dtype):
        return row_major_smem_layout(dtype, self.tile_n, self.head_dim_v, self.stages)

    def smem_layout_o(self, dtype):
        return row_major_smem_layout(dtype, self.tile_m, self.head_dim_v)

    def tiled_mma_qk(self, dtype):
        """S = Q K^T: M = queries (64 per consumer warpgroup), N = keys, K = Dqk; both K-major."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(self.consumer_wgs, 1, 1),
            tiler_mn=(MMA_ROWS, self.tile_n),
        )

    def tiled_mma_pv(self, dtype):
        """O += P V: M = queries, N = Dv, K = keys; A (P) from registers, B V's MN-major view."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            OperandMajorMode.K,
            OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(self.consumer_wgs, 1, 1),
            tiler_mn=(MMA_ROWS, self.head_dim_v),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def s2g_copy_o(self, dtype):
        """Staged O rows from shared to global memory by every consumer thread, 16 bytes a copy,
        a row's copies on consecutive threads (variable lengths: a row past its sequence is
        skipped, which a TMA store of the packed rows could not do). A row's copies go to the
        largest power of two of threads that divides them (d96: 4 threads of 3 copies each), so
        the threads tile whole rows."""
        import cutlass.cute as cute

        vec = 128 // dtype.width
        copies = self.head_dim_v // vec
        per_row = copies & -copies
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
        thr = cute.make_layout((self.num_mma_threads // per_row, per_row), stride=(per_row, 1))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, vec)))

    def r2s_copy_o(self, dtype, tiled_mma_pv):
        """O (cast) from the accumulator into its staging buffer by stmatrix (rows of 8 values,
        as the K-major swizzle keeps them)."""
        import cutlass.cute as cute

        op = cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4)
        return cute.make_tiled_copy_C(cute.make_copy_atom(op, dtype), tiled_mma_pv)
