"""Attention-backward pre/post-processing on the GPU, against fp64 references.

Every distinct (dtype, padded head dim, vector width, varlen) is a JIT compile, so head
dims are chosen to reach each padded head dim and vector width once per dtype, and the
shapes, layouts and options of one configuration are looped inside one test.
"""

import math

import pytest
import torch

from ops import _compile as cc
from ops import attention_bwd_prepost as A
from ops.reference import attention_delta_ref, convert_dkv_ref, convert_dq_ref

from .helpers import poison, rel_err

pytestmark = pytest.mark.gpu

DEV = "cuda"
# every padded head dim (32..256) with its widest vector, and the odd ones (vec 1 / 4)
HEAD_DIMS = [1, 32, 33, 40, 64, 72, 96, 100, 128, 160, 192, 255, 256]
# (batch, seqlen, heads): seqlens not multiples of 128, B <= 3, H <= 4
SHAPES = [(1, 1, 1), (2, 77, 3), (3, 200, 2), (1, 1000, 4)]
LAYOUTS = ["bshd", "bhsd"]
# varlen sequence lengths: a zero-length sequence, single rows, lengths across blocks
LENGTHS = [[77, 0, 200], [1], [0, 130, 1000]]
# convert outputs: one rounding of an fp32 value
OUT_TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3}


# ----------------------------------------------------------------------------- helpers


def seq_tensor(b, s, h, d, dtype, layout, gen=None):
    """[B, S, H, D]: contiguous ("bshd") or a [B, H, S, D] tensor's transpose(1, 2) ("bhsd")."""
    if layout == "bshd":
        return torch.randn(b, s, h, d, device=DEV, dtype=dtype, generator=gen)
    return torch.randn(b, h, s, d, device=DEV, dtype=dtype, generator=gen).transpose(1, 2)


def cu_seqlens(lengths):
    return torch.tensor([0] + list(lengths), device=DEV).cumsum(0).to(torch.int32)


def packed(total, h, d, dtype, offset=0, gen=None):
    """[total, H, D] starting ``offset`` elements into a buffer (offset 1: a 2-byte aligned start)."""
    flat = torch.randn(offset + total * h * d, device=DEV, dtype=dtype, generator=gen)
    return flat[offset:].view(total, h, d)


def vec_of(*tensors):
    """The vector width (elements) the host picks for these tensors."""
    return cc.max_vector_elems(128, *((t, t.shape[-1]) for t in tensors))


def poison_allocator(*nbytes):
    """Fill fresh blocks of these sizes with 0xFF bytes (NaN in fp32, fp16 and bf16) and free
    them, so the caching allocator hands that memory to the next allocations of those sizes.
    Returns the blocks' address ranges."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=DEV) for n in nbytes]
    ranges = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in blocks]
    del blocks
    return ranges


def valid_rows(b, h, rows, lengths):
    """[B, H, rows] bool: row i of sequence b is inside the sequence."""
    n = torch.tensor(lengths, device=DEV).view(b, 1, 1)
    return (torch.arange(rows, device=DEV).view(1, 1, rows) < n).expand(b, h, rows)


def check_delta(delta, out, grad_out, scale=1.0, cu=None, max_seqlen=None, rounded=True, tol=1e-4):
    """Δ against the fp64 reference: within ``tol`` of Σ|O dO| per row (fp32 sums of exact
    products), rows past each sequence exactly 0, nothing unwritten (NaN)."""
    ref = attention_delta_ref(out, grad_out, scale, cu, max_seqlen, rounded)
    assert delta.shape == ref.shape and delta.dtype == torch.float32, (delta.shape, ref.shape)
    assert not delta.isnan().any(), "Δ has unwritten (NaN) rows"
    mag = attention_delta_ref(out.abs(), grad_out.abs(), abs(scale), cu, max_seqlen, rounded)
    diff = (delta.double() - ref).abs()
    assert (diff <= tol * mag + 1e-30).all(), f"max |Δ - ref| {diff.max().item()} (row magnitude {mag.max().item()})"
    b, h, rows = delta.shape
    lengths = [out.shape[1]] * b if cu is None else (cu[1:] - cu[:-1]).tolist()
    assert (delta[~valid_rows(b, h, rows, lengths)] == 0).all(), "Δ past a sequence's end is not 0"


def check_converted(got, ref, dtype):
    """fp16/bf16 output: one rounding of the fp64 value (relative), tiny absolute near zero."""
    assert got.shape == ref.shape and got.dtype == dtype, (got.shape, ref.shape, got.dtype)
    assert not got.isnan().any(), "output has NaN: unwritten elements or padding leaked"
    diff = (got.double() - ref).abs()
    bound = OUT_TOL[dtype] * ref.abs() + 1e-5 * ref.abs().max().clamp(min=1e-30)
    assert (diff <= bound).all(), f"max |out - ref| {diff.max().item()}"
    if ref.numel():
        assert rel_err(got, ref) < 1e-2


def nan_padded_dq_accum(b, s, h, d, nsplits=None, gen=None):
    """A [(nsplits,) B, S_r, H, D_r] accumulator: random rows < S and columns < D, NaN elsewhere."""
    acc = torch.full(A.dq_accum_shape(b, s, h, d, nsplits=nsplits), float("nan"), device=DEV)
    acc[..., :s, :, :d] = torch.randn(acc[..., :s, :, :d].shape, device=DEV, generator=gen)
    return acc


def nan_padded_dq_accum_varlen(lengths, h, d, nsplits=None, gen=None):
    """[(nsplits,) total + 128 B, H, D_r]: sequence b's rows at cu[b] + 128 b random, the rest NaN."""
    b, total = len(lengths), sum(lengths)
    acc = torch.full(A.dq_accum_shape(b, total, h, d, varlen=True, nsplits=nsplits), float("nan"), device=DEV)
    start = 0
    for i, n in enumerate(lengths):
        rows = acc[..., start + 128 * i : start + 128 * i + n, :, :d]
        rows.copy_(torch.randn(rows.shape, device=DEV, generator=gen))
        start += n
    return acc


def nan_padded_dkv_accum(lengths, h, d, max_seqlen, gen=None):
    """[B, H, S_r, D_r]: rows < lengths[b] and columns < D random, NaN elsewhere."""
    acc = torch.full(A.dkv_accum_shape(len(lengths), h, max_seqlen, d), float("nan"), device=DEV)
    for i, n in enumerate(lengths):
        acc[i, :, :n, :d] = torch.randn(h, n, d, device=DEV, generator=gen)
    return acc


# ------------------------------------------------------------------------- preprocess

PRE_CASES = (
    [(torch.bfloat16, d) for d in HEAD_DIMS]
    + [(torch.float16, d) for d in (1, 40, 100, 128, 256)]
    + [(torch.float32, d) for d in (33, 64, 100, 256)]
)


@pytest.mark.parametrize("dtype,head_dim", PRE_CASES, ids=[f"{str(t)[6:]}-d{d}" for t, d in PRE_CASES])
def test_preprocess(dtype, head_dim):
    gen = torch.Generator(DEV).manual_seed(head_dim)
    for i, (b, s, h) in enumerate(SHAPES):
        for layout in LAYOUTS:
            out = seq_tensor(b, s, h, head_dim, dtype, layout, gen)
            grad_out = seq_tensor(b, s, h, head_dim, dtype, layout, gen)
            scale = (1.0, 0.9, 1.0, 0.5)[i]
            poison_allocator(b * h * A.seqlen_rounded(s) * 4)
            delta = A.attention_bwd_preprocess(out, grad_out, scale=scale)
            check_delta(delta, out, grad_out, scale)


@pytest.mark.parametrize("scale", [0.0, 0.25, 1.0])
def test_preprocess_scale(scale):
    out = seq_tensor(2, 200, 3, 128, torch.bfloat16, "bshd")
    grad_out = seq_tensor(2, 200, 3, 128, torch.bfloat16, "bshd")
    delta = A.attention_bwd_preprocess(out, grad_out, scale=scale)
    check_delta(delta, out, grad_out, scale)
    unscaled = A.attention_bwd_preprocess(out, grad_out)
    torch.testing.assert_close(delta, unscaled * scale, rtol=1e-6, atol=0)


VARLEN_CASES = [(torch.bfloat16, d) for d in (33, 64, 128, 256)] + [
    (torch.float16, 40),
    (torch.float16, 100),
    (torch.float32, 64),
]


@pytest.mark.parametrize("dtype,head_dim", VARLEN_CASES, ids=[f"{str(t)[6:]}-d{d}" for t, d in VARLEN_CASES])
def test_preprocess_varlen(dtype, head_dim):
    gen = torch.Generator(DEV).manual_seed(100 + head_dim)
    h = 3
    for lengths in LENGTHS:
        total = sum(lengths)
        out, grad_out = packed(total, h, head_dim, dtype, gen=gen), packed(total, h, head_dim, dtype, gen=gen)
        cu = cu_seqlens(lengths)
        # max_seqlen exact, and a looser bound (Δ gets more rows, all zero)
        for max_seqlen in (max(lengths), max(lengths) + 130):
            poison_allocator(len(lengths) * h * A.seqlen_rounded(max_seqlen) * 4)
            delta = A.attention_bwd_preprocess(out, grad_out, scale=0.75, cu_seqlens_q=cu, max_seqlen_q=max_seqlen)
            assert delta.shape == (len(lengths), h, A.seqlen_rounded(max_seqlen))
            check_delta(delta, out, grad_out, 0.75, cu, max_seqlen)


@pytest.mark.parametrize("offset,vec", [(1, 1), (2, 2), (4, 4), (8, 8)])
def test_preprocess_misaligned_starts(offset, vec):
    """Inputs whose start is not 16-byte aligned take narrower vectors and stay right."""
    gen = torch.Generator(DEV).manual_seed(offset)
    lengths = [77, 0, 200]
    cu = cu_seqlens(lengths)
    out = packed(277, 2, 64, torch.bfloat16, offset, gen)
    grad_out = packed(277, 2, 64, torch.bfloat16, 8, gen)
    assert vec_of(out, grad_out) == vec  # the case reaches the vector it is about
    delta = A.attention_bwd_preprocess(out, grad_out, cu_seqlens_q=cu, max_seqlen_q=200)
    check_delta(delta, out, grad_out, 1.0, cu, 200)
    # the same storage as [B, S, H, D]
    out4 = out[:200].view(2, 100, 2, 64)
    grad4 = grad_out[:200].view(2, 100, 2, 64)
    assert vec_of(out4, grad4) == vec
    check_delta(A.attention_bwd_preprocess(out4, grad4), out4, grad4)
    check_delta(A.attention_bwd_compute_delta(out4, grad4), out4, grad4, rounded=False)


def test_preprocess_odd_row_slice():
    """base[1:] of a packed tensor whose rows (H x D = 99 elements) are odd-sized."""
    base = torch.randn(301, 3, 33, device=DEV, dtype=torch.float16)
    gbase = torch.randn(301, 3, 33, device=DEV, dtype=torch.float16)
    out, grad_out = base[1:], gbase[1:]
    assert out.data_ptr() % 16
    lengths = [100, 0, 1, 199]
    cu = cu_seqlens(lengths)
    check_delta(
        A.attention_bwd_preprocess(out, grad_out, cu_seqlens_q=cu, max_seqlen_q=199), out, grad_out, 1.0, cu, 199
    )


@pytest.mark.parametrize(
    "dtype,head_dim,varlen",
    [
        (torch.bfloat16, 40, False),
        (torch.bfloat16, 128, False),
        (torch.bfloat16, 256, False),
        (torch.float16, 100, False),
        (torch.bfloat16, 33, True),
        (torch.bfloat16, 256, True),
    ],
)
def test_zero_dq_accum(dtype, head_dim, varlen):
    """The returned accumulator is all zeros even in memory the allocator filled with NaN."""
    h = 4
    if varlen:
        lengths = [1000, 0, 1500]
        b, total = 3, sum(lengths)
        out, grad_out = packed(total, h, head_dim, dtype), packed(total, h, head_dim, dtype)
        cu, max_seqlen = cu_seqlens(lengths), 1500
        acc_shape = A.dq_accum_shape(b, total, h, head_dim, varlen=True)
        assert acc_shape == (total + 128 * b, h, A.head_dim_rounded(head_dim))
    else:
        b, s = 3, 1000
        out, grad_out = seq_tensor(b, s, h, head_dim, dtype, "bhsd"), seq_tensor(b, s, h, head_dim, dtype, "bhsd")
        cu = max_seqlen = None
        acc_shape = A.dq_accum_shape(b, s, h, head_dim)
    acc_bytes = 4 * torch.Size(acc_shape).numel()
    delta_bytes = b * h * A.seqlen_rounded(max_seqlen or out.shape[1]) * 4
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no other free block to hand out: the poisoned one is reused
    ranges = poison_allocator(delta_bytes, acc_bytes)
    delta, acc = A.attention_bwd_preprocess(out, grad_out, cu_seqlens_q=cu, max_seqlen_q=max_seqlen, zero_dq_accum=True)
    torch.cuda.synchronize()
    assert any(lo <= acc.data_ptr() < hi for lo, hi in ranges), "test precondition: the poisoned block was not reused"
    assert acc.shape == acc_shape and acc.dtype == torch.float32
    assert (acc == 0).all(), f"{(acc != 0).sum().item()} accumulator elements not zeroed"
    check_delta(delta, out, grad_out, 1.0, cu, max_seqlen)
    # without the flag: Δ alone, the same values
    torch.testing.assert_close(
        A.attention_bwd_preprocess(out, grad_out, cu_seqlens_q=cu, max_seqlen_q=max_seqlen), delta, rtol=0, atol=0
    )


@pytest.mark.parametrize("varlen", [False, True])
def test_preprocess_lse_log2(varlen):
    """The sm90 path's fused LSE rescale: LSE * log2(e) shaped as Δ, 0 past each sequence
    (also where the allocator left NaN), the forward's padding and -inf rows as they are;
    Δ and the cleared accumulator as without it."""
    h, d, dtype = 3, 64, torch.bfloat16
    if varlen:
        lengths = [100, 0, 1, 199]
        b, total, rows = len(lengths), sum(lengths), 199
        out, grad_out = packed(total, h, d, dtype), packed(total, h, d, dtype)
        cu, max_seqlen = cu_seqlens(lengths), rows
    else:
        lengths, b, rows = [300] * 2, 2, 300
        out, grad_out = seq_tensor(b, rows, h, d, dtype, "bhsd"), seq_tensor(b, rows, h, d, dtype, "bhsd")
        cu = max_seqlen = None
    lse = torch.randn(b, h, 320, device=DEV) * 10  # the forward's rows, padded to 32 values
    lse[..., rows:] = float("inf")
    lse[0, 1, 0] = -float("inf")  # a query row that saw no key
    s_r = A.seqlen_rounded(rows)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    poison_allocator(*(b * h * s_r * 4 for _ in range(2)))
    delta, acc, got = A._preprocess_impl(out, grad_out, 1.0, cu, max_seqlen, True, lse=lse)
    assert got.shape == delta.shape == (b, h, s_r) and got.dtype == torch.float32
    want = torch.zeros(b, h, s_r, device=DEV)
    want[..., :rows] = lse[..., :rows] * math.log2(math.e)
    want = torch.where(valid_rows(b, h, s_r, lengths), want, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got[0, 1, 0] == -float("inf")
    ref_delta, ref_acc = A._preprocess_impl(out, grad_out, 1.0, cu, max_seqlen, True)
    assert torch.equal(delta, ref_delta) and (acc == 0).all() and acc.shape == ref_acc.shape


def test_preprocess_empty():
    out = torch.empty(2, 0, 3, 64, device=DEV, dtype=torch.bfloat16)
    delta = A.attention_bwd_preprocess(out, out)
    assert delta.shape == (2, 3, 128) and (delta == 0).all()
    delta, acc = A.attention_bwd_preprocess(out, out, zero_dq_accum=True)
    assert (delta == 0).all() and acc.shape == (2, 128, 3, 64) and (acc == 0).all()
    # varlen, every sequence empty
    out = torch.empty(0, 3, 64, device=DEV, dtype=torch.bfloat16)
    cu = cu_seqlens([0, 0])
    delta, acc = A.attention_bwd_preprocess(out, out, cu_seqlens_q=cu, max_seqlen_q=0, zero_dq_accum=True)
    assert delta.shape == (2, 3, 128) and (delta == 0).all()
    assert acc.shape == (256, 3, 64) and (acc == 0).all()
    assert A.attention_bwd_compute_delta(out, out, cu_seqlens_q=cu, max_seqlen_q=0).shape == (2, 3, 0)


def test_long_sequences():
    """Row blocks past 65535 (the grid's y and z limit): one sequence of over a million rows."""
    s = 65535 * 16 + 1000  # more row blocks than 65535 at the smallest preprocess tile (16 rows)
    out = seq_tensor(1, s, 1, 256, torch.bfloat16, "bshd")
    grad_out = seq_tensor(1, s, 1, 256, torch.bfloat16, "bshd")
    check_delta(A.attention_bwd_preprocess(out, grad_out), out, grad_out)
    check_delta(A.attention_bwd_compute_delta(out, grad_out), out, grad_out, rounded=False)
    del out, grad_out
    s = 65535 * 64 + 1000  # and past 65535 blocks of 64 rows for the conversions
    acc = torch.randn(A.dq_accum_shape(1, s, 1, 32), device=DEV)
    check_converted(
        A.attention_bwd_convert_dq(acc, 0.5, head_dim=32, seqlen_q=s),
        convert_dq_ref(acc, 0.5, head_dim=32, seqlen_q=s),
        torch.bfloat16,
    )
    acc = acc.view(A.dkv_accum_shape(1, 1, s, 32))
    dk, dv = A.attention_bwd_convert_dkv(acc, acc, 0.5, head_dim=32, seqlen_k=s)
    ref_dk, ref_dv = convert_dkv_ref(acc, acc, 0.5, head_dim=32, seqlen_k=s)
    check_converted(dk, ref_dk, torch.bfloat16)
    check_converted(dv, ref_dv, torch.bfloat16)


# ---------------------------------------------------------------------- compute_delta

DELTA_CASES = (
    [(torch.bfloat16, d) for d in (1, 40, 72, 100, 128, 192, 255, 256)]
    + [(torch.float16, d) for d in (33, 64, 160)]
    + [(torch.float32, d) for d in (32, 100, 256)]
)


@pytest.mark.parametrize("dtype,head_dim", DELTA_CASES, ids=[f"{str(t)[6:]}-d{d}" for t, d in DELTA_CASES])
def test_compute_delta(dtype, head_dim):
    gen = torch.Generator(DEV).manual_seed(200 + head_dim)
    for b, s, h in SHAPES:
        for layout in LAYOUTS:
            out = seq_tensor(b, s, h, head_dim, dtype, layout, gen)
            grad_out = seq_tensor(b, s, h, head_dim, dtype, layout, gen)
            poison_allocator(b * h * s * 4)
            delta = A.attention_bwd_compute_delta(out, grad_out)
            check_delta(delta, out, grad_out, rounded=False)


@pytest.mark.parametrize(
    "dtype,head_dim,offset",
    [(torch.bfloat16, 64, 0), (torch.bfloat16, 255, 0), (torch.float16, 100, 0), (torch.bfloat16, 64, 2)],
)
def test_compute_delta_varlen(dtype, head_dim, offset):
    gen = torch.Generator(DEV).manual_seed(300 + head_dim)
    h = 2
    for lengths in LENGTHS:
        total = sum(lengths)
        out = packed(total, h, head_dim, dtype, offset, gen)
        grad_out = packed(total, h, head_dim, dtype, offset, gen)
        cu = cu_seqlens(lengths)
        for max_seqlen in (max(lengths), max(lengths) + 3):
            delta = A.attention_bwd_compute_delta(out, grad_out, cu_seqlens_q=cu, max_seqlen_q=max_seqlen)
            check_delta(delta, out, grad_out, 1.0, cu, max_seqlen, rounded=False)


def test_compute_delta_matches_preprocess():
    out = seq_tensor(3, 1000, 4, 128, torch.bfloat16, "bhsd")
    grad_out = seq_tensor(3, 1000, 4, 128, torch.bfloat16, "bhsd")
    a = A.attention_bwd_compute_delta(out, grad_out)
    b = A.attention_bwd_preprocess(out, grad_out)[:, :, :1000]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------- convert_dq

CONVERT_CASES = [(torch.bfloat16, d) for d in HEAD_DIMS] + [(torch.float16, d) for d in (1, 72, 100, 256)]


@pytest.mark.parametrize("dtype,head_dim", CONVERT_CASES, ids=[f"{str(t)[6:]}-d{d}" for t, d in CONVERT_CASES])
def test_convert_dq(dtype, head_dim):
    gen = torch.Generator(DEV).manual_seed(400 + head_dim)
    scale = head_dim**-0.5
    for i, (b, s, h) in enumerate(SHAPES[:3]):
        for nsplits in (None, 1, 4):  # None: no split dim
            p = (0.0, 0.1, 0.0)[i]
            acc = nan_padded_dq_accum(b, s, h, head_dim, nsplits, gen)
            poison_allocator(b * s * h * head_dim * 2)
            dq = A.attention_bwd_convert_dq(acc, scale, head_dim=head_dim, seqlen_q=s, p_dropout=p, dtype=dtype)
            ref = convert_dq_ref(acc, scale, head_dim=head_dim, seqlen_q=s, p_dropout=p)
            check_converted(dq, ref, dtype)


def test_convert_dq_p_dropout_and_strided_accumulator():
    """p_dropout divides by 1 - p; an accumulator view (row stride past D_r, a split slice) is read by its strides."""
    b, s, h, d = 2, 200, 3, 128
    big = torch.randn(6, b, 256, h, 160, device=DEV)
    acc = big[1:5, :, :, :, :128]  # 4 splits, rows 160 elements apart
    for p in (0.0, 0.1, 0.5):
        dq = A.attention_bwd_convert_dq(acc, 0.125, head_dim=d, seqlen_q=s, p_dropout=p)
        check_converted(dq, convert_dq_ref(acc, 0.125, head_dim=d, seqlen_q=s, p_dropout=p), torch.bfloat16)
    base = A.attention_bwd_convert_dq(acc, 0.125, head_dim=d, seqlen_q=s)
    half = A.attention_bwd_convert_dq(acc, 0.125, head_dim=d, seqlen_q=s, p_dropout=0.5)
    torch.testing.assert_close(half.float(), (base.float() * 2).bfloat16().float(), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize(
    "dtype,head_dim", [(torch.bfloat16, 40), (torch.bfloat16, 128), (torch.bfloat16, 256), (torch.float16, 33)]
)
def test_convert_dq_varlen(dtype, head_dim):
    """Rows of the per-sequence slack and columns past head_dim (NaN) never reach dQ."""
    gen = torch.Generator(DEV).manual_seed(500 + head_dim)
    h = 3
    for lengths in LENGTHS:
        cu = cu_seqlens(lengths)
        for nsplits in (None, 3):
            acc = nan_padded_dq_accum_varlen(lengths, h, head_dim, nsplits, gen)
            for max_seqlen in (max(lengths), max(lengths) + 200):
                poison_allocator(sum(lengths) * h * head_dim * 2)
                dq = A.attention_bwd_convert_dq(
                    acc, 0.1, head_dim=head_dim, cu_seqlens_q=cu, max_seqlen_q=max_seqlen, p_dropout=0.2, dtype=dtype
                )
                ref = convert_dq_ref(acc, 0.1, head_dim=head_dim, cu_seqlens_q=cu, p_dropout=0.2)
                assert dq.shape == (sum(lengths), h, head_dim)
                check_converted(dq, ref, dtype)


# ------------------------------------------------------------------------ convert_dkv

DKV_CASES = [(torch.bfloat16, d) for d in (1, 33, 64, 96, 100, 128, 160, 192, 256)] + [
    (torch.float16, d) for d in (40, 255)
]


@pytest.mark.parametrize("dtype,head_dim", DKV_CASES, ids=[f"{str(t)[6:]}-d{d}" for t, d in DKV_CASES])
def test_convert_dkv(dtype, head_dim):
    gen = torch.Generator(DEV).manual_seed(600 + head_dim)
    scale = head_dim**-0.5
    for i, (b, s, h) in enumerate(SHAPES):
        p = (0.0, 0.2, 0.0, 0.1)[i]
        dk_acc = nan_padded_dkv_accum([s] * b, h, head_dim, s, gen)
        dv_acc = nan_padded_dkv_accum([s] * b, h, head_dim, s, gen)
        poison_allocator(*[b * s * h * head_dim * 2] * 2)
        dk, dv = A.attention_bwd_convert_dkv(
            dk_acc, dv_acc, scale, head_dim=head_dim, seqlen_k=s, p_dropout=p, dtype=dtype
        )
        ref_dk, ref_dv = convert_dkv_ref(dk_acc, dv_acc, scale, head_dim=head_dim, seqlen_k=s, p_dropout=p)
        check_converted(dk, ref_dk, dtype)
        check_converted(dv, ref_dv, dtype)


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.bfloat16, 256), (torch.float16, 33)])
def test_convert_dkv_varlen(dtype, head_dim):
    gen = torch.Generator(DEV).manual_seed(700 + head_dim)
    h = 2
    for lengths in LENGTHS:
        cu = cu_seqlens(lengths)
        dk_acc = nan_padded_dkv_accum(lengths, h, head_dim, max(lengths), gen)
        dv_acc = nan_padded_dkv_accum(lengths, h, head_dim, max(lengths), gen)
        total = sum(lengths)
        dk, dv = A.attention_bwd_convert_dkv(
            dk_acc, dv_acc, 0.3, head_dim=head_dim, seqlen_k=total, cu_seqlens_k=cu, p_dropout=0.1, dtype=dtype
        )
        ref_dk, ref_dv = convert_dkv_ref(
            dk_acc, dv_acc, 0.3, head_dim=head_dim, seqlen_k=total, cu_seqlens_k=cu, p_dropout=0.1
        )
        assert dk.shape == dv.shape == (total, h, head_dim)
        check_converted(dk, ref_dk, dtype)
        check_converted(dv, ref_dv, dtype)


# -------------------------------------------------------------------- clear_dkv_accum


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_clear_dkv_accum(head_dim):
    for b, s, h in SHAPES[1:]:
        shape = A.dkv_accum_shape(b, h, s, head_dim)
        dk, dv = poison(torch.empty(shape, device=DEV)), poison(torch.empty(shape, device=DEV))
        assert A.attention_bwd_clear_dkv_accum(dk, dv) is None
        assert (dk == 0).all() and (dv == 0).all()
    # views into larger buffers: the rows past the view stay untouched
    big_k = poison(torch.empty(2, 3, 384, head_dim, device=DEV))
    big_v = poison(torch.empty(2, 3, 384, head_dim, device=DEV))
    A.attention_bwd_clear_dkv_accum(big_k[:, :, :256], big_v[:, :, :256])
    for big in (big_k, big_v):
        assert (big[:, :, :256] == 0).all() and big[:, :, 256:].isnan().all()


# ---------------------------------------------------------------- torch integration


def test_torch_compile_preprocess():
    out = seq_tensor(2, 200, 3, 64, torch.bfloat16, "bhsd")
    grad_out = seq_tensor(2, 200, 3, 64, torch.bfloat16, "bhsd")

    def f(out, grad_out):
        delta, acc = A.attention_bwd_preprocess(out, grad_out, scale=0.9, zero_dq_accum=True)
        return delta * 2, acc + 1

    got = torch.compile(f, fullgraph=True)(out, grad_out)
    want = f(out, grad_out)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_torch_compile_preprocess_and_convert_dq():
    b, s, h, d = 2, 200, 3, 64
    out = seq_tensor(b, s, h, d, torch.bfloat16, "bshd")
    grad_out = seq_tensor(b, s, h, d, torch.bfloat16, "bshd")
    partials = torch.randn(A.dq_accum_shape(b, s, h, d, nsplits=2), device=DEV)

    def f(out, grad_out, partials):
        delta = A.attention_bwd_preprocess(out, grad_out, scale=0.9)
        dq = A.attention_bwd_convert_dq(partials, 0.125, head_dim=d, seqlen_q=s, p_dropout=0.1)
        return delta.sum(-1), dq.float() * 2

    got = torch.compile(f, fullgraph=True)(out, grad_out, partials)
    want = f(out, grad_out, partials)
    # the row sums of Δ are reduced by inductor in one graph and by torch eagerly in the
    # other: the same Δ, summed in a different order
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
    assert torch.equal(got[1], want[1])


def test_opcheck_fake_implementations():
    """The registered fake implementations agree with the real ops (shapes, dtypes, strides)."""
    utils = ("test_schema", "test_faketensor")
    ops = torch.ops.cute_kernels
    out = seq_tensor(2, 77, 3, 40, torch.bfloat16, "bhsd")
    pk = packed(277, 3, 40, torch.bfloat16)
    cu = cu_seqlens([77, 0, 200])
    torch.library.opcheck(ops.attention_bwd_preprocess, (out, out, 0.5, None, None, True), test_utils=utils)
    torch.library.opcheck(ops.attention_bwd_preprocess, (pk, pk, 1.0, cu, 200, False), test_utils=utils)
    torch.library.opcheck(ops.attention_bwd_compute_delta, (out, out, None, None), test_utils=utils)
    torch.library.opcheck(ops.attention_bwd_compute_delta, (pk, pk, cu, 200), test_utils=utils)
    acc = torch.randn(A.dq_accum_shape(2, 77, 3, 40, nsplits=2), device=DEV)
    torch.library.opcheck(
        ops.attention_bwd_convert_dq, (acc, 0.1, 40, 77, None, None, 0.0, torch.bfloat16), test_utils=utils
    )
    acc = torch.randn(A.dq_accum_shape(3, 277, 3, 40, varlen=True), device=DEV)
    torch.library.opcheck(
        ops.attention_bwd_convert_dq, (acc, 0.1, 40, None, cu, 200, 0.0, torch.float16), test_utils=utils
    )
    dk, dv = torch.randn(2, 3, 128, 64, device=DEV), torch.randn(2, 3, 128, 64, device=DEV)
    torch.library.opcheck(
        ops.attention_bwd_convert_dkv, (dk, dv, 0.1, 40, 77, None, 0.0, torch.bfloat16), test_utils=utils
    )
    torch.library.opcheck(ops.attention_bwd_clear_dkv_accum, (dk, dv), test_utils=utils)
