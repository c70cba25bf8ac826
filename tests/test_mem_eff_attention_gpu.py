"""Memory-efficient attention backward on the GPU: ``efficient_attention_backward`` against
the fp64 reference and against ``torch.ops.aten._efficient_attention_backward`` on identical
inputs (out / logsumexp from ``aten._efficient_attention_forward``), feature by feature;
``memory_efficient_attention`` (eager and torch.compile) and ``use_for_sdpa`` in training.

The main criterion: our error against the fp64 reference is at most twice torch's own
backward's error plus a small floor (a fraction of max |ref|); a looser absolute bound
against the reference holds where torch cannot be compared. Where torch 2.11 is known to be
wrong the tests say so and compare with the reference only:

* its forward leaves the first query blocks unmasked for causal from the bottom right with
  more queries than keys (a signed / unsigned comparison): out / lse then come from the
  reference forward instead;
* its backward ignores the bottom-right shift in the sliding-window mask (Mq != Mk);
* its backward never writes dQ rows of queries that see no key (empty key sequences,
  windows past the keys): those rows are left out of the torch comparison, and ours must
  be exactly 0 there.

Every distinct (dtype, head dims) is a JIT compile of our kernel, so shapes and options of
one configuration are looped inside one test.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import ops
from ops import attention as A
from ops import attention_sdpa as SD
from ops.reference import attention_backward_ref, attention_forward_ref, attention_mask_ref

from .helpers import rel_err, tile_error

pytestmark = pytest.mark.gpu

DEV = "cuda"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# against the fp64 reference: max |err| <= REF_TOL * max |ref| (a sanity bound)
REF_TOL = {F16: 5e-3, BF16: 2e-2, F32: 5e-3}
# main criterion: max |err| <= 2 * torch's max |err| + FLOOR * max |ref|
FLOOR = {F16: 1e-3, BF16: 4e-3, F32: 2e-3}
# and per tile of 64 rows: |err| <= TILE_TOL * |ref| (helpers.tile_error), the reference taking
# Δ from the O the kernel is given (attention_backward_ref(out=)); calibrated on the correct
# kernels of both backends (CUTE_KERNELS_TILE_REPORT, tests/conftest.py)
# (largest seen, both backends and torch's own: bf16 3.9e-3, fp16 1.4e-3, fp32 1.2e-6)
TILE_TOL = {F16: 4e-3, BF16: 1.2e-2, F32: 5e-5}
TILE_ERRORS: list = []  # (name, dtype, ours, torch's) of every check: for calibration runs
LSE_ALIGN = 32


def _backward():
    """The memory-efficient kernel, pinned: under backend="auto" an H100 would run the sm90
    kernel for fp16 / bf16 head dims 64 / 96 / 128 / 192 / 256 (tests/test_attention_sm90_gpu.py covers it)."""
    from ops.attention import efficient_attention_backward

    return functools.partial(efficient_attention_backward, backend="mem_eff")


# ----------------------------------------------------------------------------- inputs


def cu_seqlens(lengths):
    return torch.tensor([0] + list(lengths), device=DEV).cumsum(0).to(torch.int32)


def seq_args(mq, mk, lengths):
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k): Nones and (mq, mk) without ``lengths``."""
    if lengths is None:
        return None, None, mq, mk
    return cu_seqlens(lengths[0]), cu_seqlens(lengths[1]), max(max(lengths[0]), 1), max(max(lengths[1]), 1)


def make_qkv(b, mq, mk, h, kd, kv, dtype, gen, layout="bmhk"):
    """q, k, v, dO as [B, M, H, D] tensors: contiguous ("bmhk"), transposed [B, H, M, D]
    tensors ("bhmk", dO too) or q, k, v unbound from one packed [B, M, 3, H, D] ("packed")."""
    r = lambda *s: torch.randn(*s, device=DEV, dtype=dtype, generator=gen)  # noqa: E731
    if layout == "bmhk":
        return r(b, mq, h, kd), r(b, mk, h, kd), r(b, mk, h, kv), r(b, mq, h, kv)
    if layout == "bhmk":
        return tuple(r(b, h, m, d).transpose(1, 2) for m, d in ((mq, kd), (mk, kd), (mk, kv), (mq, kv)))
    assert layout == "packed" and mq == mk and kd == kv
    q, k, v = r(b, mq, 3, h, kd).unbind(2)
    return q, k, v, r(b, mq, h, kv)


def segments(b, mq, mk, lengths):
    """[(Mq, Mk)] per batch entry or packed sequence."""
    if lengths is None:
        return [(mq, mk)] * b
    return list(zip(*lengths))


def torch_forward_ok(mask_type, segs):
    """torch 2.11's forward masks causal-from-bottom-right wrongly when a sequence has Mq > Mk."""
    return not (mask_type == 2 and any(a > b for a, b in segs))


def torch_backward_ok(mask_type, window, segs):
    """torch 2.11's backward drops the bottom-right shift from the window mask."""
    return not (mask_type == 2 and window > 0 and any(a != b for a, b in segs))


def ref_forward(q, k, v, mask_type, window, scale, cq, ck, max_q):
    """(out, lse) in torch's layout from the fp64 reference: out in q's dtype, lse fp32
    [rows, H, round_up(max_q, 32)] padded with +inf, 0 on rows without keys."""
    out, lse = attention_forward_ref(
        q, k, v, custom_mask_type=mask_type, window_size=window, scale=scale, cu_seqlens_q=cq, cu_seqlens_k=ck
    )
    rows, h, n = lse.shape
    padded = torch.full((rows, h, (max_q + LSE_ALIGN - 1) // LSE_ALIGN * LSE_ALIGN), float("inf"), device=DEV)
    padded[..., :n] = lse.float()
    return out.to(q.dtype), padded


def key_coverage(b, mq, mk, mask_type, window, lengths):
    """(query rows that see a key [B, Mq], key rows seen by a query [B, Mk]) as bool tensors."""
    if lengths is None:
        keep = attention_mask_ref(mq, mk, mask_type, window, device=DEV)
        return keep.any(1).expand(b, mq), keep.any(0).expand(b, mk)
    rows_q, rows_k = [], []
    for nq, nk in zip(*lengths):
        keep = attention_mask_ref(nq, nk, mask_type, window, device=DEV)
        rows_q.append(keep.any(1))
        rows_k.append(keep.any(0))
    return torch.cat(rows_q).unsqueeze(0), torch.cat(rows_k).unsqueeze(0)


def check_grad(name, got, ref, dtype, theirs=None, rows=None, floor=None):
    """``got`` vs the fp64 ``ref`` (and torch's ``theirs`` on ``rows``); rows outside ``rows``
    must be exactly 0 (no key / no query there). ``floor`` (broadcastable to ``got``) adds an
    absolute allowance per element: rounding that does not shrink with the gradient."""
    assert got.shape == ref.shape and got.dtype == dtype, (name, got.shape, ref.shape, got.dtype)
    assert torch.isfinite(got).all(), f"{name}: NaN / inf (unwritten rows?)"
    if rows is not None and (~rows).any():
        assert (got[~rows] == 0).all(), f"{name}: rows without keys / queries are not 0"
    mag = ref.abs().max().item() or 1.0
    diff = (got.double() - ref).abs()
    if floor is not None:
        diff = (diff - floor).clamp_min(0.0)
    err = diff.max().item()
    assert err <= REF_TOL[dtype] * mag, (
        f"{name}: max |ours - ref| (beyond the floor) {err:.3g} > {REF_TOL[dtype]} * {mag:.3g}"
    )
    tiles = tile_error(got, ref, floor=floor)
    TILE_ERRORS.append((name, dtype, tiles, None if theirs is None else tile_error(theirs, ref)))
    assert tiles <= TILE_TOL[dtype], f"{name}: a tile of 64 rows errs by {tiles:.3g} of its norm (> {TILE_TOL[dtype]})"
    if theirs is not None:
        sel = (lambda t: t[rows]) if rows is not None else (lambda t: t)  # noqa: E731
        ours_err = (sel(got).double() - sel(ref)).abs().max().item() if sel(ref).numel() else 0.0
        torch_err = (sel(theirs).double() - sel(ref)).abs().max().item() if sel(ref).numel() else 0.0
        bound = 2 * torch_err + FLOOR[dtype] * mag
        assert ours_err <= bound, (
            f"{name}: ours {ours_err:.3g} vs torch {torch_err:.3g} (bound {bound:.3g}, max |ref| {mag:.3g})"
        )


def run_case(
    dtype,
    b,
    mq,
    mk,
    h,
    kd,
    kv,
    *,
    mask_type=0,
    window=0,
    scale=None,
    lengths=None,
    splits=None,
    layout="bmhk",
    seed=0,
    compare_torch=True,
    torch_forward=True,
):
    """One backward: ours vs the reference and vs torch's on the same out / lse."""
    gen = torch.Generator(DEV).manual_seed(seed)
    if lengths is not None:
        b, mq, mk = 1, sum(lengths[0]), sum(lengths[1])
    q, k, v, do = make_qkv(b, mq, mk, h, kd, kv, dtype, gen, layout)
    cq, ck, max_q, max_k = seq_args(mq, mk, lengths)
    segs = segments(b, mq, mk, lengths)
    win = window or None
    if torch_forward and torch_forward_ok(mask_type, segs):
        out, lse, seed_t, offset_t, _, _ = torch.ops.aten._efficient_attention_forward(
            q,
            k,
            v,
            None,
            cq,
            ck,
            max_q if cq is not None else None,
            max_k if cq is not None else None,
            0.0,
            mask_type,
            True,
            scale=scale,
            window_size=win,
        )
    else:
        out, lse = ref_forward(q, k, v, mask_type, window, scale, cq, ck, max_q)
        seed_t = offset_t = torch.empty((), dtype=torch.int64)
    args = (do, q, k, v, None, out, cq, ck, max_q, max_k, lse, 0.0, seed_t, offset_t, mask_type, False)
    kw = dict(scale=scale, num_splits_key=splits, window_size=win)
    dq, dk, dv, _ = _backward()(*args, **kw)
    ref = attention_backward_ref(
        q,
        k,
        v,
        do,
        custom_mask_type=mask_type,
        window_size=window,
        scale=scale,
        cu_seqlens_q=cq,
        cu_seqlens_k=ck,
        out=out,
    )
    theirs = [None] * 3
    if compare_torch and torch_backward_ok(mask_type, window, segs):
        theirs = torch.ops.aten._efficient_attention_backward(*args, **kw)[:3]
    rows_q, rows_k = key_coverage(b, mq, mk, mask_type, window, lengths)
    label = f"{str(dtype)[6:]} B{b} Mq{mq} Mk{mk} H{h} K{kd} Kv{kv} mask{mask_type} w{window} {layout} splits{splits}"
    check_grad(f"dq [{label}]", dq, ref[0], dtype, theirs[0], rows_q)
    check_grad(f"dk [{label}]", dk, ref[1], dtype, theirs[1], rows_k)
    check_grad(f"dv [{label}]", dv, ref[2], dtype, theirs[2], rows_k)


# ---------------------------------------------------------------- feature by feature

HEAD_DIMS = [32, 64, 80, 96, 128, 160, 256]
HEAD_CASES = [(d, t) for t in (F16, BF16) for d in HEAD_DIMS]
SHAPES = [(1, 17, 17, 2), (2, 100, 257, 3)]  # (B, Mq, Mk, H): not multiples of 64


@pytest.mark.parametrize("head_dim,dtype", HEAD_CASES, ids=[f"{str(t)[6:]}-d{d}" for d, t in HEAD_CASES])
def test_head_dims(head_dim, dtype):
    for i, (b, mq, mk, h) in enumerate(SHAPES):
        for mask_type in (0, 1):
            run_case(dtype, b, mq, mk, h, head_dim, head_dim, mask_type=mask_type, seed=i)


# Above 256 (dK / dV accumulated in the fp32 workspace, column loops; sm_90 for > 384):
# (Dqk, Dv, dtype): max_k 320 (column tile 64, two Q / dO stages), 384 and 512 (tile 128),
# Dqk != Dv both ways (chunks past the smaller head dim are skipped).
BIG_HEAD_CASES = [
    (288, 288, F16),
    (288, 288, BF16),
    (384, 384, F16),
    (384, 384, BF16),
    (512, 512, F16),
    (512, 512, BF16),
    (512, 320, BF16),
    (320, 512, F16),
]
# (B, Mq, Mk, H): Mq < Mk leaves key blocks no causal query sees (zfill_grad_kv); Mq > Mk
# walks several query blocks per key block (workspace load / add / store)
BIG_SHAPES = [(2, 100, 257, 2), (1, 300, 130, 2)]
BIG_VARLEN = ([77, 0, 200], [90, 5, 180])  # an empty query sequence, ragged blocks


def _skip_if_smem_short(kd, kv):
    """Above 384 the tiles need sm_90's shared memory: elsewhere the op must refuse clearly."""
    if torch.cuda.get_device_capability()[0] < 9 and max(kd, kv) > 384:
        with pytest.raises(NotImplementedError, match="serves head dims up to"):
            run_case(BF16, 1, 64, 80, 2, kd, kv)
        pytest.skip("head dims above 384 need sm_90 (refused clearly here)")


@pytest.mark.parametrize("kd,kv,dtype", BIG_HEAD_CASES, ids=[f"{str(t)[6:]}-k{a}-v{b}" for a, b, t in BIG_HEAD_CASES])
def test_head_dims_above_256(kd, kv, dtype):
    """Masks 0 / 1, one and two key splits (split keys: Δ from torch, dQ by reductions and
    the counter), then varlen once."""
    _skip_if_smem_short(kd, kv)
    for i, (b, mq, mk, h) in enumerate(BIG_SHAPES):
        for mask_type in (0, 1):
            for splits in (1, 2):
                run_case(dtype, b, mq, mk, h, kd, kv, mask_type=mask_type, splits=splits, seed=kd + kv + i)
    run_case(dtype, 1, 0, 0, 2, kd, kv, mask_type=1, lengths=BIG_VARLEN, seed=1)
    run_case(dtype, 1, 0, 0, 2, kd, kv, mask_type=0, splits=2, lengths=BIG_VARLEN, seed=2)


def test_head_dim_above_256_unaligned_and_window():
    """Head dims that are not multiples of 8 (element-wise copies) and a sliding window."""
    _skip_if_smem_short(512, 512)
    # torch 2.11 has no kernel for these head dims ("cutlassF: no kernel found to launch"):
    # out / lse from the fp64 reference, no comparison with torch's backward.
    run_case(F16, 1, 130, 200, 2, 300, 270, mask_type=1, seed=3, torch_forward=False, compare_torch=False)
    run_case(BF16, 2, 150, 150, 2, 512, 512, mask_type=1, window=40, seed=4)
    run_case(BF16, 2, 150, 150, 2, 512, 512, mask_type=2, window=40, splits=3, seed=5)


def test_head_dim_above_512_not_implemented():
    """Above 512 (fp16 / bf16) and above 256 (fp32): not implemented, said clearly."""
    for dtype, d, limit in ((BF16, 544, "512"), (F32, 288, "256")):
        q = torch.randn(1, 64, 2, d, device=DEV, dtype=dtype)
        lse = torch.zeros(1, 2, 64, device=DEV)
        with pytest.raises(NotImplementedError, match=limit):
            _backward()(q, q, q, q, None, q, None, None, None, None, lse, 0.0, None, None, 1, False)


FP32_CASES = [  # (Dqk, Dv, mask, window, splits, lengths): the SIMT path, every feature once
    (64, 64, 0, 0, None, None),
    (128, 128, 1, 0, None, None),
    (32, 96, 2, 0, None, None),
    (80, 80, 1, 16, None, None),
    (256, 256, 1, 0, None, None),
    (200, 136, 0, 0, None, None),
    (64, 64, 0, 0, 2, None),
    (128, 128, 1, 0, 3, None),
    (64, 64, 1, 8, None, VARLEN_FP32 := ([77, 0, 200, 1], [77, 5, 180, 1])),
    (64, 64, 2, 0, 2, VARLEN_FP32),
]


@pytest.mark.parametrize(
    "case",
    FP32_CASES,
    ids=[f"k{c[0]}-v{c[1]}-m{c[2]}-w{c[3]}-s{c[4]}-{'varlen' if c[5] else 'dense'}" for c in FP32_CASES],
)
def test_fp32(case):
    """fp32 inputs run the SIMT FMA matmuls (no tensor cores): fp32 accuracy."""
    kd, kv, mask_type, window, splits, lengths = case
    for i, (b, mq, mk, h) in enumerate(SHAPES):
        run_case(F32, b, mq, mk, h, kd, kv, mask_type=mask_type, window=window, splits=splits, lengths=lengths, seed=i)
        if lengths is not None:
            break


DQK_DV = [(128, 64), (64, 128), (32, 96)]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("dims", DQK_DV, ids=[f"k{a}-v{b}" for a, b in DQK_DV])
def test_dqk_ne_dv(dims, dtype):
    kd, kv = dims
    for i, (b, mq, mk, h) in enumerate(SHAPES):
        run_case(dtype, b, mq, mk, h, kd, kv, mask_type=i, seed=kd + kv + i)


SEQLENS = [(1, 1), (17, 1000), (1000, 17), (257, 100), (100, 257), (1, 257), (257, 1), (1000, 1000)]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_seqlens_and_masks(dtype):
    """Lengths that are not multiples of the tiles, q shorter and longer than k, all masks."""
    for i, (mq, mk) in enumerate(SEQLENS):
        for mask_type in (0, 1, 2):
            run_case(dtype, 1, mq, mk, 2, 64, 64, mask_type=mask_type, seed=i)


WINDOWS = [(1, 1), (1, 16), (1, 100), (2, 1), (2, 16), (2, 100)]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_windows(dtype):
    """Sliding windows (causal only), q == k, q < k and q > k; windows past the keys leave rows
    without keys (dQ 0)."""
    for mask_type, window in WINDOWS:
        for mq, mk in ((257, 257), (100, 300), (300, 100)):
            run_case(dtype, 1, mq, mk, 2, 64, 64, mask_type=mask_type, window=window, seed=window)


VARLEN = [
    ([77, 0, 200, 1], [77, 5, 180, 1]),  # an empty query sequence, a single row
    ([1, 130, 3], [0, 130, 64]),  # an empty key sequence: its query row sees nothing
    ([300], [257]),
    ([5, 64, 65, 33], [70, 64, 1, 100]),
]


@pytest.mark.parametrize(
    "dtype,head_dim", [(F16, 64), (BF16, 64), (BF16, 128)], ids=["fp16-d64", "bf16-d64", "bf16-d128"]
)
def test_varlen(dtype, head_dim):
    for i, lengths in enumerate(VARLEN):
        for mask_type, window in ((0, 0), (1, 0), (2, 0), (1, 8), (2, 8)):
            run_case(dtype, 1, 0, 0, 2, head_dim, head_dim, mask_type=mask_type, window=window, lengths=lengths, seed=i)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_num_splits_key(splits):
    for mask_type in (0, 1):
        run_case(BF16, 2, 300, 300, 2, 64, 64, mask_type=mask_type, splits=splits)
        run_case(BF16, 1, 200, 513, 2, 128, 128, mask_type=mask_type, splits=splits, seed=1)
    run_case(BF16, 1, 0, 0, 2, 64, 64, mask_type=1, splits=splits, lengths=VARLEN[0])


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_explicit_scale(scale):
    run_case(BF16, 2, 100, 150, 2, 64, 64, mask_type=1, scale=scale)
    run_case(F16, 1, 0, 0, 2, 64, 64, mask_type=0, scale=scale, lengths=VARLEN[1])


@pytest.mark.parametrize("layout", ["bhmk", "packed"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_strided_inputs(layout, dtype):
    """[B, H, M, D] tensors transposed (dO too), and q, k, v unbound from a packed QKV."""
    run_case(dtype, 2, 200, 200, 3, 64, 64, mask_type=1, layout=layout)
    run_case(dtype, 1, 77, 77, 2, 128, 128, mask_type=0, layout=layout, seed=1)
    if layout == "bhmk":
        run_case(dtype, 1, 50, 130, 2, 64, 32, mask_type=2, layout=layout, seed=2)


# ------------------------------------------------------- memory_efficient_attention


def _op_case(dtype, q, k, v, do, causal, window, scale, lengths):
    kw = {}
    if lengths is not None:
        kw = dict(cu_seqlens_q=cu_seqlens(lengths[0]), cu_seqlens_k=cu_seqlens(lengths[1]))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ops.memory_efficient_attention(
        q, k, v, causal=causal, window_size=window, scale=scale, backend="mem_eff", **kw
    )
    out.backward(do)
    mask_type = {False: 0, True: 1, "top_left": 1, "bottom_right": 2}[causal]
    cq, ck = kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")
    ref_out, _ = attention_forward_ref(
        q, k, v, custom_mask_type=mask_type, window_size=window or 0, scale=scale, cu_seqlens_q=cq, cu_seqlens_k=ck
    )
    assert (out.double() - ref_out).abs().max().item() <= REF_TOL[dtype] * ref_out.abs().max().item()
    ref = attention_backward_ref(
        q, k, v, do, custom_mask_type=mask_type, window_size=window or 0, scale=scale, cu_seqlens_q=cq, cu_seqlens_k=ck
    )
    for name, got, want in zip("qkv", (q.grad, k.grad, v.grad), ref):
        check_grad(f"d{name} (memory_efficient_attention {causal} w{window})", got, want, dtype)


OP_CASES = [
    (False, None, None, None),
    (True, None, 0.1, None),
    ("bottom_right", 32, None, None),
    (True, 16, None, ([77, 0, 200, 1], [77, 5, 180, 1])),
    ("bottom_right", None, None, ([10, 100], [20, 100])),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_memory_efficient_attention_autograd(dtype):
    gen = torch.Generator(DEV).manual_seed(0)
    for causal, window, scale, lengths in OP_CASES:
        if lengths is None:
            q, k, v, do = make_qkv(2, 150, 200, 2, 64, 64, dtype, gen)
        else:
            q, k, v, do = make_qkv(1, sum(lengths[0]), sum(lengths[1]), 2, 64, 64, dtype, gen)
        _op_case(dtype, q, k, v, do, causal, window, scale, lengths)


def test_memory_efficient_attention_compiles_fullgraph():
    """torch.compile(fullgraph=True) of forward + loss; the backward runs through the compiled graph."""
    gen = torch.Generator(DEV).manual_seed(3)
    q, k, v, do = make_qkv(2, 130, 130, 2, 64, 64, BF16, gen)

    def loss_fn(q, k, v):
        out = ops.memory_efficient_attention(q, k, v, causal=True, scale=0.125, backend="mem_eff")
        return (out.float() * do.float()).sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True)
    grads = {}
    for name, fn in (("eager", loss_fn), ("compiled", compiled)):
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        fn(qs, ks, vs).backward()
        grads[name] = (qs.grad, ks.grad, vs.grad)
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=1, scale=0.125)
    for i, name in enumerate("qkv"):
        check_grad(f"d{name} (compiled)", grads["compiled"][i], ref[i], BF16)
        assert rel_err(grads["compiled"][i], grads["eager"][i]) < 1e-2


# ---------------------------------------------------------------------- use_for_sdpa


class Block(torch.nn.Module):
    """Linear -> SDPA (efficient backend forced) -> Linear."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, causal=False, attn_mask=None, dropout_p=0.0):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b, m, d = x.shape
        q, k, v = self.qkv(x).view(b, m, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        backends = [SDPBackend.EFFICIENT_ATTENTION] if x.dtype != torch.float64 else [SDPBackend.MATH]
        with sdpa_kernel(backends):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal)
        return self.proj(o.transpose(1, 2).reshape(b, m, d))


class Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


@pytest.fixture
def counted_backward(monkeypatch):
    counter = Counter(A.efficient_attention_backward)
    for module in (A, SD):  # the op's autograd and the SDPA override call it by these names
        monkeypatch.setattr(module, "efficient_attention_backward", counter)
    return counter


def _grads(model, x, target, **kw):
    model.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x, **kw).double(), target.double())
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_use_for_sdpa_training(dtype, causal, counted_backward):
    torch.manual_seed(0)
    dim, heads = 256, 4  # head_dim 64
    base = Block(dim, heads).to(DEV)
    x = torch.randn(2, 200, dim, device=DEV)
    target = torch.randn(2, 200, dim, device=DEV)
    ref_model = copy.deepcopy(base).double()
    _, ref = _grads(ref_model, x.double(), target.double(), causal=causal)
    theirs_model, ours_model = copy.deepcopy(base).to(dtype), copy.deepcopy(base).to(dtype)
    _, theirs = _grads(theirs_model, x.to(dtype), target, causal=causal)
    assert counted_backward.calls == 0
    with ops.use_for_sdpa():
        _, ours = _grads(ours_model, x.to(dtype), target, causal=causal)
    assert counted_backward.calls == 1
    floor = {F16: 1e-3, BF16: 4e-3}[dtype]
    for name in ref:
        mag = ref[name].abs().max().item()
        e_ours = (ours[name].double() - ref[name]).abs().max().item()
        e_theirs = (theirs[name].double() - ref[name]).abs().max().item()
        assert e_ours <= 2 * e_theirs + floor * mag, (
            f"{name}: ours {e_ours:.3g} vs torch {e_theirs:.3g} (max |ref| {mag:.3g})"
        )
    # a few SGD steps with each: the losses stay together
    losses = {}
    for label, model, on in (("torch", theirs_model, False), ("ours", ours_model, True)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with ops.use_for_sdpa(enabled=on):
            for _ in range(3):
                loss, _ = _grads(model, x.to(dtype), target, causal=causal)
                opt.step()
        losses[label] = loss
    assert abs(losses["ours"] - losses["torch"]) <= 2e-2 * abs(losses["torch"])
    assert counted_backward.calls == 4 and not ops.use_for_sdpa.is_enabled()


def test_use_for_sdpa_takes_bias_and_dropout(counted_backward):
    """The override takes an attention bias of the inputs' dtype and dropout
    (the forward's philox seed / offset give torch's mask): gradients as torch's kernel's."""
    torch.manual_seed(1)
    model = Block(128, 2).to(DEV).half()
    x = torch.randn(2, 64, 128, device=DEV, dtype=torch.float16)
    target = torch.randn_like(x)
    bias = torch.randn(2, 2, 64, 64, device=DEV, dtype=torch.float16)
    for kw in (dict(attn_mask=bias), dict(dropout_p=0.1)):
        torch.manual_seed(2)
        _, theirs = _grads(model, x, target, **kw)
        calls = counted_backward.calls
        with ops.use_for_sdpa():
            torch.manual_seed(2)  # the same philox seed / offset as torch's run
            _, ours = _grads(model, x, target, **kw)
        assert counted_backward.calls == calls + 1, kw
        for name in theirs:
            mag = theirs[name].abs().max().item()
            err = (ours[name].double() - theirs[name].double()).abs().max().item()
            assert err <= 2e-2 * mag, f"{list(kw)} {name}: {err:.3g} vs max {mag:.3g}"


def test_use_for_sdpa_dispatch_table_on_cuda():
    def cuda_line():
        return [ln for ln in torch._C._dispatch_dump(SD.SDPA_BACKWARD).splitlines() if ln.startswith("CUDA:")][0]

    before = cuda_line()
    assert "attention_sdpa.py" not in before  # torch's own kernel
    with ops.use_for_sdpa():
        assert "attention_sdpa.py" in cuda_line()
    assert cuda_line() == before
