"""The Hopper-native attention backward on an H100 (sm_90a) through the ops:

* ``memory_efficient_attention(backend="sm90")`` autograd (eager and captured) against
  backend="mem_eff" and fp64, with grouped heads and Dqk != Dv too;
* dispatch on the device: auto takes sm90 where it applies (bias and dropout included) and
  the memory-efficient kernel for key splits / unaligned inputs / fp32, each run's
  gradients against fp64.
"""

import logging

import pytest
import torch

import ops
from ops.reference import attention_backward_ref, attention_forward_ref

from .attention_sm90_gpu_common import (
    BF16,
    DEV,
    F16,
    LOGGER,
    backward,
    check,
    chosen,
    forward,
    make_inputs,
    rounding_floors,
)
from .attention_sm90_gpu_common import _needs_sm90  # noqa: F401 (autouse: an sm_90a device)

pytestmark = pytest.mark.gpu


# ------------------------------------------------------------------ autograd op


def _op_grads(backend, q, k, v, do, causal, compile_=False):
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))

    def fn(q, k, v):
        return ops.memory_efficient_attention(q, k, v, causal=causal, backend=backend)

    if compile_:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")  # our op as one node, no codegen
    fn(qs, ks, vs).backward(do)
    return qs.grad, ks.grad, vs.grad


MASK_TYPES = {False: 0, True: 1, "bottom_right": 2}  # memory_efficient_attention's causal -> custom_mask_type


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_memory_efficient_attention_autograd(dtype, causal, caplog):
    q, k, v, do = make_inputs(2, 2, 150, 200, 64, dtype, seed=11)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        ours = _op_grads("sm90", q, k, v, do, causal)
        theirs = _op_grads("mem_eff", q, k, v, do, causal)
    assert chosen(caplog) == ["sm90", "mem_eff"]
    for name, g, r, like in zip(("dq", "dk", "dv"), ours, theirs, (q, k, v)):
        check(f"{name} (memory_efficient_attention causal={causal})", g, r, like, dtype)
    mask_type = MASK_TYPES[causal]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type)
    out, _ = attention_forward_ref(q, k, v, custom_mask_type=mask_type)  # (the forward's out, for the floors)
    floors = rounding_floors(q, k, do, out.to(dtype), dtype)
    for backend, grads in (("sm90", ours), ("mem_eff", theirs)):
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads, ref, (q, k, v), floors):
            check(f"{name} (memory_efficient_attention causal={causal}, {backend}) vs fp64", g, r, like, dtype, floor)


def test_memory_efficient_attention_captured(caplog):
    """torch.compile(fullgraph=True): the backend reaches the backward through the graph."""
    q, k, v, do = make_inputs(1, 2, 130, 130, 128, BF16, seed=12)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        ours = _op_grads("sm90", q, k, v, do, True, compile_=True)
    torch._dynamo.reset()
    assert chosen(caplog) == ["sm90"]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=1)
    for name, g, r, like in zip(("dq", "dk", "dv"), ours, ref, (q, k, v)):
        check(f"{name} (captured)", g, r, like, BF16)


# ------------------------------------------------------------------------- dispatch


def test_auto_takes_sm90(caplog):
    q, k, v, do = make_inputs(2, 2, 100, 130, 128, F16, seed=13)
    out, lse = forward(q, k, v, 1)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        auto = backward("auto", q, k, v, do, out, lse, 1)
    assert chosen(caplog) == ["sm90"]
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=1)
    for name, g, r, like in zip(("dq", "dk", "dv"), auto, ref, (q, k, v)):
        check(f"{name} (auto)", g, r, like, F16)


def test_auto_dispatch_of_features(caplog):
    """bias and dropout: the sm90 kernel; key splits, unaligned inputs, fp32: the memory-efficient
    one. Each run's gradients against fp64 (with the bias, with the keep mask torch's forward drew)."""
    from .test_mem_eff_attention_features_gpu import torch_keep_mask

    gen = torch.Generator(DEV).manual_seed(14)
    b, h, s, d = 1, 2, 96, 64
    q, k, v, do = make_inputs(b, h, s, s, d, BF16, seed=14)
    empty = torch.empty((), dtype=torch.int64)
    runs = []  # (the call, its (q, k, v, dO, out), the reference's keywords)
    # attention bias
    bias = torch.randn(b, h, s, s, device=DEV, dtype=BF16, generator=gen)
    out, lse, _, _, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, bias, None, None, None, None, 0.0, 0, True
    )
    runs.append(
        (
            lambda: ops.efficient_attention_backward(
                do, q, k, v, bias, out, None, None, s, s, lse, 0.0, empty, empty, 0, False
            ),
            (q, k, v, do, out),
            dict(custom_mask_type=0, bias=bias),
        )
    )
    # dropout (the forward's philox state)
    out_d, lse_d, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, None, None, None, None, 0.2, 0, True
    )
    keep = torch_keep_mask((b, h, s, s), 0.2, int(seed), int(offset))
    runs.append(
        (
            lambda: ops.efficient_attention_backward(
                do, q, k, v, None, out_d, None, None, s, s, lse_d, 0.2, seed, offset, 0, False
            ),
            (q, k, v, do, out_d),
            dict(custom_mask_type=0, dropout_mask=keep, dropout_p=0.2),
        )
    )
    # key splits
    out_c, lse_c = forward(q, k, v, 1)
    runs.append(
        (
            lambda: backward("auto", q, k, v, do, out_c, lse_c, 1, num_splits_key=2),
            (q, k, v, do, out_c),
            dict(custom_mask_type=1),
        )
    )
    # an input 2 bytes past a 16-byte boundary (TMA cannot read it)
    q_off = torch.empty(q.numel() + 8, device=DEV, dtype=BF16)[1 : q.numel() + 1].view(q.shape).copy_(q)
    runs.append(
        (lambda: backward("auto", q_off, k, v, do, out_c, lse_c, 1), (q_off, k, v, do, out_c), dict(custom_mask_type=1))
    )
    # fp32
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, do))
    out32, lse32 = forward(q32, k32, v32, 0)
    runs.append(
        (
            lambda: backward("auto", q32, k32, v32, do32, out32, lse32, 0),
            (q32, k32, v32, do32, out32),
            dict(custom_mask_type=0),
        )
    )
    reasons = ["supported", "supported", "num_splits_key", "not TMA-aligned", "dtype"]
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        results = [run() for run, _, _ in runs]
    assert chosen(caplog) == ["sm90"] * 2 + ["mem_eff"] * (len(runs) - 2)
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    for msg, reason in zip(msgs, reasons):
        assert reason in msg, (reason, msg)
    for (_, (qi, ki, vi, doi, outi), ref_kw), grads, what in zip(
        runs, results, ("bias", "dropout", "key splits", "unaligned", "fp32")
    ):
        ref = attention_backward_ref(qi, ki, vi, doi, **ref_kw)
        floors = rounding_floors(qi, ki, doi, outi, qi.dtype)
        for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads[:3], ref, (qi, ki, vi), floors):
            check(f"{name} ({what})", g, r, like, qi.dtype, floor)


def test_sm90_refuses_features():
    q, k, v, do = make_inputs(1, 2, 96, 96, 64, BF16, seed=15)
    out, lse = forward(q, k, v, 1)
    for kw, reason in ((dict(num_splits_key=1), "num_splits_key"),):
        with pytest.raises(NotImplementedError, match=reason):
            backward("sm90", q, k, v, do, out, lse, 1, **kw)


def test_memory_efficient_attention_grouped_heads():
    """The autograd op takes key / value with fewer heads (its forward repeats them for
    torch's kernel); both backwards give the fp64 gradients of the grouped problem."""
    q, _, _, do = make_inputs(2, 6, 140, 140, 64, BF16, seed=17)
    _, k, v, _ = make_inputs(2, 2, 140, 140, 64, BF16, seed=18)
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=1)
    for backend in ("sm90", "mem_eff"):
        grads = _op_grads(backend, q, k, v, do, True)
        for name, g, r, like in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
            check(f"{name} (memory_efficient_attention, grouped heads, {backend})", g, r, like, BF16)


@pytest.mark.parametrize("head_dim,head_dim_v", [(128, 64), (192, 128)], ids=["d128-dv64", "d192-dv128"])
def test_memory_efficient_attention_unequal_head_dims(head_dim, head_dim_v):
    """The autograd op with a value head dim of its own: both backends give the fp64 gradients."""
    q, k, v, do = make_inputs(2, 2, 150, 200, (head_dim, head_dim_v), BF16, seed=19)
    ref = attention_backward_ref(q, k, v, do, custom_mask_type=1)
    for backend in ("sm90", "mem_eff"):
        grads = _op_grads(backend, q, k, v, do, True)
        for name, g, r, like in zip(("dq", "dk", "dv"), grads, ref, (q, k, v)):
            check(f"{name} (memory_efficient_attention d{head_dim} dv{head_dim_v}, {backend})", g, r, like, BF16)
