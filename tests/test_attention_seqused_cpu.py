"""CPU: used lengths (``seqused_q / seqused_k``). The fp64 reference cuts each sequence to its used
rows (padding of NaN changes nothing); the op hands the lengths to its forward and backward (the
missing one as the full lengths); the sm90 backward's plan keeps to a CTA per tile with the
lengths read on the device; only the sm90 backward takes them; the new configurations compile."""

import dataclasses

import cutlass
import pytest
import torch

import ops
from ops import attention as A
from ops import attention_common as C
from ops import attention_fwd_sm90 as F
from ops import attention_sm90 as S
from ops._disk_cache import stable_key
from ops.reference import attention_backward_ref, attention_forward_ref

from .mem_eff_attention_cpu_common import cu as _cu
from .test_mem_eff_attention_wiring_cpu import cpu_attention  # noqa: F401 (a fixture: the op on CPU tensors)

F64, I32 = torch.float64, torch.int32
BF16 = cutlass.BFloat16


def _with_nan_padding(t, used, cu=None):
    """``t`` [B, M, H, D] with NaN in every row past each sequence's used length."""
    t = t.clone()
    if cu is None:
        for b, n in enumerate(used.tolist()):
            t[b, n:] = float("nan")
    else:
        for i, n in enumerate(used.tolist()):
            t[0, cu[i] + n : cu[i + 1]] = float("nan")
    return t


# (Mq, Mk, mask, window, used_q, used_k, lengths (cu_seqlens) or None)
REFERENCE_CASES = [
    (9, 12, 0, 0, [9, 4, 0], [12, 5, 3], None),
    (9, 12, 2, 0, [7, 1, 3], [12, 5, 3], None),
    (9, 12, 1, 3, [2, 9, 5], [0, 7, 11], None),
    (0, 0, 2, 2, [4, 0, 6], [5, 3, 7], ([6, 1, 9], [8, 3, 7])),
]


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_reference_takes_each_sequence_to_its_used_rows(case):
    """Each sequence's out, lse and gradients are the reference's on its used rows alone (masks
    aligned to the used lengths), whatever the padding holds; out, gradients 0 and lse +inf on
    the padding."""
    mq, mk, mask, window, used_q, used_k, lengths = case
    gen = torch.Generator().manual_seed(len(used_q) + mask)
    cu_q = cu_k = None
    b = len(used_q)
    if lengths is not None:
        cu_q, cu_k = _cu(lengths[0]), _cu(lengths[1])
        b, mq, mk = 1, int(cu_q[-1]), int(cu_k[-1])
    uq, uk = torch.tensor(used_q, dtype=I32), torch.tensor(used_k, dtype=I32)
    q, do = (torch.randn(b, mq, 4, 8, dtype=F64, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, mk, 2, 8, dtype=F64, generator=gen) for _ in range(2))
    q, do = (_with_nan_padding(t, uq, cu_q) for t in (q, do))
    k, v = (_with_nan_padding(t, uk, cu_k) for t in (k, v))
    kw = dict(custom_mask_type=mask, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = attention_forward_ref(q, k, v, seqused_q=uq, seqused_k=uk, **kw)
    dq, dk, dv = attention_backward_ref(q, k, v, do, seqused_q=uq, seqused_k=uk, **kw)
    starts_q = [0] * b if cu_q is None else cu_q.tolist()
    starts_k = [0] * b if cu_k is None else cu_k.tolist()
    for i, (nq, nk) in enumerate(zip(used_q, used_k)):
        bi = 0 if cu_q is not None else i
        rq = slice(starts_q[i], starts_q[i] + nq)
        rk = slice(starts_k[i], starts_k[i] + nk)
        one = dict(custom_mask_type=mask, window_size=window)
        sub = (q[bi : bi + 1, rq], k[bi : bi + 1, rk], v[bi : bi + 1, rk])
        want_out, want_lse = attention_forward_ref(*sub, **one)
        want = attention_backward_ref(*sub, do[bi : bi + 1, rq], **one)
        torch.testing.assert_close(out[bi : bi + 1, rq], want_out)
        torch.testing.assert_close(lse[i, :, :nq], want_lse[0])
        assert torch.isinf(lse[i, :, nq:]).all() and (lse[i, :, nq:] > 0).all()
        for got, ref, rows in ((dq, want[0], rq), (dk, want[1], rk), (dv, want[2], rk)):
            torch.testing.assert_close(got[bi : bi + 1, rows], ref)
    for got in (out, dq, dk, dv):  # the padding's rows: zeros, not NaN
        assert not got.isnan().any()


def test_used_lengths_reach_the_forward_and_the_backward(cpu_attention):  # noqa: F811 (the fixture)
    """The op passes the used lengths (int32 [B]; the one not given: the full lengths) to its
    forward and to the backward's arguments, and its gradients are the reference's with them."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 10, 2, 8, generator=gen).requires_grad_() for _ in range(3))
    used_k = torch.tensor([10, 4, 0], dtype=I32)
    out = ops.memory_efficient_attention(q, k, v, causal="bottom_right", seqused_k=used_k)
    do = torch.randn(out.shape, generator=gen)
    (out * do).sum().backward()
    call = cpu_attention.calls[-1]
    got_q, got_k = call["seqused"]
    assert got_k is used_k and got_q.dtype == I32 and got_q.tolist() == [10, 10, 10]
    full = torch.full((3,), 10, dtype=I32)
    want = attention_backward_ref(q, k, v, do, custom_mask_type=2, seqused_q=full, seqused_k=used_k)
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_used_lengths_with_cu_seqlens_fill_the_missing_one_per_sequence(cpu_attention):  # noqa: F811
    q = torch.randn(1, 12, 2, 8, requires_grad=True)
    k, v = torch.randn(1, 12, 2, 8), torch.randn(1, 12, 2, 8)
    cu_q, cu_k = _cu([5, 7]), _cu([4, 8])
    used_q = torch.tensor([2, 7], dtype=I32)
    out = ops.memory_efficient_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q)
    out.sum().backward()
    got_q, got_k = cpu_attention.calls[-1]["seqused"]
    assert got_q is used_q and got_k.tolist() == [4, 8]
    assert (out[0, 2:5] == 0).all() and (out[0, :2] != 0).any()


def test_torch_forward_refuses_used_lengths():
    """Where torch's forward would run (here: CPU tensors, no sm_90a) used lengths raise, naming them."""
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    used = torch.tensor([4], dtype=I32)
    with pytest.raises(NotImplementedError, match="seqused_q / seqused_k need our forward.*needs sm_90a"):
        A._mea_impl(q, q, q, None, None, 8, 8, 0, 0, None, seqused_q=used, seqused_k=used)


def _args(backend="auto", d=64, seqused=True):
    q = torch.empty(2, 128, 2, d, dtype=torch.bfloat16, device="meta")
    used = torch.empty(2, dtype=I32, device="meta") if seqused else None
    return C.AttentionBackwardArgs(
        grad_out=q, query=q, key=q, value=q, out=q, logsumexp=q, backend=backend, seqused_q=used, seqused_k=used
    )


def test_only_the_sm90_backward_takes_used_lengths():
    assert A.choose_backend(_args(), arch="sm_90a")[0] == "sm90"
    assert A.choose_backend(_args(seqused=False), arch="sm_80")[0] == "mem_eff"
    with pytest.raises(NotImplementedError, match="seqused_q / seqused_k.*needs sm_90a"):
        A.choose_backend(_args(), arch="sm_80")
    with pytest.raises(NotImplementedError, match="seqused_q / seqused_k.*backend='mem_eff'"):
        A.choose_backend(_args(backend="mem_eff"), arch="sm_90a")
    with pytest.raises(NotImplementedError, match="seqused_q / seqused_k.*head dims"):
        A.choose_backend(_args(d=80), arch="sm_90a")


def _backward_key(d, mask, rows, seqused=True, **kw):
    flags = dict(window=False, deterministic=False, varlen=False, bias=False, grad_bias=False, dropout=False)
    flags.update(kw)
    plan = S._plan(BF16, d, d, mask, "sm_90a", rows_q=rows, group=1, rows_k=rows, ctas=132, seqused=seqused, **flags)
    return plan[1], plan[2]


@pytest.mark.parametrize("d, mask", [(64, 0), (64, 1), (128, 0), (128, 2)])
def test_backward_plan_reads_lengths_on_the_device(d, mask):
    """Used lengths take the plan of lengths per sequence: a CTA per tile (no persistent CTAs,
    which share tiles of every length), no stored-first dQ or zeroing ahead (query blocks past
    the used rows are never visited), no partial-block products (the last block is per
    sequence), no ConvertDQReady (its counts take every key block of the grid)."""
    schedule, key = _backward_key(d, mask, 4010)
    assert schedule == "grid" and key.seqused
    assert not (key.store_first or key.zero_ahead or key.carry_dq or key.dq_ready or key.tail_m)
    assert stable_key(key) != stable_key(dataclasses.replace(key, seqused=False))


FORWARD = F.ForwardConfig(BF16, 128, 128, 2, True, False, "sm_90a", seqused=True)


@pytest.mark.compile
def test_forward_compiles_with_used_lengths():
    assert callable(F._build(FORWARD))


@pytest.mark.compile
def test_backward_compiles_with_used_lengths():
    _, key = _backward_key(128, 1, 4010)
    assert callable(S._build(key))


def test_kernels_refuse_used_lengths_with_bias_or_dropout():
    from cute_kernels.attention_sm90 import backward_config
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90
    from cute_kernels.attention_sm90.attention_forward_sm90 import AttentionForwardSm90
    from cute_kernels.attention_sm90.forward_config import forward_tiles

    tiles = backward_config.attention_sm90_tiles(128, bias_or_dropout=True)
    with pytest.raises(NotImplementedError, match="seqused"):
        AttentionBackwardSm90(BF16, tiles, 0, dropout=True, seqused=True)
    with pytest.raises(NotImplementedError, match="seqused"):
        AttentionForwardSm90(BF16, forward_tiles(128, 128, bias=True), 0, has_bias=True, seqused=True)
