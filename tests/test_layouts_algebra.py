"""The pure-Python layout algebra: known answers, properties, and agreement with the DSL."""

import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest  # noqa: E402
from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import layouts  # noqa: E402
from layouts import catalogue  # noqa: E402
from layouts.algebra import (  # noqa: E402
    ComposedLayout,
    Layout,
    Swizzle,
    TVLayout,
    coalesce,
    complement,
    composition,
    concat,
    idx2crd,
    left_inverse,
    make_layout,
    make_ordered_layout,
    make_tiled_copy_tv,
    parse_layout,
    ptx_mma_m16n8k16_a,
    ptx_mma_m16n8k16_b,
    ptx_mma_m16n8k16_c,
    raked_product,
    right_inverse,
    sm75_ldmatrix_x4,
    sm80_mma_16x8x16,
    tiled_copy_tv_direct,
)

# ------------------------------------------------------------------ known answers


def test_rowmajor_8x8():
    L = layouts.get("reference.rowmajor_8x8").layout
    assert str(L) == "(8,8):(8,1)"
    assert [[L((i, j)) for j in range(8)] for i in range(8)] == [[8 * i + j for j in range(8)] for i in range(8)]
    # a linear index is split colexicographically: the row (first mode) varies fastest
    assert [L(i) for i in range(4)] == [0, 8, 16, 24]
    assert L(8) == 1 and L(63) == 63
    assert L.size() == 64 and L.cosize() == 64


def test_colexicographic_coordinates():
    assert idx2crd(5, (2, 3)) == (1, 2)
    assert idx2crd(13, ((2, 2), 4)) == ((1, 0), 3)
    L = Layout(((2, 2), 4), ((1, 8), 2))
    assert L(13) == L(((1, 0), 3)) == 1 + 6


def test_ordered_layout():
    assert str(make_ordered_layout((16, 32), (1, 0))) == "(16,32):(32,1)"
    assert str(make_ordered_layout((16, 32), (0, 1))) == "(16,32):(1,16)"
    assert str(make_ordered_layout((2, 3, 4), (2, 0, 1))) == "(2,3,4):(12,1,3)"


def test_coalesce_composition_inverse_examples():
    # the DSL's answers for these (recorded from cute.compile traces, see test_matches_dsl)
    assert str(coalesce(Layout(((2, 4), 8), ((32, 8), 1)))) == "(2,4,8):(32,8,1)"
    assert str(coalesce(Layout((2, 4), (1, 2)))) == "8:1"
    assert str(composition(Layout((8, 8), (8, 1)), make_layout((4, 2)))) == "(4,2):(8,32)"
    assert str(right_inverse(Layout((4, 8), (8, 1)))) == "(8,4):(4,1)"
    assert str(left_inverse(Layout((4, 8), (8, 1)))) == "(8,4):(4,1)"
    assert str(complement(Layout((4, 2), (1, 8)), 64)) == "(2,4):(4,16)"
    assert str(raked_product(Layout((4, 2), (2, 1)), make_layout((2, 3)))) == "((2,4),(3,2)):((8,2),(16,1))"


def test_swizzle_definition():
    s = Swizzle(3, 3, 3)
    assert s.yyy_mask == 0b111000000 and s.zzz_mask == 0b111000
    assert s(64) == 72 and s(72) == 64 and s(7) == 7
    for x in range(1 << 12):
        assert s(x) == x ^ ((x >> 3) & 0b111000)
        assert s(s(x)) == x  # an involution, so a bijection
    assert sorted(Swizzle(2, 4, 3)(x) for x in range(512)) == list(range(512))
    with pytest.raises(ValueError):
        Swizzle(3, 3, 2)  # source and target bits would overlap


def test_swizzled_fp16_tile_permutes_16_byte_chunks_within_rows():
    L = ComposedLayout(Swizzle(3, 3, 3), Layout((64, 64), (64, 1)))
    for r in range(64):
        for c in range(64):
            off = L((r, c))
            assert off // 64 == r  # stays in its row
            assert (off % 64) // 8 == (c // 8) ^ (r % 8)  # chunk XOR row mod 8
            assert off % 8 == c % 8  # 8 fp16 = 16 bytes stay contiguous
    assert L.cosize() == 64 * 64


def test_parse_round_trip():
    for text in ["(16,32):(32,1)", "((32,16),8):((128,1),16)", "8:1", "S<3,3,3> o 0 o (8,64):(64,1)"]:
        assert str(parse_layout(text)) == text


# ------------------------------------------------------------------- properties

pow2 = st.sampled_from([1, 2, 4, 8])


@st.composite
def packed_layouts(draw, max_rank=4):
    """A packed (bijective) layout of power-of-two modes in a random order."""
    shape = tuple(draw(st.lists(pow2, min_size=1, max_size=max_rank)))
    order = draw(st.permutations(range(len(shape))))
    return make_ordered_layout(shape, order)


@st.composite
def strided_layouts(draw, max_rank=3):
    shape = tuple(draw(st.lists(pow2, min_size=1, max_size=max_rank)))
    stride = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 4, 8, 16]), min_size=len(shape), max_size=len(shape))))
    return Layout(shape, stride)


@settings(max_examples=200, deadline=None)
@given(strided_layouts())
def test_coalesce_keeps_the_function(L):
    C = coalesce(L)
    assert C.size() == L.size()
    assert [C(i) for i in range(L.size())] == [L(i) for i in range(L.size())]


@st.composite
def disjoint_layouts(draw, max_rank=3):
    """Injective layouts whose modes, sorted by stride, do not interleave (plus broadcast
    modes): the ones CuTe's composition is defined for, mode by mode."""
    shape = draw(st.lists(pow2, min_size=1, max_size=max_rank))
    order = draw(st.permutations(range(len(shape))))
    stride, cur = [0] * len(shape), 1
    for i in sorted(range(len(shape)), key=lambda i: order[i]):
        cur *= draw(st.sampled_from([1, 1, 2, 4]))  # a gap before this mode
        stride[i] = 0 if draw(st.integers(0, 5)) == 0 else cur
        cur *= shape[i] if stride[i] else 1
    return Layout(tuple(shape), tuple(stride))


@settings(max_examples=300, deadline=None)
@given(packed_layouts(), disjoint_layouts())
def test_composition_is_function_composition(A, B):
    assume(B.cosize() <= A.size())  # inside A's domain (beyond it CuTe only extends the last mode)
    R = composition(A, B)
    assert R.size() == B.size()
    assert [R(i) for i in range(B.size())] == [A(B(i)) for i in range(B.size())]


@settings(max_examples=200, deadline=None)
@given(packed_layouts())
def test_inverses(L):
    R = right_inverse(L)
    assert R.size() == L.size()
    assert all(L(R(i)) == i for i in range(R.size()))
    Li = left_inverse(L)
    assert all(Li(L(i)) == i for i in range(L.size()))


@settings(max_examples=100, deadline=None)
@given(packed_layouts(max_rank=3), st.sampled_from([1, 2, 4]))
def test_complement_fills_the_codomain(L, k):
    M = L.cosize() * k
    full = concat(L, complement(L, M))
    assert sorted(full(i) for i in range(full.size())) == list(range(M))


@settings(max_examples=100, deadline=None)
@given(st.tuples(pow2, pow2), st.sampled_from([(1, 0), (0, 1)]), st.tuples(pow2, pow2))
def test_tiled_copy_tv_matches_its_definition(thr_shape, order, val_shape):
    thr, val = make_ordered_layout(thr_shape, order), make_layout(val_shape)
    tv = make_tiled_copy_tv(thr, val)
    direct = tiled_copy_tv_direct(thr, val)
    assert tv.tile == (thr_shape[0] * val_shape[0], thr_shape[1] * val_shape[1])
    assert (tv.num_threads, tv.num_values) == (thr.size(), val.size())
    coords = [tv.coord(t, v) for t in range(tv.num_threads) for v in range(tv.num_values)]
    assert coords == [direct(t, v) for t in range(tv.num_threads) for v in range(tv.num_values)]
    assert len(set(coords)) == tv.tile[0] * tv.tile[1]  # every element exactly once


# -------------------------------------------------------------- TV known answers


def test_dropout_gmem_copy_tv():
    tv = layouts.get("dropout_bias_bwd.sm90.bf16.gmem_dy").tv()
    assert str(tv.layout) == "((32,16),8):((128,1),16)"  # what the DSL prints for layout_tv_tiled
    assert tv.tile == (16, 256)
    assert tv.thread_coords(0) == [(0, v) for v in range(8)]
    assert tv.thread_coords(1) == [(0, 8 + v) for v in range(8)]
    assert tv.thread_coords(32) == [(1, v) for v in range(8)]  # warp 1 takes row 1


def test_mma_c_partition():
    c = layouts.get("reference.sm80.mma_16x8x16.f16").atom.c
    assert c.tile == (16, 8) and (c.num_threads, c.num_values) == (32, 4)
    assert c.thread_coords(0) == [(0, 0), (0, 1), (8, 0), (8, 1)]
    for t in range(32):
        r, k = t // 4, 2 * (t % 4)
        assert c.thread_coords(t) == [(r, k), (r, k + 1), (r + 8, k), (r + 8, k + 1)]


def test_mma_fragments_follow_the_ptx_isa():
    atom = sm80_mma_16x8x16()
    for lane in range(32):
        assert atom.a.thread_coords(lane) == [ptx_mma_m16n8k16_a(lane, i) for i in range(8)]
        # B is held as N x K (CuTe's convention); the PTX ISA writes (k, n)
        assert atom.b.thread_coords(lane) == [ptx_mma_m16n8k16_b(lane, i)[::-1] for i in range(4)]
        assert atom.c.thread_coords(lane) == [ptx_mma_m16n8k16_c(lane, i) for i in range(4)]
    assert atom.a.thread_coords(5) == [(1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)]
    for frag in (atom.a, atom.b, atom.c):
        cells = {frag.coord(t, v) for t in range(32) for v in range(frag.num_values)}
        assert len(cells) == frag.tile[0] * frag.tile[1] == 32 * frag.num_values


def test_ldmatrix_x4():
    ld = sm75_ldmatrix_x4()
    for lane in range(32):
        assert ld.src.thread_coords(lane) == [(lane % 16, 8 * (lane // 16) + v) for v in range(8)]
    # lanes 8j..8j+7 address the rows of matrix j; the quadrants in A's register order
    quadrant = [(0, 0), (8, 0), (0, 8), (8, 8)]
    for j, (r0, c0) in enumerate(quadrant):
        rows = [ld.src.coord(lane, 0) for lane in range(8 * j, 8 * j + 8)]
        assert rows == [(r0 + r, c0) for r in range(8)]
    # register j of lane t = row t // 4, columns 2 (t % 4) + {0, 1} of matrix j
    for t in range(32):
        for j, (r0, c0) in enumerate(quadrant):
            for e in range(2):
                assert ld.dst.coord(t, 2 * j + e) == (r0 + t // 4, c0 + 2 * (t % 4) + e)
    assert ld.dst.same_function(sm80_mma_16x8x16().a)


def test_tv_same_function_and_owners():
    a = TVLayout(Layout((4, 2), (2, 1)), (8, 1))
    assert a.same_function(TVLayout(Layout(((2, 2), 2), ((2, 4), 1)), (8, 1)))
    assert not a.same_function(TVLayout(Layout((4, 2), (1, 4)), (8, 1)))
    owners = a.owners()
    assert owners[3][0] == [(1, 1)]


def test_kernel_spec_and_catalogue_share_the_layout():
    from cute_kernels.dropout_bias import config as dropout_bias_config

    t = dropout_bias_config.tiles(16, 8, "sm_90a")
    assert layouts.get("dropout_bias_bwd.sm90.bf16.gmem_dy").spec == t.gmem_load()
    assert layouts.get("dropout_bias_bwd.sm80.fp32.gmem_mask").spec == dropout_bias_config.tiles(32, 4).gmem_load_mask()
    with pytest.raises(KeyError, match="did you mean"):
        layouts.get("dropout_bias_bwd.sm90.bf16.gmem_dyy")


# ---------------------------------------------------------- agreement with the DSL

_RECORDED = {}


def _record_dsl():
    """Plain Python run at trace time: build DSL layouts, keep their printed forms."""
    import cutlass.cute as cute

    rec = _RECORDED
    rec["ordered"] = str(cute.make_ordered_layout((16, 32), order=(1, 0)))
    rec["ordered3"] = str(cute.make_ordered_layout((2, 3, 4), order=(2, 0, 1)))
    rec["coalesce"] = str(cute.coalesce(cute.make_layout(((2, 4), 8), stride=((32, 8), 1))))
    rec["composition"] = str(
        cute.composition(cute.make_layout((8, 8), stride=(8, 1)), cute.make_layout((4, 2), stride=(2, 16)))
    )
    rec["right_inverse"] = str(cute.right_inverse(cute.make_layout((4, (2, 8)), stride=(2, (1, 8)))))
    rec["left_inverse"] = str(cute.left_inverse(cute.make_layout((4, 8), stride=(8, 1))))
    rec["complement"] = str(cute.complement(cute.make_layout((4, 2), stride=(1, 8)), 64))
    rec["raked"] = str(cute.raked_product(cute.make_layout((4, 2), stride=(2, 1)), cute.make_layout((2, 3))))
    for name in layouts.names():
        e = layouts.get(name)
        obj = e.build()
        if e.kind == "copy":
            rec[name] = str(obj.layout_tv_tiled)
            rec[name + "#src"] = str(obj.layout_src_tv_tiled)
        elif e.kind == "ldmatrix":
            rec[name + "#src"] = str(obj.layout_src_tv_tiled)
            rec[name + "#dst"] = str(obj.layout_dst_tv_tiled)
        elif e.kind == "mma":
            for frag in "ABC":
                rec[f"{name}#{frag}"] = str(getattr(obj, f"tv_layout_{frag}"))
            if e.tiled:
                rec[f"{name}#C_tiled"] = str(obj.tv_layout_C_tiled)
        else:
            rec[name] = str(obj)
    import cutlass

    from cute_kernels.attention_sm90 import backward_config as sm90_config

    for d in sm90_config.HEAD_DIMS:  # the kernel's own dK / dV row copy, against its catalogue entry
        t = sm90_config.attention_sm90_tiles(d)
        if t.dkv_vector_store:
            rec[f"s2g_copy_dkv.d{d}"] = str(t.s2g_copy_dkv(cutlass.BFloat16, d).layout_tv_tiled)
    for thr_shape, order, val_shape in [((4, 8), (0, 1), (2, 2)), ((8, 4), (1, 0), (4, 1)), ((2, 16), (0, 1), (1, 4))]:
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass_dtype(), num_bits_per_copy=16)
        tc = cute.make_tiled_copy_tv(
            atom, cute.make_ordered_layout(thr_shape, order=order), cute.make_layout(val_shape)
        )
        rec[("tv", thr_shape, order, val_shape)] = str(tc.layout_tv_tiled)


def cutlass_dtype():
    import cutlass

    return cutlass.Float16


@pytest.fixture(scope="module")
def dsl():
    cute = pytest.importorskip("cutlass.cute")

    @cute.jit
    def trace():
        _record_dsl()

    cute.compile(trace)
    return dict(_RECORDED)


def _same(a, b, domain):
    return all(a(i) == b(i) for i in range(domain))


@pytest.mark.compile
def test_matches_dsl_algebra(dsl):
    assert dsl["ordered"] == str(make_ordered_layout((16, 32), (1, 0)))
    assert dsl["ordered3"] == str(make_ordered_layout((2, 3, 4), (2, 0, 1)))
    assert dsl["coalesce"] == str(coalesce(Layout(((2, 4), 8), ((32, 8), 1))))
    ours = composition(Layout((8, 8), (8, 1)), Layout((4, 2), (2, 16)))
    theirs = parse_layout(dsl["composition"])
    assert theirs.size() == ours.size() and _same(ours, theirs, 8)
    ri = right_inverse(Layout((4, (2, 8)), (2, (1, 8))))
    assert _same(ri, parse_layout(dsl["right_inverse"]), 64) and parse_layout(dsl["right_inverse"]).size() == 64
    assert dsl["left_inverse"] == str(left_inverse(Layout((4, 8), (8, 1))))
    assert dsl["complement"] == str(complement(Layout((4, 2), (1, 8)), 64))
    assert dsl["raked"] == str(raked_product(Layout((4, 2), (2, 1)), make_layout((2, 3))))
    for key, text in dsl.items():
        if isinstance(key, tuple):
            _, thr_shape, order, val_shape = key
            tv = make_tiled_copy_tv(make_ordered_layout(thr_shape, order), make_layout(val_shape))
            theirs = parse_layout(text)
            assert theirs.size() == tv.layout.size(), key
            assert _same(tv.layout, theirs, tv.layout.size()), (key, text, str(tv.layout))


def _tv_matches(ours: TVLayout, text: str) -> bool:
    theirs = parse_layout(text)
    T, V = ours.num_threads, ours.num_values
    if theirs[0].size() != T or theirs[1].size() != V:
        return False
    return all(ours.layout((t, v)) == theirs((t, v)) for t in range(T) for v in range(V))


@pytest.mark.compile
def test_catalogue_matches_dsl(dsl):
    checked = 0
    for name in layouts.names():
        e = layouts.get(name)
        if e.kind == "copy":
            assert _tv_matches(e.tv(), dsl[name]), (name, dsl[name], str(e.tv().layout))
            assert _tv_matches(e.tv(), dsl[name + "#src"]), (name, dsl[name + "#src"])
        elif e.kind == "ldmatrix":
            assert _tv_matches(e.src_tv(), dsl[name + "#src"]), (name, dsl[name + "#src"])
            assert _tv_matches(e.dst_tv(), dsl[name + "#dst"]), (name, dsl[name + "#dst"])
        elif e.kind == "mma":
            for frag, tv in zip("ABC", (e.atom.a, e.atom.b, e.atom.c)):
                assert str(tv.layout) == dsl[f"{name}#{frag}"]
            if e.tiled:
                assert _tv_matches(e.tiled_c(), dsl[f"{name}#C_tiled"]), (name, dsl[f"{name}#C_tiled"])
        else:
            theirs = parse_layout(dsl[name])
            if not (isinstance(theirs, ComposedLayout) and theirs.swizzle.bits == 0):  # the DSL renames a no-op one
                assert str(theirs) == str(e.layout)
            assert theirs.values() == e.layout.values()
        checked += 1
    assert checked == len(layouts.names()) >= 20
    for d in (64, 128):
        entry = layouts.get(f"attention_bwd_sm90.sm90.bf16.d{d}.gmem_dkv")
        assert _tv_matches(entry.tv(), dsl[f"s2g_copy_dkv.d{d}"]), d
    assert isinstance(catalogue.get("reference.smem.fp16_64x64.swizzle333").layout, ComposedLayout)
