"""GPU (sm_90a): learnable sinks (``ops.memory_efficient_attention(sink=)``: our forward, the sm90
backward, d sink beside it) against the fp64 reference (``ops.reference``, its d sink checked
against finite differences in tests/test_attention_sink_cpu.py): O and the LSE, then dQ / dK / dV
and d sink for a loss on O and on O and the LSE; d64 / d128, causal or not, grouped-query heads,
a window with rows that see no key (O = 0, LSE = the sink), variable lengths (empty, one-token and
key-less sequences), softcap, a bias with its gradient, dropout and deterministic mode, the
memory-efficient backward, torch.compile."""

import logging
import math

import pytest
import torch

import ops
from ops import _compile as cc
from ops.reference import attention_backward_ref, attention_forward_ref

from .attention_sm90_gpu_common import TOL
from .test_attention_features_gpu import _check_grads, _cu, _reference, _valid_rows
from .test_attention_fwd_sm90_gpu import _torch_keep_mask, check_forward

pytestmark = pytest.mark.gpu

DEV = "cuda"
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
CAUSAL = {0: False, 1: "top_left", 2: "bottom_right"}


@pytest.fixture(autouse=True)
def _needs_sm90():
    if cc.device_arch(torch.cuda.current_device()) != "sm_90a":
        pytest.skip("a sink needs our forward: an sm_90a device (H100 / H200)")


# (id, dtype, B, H, Hk, Sq, Sk, D, mask, window, lengths or None, softcap, sink dtype)
CASES = [
    ("d128-gqa-causal", BF16, 2, 4, 2, 257, 300, 128, 1, 0, None, None, F32),
    ("d64-full", F16, 1, 4, 4, 300, 300, 64, 0, 0, None, None, F32),
    ("d128-full-bf16-sink", BF16, 2, 2, 2, 130, 200, 128, 0, 0, None, None, BF16),
    # top-left window of 20 over 100 keys: queries 119.. see no key
    ("d64-window-blind-rows", BF16, 1, 2, 1, 300, 100, 64, 1, 20, None, None, F32),
    ("d64-mqa-bottom-right-window", F16, 1, 4, 1, 200, 333, 64, 2, 50, None, None, F32),
    ("d128-softcap", BF16, 1, 4, 2, 200, 257, 128, 1, 0, None, 2.0, F32),
    # packed: an empty sequence, one-token ones, one with queries and no key
    (
        "varlen-d128-causal",
        BF16,
        1,
        4,
        2,
        None,
        None,
        128,
        1,
        0,
        ([5, 0, 300, 1, 129, 7], [5, 3, 300, 1, 200, 0]),
        None,
        F32,
    ),
    ("varlen-d64-window", F16, 1, 2, 1, None, None, 64, 2, 64, ([50, 400, 1], [300, 400, 10]), None, F32),
]


def _sinks(h, dtype, gen):
    """Sinks from well below to well above the rows' LSE (about log Sk + 0.5 here)."""
    spread = torch.linspace(-3.0, 9.0, h, device=DEV)
    return (spread + 0.5 * torch.randn(h, device=DEV, generator=gen)).to(dtype)


def _inputs(case):
    """q, k, v, dO, the sink, the LSE's weights (0 on the padding) and the op's keyword arguments."""
    _, dtype, b, h, hk, sq, sk, d, mask, window, lengths, softcap, sink_dtype = case
    if lengths is not None:
        sq, sk = sum(lengths[0]), sum(lengths[1])
    gen = torch.Generator(DEV).manual_seed(sum(c for c in case[2:8] if c))
    r = lambda *s: torch.randn(*s, device=DEV, dtype=dtype, generator=gen)  # noqa: E731
    q, k, v, do = r(b, sq, h, d), r(b, sk, hk, d), r(b, sk, hk, d), r(b, sq, h, d)
    kw = dict(causal=CAUSAL[mask], window_size=window or None, scale=None, softcap=softcap)
    rows = b
    if lengths is not None:
        kw.update(cu_seqlens_q=_cu(lengths[0]), cu_seqlens_k=_cu(lengths[1]))
        rows, sq = len(lengths[0]), max(lengths[0])
    w = torch.randn(rows, h, math.ceil(sq / 32) * 32, device=DEV, generator=gen)
    glse = torch.where(_valid_rows(w, lengths, sq), w, 0.0)
    return q, k, v, do, _sinks(h, sink_dtype, gen), glse, kw


def _train(q, k, v, do, sink, glse, kw):
    """(O, LSE, [dq, dk, dv, dsink]) of one call; ``glse`` None: a loss on O alone."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    out, lse = ops.memory_efficient_attention(*leaves[:3], sink=leaves[3], return_lse=True, **kw)
    outputs, grads = ([out], [do]) if glse is None else ([out, lse], [do, glse])
    torch.autograd.backward(outputs, grads)
    return out.detach(), lse.detach(), [x.grad for x in leaves]


def _sink_terms(sink, out, do, ref_lse, glse, lengths):
    """sum over rows of |P_sink (dLSE - Δ)| per head (fp64): the scale d sink's rounding is
    measured against (its terms cancel)."""
    delta = (do.double() * out.double()).sum(-1)  # [B, M, H]
    if lengths is None:
        mq = out.shape[1]
        g = -delta.transpose(1, 2) + (0.0 if glse is None else glse[..., :mq].double())
        return (torch.exp(sink.double().view(1, -1, 1) - ref_lse) * g).abs().sum((0, 2))
    total, start = 0.0, 0
    for i, n in enumerate(lengths[0]):
        g = -delta[0, start : start + n].t() + (0.0 if glse is None else glse[i, :, :n].double())
        total = total + (torch.exp(sink.double().view(-1, 1) - ref_lse[i, :, :n]) * g).abs().sum(-1)
        start += n
    return total


def check_sink_grad(label, got, want, terms):
    assert got is not None, f"{label}: no d sink"
    err = ((got.double() - want).abs() / terms.clamp_min(1e-30)).max().item()
    tol = 1e-3 if got.dtype == F32 else 1e-2  # (a bf16 d sink: its own rounding)
    assert err < tol, f"{label}: max |d sink - ref| / sum |terms| = {err:.3g} >= {tol}"


def _check_against_reference(label, q, k, v, do, sink, glse, kw, out, lse, grads, dtype, lengths):
    """O and the LSE, then dQ, dK, dV and d sink against the fp64 reference of the same call."""
    ref_kw = _reference(q, k, v, kw, lengths, sink=sink)
    ref_out, ref_lse = attention_forward_ref(q, k, v, **ref_kw)
    check_forward(label, out, lse, ref_out, ref_lse, dtype, lengths)
    *ref, ref_sink = attention_backward_ref(q, k, v, do, out=out, grad_lse=glse, **ref_kw)
    _check_grads(label, q, k, v, do, out, grads[:3], ref, dtype)
    check_sink_grad(label, grads[3], ref_sink, _sink_terms(sink, out, do, ref_lse, glse, lengths))


@pytest.mark.parametrize("loss", ["out", "both"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_fp64_reference(case, loss, caplog):
    """O, the LSE (the sink's on rows that see no key) and the gradients, the sink's included,
    against the reference; the forward and the backward are ours (logged)."""
    name, dtype, lengths = case[0], case[1], case[10]
    q, k, v, do, sink, glse, kw = _inputs(case)
    glse = None if loss == "out" else glse
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        out, lse, grads = _train(q, k, v, do, sink, glse, kw)
    logged = [r.getMessage() for r in caplog.records]
    assert "attention forward: sm90" in logged and any(m.startswith("attention backward: sm90") for m in logged)
    _check_against_reference(f"{name} {loss}", q, k, v, do, sink, glse, kw, out, lse, grads, dtype, lengths)
    assert grads[3].dtype == sink.dtype


def test_blind_rows_take_the_sink():
    """Rows that see no key (a top-left window over fewer keys): O exactly 0, LSE the head's sink."""
    case = CASES[3]
    q, k, v, _, sink, _, kw = _inputs(case)
    out, lse = ops.memory_efficient_attention(q, k, v, sink=sink, return_lse=True, **kw)
    blind = slice(119, 300)
    assert not out[:, blind].any()
    assert torch.allclose(lse[:, :, blind], sink.float().view(1, -1, 1).expand(1, -1, 181), atol=1e-5)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
def test_sink_with_bias_gradient_dropout_and_determinism(dtype):
    """A sink beside a bias that gets its gradient, dropout with torch's keep mask and
    deterministic mode (two runs bitwise equal, d sink included), a loss on O and the LSE."""
    b, h, hk, sq, sk, d, p = 2, 4, 2, 200, 256, 64, 0.2
    gen = torch.Generator(DEV).manual_seed(13)
    r = lambda *s: torch.randn(*s, device=DEV, dtype=dtype, generator=gen)  # noqa: E731
    q, k, v, do, bias = r(b, sq, h, d), r(b, sk, hk, d), r(b, sk, hk, d), r(b, sq, h, d), r(1, h, sq, sk)
    sink = _sinks(h, F32, gen)
    glse = torch.randn(b, h, 224, device=DEV, generator=gen)
    glse[..., sq:] = 0.0
    runs = []
    for _ in range(2):
        torch.manual_seed(29)  # our forward draws from the generator as torch's (seed 29, offset 0)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, bias, sink)]
        out, lse = ops.memory_efficient_attention(
            *leaves[:3],
            attn_bias=leaves[3],
            sink=leaves[4],
            causal=True,
            dropout_p=p,
            deterministic=True,
            return_lse=True,
        )
        torch.autograd.backward([out, lse], [do, glse])
        runs.append((out.detach(), lse.detach(), [x.grad for x in leaves]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2])), "deterministic runs differ"
    out, lse, grads = runs[0]
    keep = _torch_keep_mask((b, h, sq, sk), p, 29, 0)
    ref_kw = dict(custom_mask_type=1, bias=bias, dropout_mask=keep, dropout_p=p, sink=sink)
    ref_out, ref_lse = attention_forward_ref(q, k, v, **ref_kw)
    check_forward(f"bias dropout {dtype}", out, lse, ref_out, ref_lse, dtype)
    *ref, ref_db, ref_sink = attention_backward_ref(
        q, k, v, do, out=out, grad_lse=glse, return_grad_bias=True, **ref_kw
    )
    _check_grads(f"bias dropout {dtype}", q, k, v, do, out, grads[:3], ref, dtype)
    # (as tests/test_attention_sm90_features_gpu.py: Δ's rounding bounds dB by |dO| |O|; summed over the batch)
    want_db = ref_db.sum(0, keepdim=True)
    mag = b * max(ref_db.abs().max().item(), (do.double().abs() * out.double().abs()).sum(-1).max().item())
    err = (grads[3].double() - want_db).abs().max().item()
    assert err <= TOL[dtype] * mag, f"dbias: {err:.3g} > {TOL[dtype]} * {mag:.3g}"
    check_sink_grad(f"bias dropout {dtype}", grads[4], ref_sink, _sink_terms(sink, out, do, ref_lse, glse, None))


def test_sink_on_the_memory_efficient_backward(caplog):
    """backend="mem_eff": our forward (torch's has no sink) and the memory-efficient backward,
    which takes P from the sink's LSE."""
    case = ("mem-eff", BF16, 2, 4, 2, 257, 300, 128, 1, 0, None, None, F32)
    q, k, v, do, sink, glse, kw = _inputs(case)
    kw.update(backend="mem_eff")
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        out, lse, grads = _train(q, k, v, do, sink, glse, kw)
    logged = [r.getMessage() for r in caplog.records]
    assert "attention forward: sm90" in logged and any(m.startswith("attention backward: mem_eff") for m in logged)
    _check_against_reference("mem_eff", q, k, v, do, sink, glse, kw, out, lse, grads, BF16, None)


def test_torch_compile_keeps_the_sink():
    """torch.compile(fullgraph=True): the op's schema carries the sink forward and its gradient
    back; the compiled step's gradients are the eager one's."""
    gen = torch.Generator(DEV).manual_seed(3)
    q, k, v, do = (torch.randn(1, 200, 2, 64, device=DEV, dtype=F16, generator=gen) for _ in range(4))
    sink = _sinks(2, F32, gen)
    w = torch.randn(1, 2, 200, device=DEV, generator=gen)

    def step(q, k, v, sink):
        out, lse = ops.memory_efficient_attention(q, k, v, causal=True, sink=sink, return_lse=True)
        return (out.float() * do.float()).sum() + (lse[..., :200] * w).sum()  # (past row 200: +inf padding)

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
        fn(*leaves).backward()
        grads.append([x.grad for x in leaves])
    for a, b in zip(*grads):
        assert (a.double() - b.double()).abs().max().item() <= 1e-3 * a.double().abs().max().item()


def test_sink_refused_where_our_forward_does_not_apply():
    """torch's forward has no sink (fp32, head dims ours does not compile): NotImplementedError
    naming it, rather than a call without it."""
    for dtype, d in ((F32, 64), (BF16, 80)):
        q, k, v = (torch.randn(1, 64, 2, d, device=DEV, dtype=dtype) for _ in range(3))
        with pytest.raises(NotImplementedError, match="sink needs our forward"):
            ops.memory_efficient_attention(q, k, v, sink=torch.zeros(2, device=DEV))
