"""Tiles of the attention-backward pre/post-processing kernels.

Seeds: PyTorch's ``flash_bwd_preprocess_kernel.h`` (``compute_dot_do_o``,
``clear_dKVaccum``, ``convert_dQ``, ``convert_dKV``) and the mem-eff kernel's
``computeDelta``. The names below are the originals' ``Kernel_traits`` members.

| name                   | what                                         | layout                                         |
|------------------------|----------------------------------------------|------------------------------------------------|
| GmemTiledCopydO        | O / dO tile -> registers (also dQ/dK/dV out) | (threads/TPR x TPR) threads, (1 x vec) values  |
| GmemTiledCopydQaccum   | fp32 accumulator tile <-> registers          | (threads/TPRa x TPRa) threads, (1 x 4) values  |
| TiledMmadQ / TiledMmadKV | the accumulator's MMA fragment layout      | sm80 m16n8k16, warps (W_M x W_N x 1)           |
| accumulator read       | fp32 partials -> fragment                    | make_tiled_copy_C(64-bit atom, TiledMmadQ)     |
| SmemCopyAtomdQ         | fragment -> smem, 2 elements per store        | make_tiled_copy_C(32-bit atom, TiledMmadQ)     |
| SmemLayoutdQ / dKV     | the staging tile                             | Swizzle<3,3,3> (8 x 64) atoms (32-col: <2,3,3>) |

TPR (threads per row) = kBlockKGmem / vec with kBlockKGmem the largest of 128, 64, 32
dividing the padded head dim (the original's rule), capped at 32 so that a row's
threads are lanes of one warp and the row sum is a shuffle-xor butterfly.

| padded head dim | preprocess kBlockM x threads | postprocess kBlockM x threads (MMA warps M x N) |
|-----------------|------------------------------|-------------------------------------------------|
| 32              | 128 x 128                    | 32 x 128 (2 x 2)                                |
| 64              | 64 x 128                     | 32 x 128 (2 x 2)                                |
| 96, 128         | 32 x 128 (96: 32 rows)       | 32 x 128 (2 x 2)                                |
| 160 .. 256      | 16-24 x 128 (>= copy rows)   | 32 x 128 (2 x 2)                                |

The preprocess tile keeps 32 elements of each of O and dO per thread in registers
(every load issued before the first product); loads skip L1 (no_allocate). The grid
walks heads fastest (``HEADS_FASTEST``). All of it measured on the H100:
docs/attention_bwd_prepost.md.

Memory conventions (the original's): Δ is [batch, heads, seqlen_q_rounded] fp32 with
seqlen_q_rounded = round_up(max seqlen_q, 128); the dQ accumulator is
[batch, seqlen_q_rounded, heads, head_dim_rounded] fp32, or with variable lengths
[total_q + 128 * batch, heads, head_dim_rounded] (sequence b starts at row
cu_seqlens_q[b] + 128 b: every sequence has 128 rows of slack for whole-tile writes),
optionally with a leading split dim; dK/dV accumulators are
[batch, heads_k, seqlen_k_rounded, head_dim_rounded] fp32. head_dim_rounded rounds d up
to a multiple of 32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import SmemLayoutSpec, TiledCopySpec, TiledMmaSpec

MAX_VECTOR_BITS = 128
SEQLEN_ROUND = 128  # seqlen_q_rounded / seqlen_k_rounded multiple
VARLEN_ACCUM_PAD = 128  # rows of slack per sequence in a variable-length dQ accumulator
HEAD_DIM_ROUND = 32
MAX_HEAD_DIM = 256
# compute_delta also serves the memory-efficient backward, whose head dims go to 512
MAX_DELTA_HEAD_DIM = 512
NUM_THREADS = 128
# CTAs launched back to back read the same rows of neighbouring heads: in a
# [B, S, H, D] tensor those are adjacent, so DRAM pages are opened once, not per head.
HEADS_FASTEST = True
# O and dO are read once: not allocating them in L1 gave 3-8% on the H100.
LOAD_HINTS = (("op", "g2r"), ("l1_evict", "no_allocate"))
# compute_delta (mem-eff): kNumThreads, kBlockSizeI, pipeline stages
DELTA_THREADS = 128
DELTA_BLOCK_I = 64
DELTA_STAGES = 2


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def head_dim_rounded(d: int) -> int:
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {MAX_HEAD_DIM}], got {d}")
    return round_up(d, HEAD_DIM_ROUND)


def seqlen_rounded(s: int) -> int:
    return round_up(max(s, 1), SEQLEN_ROUND)


def _block_k_gmem(head_dim: int) -> int:
    return 128 if head_dim % 128 == 0 else 64 if head_dim % 64 == 0 else 32


def _pow2_divisor(x: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and x % (p * 2) == 0:
        p *= 2
    return p


@dataclass(frozen=True)
class PrepostTiles:
    """One configuration: element width, padded head dim (kHeadDim), vector, CTA tile."""

    elem_bits: int
    head_dim: int  # kHeadDim: the padded head dim (multiple of 32)
    vec: int  # elements per O/dO/dQ access (the host's widest legal vector)
    block_m: int  # kBlockM (preprocess) or kBlockM/kBlockN (postprocess)
    num_threads: int = NUM_THREADS
    heads_fastest: bool = HEADS_FASTEST  # grid raster: blockIdx.x walks heads, not row blocks
    load_hints: tuple = ()  # TiledCopySpec fields for the O/dO loads, e.g. (("op", "g2r"), ...)
    tiles_per_cta: int = 1  # row blocks per CTA (preprocess), software-pipelined
    # the grid walked backwards: the CTAs launched first take the last (batch, head, rows)
    # tiles, which a kernel walking forwards before this one touched last and L2 may still
    # hold; and this one's last tiles (batch 0's) are the first the next kernel reads
    last_first: bool = False

    def __post_init__(self):
        if self.head_dim % HEAD_DIM_ROUND or not 0 < self.head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"kHeadDim must be a multiple of {HEAD_DIM_ROUND} up to {MAX_HEAD_DIM}")
        if self.vec < 1 or self.vec & (self.vec - 1) or self.vec * self.elem_bits > MAX_VECTOR_BITS:
            raise ValueError(f"vector of {self.vec} x {self.elem_bits} bits is not a legal access")
        for spec in (self.gmem_tiled_copy_do(), self.gmem_tiled_copy_dq_accum()):
            if self.block_m % spec.tiler[0]:
                raise ValueError(f"kBlockM={self.block_m} is not a multiple of a copy's {spec.tiler[0]} rows")

    @property
    def tile(self) -> tuple:
        return (self.block_m, self.head_dim)

    def ctas_along_rows(self, rows: int) -> int:
        return -(-rows // (self.block_m * self.tiles_per_cta))

    @property
    def threads_per_row(self) -> int:  # kGmemThreadsPerRow
        return min(32, _block_k_gmem(self.head_dim) // self.vec)

    def gmem_tiled_copy_do(self, load: bool = False) -> TiledCopySpec:
        """GmemTiledCopydO: O, dO (and dQ, dK, dV stores) one vector per thread per row."""
        tpr = self.threads_per_row
        hints = dict(self.load_hints) if load else {}
        return TiledCopySpec((self.num_threads // tpr, tpr), (1, self.vec), self.elem_bits, **hints)

    def grid(self, num_blocks, batch, heads) -> list:
        """The launch grid for (row blocks, batch, heads), in this tiling's raster order.

        Heads fastest flattens (row block, head) into x, whose limit is 2^31 - 1, so
        long sequences do not meet y's 65535.
        """
        return [heads * num_blocks, batch, 1] if self.heads_fastest else [num_blocks, batch, heads]

    def block_coords(self, block, grid, heads) -> tuple:
        """(row block, batch, head) of CTA ``block`` = (x, y, z) of ``grid`` (``grid``'s
        raster order, backwards with ``last_first``); plain arithmetic, so the kernels
        trace it on the DSL's block indices and the tests run it on ints."""
        x, y, z = block
        if self.last_first:
            x, y, z = grid[0] - 1 - x, grid[1] - 1 - y, grid[2] - 1 - z
        if self.heads_fastest:
            return x // heads, y, x % heads
        return x, y, z

    def gmem_tiled_copy_dq_accum(self) -> TiledCopySpec:
        """GmemTiledCopydQaccum: fp32 accumulators, 128-bit accesses."""
        tpr = _pow2_divisor(self.head_dim // 4, 32)
        return TiledCopySpec((self.num_threads // tpr, tpr), (1, 4), 32)

    def tiled_mma(self) -> TiledMmaSpec:
        """TiledMmadQ / TiledMmadKV: the warps of the backward's dQ (dK, dV) MMA."""
        warps = self.num_threads // 32
        warps_m = min(warps, self.block_m // 16)
        warps_n = warps // warps_m
        return TiledMmaSpec((warps_m, warps_n, 1), (16 * warps_m, 16 * warps_n, 16))

    def smem_layout_dq(self) -> SmemLayoutSpec:
        """SmemLayoutdQ (also SmemLayoutdKV): where a tile is staged for 128-bit stores.

        With one-element vectors (odd head dims) the DSL cannot copy element-wise out of
        a swizzled tile, so rows are padded by 16 bytes instead, which also keeps the
        fragment's 8-row column writes on distinct banks.
        """
        if self.vec == 1:
            return SmemLayoutSpec((8, self.head_dim), None, self.tile, self.elem_bits, pad=128 // self.elem_bits)
        k = 64 if self.head_dim % 64 == 0 else 32
        swizzle = (3, 3, 3) if k == 64 else (2, 3, 3)
        return SmemLayoutSpec((8, k), swizzle, self.tile, self.elem_bits)

    def accum_copy_bits(self) -> int:
        """The fp32 accumulator read in the MMA fragment's layout: a pair of columns, 64 bits."""
        return 64

    def smem_copy_atom_dq_bits(self) -> int:
        """SmemCopyAtomdQ: one fragment pair (2 elements) per shared store."""
        return 2 * self.elem_bits


def _check_vec(elem_bits: int, vec: int) -> None:
    if vec < 1 or vec & (vec - 1) or vec * elem_bits > MAX_VECTOR_BITS:
        raise ValueError(f"vector of {vec} x {elem_bits} bits is not a legal access")


def preprocess_tiles(elem_bits: int, head_dim: int, vec: int, arch: str = "sm_90a") -> PrepostTiles:
    """compute_dot_do_o: padded head dim ``head_dim``, ``vec`` elements per access.

    kBlockM * kHeadDim = 4096: 32 elements of each of O and dO per thread, all loads
    issued before the first product, many small CTAs per SM. On the H100 this beat
    64- and 128-row tiles, 256 threads, and 2 or 4 software-pipelined tiles per CTA by
    1-7% (docs/attention_bwd_prepost.md). sm_80 shares the tiles. The grid is walked
    backwards (``last_first``): batch 0's O / dO / Δ / zeroed accumulator rows go last, so L2
    still holds them when the attention backward's first CTAs (batch 0's) read them.
    """
    del arch
    _check_vec(elem_bits, vec)
    hd = head_dim_rounded(head_dim)
    probe = PrepostTiles(elem_bits, hd, vec, 128)
    rows = math.lcm(probe.gmem_tiled_copy_do().tiler[0], probe.gmem_tiled_copy_dq_accum().tiler[0])
    block_m = max(rows, (4096 // hd) // rows * rows)
    return PrepostTiles(elem_bits, hd, vec, block_m, load_hints=LOAD_HINTS, last_first=True)


def postprocess_tiles(elem_bits: int, head_dim: int, vec: int, arch: str = "sm_90a") -> PrepostTiles:
    """convert_dq / convert_dkv / clear_dkv_accum. The grid is walked backwards
    (``last_first``): the attention backward before convert_dq adds into the last batches'
    accumulator rows last, and those are the ones L2 may still hold (H100, full sm90 backward
    with both walked backwards: 0.6-1.7% faster on the six suite cases, docs/attention_sm90.md)."""
    del arch
    _check_vec(elem_bits, vec)
    hd = head_dim_rounded(head_dim)
    return PrepostTiles(elem_bits, hd, vec, 32, last_first=True)


@dataclass(frozen=True)
class ComputeDeltaTiles:
    """mem-eff ``computeDelta``: kNumThreads threads over kBlockSizeI rows, kMaxK columns."""

    elem_bits: int
    vec: int  # kElementsPerAccess
    max_k: int  # kMaxK: the padded head dim
    num_threads: int = DELTA_THREADS
    block_i: int = DELTA_BLOCK_I
    stages: int = DELTA_STAGES

    def __post_init__(self):
        _check_vec(self.elem_bits, self.vec)
        if self.threads_per_line not in (1, 2, 4):  # the original's static_assert
            raise ValueError("kNumThreads / kBlockSizeI must be 1, 2 or 4")
        if self.max_k % (self.vec * self.threads_per_line):
            raise ValueError("kMaxK must be a multiple of kElementsPerAccess * kNumThreadsPerLine")

    @property
    def threads_per_line(self) -> int:  # kNumThreadsPerLine
        return self.num_threads // self.block_i

    @property
    def max_iters(self) -> int:  # kMaxIters
        return self.max_k // (self.vec * self.threads_per_line)

    def gmem_load(self) -> TiledCopySpec:
        """Thread t reads row t / kNumThreadsPerLine, vector t % kNumThreadsPerLine of a line."""
        return TiledCopySpec((self.block_i, self.threads_per_line), (1, self.vec), self.elem_bits)


def delta_head_dim_rounded(d: int) -> int:
    """compute_delta's kMaxK: the head dim rounded to 32, up to MAX_DELTA_HEAD_DIM."""
    if not 1 <= d <= MAX_DELTA_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {MAX_DELTA_HEAD_DIM}], got {d}")
    return round_up(d, HEAD_DIM_ROUND)


def compute_delta_tiles(elem_bits: int, head_dim: int, vec: int, arch: str = "sm_90a") -> ComputeDeltaTiles:
    del arch
    return ComputeDeltaTiles(elem_bits, vec, delta_head_dim_rounded(head_dim))
