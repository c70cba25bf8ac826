"""The sm90 attention backward's shared-memory tiles on a CPU: their layouts in
``layouts.algebra`` form and every access the kernel makes to them (``layouts.access``).

Per tile (``AttentionSm90Layouts`` flags decide which apply):

* Q / dO stage (tile_m x d, row-major): TMA load; wgmma B of S^T / dP^T (K-major: N the
  queries, K a 16-column slice of d); wgmma B of dK / dV (the MN-major view: N the head
  dim a warpgroup computes, K 16 queries).
* K / V (tile_n x d): TMA load; wgmma A of S^T / dP^T (K-major, 64 keys a warpgroup); wgmma
  B of dQ = dS K (MN-major, a warpgroup's dQ columns) or A of dQ^T = K^T dS^T (``dq_swapab``);
  with ``dkv_tma_store`` dK / dV staged there by stmatrix, then read back by every consumer
  thread's 16-byte loads (``dkv_vector_store``) or a TMA store.
* dS (tile_m x tile_n, queries contiguous): stmatrix of dS^T (and P^T in the wide kernel);
  wgmma A of dQ (MN-major) or B of dQ^T; wide: also A of dK / dV (K-major).
* dQ staging (fp32, tile_m x d): the accumulator's 64-bit pairs (32-bit values transposed
  with ``dq_swapab``), then the TMA reduce-add reads it.
"""

from __future__ import annotations

from .access import copy, fragment, matrix_x4, tma, wgmma
from .algebra import ComposedLayout, Layout, Swizzle
from .attention_sm90 import (
    DKV_VECTOR_BITS,
    GRAD_BIAS_BOX_KEYS,
    NUM_CONSUMER_WG,
    AttentionSm90Layouts,
    AttentionSm90WideLayouts,
    atom_cols,
)
from .spec import TiledCopySpec


def smem_layouts_algebra(t: AttentionSm90Layouts) -> dict:
    """The shared-memory tiles (one stage) in ``layouts.algebra`` form, for the catalogue and
    its pictures: element offsets, swizzles in element units. The kernel's DSL layouts
    (``AttentionSm90Layouts.smem_layout_*``) swizzle byte addresses: S<B,4,3> on bytes (B = 3,
    2, 1 for 128-, 64-, 32-byte atom rows) is S<B,3,3> on 16-bit elements and S<B,2,3> on
    fp32 (tests/test_attention_sm90_tiles_cpu.py
    compares them). With Dqk != Dv, dO and V have their own entries (smem_do, smem_v)."""
    tm, tn = t.tile_m, t.tile_n

    def swizzle(w, bits):  # atom rows of w elements: 16-byte chunks XORed with the row mod 2^B
        return Swizzle((w * bits // 128).bit_length() - 1, (128 // bits).bit_length() - 1, 3)

    def rows(r, w, bits, d=t.head_dim, cols_first=False):  # K-major atoms (8 rows x w elements), rows first
        if cols_first:
            return ComposedLayout(swizzle(w, bits), Layout(((8, r // 8), (w, d // w)), ((w, 8 * d), (1, 8 * w))))
        return ComposedLayout(swizzle(w, bits), Layout(((8, r // 8), (w, d // w)), ((w, 8 * w), (1, r * w))))

    wds = atom_cols(tm, 16)  # MN-major dS: queries contiguous
    ds = ComposedLayout(swizzle(wds, 16), Layout(((wds, tm // wds), (8, tn // 8)), ((1, tn * wds), (wds, 8 * wds))))
    if t.ds_keys_contiguous:  # the bias gradient's: rows of GRAD_BIAS_BOX_KEYS keys, atoms rows first
        ds = rows(tm, GRAD_BIAS_BOX_KEYS, 16, d=tn)
    if t.head_dim_v == t.head_dim:
        q_what, k_what = (
            "Q / dO stage: S^T / dP^T B (K-major), dK / dV B (MN-major view)",
            "K / V: S^T / dP^T A (K-major), dQ B (MN-major view)",
        )
    else:
        q_what, k_what = "Q stage: S^T B (K-major), dK B (MN-major view)", "K: S^T A (K-major), dQ B (MN-major view)"
    ds_what = "dS stage, queries contiguous: dQ A (MN-major)"
    if t.ds_keys_contiguous:
        ds_what = "dS stage, keys contiguous: dQ A (K-major), the bias gradient's TMA boxes"
    if isinstance(t, AttentionSm90WideLayouts):
        ds_what = "P^T / dS^T stage, queries contiguous: dV / dK A (K-major), dQ A (MN-major)"
    forms = {
        "smem_q": (rows(tm, atom_cols(t.q_slice_cols, 16), 16), "bf16", q_what),
        "smem_k": (rows(tn, atom_cols(t.k_slice_cols, 16), 16), "bf16", k_what),
        "smem_ds": (ds, "bf16", ds_what),
        "smem_dq": (
            rows(tm, atom_cols(t.dq_slice_cols, 32), 32, cols_first=t.dq_order == (1, 0)),
            "fp32",
            "dQ staging (fp32) for the TMA reduce-add",
        ),
    }
    if t.head_dim_v != t.head_dim:
        dv = t.head_dim_v
        forms["smem_do"] = (
            rows(tm, atom_cols(t.do_slice_cols, 16), 16, dv),
            "bf16",
            "dO stage: dP^T B (K-major), dV B (MN-major view)",
        )
        forms["smem_v"] = (rows(tn, atom_cols(t.v_slice_cols, 16), 16, dv), "bf16", "V: dP^T A (K-major)")
    return forms


def _wide(t: AttentionSm90Layouts) -> bool:
    return isinstance(t, AttentionSm90WideLayouts)


def _q_accesses(t: AttentionSm90Layouts) -> tuple:
    d = t.head_dim
    wg_queries = t.tile_m // NUM_CONSUMER_WG if _wide(t) else t.tile_m  # S^T's N a warpgroup
    dkv_n = d // NUM_CONSUMER_WG if _wide(t) else d  # dK's N a warpgroup
    return (
        tma("TMA load of Q / dO", t.tile_m, d),
        wgmma("wgmma B read of Q / dO by S^T / dP^T", "K-major", wg_queries, 16),
        wgmma("wgmma B read of Q / dO by dK / dV", "MN-major view", 16, dkv_n),
    )


def _k_accesses(t: AttentionSm90Layouts) -> tuple:
    d, n = t.head_dim, t.tile_n
    out = [tma("TMA load of K / V", n, d), wgmma("wgmma A read of K / V by S^T / dP^T", "K-major", 64, 16)]
    if t.dq_swapab:
        out.append(wgmma("wgmma A read of K by dQ^T = K^T dS^T", "MN-major view", 16, 64))
    else:
        out.append(wgmma("wgmma B read of K by dQ = dS K", "MN-major view", 16, t.k_slice_cols))
    if t.dkv_tma_store:
        out.append(matrix_x4("stmatrix write of dK / dV (staged)", "x4"))
        if t.dkv_vector_store:
            per_row = d * 16 // DKV_VECTOR_BITS
            spec = TiledCopySpec((t.num_mma_threads // per_row, per_row), (1, DKV_VECTOR_BITS // 16), 16)
            out.append(copy("128-bit read of staged dK / dV (to global)", spec))
        else:
            out.append(tma("TMA store of staged dK / dV", n, d))
    return tuple(out)


def _ds_accesses(t: AttentionSm90Layouts) -> tuple:
    what = "P^T and dS^T" if _wide(t) else "dS^T"
    if t.ds_keys_contiguous:  # stored transposed; dQ reads it K-major; the bias gradient leaves by TMA
        rows = t.dq_sub_tile[0]
        return (
            matrix_x4(f"stmatrix write of {what}", "x4.trans"),
            wgmma("wgmma A read of dS by dQ", "K-major", rows, 16),
            tma("TMA store of dB (bias gradient)", t.tile_m, GRAD_BIAS_BOX_KEYS),
        )
    out = [matrix_x4(f"stmatrix write of {what}", "x4")]
    if _wide(t):
        out.append(wgmma("wgmma A read of P^T / dS^T by dV / dK", "K-major", 16, 64))
    if t.dq_swapab:
        out.append(wgmma("wgmma B read of dS^T by dQ^T", "MN-major", t.tile_m, 16))
    else:
        rows = 64 if _wide(t) else t.dq_sub_tile[0]
        out.append(wgmma("wgmma A read of dS by dQ", "MN-major", rows, 16))
    return tuple(out)


def _dq_accesses(t: AttentionSm90Layouts) -> tuple:
    if t.dq_swapab:
        store = fragment("dQ^T accumulator store", 32, 32, transpose=True)
    else:
        store = fragment("dQ accumulator store (value pairs)", 64, 32)
    box = t.dq_sub_tile if t.dq_per_wg else (t.tile_m, t.head_dim)
    return (store, tma("TMA reduce-add read of dQ", *box))


def smem_accesses(t: AttentionSm90Layouts) -> dict:
    """Every access the kernel makes to each tile of ``smem_layouts_algebra`` (equal head
    dims: dO shares Q's layout and accesses, V K's)."""
    return {"smem_q": _q_accesses(t), "smem_k": _k_accesses(t), "smem_ds": _ds_accesses(t), "smem_dq": _dq_accesses(t)}
