"""CPU: ``use_for_sdpa``'s registration, translation of SDPA's backward to ours (bias and
dropout too), fall-through like torch's, and restoration (a reference-backed backward stands
in for the CUDA one)."""

import logging

import pytest
import torch

import ops
from ops import attention_sdpa as SD
from ops.reference import attention_forward_ref, mem_eff_dropout_keep_mask

from .mem_eff_attention_cpu_common import (
    FORWARD_OFFSET,
    FORWARD_SEED,
    BackwardStandIn,
    _lse_padded,
    naive_attention_bias_dropout,
    naive_grads,
)


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
