"""CPU: learnable attention sinks (``memory_efficient_attention(sink=)``). The fp64 reference's
closed form for d sink against finite differences, the op's d sink (``ops.attention_sink``)
against the reference, the autograd wiring (the reference standing in for the kernels), the
forward's compile with a sink, its launch arguments, and where a sink is refused."""

import dataclasses

import cutlass
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
from ops import attention as A
from ops import attention_bwd_prepost as P
from ops import attention_bwd_prepost_build as PB
from ops import attention_checks as AC
from ops import attention_fwd_sm90 as F
from ops._disk_cache import stable_key
from ops.attention_sink import delta_rows, sink_grad
from ops.reference import attention_backward_ref, attention_forward_ref, mem_eff_dropout_keep_mask

from .mem_eff_attention_cpu_common import cu as _cu
from .test_mem_eff_attention_wiring_cpu import cpu_attention  # noqa: F401 (a fixture: the op on CPU tensors)

F64 = torch.float64
BF16, F16 = cutlass.BFloat16, cutlass.Float16


class _ClosedForm(torch.autograd.Function):
    """(out, lse) of the fp64 reference forward with a sink, differentiated by the reference's
    closed-form backward (d sink included): gradcheck compares it with finite differences."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sink, options):
        out, lse = attention_forward_ref(q, k, v, bias=bias, sink=sink, **options)
        ctx.save_for_backward(q, k, v, bias, sink, out)
        ctx.options = options
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias, sink, out = ctx.saved_tensors
        dq, dk, dv, db, dsink = attention_backward_ref(
            q, k, v, grad_out, bias=bias, out=out, grad_lse=grad_lse, return_grad_bias=True, sink=sink, **ctx.options
        )
        return dq, dk, dv, db if bias is not None else None, dsink, None


# (B, H, Hk, Mq, Mk, mask, window, softcap, bias, dropout)
GRADCHECK = [
    (1, 2, 2, 3, 4, 0, 0, 0.0, False, False),
    (2, 4, 2, 4, 3, 1, 0, 0.0, False, False),  # grouped heads, causal
    (1, 2, 2, 5, 3, 2, 0, 1.5, True, False),  # bottom-right, Mq > Mk: rows with the sink alone
    (1, 2, 1, 5, 5, 1, 2, 0.0, False, True),  # a window, dropout
]


@pytest.mark.parametrize("case", GRADCHECK, ids=lambda c: "b{}h{}/{}q{}k{}m{}w{}c{}-bias{:d}-drop{:d}".format(*c))
def test_reference_sink_gradient_matches_finite_differences(case):
    b, h, hk, mq, mk, mask, window, softcap, with_bias, dropout = case
    gen = torch.Generator().manual_seed(sum(case[:7]))
    r = lambda *s: torch.randn(*s, dtype=F64, generator=gen, requires_grad=True)  # noqa: E731
    q, k, v, sink = r(b, mq, h, 3), r(b, mk, hk, 3), r(b, mk, hk, 2), r(h)
    bias = r(b, h, mq, mk) if with_bias else None
    options = dict(custom_mask_type=mask, window_size=window, scale=1.0, softcap=softcap)
    if dropout:
        keep = mem_eff_dropout_keep_mask(7, 0, b, h, mq, mk, 0.3)
        options.update(dropout_mask=keep, dropout_p=0.3)
    inputs = (q, k, v, bias, sink)
    assert torch.autograd.gradcheck(lambda *x: _ClosedForm.apply(*x, options), inputs, atol=1e-7)


def test_reference_sink_semantics():
    """lse = log(e^sink + sum e^s); a row with no key: out 0, lse = the sink; a sink of -inf is none."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 2, 3, dtype=F64, generator=gen) for _ in range(3))
    sink = torch.tensor([0.5, -2.0], dtype=F64)
    out, lse = attention_forward_ref(q, k, v, sink=sink)
    plain_out, plain_lse = attention_forward_ref(q, k, v)
    torch.testing.assert_close(lse, torch.logaddexp(plain_lse, sink.view(1, 2, 1)))
    torch.testing.assert_close(out, plain_out * torch.exp(plain_lse - lse).transpose(1, 2).unsqueeze(-1))
    none = attention_forward_ref(q, k, v, sink=torch.full((2,), float("-inf"), dtype=F64))
    assert all(torch.allclose(a, b) for a, b in zip(none, (plain_out, plain_lse)))
    out, lse = attention_forward_ref(q, k[:, :2], v[:, :2], custom_mask_type=2, sink=sink)  # rows 0, 1 see no key
    assert not out[:, :2].any() and torch.equal(lse[0, :, :2], sink.view(2, 1).expand(2, 2))


def _lse_layout(lse, rows):
    """The op's LSE layout: fp32, +inf on the rows past each sequence up to ``rows``."""
    padded = torch.full((*lse.shape[:-1], rows), float("inf"), dtype=torch.float32)
    padded[..., : lse.shape[-1]] = lse
    return padded


@pytest.mark.parametrize("with_out,with_lse", [(True, False), (True, True), (False, True)])
def test_sink_grad_dense_is_the_reference(with_out, with_lse):
    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, dtype=F64, generator=gen)  # noqa: E731
    q, k, v, sink = r(2, 7, 4, 8), r(2, 5, 2, 8), r(2, 5, 2, 8), r(4)
    out, lse = attention_forward_ref(q, k, v, custom_mask_type=2, sink=sink)  # Mq > Mk: blind rows
    do = r(2, 7, 4, 8) if with_out else torch.zeros(2, 7, 4, 8, dtype=F64)
    glse = r(2, 4, 32) if with_lse else None
    *_, want = attention_backward_ref(q, k, v, do, custom_mask_type=2, out=out, grad_lse=glse, sink=sink)
    got = sink_grad(sink.float(), out.float(), do.float() if with_out else None, _lse_layout(lse, 32), glse, None)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_sink_grad_varlen_takes_each_sequences_rows():
    """Packed sequences (one empty, rows past the last sequence holding NaN, the LSE unwritten
    past each sequence's rows): d sink sums each sequence's rows only."""
    gen = torch.Generator().manual_seed(4)
    lens_q, lens_k = [3, 0, 1, 5], [4, 2, 0, 6]
    r = lambda *s: torch.randn(*s, dtype=F64, generator=gen)  # noqa: E731
    q, k, v, do, sink = r(1, 11, 2, 4), r(1, 12, 2, 4), r(1, 12, 2, 3), r(1, 11, 2, 3), r(2)
    cq, ck = _cu(lens_q), _cu(lens_k)
    out, lse = attention_forward_ref(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, custom_mask_type=1, sink=sink)
    glse = r(4, 2, 32)
    *_, want = attention_backward_ref(
        q, k, v, do, cu_seqlens_q=cq, cu_seqlens_k=ck, custom_mask_type=1, out=out, grad_lse=glse, sink=sink
    )
    out, lse = out.float(), _lse_layout(lse, 32)
    out[:, 9:] = float("nan")  # past the last sequence
    lse[:, :, 5:] = float("nan")  # unwritten past the longest sequence's rows
    got = sink_grad(sink.float(), out, do.float(), lse, glse.float(), cq)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


WIRING = [
    # (Mq, Mk, heads, kv heads, causal, lengths, loss on the LSE, sink dtype)
    (9, 12, 4, 2, False, None, False, torch.float32),
    (7, 12, 2, 2, "bottom_right", None, True, torch.float32),
    (16, 21, 2, 1, True, ([5, 0, 1, 10], [6, 4, 0, 11]), True, torch.bfloat16),
]


@pytest.mark.parametrize("case", WIRING, ids=["gqa", "bottom-right-lse", "varlen-lse"])
def test_sink_gradient_reaches_the_op(cpu_attention, case):  # noqa: F811 (the fixture)
    """memory_efficient_attention(sink=) reaches the forward; the backward gets the sink's LSE;
    out, the LSE and every gradient, the sink's included, are the reference's."""
    mq, mk, h, hk, causal, lengths, with_lse, dtype = case
    gen = torch.Generator().manual_seed(mq)
    q = torch.randn(1, mq, h, 8, generator=gen).requires_grad_()
    k, v = (torch.randn(1, mk, hk, 8, generator=gen).requires_grad_() for _ in range(2))
    sink = torch.randn(h, generator=gen).to(dtype).requires_grad_()
    kw = {} if lengths is None else dict(cu_seqlens_q=_cu(lengths[0]), cu_seqlens_k=_cu(lengths[1]))
    out, lse = ops.memory_efficient_attention(q, k, v, causal=causal, return_lse=True, sink=sink, **kw)
    mask_type = {False: 0, True: 1, "bottom_right": 2}[causal]
    want_out, want_lse = attention_forward_ref(q, k, v, custom_mask_type=mask_type, sink=sink, **kw)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    rows = torch.isfinite(lse)
    n = want_lse.shape[-1]  # (the reference's rows: each sequence's, +inf past it)
    torch.testing.assert_close(lse[..., :n].double(), want_lse.where(rows[..., :n], float("inf")), atol=1e-5, rtol=0)
    w = torch.randn(lse.shape, generator=gen).where(rows, 0.0) if with_lse else None
    do = torch.randn(out.shape, generator=gen)
    loss = (out * do).sum() + ((lse.where(rows, 0.0) * w).sum() if with_lse else 0.0)
    loss.backward()
    assert cpu_attention.sink is not None  # (the stand-in checked the LSE it got against it)
    *want, want_sink = attention_backward_ref(
        q, k, v, do, custom_mask_type=mask_type, grad_lse=w, sink=sink, out=out.detach(), **kw
    )
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # d sink in the sink's dtype
    assert sink.grad.dtype == sink.dtype
    torch.testing.assert_close(sink.grad.double(), want_sink, atol=tol, rtol=tol)


def test_sink_alone_needs_no_backward_kernel(cpu_attention):  # noqa: F811 (the fixture)
    """Only the sink trains: its gradient, and no dQ / dK / dV launch."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen) for _ in range(3))
    sink = torch.zeros(2, requires_grad=True)
    out = ops.memory_efficient_attention(q, k, v, sink=sink)
    do = torch.randn(out.shape, generator=gen)
    out.backward(do)
    *_, want = attention_backward_ref(q, k, v, do, sink=sink, out=out.detach())
    torch.testing.assert_close(sink.grad.double(), want, atol=1e-5, rtol=1e-5)
    assert not cpu_attention.calls


# ------------------------------------------------------------------------ the forward

SINK_FORWARD = [
    F.ForwardConfig(BF16, 128, 128, 1, False, True, "sm_90a", sink=True),
    F.ForwardConfig(F16, 64, 64, 0, False, False, "sm_90a", bias=True, dropout=True, softcap=True, sink=True),
]


@pytest.mark.compile
@pytest.mark.parametrize("config", SINK_FORWARD, ids=["d128-causal-varlen", "d64-bias-dropout-softcap"])
def test_forward_compiles_with_a_sink(config):
    assert callable(F._build(config))


def test_sink_is_its_own_compile_key():
    fwd = F.ForwardConfig(BF16, 128, 128, 1, False, False, "sm_90a")
    assert stable_key(dataclasses.replace(fwd, sink=True)) != stable_key(fwd)


def test_forward_launches_with_an_fp32_sink(monkeypatch):
    """The kernel reads the sink as contiguous fp32 [H]; the config carries the flag."""
    seen = {}
    monkeypatch.setattr(F, "compiled", lambda config: lambda *a: seen.update(config=config, args=a))
    q, k, v = (torch.zeros(1, 40, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    sink = torch.arange(8, dtype=torch.bfloat16)[::2]
    F.attention_forward_sm90(q, k, v, sink=sink)
    got = seen["args"][-1]
    assert seen["config"].sink and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, sink.float())


@pytest.mark.parametrize("varlen", [False, True])
def test_empty_keys_give_the_sink_as_lse(varlen):
    """No key at all (no launch): O = 0 and each row's LSE is its head's sink, +inf past it."""
    q = torch.randn(1, 5, 3, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 0, 3, 64, dtype=torch.bfloat16)
    sink = torch.tensor([1.0, -2.0, 3.0])
    kw = dict(cu_seqlens_q=_cu([2, 3]), cu_seqlens_k=_cu([0, 0]), max_seqlen_q=3, max_seqlen_k=1) if varlen else {}
    out, lse = F.attention_forward_sm90(q, k, v, sink=sink, **kw)
    assert not out.any()
    lengths = [2, 3] if varlen else [5]
    for i, n in enumerate(lengths):
        assert torch.equal(lse[i, :, :n], sink.view(3, 1).expand(3, n)) and torch.isinf(lse[i, :, n:]).all()


# ------------------------------------------------------------------ where it is refused


def _meta(h=2, d=64):
    return tuple(torch.empty(1, 128, h, d, dtype=torch.bfloat16, device="meta") for _ in range(3))


def test_sink_needs_our_forward():
    """torch's forward has no sink: where ours does not apply (meta tensors: no arch) the op
    raises rather than running without it; backend="mem_eff" keeps our forward for a sink."""
    q, k, v = _meta()
    sink = torch.zeros(2, device="meta")
    for backend in ("auto", "mem_eff"):
        with pytest.raises(NotImplementedError, match="sink needs our forward.*sm_90a"):
            A._mea_impl(q, k, v, None, None, 128, 128, 0, 0, None, None, 0.0, backend, False, 0.0, sink=sink)
    assert A.forward_unsupported(q, k, v, 0, None, 0.0, "mem_eff", arch="sm_90a", sink=True) is None
    assert A.forward_unsupported(q, k, v, 0, None, 0.0, "mem_eff", arch="sm_90a") == "backend='mem_eff'"


@pytest.mark.parametrize(
    "sink,exc,match",
    [
        ([0.0, 0.0], TypeError, "sink must be a torch.Tensor"),
        (torch.zeros(3), ValueError, r"sink must have shape \(2,\)"),
        (torch.zeros(1, 2), ValueError, r"sink must have shape \(2,\)"),
        (torch.zeros(2, dtype=torch.float64), TypeError, "sink must have dtype"),
        (torch.zeros(2, dtype=torch.int32), TypeError, "sink must have dtype"),
        (torch.zeros(2, device="meta"), ValueError, "sink is on meta"),
    ],
)
def test_sink_checks(sink, exc, match):
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(exc, match=match):
        AC.check_sink(sink, q)
    AC.check_sink(torch.zeros(2, dtype=torch.bfloat16), q)


def test_delta_rows_in_the_lse_layout():
    """Δ = rowsum(dO ∘ O) per packed sequence's rows, zeros past each sequence (the rows the
    backwards' Δ kernel leaves at zero)."""
    gen = torch.Generator().manual_seed(6)
    lens = [3, 0, 5, 1]
    out, do = (torch.randn(1, 11, 2, 4, generator=gen) for _ in range(2))
    got = delta_rows(out, do, _cu(lens), 6)
    assert got.shape == (4, 2, 6)
    start = 0
    for i, n in enumerate(lens):
        want = (out[0, start : start + n] * do[0, start : start + n]).sum(-1).T
        torch.testing.assert_close(got[i, :, :n], want)
        assert (got[i, :, n:] == 0).all()
        start += n
    dense = delta_rows(out, do, None, 11)
    torch.testing.assert_close(dense, (out * do).sum(-1).transpose(1, 2))


@pytest.mark.parametrize("varlen", [False, True])
def test_sink_grad_traced_through_its_op(varlen):
    """Where a graph is traced (fake CUDA tensors, as torch.compile's backward sees them) d sink
    goes through its custom op, which reads no data pointer: a fake [H] in the sink's dtype."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        out, do = (torch.empty(1, 40 if varlen else 30, 3, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        cu = torch.tensor([0, 10, 40], dtype=torch.int32, device="cuda") if varlen else None
        lse = torch.empty(2 if varlen else 1, 3, 32, device="cuda")
        sink = torch.empty(3, device="cuda", dtype=torch.bfloat16)
        got = sink_grad(sink, out, do, lse, lse.clone(), cu, 30 if varlen else None)
    assert tuple(got.shape) == (3,) and got.dtype == torch.bfloat16


@pytest.mark.compile
@pytest.mark.parametrize("varlen", [False, True])
def test_preprocess_with_sink_terms_compiles(varlen):
    """The preprocess variant that writes the sink's row terms (sm_90a, with and without dLSE;
    alone, and in the Hopper backward's launch that clears the dQ accumulator too)."""
    for clear, grad_lse in ((False, False), (False, True), (True, False), (True, True)):
        assert callable(PB._build_preprocess(cutlass.BFloat16, 64, 8, varlen, clear, "sm_90a", True, grad_lse, True))


def test_sink_terms_need_the_lse():
    from cute_kernels.attention_bwd_prepost import ComputeDotDoO
    from layouts.attention_bwd_prepost import preprocess_tiles

    with pytest.raises(ValueError, match="need lse_log2"):
        ComputeDotDoO(cutlass.BFloat16, preprocess_tiles(16, 64, 8, "sm_90a"), False, False, sink=True)


def test_sm90_backward_sums_its_preprocess_sink_terms(monkeypatch):
    """The Hopper backward hands its preprocess the sink in fp32 and a buffer for the row terms
    shaped as Δ, and returns their sum over batch and rows in the sink's dtype; without a sink
    it asks for none."""
    from ops import _compile as cc
    from ops import attention_common as C
    from ops import attention_sm90 as S

    seen, delta_storage = [], []

    def launch(out, do, delta, acc, scale, cu, mq, lse, lse2, dlse, sink, terms):
        seen.append((delta.shape, sink, terms))
        delta_storage.append(delta.untyped_storage().data_ptr())
        if terms is not None:
            terms.copy_(torch.arange(terms.numel(), dtype=torch.float32).view(terms.shape))

    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(P, "launch_preprocess", launch)
    monkeypatch.setattr(S, "compiled", lambda config: lambda *a: None)
    monkeypatch.setattr(P, "convert_dq", lambda acc, scale, d, sq, *rest, ready=None: torch.zeros(2, sq, 3, d))
    q, k, v, do, o = (torch.zeros(2, 100, 3, 64, dtype=torch.bfloat16) for _ in range(5))
    sink = torch.randn(3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for given in (sink, None):
        args = C.AttentionBackwardArgs(
            grad_out=do, query=q, key=k, value=v, out=o, logsumexp=torch.zeros(2, 3, 128), scale=0.1, sink=given
        )
        *_, dsink = S.attention_backward_sm90(args)
        shape, sink32, terms = seen[-1]
        if given is None:
            assert dsink is None and sink32 is None and terms is None
            continue
        assert sink32.dtype == torch.float32 and torch.equal(sink32, sink.float()) and terms.shape == shape
        assert terms.untyped_storage().data_ptr() == delta_storage[-1]  # the call's one scratch allocation
        want = torch.arange(terms.numel(), dtype=torch.float32).view(terms.shape).sum((0, 2))
        assert dsink.dtype == torch.bfloat16 and torch.equal(dsink, want.to(torch.bfloat16))


def test_backward_op_returns_unaliased_empties(monkeypatch):
    """Without a bias or sink gradient the backward op returns an empty tensor for each, two
    distinct ones: torch refuses an op whose outputs alias (as under torch.compile)."""
    from ops import attention as A
    from ops import attention_common as C

    q, k, v, do, o = (torch.zeros(1, 8, 2, 16) for _ in range(5))
    monkeypatch.setattr(A, "run_backward", lambda args: (q.clone(), k.clone(), v.clone(), None, None))
    args = C.AttentionBackwardArgs(grad_out=do, query=q, key=k, value=v, out=o, logsumexp=torch.zeros(1, 2, 32))
    *_, gb, gs = A._op(*args.normalized(0.25).op_args())
    assert gb.shape == (0,) and gs.shape == (0,) and gb is not gs
