"""The kernels' catalogue entries, built from the functions the kernels call.

One ``_register_*`` per kernel family; names read ``<kernel>.<arch>.<dtype>.<config>.<what>``.
Where a layout depends on the problem (LayerNorm's row length, the head dim), a few
representative configurations are registered; ``show`` prints each one's parameters.
Shared-memory tiles carry the accesses the kernel makes to them (``layouts.access``).
"""

from __future__ import annotations

from cute_kernels.attention_sm90 import backward_config as sm90_config
from cute_kernels.mem_eff_attention import config as mem_eff_config

from . import attention_bwd_prepost as prepost
from . import attention_sm90, attention_sm90_smem, dropout_bias, layer_norm
from .access import SmemAccess, copy, fragment, matrix_x4
from .algebra import Layout, TVLayout, make_layout, make_ordered_layout, make_tiled_copy_tv, product, sm80_mma_16x8x16
from .catalogue import ARCHS, DTYPES, CopyEntry, MmaEntry, SmemEntry, register
from .spec import FragmentCopySpec, TiledCopySpec

LN_ROWS = (1024, 4096, 16384)  # one row per warp pair / per CTA / over a 2-CTA cluster
PREPOST_HEAD_DIMS = ((64, 8), (128, 8), (96, 8), (96, 1))  # (head dim, vector): 96 takes 64-byte atoms, vec 1 pads


def _sw(spec) -> str:
    return "no swizzle" if spec.swizzle is None or spec.swizzle[0] == 0 else "S<{},{},{}>".format(*spec.swizzle)


def register_all() -> None:
    _register_dropout_bias()
    _register_mem_eff_attention()
    _register_attention_sm90()
    _register_layer_norm()
    _register_prepost()


# ------------------------------------------------------------------------ dropout + bias


def _register_dropout_bias() -> None:
    from cute_kernels.dropout_bias import config as dropout_bias_config

    for arch_key, arch in ARCHS.items():
        for dtype in ("bf16", "fp16", "fp32"):
            bits = DTYPES[dtype]
            t = dropout_bias_config.tiles(bits, dropout_bias.MAX_VECTOR_BITS // bits, arch)
            base = f"dropout_bias_bwd.{arch_key}.{dtype}"
            register(
                CopyEntry(f"{base}.gmem_dy", f"dY / x global load, {t.vec} x {dtype} per thread", t.gmem_load(), dtype)
            )
            register(
                CopyEntry(
                    f"{base}.gmem_mask", f"keep-mask global load (bytes), {t.vec} per thread", t.gmem_load_mask(), "u8"
                )
            )
            register(
                CopyEntry(f"{base}.gmem_dx", f"dX global store, {t.vec} x {dtype} per thread", t.gmem_store(), dtype)
            )


# ----------------------------------------------------------- memory-efficient attention


def _mem_eff_tile_accesses(cfg, copy_name: str) -> dict:
    """What the five matmuls do to each tile: cp.async fills Q / dO and K / V; ldmatrix
    (.trans for the transposed views) feeds every MMA operand; the QK / DOIVJ accumulator
    is stored into attn_T / tmp_T as bf16 pairs."""
    store = fragment(
        "attn_T / tmp_T store from the QK / DOIVJ accumulator",
        cfg.smem_store_bits(),
        cfg.elem_bits,
        tv=cfg.mma_qk().c_tv(),
    )
    return {
        "smem_q": (
            copy_name,
            matrix_x4("ldmatrix B read of Q_i / dO_i by QK / DOIVJ", "x4"),
            matrix_x4("ldmatrix B read of Q_i^T / dO_i^T by GradK / GradV", "x4.trans"),
        ),
        "smem_k": (
            copy_name,
            matrix_x4("ldmatrix A read of K_j / V_j by QK / DOIVJ", "x4"),
            matrix_x4("ldmatrix B read of K_j^T by GradQ", "x4.trans"),
        ),
        "smem_attn": (
            store,
            matrix_x4("ldmatrix A read of attn_T / tmp_T by GradV / GradK", "x4"),
            matrix_x4("ldmatrix A read of tmp_T^T by GradQ", "x4.trans"),
        ),
    }


def _register_mem_eff_attention() -> None:
    for arch_key, arch in ARCHS.items():
        for max_k in (64, 128, 256):
            cfg = mem_eff_config.attention_backward_config(16, max_k, max_k, True, arch)
            base = f"mem_eff_attention_bwd.{arch_key}.bf16.k{max_k}"
            tiles = {
                "smem_q": (
                    cfg.smem_layout_q(),
                    "Q_i / dO_i tile (one stage): MatmulQK / DOIVJ B, GradK / GradV B (.trans)",
                ),
                "smem_k": (cfg.smem_layout_k(), "K_j / V_j tile: MatmulQK / DOIVJ A, GradQ B (.trans)"),
                "smem_attn": (
                    cfg.smem_layout_attn(),
                    "attn_T / tmp_T (keys x queries): GradV / GradK A, GradQ A (.trans)",
                ),
            }
            copy_name = f"{base}.gmem_qkv"
            register(
                CopyEntry(
                    copy_name,
                    f"cp.async of Q/K/V/dO rows into shared memory, {cfg.vec} x bf16 per thread",
                    cfg.gmem_tiled_copy(cfg.max_k),
                    "bf16",
                    "smem",
                    (f"{base}.smem_q", f"{base}.smem_k"),
                )
            )
            accesses = _mem_eff_tile_accesses(cfg, copy_name)
            for name, (spec, what) in tiles.items():
                rows, cols = spec.shape
                register(
                    SmemEntry(
                        f"{base}.{name}", f"{what}: {rows}x{cols}, {_sw(spec)}", spec.layout(), "bf16", accesses[name]
                    )
                )
            for name, mma, what in (
                ("mma_qk", cfg.mma_qk(), "MatmulQK / DOIVJ (keys x queries)"),
                ("mma_grad_kv", cfg.mma_grad_kv(), "MatmulGradV / GradK (keys x head dim)"),
                ("mma_grad_q", cfg.mma_grad_q(), "MatmulGradQ (queries x head dim)"),
            ):
                warps = "x".join(map(str, mma.atom_layout[:2]))
                register(
                    MmaEntry(
                        f"{base}.{name}",
                        f"{what}: {warps} warps of mma.m16n8k16, C over {mma.permutation[0]}x{mma.permutation[1]}",
                        sm80_mma_16x8x16(),
                        "bf16",
                        tiled=mma,
                    )
                )
    _register_mem_eff_features()
    _register_mem_eff_fp32()


def _simt_read(label: str, rows: int, cols: int, along_rows: bool, by_tm: bool) -> SmemAccess:
    """fp32 SIMT operand loads, one element a thread an instruction (``gemm_smem``'s element
    copies of the MMA partitions): the 16 x 16 threads (tm fastest) read rows ``tm + 16 i``
    (or ``tn + 16 j``) of a K-major operand at one column, or those columns of a row when
    the operand is an MN-major view (``along_rows`` False); the other thread index broadcasts."""
    lines = rows if along_rows else cols
    thr = (1, 0) if by_tm else (0, 1)  # the thread index that picks the line; the other reads the same
    if along_rows:  # index m + rows * k: line m = t + 16 i, every column k
        layout = Layout(((16, 16), (lines // 16, cols)), (thr, (16, rows)))
    else:  # line (column) n = t + 16 j of every row k
        layout = Layout(((16, 16), (lines // 16, rows)), (tuple(x * rows for x in thr), (16 * rows, 1)))
    return SmemAccess(
        label,
        "vector",
        "32-bit, a thread's elements one by one",
        tv=TVLayout(layout, (rows, cols)),
        values_per_access=1,
    )


def _register_mem_eff_fp32() -> None:
    """fp32 (SIMT FMA): plain tiles, operands read element by element through the MMA's partitions."""
    cfg = mem_eff_config.attention_backward_config(32, 64, 64, True, "sm_90a")
    base = "mem_eff_attention_bwd.sm90.fp32.k64"
    i, j, k = cfg.block_size_i, cfg.block_size_j, cfg.max_k
    copy_name = f"{base}.gmem_qkv"
    register(
        CopyEntry(
            copy_name,
            f"cp.async of Q/K/V/dO rows, {cfg.vec} x fp32 per thread",
            cfg.gmem_tiled_copy(k),
            "fp32",
            "smem",
            (f"{base}.smem_q", f"{base}.smem_k"),
        )
    )
    store = TVLayout(Layout(((16, 16), (j // 16, i // 16)), ((1, j), (16, 16 * j))), (j, i))
    tiles = {
        "smem_q": (
            cfg.smem_layout_q(),
            "Q_i / dO_i tile (one stage)",
            (
                copy_name,
                _simt_read("SIMT B read of Q_i / dO_i by QK / DOIVJ", i, k, True, False),
                _simt_read("SIMT B read of Q_i^T / dO_i^T by GradK / GradV", i, k, False, False),
            ),
        ),
        "smem_k": (
            cfg.smem_layout_k(),
            "K_j / V_j tile",
            (
                copy_name,
                _simt_read("SIMT A read of K_j / V_j by QK / DOIVJ", j, k, True, True),
                _simt_read("SIMT B read of K_j^T by GradQ", j, k, False, False),
            ),
        ),
        "smem_attn": (
            cfg.smem_layout_attn(),
            "attn_T / tmp_T (keys x queries)",
            (
                SmemAccess(
                    "attn_T / tmp_T store from the SIMT accumulator", "vector", "32-bit", tv=store, values_per_access=1
                ),
                _simt_read("SIMT A read of attn_T / tmp_T by GradV / GradK", j, i, True, True),
                _simt_read("SIMT A read of tmp_T^T by GradQ", j, i, False, True),
            ),
        ),
    }
    for name, (spec, what, accesses) in tiles.items():
        rows, cols = spec.shape
        register(
            SmemEntry(
                f"{base}.{name}",
                f"{what}: {rows}x{cols}, {_sw(spec)} (the DSL mis-addresses SIMT reads of swizzled tiles)",
                spec.layout(),
                "fp32",
                accesses,
            )
        )


def _register_mem_eff_features() -> None:
    """The bias and dropout tiles (their own configuration) and the unaligned copy."""
    cfg = mem_eff_config.attention_backward_config(
        16, 64, 64, True, "sm_90a", has_bias=True, bias_aligned=True, grad_bias=True, apply_dropout=True
    )
    base = "mem_eff_attention_bwd.sm90.bf16.k64"
    frag = cfg.mma_qk().c_tv()
    bias, zij = cfg.smem_layout_bias(), cfg.smem_layout_zij()
    register(
        CopyEntry(
            f"{base}.gmem_bias",
            "BiasLoader: B_ij rows into the bias tile, 128-bit cp.async",
            cfg.bias_tiled_copy(),
            "bf16",
            "smem",
            (f"{base}.smem_bias",),
        )
    )
    register(
        CopyEntry(
            f"{base}.gmem_grad_bias",
            "BiasGradEpilogue: the staged dB_ij to global memory, 128-bit",
            cfg.grad_bias_tiled_copy(),
            "bf16",
        )
    )
    register(
        SmemEntry(
            f"{base}.smem_bias",
            f"B_ij / dB_ij tile (queries x keys), rows padded by {cfg.tile_pad_bytes} bytes: "
            f"{bias.shape[0]}x{bias.shape[1]}",
            bias.layout(),
            "bf16",
            (
                f"{base}.gmem_bias",
                fragment("bias read at the QK fragment's (key, query)", 16, 16, transpose=True, tv=frag),
                fragment("dB_ij store from the dS fragment", 16, 16, transpose=True, tv=frag),
                copy("128-bit read of dB_ij (to global)", cfg.grad_bias_tiled_copy()),
            ),
        )
    )
    tpr, quads = cfg.zij_threads_per_row, cfg.zij_quads_per_thread
    # thread t draws 4 * quads flags of row t // tpr and stores them four at a time
    draw = make_tiled_copy_tv(make_ordered_layout((cfg.num_threads // tpr, tpr), (1, 0)), make_layout((1, 4 * quads)))
    register(
        SmemEntry(
            f"{base}.smem_zij",
            f"Zij keep flags (a byte per query x key), rows padded by {cfg.tile_pad_bytes} bytes: "
            f"{zij.shape[0]}x{zij.shape[1]}",
            zij.layout(),
            "u8",
            (
                SmemAccess("keep-flag write, four flags a store", "vector", "32-bit", tv=draw, values_per_access=4),
                fragment("keep-flag read at the QK fragment's (key, query)", 8, 8, transpose=True, tv=frag),
            ),
        )
    )
    unaligned = mem_eff_config.attention_backward_config(16, 64, 64, False, "sm_90a")
    register(
        CopyEntry(
            f"{base}.gmem_qkv_unaligned",
            "Q/K/V/dO rows whose strides do not allow 128 bits: one element a thread (synchronous)",
            unaligned.gmem_tiled_copy(64),
            "bf16",
        )
    )


# ------------------------------------------------------------- sm90 attention backward


# (name, head dim, options): with a bias or dropout d64 and d128 take 64-query tiles (other
# layouts); the bias gradient stores dS keys-contiguous
SM90_CONFIGS = tuple((f"d{d}", d, {}) for d in sm90_config.HEAD_DIMS) + (
    ("d64_bias_or_dropout", 64, dict(bias_or_dropout=True)),
    ("d128_bias_or_dropout", 128, dict(bias_or_dropout=True)),
    ("d64_grad_bias", 64, dict(bias_or_dropout=True, ds_keys_contiguous=True)),
)


def _register_attention_sm90() -> None:
    for config, d, options in SM90_CONFIGS:
        t = sm90_config.attention_sm90_tiles(d, **options)
        base = f"attention_bwd_sm90.sm90.bf16.{config}"
        accesses = attention_sm90_smem.smem_accesses(t)
        for name, (layout, dtype, what) in attention_sm90_smem.smem_layouts_algebra(t).items():
            tile = "x".join(str(product(m)) for m in layout.shape)
            register(
                SmemEntry(
                    f"{base}.{name}", f"{what}: {tile}, {layout.swizzle} (element units)", layout, dtype, accesses[name]
                )
            )
        if t.dkv_vector_store:
            per_row = d * 16 // attention_sm90.DKV_VECTOR_BITS
            spec = TiledCopySpec((t.num_mma_threads // per_row, per_row), (1, attention_sm90.DKV_VECTOR_BITS // 16), 16)
            register(
                CopyEntry(
                    f"{base}.gmem_dkv",
                    "dK / dV rows from the staged tile to global memory, 16 bytes a consumer thread (s2g_copy_dkv)",
                    spec,
                    "bf16",
                )
            )


# ------------------------------------------------------------------------- LayerNorm


def _register_layer_norm() -> None:
    from cute_kernels.layer_norm import config as ln_config

    for n in LN_ROWS:
        vec = layer_norm.widest_vec(n, 16)
        t = ln_config.ln_bwd_tiles(n, 16, 16, 16, vec, "sm_90a")
        _register_rows(f"layer_norm_bwd.sm90.bf16.n{n}", t, n, ("x", "dz"), "dx", "the cp.async ring")
    _register_ln_fwd()
    _register_ln_finalize()


def _register_ln_fwd() -> None:
    """The forward's x loads into its ring, its y stores and the ring (fp32 weight and bias)."""
    from cute_kernels.layer_norm import config as ln_config

    for n in LN_ROWS:
        t = ln_config.ln_fwd_tiles(n, 16, 64, layer_norm.widest_vec(n, 16), "sm_90a")
        _register_rows(f"layer_norm_fwd.sm90.bf16.n{n}", t, n, ("x",), "y", "the cp.async ring of x")


def _register_rows(base: str, t, n: int, loads, store: str, ring: str) -> None:
    """A row kernel's entries (bf16 rows of n): each loaded tensor's copy into the shared ring,
    the stored tensor's copy to global memory, and the ring."""
    shape = (
        f"{t.rows_per_cta} row(s) x {t.threads_per_row} threads a CTA, {t.ldgs} vectors of {t.vec} a "
        f"thread, {t.ctas_per_row} CTA(s) a row"
    )
    load = t.gmem_copy(16, load=True)
    for what in loads:
        register(
            CopyEntry(
                f"{base}.gmem_{what}",
                f"{what} rows into the shared ring by {load.op} ({shape})",
                load,
                "bf16",
                gmem_row_stride=n,
            )
        )
    register(
        CopyEntry(
            f"{base}.gmem_{store}",
            f"{store} rows to global memory ({shape})",
            t.gmem_copy(16, load=False),
            "bf16",
            gmem_row_stride=n,
        )
    )
    ring_shape, order = t.ring()
    register(
        SmemEntry(
            f"{base}.smem_ring",
            f"{ring} (rows, threads x vec, ldgs, stages) = {ring_shape}, "
            "no swizzle: each thread reads back only its own vectors",
            make_ordered_layout(ring_shape, order),
            "bf16",
            (copy(f"{load.op} write of {' / '.join(loads)}", load), copy("read back of a thread's own vectors", load)),
        )
    )


def _register_ln_finalize() -> None:
    from cute_kernels.layer_norm import config as ln_config

    f = ln_config.finalize_tiles(4096)
    base = "layer_norm_bwd_finalize.sm90.fp32"
    rows_t, cols_t = f.threads
    register(
        CopyEntry(
            f"{base}.gmem_partials",
            f"partial rows of dgamma / dbeta: {rows_t} x {cols_t} threads, {f.vec} fp32 a thread (N = 4096)",
            TiledCopySpec(f.threads, (1, f.vec), 32),
            "fp32",
            gmem_row_stride=4096,
        )
    )
    lanes = f.fold_cols_per_warp
    register(
        SmemEntry(
            f"{base}.smem_fold",
            f"where the warps' column sums meet: {f.fold_rows} x {f.tile_n} fp32 (fold_layout)",
            make_ordered_layout((f.fold_rows, f.tile_n), (1, 0)),
            "fp32",
            (
                copy(f"fold write, lanes < {lanes} of each warp", TiledCopySpec((1, lanes), (1, f.vec), 32)),
                copy("column read, one fp32 a thread", TiledCopySpec((1, min(32, f.tile_n)), (1, 1), 32)),
            ),
        )
    )


# ------------------------------------------------------- attention pre/post-processing


def _register_prepost() -> None:
    for d, vec in PREPOST_HEAD_DIMS:
        post = prepost.postprocess_tiles(16, d, vec)
        base = f"attention_bwd_prepost.sm90.bf16.d{d}" + ("" if vec == 8 else f"_vec{vec}")
        if vec == 8 and d != 96:
            _register_preprocess(base, prepost.preprocess_tiles(16, d, vec))
        _register_postprocess(base, post)
    delta = prepost.compute_delta_tiles(16, 128, 8)
    register(
        CopyEntry(
            "attention_bwd_prepost.sm90.bf16.d128.compute_delta.gmem_o_do",
            f"computeDelta (mem-eff kernel): O / dO rows, {delta.threads_per_line} threads a row",
            delta.gmem_load(),
            "bf16",
            gmem_row_stride=delta.max_k,
        )
    )


def _register_preprocess(base: str, t) -> None:
    rows, cols = t.tile
    register(
        CopyEntry(
            f"{base}.preprocess.gmem_o_do",
            f"compute_dot_do_o: O / dO tile {rows}x{cols}, {t.vec} a thread (no L1 allocation)",
            t.gmem_tiled_copy_do(load=True),
            "bf16",
        )
    )
    register(
        CopyEntry(
            f"{base}.preprocess.gmem_dq_accum",
            "compute_dot_do_o: zeros into the fp32 dQ accumulator, 128-bit",
            t.gmem_tiled_copy_dq_accum(),
            "fp32",
        )
    )


def _register_postprocess(base: str, t) -> None:
    rows, cols = t.tile
    mma = t.tiled_mma()
    out = t.gmem_tiled_copy_do()
    smem = t.smem_layout_dq()
    frag = FragmentCopySpec(mma, 32, t.accum_copy_bits())
    register(
        CopyEntry(
            f"{base}.postprocess.gmem_accum",
            f"convert_dq / convert_dkv: the fp32 accumulator read in the "
            f"MMA's fragment layout, {t.accum_copy_bits()}-bit",
            frag,
            "fp32",
            gmem_row_stride=cols,
        )
    )
    register(
        MmaEntry(
            f"{base}.postprocess.mma",
            f"TiledMmadQ / dKV: {mma.atom_layout[0]}x{mma.atom_layout[1]} "
            "warps of mma.m16n8k16 (its C layout places the accumulator)",
            sm80_mma_16x8x16(),
            "bf16",
            tiled=mma,
        )
    )
    register(
        CopyEntry(
            f"{base}.postprocess.gmem_dq",
            f"dQ / dK / dV: staged rows to global memory, {t.vec} a thread",
            out,
            "bf16",
            "gmem",
        )
    )
    register(
        CopyEntry(
            f"{base}.postprocess.gmem_dkv_accum",
            "clear_dkv_accum: zeros into the fp32 dK / dV accumulators, 128-bit",
            t.gmem_tiled_copy_dq_accum(),
            "fp32",
        )
    )
    register(
        SmemEntry(
            f"{base}.postprocess.smem_dq",
            f"SmemLayoutdQ / dKV: {rows}x{cols}, {_sw(smem)}"
            + (f", rows padded by {smem.pad} elements" if smem.pad else ""),
            smem.layout(),
            "bf16",
            (
                fragment("fragment store (SmemCopyAtomdQ)", t.smem_copy_atom_dq_bits(), 16, tv=mma.c_tv()),
                copy(f"{out.copy_bits}-bit row read (GmemTiledCopydO)", out),
            ),
        )
    )
