"""CPU: softcapping and the gradient through the returned logsumexp. The fp64 reference's closed
forms (``ops.reference``) against finite differences (``torch.autograd.gradcheck``) on tiny shapes;
variable lengths against the same problems one sequence at a time."""

import dataclasses
from types import SimpleNamespace

import cutlass
import pytest
import torch

import ops
from layouts import attention_bwd_prepost as tiling_prepost
from ops import _compile as cc
from ops import attention as A
from ops import attention_bwd_prepost_build as PB
from ops import attention_checks as AC
from ops import attention_fwd_sm90 as F
from ops import attention_bwd_prepost as P
from ops import attention_common as C
from ops import attention_sm90 as S
from ops import mem_eff_attention as M
from ops._disk_cache import stable_key
from ops.reference import attention_backward_ref, attention_forward_ref

from .test_mem_eff_attention_wiring_cpu import cpu_attention  # noqa: F401 (a fixture: the op on CPU tensors)
from .mem_eff_attention_cpu_common import cu as _cu

F64 = torch.float64


class _ClosedForm(torch.autograd.Function):
    """(out, lse) of the fp64 reference forward, differentiated by the reference's closed-form
    backward (dLSE and the softcap's derivative included): gradcheck compares that backward with
    finite differences of the forward."""

    @staticmethod
    def forward(ctx, q, k, v, bias, options):
        out, lse = attention_forward_ref(q, k, v, bias=bias, **options)
        ctx.save_for_backward(q, k, v, bias, out)
        ctx.options = options
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias, out = ctx.saved_tensors
        dq, dk, dv, db = attention_backward_ref(
            q, k, v, grad_out, bias=bias, out=out, grad_lse=grad_lse, return_grad_bias=True, **ctx.options
        )
        return dq, dk, dv, db if bias is not None else None, None


# (B, H, Hk, Mq, Mk, mask, window, softcap, bias)
GRADCHECK = [
    (1, 2, 2, 3, 4, 0, 0, 0.0, False),  # dLSE alone
    (1, 2, 2, 3, 4, 0, 0, 0.7, False),
    (2, 2, 1, 4, 3, 1, 0, 0.5, False),  # grouped heads, causal
    (1, 2, 2, 5, 3, 2, 0, 1.5, True),  # bottom-right, Mq > Mk: rows that see no key
    (1, 1, 1, 5, 5, 1, 2, 0.9, True),  # a window
]


@pytest.mark.parametrize("case", GRADCHECK, ids=lambda c: "b{}h{}/{}q{}k{}m{}w{}c{}-bias{:d}".format(*c))
def test_reference_gradients_match_finite_differences(case):
    b, h, hk, mq, mk, mask, window, softcap, with_bias = case
    gen = torch.Generator().manual_seed(sum(case[:7]))
    r = lambda *s: torch.randn(*s, dtype=F64, generator=gen, requires_grad=True)  # noqa: E731
    q, k, v = r(b, mq, h, 3), r(b, mk, hk, 3), r(b, mk, hk, 2)
    bias = r(b, h, mq, mk) if with_bias else None
    # scores of a few units: tanh's curvature shows where the cap is near them
    options = dict(custom_mask_type=mask, window_size=window, scale=1.0, softcap=softcap)
    assert torch.autograd.gradcheck(lambda *x: _ClosedForm.apply(*x, options), (q, k, v, bias), atol=1e-7)


def test_softcap_caps_the_scores():
    """c tanh(s / c): scores far above c give the same softmax as c itself; a cap far above the
    scores changes nothing."""
    q = torch.zeros(1, 1, 1, 1, dtype=F64)
    k = torch.tensor([100.0, 200.0, 0.0], dtype=F64).view(1, 3, 1, 1)
    v = torch.tensor([1.0, 2.0, 3.0], dtype=F64).view(1, 3, 1, 1)
    q[...] = 1.0
    out, lse = attention_forward_ref(q, k, v, scale=1.0, softcap=5.0)
    e = torch.tensor([5.0 * torch.tanh(torch.tensor(20.0)), 5.0 * torch.tanh(torch.tensor(40.0)), 0.0], dtype=F64)
    assert torch.allclose(lse.flatten(), torch.logsumexp(e, 0).view(1)) and out.item() < 1.6
    q, k, v = (torch.randn(1, 6, 2, 4, dtype=F64) for _ in range(3))
    plain, cap = attention_forward_ref(q, k, v), attention_forward_ref(q, k, v, softcap=1e6)
    assert all(torch.allclose(a, b, atol=1e-9) for a, b in zip(plain, cap))


def test_varlen_reference_is_each_sequence_alone():
    """Packed sequences with a grad_lse in the varlen layout ([sequences, H, max length]) give each
    sequence's dense gradients."""
    gen = torch.Generator().manual_seed(3)
    lens_q, lens_k = [3, 0, 5], [4, 2, 5]
    r = lambda *s: torch.randn(*s, dtype=F64, generator=gen)  # noqa: E731
    q, k, v, do = r(1, 8, 2, 4), r(1, 11, 1, 4), r(1, 11, 1, 3), r(1, 8, 2, 3)
    glse = r(3, 2, 32)
    cu = lambda n: torch.tensor([0] + n).cumsum(0).to(torch.int32)  # noqa: E731
    opts = dict(custom_mask_type=2, softcap=0.8)
    got = attention_backward_ref(q, k, v, do, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), grad_lse=glse, **opts)
    sq = sk = 0
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        rq, rk = slice(sq, sq + nq), slice(sk, sk + nk)
        one = attention_backward_ref(q[:, rq], k[:, rk], v[:, rk], do[:, rq], grad_lse=glse[i : i + 1, :, :nq], **opts)
        for g, w, rows in zip(got, one, (rq, rk, rk)):
            assert torch.allclose(g[:, rows], w, atol=1e-12)
        sq, sk = sq + nq, sk + nk


# ------------------------------------------------------------- the logsumexp's gradient


def test_subtract_grad_lse_takes_each_sequences_rows():
    """Δ -= dLSE on the rows of each sequence only (Δ [sequences, H, rows], dLSE in the LSE's
    layout, at least as many rows, any strides: autograd hands over expanded ones); past a
    packed sequence Δ stays."""
    delta = torch.zeros(2, 3, 50)  # the memory-efficient backward's Δ: Mq rows, the LSE's rounded up
    glse = torch.arange(2 * 3 * 64, dtype=torch.float32).view(2, 3, 64)
    C.subtract_grad_lse(delta, glse, None)
    assert torch.equal(delta, -glse[..., :50])
    delta = torch.zeros(3, 2, 40)
    C.subtract_grad_lse(delta, torch.ones(()).expand(3, 2, 64), torch.tensor([0, 5, 5, 45], dtype=torch.int32))
    assert (delta[0, :, :5] == -1).all() and not delta[0, :, 5:].any() and not delta[1].any()
    assert (delta[2] == -1).all()


@pytest.mark.compile
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_preprocess_compiles_with_grad_lse(varlen):
    assert callable(PB._build_preprocess(cutlass.BFloat16, 128, 8, varlen, True, "sm_90a", True, True))


def test_preprocess_refuses_grad_lse_without_the_lse():
    from cute_kernels.attention_bwd_prepost import ComputeDotDoO

    tiles = tiling_prepost.preprocess_tiles(16, 64, 8, "sm_90a")
    with pytest.raises(ValueError, match="lse_log2"):
        ComputeDotDoO(cutlass.BFloat16, tiles, False, False, lse_log2=False, grad_lse=True)


def test_sm90_hands_grad_lse_to_the_preprocess(monkeypatch):
    """The Hopper backward's preprocess gets the LSE's gradient beside the LSE (Δ - dLSE is
    computed there); the kernel's compile key does not change."""
    seen, keys = [], []
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(P, "launch_preprocess", lambda *a: seen.append(a))
    monkeypatch.setattr(S, "compiled", lambda config: keys.append(config) or (lambda *a: None))
    monkeypatch.setattr(P, "convert_dq", lambda acc, scale, d, sq, *rest, ready=None: torch.zeros(2, sq, 3, d))
    q, k, v, do, o = (torch.zeros(2, 100, 3, 64, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.zeros(2, 3, 128)
    for glse in (None, torch.ones(()).expand(2, 3, 128)):
        args = C.AttentionBackwardArgs(
            grad_out=do, query=q, key=k, value=v, out=o, logsumexp=lse, scale=0.1, custom_mask_type=1, grad_lse=glse
        )
        S.attention_backward_sm90(args)
        assert seen[-1][9] is glse and seen[-1][7] is lse and seen[-1][10:] == (None, None)  # (no sink)
    assert keys[0] == keys[1]


def test_mem_eff_delta_takes_grad_lse(monkeypatch):
    """The memory-efficient backward: Δ from its own launch (not the kernel's), minus dLSE, then
    the rows that see no key zeroed (their LSE is a constant 0)."""
    monkeypatch.setattr(M, "compute_delta", lambda out, do, cu, rows: torch.ones(1, 2, 6))
    q, k, v, do, o = (torch.zeros(1, 6, 2, 8) for _ in range(5))
    glse = torch.arange(2 * 32, dtype=torch.float32).view(1, 2, 32)
    args = C.AttentionBackwardArgs(
        grad_out=do, query=q, key=k[:, :4], value=v[:, :4], out=o, logsumexp=glse, custom_mask_type=2, grad_lse=glse
    )
    params = SimpleNamespace(custom_mask_type=2, window_size=0, num_splits_key=1)
    params.cfg = SimpleNamespace(kernel_computes_delta=True)
    delta, in_kernel = M._delta(args, params, 1, 6, 4)
    assert not in_kernel
    # bottom-right, 6 queries over 4 keys: rows 0 and 1 see none
    assert not delta[..., :2].any() and torch.equal(delta[..., 2:], 1 - glse[..., 2:6])


LSE_WIRING = [
    # (Mq, Mk, causal, lengths, out's loss too)
    (9, 12, False, None, True),
    (7, 12, "bottom_right", None, False),
    (16, 21, True, ([5, 0, 1, 10], [6, 4, 0, 11]), True),
]


@pytest.mark.parametrize("case", LSE_WIRING, ids=["plain", "lse-alone", "varlen"])
def test_lse_gradient_reaches_the_backward(cpu_attention, case):  # noqa: F811 (the fixture)
    """A loss on the returned logsumexp reaches the op's backward as its gradient in the LSE's
    layout (alone: with dO = 0), and the gradients are the reference's with that dLSE."""
    mq, mk, causal, lengths, with_out = case
    gen = torch.Generator().manual_seed(mq)
    q, k, v = (torch.randn(1, m, 2, 8, generator=gen).requires_grad_() for m in (mq, mk, mk))
    kw = {} if lengths is None else dict(cu_seqlens_q=_cu(lengths[0]), cu_seqlens_k=_cu(lengths[1]))
    out, lse = ops.memory_efficient_attention(q, k, v, causal=causal, return_lse=True, **kw)
    w = torch.randn(lse.shape, generator=gen)
    do = torch.randn(out.shape, generator=gen) if with_out else torch.zeros(out.shape)
    rows = torch.isfinite(lse)  # past each sequence: +inf padding, no loss there
    loss = (lse.where(rows, 0.0) * w).sum() + ((out * do).sum() if with_out else 0.0)
    loss.backward()
    (call,) = cpu_attention.calls
    assert call["grad_lse"] is not None and call["grad_lse"].shape == lse.shape
    assert with_out or not call["grad_out"].any()
    mask_type = {False: 0, True: 1, "bottom_right": 2}[causal]
    want = attention_backward_ref(q, k, v, do, custom_mask_type=mask_type, grad_lse=w.where(rows, 0.0), **kw)
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ softcap

BF16, F16 = cutlass.BFloat16, cutlass.Float16

# the forward: a few (CI cost), each feature of the consumers once beside the cap
SOFTCAP_FORWARD = [
    F.ForwardConfig(BF16, 128, 128, 1, False, False, "sm_90a", softcap=True),
    F.ForwardConfig(F16, 64, 64, 2, True, True, "sm_90a", dropout=True, softcap=True),
    F.ForwardConfig(BF16, 192, 128, 0, False, False, "sm_90a", bias=True, softcap=True),
]


@pytest.mark.compile
@pytest.mark.parametrize("config", SOFTCAP_FORWARD, ids=["d128-causal", "d64-varlen-window-dropout", "d192v128-bias"])
def test_forward_compiles_with_softcap(config):
    assert callable(F._build(config))


def _backward_key(d, dv, mask, rows, **kw):
    """The backward's compile key as a call would plan it (tiles' own switches included)."""
    flags = dict(window=False, deterministic=False, varlen=False, bias=False, grad_bias=False, dropout=False)
    flags.update(kw)
    return S._plan(BF16, d, dv, mask, "sm_90a", rows_q=rows, group=1, rows_k=rows, ctas=132, softcap=True, **flags)[2]


# the backward: d128's grid (store_first, dq_ready, a partial last block), d64's persistent causal
# CTAs (dq_defer, zero_ahead), the wide kernel with a bias (held for the cap's derivative)
SOFTCAP_BACKWARD = [
    ("d128-tail", lambda: _backward_key(128, 128, 0, 4010)),
    ("d64-causal-persistent", lambda: _backward_key(64, 64, 1, 4096)),
    ("d192v128-bias", lambda: _backward_key(192, 128, 0, 1000, bias=True)),
]


@pytest.mark.compile
@pytest.mark.parametrize("key", [k for _, k in SOFTCAP_BACKWARD], ids=[n for n, _ in SOFTCAP_BACKWARD])
def test_backward_compiles_with_softcap(key):
    config = key()
    assert config.softcap and callable(S._build(config))


def test_softcap_is_its_own_compile_key():
    """The cap is a flag of both compile keys (its value a runtime argument): a capped kernel is
    a build of its own, and one cap value serves every other."""
    fwd = F.ForwardConfig(BF16, 128, 128, 1, False, False, "sm_90a")
    assert stable_key(dataclasses.replace(fwd, softcap=True)) != stable_key(fwd)
    bwd = _backward_key(128, 128, 1, 1000)
    assert stable_key(dataclasses.replace(bwd, softcap=False)) != stable_key(bwd)
    assert "softcap" not in {f.name for f in dataclasses.fields(fwd) if f.type in ("float", float)}


def test_backward_kernel_refuses_softcap_with_a_bias_gradient():
    from cute_kernels.attention_sm90 import backward_config
    from cute_kernels.attention_sm90.attention_backward_sm90 import AttentionBackwardSm90

    tiles = backward_config.attention_sm90_tiles(128, ds_keys_contiguous=True, bias_or_dropout=True)
    with pytest.raises(ValueError, match="softcap with grad_bias"):
        AttentionBackwardSm90(BF16, tiles, 0, has_bias=True, grad_bias=True, softcap=True)


def _meta(b=1, s=128, h=2, d=64, dtype=torch.bfloat16):
    return tuple(torch.empty(b, s, h, d, dtype=dtype, device="meta") for _ in range(3))


def _args(softcap, backend="auto", bias=None, grad_bias=False, d=64):
    q, k, v = _meta(d=d)
    return C.AttentionBackwardArgs(
        grad_out=v,
        query=q,
        key=k,
        value=v,
        out=v,
        logsumexp=v,
        bias=bias,
        bias_requires_grad=grad_bias,
        backend=backend,
        softcap=softcap,
    )


def test_only_the_sm90_backward_takes_a_softcap():
    """auto: sm90 where it applies; where it does not, and with backend="mem_eff", the
    memory-efficient kernel would drop the cap: NotImplementedError naming it."""
    assert A.choose_backend(_args(30.0), arch="sm_90a")[0] == "sm90"
    assert A.choose_backend(_args(0.0), arch="sm_80")[0] == "mem_eff"
    with pytest.raises(NotImplementedError, match="softcap.*needs sm_90a"):
        A.choose_backend(_args(30.0), arch="sm_80")
    with pytest.raises(NotImplementedError, match="softcap.*backend='mem_eff'"):
        A.choose_backend(_args(30.0, backend="mem_eff"), arch="sm_90a")
    with pytest.raises(NotImplementedError, match="softcap.*head dims"):
        A.choose_backend(_args(30.0, d=80), arch="sm_90a")
    bias = torch.empty(1, 2, 128, 128, dtype=torch.bfloat16, device="meta")
    assert A.choose_backend(_args(30.0, bias=bias), arch="sm_90a")[0] == "sm90"
    with pytest.raises(NotImplementedError, match="softcap with a bias gradient"):
        A.choose_backend(_args(30.0, bias=bias, grad_bias=True), arch="sm_90a")


def test_softcap_needs_our_forward():
    """torch's forward has no softcap: where ours does not apply the op raises (meta tensors:
    no arch, so not ours), rather than running uncapped."""
    q, k, v = _meta()
    with pytest.raises(NotImplementedError, match="softcap needs our forward"):
        A._mea_impl(q, k, v, None, None, 128, 128, 0, 0, None, None, 0.0, "auto", False, 30.0)
    with pytest.raises(NotImplementedError, match="softcap needs our forward.*mem_eff"):
        A._mea_impl(q, k, v, None, None, 128, 128, 0, 0, None, None, 0.0, "mem_eff", False, 30.0)


@pytest.mark.parametrize("value,want", [(None, 0.0), (0, 0.0), (0.0, 0.0), (30, 30.0), (50.0, 50.0), (1e-3, 1e-3)])
def test_softcap_values(value, want):
    assert AC.check_softcap(value) == want


@pytest.mark.parametrize(
    "value,exc",
    [(-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError), (True, TypeError), ("30", TypeError)],
)
def test_softcap_values_refused(value, exc):
    with pytest.raises(exc, match="softcap"):
        AC.check_softcap(value)


def test_softcap_reaches_the_backward(cpu_attention):  # noqa: F811 (the fixture)
    """memory_efficient_attention(softcap=) reaches the forward and the backward (the reference
    stands in for both), and the gradients are the capped problem's."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(1, 9, 2, 8, generator=gen)
    out = ops.memory_efficient_attention(q, k, v, causal=True, softcap=1.5)
    want_out, _ = attention_forward_ref(q, k, v, custom_mask_type=1, softcap=1.5)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    out.backward(do)
    assert cpu_attention.calls[0]["softcap"] == 1.5
    want = attention_backward_ref(q, k, v, do, custom_mask_type=1, softcap=1.5)
    for got, ref in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
