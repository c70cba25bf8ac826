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
    bad, _ = draw.panels(layouts.get(UNSWIZZLED))
    good, figures = draw.panels(layouts.get(SWIZZLED))
    assert len(bad) == len(good) == 3  # bank map + one panel per analysed access
    assert len(bad[1].crossed) == 64 * 64 and not good[1].crossed
    assert sorted(good[1].dim_except) == sorted(report(LDMATRIX, SWIZZLED).first_phase)
    assert any("conflict-free" in f for f in figures)
    # the bank map is coloured by bank: cells in the same bank share a colour
    p = good[0]
    assert p.labels[0][0] == "0" and p.labels[0][2] == "1" and p.labels[1][0] == "4"
    assert (p.rgb[0, 0] == p.rgb[1, 9]).all()  # row 1, chunk 1 ^ 1 = 0: bank 0 again


def test_big_grids_drop_text_keep_colours():
    import matplotlib.pyplot as plt

    small = catalogue.LayoutEntry("t.8", "8x8", Layout((8, 8), (8, 1)))
    big = catalogue.LayoutEntry("t.128", "128x128", Layout((128, 128), (128, 1)))
    for entry, texts in ((small, 64), (big, 0)):
        fig = draw.render(entry)
        try:
            ax = fig.axes[0]
            assert len(ax.texts) == texts
            assert len(ax.images) == 1
        finally:
            plt.close(fig)
    # a bank map's labels are 1-2 characters, big enough in a 128x128 grid's 5-point cells by font size alone:
    # dropped by the cell count (MAX_LABELS), or the gallery spends minutes drawing 16k unreadable labels
    bank_map = catalogue.SmemEntry("t.smem128", "128x128 bf16", Layout((128, 128), (128, 1)), "bf16")
    fig = draw.render(bank_map)
    try:
        assert len(fig.axes[0].texts) == 0 and len(fig.axes[0].images) == 1
    finally:
        plt.close(fig)
    w, h = draw.figure_pixels(big)
    assert 600 <= w <= 2000 and 600 <= h <= 2000
    w, h = draw.figure_pixels(small)
    assert 400 <= w <= 1200 and 300 <= h <= 1200
