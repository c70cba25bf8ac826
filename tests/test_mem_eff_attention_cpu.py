"""CPU: the fp64 attention reference against an independent naive autograd implementation
(masks, windows, variable lengths, empty rows), the validation of
``memory_efficient_attention``, its fake implementation, graph capture and autograd
wiring (a reference-backed CPU kernel and backward stand in for the CUDA ones), and
``use_for_sdpa``'s registration, translation, fall-through and restoration."""

import logging
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
from ops import attention as A
from ops import attention_sdpa as SD
from ops.reference import (
    attention_backward_ref,
    attention_forward_ref,
    attention_mask_ref,
    curand_philox_words,
    curand_uniform,
    mem_eff_dropout_keep_mask,
    philox4x32_10,
)
from tests.helpers import trace_custom_ops

F64 = torch.float64
FORWARD_SEED, FORWARD_OFFSET = (
    0x9234_5678_9ABC_DEF0 - (1 << 64),
    37,
)  # a seed with both key halves set (int64 as torch keeps it)


# ------------------------------------------------------------- naive implementation


def naive_keep(nq, nk, mask_type, window):
    """The mask, element by element, written from the kernel's comments."""
    keep = torch.zeros(nq, nk, dtype=torch.bool)
    shift = nk - nq if mask_type == 2 else 0
    for n in range(nq):
        for m in range(nk):
            ok = True
            if mask_type in (1, 2):
                ok = m <= n + shift  # mask if key > query + shift
                if window > 0:
                    ok = ok and not (m <= n + shift - window)
            keep[n, m] = ok
    return keep


def naive_segment(q, k, v, scale, keep):
    """One sequence [M, H, D]: masked softmax without -inf (autograd-safe on empty rows)."""
    nq, h = q.shape[0], q.shape[1]
    if k.shape[0] == 0:
        return q.new_zeros(nq, h, v.shape[-1]) + 0 * q.sum(), q.new_zeros(h, nq)
    s = torch.einsum("nhd,mhd->hnm", q, k) * scale
    w = keep.to(q.dtype)
    m = s.detach().masked_fill(~keep, float("-inf")).amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * w
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    lse = torch.where(den > 0, m + torch.log(torch.where(den > 0, den, torch.ones_like(den))), torch.zeros_like(den))
    return torch.einsum("hnm,mhd->nhd", p, v), lse.squeeze(-1)


def naive_attention(q, k, v, mask_type=0, window=0, scale=None, cu_q=None, cu_k=None):
    """(out, per-sequence lse list) in fp64 with autograd; [B, M, H, D] or packed (B == 1)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_q is None:
        parts = [
            naive_segment(q[b], k[b], v[b], scale, naive_keep(q.shape[1], k.shape[1], mask_type, window))
            for b in range(q.shape[0])
        ]
        return torch.stack([p[0] for p in parts]), [p[1] for p in parts]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qs, ks, vs = q[0, cq[i] : cq[i + 1]], k[0, ck[i] : ck[i + 1]], v[0, ck[i] : ck[i + 1]]
        o, lse = naive_segment(qs, ks, vs, scale, naive_keep(qs.shape[0], ks.shape[0], mask_type, window))
        outs.append(o)
        lses.append(lse)
    rest = q.shape[1] - cq[-1]
    outs.append(q.new_zeros(rest, q.shape[2], v.shape[-1]))
    return torch.cat(outs).unsqueeze(0), lses


def naive_grads(q, k, v, do, **kw):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lses = naive_attention(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), do.double(), allow_unused=True)
    return out.detach(), lses, [torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))]


def cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0).to(torch.int32)


def rand(*shape, gen):
    return torch.randn(*shape, dtype=F64, generator=gen)


def assert_close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert not a.isnan().any(), "NaN"
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ------------------------------------------------------------------------ reference


def test_mask_matches_kernel_comments():
    # bottom right, 3 queries and 5 keys: shift 2; window 2 keeps keys in (n + 2 - 2, n + 2]
    keep = attention_mask_ref(3, 5, 2, 2)
    expected = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(keep, expected)
    assert torch.equal(
        attention_mask_ref(3, 5, 1), torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    )
    assert attention_mask_ref(4, 2, 0).all()
    for nq, nk in ((5, 5), (4, 9), (9, 4), (1, 1), (0, 3), (3, 0)):
        for mt in (0, 1, 2):
            for w in (0, 1, 3) if mt else (0,):
                assert torch.equal(attention_mask_ref(nq, nk, mt, w), naive_keep(nq, nk, mt, w)), (nq, nk, mt, w)
    with pytest.raises(ValueError, match="window_size needs a causal mask"):
        attention_mask_ref(3, 3, 0, 2)


DENSE = [
    # (B, Mq, Mk, H, K, Kv)
    (2, 5, 5, 3, 8, 8),
    (1, 7, 13, 2, 8, 5),  # k longer than q, Dqk != Dv
    (2, 13, 7, 2, 4, 12),  # q longer than k: bottom-right leaves empty rows
    (1, 1, 9, 1, 16, 16),
    (1, 9, 1, 2, 8, 3),
]
MASKS = [(0, 0), (1, 0), (2, 0), (1, 1), (1, 3), (2, 2), (2, 20)]


@pytest.mark.parametrize("shape", DENSE, ids=[f"B{b}q{mq}k{mk}h{h}d{k}v{kv}" for b, mq, mk, h, k, kv in DENSE])
def test_reference_dense_against_naive(shape):
    b, mq, mk, h, kd, kv = shape
    gen = torch.Generator().manual_seed(mq * 100 + mk)
    q, k, v = rand(b, mq, h, kd, gen=gen), rand(b, mk, h, kd, gen=gen), rand(b, mk, h, kv, gen=gen)
    do = rand(b, mq, h, kv, gen=gen)
    for mt, w in MASKS:
        for scale in (None, 0.3):
            kw = dict(mask_type=mt, window=w, scale=scale)
            out_n, lses, (dq_n, dk_n, dv_n) = naive_grads(q, k, v, do, **kw)
            rk = dict(custom_mask_type=mt, window_size=w, scale=scale)
            out, lse = attention_forward_ref(q, k, v, **rk)
            assert_close(out, out_n)
            assert_close(lse, torch.stack(lses))
            dq, dk, dv = attention_backward_ref(q, k, v, do, **rk)
            assert_close(dq, dq_n)
            assert_close(dk, dk_n)
            assert_close(dv, dv_n)


@pytest.mark.parametrize("h,hk", [(4, 2), (3, 1)], ids=["gqa", "mqa"])
def test_reference_grouped_heads_against_naive(h, hk):
    """Key / value with Hk heads serve H / Hk consecutive query heads each: the reference
    equals autograd through key / value repeated per query head."""
    gen = torch.Generator().manual_seed(h * 10 + hk)
    q, k, v, do = (
        rand(2, 6, h, 8, gen=gen),
        rand(2, 9, hk, 8, gen=gen),
        rand(2, 9, hk, 5, gen=gen),
        rand(2, 6, h, 5, gen=gen),
    )
    kx, vx = (t.detach().requires_grad_() for t in (k, v))
    out_n, lses = naive_attention(
        q, kx.repeat_interleave(h // hk, 2), vx.repeat_interleave(h // hk, 2), mask_type=2, window=4
    )
    dk_n, dv_n = torch.autograd.grad(out_n, (kx, vx), do)
    out, lse = attention_forward_ref(q, k, v, custom_mask_type=2, window_size=4)
    assert_close(out, out_n)
    assert_close(lse, torch.stack(lses))
    dq, dk, dv = attention_backward_ref(q, k, v, do, custom_mask_type=2, window_size=4)
    assert dk.shape == k.shape and dv.shape == v.shape
    assert_close(dk, dk_n)
    assert_close(dv, dv_n)
    with pytest.raises(ValueError, match="must divide query heads"):
        attention_backward_ref(q, rand(2, 9, h - 1, 8, gen=gen), rand(2, 9, h - 1, 5, gen=gen), do)


VARLEN = [
    ([3, 0, 1, 6, 4], [5, 2, 0, 6, 1]),  # empty q, empty k, length 1, q longer than k
    ([1], [1]),
    ([0, 7], [4, 3]),
]


@pytest.mark.parametrize("lengths", VARLEN, ids=["mixed", "single", "empty-first"])
def test_reference_varlen_against_naive(lengths):
    lq, lk = lengths
    gen = torch.Generator().manual_seed(sum(lq))
    h, kd, kv = 2, 8, 6
    extra = 2  # packed rows past the last sequence stay untouched (zero grads)
    q, k, v = (
        rand(1, sum(lq) + extra, h, kd, gen=gen),
        rand(1, sum(lk), h, kd, gen=gen),
        rand(1, sum(lk), h, kv, gen=gen),
    )
    do = rand(1, sum(lq) + extra, h, kv, gen=gen)
    cq, ck = cu(lq), cu(lk)
    for mt, w in MASKS:
        out_n, lses, grads_n = naive_grads(q, k, v, do, mask_type=mt, window=w, cu_q=cq, cu_k=ck)
        rk = dict(custom_mask_type=mt, window_size=w, cu_seqlens_q=cq, cu_seqlens_k=ck)
        out, lse = attention_forward_ref(q, k, v, **rk)
        assert_close(out, out_n)
        assert lse.shape == (len(lq), h, max(lq))
        for i, x in enumerate(lses):
            assert_close(lse[i, :, : lq[i]], x)
            assert torch.isinf(lse[i, :, lq[i] :]).all()
        for got, want in zip(attention_backward_ref(q, k, v, do, **rk), grads_n):
            assert_close(got, want)


def test_reference_fully_masked_rows_give_zero():
    """Bottom-right with Mq > Mk and a top-left window past the keys: rows with no key."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = rand(1, 10, 2, 8, gen=gen), rand(1, 4, 2, 8, gen=gen), rand(1, 4, 2, 8, gen=gen)
    do = rand(1, 10, 2, 8, gen=gen)
    for mt, w, empty in ((2, 0, range(0, 6)), (1, 2, range(5, 10)), (2, 1, range(0, 6))):
        out, lse = attention_forward_ref(q, k, v, custom_mask_type=mt, window_size=w)
        dq, dk, dv = attention_backward_ref(q, k, v, do, custom_mask_type=mt, window_size=w)
        rows = list(empty)
        assert (out[0, rows] == 0).all() and (lse[0, :, rows] == 0).all()
        assert (dq[0, rows] == 0).all()
        for t in (out, lse, dq, dk, dv):
            assert torch.isfinite(t).all()
        _, _, (dq_n, dk_n, dv_n) = naive_grads(q, k, v, do, mask_type=mt, window=w)
        assert_close(dk, dk_n)
        assert_close(dv, dv_n)
    _, lse = attention_forward_ref(q, k, v, custom_mask_type=2, empty_row_lse=float("-inf"))
    assert torch.isneginf(lse[0, :, :6]).all()


def test_reference_accepts_low_precision_inputs():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (rand(1, 6, 2, 8, gen=gen).to(torch.bfloat16) for _ in range(3))
    dq, dk, dv = attention_backward_ref(q, k, v, rand(1, 6, 2, 8, gen=gen).half(), custom_mask_type=1)
    assert dq.dtype == dk.dtype == dv.dtype == F64


# ------------------------------------------------------------------------ validation


def fake_cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="cuda", dtype=dtype)


def _mea(**kw):
    args = dict(query=fake_cuda(1, 40, 2, 64), key=fake_cuda(1, 48, 2, 64), value=fake_cuda(1, 48, 2, 32))
    args.update(kw)
    return args


def _cu(n=3, dtype=torch.int32):
    return fake_cuda(n, dtype=dtype)


BAD = [
    ("cpu query", lambda: _mea(query=torch.zeros(1, 40, 2, 64)), ValueError, "query must be a CUDA"),
    ("key not a tensor", lambda: _mea(key=[1.0]), TypeError, "key must be a torch.Tensor"),
    ("cpu key", lambda: _mea(key=torch.zeros(1, 48, 2, 64, dtype=torch.bfloat16)), ValueError, "key is on cpu"),
    ("int query", lambda: _mea(query=fake_cuda(1, 40, 2, 64, dtype=torch.int32)), TypeError, "query must have dtype"),
    ("fp64 query", lambda: _mea(query=fake_cuda(1, 40, 2, 64, dtype=F64)), TypeError, "query must have dtype"),
    (
        "key dtype",
        lambda: _mea(key=fake_cuda(1, 48, 2, 64, dtype=torch.float16)),
        TypeError,
        "key must have query's dtype",
    ),
    (
        "value dtype",
        lambda: _mea(value=fake_cuda(1, 48, 2, 32, dtype=torch.float32)),
        TypeError,
        "value must have query's dtype",
    ),
    ("3-D query", lambda: _mea(query=fake_cuda(40, 2, 64)), ValueError, "query must be 4-D"),
    ("5-D value", lambda: _mea(value=fake_cuda(1, 48, 2, 1, 32)), ValueError, "value must be 4-D"),
    ("key heads", lambda: _mea(key=fake_cuda(1, 48, 3, 64)), ValueError, "Hk heads dividing query's 2"),
    ("key head_dim", lambda: _mea(key=fake_cuda(1, 48, 2, 32)), ValueError, "key must have shape (1, Mk, Hk, 64)"),
    ("key batch", lambda: _mea(key=fake_cuda(2, 48, 2, 64)), ValueError, "key must have shape"),
    (
        "value seqlen",
        lambda: _mea(value=fake_cuda(1, 47, 2, 32)),
        ValueError,
        "value must have key's batch, seqlen and heads",
    ),
    (
        "empty head_dim",
        lambda: _mea(query=fake_cuda(1, 40, 2, 0), key=fake_cuda(1, 48, 2, 0)),
        ValueError,
        "query must have head_dim >= 1",
    ),
    (
        "strided head_dim",
        lambda: _mea(
            query=torch.empty_strided((1, 40, 2, 64), (10240, 256, 128, 2), device="cuda", dtype=torch.bfloat16)
        ),
        ValueError,
        "query must be contiguous in its last dim",
    ),
    (
        "causal typo",
        lambda: _mea(causal="bottom-right"),
        ValueError,
        "causal must be False, True, 'top_left' or 'bottom_right'",
    ),
    ("causal int", lambda: _mea(causal=1), ValueError, "causal must be"),
    ("window without causal", lambda: _mea(window_size=8), ValueError, "window_size needs causal"),
    ("negative window", lambda: _mea(causal=True, window_size=-1), ValueError, "window_size must be >= 0"),
    ("float window", lambda: _mea(causal=True, window_size=2.0), TypeError, "window_size must be an int"),
    ("nan scale", lambda: _mea(scale=float("nan")), TypeError, "scale must be a finite float"),
    ("string scale", lambda: _mea(scale="0.1"), TypeError, "scale must be a finite float"),
    ("cu_seqlens_q alone", lambda: _mea(cu_seqlens_q=_cu()), ValueError, "cu_seqlens_k is required"),
    ("cu_seqlens_k alone", lambda: _mea(cu_seqlens_k=_cu()), ValueError, "cu_seqlens_q is required"),
    (
        "int64 cu_seqlens",
        lambda: _mea(cu_seqlens_q=_cu(dtype=torch.int64), cu_seqlens_k=_cu(), max_seqlen_q=8, max_seqlen_k=8),
        TypeError,
        "cu_seqlens_q must be int32",
    ),
    (
        "2-D cu_seqlens",
        lambda: _mea(
            cu_seqlens_q=_cu(), cu_seqlens_k=fake_cuda(3, 1, dtype=torch.int32), max_seqlen_q=8, max_seqlen_k=8
        ),
        ValueError,
        "cu_seqlens_k must be a 1-D tensor",
    ),
    (
        "short cu_seqlens",
        lambda: _mea(cu_seqlens_q=_cu(1), cu_seqlens_k=_cu(1), max_seqlen_q=8, max_seqlen_k=8),
        ValueError,
        "cu_seqlens_q must be a 1-D tensor [num_seqs + 1] with at least 2 entries",
    ),
    (
        "cu_seqlens lengths differ",
        lambda: _mea(cu_seqlens_q=_cu(3), cu_seqlens_k=_cu(4), max_seqlen_q=8, max_seqlen_k=8),
        ValueError,
        "cu_seqlens_k must have cu_seqlens_q's shape",
    ),
    (
        "cpu cu_seqlens",
        lambda: _mea(
            cu_seqlens_q=torch.zeros(3, dtype=torch.int32), cu_seqlens_k=_cu(), max_seqlen_q=8, max_seqlen_k=8
        ),
        ValueError,
        "cu_seqlens_q is on cpu",
    ),
    (
        "varlen batch 2",
        lambda: _mea(
            query=fake_cuda(2, 40, 2, 64),
            key=fake_cuda(2, 48, 2, 64),
            value=fake_cuda(2, 48, 2, 32),
            cu_seqlens_q=_cu(),
            cu_seqlens_k=_cu(),
            max_seqlen_q=8,
            max_seqlen_k=8,
        ),
        ValueError,
        "query must have batch 1 with cu_seqlens_q",
    ),
    (
        "max_seqlen without cu_seqlens",
        lambda: _mea(max_seqlen_q=40),
        ValueError,
        "max_seqlen_q is only used with cu_seqlens",
    ),
    (
        "zero max_seqlen",
        lambda: _mea(cu_seqlens_q=_cu(), cu_seqlens_k=_cu(), max_seqlen_q=8, max_seqlen_k=0),
        ValueError,
        "max_seqlen_k must be >= 1",
    ),
    (
        "float max_seqlen",
        lambda: _mea(cu_seqlens_q=_cu(), cu_seqlens_k=_cu(), max_seqlen_q=8.0, max_seqlen_k=8),
        TypeError,
        "max_seqlen_q must be an int",
    ),
    (
        "max_seqlen past M",
        lambda: _mea(cu_seqlens_q=_cu(), cu_seqlens_k=_cu(), max_seqlen_q=41, max_seqlen_k=8),
        ValueError,
        "max_seqlen_q (41) is longer than query's packed length 40",
    ),
    (
        "varlen max_seqlen missing when tracing",
        lambda: _mea(cu_seqlens_q=_cu(), cu_seqlens_k=_cu(), max_seqlen_q=8),
        ValueError,
        "max_seqlen_q and max_seqlen_k are required",
    ),
    (
        "bottom_right more queries",
        lambda: _mea(query=fake_cuda(1, 60, 2, 64), causal="bottom_right"),
        NotImplementedError,
        "causal='bottom_right' with more queries than keys (60 > 48)",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_raise_before_launch(case):
    _, build, err, fragment = case
    with FakeTensorMode(allow_non_fake_inputs=True):
        kwargs = build()
        with pytest.raises(err, match=re.escape(fragment)):
            ops.memory_efficient_attention(**kwargs)


CU_VALUES = [
    ([1, 3, 5], 10, None, "cu_seqlens_q must start at 0"),
    ([0, 4, 3, 6], 10, None, "cu_seqlens_q must be non-decreasing"),
    ([0, 4, 11], 10, None, "cu_seqlens_q ends at 11, past the packed length 10"),
    ([0, 4, 10], 10, 5, "max_seqlen_q (5) is shorter than the longest sequence in cu_seqlens_q (6)"),
]


@pytest.mark.parametrize(
    "values,total,max_seqlen,fragment", CU_VALUES, ids=["start", "decreasing", "past-end", "max-short"]
)
def test_cu_seqlens_values_are_checked(values, total, max_seqlen, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        A._check_cu_values("cu_seqlens_q", torch.tensor(values, dtype=torch.int32), total, max_seqlen, "max_seqlen_q")
    longest, lengths = A._check_cu_values("cu_seqlens_q", cu([3, 0, 5]), 8, None, "max_seqlen_q")
    assert longest == 5 and lengths == [3, 0, 5]


def test_varlen_dropout_refuses_torchs_forward():
    """Where our forward does not apply, dropout with variable lengths raises instead of running
    torch's forward, whose keep mask no backward replays (meta tensors: no arch, so not ours)."""
    q, k, v = (torch.empty(1, 90, 2, 64, dtype=torch.bfloat16, device="meta") for _ in range(3))
    cq = ck = torch.empty(3, dtype=torch.int32, device="meta")
    with pytest.raises(NotImplementedError, match="dropout with variable lengths needs our forward"):
        A._mea_impl(q, k, v, cq, ck, 60, 60, 0, 0, None, None, 0.1)


def test_fake_implementation_shapes():
    with FakeTensorMode():
        q, k, v = fake_cuda(2, 70, 3, 64), fake_cuda(2, 50, 3, 64), fake_cuda(2, 50, 3, 40)
        out, lse, seed, offset = A._mea_forward(q, k, v, None, None, 70, 50, 1, 0, None)
        assert seed.dtype == offset.dtype == torch.int64 and seed.shape == offset.shape == ()
        assert out.shape == (2, 70, 3, 40) and out.dtype == torch.bfloat16
        assert lse.shape == (2, 3, 96) and lse.dtype == torch.float32  # rows padded to a multiple of 32
        q, k, v = fake_cuda(1, 90, 2, 32), fake_cuda(1, 80, 2, 32), fake_cuda(1, 80, 2, 32)
        cq, ck = fake_cuda(5, dtype=torch.int32), fake_cuda(5, dtype=torch.int32)
        out, lse, _, _ = A._mea_forward(q, k, v, cq, ck, 33, 40, 2, 8, 0.5)
        assert out.shape == (1, 90, 2, 32) and lse.shape == (4, 2, 64)  # [num_seqs, H, round_up(max_seqlen_q, 32)]
        out = ops.memory_efficient_attention(
            q, k, v, causal=True, window_size=4, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=33, max_seqlen_k=40
        )
        assert out.shape == (1, 90, 2, 32)


def test_traces_in_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) sees the forward as our op, validation included."""
    monkeypatch.setattr(A, "check_cuda", lambda *a: None)  # CPU tensors stand in for CUDA ones
    q, k, v = torch.randn(1, 12, 2, 16), torch.randn(1, 12, 2, 16), torch.randn(1, 12, 2, 8)
    found = trace_custom_ops(
        lambda q, k, v: ops.memory_efficient_attention(q, k, v, causal="bottom_right", scale=0.2) * 2, q, k, v
    )
    assert any("memory_efficient_attention" in f for f in found)
    cq = cu([5, 7])
    found = trace_custom_ops(
        lambda q, k, v, c: ops.memory_efficient_attention(
            q, k, v, causal=True, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=7, max_seqlen_k=7
        ),
        q,
        k,
        v,
        cq,
    )
    assert any("memory_efficient_attention" in f for f in found)


# ------------------------------------------------------ autograd wiring (on the CPU)


def _lse_padded(lse_ref, max_q):
    """The reference lse in torch's layout: fp32, rows padded with +inf to a multiple of 32."""
    rows, h, n = lse_ref.shape
    lse = torch.full((rows, h, A.lse_rows(max_q)), float("inf"), dtype=torch.float32)
    lse[..., :n] = lse_ref
    return lse


class BackwardStandIn:
    """Stands in for ops.attention.efficient_attention_backward: checks the call's
    conventions and answers with the fp64 reference (cast to the inputs' dtype)."""

    def __init__(self):
        self.calls = []

    def __call__(
        self,
        grad_out_,
        query,
        key,
        value,
        bias,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        logsumexp,
        dropout_p,
        philox_seed,
        philox_offset,
        custom_mask_type,
        bias_requires_grad,
        *,
        scale=None,
        num_splits_key=None,
        window_size=None,
        shared_storage_dqdkdv=False,
        backend="auto",
        deterministic=None,
    ):
        self.calls.append(
            dict(
                mask=custom_mask_type,
                window=window_size,
                scale=scale,
                max=(max_seqlen_q, max_seqlen_k),
                bias=bias,
                dropout_p=dropout_p,
                bias_requires_grad=bias_requires_grad,
                backend=backend,
                deterministic=deterministic,
            )
        )
        assert philox_seed.dtype == philox_offset.dtype == torch.int64
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        b, mq, h, kv = out.shape
        rows = b if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
        assert logsumexp.dtype == torch.float32 and logsumexp.shape == (rows, h, A.lse_rows(max_seqlen_q))
        assert grad_out_.shape == out.shape and query.shape[:3] == (b, mq, h)
        mask = None
        if dropout_p > 0.0:  # the forward's bits, from the seed / offset it returned
            mask = mem_eff_dropout_keep_mask(int(philox_seed), int(philox_offset), b, h, mq, key.shape[1], dropout_p)
        if bias is not None:
            assert bias.shape == (b, h, mq, key.shape[1])
        dq, dk, dv, db = attention_backward_ref(
            query,
            key,
            value,
            grad_out_,
            custom_mask_type=custom_mask_type,
            window_size=window_size or 0,
            scale=scale,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            bias=bias,
            dropout_mask=mask,
            dropout_p=dropout_p,
            return_grad_bias=True,
        )
        # fresh [B, M, H, K] tensors, as torch's at::empty(query.sizes())
        grads = tuple(g.to(t.dtype).contiguous() for g, t in ((dq, query), (dk, key), (dv, value)))
        return grads + (db.to(bias.dtype) if bias_requires_grad else None,)


@pytest.fixture
def cpu_attention(monkeypatch):
    """ops.memory_efficient_attention runnable on CPU tensors: a reference forward kernel at
    the CPU key, the backward stand-in, CUDA checks off. Yields the stand-in."""
    lib = torch.library.Library("cute_kernels", "IMPL")

    def forward(
        query,
        key,
        value,
        cq,
        ck,
        max_q,
        max_k,
        mask_type,
        window,
        scale,
        attn_bias=None,
        dropout_p=0.0,
        backend="auto",
        deterministic=False,
    ):
        mask = None
        seed, offset = torch.tensor(FORWARD_SEED), torch.tensor(FORWARD_OFFSET)
        if dropout_p > 0.0:  # torch's forward's mask for its philox state: the twin's
            b, mq, h, _ = query.shape
            mask = mem_eff_dropout_keep_mask(FORWARD_SEED, FORWARD_OFFSET, b, h, mq, key.shape[1], dropout_p)
        out, lse = attention_forward_ref(
            query,
            key,
            value,
            custom_mask_type=mask_type,
            window_size=window,
            scale=scale,
            cu_seqlens_q=cq,
            cu_seqlens_k=ck,
            bias=attn_bias,
            dropout_mask=mask,
            dropout_p=dropout_p,
        )
        if cq is not None:
            assert lse.shape[-1] <= max_q
        return out.to(query.dtype), _lse_padded(lse, max_q), seed, offset

    lib.impl("memory_efficient_attention", forward, "CPU")
    stand_in = BackwardStandIn()
    monkeypatch.setattr(A, "efficient_attention_backward", stand_in)
    monkeypatch.setattr(A, "check_cuda", lambda *a: None)
    yield stand_in
    lib._destroy()


WIRING = [
    # (Mq, Mk, causal, window, scale, lengths)
    (9, 9, False, None, None, None),
    (7, 12, "bottom_right", 3, 0.25, None),
    (12, 7, True, 2, None, None),
    (16, 21, True, None, 0.5, ([5, 0, 1, 10], [6, 4, 0, 11])),
    (16, 21, "bottom_right", 4, None, ([5, 0, 1, 10], [6, 4, 1, 10])),
]


@pytest.mark.parametrize(
    "case", WIRING, ids=["plain", "bottom-right-window", "top-left-window", "varlen", "varlen-bottom-right"]
)
def test_autograd_wiring(cpu_attention, case):
    mq, mk, causal, window, scale, lengths = case
    gen = torch.Generator().manual_seed(mq + mk)
    h, kd, kv = 2, 16, 8
    q, k, v = (torch.randn(1, m, h, d, generator=gen).requires_grad_() for m, d in ((mq, kd), (mk, kd), (mk, kv)))
    do = torch.randn(1, mq, h, kv, generator=gen)
    kw = {}
    if lengths is not None:
        kw = dict(cu_seqlens_q=cu(lengths[0]), cu_seqlens_k=cu(lengths[1]))
    out = ops.memory_efficient_attention(q, k, v, causal=causal, window_size=window, scale=scale, **kw)
    out.backward(do)
    mask_type = {False: 0, True: 1, "bottom_right": 2}[causal]
    _, _, want = naive_grads(
        q,
        k,
        v,
        do,
        mask_type=mask_type,
        window=window or 0,
        scale=scale,
        cu_q=kw.get("cu_seqlens_q"),
        cu_k=kw.get("cu_seqlens_k"),
    )
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    (call,) = cpu_attention.calls
    assert call["mask"] == mask_type and call["window"] == window and call["scale"] == scale
    if lengths is None:
        assert call["max"] == (mq, mk)
    else:
        assert call["max"] == (max(lengths[0]), max(lengths[1]))  # read from cu_seqlens


def test_autograd_wiring_keeps_given_max_seqlens(cpu_attention):
    q, k, v = (torch.randn(1, 10, 2, 8, requires_grad=True) for _ in range(3))
    c = cu([4, 6])
    ops.memory_efficient_attention(
        q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, max_seqlen_q=8, max_seqlen_k=9
    ).sum().backward()
    assert cpu_attention.calls[0]["max"] == (8, 9)


@pytest.mark.parametrize("backend", [None, "auto", "sm90", "mem_eff"])
def test_autograd_wiring_passes_the_backend(cpu_attention, backend):
    """memory_efficient_attention(backend=) reaches the backward unchanged ("auto" when not given)."""
    q, k, v = (torch.randn(1, 10, 2, 8, requires_grad=True) for _ in range(3))
    kw = {} if backend is None else dict(backend=backend)
    ops.memory_efficient_attention(q, k, v, causal=True, **kw).sum().backward()
    assert cpu_attention.calls[0]["backend"] == (backend or "auto")


@pytest.mark.parametrize("deterministic,torch_flag", [(None, False), (None, True), (True, False), (False, True)])
def test_autograd_wiring_passes_deterministic(cpu_attention, deterministic, torch_flag):
    """memory_efficient_attention(deterministic=) reaches the backward; None takes torch's
    deterministic-algorithms flag at the call."""
    q, k, v = (torch.randn(1, 10, 2, 8, requires_grad=True) for _ in range(3))
    kw = {} if deterministic is None else dict(deterministic=deterministic)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_flag)
    try:
        out = ops.memory_efficient_attention(q, k, v, causal=True, **kw)
    finally:
        torch.use_deterministic_algorithms(before)
    out.sum().backward()
    assert cpu_attention.calls[0]["deterministic"] is (torch_flag if deterministic is None else deterministic)


def test_memory_efficient_attention_deterministic_must_be_a_bool(cpu_attention):
    q, k, v = (torch.randn(1, 10, 2, 8) for _ in range(3))
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        ops.memory_efficient_attention(q, k, v, deterministic=1)


# ---------------------------------------------------------------------- use_for_sdpa


def _kernel_line(key="CUDA"):
    lines = [ln for ln in torch._C._dispatch_dump(SD.SDPA_BACKWARD).splitlines() if ln.startswith(key + ":")]
    return lines[0] if lines else None


def test_use_for_sdpa_registers_and_restores():
    assert not ops.use_for_sdpa.is_enabled()
    before = torch._C._dispatch_dump(SD.SDPA_BACKWARD)
    had_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(SD.SDPA_BACKWARD, "CUDA")
    with ops.use_for_sdpa() as ctx:
        assert isinstance(ctx, ops.use_for_sdpa) and ops.use_for_sdpa.is_enabled()
        assert torch._C._dispatch_has_kernel_for_dispatch_key(SD.SDPA_BACKWARD, "CUDA")
        assert "attention_sdpa.py" in _kernel_line(), _kernel_line()
        with ops.use_for_sdpa(enabled=False):  # nested: off for the block, back on after
            assert _kernel_line() is None or "attention_sdpa.py" not in _kernel_line()
        assert "attention_sdpa.py" in _kernel_line()
        with ops.use_for_sdpa():  # nested on: stays on after
            pass
        assert ops.use_for_sdpa.is_enabled()
    assert not ops.use_for_sdpa.is_enabled()
    assert torch._C._dispatch_has_kernel_for_dispatch_key(SD.SDPA_BACKWARD, "CUDA") == had_kernel
    assert torch._C._dispatch_dump(SD.SDPA_BACKWARD) == before
    # the functions: idempotent, reversible
    ops.use_for_sdpa.enable()
    ops.use_for_sdpa.enable()
    assert "attention_sdpa.py" in _kernel_line()
    ops.use_for_sdpa.disable()
    ops.use_for_sdpa.disable()
    assert torch._C._dispatch_dump(SD.SDPA_BACKWARD) == before


def test_use_for_sdpa_restores_on_error():
    before = torch._C._dispatch_dump(SD.SDPA_BACKWARD)
    with pytest.raises(RuntimeError, match="boom"):
        with ops.use_for_sdpa():
            raise RuntimeError("boom")
    assert torch._C._dispatch_dump(SD.SDPA_BACKWARD) == before and not ops.use_for_sdpa.is_enabled()


@pytest.fixture
def sdpa_on_cpu(monkeypatch):
    """Our SDPA backward registered at the CPU key, the backward stand-in, a recorder for the
    inner aten op (which has no CPU kernel). Yields (stand-in, recorded fall-through calls)."""
    stand_in = BackwardStandIn()
    monkeypatch.setattr(SD, "efficient_attention_backward", stand_in)
    fallen = []

    def inner(*args, **kwargs):
        fallen.append((args, kwargs))
        g, q, k, v = args[:4]
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    monkeypatch.setattr(SD, "_aten_efficient_attention_backward", inner)
    SD._enable_sdpa("CPU")
    yield stand_in, fallen
    SD._disable_sdpa("CPU")


def _sdpa_inputs(b=2, h=3, mq=10, mk=14, kd=16, kv=8, causal=False, scale=None, seed=0):
    """[B, H, M, K] inputs as SDPA saves them, out / lse from the reference forward."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, m, d, generator=gen) for m, d in ((mq, kd), (mk, kd), (mk, kv)))
    do = torch.randn(b, h, mq, kv, generator=gen)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse = attention_forward_ref(t(q), t(k), t(v), custom_mask_type=int(causal), scale=scale)
    return q, k, v, do, t(out).float(), _lse_padded(lse, mq)


def _empty_long():
    return torch.empty((), dtype=torch.int64)


@pytest.mark.parametrize("causal,scale", [(False, None), (True, 0.3)])
def test_sdpa_override_translates_to_our_backward(sdpa_on_cpu, causal, scale):
    stand_in, fallen = sdpa_on_cpu
    q, k, v, do, out, lse = _sdpa_inputs(causal=causal, scale=scale)
    dq, dk, dv, db = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, None, out, lse, _empty_long(), _empty_long(), 0.0, [True, True, True, False], causal, scale=scale
    )
    assert not fallen and len(stand_in.calls) == 1
    assert stand_in.calls[0]["mask"] == int(causal) and stand_in.calls[0]["max"] == (10, 14)
    assert db is None
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.transpose(1, 2).is_contiguous()  # [B, H, M, K] views of [B, M, H, K] memory, as torch returns
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    want = naive_grads(t(q), t(k), t(v), t(do), mask_type=int(causal), scale=scale)[2]
    for got, ref in zip((dq, dk, dv), want):
        torch.testing.assert_close(t(got).double(), ref, atol=1e-5, rtol=1e-5)


FALLS = [
    ("bias-dtype", dict(attn_bias=torch.float64), "attn_bias dtype torch.float64"),
    ("dropout-1", dict(dropout_p=1.0), "dropout_p = 1.0"),
    ("not implemented", dict(raise_ni=True), "NotImplementedError: head_dim 999"),
]


@pytest.mark.parametrize("case", FALLS, ids=[c[0] for c in FALLS])
def test_sdpa_override_falls_through_like_torch(sdpa_on_cpu, caplog, monkeypatch, case):
    _, opts, reason = case
    stand_in, fallen = sdpa_on_cpu
    if opts.get("raise_ni"):

        def refuse(*a, **k):
            raise NotImplementedError("head_dim 999")

        monkeypatch.setattr(SD, "efficient_attention_backward", refuse)
    q, k, v, do, out, lse = _sdpa_inputs(causal=True)
    bias = torch.randn(2, 3, 10, 14, dtype=opts["attn_bias"]) if opts.get("attn_bias") else None
    p = opts.get("dropout_p", 0.0)
    seed, offset = _empty_long(), _empty_long()
    with caplog.at_level(logging.DEBUG, logger="cute_kernels"):
        dq, dk, dv, db = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, bias, out, lse, seed, offset, p, [True, True, True, bias is not None], True, scale=0.5
        )
    assert not stand_in.calls and len(fallen) == 1
    args, kwargs = fallen[0]
    g, qt, kt, vt, b, o, cq, ck, mq, mk, l, dp, s, off, mt, brg = args
    assert (
        torch.equal(qt, q.transpose(1, 2))
        and torch.equal(g, do.transpose(1, 2))
        and torch.equal(o, out.transpose(1, 2))
    )
    assert b is bias and cq is None and ck is None and (mq, mk) == (10, 14) and l is lse and dp == p
    assert s is seed and off is offset and mt == 1 and brg == (bias is not None)
    assert kwargs == dict(scale=0.5, num_splits_key=None)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and db is None
    msgs = [r.getMessage() for r in caplog.records if r.name == "cute_kernels"]
    assert len(msgs) == 1 and reason in msgs[0], msgs


@pytest.mark.parametrize("bias_grad", [False, True])
def test_sdpa_override_translates_bias_and_dropout(sdpa_on_cpu, bias_grad):
    """SDPA's bias (its [B, H, Mq, Mk] expanded view) and dropout (philox seed / offset)
    reach our backward; the bias gradient comes back when SDPA asks for it."""
    stand_in, fallen = sdpa_on_cpu
    b, h, mq, mk, p = 2, 3, 10, 14, 0.2
    q, k, v, do, _, _ = _sdpa_inputs(causal=True)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(1, h, mq, mk, generator=gen).expand(b, h, mq, mk)  # broadcast over batch, stride 0
    mask = mem_eff_dropout_keep_mask(FORWARD_SEED, FORWARD_OFFSET, b, h, mq, mk, p)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse = attention_forward_ref(t(q), t(k), t(v), custom_mask_type=1, bias=bias, dropout_mask=mask, dropout_p=p)
    seed, offset = torch.tensor(FORWARD_SEED), torch.tensor(FORWARD_OFFSET)
    dq, dk, dv, db = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, bias, t(out).float(), _lse_padded(lse, mq), seed, offset, p, [True, True, True, bias_grad], True
    )
    assert not fallen and len(stand_in.calls) == 1
    call = stand_in.calls[0]
    assert call["bias"].shape == (b, mq, h, mk)[:1] + (h, mq, mk) and call["dropout_p"] == p
    assert call["bias_requires_grad"] == bias_grad
    z = mask.double() / (1 - p)
    leaves = [t(x).double().requires_grad_() for x in (q, k, v)] + [bias.double().clone().requires_grad_()]
    want_out = naive_attention_bias_dropout(*leaves[:3], leaves[3], z, 1)
    want = torch.autograd.grad(want_out, leaves, t(do).double())
    for got, ref in zip((dq, dk, dv), want[:3]):
        torch.testing.assert_close(t(got).double(), ref, atol=1e-5, rtol=1e-5)
    if bias_grad:
        assert db.shape == (b, h, mq, mk)  # full shape, as aten's: SDPA's autograd sums it
        torch.testing.assert_close(db.double(), want[3], atol=1e-5, rtol=1e-5)
    else:
        assert db is None


def test_sdpa_override_undefined_grad_out(sdpa_on_cpu):
    assert SD._sdpa_backward_override(None, *([None] * 8), 0.0, [True] * 4) == (None, None, None, None)


# ---------------------------------------------------------------- bias and dropout


def naive_attention_bias_dropout(q, k, v, bias, z, mask_type=0, window=0, scale=None):
    """[B, M, H, D] fp64 with autograd through q, k, v and bias [B, H, Mq, Mk]; z multiplies
    the probabilities (the dropout's 0 or 1 / (1 - p))."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keep = naive_keep(q.shape[1], k.shape[1], mask_type, window)
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale + bias
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhnm,bmhd->bnhd", p * z, v)


@pytest.mark.parametrize("mask_type,window", [(0, 0), (1, 0), (2, 3)])
def test_reference_with_bias_and_dropout_matches_autograd(mask_type, window):
    gen = torch.Generator().manual_seed(7 + mask_type)
    b, h, mq, mk, d, dv, p = 2, 3, 9, 11, 8, 5, 0.3
    q, k, v = rand(b, mq, h, d, gen=gen), rand(b, mk, h, d, gen=gen), rand(b, mk, h, dv, gen=gen)
    bias = rand(b, h, mq, mk, gen=gen)
    do = rand(b, mq, h, dv, gen=gen)
    mask = mem_eff_dropout_keep_mask(99, 5, b, h, mq, mk, p)
    assert 0 < mask.sum() < mask.numel()
    z = mask.double() / (1 - p)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = naive_attention_bias_dropout(*leaves[:3], leaves[3], z, mask_type, window)
    want = torch.autograd.grad(out, leaves, do)
    got_out, _ = attention_forward_ref(
        q, k, v, custom_mask_type=mask_type, window_size=window, bias=bias, dropout_mask=mask, dropout_p=p
    )
    assert_close(got_out, out.detach())
    got = attention_backward_ref(
        q,
        k,
        v,
        do,
        custom_mask_type=mask_type,
        window_size=window,
        bias=bias,
        dropout_mask=mask,
        dropout_p=p,
        return_grad_bias=True,
    )
    for g, w in zip(got, want):
        assert_close(g, w)


# Random123's known-answer vectors (kat_vectors, philox4x32 10): counter, key, output
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,want", PHILOX_KAT)
def test_philox_twin_known_answers(counter, key, want):
    assert tuple(int(w) for w in philox4x32_10(counter, key)) == want


class CurandPhiloxState:
    """curand's curandStatePhilox4_32_10_t written from curand_philox4x32_x.h's semantics with
    Python ints (an independent check of the twin's word indexing): curand_init, skipahead,
    curand4 with its STATE mixing of the current and the next output."""

    def __init__(self, seed, subsequence, offset):
        self.key = (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF)
        self.ctr = subsequence << 64  # skipahead_sequence: counter.zw += subsequence
        self.state = 0
        self.skipahead(offset)

    def _output(self):
        c = self.ctr % (1 << 128)
        words = [(c >> (32 * i)) & 0xFFFFFFFF for i in range(4)]
        return [int(w) for w in philox4x32_10(words, self.key)]

    def skipahead(self, n):
        self.state += n & 3
        n //= 4
        if self.state > 3:
            n += 1
            self.state -= 4
        self.ctr += n
        self.output = self._output()

    def uniform4(self):
        cur = self.output
        self.ctr += 1  # Philox_State_Incr
        self.output = self._output()
        words = (cur + self.output)[self.state : self.state + 4]
        return curand_uniform(words)


@pytest.mark.parametrize(
    "seed,offset,elem", [(0, 0, 0), (2**63 + 5, 3, 1), (123456789, 6, 10**6 + 2), (2**40 + 7, 2**33 + 1, 5)]
)
def test_curand_skipahead_and_uniform4_match_word_indexing(seed, offset, elem):
    """curand_init(seed, 0, offset) + skipahead(elem) + curand_uniform4 (PyTorch's pattern)
    reads words offset + elem .. + 3: what the twin (and the DSL) index directly."""
    import numpy as np

    st = CurandPhiloxState(seed, 0, offset)
    st.skipahead(elem)
    got = np.concatenate([st.uniform4() for _ in range(3)])
    idx = np.arange(12, dtype=np.uint64) + np.uint64(offset + elem)
    want = curand_uniform(curand_philox_words(seed, idx))
    assert np.array_equal(got, want)
    assert got.dtype == np.float32 and (got > 0).all() and (got <= 1).all()


def test_keep_mask_layout_and_rate():
    """Element (b, h, n, m) is word offset + (b H + h) Mq Mk + n Mk + m; about 1 - p kept."""
    import numpy as np

    b, h, mq, mk, p, seed, off = 2, 3, 17, 13, 0.25, 2024, 11
    mask = mem_eff_dropout_keep_mask(seed, off, b, h, mq, mk, p)
    assert mask.shape == (b, h, mq, mk) and mask.dtype == torch.bool
    words = curand_philox_words(seed, np.arange(b * h * mq * mk, dtype=np.uint64) + np.uint64(off))
    assert torch.equal(mask.flatten(), torch.from_numpy(curand_uniform(words) > np.float32(p)))
    rate = mask.double().mean().item()
    assert abs(rate - (1 - p)) < 0.05
    # a different offset draws a different mask; the same one the same mask
    assert not torch.equal(mask, mem_eff_dropout_keep_mask(seed, off + 1, b, h, mq, mk, p))
    assert torch.equal(mask, mem_eff_dropout_keep_mask(seed, off, b, h, mq, mk, p))


BIAS_WIRING = [
    # (bias shape, requires grad, dropout_p, causal)
    ((1, 2, 9, 12), True, 0.0, False),  # broadcast over batch, rows padded (12 % 16)
    ((2, 1, 9, 12), True, 0.2, True),  # broadcast over heads, with dropout
    ((9, 12), True, 0.0, "bottom_right"),  # broadcast over batch and heads
    ((2, 2, 9, 1), True, 0.1, False),  # broadcast over keys
    ((2, 2, 9, 12), False, 0.3, False),  # no bias gradient
    (None, False, 0.4, True),  # dropout alone
]


@pytest.mark.parametrize("case", BIAS_WIRING, ids=[str(i) for i in range(len(BIAS_WIRING))])
def test_autograd_wiring_bias_dropout(cpu_attention, case):
    """memory_efficient_attention(attn_bias=, dropout_p=): the forward's philox seed / offset
    and the bias reach the backward, and the bias gradient comes back summed to its shape."""
    shape, bias_grad, p, causal = case
    gen = torch.Generator().manual_seed(3)
    b, h, mq, mk, d = 2, 2, 9, 12, 8
    q, k, v = (torch.randn(b, m, h, d, generator=gen).requires_grad_() for m in (mq, mk, mk))
    bias = None if shape is None else torch.randn(shape, generator=gen).requires_grad_(bias_grad)
    do = torch.randn(b, mq, h, d, generator=gen)
    out = ops.memory_efficient_attention(q, k, v, causal=causal, attn_bias=bias, dropout_p=p)
    out.backward(do)
    (call,) = cpu_attention.calls
    assert call["dropout_p"] == p and call["bias_requires_grad"] == bias_grad
    mask_type = {False: 0, True: 1, "bottom_right": 2}[causal]
    mask = (
        mem_eff_dropout_keep_mask(FORWARD_SEED, FORWARD_OFFSET, b, h, mq, mk, p)
        if p > 0
        else torch.ones(b, h, mq, mk, dtype=torch.bool)
    )
    z = mask.double() / (1 - p)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    full_bias = torch.zeros(b, h, mq, mk, dtype=F64) if bias is None else bias.detach().double().requires_grad_()
    want_out = naive_attention_bias_dropout(*leaves, full_bias, z, mask_type)
    torch.testing.assert_close(out.detach().double(), want_out.detach(), atol=1e-5, rtol=1e-5)
    wrt = leaves + ([full_bias] if bias_grad else [])
    want = torch.autograd.grad(want_out, wrt, do.double())
    got = [q.grad, k.grad, v.grad] + ([bias.grad] if bias_grad else [])
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)
    if bias is not None and not bias_grad:
        assert bias.grad is None


@pytest.mark.parametrize(
    "mask_type,window,want",
    [
        (0, None, (0, 0)),
        (1, 0, (1, 0)),
        (1, 7, (1, 7)),
        (2, 3, (2, 3)),
        (0, (-1, -1), (0, 0)),
        (1, (-1, -1), (1, 0)),
        (0, (-1, 0), (2, 0)),  # FlashAttention's (left, right)
        (0, (5, 0), (2, 6)),
        (1, (5, 0), (1, 6)),
        (2, (0, 0), (2, 1)),
        (1, (5, -1), (1, 6)),
    ],
)
def test_window_forms(mask_type, window, want):
    """An int w keeps the w keys up to the diagonal; (left, 0) is w = left + 1, bottom-right
    without causal (FlashAttention aligns its windows there); -1 is unbounded."""
    assert A.resolve_window(mask_type, window) == want


@pytest.mark.parametrize(
    "window,exc,fragment",
    [
        ((-5, -5), ValueError, "-1 for unbounded"),
        ((3, 2), NotImplementedError, "past the diagonal"),
        ((3, -1), NotImplementedError, "any key after"),
        ((1.5, 0), TypeError, "two ints"),
        (-2, ValueError, ">= 0"),
    ],
)
def test_window_forms_refused(window, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        A.resolve_window(0, window)
