"""Shared-memory access descriptions (``layouts.access``): the bank model on known answers,
and every kernel tile's accesses with their figures pinned."""

import pytest

import layouts
from layouts import analysis, attention_sm90, catalogue
from layouts.access import SmemAccess, as_2d, contiguous_axis, fragment, matrix_x4, swizzle_span, tma, wgmma
from layouts.algebra import ComposedLayout, Layout, Swizzle, make_ordered_layout

ROW_MAJOR_64 = Layout((64, 64), (64, 1))
SWIZZLED_64 = ComposedLayout(Swizzle(3, 3, 3), ROW_MAJOR_64)


def smem(layout, dtype="bf16", accesses=()):
    return catalogue.SmemEntry("t.smem", "test tile", layout, dtype, tuple(accesses))


def report(access, layout, dtype="bf16"):
    return analysis.access_report(access, smem(layout, dtype))


@pytest.fixture(scope="module")
def figures():
    """name -> {access label: report} for every shared-memory entry (analysed once)."""
    out = {}
    for name in layouts.names():
        e = layouts.get(name)
        if isinstance(e, catalogue.SmemEntry):
            out[name] = {r.access: r for r in analysis.analyse(e)}
    return out


# ------------------------------------------------------------------ the access shapes


def test_matrix_lanes_follow_ldmatrix_x4():
    """Lane t of a 16x16 block addresses row t % 16, 16-byte chunk t // 16: ldmatrix's A order."""
    (instr,) = matrix_x4("ldmatrix").instructions(ROW_MAJOR_64, (16, 16), 16)
    assert instr.kind == "matrix" and len(instr.lanes) == 32
    for t, cells in enumerate(instr.lanes):
        assert cells == tuple((t % 16, 8 * (t // 16) + e) for e in range(8))


def test_matrix_lines_cross_the_contiguous_dimension():
    """A column-major tile's matrix rows are 8 consecutive columns, 16 bytes down a column."""
    col_major = Layout((64, 64), (1, 64))
    assert contiguous_axis(col_major) == 0 and contiguous_axis(ROW_MAJOR_64) == 1
    (instr,) = wgmma("wgmma", "MN-major", 16, 16).instructions(col_major, (16, 16), 16)
    assert instr.lanes[0] == tuple((e, 0) for e in range(8))
    assert instr.lanes[1] == tuple((e, 1) for e in range(8))


def test_tma_pieces_walk_one_swizzle_span_at_a_time():
    """A 96-column bf16 box under a 64-byte swizzle is moved as 32-column boxes: a phase (8
    pieces of 16 bytes) is two rows of one box, not a 192-byte row across boxes."""
    layout = ComposedLayout(Swizzle(2, 3, 3), Layout(((8, 2), (32, 3)), ((32, 256), (1, 512))))
    assert swizzle_span(layout) == 32 and swizzle_span(ROW_MAJOR_64) is None
    (instr,) = tma("TMA", 16, 96).instructions(layout, (16, 96), 16)
    first_phase = [cells[0] for cells in instr.lanes[:8]]
    assert first_phase == [(0, 0), (0, 8), (0, 16), (0, 24), (1, 0), (1, 8), (1, 16), (1, 24)]
    assert report(tma("TMA", 16, 96), layout).conflict_free


def test_ring_of_rank_4_is_rows_by_the_rest():
    ring = make_ordered_layout((2, 512, 2, 3), (1, 0, 2, 3))
    view = as_2d(ring)
    assert view.shape == (2, (512, 2, 3)) and smem(ring).tile == (2, 3072)
    assert all(view((m, n)) == ring((m, n % 512, (n // 512) % 2, n // 1024)) for m in range(2) for n in range(3072))


def test_access_needs_its_own_form():
    with pytest.raises(ValueError, match="vector access takes a TV layout"):
        SmemAccess("bad", "vector", block=(16, 16))
    with pytest.raises(ValueError, match="does not tile"):
        wgmma("wgmma", "K-major", 48, 16).instructions(ROW_MAJOR_64, (64, 64), 16)


# ---------------------------------------------------------------- known answers


def test_unswizzled_64_wide_bf16_conflicts_swizzled_does_not():
    """ldmatrix columns and wgmma core matrices of a 128-byte-row tile: 8 rows on the same 4
    banks (8-way) unless the 128B swizzle spreads them over all 32."""
    for access in (matrix_x4("ldmatrix"), wgmma("wgmma", "K-major", 64, 16)):
        plain, swz = report(access, ROW_MAJOR_64), report(access, SWIZZLED_64)
        assert plain.max_degree == 8 and plain.wavefronts == 8 * plain.ideal
        assert swz.conflict_free and swz.max_degree == 1
        assert sorted({swz.cell_bank[c] for c in swz.first_phase}) == list(range(32))
    assert report(tma("TMA", 64, 64), ROW_MAJOR_64).conflict_free  # rows are whole 128-byte lines either way
    assert report(tma("TMA", 64, 64), SWIZZLED_64).conflict_free


def test_64_bit_pairs_are_served_by_half_warps():
    """fp32 accumulator pairs (8 bytes a lane) into a 128B-swizzled fp32 tile: a half-warp is
    4 rows x 32 bytes, and rows r and r ^ 1 swap the same two 16-byte chunks: 2-way. The
    same fragment stored transposed, one fp32 a lane (4 rows x 8 columns), is conflict-free."""
    fp32 = ComposedLayout(Swizzle(3, 2, 3), Layout((64, 32), (32, 1)))
    pairs = report(fragment("pairs", 64, 32), fp32, "fp32")
    assert pairs.phases_per_instruction == 2 and pairs.width_bytes == 8
    assert pairs.max_degree == 2 and pairs.wavefronts == 2 * pairs.ideal
    single = report(fragment("values", 32, 32, transpose=True), fp32, "fp32")
    assert single.phases_per_instruction == 1 and single.conflict_free


def test_report_names_its_access_and_swizzle():
    r = report(wgmma("wgmma A read of K", "K-major", 64, 16), SWIZZLED_64)
    assert r.summary().startswith(
        "wgmma A read of K (K-major, 64x16 a wgmma, 128B swizzle): 4 instructions x 16 phases"
    )
    assert report(matrix_x4("ldmatrix"), ROW_MAJOR_64).summary().startswith("ldmatrix (no swizzle):")


# ------------------------------------------------------------- the kernels' tiles


def test_every_kernel_has_entries():
    kernels = {n.split(".")[0] for n in layouts.names()}
    assert {
        "layer_norm_fwd",
        "layer_norm_bwd",
        "layer_norm_bwd_finalize",
        "attention_bwd_prepost",
        "attention_bwd_sm90",
        "mem_eff_attention_bwd",
        "dropout_bias_bwd",
    } <= kernels
    assert len(layouts.names()) >= 145


def test_every_smem_tile_has_its_accesses(figures):
    for name, reps in figures.items():
        assert reps, name
        for label, r in reps.items():
            assert r.summary().startswith(r.name) and ("swizzle" in r.name or " on " in r.name), (name, label)
    silent = [n for n in layouts.names() if not analysis.analyse(layouts.get(n))]
    for name in silent:  # only register fragments and the plain reference layout touch no memory
        assert isinstance(layouts.get(name), (catalogue.MmaEntry, catalogue.LayoutEntry)), name
        assert "no shared-memory access" in analysis.no_access_reason(layouts.get(name)) or name.startswith("reference")


def test_sm90_tiles_are_conflict_free_but_two(figures):
    """Every TMA, wgmma and stmatrix access of the sm90 tiles is conflict-free under the
    model. Two vector accesses are not: the 64-bit dQ accumulator stores into the fp32
    staging tile (2-way: ``test_64_bit_pairs_are_served_by_half_warps``; d128's transposed
    32-bit stores are free), and, with a bias or dropout at d64, the 128-bit reads of the
    staged dK / dV: a 64-column row is two 64-byte-swizzle atoms 8 KiB apart, on the same banks."""
    sm90 = {n: reps for n, reps in figures.items() if n.startswith("attention_bwd_sm90.")}
    assert len(sm90) == 4 * 8
    conflicted = {
        (n.split(".")[3], n.split(".")[4], label): r.max_degree
        for n, reps in sm90.items()
        for label, r in reps.items()
        if not r.conflict_free
    }
    pairs = {
        (c, "smem_dq", "dQ accumulator store (value pairs)"): 2
        for c in ("d64", "d96", "d192", "d256", "d64_bias_or_dropout", "d128_bias_or_dropout", "d64_grad_bias")
    }
    rows = {
        (c, "smem_k", "128-bit read of staged dK / dV (to global)"): 2 for c in ("d64_bias_or_dropout", "d64_grad_bias")
    }
    assert conflicted == {**pairs, **rows}
    k128 = figures["attention_bwd_sm90.sm90.bf16.d128.smem_k"]
    assert "wgmma A read of K by dQ^T = K^T dS^T" in k128 and "128-bit read of staged dK / dV (to global)" in k128
    assert "TMA store of staged dK / dV" in figures["attention_bwd_sm90.sm90.bf16.d96.smem_k"]
    assert "stmatrix write of P^T and dS^T" in figures["attention_bwd_sm90.sm90.bf16.d256.smem_ds"]
    assert "dQ^T accumulator store" in figures["attention_bwd_sm90.sm90.bf16.d128.smem_dq"]
    assert "TMA store of dB (bias gradient)" in figures["attention_bwd_sm90.sm90.bf16.d64_grad_bias.smem_ds"]


def test_other_kernels_figures(figures):
    conflicted = {
        (n, label): r.max_degree
        for n, reps in figures.items()
        for label, r in reps.items()
        if not r.conflict_free and not n.startswith(("reference", "attention_bwd_sm90"))
    }
    fp32 = "mem_eff_attention_bwd.sm90.fp32.k64"
    assert conflicted == {
        # Zij: a row's 4 drawing threads 32 bytes apart, rows 144 bytes apart
        ("mem_eff_attention_bwd.sm90.bf16.k64.smem_zij", "keep-flag write, four flags a store"): 4,
        # fp32 SIMT: 16 lanes read 16 rows of a plain 256-byte-row tile at one column
        (f"{fp32}.smem_k", "SIMT A read of K_j / V_j by QK / DOIVJ"): 16,
        (f"{fp32}.smem_q", "SIMT B read of Q_i / dO_i by QK / DOIVJ"): 2,
        (f"{fp32}.smem_attn", "SIMT A read of attn_T / tmp_T by GradV / GradK"): 16,
        (f"{fp32}.smem_attn", "attn_T / tmp_T store from the SIMT accumulator"): 16,
    }
