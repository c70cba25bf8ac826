"""Bank conflicts and coalescing: known answers, hand-built accesses, overlays."""

import pytest

import layouts
from layouts import analysis, catalogue, draw
from layouts.algebra import ComposedLayout, Layout, Swizzle
from layouts.analysis import WarpInstruction, bank_conflicts, coalescing, tiled_over
from layouts.spec import TiledCopySpec

UNSWIZZLED = "reference.smem.fp16_64x64.unswizzled"
SWIZZLED = "reference.smem.fp16_64x64.swizzle333"
LDMATRIX = "reference.sm80.ldmatrix_x4"
ROWS_128B = "reference.sm80.cp_async_128b.fp16_16x64"


def report(access, smem):
    return analysis.smem_report(layouts.get(access), layouts.get(smem))


def test_ldmatrix_unswizzled_is_8_way():
    r = report(LDMATRIX, UNSWIZZLED)
    assert len(r.instructions) == 16 and r.phases_per_instruction == 4 and r.width_bytes == 16
    # each phase: 8 rows x 16 bytes at a 128-byte stride -> the same 4 banks 8 times
    assert r.max_degree == 8
    assert all(i.wavefronts == 32 and i.ideal == 4 and i.degree == 8 for i in r.instructions)
    assert not r.conflict_free
    assert len(r.conflicted) == 64 * 64  # every element is read in a conflicted phase


def test_ldmatrix_swizzle333_is_conflict_free():
    r = report(LDMATRIX, SWIZZLED)
    assert r.max_degree == 1 and r.conflict_free
    assert r.wavefronts == r.ideal == 16 * 4
    assert not r.conflicted
    # the first phase reads rows 0..7 of chunk 0; the swizzle spreads them over all 32 banks
    assert sorted({r.cell_bank[c] for c in r.first_phase}) == list(range(32))


@pytest.mark.parametrize("smem", [UNSWIZZLED, SWIZZLED])
def test_128_bit_row_reads_are_conflict_free(smem):
    r = report(ROWS_128B, smem)
    assert r.phases_per_instruction == 4  # 128-bit: 4 phases of 8 lanes
    assert r.max_degree == 1 and r.conflict_free and r.wavefronts == 4 * len(r.instructions)


def test_128_bit_column_reads():
    """8 lanes walking down a column of 16-byte chunks: 8-way unless swizzled."""
    spec = TiledCopySpec((32, 1), (1, 8), 16, thr_order=(0, 1))
    instrs = tiled_over(spec.tv_layout(), (64, 64))
    plain = bank_conflicts(instrs, Layout((64, 64), (64, 1)), 16)
    swz = bank_conflicts(instrs, ComposedLayout(Swizzle(3, 3, 3), Layout((64, 64), (64, 1))), 16)
    assert plain.max_degree == 8 and plain.wavefronts == 8 * 4 * len(instrs)
    assert swz.max_degree == 1 and swz.conflict_free


def _instr(addresses, elems_per_lane=1):
    """A warp instruction over a 1 x N strip of 32-bit words at the given element offsets."""
    lanes = tuple(tuple((0, a + k) for k in range(elems_per_lane)) for a in addresses)
    return WarpInstruction(lanes)


def test_hand_built_word_accesses():
    strip = Layout((1, 4096), (0, 1))
    same_bank = bank_conflicts([_instr([32 * i for i in range(32)])], strip, 32)
    assert same_bank.phases_per_instruction == 1 and same_bank.max_degree == 32
    assert same_bank.wavefronts == 32
    broadcast = bank_conflicts([_instr([0] * 32)], strip, 32)
    assert broadcast.max_degree == 1 and broadcast.wavefronts == 1
    linear = bank_conflicts([_instr(list(range(32)))], strip, 32)
    assert linear.conflict_free and linear.wavefronts == 1
    two_way = bank_conflicts([_instr([2 * i for i in range(32)])], strip, 32)
    assert two_way.max_degree == 2


def test_hand_built_64_bit_accesses():
    strip = Layout((1, 4096), (0, 1))
    r = bank_conflicts([_instr([2 * i for i in range(32)], 2)], strip, 32)
    assert r.width_bytes == 8 and r.phases_per_instruction == 2 and r.conflict_free and r.wavefronts == 2
    # lanes 16 words apart: each half-warp hits every bank pair twice
    r = bank_conflicts([_instr([4 * i for i in range(32)], 2)], strip, 32)
    assert r.max_degree == 2 and r.wavefronts == 4


def test_non_contiguous_vector_is_rejected():
    col_major = Layout((64, 64), (1, 64))
    with pytest.raises(ValueError, match="not contiguous"):
        bank_conflicts(tiled_over(layouts.get(ROWS_128B).tv(), (64, 64)), col_major, 16)
    with pytest.raises(ValueError, match="bit elements"):
        analysis.smem_report(layouts.get("dropout_bias_bwd.sm90.fp32.gmem_dy"), layouts.get(SWIZZLED))


@pytest.mark.parametrize("dtype,sectors,nbytes", [("bf16", 16, 512), ("fp16", 16, 512), ("fp32", 16, 512)])
@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_dropout_gmem_copy_is_coalesced(arch, dtype, sectors, nbytes):
    for what in ("gmem_dy", "gmem_dx"):
        e = layouts.get(f"dropout_bias_bwd.{arch}.{dtype}.{what}")
        (r,) = analysis.analyse(e)
        assert r.requests == 16  # 512 threads
        assert r.bytes_per_request == [nbytes] * 16
        assert r.sectors == r.ideal == [sectors] * 16
        assert r.fully_coalesced and r.efficiency == 1.0
    (m,) = analysis.analyse(layouts.get(f"dropout_bias_bwd.{arch}.{dtype}.gmem_mask"))
    vec = 128 // {"bf16": 16, "fp16": 16, "fp32": 32}[dtype]
    assert m.bytes_per_request == [32 * vec] * 16 and m.sectors == [vec] * 16 and m.fully_coalesced


def test_coalescing_in_a_wide_matrix_and_a_bad_layout():
    tv = layouts.get("dropout_bias_bwd.sm90.bf16.gmem_dy").tv()
    wide = coalescing(tv, 16, Layout((16, 256), (4096, 1)))  # a tile of a 4096-column matrix
    assert wide.sectors == [16] * 16 and wide.fully_coalesced
    # threads walking down rows: each lane's 8 bytes sit in a sector of their own
    bad = coalescing(TiledCopySpec((32, 16), (1, 4), 16, thr_order=(0, 1)).tv_layout(), 16)
    assert bad.bytes_per_request[0] == 256 and bad.sectors[0] == 32 and bad.ideal[0] == 8
    assert bad.efficiency == pytest.approx(0.25) and not bad.fully_coalesced


def test_every_entry_analyses():
    for name in layouts.names():
        e = layouts.get(name)
        for r in analysis.analyse(e):
            assert r.summary().startswith(r.access)
            if isinstance(r, analysis.Coalescing):
                assert r.fully_coalesced, name  # the kernels' global copies must stay coalesced
    assert analysis.analyse(layouts.get("reference.sm80.mma_16x8x16.f16")) == []


def test_overlay_marks_conflicts():
    """Per access, a crop of its first instruction: lane and bank in each cell, phase 0 lit,
    the cells of conflicted phases framed."""
    bad, _ = draw.panels(layouts.get(UNSWIZZLED))
    good, figures = draw.panels(layouts.get(SWIZZLED))
    n_access = len(analysis.analyse(layouts.get(SWIZZLED)))
    assert len(bad) == len(good) == 2 + 1 + n_access + 1  # overview, atom, bank legend, accesses, lane legend
    ld_bad, ld_good = bad[3], good[3]
    assert ld_bad.title.startswith(f"{LDMATRIX} on {UNSWIZZLED}: 8-way") and (ld_bad.rows, ld_bad.cols) == (16, 16)
    assert len(ld_bad.crossed) == 16 * 16 and not ld_good.crossed
    assert sorted(ld_good.dim_except) == sorted(report(LDMATRIX, SWIZZLED).first_phase)
    assert ld_bad.labels[0][0] == "T0\nb0" and ld_bad.labels[1][0] == "T1\nb0"  # rows 128 bytes apart: bank 0
    assert ld_good.labels[1][0] == "T1\nb4"  # row 1's chunk 0 swizzled to chunk 1
    assert any("conflict-free" in f for f in figures)
    # the whole tile's banks in colour, one swizzle atom labelled
    overview, atom = good[0], good[1]
    assert overview.labels is None and (overview.rows, overview.cols) == (64, 64)
    assert atom.labels[0][0] == "0" and atom.labels[0][2] == "1" and atom.labels[1][0] == "4"
    assert (overview.rgb[0, 0] == overview.rgb[1, 9]).all()  # row 1, chunk 1 ^ 1 = 0: bank 0 again


def test_big_grids_are_cropped_to_read():
    """A big tile is an unlabelled overview beside labelled crops (at most 16 x 64 cells, and
    as wide as a row of the figure; LABEL_CELL inches a cell or more); small ones are
    labelled whole."""
    small = catalogue.LayoutEntry("t.8", "8x8", Layout((8, 8), (8, 1)))
    (p,) = draw.panels(small)[0]
    assert p.labels[7][7] == "63"
    ps, _ = draw.panels(layouts.get("dropout_bias_bwd.sm90.bf16.gmem_dy"))
    overview, crop = ps[0], ps[1]
    assert overview.labels is None and (overview.rows, overview.cols) == (16, 256)
    assert crop.labels[0][0] == "T0\nV0" and crop.labels[1][8] == "T33\nV0"  # warp 1 takes row 1
    assert (crop.rows, crop.cols) == (8, 32) and draw.LABEL_CELL <= crop.cell <= 0.3
    for name in layouts.names():
        for p in draw.panels(layouts.get(name))[0]:
            if p.labels is not None:
                assert p.rows <= draw.ACCESS_CROP_MAX[0] and p.cols <= draw.ACCESS_CROP_MAX[1], (name, p.title)
                assert p.width <= draw.MAX_WIDTH, (name, p.title)
        w, h = draw.figure_pixels(layouts.get(name))
        assert 700 <= w <= 100 * draw.MAX_WIDTH + 100 and h <= 3500, (name, w, h)


@pytest.mark.parametrize(
    "name",
    [
        "attention_bwd_sm90.sm90.bf16.d128.smem_k",
        "dropout_bias_bwd.sm90.bf16.gmem_dy",
        "attention_bwd_prepost.sm90.bf16.d64.postprocess.mma",
        "mem_eff_attention_bwd.sm90.bf16.k64.smem_bias",
    ],
)
def test_no_text_is_clipped(name):
    """Every title and number inside the figure, no panel title over a grid."""
    import matplotlib.pyplot as plt

    fig = draw.render(layouts.get(name))
    try:
        r = fig.canvas.get_renderer()
        inside = fig.bbox.padded(0.5)
        texts = list(fig.texts) + [t for ax in fig.axes for t in ax.get_xticklabels() + ax.get_yticklabels()]
        for t in texts:
            bb = t.get_window_extent(r)
            assert inside.x0 <= bb.x0 and bb.x1 <= inside.x1 and inside.y0 <= bb.y0 and bb.y1 <= inside.y1, t
        grids = [ax.get_window_extent(r) for ax in fig.axes]
        assert not any(t.get_window_extent(r).overlaps(g) for t in fig.texts for g in grids)
    finally:
        plt.close(fig)
