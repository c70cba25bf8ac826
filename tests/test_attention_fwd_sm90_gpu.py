"""GPU: the Hopper attention forward against the fp64 reference, and against torch's forward in the
same dtype as the yardstick of rounding: every mask, windows, grouped-query heads, lengths that
are not multiples of the tiles, Sq != Sk, variable lengths with empty and one-token sequences, every
pair of head dims the forward compiles (Dqk 192 with Dv 128 among them)."""

import math

import pytest
import torch

from ops import attention_fwd_sm90 as A
from ops.reference import attention_forward_ref

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
# (B, H, Hk, Sq, Sk, D, mask, window[, Dv]): Dv = D unless given
DENSE = [
    (2, 4, 4, 300, 300, 128, 0, 0),
    (2, 4, 2, 257, 513, 128, 1, 0),
    (1, 6, 2, 511, 300, 64, 2, 0),
    (2, 3, 3, 1000, 1000, 64, 1, 0),
    (1, 4, 1, 777, 777, 128, 1, 100),
    (1, 2, 2, 64, 1500, 64, 2, 200),
    (3, 2, 2, 1, 1, 128, 0, 0),
    (1, 2, 1, 2048, 2048, 64, 2, 0),
    (2, 2, 2, 130, 70, 128, 1, 0),
    (2, 4, 2, 300, 300, 96, 0, 0),
    (1, 4, 4, 333, 517, 96, 2, 100),
    (2, 4, 2, 257, 513, 192, 1, 0),
    (1, 3, 1, 700, 700, 192, 2, 150),
    (2, 4, 4, 300, 300, 256, 0, 0),
    (1, 4, 2, 513, 257, 256, 1, 0),
    (1, 2, 1, 600, 600, 256, 1, 64),
    (2, 4, 2, 300, 300, 192, 0, 0, 128),
    (1, 4, 1, 777, 777, 192, 2, 0, 128),
    (1, 2, 2, 400, 1000, 192, 1, 200, 128),
]
# (query lengths, key lengths, H, Hk, D, mask, window[, Dv])
VARLEN = [
    ([5, 0, 300, 1, 129, 700], [5, 3, 300, 1, 200, 700], 4, 2, 128, 1, 0),
    ([100, 257, 64], [100, 0, 64], 2, 2, 64, 0, 0),
    ([50, 400, 1], [300, 400, 10], 2, 1, 128, 2, 64),
    ([5, 0, 300, 1, 129, 700], [5, 3, 300, 1, 200, 700], 4, 2, 96, 1, 0),
    ([100, 257, 64], [100, 0, 64], 2, 2, 192, 0, 0),
    ([130, 1, 77], [130, 5, 200], 2, 1, 192, 2, 50),
    ([50, 400, 1], [300, 400, 10], 2, 1, 256, 2, 64),
    ([130, 64, 3], [130, 64, 3], 2, 2, 256, 0, 0),
    ([33, 300, 129], [40, 280, 129], 4, 2, 192, 1, 0, 128),
    ([200, 1, 77], [250, 5, 77], 2, 1, 192, 2, 50, 128),
]


def _dims(d, rest):
    """D and Dv of a case whose optional last field is Dv, and the id's head-dim part."""
    dv = rest[0] if rest else d
    return d, dv, f"d{d}" if dv == d else f"d{d}v{dv}"


def _tolerance(out, ref, dtype):
    """Twice the error of rounding the exact result to ``dtype``, plus a few units of it: the
    forward's P is rounded to ``dtype`` before P V, as every fused attention does."""
    rounding = (ref.to(dtype).double() - ref).abs().max().item() if ref.numel() else 0.0
    return 2 * rounding + (1e-2 if dtype == torch.bfloat16 else 2e-3)


def _check(out, lse, ref_out, ref_lse, dtype):
    assert torch.isfinite(out).all()
    assert (out.double() - ref_out).abs().max().item() <= _tolerance(out, ref_out, dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < 1e-3 if finite.any() else True


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case", DENSE, ids=lambda c: "b{}h{}/{}q{}k{}{}m{}w{}".format(*c[:5], _dims(c[5], c[8:])[2], *c[6:8])
)
def test_dense(case, dtype):
    b, h, hk, sq, sk, d, mask, window, *rest = case
    d, dv, _ = _dims(d, rest)
    torch.manual_seed(sum(case))
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype)
    assert A.unsupported(q, k, v, mask_type=mask) is None
    out, lse = A.attention_forward_sm90(q, k, v, None, mask, window)
    ref_out, ref_lse = attention_forward_ref(q, k, v, custom_mask_type=mask, window_size=window)
    _check(out, lse[:, :, :sq], ref_out, ref_lse, dtype)
    assert lse.shape[-1] == math.ceil(sq / 32) * 32 and torch.isinf(lse[:, :, sq:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case", VARLEN, ids=lambda c: f"{len(c[0])}seqs-{_dims(c[4], c[7:])[2]}-h{c[2]}/{c[3]}-m{c[5]}-w{c[6]}"
)
def test_varlen(case, dtype):
    lens_q, lens_k, h, hk, d, mask, window, *rest = case
    d, dv, _ = _dims(d, rest)
    torch.manual_seed(len(lens_q) + d + dv)
    cu_q, cu_k = (torch.tensor([0, *x], device="cuda").cumsum(0).int() for x in (lens_q, lens_k))
    q = torch.randn(1, sum(lens_q), h, d, device="cuda", dtype=dtype)
    k = torch.randn(1, sum(lens_k), hk, d, device="cuda", dtype=dtype)
    v = torch.randn(1, sum(lens_k), hk, dv, device="cuda", dtype=dtype)
    assert A.unsupported(q, k, v, mask_type=mask) is None
    out, lse = A.attention_forward_sm90(q, k, v, None, mask, window, cu_q, cu_k, max(lens_q))
    ref_out, ref_lse = attention_forward_ref(
        q, k, v, custom_mask_type=mask, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
    )
    for i, n in enumerate(lens_q):  # the padding past each sequence is torch's business: +inf or unwritten
        if n == 0:  # an empty sequence: nothing to compare (its neighbours are)
            continue
        _check(
            out[:, cu_q[i] : cu_q[i + 1]], lse[i, :, :n], ref_out[:, cu_q[i] : cu_q[i + 1]], ref_lse[i, :, :n], dtype
        )


def test_no_keys():
    q = torch.randn(2, 40, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = v = torch.empty(2, 0, 2, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = A.attention_forward_sm90(q, k, v)
    assert (out == 0).all() and (lse[:, :, :40] == 0).all() and torch.isinf(lse[:, :, 40:]).all()


def test_scale_and_strided_inputs():
    """A scale of the caller's, and q / k / v as views of a packed qkv tensor (TMA-aligned strides)."""
    qkv = torch.randn(2, 333, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    assert A.unsupported(q, k, v) is None
    out, lse = A.attention_forward_sm90(q, k, v, 0.3, 1)
    ref_out, ref_lse = attention_forward_ref(q, k, v, custom_mask_type=1, scale=0.3)
    _check(out, lse[:, :, :333], ref_out, ref_lse, torch.bfloat16)


def test_drop_in_matches_aten():
    """``ops.efficient_attention_forward``: aten's arguments and outputs, our kernel."""
    import ops

    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse, seed, offset, mq, mk = ops.efficient_attention_forward(
        q, k, v, None, None, None, None, None, 0.0, 1, True
    )
    ref_out, ref_lse = attention_forward_ref(q, k, v, custom_mask_type=1)
    _check(out, lse[:, :, :300], ref_out, ref_lse, torch.bfloat16)
    theirs = torch.ops.aten._efficient_attention_forward(q, k, v, None, None, None, None, None, 0.0, 1, True)
    assert lse.shape == theirs[1].shape and (mq, mk) == (300, 300)
    assert ops.efficient_attention_forward(q, k, v, None, None, None, None, None, 0.0, 1)[1].shape[-1] == 0


def test_op_runs_our_forward_and_logs_it(caplog):
    import logging

    import ops

    q, k, v = (torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        ops.memory_efficient_attention(q, k, v, causal=True)
        ops.memory_efficient_attention(q, k, v, causal=True, dropout_p=0.1)
    forwards = [r.getMessage() for r in caplog.records if "attention forward" in r.getMessage()]
    assert forwards[0] == "attention forward: sm90" and "dropout" in forwards[1]


def test_op_runs_our_forward_with_dv_other_than_dqk(caplog):
    """The public op at Dqk 192 / Dv 128 (grouped-query heads, bottom-right causal): our forward,
    O as wide as V."""
    import logging

    import ops

    torch.manual_seed(11)
    q = torch.randn(2, 300, 4, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 260, 2, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 260, 2, 128, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"), torch.no_grad():
        out = ops.memory_efficient_attention(q, k, v, causal="bottom_right")
    assert "attention forward: sm90" in [r.getMessage() for r in caplog.records]
    ref_out, _ = attention_forward_ref(q, k, v, custom_mask_type=2)
    assert out.shape == (2, 300, 4, 128)
    assert (out.double() - ref_out).abs().max().item() <= _tolerance(out, ref_out, torch.bfloat16)


def test_return_lse_and_its_gradient():
    """``return_lse=True``: the LSE of our forward; training through O works, through the LSE it
    raises NotImplementedError (not a silently missing gradient)."""
    import ops

    q, k, v = (torch.randn(1, 200, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, lse = ops.memory_efficient_attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = attention_forward_ref(q.detach(), k.detach(), v.detach(), custom_mask_type=1)
    _check(out.detach(), lse.detach()[:, :, :200], ref_out, ref_lse, torch.bfloat16)
    out.sum().backward(retain_graph=True)
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(NotImplementedError, match="logsumexp"):
        (out.sum() + lse[:, :, :200].sum()).backward()


def test_use_for_sdpa_runs_our_forward(caplog):
    """F.scaled_dot_product_attention on the efficient backend: our forward ([B, H, M, K] views),
    our backward, against the fp64 reference; torch's forward where ours does not apply (bias)."""
    import logging

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import ops

    torch.manual_seed(7)
    q, k, v = (torch.randn(2, 4, 320, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with ops.use_for_sdpa(), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        with caplog.at_level(logging.DEBUG, logger="cute_kernels"):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            bias = torch.randn(2, 4, 320, 320, device="cuda", dtype=torch.bfloat16)
            F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=bias)
        out.sum().backward()
    ref_out, _ = attention_forward_ref(*(x.detach().transpose(1, 2) for x in (q, k, v)), custom_mask_type=1)
    assert (out.detach().transpose(1, 2).double() - ref_out).abs().max().item() <= _tolerance(
        out, ref_out, torch.bfloat16
    )
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    falls = [r.getMessage() for r in caplog.records if "SDPA efficient forward falls back" in r.getMessage()]
    assert len(falls) == 1 and "bias" in falls[0]
