"""CPU: the autograd wiring of ``memory_efficient_attention`` (a reference-backed CPU kernel
and backward stand in for the CUDA ones): masks, windows, variable lengths, the backend and
deterministic flags, bias and dropout reach the backward, whose gradients come back."""

import pytest
import torch

import ops
from ops import attention as A
from ops import attention_checks as AC
from ops.reference import attention_forward_ref, mem_eff_dropout_keep_mask

from .mem_eff_attention_cpu_common import (
    F64,
    FORWARD_OFFSET,
    FORWARD_SEED,
    BackwardStandIn,
    _lse_padded,
    cu,
    naive_attention_bias_dropout,
    naive_grads,
)


@pytest.fixture
def cpu_attention(monkeypatch):
    """ops.memory_efficient_attention runnable on CPU tensors: a reference forward kernel at
    the CPU key, the backward stand-in, CUDA checks off. Yields the stand-in."""
    lib = torch.library.Library("cute_kernels", "IMPL")
    stand_in = BackwardStandIn()

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
        softcap=0.0,
        seqused_q=None,
        seqused_k=None,
        sink=None,
    ):
        stand_in.sink = sink  # the backward gets only the LSE: the stand-in checks it against the sink's
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
            softcap=softcap,
            seqused_q=seqused_q,
            seqused_k=seqused_k,
            sink=sink,
        )
        if cq is not None:
            assert lse.shape[-1] <= max_q
        return out.to(query.dtype), _lse_padded(lse, max_q), seed, offset

    lib.impl("memory_efficient_attention", forward, "CPU")
    monkeypatch.setattr(A, "_backward", stand_in.on_args)
    monkeypatch.setattr(AC, "check_cuda", lambda *a: None)
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
    # (the op's backward gets the scale resolved: the default is 1 / sqrt(Dqk))
    assert call["mask"] == mask_type and call["window"] == window
    assert call["scale"] == (scale if scale is not None else kd**-0.5)
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
