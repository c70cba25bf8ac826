"""CPU: the attention-backward pre/post-processing kernels compile (sm_90a and sm_80), their
tiles are consistent, the ops validate inputs before any launch, the fake
implementations give the right shapes, and the fp64 references are right."""

import dataclasses
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.suites import attn_bwd_postprocess as post_suite
from benchmarks.suites import attn_bwd_preprocess as pre_suite
from layouts import attention_bwd_prepost as tiling
from ops import attention_bwd_prepost as A
from ops.reference import (
    attention_delta_ref,
    attention_delta_torch,
    convert_dkv_ref,
    convert_dq_ref,
)
from tests.helpers import trace_custom_ops


ARCHS = ["sm_90a", "sm_80"]
PADDED_HEAD_DIMS = list(range(32, 257, 32))


# ----------------------------------------------------------------------------- compile

# A representative subset of the suites' compile_only configurations, different per
# dtype so that together they reach every padded head dim, vec 8/4/2/1 and both varlen.
COMPILE_SUBSET = {
    "Float16": [(32, 8, False), (64, 1, True), (128, 4, False), (192, 8, True), (256, 1, False)],
    "BFloat16": [
        (32, 1, True),
        (96, 8, False),
        (128, 8, True),
        (128, 2, False),
        (160, 8, False),
        (224, 8, True),
        (256, 8, True),
    ],
}


def _in_suites(dtype_name, hd, vec, varlen):
    key = (dtype_name, hd, vec, varlen)
    return key in pre_suite.configurations(), key in post_suite.configurations()


@pytest.mark.compile
@pytest.mark.parametrize("dtype_name", sorted(COMPILE_SUBSET))
@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_suite_configurations(arch, dtype_name):
    """Through the ops' compile caches, keyed exactly as the suites' compile_only keys them."""
    import cutlass

    dtype = getattr(cutlass, dtype_name)
    for hd, vec, varlen in COMPILE_SUBSET[dtype_name]:
        in_pre, in_post = _in_suites(dtype_name, hd, vec, varlen)
        assert in_pre or in_post, (dtype_name, hd, vec, varlen)
        if in_pre:
            for clear in (False, True):
                assert callable(A.compiled_preprocess(dtype, hd, vec, varlen, clear, arch))
            assert callable(A.compiled_compute_delta(dtype, hd, vec, varlen, arch))
        if in_post:
            assert callable(A.compiled_convert_dq(dtype, hd, vec, varlen, arch))
            assert callable(A.compiled_convert_dkv(dtype, hd, vec, varlen, arch))


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_fp32_inputs_and_clears(arch):
    """fp32 O/dO (preprocess, compute_delta) and clear_dkv_accum at a few head dims."""
    import cutlass

    for hd, vec, varlen in [(32, 4, False), (128, 1, True), (256, 4, True)]:
        assert callable(A.compiled_preprocess(cutlass.Float32, hd, vec, varlen, varlen, arch))
        assert callable(A.compiled_compute_delta(cutlass.Float32, hd, vec, varlen, arch))
    for hd in post_suite.clear_configurations()[::3]:
        assert callable(A.compiled_clear_dkv_accum(hd, arch))
    assert A.compiled_clear_dkv_accum(32, arch) is A.compiled_clear_dkv_accum(32, arch)  # cached


@pytest.mark.compile
def test_compiles_preprocess_with_lse_log2():
    """The sm90 path's preprocess (dQ accumulator cleared, LSE rescaled in the same launch,
    programmatic dependent launch) at the head dims it serves, both dtypes, varlen on and
    off; sm_90a only."""
    import cutlass

    arch = "sm_90a"
    with pytest.raises(ValueError, match="sm_90a"):
        A.compiled_preprocess(cutlass.BFloat16, 64, 8, False, True, "sm_80", True)

    for dtype, hd, vec, varlen in [
        (cutlass.BFloat16, 64, 8, False),
        (cutlass.Float16, 128, 8, True),
        (cutlass.BFloat16, 96, 8, True),
        (cutlass.BFloat16, 256, 8, False),
    ]:
        fn = A.compiled_preprocess(dtype, hd, vec, varlen, True, arch, True)
        assert callable(fn) and fn is not A.compiled_preprocess(dtype, hd, vec, varlen, True, arch)


@pytest.mark.compile
def test_compiles_convert_dq_ready():
    """ConvertDQReady (behind the sm90 backward: sm_90a only) at the padded head dims of the
    sm90 path, both dtypes, varlen on and off."""
    import cutlass

    with pytest.raises(ValueError, match="sm_90a"):
        A.compiled_convert_dq_ready(cutlass.BFloat16, 64, 8, False, "sm_80")
    for dtype, hd, varlen in [
        (cutlass.BFloat16, 64, False),
        (cutlass.Float16, 128, True),
        (cutlass.BFloat16, 96, True),
        (cutlass.Float16, 192, False),
        (cutlass.BFloat16, 256, True),
    ]:
        fn = A.compiled_convert_dq_ready(dtype, hd, 8, varlen, "sm_90a")
        assert callable(fn) and fn is not A.compiled_convert_dq(dtype, hd, 8, varlen, "sm_90a")


def test_compile_only_covers_configurations(monkeypatch):
    """compile_only asks each cache for every configuration once and counts them all."""
    seen = {}

    def recorder(name):
        return lambda *key: seen.setdefault(name, []).append(key)

    for name in (
        "compiled_preprocess",
        "compiled_compute_delta",
        "compiled_convert_dq",
        "compiled_convert_dkv",
        "compiled_clear_dkv_accum",
    ):
        monkeypatch.setattr(A, name, recorder(name))
    n_pre = pre_suite.compile_only("sm_80")
    n_post = post_suite.compile_only("sm_80")
    pre, post = pre_suite.configurations(), post_suite.configurations()
    assert n_pre == 3 * len(pre) == sum(len(seen[k]) for k in ("compiled_preprocess", "compiled_compute_delta"))
    assert n_post == 2 * len(post) + len(post_suite.clear_configurations())
    for name, keys in seen.items():
        assert len(set(keys)) == len(keys), f"{name}: a configuration compiled twice"
        assert all(key[-1] == "sm_80" for key in keys)
    # every padded head dim, every vector width, both dtypes and varlen on and off
    for configs in (pre, post):
        assert {c[1] for c in configs} == set(PADDED_HEAD_DIMS)
        assert {c[2] for c in configs} == {1, 2, 4, 8}
        assert {c[0] for c in configs} == {"Float16", "BFloat16"}
        assert {c[3] for c in configs} == {False, True}
    # each key is one the host can produce: vec divides the (odd) head dim it stands for
    for _, hd, vec, _ in pre + post:
        assert hd % 32 == 0 and vec in (1, 2, 4, 8)
    for d, vec in pre_suite.NARROW + post_suite.NARROW:
        assert d % vec == 0


# ------------------------------------------------------------------------------ tiles


def _pre_tiles():
    """compute_dot_do_o tiles: fp16/bf16 and fp32 O/dO, every padded head dim and vector."""
    for bits in (16, 32):
        for hd in PADDED_HEAD_DIMS:
            vec = 128 // bits
            while vec >= 1:
                yield tiling.preprocess_tiles(bits, hd, vec)
                vec //= 2


def _post_tiles():
    """convert_dq / convert_dkv / clear_dkv_accum tiles (fp16/bf16 outputs)."""
    for hd in PADDED_HEAD_DIMS:
        for vec in (8, 4, 2, 1):
            yield tiling.postprocess_tiles(16, hd, vec)


def _all_tiles():
    yield from _pre_tiles()
    yield from _post_tiles()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiles_are_the_same_on_both_archs(arch):
    for bits, vec in ((16, 8), (16, 1), (32, 4)):
        for hd in (1, 33, 64, 100, 256):
            assert tiling.preprocess_tiles(bits, hd, vec, arch) == tiling.preprocess_tiles(bits, hd, vec)
            assert tiling.postprocess_tiles(bits, hd, vec, arch) == tiling.postprocess_tiles(bits, hd, vec)


def test_tiles_pad_the_head_dim():
    for hd in (1, 32, 33, 100, 255, 256):
        for t in (tiling.preprocess_tiles(16, hd, 1), tiling.postprocess_tiles(16, hd, 1)):
            assert t.head_dim == tiling.round_up(hd, 32) and t.tile == (t.block_m, t.head_dim)


def test_threads_per_row_is_a_warp_divisor_and_rows_are_lane_groups():
    """The row sum is a shuffle-xor over threads_per_row lanes: they must be one row."""
    for t in _all_tiles():
        tpr = t.threads_per_row
        assert 32 % tpr == 0, t
        assert t.head_dim % (tpr * t.vec) == 0, t
        tv = t.gmem_tiled_copy_do().tv_layout()
        for thread in range(0, t.num_threads, tpr):
            rows = {tv.coord(thread + i, v)[0] for i in range(tpr) for v in range(tv.num_values)}
            assert len(rows) == 1, (t, thread)  # lanes thread .. thread + tpr - 1 share a row


def _assert_tiles(spec, t, bits):
    assert spec.num_threads == t.num_threads
    assert spec.elem_bits == bits and spec.copy_bits <= 128
    rows, cols = spec.tiler
    assert t.block_m % rows == 0 and t.head_dim % cols == 0, (t, spec.tiler)
    owners = spec.tv_layout().owners()
    assert all(len(o) == 1 for row in owners for o in row), "an element of the copy's tile read twice or never"


def test_copies_tile_the_tile_exactly():
    for t in _all_tiles():
        _assert_tiles(t.gmem_tiled_copy_do(), t, t.elem_bits)
    for t in _post_tiles():  # clear_dkv_accum's stores
        _assert_tiles(t.gmem_tiled_copy_dq_accum(), t, 32)
        assert t.gmem_tiled_copy_dq_accum().val_shape == (1, 4)  # 128-bit accumulator accesses


def test_preprocess_clear_copy_tiles_the_tile():
    bad = []
    for t in _pre_tiles():
        rows, cols = t.gmem_tiled_copy_dq_accum().tiler
        if t.block_m % rows or t.head_dim % cols:
            bad.append((t.elem_bits, t.head_dim, t.vec, t.block_m, (rows, cols)))
    assert not bad, bad


def test_grid_covers_rows():
    for t in _all_tiles():
        for rows in (1, 77, 128, 1000, 16384 + 128):
            n = t.ctas_along_rows(rows)
            assert n * t.block_m * t.tiles_per_cta >= rows > (n - 1) * t.block_m * t.tiles_per_cta
        gx, gy, gz = t.grid(7, 3, 5)
        assert gx * gy * gz == 7 * 3 * 5 and gy <= 65535 and gz <= 65535
        # a million-row sequence still fits the grid's y and z limits
        gx, gy, gz = t.grid(t.ctas_along_rows(1 << 20), 1, 16)
        assert gx < 2**31 and gy <= 65535 and gz <= 65535


def test_block_coords_walk_the_grid_once_backwards():
    """Every (row block, batch, head) exactly once; with ``last_first`` (the pre- and
    postprocess tiles) the first CTA takes the last batch's last head and row block, and
    batch 0 comes last (where the attention backward starts reading)."""
    nb, b, h = 7, 3, 5
    for t in _all_tiles():
        grid = t.grid(nb, b, h)
        blocks = [(x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(grid[0])]  # launch order
        coords = [t.block_coords(blk, grid, h) for blk in blocks]
        assert sorted(coords) == [(m, bb, hh) for m in range(nb) for bb in range(b) for hh in range(h)]
        assert t.last_first
        assert coords[0][1] == b - 1 and coords[-1][1] == 0
        forwards = dataclasses.replace(t, last_first=False)
        assert [forwards.block_coords(blk, grid, h) for blk in blocks][::-1] == coords


def test_tiled_mma_covers_the_tile():
    for t in _post_tiles():
        mma = t.tiled_mma()
        assert mma.num_threads == t.num_threads
        m, n, k = mma.permutation
        assert (m, n, k) == (16 * mma.atom_layout[0], 16 * mma.atom_layout[1], 16)
        assert t.block_m % m == 0 and t.head_dim % n == 0, (t, mma)


def test_smem_layout_bytes_and_bijection():
    for t in _post_tiles():
        s = t.smem_layout_dq()
        assert s.shape == t.tile
        elems = t.block_m * t.head_dim
        if t.vec == 1:
            assert s.swizzle is None and s.pad == 128 // t.elem_bits
            assert s.bytes == t.block_m * (t.head_dim + s.pad) * t.elem_bits // 8
        else:
            assert s.pad == 0 and s.bytes == elems * t.elem_bits // 8
            assert s.swizzle == ((3, 3, 3) if t.head_dim % 64 == 0 else (2, 3, 3))
        if t.head_dim in (32, 96, 256):
            layout = s.layout()
            offsets = [layout(i) for i in range(elems)]
            assert len(set(offsets)) == elems, "two elements share a shared-memory slot"
            assert max(offsets) < s.bytes * 8 // t.elem_bits
        assert 2 * s.bytes <= 48 * 1024  # convert_dkv stages dK and dV side by side
        assert t.smem_copy_atom_dq_bits() == 2 * t.elem_bits


def test_prepost_tiles_reject_bad_configurations():
    with pytest.raises(ValueError, match="multiple of 32"):
        tiling.PrepostTiles(16, 48, 8, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        tiling.PrepostTiles(16, 288, 8, 64)
    with pytest.raises(ValueError, match="not a legal access"):
        tiling.preprocess_tiles(32, 64, 8)  # 256 bits
    with pytest.raises(ValueError, match="not a legal access"):
        tiling.postprocess_tiles(16, 64, 3)
    with pytest.raises(ValueError, match="not a multiple of a copy"):
        tiling.PrepostTiles(16, 32, 1, 2)  # 4 rows of threads do not tile 2 rows
    with pytest.raises(ValueError, match="head dim must be in"):
        tiling.head_dim_rounded(0)
    with pytest.raises(ValueError, match="head dim must be in"):
        tiling.head_dim_rounded(257)


def test_compute_delta_tiles():
    for bits in (16, 32):
        for hd in PADDED_HEAD_DIMS:
            vec = 128 // bits
            while vec >= 1:
                t = tiling.compute_delta_tiles(bits, hd, vec)
                assert t.threads_per_line == tiling.DELTA_THREADS // tiling.DELTA_BLOCK_I == 2
                assert t.max_iters * t.vec * t.threads_per_line == t.max_k == hd
                spec = t.gmem_load()
                assert spec.num_threads == t.num_threads and spec.tiler == (t.block_i, t.threads_per_line * t.vec)
                vec //= 2
    assert tiling.compute_delta_tiles(16, 33, 1).max_k == 64
    with pytest.raises(ValueError, match="must be 1, 2 or 4"):
        tiling.ComputeDeltaTiles(16, 8, 128, num_threads=128, block_i=16)  # 8 threads per line
    with pytest.raises(ValueError, match="must be 1, 2 or 4"):
        tiling.ComputeDeltaTiles(16, 8, 128, num_threads=128, block_i=256)
    with pytest.raises(ValueError, match="kMaxK must be a multiple"):
        tiling.ComputeDeltaTiles(16, 8, 40)  # 8 x 2 does not divide 40
    with pytest.raises(ValueError, match="not a legal access"):
        tiling.ComputeDeltaTiles(32, 8, 128)


def test_rounding_helpers():
    assert [A.seqlen_rounded(s) for s in (1, 77, 128, 129, 1000)] == [128, 128, 128, 256, 1024]
    assert [A.head_dim_rounded(d) for d in (1, 32, 33, 100, 255, 256)] == [32, 32, 64, 128, 256, 256]
    assert A.dq_accum_shape(2, 77, 3, 40) == (2, 128, 3, 64)
    assert A.dq_accum_shape(2, 77, 3, 40, nsplits=4) == (4, 2, 128, 3, 64)
    assert A.dq_accum_shape(3, 500, 4, 100, varlen=True) == (500 + 3 * 128, 4, 128)
    assert A.dkv_accum_shape(2, 4, 1000, 72) == (2, 4, 1024, 96)


# --------------------------------------------------------------------------- validation


def fc(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="cuda", dtype=dtype)


def f32(*shape):
    return fc(*shape, dtype=torch.float32)


def cu(*lengths, dtype=torch.int32):
    return torch.tensor([0] + list(lengths), dtype=dtype, device="cuda").cumsum(0).to(dtype)


def pre(**kw):
    out = kw.pop("out", None)
    if out is None:
        out = fc(2, 77, 3, 64)
    grad_out = kw.pop("grad_out", out)
    return lambda: A.attention_bwd_preprocess(out, grad_out, **kw)


def delta_(out, grad_out=None, **kw):
    return lambda: A.attention_bwd_compute_delta(out, out if grad_out is None else grad_out, **kw)


def cdq(acc=None, scale=0.125, **kw):
    kw.setdefault("head_dim", 64)
    if "cu_seqlens_q" not in kw:
        kw.setdefault("seqlen_q", 77)
    acc = f32(2, 128, 3, 64) if acc is None else acc
    return lambda: A.attention_bwd_convert_dq(acc, scale, **kw)


def cdkv(dk=None, dv=None, scale=0.125, **kw):
    kw.setdefault("head_dim", 64)
    kw.setdefault("seqlen_k", 77)
    dk = f32(2, 3, 128, 64) if dk is None else dk
    dv = f32(2, 3, 128, 64) if dv is None else dv
    return lambda: A.attention_bwd_convert_dkv(dk, dv, scale, **kw)


def clr(dk=None, dv=None):
    dk = f32(2, 3, 128, 64) if dk is None else dk
    dv = f32(2, 3, 128, 64) if dv is None else dv
    return lambda: A.attention_bwd_clear_dkv_accum(dk, dv)


BAD = [
    # (description, call builder, error type, message fragment)
    ("pre: cpu tensor", lambda: pre(out=torch.empty(2, 77, 3, 64)), ValueError, "out must be a CUDA tensor"),
    ("pre: int dtype", lambda: pre(out=fc(2, 77, 3, 64, dtype=torch.int32)), TypeError, "out must have dtype in"),
    ("pre: fp64", lambda: pre(out=fc(2, 77, 3, 64, dtype=torch.float64)), TypeError, "out must have dtype in"),
    (
        "pre: dtype mismatch",
        lambda: pre(grad_out=fc(2, 77, 3, 64, dtype=torch.float16)),
        TypeError,
        "grad_out must have out's dtype",
    ),
    ("pre: shape mismatch", lambda: pre(grad_out=fc(2, 78, 3, 64)), ValueError, "grad_out must have out's shape"),
    (
        "pre: rank 3 without cu_seqlens",
        lambda: pre(out=fc(77, 3, 64)),
        ValueError,
        "out must be [batch, seqlen, heads, head_dim]",
    ),
    (
        "pre: rank 4 with cu_seqlens",
        lambda: pre(cu_seqlens_q=cu(10, 20), max_seqlen_q=20),
        ValueError,
        "with cu_seqlens_q, out must be [total, heads, head_dim]",
    ),
    (
        "pre: last dim not contiguous",
        lambda: pre(out=fc(2, 77, 64, 3).transpose(-1, -2)),
        ValueError,
        "out must be contiguous in its last dim",
    ),
    (
        "pre: grad_out last dim not contiguous",
        lambda: pre(grad_out=fc(2, 77, 64, 3).transpose(-1, -2)),
        ValueError,
        "grad_out must be contiguous in its last dim",
    ),
    ("pre: head_dim 0", lambda: pre(out=fc(2, 77, 3, 0)), ValueError, "head_dim must be in [1, 256]"),
    ("pre: head_dim 300", lambda: pre(out=fc(2, 77, 3, 300)), ValueError, "head_dim must be in [1, 256], got 300"),
    (
        "pre: cu_seqlens without max_seqlen",
        lambda: pre(out=fc(30, 3, 64), cu_seqlens_q=cu(10, 20)),
        ValueError,
        "cu_seqlens_q needs max_seqlen_q",
    ),
    (
        "pre: max_seqlen without cu_seqlens",
        lambda: pre(max_seqlen_q=77),
        ValueError,
        "max_seqlen_q is only used with cu_seqlens_q",
    ),
    (
        "pre: cu_seqlens int64",
        lambda: pre(out=fc(30, 3, 64), cu_seqlens_q=cu(10, 20, dtype=torch.int64), max_seqlen_q=20),
        ValueError,
        "cu_seqlens_q must be a 1-D int32 tensor",
    ),
    (
        "pre: cu_seqlens 2-D",
        lambda: pre(out=fc(30, 3, 64), cu_seqlens_q=cu(10, 20).view(1, 3), max_seqlen_q=20),
        ValueError,
        "cu_seqlens_q must be a 1-D int32 tensor",
    ),
    (
        "pre: cu_seqlens on cpu",
        lambda: pre(out=fc(30, 3, 64), cu_seqlens_q=torch.tensor([0, 10, 30], dtype=torch.int32), max_seqlen_q=20),
        ValueError,
        "cu_seqlens_q is on cpu",
    ),
    (
        "pre: negative max_seqlen",
        lambda: pre(out=fc(30, 3, 64), cu_seqlens_q=cu(10, 20), max_seqlen_q=-1),
        ValueError,
        "max_seqlen_q must be >= 0",
    ),
    ("pre: scale nan", lambda: pre(scale=float("nan")), TypeError, "scale must be a finite float"),
    ("pre: scale str", lambda: pre(scale="1"), TypeError, "scale must be a finite float"),
    ("pre: grad_out not a tensor", lambda: pre(grad_out=[1.0]), TypeError, "grad_out must be a torch.Tensor"),
    ("delta: fp64", lambda: delta_(fc(2, 77, 3, 64, dtype=torch.float64)), TypeError, "out must have dtype in"),
    ("delta: rank 5", lambda: delta_(fc(1, 2, 77, 3, 64)), ValueError, "out must be [batch, seqlen, heads, head_dim]"),
    ("delta: head_dim 257", lambda: delta_(fc(2, 77, 3, 257)), ValueError, "head_dim must be in [1, 256]"),
    (
        "delta: cu_seqlens without max_seqlen",
        lambda: delta_(fc(30, 3, 64), cu_seqlens_q=cu(30)),
        ValueError,
        "cu_seqlens_q needs max_seqlen_q",
    ),
    (
        "delta: shape mismatch",
        lambda: delta_(fc(2, 77, 3, 64), fc(2, 77, 4, 64)),
        ValueError,
        "grad_out must have out's shape",
    ),
    ("dq: accumulator bf16", lambda: cdq(fc(2, 128, 3, 64)), TypeError, "dq_accum must be float32"),
    ("dq: accumulator rank 3", lambda: cdq(f32(128, 3, 64)), ValueError, "dq_accum must have 4 or 5 dims"),
    (
        "dq: varlen accumulator rank 5",
        lambda: cdq(f32(1, 1, 300, 3, 64), cu_seqlens_q=cu(40), max_seqlen_q=40),
        ValueError,
        "dq_accum must have 3 or 4 dims",
    ),
    (
        "dq: wrong last dim",
        lambda: cdq(f32(2, 128, 3, 64), head_dim=72),
        ValueError,
        "head_dim rounded up to 32 = 96, got 64",
    ),
    (
        "dq: last dim = head_dim, not rounded",
        lambda: cdq(f32(2, 128, 3, 40), head_dim=40),
        ValueError,
        "head_dim rounded up to 32 = 64, got 40",
    ),
    ("dq: head_dim 0", lambda: cdq(head_dim=0), ValueError, "head_dim must be >= 1"),
    (
        "dq: head_dim 300",
        lambda: cdq(f32(2, 128, 3, 320), head_dim=300),
        ValueError,
        "head_dim must be in [1, 256], got 300",
    ),
    ("dq: head_dim float", lambda: cdq(head_dim=64.0), TypeError, "head_dim must be an int"),
    ("dq: seqlen_q missing", lambda: cdq(seqlen_q=None), ValueError, "seqlen_q is required"),
    (
        "dq: too few rows",
        lambda: cdq(seqlen_q=200),
        ValueError,
        "dq_accum needs round_up(seqlen_q, 128) = 256 rows, got 128",
    ),
    (
        "dq: varlen too few rows",
        lambda: cdq(f32(200, 3, 64), cu_seqlens_q=cu(40, 40), max_seqlen_q=40),
        ValueError,
        "dq_accum must have total_q + 128 * batch rows",
    ),
    (
        "dq: varlen with seqlen_q",
        lambda: cdq(f32(296, 3, 64), cu_seqlens_q=cu(40), max_seqlen_q=40, seqlen_q=40),
        ValueError,
        "drop seqlen_q",
    ),
    (
        "dq: varlen without max_seqlen_q",
        lambda: cdq(f32(296, 3, 64), cu_seqlens_q=cu(40)),
        ValueError,
        "cu_seqlens_q needs max_seqlen_q",
    ),
    (
        "dq: cu_seqlens int64",
        lambda: cdq(f32(296, 3, 64), cu_seqlens_q=cu(40, dtype=torch.int64), max_seqlen_q=40),
        ValueError,
        "cu_seqlens_q must be a 1-D int32 tensor",
    ),
    ("dq: p_dropout 1", lambda: cdq(p_dropout=1.0), ValueError, "p_dropout must be in [0, 1)"),
    ("dq: p_dropout negative", lambda: cdq(p_dropout=-0.1), ValueError, "p_dropout must be in [0, 1)"),
    ("dq: dtype float32", lambda: cdq(dtype=torch.float32), TypeError, "dtype must be float16 or bfloat16"),
    ("dq: softmax_scale inf", lambda: cdq(scale=float("inf")), TypeError, "softmax_scale must be a finite float"),
    (
        "dq: row stride not a multiple of 4",
        lambda: cdq(torch.empty_strided((2, 128, 3, 64), (128 * 3 * 66, 3 * 66, 66, 1), device="cuda")),
        ValueError,
        "multiples of 4 elements",
    ),
    (
        "dq: last dim not contiguous",
        lambda: cdq(f32(2, 128, 64, 3).transpose(-1, -2)),
        ValueError,
        "dq_accum must be contiguous in its last dim",
    ),
    ("dq: cpu accumulator", lambda: cdq(torch.empty(2, 128, 3, 64)), ValueError, "dq_accum must be a CUDA tensor"),
    ("dkv: dv shape mismatch", lambda: cdkv(dv=f32(2, 3, 256, 64)), ValueError, "dv_accum must have dk_accum's shape"),
    ("dkv: dv dtype", lambda: cdkv(dv=fc(2, 3, 128, 64, dtype=torch.float16)), TypeError, "dv_accum must be float32"),
    (
        "dkv: dv last dim",
        lambda: cdkv(dv=f32(2, 3, 128, 96)),
        ValueError,
        "dv_accum's last dim must be head_dim rounded up to 32 = 64",
    ),
    ("dkv: rank 3", lambda: cdkv(dk=f32(3, 128, 64)), ValueError, "dk_accum must have 4 dims"),
    ("dkv: head_dim 300", lambda: cdkv(head_dim=300), ValueError, "head_dim must be in [1, 256]"),
    (
        "dkv: seqlen_k past the rows",
        lambda: cdkv(seqlen_k=129),
        ValueError,
        "dk_accum needs round_up(seqlen_k, 128) = 256 rows, got 128",
    ),
    ("dkv: seqlen_k negative", lambda: cdkv(seqlen_k=-1), ValueError, "seqlen_k must be >= 0"),
    (
        "dkv: cu_seqlens_k batch mismatch",
        lambda: cdkv(cu_seqlens_k=cu(10, 20, 30), seqlen_k=60),
        ValueError,
        "cu_seqlens_k has 3 sequences, dk_accum 2",
    ),
    (
        "dkv: cu_seqlens_k int64",
        lambda: cdkv(cu_seqlens_k=cu(10, 20, dtype=torch.int64), seqlen_k=30),
        ValueError,
        "cu_seqlens_k must be a 1-D int32 tensor",
    ),
    ("dkv: dtype float32", lambda: cdkv(dtype=torch.float32), TypeError, "dtype must be float16 or bfloat16"),
    ("dkv: p_dropout 1", lambda: cdkv(p_dropout=1.0), ValueError, "p_dropout must be in [0, 1)"),
    ("dkv: softmax_scale bool", lambda: cdkv(scale=True), TypeError, "softmax_scale must be a finite float"),
    (
        "clear: last dim 40",
        lambda: clr(f32(2, 3, 128, 40), f32(2, 3, 128, 40)),
        ValueError,
        "dk_accum's last dim must be a multiple of 32 in [32, 256], got 40",
    ),
    ("clear: last dim 288", lambda: clr(f32(2, 3, 128, 288), f32(2, 3, 128, 288)), ValueError, "got 288"),
    ("clear: not a tensor", lambda: clr(dk=3.0), TypeError, "dk_accum must be a torch.Tensor"),
    ("clear: dv shape mismatch", lambda: clr(dv=f32(2, 4, 128, 64)), ValueError, "dv_accum must have dk_accum's shape"),
    (
        "clear: dv last dim",
        lambda: clr(dv=f32(2, 3, 128, 96)),
        ValueError,
        "dv_accum's last dim must be head_dim rounded up to 32 = 64",
    ),
    ("clear: dk bf16", lambda: clr(dk=fc(2, 3, 128, 64)), TypeError, "dk_accum must be float32"),
    (
        "clear: rank 5",
        lambda: clr(f32(1, 2, 3, 128, 64), f32(1, 2, 3, 128, 64)),
        ValueError,
        "dk_accum must have 4 dims",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_raise_before_launch(case):
    _, build, err, fragment = case
    with FakeTensorMode(allow_non_fake_inputs=True):
        call = build()
        with pytest.raises(err) as info:
            call()
    assert fragment in str(info.value), (fragment, str(info.value))


def test_enough_bad_input_cases_per_function():
    per = {}
    for name, *_ in BAD:
        per[name.split(":")[0]] = per.get(name.split(":")[0], 0) + 1
    assert set(per) == {"pre", "delta", "dq", "dkv", "clear"} and len(BAD) >= 20


def test_good_inputs_pass_validation():
    """The same builders with nothing wrong reach the (fake) op: the bad cases fail for their reason."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert pre()().shape == (2, 3, 128)
        assert pre(out=fc(30, 3, 64), cu_seqlens_q=cu(10, 20), max_seqlen_q=20)().shape == (2, 3, 128)
        assert delta_(fc(2, 77, 3, 64))().shape == (2, 3, 77)
        assert cdq()().shape == (2, 77, 3, 64)
        assert cdq(f32(4, 2, 128, 3, 64))().shape == (2, 77, 3, 64)
        assert cdq(f32(296, 3, 64), cu_seqlens_q=cu(40), max_seqlen_q=40)().shape == (168, 3, 64)
        assert [t.shape for t in cdkv()()] == [(2, 77, 3, 64)] * 2
        assert [t.shape for t in cdkv(cu_seqlens_k=cu(10, 20), seqlen_k=30)()] == [(30, 3, 64)] * 2
        assert clr()() is None


# ---------------------------------------------------------------------- fake shapes


def test_fake_shapes_of_the_custom_ops():
    ops = torch.ops.cute_kernels
    with FakeTensorMode():
        o = fc(3, 200, 4, 72)
        d, acc = ops.attention_bwd_preprocess(o, o, 1.0, None, None, False)
        assert d.shape == (3, 4, 256) and d.dtype == torch.float32 and acc.shape == (0,)
        d, acc = ops.attention_bwd_preprocess(o, o, 0.5, None, None, True)
        assert d.shape == (3, 4, 256) and acc.shape == (3, 256, 4, 96) and acc.dtype == torch.float32

        packed = fc(500, 4, 33, dtype=torch.float16)
        c = cu(77, 0, 423)
        d, acc = ops.attention_bwd_preprocess(packed, packed, 1.0, c, 423, True)
        assert d.shape == (3, 4, 512) and acc.shape == (500 + 3 * 128, 4, 64)

        assert ops.attention_bwd_compute_delta(o, o, None, None).shape == (3, 4, 200)
        assert ops.attention_bwd_compute_delta(packed, packed, c, 423).shape == (3, 4, 423)

        dq = ops.attention_bwd_convert_dq(f32(3, 256, 4, 96), 0.1, 72, 200, None, None, 0.0, torch.bfloat16)
        assert dq.shape == (3, 200, 4, 72) and dq.dtype == torch.bfloat16
        dq = ops.attention_bwd_convert_dq(f32(4, 3, 256, 4, 96), 0.1, 72, 200, None, None, 0.1, torch.float16)
        assert dq.shape == (3, 200, 4, 72) and dq.dtype == torch.float16
        dq = ops.attention_bwd_convert_dq(f32(884, 4, 64), 0.1, 33, None, c, 423, 0.0, torch.bfloat16)
        assert dq.shape == (500, 4, 33)
        dq = ops.attention_bwd_convert_dq(f32(2, 884, 4, 64), 0.1, 33, None, c, 423, 0.0, torch.bfloat16)
        assert dq.shape == (500, 4, 33)

        dk, dv = ops.attention_bwd_convert_dkv(
            f32(3, 2, 256, 96), f32(3, 2, 256, 96), 0.1, 72, 200, None, 0.0, torch.bfloat16
        )
        assert dk.shape == dv.shape == (3, 200, 2, 72) and dk.dtype == dv.dtype == torch.bfloat16
        dk, dv = ops.attention_bwd_convert_dkv(
            f32(3, 2, 512, 64), f32(3, 2, 512, 64), 0.1, 33, 500, c, 0.0, torch.float16
        )
        assert dk.shape == dv.shape == (500, 2, 33) and dk.dtype == torch.float16

        dk_acc, dv_acc = f32(3, 2, 256, 96), f32(3, 2, 256, 96)
        assert ops.attention_bwd_clear_dkv_accum(dk_acc, dv_acc) is None


def test_fake_shapes_of_the_public_functions():
    with FakeTensorMode():
        o = fc(2, 3, 1000, 256).transpose(1, 2)  # [B, H, S, D] storage
        assert A.attention_bwd_preprocess(o, o, scale=0.9).shape == (2, 3, 1024)
        delta, acc = A.attention_bwd_preprocess(o, o, zero_dq_accum=True)
        assert delta.shape == (2, 3, 1024)
        assert acc.shape == A.dq_accum_shape(2, 1000, 3, 256) == (2, 1024, 3, 256)
        assert A.attention_bwd_compute_delta(o, o).shape == (2, 3, 1000)
        dq = A.attention_bwd_convert_dq(f32(4, 2, 1024, 3, 256), 0.1, head_dim=255, seqlen_q=1000, dtype=torch.float16)
        assert dq.shape == (2, 1000, 3, 255) and dq.dtype == torch.float16
        shape = A.dkv_accum_shape(2, 3, 1000, 1)
        dk, dv = A.attention_bwd_convert_dkv(f32(*shape), f32(*shape), 0.1, head_dim=1, seqlen_k=1000)
        assert dk.shape == (2, 1000, 3, 1) and dv.dtype == torch.bfloat16
        assert A.attention_bwd_clear_dkv_accum(f32(*shape), f32(*shape)) is None


# ------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize(
    "name",
    ["preprocess", "compute_delta", "convert_dq", "convert_dkv", "clear_dkv_accum"],
)
def test_public_functions_trace_in_one_graph(name, monkeypatch):
    """torch.compile(fullgraph=True) captures each function as its custom op, validation included."""
    monkeypatch.setattr(A, "check_cuda", lambda *a: None)  # CPU tensors stand in for CUDA ones
    o = torch.randn(2, 77, 3, 40, dtype=torch.bfloat16)
    calls = {
        "preprocess": (lambda o: A.attention_bwd_preprocess(o, o, scale=0.9, zero_dq_accum=True)[0] * 2, o),
        "compute_delta": (lambda o: A.attention_bwd_compute_delta(o, o) + 1, o),
        "convert_dq": (
            lambda a: A.attention_bwd_convert_dq(a, 0.1, head_dim=40, seqlen_q=77).float(),
            torch.zeros(2, 2, 128, 3, 64),
        ),
        "convert_dkv": (
            lambda a: A.attention_bwd_convert_dkv(a, a, 0.1, head_dim=40, seqlen_k=77)[0].float(),
            torch.zeros(2, 3, 128, 64),
        ),
        "clear_dkv_accum": (lambda a: A.attention_bwd_clear_dkv_accum(a, a), torch.zeros(2, 3, 128, 64)),
    }
    fn, arg = calls[name]
    assert any(f"attention_bwd_{name}" in op for op in trace_custom_ops(fn, arg))


# ------------------------------------------------------------------------ references


def test_delta_reference_by_hand():
    out = torch.tensor([[[[1.0, 2.0]], [[3.0, -1.0]]]])  # [B=1, S=2, H=1, D=2]
    grad = torch.tensor([[[[0.5, 0.25]], [[2.0, 4.0]]]])
    d = attention_delta_ref(out, grad, scale=2.0)
    assert d.shape == (1, 1, 128) and d.dtype == torch.float64
    assert d[0, 0, :2].tolist() == [2.0, 4.0]  # 2 * (0.5 + 0.5), 2 * (6 - 4)
    assert not d[0, 0, 2:].any()
    assert attention_delta_ref(out, grad, rounded=False).tolist() == [[[1.0, 2.0]]]
    torch.testing.assert_close(attention_delta_torch(out, grad), torch.tensor([[[1.0], [2.0]]]))


def test_delta_reference_varlen_by_hand():
    # sequences of 2, 0 and 1 rows, heads 2, head_dim 1
    out = torch.tensor([[[1.0], [2.0]], [[3.0], [4.0]], [[5.0], [6.0]]])  # [total=3, H=2, D=1]
    grad = torch.full_like(out, 10.0)
    c = torch.tensor([0, 2, 2, 3], dtype=torch.int32)
    d = attention_delta_ref(out, grad, cu_seqlens_q=c, max_seqlen_q=2, rounded=False)
    assert d.tolist() == [[[10.0, 30.0], [20.0, 40.0]], [[0.0, 0.0], [0.0, 0.0]], [[50.0, 0.0], [60.0, 0.0]]]
    d = attention_delta_ref(out, grad, 0.5, c, 2)
    assert d.shape == (3, 2, 128) and d[2, 1, 0].item() == 30.0 and not d[:, :, 2:].any()
    # the same sequences unpacked agree with the batched form
    batched = torch.zeros(3, 2, 2, 1)
    batched[0, :2], batched[2, :1] = out[:2], out[2:]
    torch.testing.assert_close(attention_delta_ref(batched, batched * 0 + 10.0, rounded=False), d[:, :, :2] * 2)


def test_convert_dq_reference_by_hand():
    acc = torch.arange(2 * 1 * 128 * 2 * 32, dtype=torch.float32).view(2, 1, 128, 2, 32)  # nsplits 2
    dq = convert_dq_ref(acc, 0.5, head_dim=3, seqlen_q=2, p_dropout=0.5)
    assert dq.shape == (1, 2, 2, 3) and dq.dtype == torch.float64
    # element (s, h, d) of split k is k * 8192 + s * 64 + h * 32 + d; summed, * 0.5 / 0.5
    assert dq[0, 1, 1].tolist() == [2 * (64 + 32) + 8192 + i * 2 for i in range(3)]
    torch.testing.assert_close(convert_dq_ref(acc[0], 1.0, head_dim=32, seqlen_q=128), acc[0].double())


def test_convert_dq_reference_varlen_by_hand():
    c = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # lengths 2, 0, 3
    rows = 5 + 3 * 128
    acc = torch.arange(rows, dtype=torch.float32).view(rows, 1, 1).expand(rows, 1, 32).contiguous()
    dq = convert_dq_ref(acc, 1.0, head_dim=1, cu_seqlens_q=c)
    # sequence b starts at cu[b] + 128 b: rows 0, 1 | - | 2 + 256 .. 4 + 256
    assert dq.shape == (5, 1, 1) and dq.flatten().tolist() == [0, 1, 258, 259, 260]
    two = convert_dq_ref(torch.stack([acc, acc]), 2.0, head_dim=1, cu_seqlens_q=c)
    assert two.flatten().tolist() == [0, 4, 1032, 1036, 1040]


def test_convert_dkv_reference_by_hand():
    dk = torch.arange(2 * 3 * 128 * 32, dtype=torch.float32).view(2, 3, 128, 32)
    dv = -dk
    k, v = convert_dkv_ref(dk, dv, 0.5, head_dim=2, seqlen_k=4, p_dropout=0.75)
    assert k.shape == v.shape == (2, 4, 3, 2) and k.dtype == torch.float64
    # [b, j, h, d] <- accum[b, h, j, d]: dK scaled by 0.5 / 0.25, dV by 1 / 0.25
    assert k[1, 3, 2].tolist() == [2.0 * float(dk[1, 2, 3, i]) for i in range(2)]
    assert v[1, 3, 2].tolist() == [-4.0 * float(dk[1, 2, 3, i]) for i in range(2)]
    c = torch.tensor([0, 3, 4], dtype=torch.int32)
    k, v = convert_dkv_ref(dk, dv, 1.0, head_dim=1, seqlen_k=4, cu_seqlens_k=c)
    assert k.shape == (4, 3, 1)
    assert k[:, 0, 0].tolist() == [float(dk[0, 0, j, 0]) for j in range(3)] + [float(dk[1, 0, 0, 0])]
    assert math.isclose(float(v[3, 2, 0]), -float(dk[1, 2, 0, 0]))


def test_reference_layouts_agree_with_transposed_inputs():
    """A [B, H, S, D] tensor passed as .transpose(1, 2) is the same [B, S, H, D] tensor."""
    torch.manual_seed(0)
    o = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    g = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    d = attention_delta_ref(o.transpose(1, 2), g.transpose(1, 2), rounded=False)
    torch.testing.assert_close(d, (o * g).sum(-1))


# ------------------------------------------------------------------ rows without keys


def _blind_brute(sq, sk, mask_type, window):
    """[Sq] bool by enumeration: no key k in [0, Sk) passes the mask of query q."""
    offset = sk - sq if mask_type == 2 else 0
    rows = []
    for q in range(sq):
        sees = [
            k
            for k in range(sk)
            if (mask_type == 0 or k <= q + offset) and not (window > 0 and k <= q + offset - window)
        ]
        rows.append(not sees)
    return torch.tensor(rows, dtype=torch.bool)


BLIND_CASES = [  # (Sq, Sk, mask, window)
    (300, 100, 2, 0),
    (100, 300, 2, 0),
    (64, 64, 2, 0),
    (300, 100, 1, 0),
    (300, 100, 1, 50),
    (300, 100, 2, 50),
    (129, 129, 2, 1),
    (400, 260, 1, 300),
    (257, 300, 2, 70),
    (50, 80, 0, 0),
    (90, 10, 1, 1),
]


@pytest.mark.parametrize("case", BLIND_CASES, ids=[f"q{c[0]}k{c[1]}m{c[2]}w{c[3]}" for c in BLIND_CASES])
def test_zero_blind_delta_dense(case):
    """Exactly the rows that see no key are zeroed (rows padded past Sq are left alone)."""
    sq, sk, mask_type, window = case
    rows = (sq + 127) // 128 * 128
    delta = torch.randn(2, 3, rows).add_(5.0)  # no zero anywhere before
    A.zero_blind_delta(delta, mask_type, window, sq, sk)
    want = torch.zeros(rows, dtype=torch.bool)
    want[:sq] = _blind_brute(sq, sk, mask_type, window)
    zeroed = delta == 0
    assert (zeroed[..., :sq] == want[:sq]).all(), (zeroed[0, 0, :sq].nonzero().flatten(), want.nonzero().flatten())


@pytest.mark.parametrize("mask_type,window", [(2, 0), (1, 30), (2, 30), (1, 0)])
def test_zero_blind_delta_packed(mask_type, window):
    """Packed sequences: each sequence's own blind rows; rows past its end are not asked about."""
    lens_q, lens_k = [300, 5, 64, 0, 100], [100, 50, 64, 7, 250]
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)  # noqa: E731
    rows = max(lens_q)
    delta = torch.randn(len(lens_q), 2, rows).add_(5.0)
    A.zero_blind_delta(delta, mask_type, window, sum(lens_q), sum(lens_k), cu(lens_q), cu(lens_k))
    for i, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq == 0:
            continue
        assert ((delta[i, :, :sq] == 0) == _blind_brute(sq, sk, mask_type, window)).all(), (i, sq, sk)
