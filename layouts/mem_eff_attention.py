"""Layouts of the memory-efficient attention backward (``AttentionBackwardKernel``).

Seed: PyTorch's ``kernel_backward.h`` (originally xformers). Its template parameters that
shape the tiles (scalar_t, kIsAligned, kBlockSizeI / J, kMaxK, the warps, the buffers and
the features that own shared memory) are :class:`AttentionBackwardLayouts`' fields; what
the C++ derives from them for the tiles (``kNumWarpsPerBlock``, the column loops, the
``GradQTempStorage`` words...) is a property here, and every layout the five matmuls use is
a method, so a layout change here is a kernel change. The algorithm switches (kPreload,
kKeysQueriesAlignedToBlockSize, the dQ reductions), the register budget that decides
kOutputInRF, kMinBlocksPerSm, and the measured tile table
(``attention_backward_config``) with its head-dim thresholds are
``cute_kernels/mem_eff_attention/config.py`` (``AttentionBackwardConfig``, which extends
:class:`AttentionBackwardLayouts`; the kernel reads that one object).

The five matmuls of one (query block i, key block j) step, their MMA shape (M x N x K)
and where their operands come from (sm80 ``mma.sync`` m16n8k16, fp32 accumulators):

| matmul       | computes                         | M x N x K       | A (smem, ldmatrix)  | B (smem, ldmatrix)    |
|--------------|----------------------------------|-----------------|---------------------|-----------------------|
| MatmulQK     | attn_T = K_j Q_iᵀ                | J x I x Dqk     | K_j (J x Dqk)       | Q_i (I x Dqk)         |
| MatmulGradV  | dV_j += attn_Tᵀᵀ dO_i = P_ijᵀ dO_i | J x Dv x I    | attn_T (J x I)      | dO_iᵀ (.trans)        |
| MatmulDOIVJ  | dP_ijᵀ = V_j dO_iᵀ               | J x I x Dv      | V_j (J x Dv)        | dO_i (I x Dv)         |
| MatmulGradQ  | dQ_i += dS_ij K_j                | I x Dqk x J     | tmp_T (.trans)      | K_jᵀ (.trans)         |
| MatmulGradK  | dK_j += dS_ijᵀ Q_i               | J x Dqk x I     | tmp_T (J x I)       | Q_iᵀ (.trans)         |

MatmulDOIVJ is computed transposed (the original computes dO_i V_jᵀ and re-reads
attn_T transposed from shared memory, element by element): with dPᵀ in the same
fragment layout as attn_T, dS = (dP - Δ)·P is formed in registers and stored once,
as ``tmp_T``; both dQ and dK read it, one of them through a transposed view.

The tiles picked per head dim (block sizes, warps): ``cute_kernels/mem_eff_attention/config.py``'s
table.

Head dims above 256 (``output_in_rf`` false, the C++'s kOutputInRF = false): max_k is
rounded up to 64 (288 runs as 320) and MatmulGradV, MatmulGradK and MatmulGradQ loop
over the head dim in column chunks of ``grad_col_tile`` (128, or 64 when max_k % 128),
each chunk's accumulator in registers for that chunk only. Between the query blocks of
a key block, the dK_j / dV_j chunks live in an fp32 workspace in global memory (the
C++'s ``accumulate_in_gmem`` over ``workspace_gk`` / ``workspace_gv``), in each
thread's own fragment order: the first query block starts from zeros, the last one
writes dK / dV from registers. MatmulQK and MatmulDOIVJ still contract over the whole
head dim from shared memory. Q_i and dO_i have one buffer (stages_q = 1) above 320;
shared memory: 197 KB at max_k 512, so sm_80 (163 KB) serves head dims up to 384
only (the config refuses more with a NotImplementedError). fp32 stops at 256.

Q_i, dO_i, LSE_i and Δ_i have ``stages_q`` = 2 buffers where shared memory allows
(sm_90 always; sm_80 up to max_k 128): the next query block of the same key block is
fetched (cp.async) while this one is computed.

``max_k`` is max(Dqk, Dv) rounded up to 32 (the C++ rounds to 32, 64, 128 or
unbounded); runtime head dims below it are predicated. The dQ partials of a query
block live in the fp32 workspace (``GradQTempStorage``) between key blocks, in the
thread-owned fragment order of the original's ``GmemTile`` (128-bit per access).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Tuple

from .spec import SmemLayoutSpec, TiledCopySpec, TiledMmaSpec

WARP_SIZE = 32
HEAD_DIM_ROUND = 32  # max_k is a multiple of this
SMEM_CAPACITY = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024, "sm_90a": 227 * 1024}
GMEM_TILE_ACCESS = 4  # floats per GmemTile access (128 bits)
GRAD_Q_HEADER_WORDS = 4  # GradQTempStorage: lock, counter, pad[2]
SIMT_THREADS = (16, 16)  # fp32 (SIMT FMA) matmuls: threads over (M, N)
SIMT_K_BLOCK = 8  # fp32: k per shared -> register step


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _swizzled_atom(cols: int, elem_bits: int) -> Tuple[Tuple[int, int], Tuple[int, int, int]]:
    """(8 x k) row-major atom and its swizzle: k spans 128, 64 or 32 bytes of a row.

    Swizzle<B, M, S> with M = log2(16 bytes / element) permutes 16-byte chunks, so the
    8 rows an ldmatrix reads (one column chunk each) land on 8 different bank groups.
    """
    elem_bytes = elem_bits // 8
    row_bytes = cols * elem_bytes
    chunk = 128 if row_bytes % 128 == 0 else 64 if row_bytes % 64 == 0 else 32
    base = {1: 4, 2: 3, 4: 2}[elem_bytes]
    bits = {128: 3, 64: 2, 32: 1}[chunk]
    return (8, chunk // elem_bytes), (bits, base, 3)


@dataclass(frozen=True)
class AttentionBackwardLayouts:
    """``AttentionBackwardKernel``'s template parameters that shape its tiles, plus our warp
    layouts. ``output_in_rf`` (kOutputInRF: a register budget) is the configuration's
    (``cute_kernels/mem_eff_attention/config.py``'s ``AttentionBackwardConfig``, the class the
    kernel reads); the column loops and workspaces here follow it."""

    elem_bits: int  # scalar_t
    is_aligned: bool  # kIsAligned: 128-bit global accesses (strides multiples of 8 halves)
    apply_dropout: bool  # kApplyDropout: Zij (keep flags) drawn per block, applied to dV's P and to dP
    block_size_i: int  # kBlockSizeI: queries per block
    block_size_j: int  # kBlockSizeJ: keys per block (one key block per CTA step)
    max_k: int  # kMaxK: upper bound of max(head_dim, head_dim_value), a multiple of 32
    num_warps: int = 8  # kNumWarpsPerBlock (the C++: I * J / 1024)
    warps_sdp: Tuple[int, int] = (4, 2)  # MatmulQK / MatmulDOIVJ: warps over (keys, queries)
    warps_dkv: Tuple[int, int] = (4, 2)  # MatmulGradV / MatmulGradK: warps over (keys, head dim)
    warps_dq: Tuple[int, int] = (2, 4)  # MatmulGradQ: warps over (queries, head dim)
    stages_q: int = 2  # buffers of Q_i / dO_i / LSE / Δ: 2 prefetches the next query block
    # tmp_T in its own bytes (not over attn_T's): dS is stored before GradV and the three
    # gradient matmuls run behind one barrier instead of three. Measured on the H100:
    # 0.97-1.01x (more shared memory, less L1), so off; kept as a switch. A switch that
    # shapes the shared storage, so a field here (as the sm90 layouts' layout-shaping flags).
    tmp_own_buffer: bool = False
    # Attention bias (the C++'s bias_ptr != nullptr, a compile-time flag here so that the
    # no-bias kernel pays nothing): BiasLoader tiles it through shared memory.
    has_bias: bool = False
    bias_aligned: bool = False  # 128-bit cp.async bias loads (else one element per access)
    grad_bias: bool = False  # BiasGradEpilogue: dB = dS (before the softmax scale)

    def __post_init__(self):
        if self.elem_bits not in (16, 32):
            raise ValueError(f"scalar_t must be 16 or 32 bits, got {self.elem_bits}")
        if self.max_k % HEAD_DIM_ROUND or self.max_k <= 0:
            raise ValueError(f"kMaxK must be a positive multiple of {HEAD_DIM_ROUND}, got {self.max_k}")
        for name, (wm, wn) in (
            ("warps_sdp", self.warps_sdp),
            ("warps_dkv", self.warps_dkv),
            ("warps_dq", self.warps_dq),
        ):
            if wm * wn != self.num_warps:
                raise ValueError(f"{name} {wm}x{wn} does not use the {self.num_warps} warps")
        if not self.is_half:  # SIMT: 16 x 16 threads tile every matmul
            tm, tn = SIMT_THREADS
            if tm * tn != self.num_threads:
                raise ValueError(f"the SIMT thread grid {SIMT_THREADS} does not use the {self.num_threads} threads")
            checks = (
                (self.block_size_j, tm, "block_size_j (MatmulQK M)"),
                (self.block_size_i, tn, "block_size_i (MatmulQK N)"),
                (self.block_size_i, tm, "block_size_i (MatmulGradQ M)"),
                (self.grad_col_tile, tn, "grad_col_tile (MatmulGradK N)"),
            )
        else:
            checks = ()
        checks = checks or (
            (self.block_size_j, 16 * self.warps_sdp[0], "block_size_j (MatmulQK M)"),
            (self.block_size_i, 16 * self.warps_sdp[1], "block_size_i (MatmulQK N)"),
            (self.block_size_j, 16 * self.warps_dkv[0], "block_size_j (MatmulGradK M)"),
            (self.grad_col_tile, 16 * self.warps_dkv[1], "grad_col_tile (MatmulGradK N)"),
            (self.block_size_i, 16 * self.warps_dq[0], "block_size_i (MatmulGradQ M)"),
            (self.grad_col_tile, 16 * self.warps_dq[1], "grad_col_tile (MatmulGradQ N)"),
            (self.max_k, self.grad_col_tile, "max_k (the gradient matmuls' column loop)"),
        )
        for size, tile, what in checks:
            if size % tile:
                raise ValueError(f"{what}={size} is not a multiple of the warp tile {tile}")
        if self.stages_q not in (1, 2):
            raise ValueError(f"stages_q must be 1 or 2, got {self.stages_q}")
        if self.block_size_i > self.num_threads:
            raise ValueError("each of the block's queries needs a thread (di / lse loads)")
        if self.grad_bias and not self.has_bias:
            raise ValueError("grad_bias needs has_bias")
        if self.apply_dropout:
            tpr = self.zij_threads_per_row
            if self.num_threads % self.block_size_i or self.block_size_j % (4 * tpr):
                raise ValueError(
                    f"Zij: {self.num_threads} threads cannot draw {self.block_size_i} x {self.block_size_j} in quads"
                )

    # ---- the C++'s derived constants ------------------------------------------------
    @property
    def is_half(self) -> bool:  # kIsHalf
        return self.elem_bits <= 16

    @property
    def num_threads(self) -> int:  # kNumThreads
        return WARP_SIZE * self.num_warps

    @property
    def output_in_rf(self) -> bool:
        """kOutputInRF: dK_j / dV_j accumulate in registers across the query blocks. A register
        budget, so the configuration's (config.py's AttentionBackwardConfig overrides this)."""
        raise NotImplementedError(
            "AttentionBackwardLayouts is the geometry only: use cute_kernels.mem_eff_attention.config."
            "AttentionBackwardConfig (it decides output_in_rf)"
        )

    @property
    def needs_accum_grad_k(self) -> bool:  # kNeedsAccumGradK
        return not self.output_in_rf

    @property
    def needs_accum_grad_v(self) -> bool:  # kNeedsAccumGradV
        return not self.output_in_rf

    @property
    def vec(self) -> int:
        """Elements per global access: 128 bits when aligned, one element otherwise."""
        return 128 // self.elem_bits if self.is_aligned else 1

    # ---- column loops and GradQTempStorage -------------------------------------------
    @property
    def grad_col_tile(self) -> int:
        """MatmulGradV / GradK / GradQ's column tile (ThreadblockShape::kN): the whole
        padded head dim (one column iteration) while dK / dV stay in registers, else
        128 (64 when max_k % 128) columns per iteration of the column loop."""
        if self.output_in_rf:
            return self.max_k
        return 128 if self.max_k % 128 == 0 else 64

    @property
    def grad_q_col_tile(self) -> int:
        """MatmulGradQ's column tile."""
        return self.grad_col_tile

    @property
    def num_col_blocks(self) -> int:
        """Iterations of the gradient matmuls' column loop over max_k."""
        return self.max_k // self.grad_col_tile

    @property
    def grad_q_elements_stored(self) -> int:  # AccumTileGmem::kElementsStored x column blocks
        return self.block_size_i * self.max_k

    @property
    def grad_kv_accum_words(self) -> int:
        """fp32 words of one dK_j (or dV_j) accumulator in the workspace (not output_in_rf)."""
        return 0 if self.output_in_rf else self.block_size_j * self.max_k

    @property
    def grad_q_temp_storage_words(self) -> int:  # sizeof(GradQTempStorage) / 4
        return GRAD_Q_HEADER_WORDS + self.grad_q_elements_stored

    # ---- shared memory tiles ----------------------------------------------------------
    def smem_tile(self, rows: int, cols: int) -> SmemLayoutSpec:
        atom, swizzle = _swizzled_atom(cols, self.elem_bits)
        if not self.is_half:
            # SIMT reads the tiles element by element through the MMA's partitions; the
            # DSL (4.8.1) mis-addresses those reads on a swizzled tile (measured on the
            # H100: wrong gradients, right without the swizzle), so fp32 tiles are plain.
            swizzle = (0, swizzle[1], swizzle[2])
        return SmemLayoutSpec(atom, swizzle, (rows, cols), self.elem_bits)

    def smem_layout_q(self) -> SmemLayoutSpec:  # MatmulQK B operand, MatmulGradK B (transposed)
        return replace(self.smem_tile(self.block_size_i, self.max_k), stages=self.stages_q)

    def smem_layout_k(self) -> SmemLayoutSpec:  # MatmulQK A operand, MatmulGradQ B (transposed)
        return self.smem_tile(self.block_size_j, self.max_k)

    def smem_layout_v(self) -> SmemLayoutSpec:  # MatmulDOIVJ A operand
        return self.smem_tile(self.block_size_j, self.max_k)

    def smem_layout_do(self) -> SmemLayoutSpec:  # MatmulDOIVJ B operand, MatmulGradV B (transposed)
        return replace(self.smem_tile(self.block_size_i, self.max_k), stages=self.stages_q)

    def smem_layout_attn(self) -> SmemLayoutSpec:
        """AccumulatorSharedStorage of attn_T (and of tmp_T = dSᵀ·scale): J x I."""
        return self.smem_tile(self.block_size_j, self.block_size_i)

    # ---- bias and dropout ----------------------------------------------------------------
    @property
    def tile_pad_bytes(self) -> int:
        # 16 bytes per row: rows stay 16-byte aligned (cp.async) and consecutive query
        # rows start 4 banks apart, so the fragment reads (2 queries x 8 keys per
        # 4 lanes) do not conflict.
        return 16

    def smem_layout_bias(self) -> SmemLayoutSpec:
        """BiasLoader::SmemTile: B_ij as (queries, keys), rows padded (read at the fragment's
        (key, query); also the BiasGradEpilogue's staging tile for dB_ij)."""
        pad = self.tile_pad_bytes * 8 // self.elem_bits
        return SmemLayoutSpec((1, 1), None, (self.block_size_i, self.block_size_j), self.elem_bits, pad=pad)

    def smem_layout_zij(self) -> SmemLayoutSpec:
        """ZijSharedStorage: one keep flag byte per (query, key), rows padded."""
        return SmemLayoutSpec((1, 1), None, (self.block_size_i, self.block_size_j), 8, pad=self.tile_pad_bytes)

    @property
    def zij_threads_per_row(self) -> int:
        """Threads drawing one query row of Zij (the C++'s kNumThreads / kQueriesPerBlock)."""
        return max(1, self.num_threads // self.block_size_i)

    @property
    def zij_quads_per_thread(self) -> int:
        """curand_uniform4 calls per thread per block (elts_per_thread / 4)."""
        return self.block_size_j // (4 * self.zij_threads_per_row)

    def bias_tiled_copy(self) -> TiledCopySpec:
        """BiasLoader::GmemTileIterator: rows of queries, contiguous keys; 128-bit cp.async
        when the bias allows it, else one element per (synchronous) access."""
        if self.bias_aligned:
            vec = 128 // self.elem_bits
            tpr = min(self.block_size_j // vec, self.num_threads)
            return TiledCopySpec(
                (self.num_threads // tpr, tpr), (1, vec), self.elem_bits, op="cp.async", load_cache="global"
            )
        tpr = min(32, self.block_size_j)
        return TiledCopySpec((self.num_threads // tpr, tpr), (1, 1), self.elem_bits)

    def grad_bias_tiled_copy(self) -> TiledCopySpec:
        """BiasGradEpilogue: the staged dB_ij tile to global memory, 128-bit stores (our
        grad_bias rows are padded to 128 bits)."""
        vec = 128 // self.elem_bits
        tpr = min(self.block_size_j // vec, self.num_threads)
        return TiledCopySpec((self.num_threads // tpr, tpr), (1, vec), self.elem_bits)

    # ---- copies -----------------------------------------------------------------------
    def gmem_tiled_copy(self, cols: int) -> TiledCopySpec:
        """Q, K, V, dO tiles into shared memory: cp.async 16 bytes, or one element.

        Threads per row = the swizzle atom's width / vector, so each 8-row group of
        copies writes whole atoms (the original's 128-bit ``PredicatedTileIterator``).
        """
        if self.is_aligned:
            atom_cols = _swizzled_atom(cols, self.elem_bits)[0][1]
            tpr = atom_cols // self.vec
            return TiledCopySpec(
                (self.num_threads // tpr, tpr), (1, self.vec), self.elem_bits, op="cp.async", load_cache="global"
            )
        tpr = min(32, cols)
        return TiledCopySpec((self.num_threads // tpr, tpr), (1, 1), self.elem_bits)

    def smem_store_bits(self) -> int:
        """Fragment -> shared (attn_T, tmp_T): two accumulator columns per store
        (mma.sync holds column pairs; a SIMT thread's columns are 16 apart)."""
        return 2 * self.elem_bits if self.is_half else self.elem_bits

    # ---- MMAs -------------------------------------------------------------------------
    def _mma(self, warps: Tuple[int, int]) -> TiledMmaSpec:
        if not self.is_half:
            # fp32: SIMT FMA, threads SIMT_THREADS over (M, N), K_BLOCK k per block
            tm, tn = SIMT_THREADS
            return TiledMmaSpec((tm, tn, 1), (tm, tn, SIMT_K_BLOCK), (1, 1, 1), op="fma")
        wm, wn = warps
        return TiledMmaSpec((wm, wn, 1), (16 * wm, 16 * wn, 16))

    def mma_qk(self) -> TiledMmaSpec:  # MatmulQK and MatmulDOIVJ (same fragment layout)
        return self._mma(self.warps_sdp)

    def mma_grad_kv(self) -> TiledMmaSpec:  # MatmulGradV and MatmulGradK
        return self._mma(self.warps_dkv)

    def mma_grad_q(self) -> TiledMmaSpec:  # MatmulGradQ
        return self._mma(self.warps_dq)

    # ---- SharedStorage ----------------------------------------------------------------
    def shared_storage_sizes(self) -> dict:
        """Bytes of each field and part, as the C++'s ``print_size`` reports them.

        persistent: di and lse (fp32 per query), K_j and V_j (the key block's tiles,
        kept while the CTA walks its query blocks); part1 (QK, GradV, DOIVJ): Q_i, dO_i,
        attn_T, zij (dropout only); part2 (GradQ, GradK) reuses attn_T's bytes for tmp_T
        and keeps Q_i (GradK's B operand). The parts are a union; the C++ union of
        part1..part6 collapses to these two because our epilogues write from registers
        (also above 256: the column loops' dK / dV chunks go to global memory, not
        through shared memory).
        """
        e = self.elem_bits // 8
        i, j, k, st = self.block_size_i, self.block_size_j, self.max_k, self.stages_q
        attn = j * i * e
        persistent = {"di": 4 * i * st, "lse": 4 * i * st, "mm_qk_k": j * k * e, "mm_doivj_v": j * k * e}
        part1 = {
            "mm_qk_q": i * k * e * st,
            "mm_gradV_do": i * k * e * st,
            "attn_shared_storage": attn,
            "bias": self.smem_layout_bias().bytes if self.has_bias else 0,
            "zij": self.smem_layout_zij().bytes if self.apply_dropout else 0,
            "tmp_shared_storage": attn if self.tmp_own_buffer else 0,
        }
        part2 = {"mm_gradK_q": i * k * e * st, "mm_gradV_do": i * k * e * st, "tmp_shared_storage": attn}
        sizes = {
            "persistent": persistent,
            "part1": part1,
            "part2": part2,
        }
        total = sum(persistent.values()) + max(sum(part1.values()), sum(part2.values()))
        sizes["total"] = total
        return sizes

    def smem_bytes(self) -> int:
        return self.shared_storage_sizes()["total"] + 1024  # alignment slack of the struct

    def print_size(self) -> str:
        s = self.shared_storage_sizes()
        lines = [f"Total smem: {s['total']} bytes"]
        for part in ("persistent", "part1", "part2"):
            lines.append(f"  {part}: {sum(s[part].values())}b")
            lines.extend(f"    {name}: {size}b" for name, size in s[part].items())
        return "\n".join(lines)
