"""CPU: softcapping and the gradient through the returned logsumexp. The fp64 reference's closed
forms (``ops.reference``) against finite differences (``torch.autograd.gradcheck``) on tiny shapes;
variable lengths against the same problems one sequence at a time."""

import pytest
import torch

from ops.reference import attention_backward_ref, attention_forward_ref

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
