"""GPU (sm_90a): softcapped scores and a loss on the returned logsumexp through
``ops.memory_efficient_attention`` (our forward, the sm90 backward) against the fp64 reference
(``ops.reference``, checked against finite differences in tests/test_attention_features_cpu.py):
O and the LSE, then dQ / dK / dV for a loss on O alone, on the LSE alone (dO = 0: dV exactly 0)
and on both; every mask, sliding windows, grouped-query heads, variable lengths (empty and
one-token sequences), each kernel shape of the backward (d64's persistent CTAs, d96, d128's grid
with a partial last block, the wide d192 / d256 kernel, Dqk != Dv), both dtypes; a bias (without
its gradient) and dropout beside the cap; deterministic mode; torch.compile. The LSE's gradient also
through the memory-efficient backward (torch's forward), fp32 included."""

import math

import pytest
import torch

import ops
from ops import _compile as cc
from ops.reference import attention_backward_ref, attention_forward_ref

from .test_attention_fwd_sm90_gpu import _torch_keep_mask, check_forward
from .test_attention_sm90_gpu import check, rounding_floors

pytestmark = pytest.mark.gpu

DEV = "cuda"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DTYPES = [BF16, F16]
CAUSAL = {0: False, 1: "top_left", 2: "bottom_right"}


@pytest.fixture(autouse=True)
def _needs_sm90():
    if cc.device_arch(torch.cuda.current_device()) != "sm_90a":
        pytest.skip("softcap needs our forward and the sm90 backward: an sm_90a device (H100 / H200)")


# (id, B, H, Hk, Sq, Sk, (Dqk, Dv), mask, window, lengths or None, softcap, scale): a cap near the
# scores (their tanh curves, some saturate) and Gemma 2's 50 on scores that reach it (scale 1)
CASES = [
    ("d128-gqa-causal-tail", 2, 4, 2, 257, 300, (128, 128), 1, 0, None, 2.0, None),
    ("d64-persistent", 1, 4, 4, 300, 300, (64, 64), 0, 0, None, 1.0, None),
    ("d64-causal-persistent", 1, 2, 2, 513, 513, (64, 64), 1, 0, None, 50.0, 1.0),
    ("d64-mqa-bottom-right-window", 1, 2, 1, 200, 333, (64, 64), 2, 50, None, 3.0, None),
    ("d96-bottom-right", 2, 2, 2, 130, 257, (96, 96), 2, 0, None, 2.0, None),
    ("d192-causal", 1, 2, 2, 200, 200, (192, 192), 1, 0, None, 30.0, 1.0),
    ("d192v128-window", 1, 2, 1, 257, 300, (192, 128), 2, 70, None, 2.0, None),
    ("d256-top-left-short", 1, 2, 2, 77, 300, (256, 256), 1, 0, None, 1.5, None),
    (
        "varlen-d128-causal",
        1,
        4,
        2,
        None,
        None,
        (128, 128),
        1,
        0,
        ([5, 0, 300, 1, 129], [5, 3, 300, 1, 200]),
        2.0,
        None,
    ),
    ("varlen-d64-window", 1, 2, 1, None, None, (64, 64), 2, 64, ([50, 400, 1], [300, 400, 10]), 5.0, 0.5),
    ("varlen-d192v128", 1, 4, 2, None, None, (192, 128), 1, 0, ([33, 300, 129], [40, 280, 129]), 2.0, None),
]
# which losses each case runs: O's, the LSE's (dO = 0), both; with the cap and, for the LSE's
# gradient, without it too
LOSSES = [("out", True), ("lse", True), ("both", True), ("lse", False), ("both", False)]


def _cu(lengths):
    return torch.tensor([0] + list(lengths), device=DEV).cumsum(0).to(torch.int32)


def _inputs(case, dtype):
    """q, k, v, dO, the LSE's weights (in the LSE's layout) and the op's keyword arguments."""
    _, b, h, hk, sq, sk, (d, dv), mask, window, lengths, softcap, scale = case
    if lengths is not None:
        sq, sk = sum(lengths[0]), sum(lengths[1])
    gen = torch.Generator(DEV).manual_seed(sum(c for c in case[1:6] if c) + d)
    r = lambda *s: torch.randn(*s, device=DEV, dtype=dtype, generator=gen)  # noqa: E731
    q, k, v, do = r(b, sq, h, d), r(b, sk, hk, d), r(b, sk, hk, dv), r(b, sq, h, dv)
    kw = dict(causal=CAUSAL[mask], window_size=window or None, scale=scale, softcap=softcap)
    rows = b
    if lengths is not None:
        kw.update(cu_seqlens_q=_cu(lengths[0]), cu_seqlens_k=_cu(lengths[1]))
        rows, sq = len(lengths[0]), max(lengths[0])
    w = torch.randn(rows, h, math.ceil(sq / 32) * 32, device=DEV, generator=gen)
    return q, k, v, do, w, kw


def _valid_rows(w, lengths, sq):
    """[sequences, H, rows] bool: the LSE entries of real queries (not the padding)."""
    n = torch.arange(w.shape[-1], device=DEV).view(1, 1, -1)
    if lengths is None:
        return (n < sq).expand(w.shape)
    return (n < torch.tensor(lengths[0], device=DEV).view(-1, 1, 1)).expand(w.shape)


def _reference(q, k, v, kw, lengths, **extra):
    """The fp64 reference's keyword arguments for the op's ``kw``."""
    mask = {False: 0, "top_left": 1, "bottom_right": 2}[kw["causal"]]
    ref = dict(custom_mask_type=mask, window_size=kw["window_size"] or 0, scale=kw["scale"])
    ref.update(softcap=kw.get("softcap") or 0.0, **extra)
    if lengths is not None:
        ref.update(cu_seqlens_q=kw["cu_seqlens_q"], cu_seqlens_k=kw["cu_seqlens_k"])
    return ref


def _train(q, k, v, do, glse, loss, kw):
    """(O, LSE, grads) of one call with the loss's gradients handed to autograd: dO for O's,
    ``glse`` for the LSE's (0 on the padding)."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = ops.memory_efficient_attention(*leaves, return_lse=True, **kw)
    outputs, grads = {"out": ([out], [do]), "lse": ([lse], [glse]), "both": ([out, lse], [do, glse])}[loss]
    torch.autograd.backward(outputs, grads)
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def _check_grads(label, q, k, v, do, out, grads, ref, dtype):
    floors = rounding_floors(q, k, do, out, dtype, None)
    for name, g, r, like, floor in zip(("dq", "dk", "dv"), grads, ref, (q, k, v), floors):
        check(f"{name} [{label}]", g, r, like, dtype, floor)


RUNS = [(c, dt, loss, cap) for c in CASES for dt in DTYPES for loss, cap in LOSSES]


@pytest.mark.parametrize(
    "case,dtype,loss,capped",
    RUNS,
    ids=[f"{c[0]}-{str(dt)[6:]}-{loss}-{'cap' if cap else 'nocap'}" for c, dt, loss, cap in RUNS],
)
def test_against_fp64_reference(case, dtype, loss, capped, caplog):
    """O, the LSE and the gradients of a loss on O, on the LSE or on both, with and without the
    cap, against the reference; the forward and the backward are ours (logged)."""
    import logging

    lengths = case[9]
    q, k, v, do, w, kw = _inputs(case, dtype)
    if not capped:
        kw["softcap"] = None
    sq = q.shape[1] if lengths is None else max(lengths[0])
    glse = torch.where(_valid_rows(w, lengths, sq), w, 0.0)
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        out, lse, grads = _train(q, k, v, do, glse, loss, kw)
    logged = [r.getMessage() for r in caplog.records]
    assert "attention forward: sm90" in logged and any(m.startswith("attention backward: sm90") for m in logged)
    ref_kw = _reference(q, k, v, kw, lengths)
    ref_out, ref_lse = attention_forward_ref(q, k, v, **ref_kw)
    label = f"{case[0]} {dtype} {loss} softcap={kw['softcap']}"
    check_forward(label, out, lse, ref_out, ref_lse, dtype, lengths)
    do_ref = torch.zeros_like(do) if loss == "lse" else do
    ref = attention_backward_ref(q, k, v, do_ref, out=out, grad_lse=None if loss == "out" else glse, **ref_kw)
    _check_grads(label, q, k, v, do_ref, out, grads, ref, dtype)
    if loss == "lse":  # dV = P^T dO with dO = 0
        assert not grads[2].any(), f"{label}: dV of a loss on the LSE alone is not 0"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_softcap_with_bias_dropout_and_determinism(dtype):
    """The cap beside an additive bias (its gradient not asked for: that takes the cap's
    derivative apart, refused), dropout with torch's keep mask and deterministic mode (three runs
    bitwise equal), a loss on O and the LSE."""
    b, h, hk, sq, sk, d, p, c = 2, 4, 2, 200, 256, 128, 0.2, 2.0
    gen = torch.Generator(DEV).manual_seed(11)
    r = lambda *s: torch.randn(*s, device=DEV, dtype=dtype, generator=gen)  # noqa: E731
    q, k, v, do, bias = r(b, sq, h, d), r(b, sk, hk, d), r(b, sk, hk, d), r(b, sq, h, d), r(1, h, sq, sk)
    glse = torch.randn(b, h, 224, device=DEV, generator=gen)
    glse[..., sq:] = 0.0
    kw = dict(causal=True, attn_bias=bias, dropout_p=p, softcap=c, deterministic=True)
    runs = []
    for _ in range(3):
        torch.manual_seed(23)  # our forward draws from the generator as torch's (seed 23, offset 0)
        runs.append(_train(q, k, v, do, glse, "both", kw))
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0][2], other[2])), "deterministic runs differ"
    out, lse, grads = runs[0]
    keep = _torch_keep_mask((b, h, sq, sk), p, 23, 0)
    ref_kw = dict(custom_mask_type=1, bias=bias, dropout_mask=keep, dropout_p=p, softcap=c)
    ref_out, ref_lse = attention_forward_ref(q, k, v, **ref_kw)
    check_forward(f"bias dropout {dtype}", out, lse, ref_out, ref_lse, dtype)
    ref = attention_backward_ref(q, k, v, do, out=out, grad_lse=glse, **ref_kw)
    _check_grads(f"bias dropout {dtype}", q, k, v, do, out, grads, ref, dtype)


def test_a_cap_far_above_the_scores_changes_little():
    """softcap = 1000 on scores of a few units moves them by s³ / 3c² < 1e-4: O, the LSE and the
    gradients are the uncapped call's to rounding (the capped kernels against the plain ones; the
    kernels' tanh errs by ~2.4e-7 absolute, c times that on a score)."""
    q, k, v, do = (torch.randn(2, 300, 4, 128, device=DEV, dtype=BF16) for _ in range(4))
    glse = torch.zeros(2, 4, 320, device=DEV)
    glse[..., :300] = 1.0
    plain = _train(q, k, v, do, glse, "both", dict(causal=True))
    capped = _train(q, k, v, do, glse, "both", dict(causal=True, softcap=1000.0))
    assert (plain[0].double() - capped[0].double()).abs().max().item() < 1e-2
    assert (plain[1][..., :300] - capped[1][..., :300]).abs().max().item() < 1e-3
    for a, b in zip(plain[2], capped[2]):
        assert (a.double() - b.double()).abs().max().item() <= 2e-2 * a.double().abs().max().item()


def test_torch_compile_keeps_softcap_and_the_lse_gradient():
    """torch.compile(fullgraph=True): the op's schema carries softcap forward and the LSE's
    gradient backward; the compiled step's gradients are the eager one's."""
    q, k, v, do = (torch.randn(1, 200, 2, 64, device=DEV, dtype=F16) for _ in range(4))
    w = torch.randn(1, 2, 200, device=DEV)

    def step(q, k, v):
        out, lse = ops.memory_efficient_attention(q, k, v, causal=True, softcap=2.0, return_lse=True)
        return (out.float() * do.float()).sum() + (lse[..., :200] * w).sum()  # (past row 200: +inf padding)

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        fn(*leaves).backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert (a.double() - b.double()).abs().max().item() <= 1e-3 * a.double().abs().max().item()


def test_softcap_refused_where_our_kernels_do_not_apply():
    """torch's forward and the memory-efficient backward have no cap: NotImplementedError naming
    it, before any forward where the call trains."""
    q, k, v = (torch.randn(1, 64, 2, 64, device=DEV, dtype=BF16) for _ in range(3))
    with pytest.raises(NotImplementedError, match="softcap"):
        ops.memory_efficient_attention(q, k, v, softcap=30.0, backend="mem_eff")
    x = [t.float().requires_grad_() for t in (q, k, v)]
    with pytest.raises(NotImplementedError, match="softcap"):
        ops.memory_efficient_attention(*x, softcap=30.0)
    with pytest.raises(NotImplementedError, match="softcap"), torch.no_grad():
        ops.memory_efficient_attention(*x, softcap=30.0)  # (torch's forward: fp32)


# (id, dtype, B, H, Hk, Sq, Sk, D, mask, window, lengths)
MEM_EFF = [
    ("bf16-gqa-causal", BF16, 2, 4, 2, 257, 300, 64, 1, 0, None),
    ("fp16-bottom-right-window", F16, 1, 2, 2, 200, 333, 128, 2, 50, None),
    ("fp32", F32, 1, 2, 2, 130, 130, 64, 0, 0, None),
    ("fp32-d80", F32, 1, 2, 1, 100, 90, 80, 1, 0, None),
    ("bf16-varlen", BF16, 1, 2, 2, None, None, 64, 1, 0, ([5, 0, 300, 1, 129], [5, 3, 300, 1, 200])),
]


@pytest.mark.parametrize("loss", ["lse", "both"])
@pytest.mark.parametrize("case", MEM_EFF, ids=[c[0] for c in MEM_EFF])
def test_lse_gradient_on_the_memory_efficient_backward(case, loss):
    """backend="mem_eff" (torch's forward, the memory-efficient kernel, which then takes Δ from
    our launch minus dLSE) against the reference; fp32 and head dims the sm90 path has not."""
    _, dtype, b, h, hk, sq, sk, d, mask, window, lengths = case
    case11 = (case[0], b, h, hk, sq, sk, (d, d), mask, window, lengths, None, None)
    q, k, v, do, w, kw = _inputs(case11, dtype)
    kw.update(backend="mem_eff")
    sq = q.shape[1] if lengths is None else max(lengths[0])
    glse = torch.where(_valid_rows(w, lengths, sq), w, 0.0)
    out, lse, grads = _train(q, k, v, do, glse, loss, kw)
    do_ref = torch.zeros_like(do) if loss == "lse" else do
    ref = attention_backward_ref(q, k, v, do_ref, out=out, grad_lse=glse, **_reference(q, k, v, kw, lengths))
    _check_grads(f"mem_eff {case[0]} {loss}", q, k, v, do_ref, out, grads, ref, dtype)
