"""Layouts of the Hopper-native attention backward (sm_90a: TMA, wgmma, warp specialization).

The choices made with them (tiles per head dim, the algorithm switches, register budgets, warp
roles, dispatch thresholds) are ``cute_kernels/attention_sm90/backward_config.py``, whose
``AttentionSm90Tiles`` extends ``AttentionSm90Layouts`` here; the kernel reads that object.

One CTA owns ``tile_n`` rows of K and V (a key block) and walks the query blocks of
``tile_m`` rows that see it. It is the flash-attention-3 decomposition, in the
transposed form that keeps P and dS in registers for the dK / dV products:

* 3 warpgroups: warpgroup 0 is the producer (warp 0 issues the TMA loads of K, V once
  and of Q, LSE, dO, Δ per query block into ``stages``-deep mbarrier pipelines; warp 1
  adds each block's dQ into the fp32 accumulator with a TMA reduce-add); warpgroups 1
  and 2 are the consumers, each owning 64 of the key block's rows.
* per query block, consumer warpgroup w (keys 64w .. 64w+63):
    S^T  = K_w Q^T            (wgmma SS: A = K  smem, K-major;  B = Q  smem, K-major)
    dP^T = V_w dO^T           (wgmma SS: A = V  smem, K-major;  B = dO smem, K-major)
    P^T  = exp2(S^T * scale * log2 e - LSE * log2 e),  dS^T = P^T (dP^T - Δ)
    dV_w += P^T dO            (wgmma RS: A = P^T registers; B = dO smem, MN-major view)
    dK_w += dS^T Q            (wgmma RS: A = dS^T registers; B = Q smem, MN-major view)
    dS^T -> shared memory (m-contiguous; stmatrix), then dQ = dS K over the whole key block
                              (wgmma SS: A = dS smem, MN-major; B = K smem, MN-major view)
  the two warpgroups split dQ's columns (tile_m = 64) or rows (tile_m = 128).
* Q, dO and K are stored once, row-major and swizzled; the K-major view serves the
  first products and the transposed (MN-major) view the second ones. One swizzle atom
  (8 rows x 16 / 32 / 64 elements: 32-, 64- or 128-byte rows) is legal for both views when
  its width divides every column slice a wgmma takes of the MN-major view: all of d for
  Q / dO (dK, dV: N = d), d / 2 for K when the warpgroups split dQ's columns. So the
  atom is the widest that divides d (Q / dO) or that slice (K / V), see ``atom_cols``
  (d is one head dim here; Dqk != Dv below).

Swizzle atoms: 128-byte for every tile of d128 and of d64 (on tile_m 128 the warpgroups split
dQ's rows, not its columns); d64 on tile_m 64 (bias, dropout) gives K / V the 64-byte atom
(32 columns), the warpgroups' dQ slice of K's MN-major view. d96 rows are 192 bytes, which
a 128-byte atom does not divide: Q / dO take the 64-byte atom (32 columns; dK / dV read
all 96 columns of the MN-major view), K / V the 32-byte one (16 columns: each warpgroup's
dQ takes 48 columns of K's MN-major view, and with 32-column atoms warpgroup 1's slice
would start mid-atom, which no wgmma descriptor expresses: the DSL refuses to partition
it), the fp32 dQ staging the 64-byte one (16 columns: each warpgroup's 48-column part is
whole atoms, reduce-added as three 16-column TMA boxes).

Head dims 192 and 256 (``AttentionSm90WideTiles``, kernel ``AttentionBackwardSm90Wide``;
FA3's hdim-256 decomposition): with 64 keys per warpgroup each thread would hold dK and dV
of 64 x d fp32 (192 / 256 registers), over setmaxnreg's 240. So a CTA owns tile_n = 64 keys
and both consumer warpgroups own all of them, splitting the other dimension of each product:

* S^T / dP^T (64 keys x 64 queries): warpgroup w the queries 32w .. 32w+31 (m64n32, SS);
* P^T and dS^T go to shared memory (both are needed whole by both warpgroups): the sdS
  allocation holds 2 x ds_stages (tile_m, tile_n) buffers, P^T in [0, ds_stages), dS^T after;
  queries contiguous, so one layout is dV / dK's K-major A (P^T, dS^T) and dQ's MN-major A (dS);
* dV += P^T dO, dK += dS^T Q (SS): warpgroup w the head-dim columns w d/2 .. (w+1) d/2 - 1,
  2 x d / 4 fp32 registers a thread (96 for d192, 128 for d256);
* dQ = dS K in two column halves, one after the other (each warpgroup a quarter of d of
  each half): a whole dQ half per warpgroup (d / 4 registers) beside dK and dV made ptxas
  run out of registers (d256: 768 bytes of spill and every wgmma serialised, C7512), a
  quarter leaves it at 0 spills and pipelined wgmmas. Both halves are staged in sdQ and the
  store warp adds the whole tile (one joint handoff: ``dq_per_wg`` off, a warpgroup's
  columns are two quarters);
* two P / dS buffers: one barrier a block keeps a warpgroup's writes off the buffers the
  other still reads.

Swizzle atoms follow the same rule: Q / dO slices are d / 2 (dK / dV), K's and the dQ
staging's d / 4 (d192: 96 and 48 columns, so 64-byte Q / dO atoms, 32-byte K / V ones and
64-byte fp32 ones; d256: 128-byte atoms everywhere).

Dqk != Dv (``head_dim`` = Dqk: Q, K, dQ, dK; ``head_dim_v`` = Dv: V, dO, dV; equal by
default). S^T reduces over Dqk and dP^T over Dv; dK's accumulator is Dqk wide and dV's Dv
wide, each its own tiled MMA. Atoms: Q's and K's follow Dqk's slices, dO's Dv's (dV's N); V is read
K-major only and takes the widest atom its Dv columns allow (with equal head dims it keeps
K's layout, as before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SMEM_LIMIT = 227 * 1024  # bytes of shared memory an H100 CTA may use
NUM_CONSUMER_WG = 2
TILE_RING_SLOTS = 4  # persistent CTAs: tile indices in flight from the producer warp to the others
TAIL_ROWS_ALIGN = 16  # a partial last block's products (tail_block): N of S^T / dQ^T and dK / dV's k-blocks
SMEM_ALIGN = 1024  # bytes: every shared buffer starts on a whole 128-byte-swizzle period (8 x 128 B)
SWIZZLE_ROW_BITS = (1024, 512, 256)  # the wgmma / TMA swizzle atoms' rows (128, 64, 32 bytes), widest first
TMA_ALIGN_BYTES = 16  # TMA: global strides (but the last) and addresses, in bytes
STATS_ALIGN = 128  # bytes: the LSE / Δ stages (TMA destinations)
# registers -> memory vector widths (bits): a thread's accumulator holds column pairs
DS_STORE_BITS = 32  # dS^T pair of 16-bit values, adjacent in the query-contiguous sdS
DQ_STORE_BITS = 64  # dQ fp32 pair into the swizzled staging buffer
DKV_STORE_BITS = 32  # dK / dV pair of 16-bit values into global memory
DKV_VECTOR_BITS = 128  # dkv_vector_store: a consumer thread's copy of staged dK / dV rows to global memory
KEEP_FLAG_BUFFERS = 2  # dropout keep-flag buffers: a warpgroup draws block i+1's while it may still read block i's
GRAD_BIAS_BOX_KEYS = 64  # keys of one bias-gradient TMA store: one 128-byte swizzle atom row (16-bit types)


def row_major_smem_layout(dtype, rows: int, cols: int, stages=None, slice_cols: Optional[int] = None):
    """(rows, cols[, stages]) row-major in shared memory with the widest swizzle atom that
    ``slice_cols`` (default: ``cols``) allows, the layout wgmma reads without bank conflicts."""
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warpgroup
    from cutlass.tensor_utils import LayoutEnum
    from cutlass.utils import hopper_helpers as hh

    atom_cols = slice_cols or cols
    atom = warpgroup.make_smem_layout_atom(hh.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols), dtype)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, order=(0, 1) if stages is None else (0, 1, 2))


def tma_align_elems(elem_bits: int) -> int:
    """Elements per TMA_ALIGN_BYTES (the divisibility of strides the sm90 path needs)."""
    return TMA_ALIGN_BYTES * 8 // elem_bits


def atom_cols(cols: int, elem_bits: int) -> int:
    """Columns of the widest swizzle atom whose row divides ``cols`` elements (the rule of
    ``hopper_helpers.get_smem_layout_atom``, which the DSL side calls; the catalogue test
    checks the two agree)."""
    for row_bits in SWIZZLE_ROW_BITS:
        if cols * elem_bits % row_bits == 0:
            return row_bits // elem_bits
    raise ValueError(f"{cols} columns of {elem_bits}-bit elements fit no swizzle atom")


@dataclass(frozen=True)
class AttentionSm90Layouts:
    """The geometry of one backward configuration: tile shapes, buffer counts and the
    layout-shaping flags, with the shared-memory layouts, tiled MMAs and copies built from them
    (``cute_kernels.attention_sm90.backward_config.AttentionSm90Tiles`` adds the switches)."""

    head_dim: int  # Dqk: Q, K, dQ, dK (and the S^T product's reduction)
    tile_m: int
    tile_n: int
    head_dim_v: Optional[int] = None  # Dv: V, dO, dV (dP^T's reduction); None: Dqk
    stages: int = 2  # Q / LSE and dO / Δ pipelines
    ds_stages: int = 2  # dS buffers: a warpgroup may write block i+1's dS while the other still reads block i's
    dq_per_wg: bool = False  # each warpgroup hands its part of dQ to the store warp alone (no joint barrier)
    dq_stages: int = 1  # dQ staging buffers (2 measured no faster: the reduce-add is read long before the next block)
    # dQ^T = K^T dS^T (warpgroups split the head dim on wgmma's M): lets tile_m be 80 (FA3's
    # non-causal d128 tile; dQ's own M would have to be a multiple of 64)
    dq_swapab: bool = False
    # dS in shared memory with keys contiguous (rows as the bias gradient's: TMA stores it from
    # there) instead of queries (whose register pairs store as 32 bits); with the bias gradient
    ds_keys_contiguous: bool = False
    # dS^T into shared memory by stmatrix (4 x 8x8 matrices a warp instruction; transposed
    # when keys are contiguous) instead of one 32-bit (16-bit) store per value pair (value)
    ds_stmatrix: bool = True
    # dK / dV through K's / V's shared memory (stmatrix) and a TMA store, instead of 32-bit
    # stores from registers straight to global memory
    dkv_tma_store: bool = False
    # with dkv_tma_store: the staged dK / dV leave by 128-bit stores of every consumer thread
    # instead of one thread's TMA stores, which queue behind the dQ-store warp's last reduce-adds
    # (the CTA then waits for them to read shared memory before it can leave)
    dkv_vector_store: bool = False
    # K / V buffers: 2 for persistent CTAs, which load the next tile's K / V while the current
    # tile runs (``backward_config`` chooses where; AttentionBackwardSm90.tile_schedule takes the path)
    kv_buffers: int = 1

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)

    @property
    def dkv_by_tma(self) -> bool:
        """dK / dV leave by TMA stores (staged, and not by the vector stores): the kernel then
        needs their TMA atoms."""
        return self.dkv_tma_store and not self.dkv_vector_store

    @property
    def tile_ring(self) -> int:
        """Persistent CTAs (kv_buffers 2): slots of the shared ring through which the producer
        warp hands the tile indices it takes from the tile counter to the other warps."""
        return TILE_RING_SLOTS if self.kv_buffers == 2 else 0

    @property
    def kv_barriers(self) -> int:
        """mbarriers of K / V: one (loaded once) or a full / empty pair per buffer."""
        return 1 if self.kv_buffers == 1 else 2 * self.kv_buffers

    @property
    def stats_stage_stride(self) -> int:
        """Floats between the LSE / Δ stages: TMA destinations are 128-byte aligned (tile_m 80)."""
        return -(-self.tile_m // 32) * 32

    @property
    def num_threads(self) -> int:
        return 128 * (NUM_CONSUMER_WG + 1)

    @property
    def num_mma_threads(self) -> int:
        return 128 * NUM_CONSUMER_WG

    @property
    def dq_atoms(self) -> tuple:
        """(M, N) warpgroups of the dQ product: split rows when there are 128, else columns."""
        return (2, 1) if self.tile_m == 128 else (1, 2)

    @property
    def ds_buffers(self) -> int:
        """(tile_m, tile_n) buffers of the sdS allocation: dS's stages."""
        return self.ds_stages

    @property
    def sdp_wg_tile(self) -> tuple:
        """(keys, queries) of S^T / dP^T one consumer warpgroup holds: 64 keys, every query."""
        return (self.tile_n // NUM_CONSUMER_WG, self.tile_m)

    def sdp_wg_origin(self, wg):
        """(key, query) where warpgroup ``wg``'s part of S^T starts in the block."""
        return (wg * (self.tile_n // NUM_CONSUMER_WG), 0)

    @property
    def keep_flag_keys(self) -> int:
        """Dropout: consecutive keys of one query row each consumer thread draws (a warpgroup
        draws its own part of S^T: curand's stream is key-contiguous, one Philox call per 4 keys)."""
        keys, queries = self.sdp_wg_tile
        return keys * queries // 128

    @property
    def keep_flag_bytes(self) -> int:
        """One buffer of dropout keep flags: a bit per (query, key) of the block, rows of queries."""
        return self.tile_m * self.tile_n // 8

    def smem_bytes(self, elem_bytes: int = 2, dropout: bool = False) -> int:
        """Bytes of the kernel's SharedStorage, member by member with its alignments, the
        whole rounded up to SMEM_ALIGN as the DSL sizes it (``dropout``: with the keep-flag
        buffers; d64 with dq_stages 2 came to 233472 bytes on the H100, over the limit, while
        it had a one-byte placeholder for them)."""
        d, dv = self.head_dim, self.head_dim_v

        def place(offset, size, align):
            return -(-offset // align) * align + size

        # mbarriers: Q and dO pipelines (full + empty), K/V, the tile ring's (full + empty); its slots
        off = 8 * (4 * self.stages + self.kv_barriers + 2 * self.tile_ring) + 4 * self.tile_ring
        stats = 4 * ((self.stages - 1) * self.stats_stage_stride + self.tile_m)
        off = place(off, stats, STATS_ALIGN)  # LSE
        off = place(off, stats, STATS_ALIGN)  # Δ
        q_rows = self.stages * self.tile_m
        kv_rows = self.kv_buffers * self.tile_n
        for rows, cols in ((q_rows, d), (q_rows, dv), (kv_rows, d), (kv_rows, dv)):
            off = place(off, rows * cols * elem_bytes, SMEM_ALIGN)  # Q, dO, K, V
        off = place(off, self.ds_buffers * self.tile_m * self.tile_n * elem_bytes, SMEM_ALIGN)  # dS (and P)
        off = place(off, self.dq_stages * self.tile_m * d * 4, SMEM_ALIGN)  # dQ staging
        if dropout:
            off = place(off, KEEP_FLAG_BUFFERS * self.keep_flag_bytes, STATS_ALIGN)
        # the struct's size is a multiple of its alignment (the DSL's launch checks that size)
        return -(-off // SMEM_ALIGN) * SMEM_ALIGN

    # ---- DSL objects (called while tracing) -------------------------------------------
    def tiled_mma_sdp(self, dtype):
        """S^T = K Q^T and dP^T = V dO^T: M = keys (64 per warpgroup), N = queries, K = head dim."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(NUM_CONSUMER_WG, 1, 1),
            tiler_mn=(64, self.tile_m),
        )

    def tiled_mma_dkv(self, dtype, cols: Optional[int] = None):
        """dV += P^T dO and dK += dS^T Q: A from registers, B the MN-major view of dO / Q.
        ``cols``: the product's head dim, dK's (head_dim, the default) or dV's (head_dim_v)."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            OperandMajorMode.K,
            OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(NUM_CONSUMER_WG, 1, 1),
            tiler_mn=(64, cols or self.head_dim),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def ds_major(self, as_a_of_dq: bool):
        """Major mode of the dS tile as a wgmma operand: dQ's A (queries x keys) or, transposed,
        the A of dK / dV (keys x queries, the wide kernel). K-major = contiguous along the
        product's reduction."""
        from cutlass.cute.nvgpu import OperandMajorMode

        k_major = self.ds_keys_contiguous == as_a_of_dq
        return OperandMajorMode.K if k_major else OperandMajorMode.MN

    def tiled_mma_dq(self, dtype):
        """dQ = dS K: A = dS (queries contiguous: MN-major; keys: K-major), B = K's MN-major view."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        am, an = self.dq_atoms
        if self.dq_swapab:  # A = K^T (head dim contiguous: MN-major), B = dS^T (keys contiguous: K-major)
            b_major = OperandMajorMode.K if self.ds_keys_contiguous else OperandMajorMode.MN
            return hh.make_trivial_tiled_mma(
                dtype,
                dtype,
                OperandMajorMode.MN,
                b_major,
                Float32,
                atom_layout_mnk=(an, am, 1),
                tiler_mn=(64, self.tile_m),
            )
        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            self.ds_major(True),
            OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(am, an, 1),
            tiler_mn=(64, self.head_dim // an),
        )

    def r2s_copy_ds(self, dtype, tiled_mma_sdp):
        """dS^T (the S^T / dP^T accumulator, cast) into sdS: query pairs as 32 bits, or single
        values where keys are contiguous."""
        import cutlass.cute as cute

        if self.ds_stmatrix:
            op = cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=self.ds_keys_contiguous, num_matrices=4)
            return cute.make_tiled_copy_C(cute.make_copy_atom(op, dtype), tiled_mma_sdp)
        bits = dtype.width if self.ds_keys_contiguous else DS_STORE_BITS
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
        return cute.make_tiled_copy_C(atom, tiled_mma_sdp)

    def r2s_copy_dq(self, tiled_mma_dq):
        """The dQ accumulator (fp32) into its staging buffer."""
        import cutlass.cute as cute
        from cutlass import Float32

        # dQ^T's value pairs run along queries, rows apart in the staging buffer: one value a store
        bits = 32 if self.dq_swapab else DQ_STORE_BITS
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=bits)
        return cute.make_tiled_copy_C(atom, tiled_mma_dq)

    def r2s_copy_dkv(self, dtype, tiled_mma_dkv):
        """dK / dV accumulators (cast) into K's / V's shared memory for the TMA store (stmatrix:
        rows of 8 values, as K-major swizzles keep them)."""
        import cutlass.cute as cute

        op = cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4)
        return cute.make_tiled_copy_C(cute.make_copy_atom(op, dtype), tiled_mma_dkv)

    def s2g_copy_dkv(self, dtype, cols: int, threads: Optional[int] = None):
        """Staged dK / dV rows (``cols`` wide) from shared to global memory by every consumer
        thread (or ``threads`` threads), 16 bytes a copy, a row's copies on consecutive threads
        (``dkv_vector_store``)."""
        import cutlass.cute as cute

        vec = DKV_VECTOR_BITS // dtype.width
        per_row = cols // vec
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=DKV_VECTOR_BITS)
        thr = cute.make_layout(((threads or self.num_mma_threads) // per_row, per_row), stride=(per_row, 1))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, vec)))

    def r2g_copy_dkv(self, dtype, tiled_mma_dkv):
        """dK / dV accumulators (cast) straight to global memory (once per CTA)."""
        import cutlass.cute as cute

        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=DKV_STORE_BITS)
        return cute.make_tiled_copy_C(atom, tiled_mma_dkv)

    @property
    def q_slice_cols(self) -> int:
        """Columns of the narrowest slice a wgmma takes of Q's MN-major view (dK: one
        warpgroup's N is all of Dqk)."""
        return self.head_dim

    @property
    def do_slice_cols(self) -> int:
        """The same for dO (dV: all of Dv)."""
        return self.head_dim_v

    @property
    def k_slice_cols(self) -> int:
        """The same for K (B operand of dQ): one warpgroup's dQ columns."""
        return self.dq_sub_tile[1]

    @property
    def v_slice_cols(self) -> int:
        """V is only read K-major (dP^T's A), which any atom dividing its rows serves. With
        equal head dims it takes K's layout (one layout and TMA box for both, as before
        Dqk != Dv), else the widest atom for its Dv columns."""
        return self.k_slice_cols if self.head_dim_v == self.head_dim else self.head_dim_v

    def smem_layout_rows(self, dtype, rows: int, stages, slice_cols: int, cols: Optional[int] = None):
        """(rows, cols[, stages]) row-major (cols: head_dim by default), swizzle atoms as wide
        as ``slice_cols`` allows: a wgmma's MN-major slice must start on a whole atom."""
        return row_major_smem_layout(dtype, rows, cols or self.head_dim, stages, slice_cols)

    def smem_layout_q(self, dtype):
        """Q ring: (tile_m, head_dim, stages)."""
        return self.smem_layout_rows(dtype, self.tile_m, self.stages, self.q_slice_cols)

    def smem_layout_do(self, dtype):
        """dO ring: (tile_m, head_dim_v, stages)."""
        return self.smem_layout_rows(dtype, self.tile_m, self.stages, self.do_slice_cols, self.head_dim_v)

    def smem_layout_k(self, dtype):
        """K: (tile_n, head_dim[, kv_buffers])."""
        buffers = self.kv_buffers if self.kv_buffers > 1 else None
        return self.smem_layout_rows(dtype, self.tile_n, buffers, self.k_slice_cols)

    def smem_layout_v(self, dtype):
        """V: (tile_n, head_dim_v[, kv_buffers]) (``v_slice_cols``)."""
        buffers = self.kv_buffers if self.kv_buffers > 1 else None
        return self.smem_layout_rows(dtype, self.tile_n, buffers, self.v_slice_cols, self.head_dim_v)

    def smem_layout_ds(self, dtype):
        """(tile_m, tile_n, ds_buffers), queries contiguous: dS^T's register pairs are adjacent.
        With ``ds_keys_contiguous`` rows of keys in 128-byte atoms, key-atom columns outer: each
        GRAD_BIAS_BOX_KEYS columns of a buffer are one TMA box of the bias gradient."""
        import cutlass.cute as cute
        from cutlass.cute.nvgpu import warpgroup
        from cutlass.tensor_utils import LayoutEnum
        from cutlass.utils import hopper_helpers as hh

        if self.ds_keys_contiguous:
            return cute.tile_to_shape(
                self.ds_keys_atom(dtype), (self.tile_m, self.tile_n, self.ds_buffers), order=(0, 1, 2)
            )
        atom = warpgroup.make_smem_layout_atom(hh.get_smem_layout_atom(LayoutEnum.COL_MAJOR, dtype, self.tile_m), dtype)
        return cute.tile_to_shape(atom, (self.tile_m, self.tile_n, self.ds_buffers), order=(1, 0, 2))

    def ds_keys_atom(self, dtype):
        """The keys-contiguous dS tile's swizzle atom: 8 rows of GRAD_BIAS_BOX_KEYS keys (128 bytes)."""
        from cutlass.cute.nvgpu import warpgroup
        from cutlass.tensor_utils import LayoutEnum
        from cutlass.utils import hopper_helpers as hh

        return warpgroup.make_smem_layout_atom(
            hh.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, GRAD_BIAS_BOX_KEYS), dtype
        )

    def smem_layout_grad_bias_box(self, dtype):
        """One TMA box of the bias gradient: GRAD_BIAS_BOX_KEYS columns of a keys-contiguous dS buffer."""
        import cutlass.cute as cute

        return cute.tile_to_shape(self.ds_keys_atom(dtype), (self.tile_m, GRAD_BIAS_BOX_KEYS), order=(0, 1))

    @property
    def dq_slice_cols(self) -> int:
        """Columns of one warpgroup's dQ: the register -> shared copy of its accumulator cuts
        the staging buffer into slices this wide, and dq_per_wg's reduce-add box is one."""
        return self.dq_sub_tile[1]

    def dq_atom(self):
        """fp32 swizzle atom of the dQ staging buffer: 128-byte (32 columns) where the
        warpgroup slices allow, else 64-byte (16 columns; d96's 48-column slices: with
        32-column atoms the DSL partitions neither the copy nor the box). Both put
        a warp's 64-bit accumulator pairs (8 rows x 4 pairs) in 2 wavefronts, the least
        for 256 bytes (row-major 512-byte rows were 8-way conflicts); TMA unswizzles it."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import warpgroup
        from cutlass.tensor_utils import LayoutEnum
        from cutlass.utils import hopper_helpers as hh

        return warpgroup.make_smem_layout_atom(
            hh.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, Float32, self.dq_slice_cols), Float32
        )

    def smem_layout_dq(self):
        """(tile_m, head_dim, dq_stages) fp32, swizzled (``dq_atom``)."""
        import cutlass.cute as cute

        return cute.tile_to_shape(
            self.dq_atom(), (self.tile_m, self.head_dim, self.dq_stages), order=self.dq_order + (2,)
        )

    @property
    def dq_order(self) -> tuple:
        """Tiling order of the dQ staging atoms: rows first, so a column part (dq_per_wg's
        when the warpgroups split columns) is one run and a TMA box covers one atom's columns;
        columns first when each warpgroup hands over its own rows (dq_per_wg, tile_m 128)."""
        return (1, 0) if self.dq_per_wg and self.dq_atoms == (2, 1) else (0, 1)

    @property
    def dq_sub_tile(self) -> tuple:
        """(rows, cols) of dQ one warpgroup computes."""
        am, an = self.dq_atoms
        return (self.tile_m // am, self.head_dim // an)

    def smem_layout_dq_sub(self):
        """One warpgroup's part of the dQ staging buffer (the TMA box of dq_per_wg)."""
        import cutlass.cute as cute

        return cute.tile_to_shape(self.dq_atom(), self.dq_sub_tile, order=self.dq_order)


@dataclass(frozen=True)
class AttentionSm90WideLayouts(AttentionSm90Layouts):
    """d192 / d256, or a Dqk / Dv pair with one of them (``AttentionBackwardSm90Wide``): 64 keys
    x 64 queries, both warpgroups own all 64 keys and split the other dimension of every
    product (module docstring)."""

    @property
    def ds_buffers(self) -> int:
        """P^T and dS^T both go through shared memory: P in buffers [0, ds_stages), dS after."""
        return 2 * self.ds_stages

    @property
    def sdp_wg_tile(self) -> tuple:
        """All 64 keys, half of the queries."""
        return (self.tile_n, self.tile_m // NUM_CONSUMER_WG)

    def sdp_wg_origin(self, wg):
        return (0, wg * (self.tile_m // NUM_CONSUMER_WG))

    def tiled_mma_sdp(self, dtype):
        """S^T = K Q^T, dP^T = V dO^T: all 64 keys, each warpgroup half of the queries (m64n32)."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(1, NUM_CONSUMER_WG, 1),
            tiler_mn=(64, self.tile_m // NUM_CONSUMER_WG),
        )

    def tiled_mma_dkv(self, dtype, cols: Optional[int] = None):
        """dV += P^T dO, dK += dS^T Q: A = P^T / dS^T from shared memory (K-major: queries
        contiguous), B the MN-major view of dO / Q; each warpgroup half of the head dim
        (``cols``: dK's head_dim by default, dV's head_dim_v)."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            self.ds_major(False),
            OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(1, NUM_CONSUMER_WG, 1),
            tiler_mn=(64, (cols or self.head_dim) // NUM_CONSUMER_WG),
        )

    def tiled_mma_dq(self, dtype):
        """dQ = dS K in two column halves, one after the other (their accumulators would not
        fit beside dK and dV): each warpgroup a quarter of d of each half."""
        from cutlass import Float32
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as hh

        return hh.make_trivial_tiled_mma(
            dtype,
            dtype,
            self.ds_major(True),
            OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(1, NUM_CONSUMER_WG, 1),
            tiler_mn=(64, self.dq_slice_cols),
        )

    @property
    def q_slice_cols(self) -> int:
        """dK / dV: one warpgroup's N is half of Dqk / Dv."""
        return self.head_dim // NUM_CONSUMER_WG

    @property
    def do_slice_cols(self) -> int:
        """dV: one warpgroup's N is half of Dv."""
        return self.head_dim_v // NUM_CONSUMER_WG

    @property
    def dq_slice_cols(self) -> int:
        """One warpgroup's part of a dQ half: a quarter of Dqk (also K's MN-major slice)."""
        return self.head_dim // (2 * NUM_CONSUMER_WG)

    @property
    def k_slice_cols(self) -> int:
        return self.dq_slice_cols
