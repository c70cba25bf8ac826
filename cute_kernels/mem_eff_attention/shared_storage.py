"""``SharedStorage`` of the attention backward: phase unions, as the C++'s structs.

The C++ keeps ``persistent`` fields (Δ of the query block, and the K tile when
preloading) and overlaps the per-phase fields in a union of parts. Ours keeps the key
block's K_j and V_j persistent (they serve every query block the CTA walks) and has
two phases:

    part1 (MatmulQK, MatmulGradV, MatmulDOIVJ): Q_i, dO_i, attn_T, bias (BiasLoader's
        B_ij, then the BiasGradEpilogue's dB_ij), zij (dropout keep flags)
    part2 (MatmulGradQ, MatmulGradK):           Q_i, dO_i, tmp_T (over attn_T's bytes)

Q_i and dO_i sit at the same offsets in both parts (GradK still reads Q_i), so only
attn_T / tmp_T alias: tmp_T is written after every warp has finished GradV. Where
shared memory allows (``tmp_own_buffer``), tmp_T gets bytes of its own in part1 instead.
"""

import cutlass
import cutlass.cute as cute

from .config import AttentionBackwardConfig

ALIGN = 128  # bytes; ldmatrix rows and cp.async destinations are 16-byte chunks


def _tile(dtype, spec):
    return cute.struct.Align[cute.struct.MemRange[dtype, spec.shape[0] * spec.shape[1] * spec.stages], ALIGN]


def make_shared_storage(cfg: AttentionBackwardConfig, dtype):
    """The ``@cute.struct`` for one configuration (call at trace time)."""
    i = cfg.block_size_i * cfg.stages_q
    zij_bytes = cfg.smem_layout_zij().bytes if cfg.apply_dropout else 0
    bias_elems = cfg.smem_layout_bias().bytes * 8 // cfg.elem_bits if cfg.has_bias else 0
    tmp_own_elems = cfg.block_size_j * cfg.block_size_i if cfg.tmp_own_buffer else 0

    @cute.struct
    class Persistent:
        di: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, i], ALIGN]  # (do_i * o_i).sum(-1)
        lse: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, i], ALIGN]
        flag: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 4], 16]  # "is last" (__syncthreads_or)
        mm_qk_k: _tile(dtype, cfg.smem_layout_k())  # K_j: MatmulQK A, MatmulGradQ B
        mm_doivj_v: _tile(dtype, cfg.smem_layout_v())  # V_j: MatmulDOIVJ A

    @cute.struct
    class Part1:  # Q.K, dV, dO.V
        mm_qk_q: _tile(dtype, cfg.smem_layout_q())  # Q_i: MatmulQK B
        mm_gradV_do: _tile(dtype, cfg.smem_layout_do())  # dO_i: MatmulGradV B, MatmulDOIVJ B
        attn_shared_storage: _tile(dtype, cfg.smem_layout_attn())  # attn_T = P_ijᵀ
        if cfg.has_bias:  # only then: the no-bias struct keeps its offsets
            bias: cute.struct.Align[cute.struct.MemRange[dtype, bias_elems], ALIGN]  # B_ij / dB_ij (queries x keys)
        zij: cute.struct.Align[
            cute.struct.MemRange[cutlass.Uint8, max(zij_bytes, 1)], ALIGN
        ]  # ZijSharedStorage: keep flags
        tmp_own: cute.struct.Align[cute.struct.MemRange[dtype, max(tmp_own_elems, 1)], ALIGN]  # tmp_T (tmp_own_buffer)

    @cute.struct
    class Part2:  # dQ, dK
        mm_gradK_q: _tile(dtype, cfg.smem_layout_q())  # Q_i: MatmulGradK B (same bytes as mm_qk_q)
        mm_gradV_do: _tile(dtype, cfg.smem_layout_do())
        tmp_shared_storage: _tile(dtype, cfg.smem_layout_attn())  # tmp_T = dS_ijᵀ * scale

    @cute.union
    class Parts:
        part1: Part1
        part2: Part2

    @cute.struct
    class SharedStorage:
        persistent: Persistent
        parts: Parts

    return SharedStorage


def print_size(cfg: AttentionBackwardConfig, dtype) -> str:
    """The C++'s ``SharedStorage::print_size``: bytes of the struct, its parts and fields."""
    storage = make_shared_storage(cfg, dtype)
    lines = [f"Total smem: {storage.__sizeof__()} bytes", cfg.print_size()]
    return "\n".join(lines)
