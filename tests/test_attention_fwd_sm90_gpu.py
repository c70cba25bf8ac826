"""GPU: the Hopper attention forward against the fp64 reference, and against torch's forward in the
same dtype as the yardstick of rounding: every mask, windows, grouped-query heads, lengths that
are not multiples of the tiles, Sq != Sk, variable lengths with empty and one-token sequences, every
pair of head dims the forward compiles (Dqk 192 with Dv 128 among them); an additive bias of every
broadcast and layout; dropout with torch's keep mask, bit for bit (the same philox seed / offset as
torch's forward, and the same ones after ``torch.manual_seed``), through the autograd op with our
backward."""

import math

import pytest
import torch

from ops import attention_fwd_sm90 as A
from ops.attention import _prepare_bias
from ops.reference import attention_backward_ref, attention_forward_ref, attention_mask_ref

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


def check_forward(name, out, lse, ref_out, ref_lse, dtype, lengths=None):
    """``_check``'s bounds with messages, for O [B, Mq, H, Dv] and the whole LSE as the forward
    returns it (``lse`` None: O alone): dense, the rows past Mq +inf; with variable lengths
    (``lengths`` = (query lengths, key lengths)) each sequence's rows (the padding past them is
    torch's business, not compared)."""
    assert torch.isfinite(out).all(), f"{name}: O has NaN / inf (unwritten?)"
    err = (out.double() - ref_out).abs().max().item() if out.numel() else 0.0
    tol = _tolerance(out, ref_out, dtype)
    assert err <= tol, f"{name}: max |O - ref| {err:.3g} > {tol:.3g}"
    if lse is None:
        return
    if lengths is None:
        mq = out.shape[1]
        assert (lse[:, :, mq:] == math.inf).all(), f"{name}: LSE rows past Mq are not +inf"
        rows = [(lse[:, :, :mq], ref_lse)]
    else:
        rows = [(lse[i, :, :n], ref_lse[i, :, :n]) for i, n in enumerate(lengths[0]) if n]
    for got, want in rows:
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite), f"{name}: LSE finite where the reference is not, or not finite"
        if finite.any():
            e = (got.double()[finite] - want[finite]).abs().max().item()
            assert e < 1e-3, f"{name}: max |LSE - ref| {e:.3g} >= 1e-3"


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


@pytest.mark.parametrize("d,mask", [(64, 1), (128, 0), (128, 2)])
def test_varlen_many_sequences_and_a_loose_max_seqlen(d, mask):
    """More sequences than a warp has lanes (the CTAs' block decode walks them 32 at a time),
    empty and one-token ones among them, and max_seqlen_q above the longest (an upper bound, as
    torch's forward takes it): every sequence's rows against the reference."""
    gen = torch.Generator().manual_seed(d + mask)
    lens = [int(x) for x in torch.randint(0, 400, (45,), generator=gen)]
    lens[3], lens[10], lens[40] = 0, 1, 1000
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).int()
    q, k, v = (torch.randn(1, sum(lens), 4, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = A.attention_forward_sm90(q, k, v, None, mask, 0, cu, cu, max(lens) + 300)
    ref_out, ref_lse = attention_forward_ref(q, k, v, custom_mask_type=mask, cu_seqlens_q=cu, cu_seqlens_k=cu)
    for i, n in enumerate(lens):
        if n:
            rows = slice(cu[i], cu[i + 1])
            _check(out[:, rows], lse[i, :, :n], ref_out[:, rows], ref_lse[i, :, :n], torch.bfloat16)


def test_varlen_sections_of_heads():
    """A sequence whose K / V for all 12 heads do not fit the L2 budget runs its heads in
    sections (8, then a narrower 4 at d128 over 7000 keys), beside short and empty sequences and
    packed rows past the last sequence: every sequence's rows against the reference."""
    lens = [300, 7000, 0, 1200]
    cu = torch.tensor([0, *lens], device="cuda").cumsum(0).int()
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (
        torch.randn(1, sum(lens) + 50, 12, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)
    )
    out, lse = A.attention_forward_sm90(q, k, v, None, 1, 0, cu, cu, max(lens), max(lens))
    ref_out, ref_lse = attention_forward_ref(q, k, v, custom_mask_type=1, cu_seqlens_q=cu, cu_seqlens_k=cu)
    for i, n in enumerate(lens):
        if n:
            rows = slice(cu[i], cu[i + 1])
            _check(out[:, rows], lse[i, :, :n], ref_out[:, rows], ref_lse[i, :, :n], torch.bfloat16)


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
    bias = torch.randn(2, 256, 256, device="cuda", dtype=torch.float16)
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        ops.memory_efficient_attention(q, k, v, causal=True)
        ops.memory_efficient_attention(q, k, v, causal=True, attn_bias=bias, dropout_p=0.1)
        ops.memory_efficient_attention(*(x.float() for x in (q, k, v)), causal=True)
    forwards = [r.getMessage() for r in caplog.records if "attention forward" in r.getMessage()]
    assert forwards[:2] == ["attention forward: sm90"] * 2 and "dtype" in forwards[2]


def test_op_runs_our_forward_with_dv_other_than_dqk(caplog):
    """The public op at Dqk 192 / Dv 128 (grouped-query heads, bottom-right causal): our forward,
    O as wide as V."""
    import logging

    import ops

    torch.manual_seed(11)
    q = torch.randn(2, 260, 4, 192, device="cuda", dtype=torch.bfloat16)  # (bottom-right: Mq <= Mk)
    k = torch.randn(2, 300, 2, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"), torch.no_grad():
        out = ops.memory_efficient_attention(q, k, v, causal="bottom_right")
    assert "attention forward: sm90" in [r.getMessage() for r in caplog.records]
    ref_out, _ = attention_forward_ref(q, k, v, custom_mask_type=2)
    assert out.shape == (2, 260, 4, 128)
    assert (out.double() - ref_out).abs().max().item() <= _tolerance(out, ref_out, torch.bfloat16)


def test_return_lse_and_its_gradient():
    """``return_lse=True``: the LSE of our forward; a loss on it beside O's is differentiated
    (the backward's Δ - dLSE; tests/test_attention_features_gpu.py checks it case by case)."""
    import ops

    q, k, v = (torch.randn(1, 200, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, lse = ops.memory_efficient_attention(q, k, v, causal=True, return_lse=True)
    ref_out, ref_lse = attention_forward_ref(q.detach(), k.detach(), v.detach(), custom_mask_type=1)
    _check(out.detach(), lse.detach()[:, :, :200], ref_out, ref_lse, torch.bfloat16)
    (out.sum() + lse[:, :, :200].sum()).backward()
    glse = torch.zeros_like(lse)
    glse[:, :, :200] = 1.0
    want = attention_backward_ref(
        q.detach(), k.detach(), v.detach(), torch.ones_like(out), custom_mask_type=1, grad_lse=glse, out=out.detach()
    )
    for name, got, ref in zip("qkv", (q.grad, k.grad, v.grad), want):
        err = (got.double() - ref).abs().max().item()
        assert err <= 2e-2 * ref.abs().max().item(), f"d{name}: {err:.3g}"


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
            F.scaled_dot_product_attention(*(x.detach().float() for x in (q, k, v)))
        out.sum().backward()
    ref_out, _ = attention_forward_ref(*(x.detach().transpose(1, 2) for x in (q, k, v)), custom_mask_type=1)
    assert (out.detach().transpose(1, 2).double() - ref_out).abs().max().item() <= _tolerance(
        out, ref_out, torch.bfloat16
    )
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    falls = [r.getMessage() for r in caplog.records if "SDPA efficient forward falls back" in r.getMessage()]
    assert len(falls) == 1 and "dtype" in falls[0]


# ------------------------------------------------------------------------- attention bias


def _bias(shape, layout, dtype):
    """A bias of ``shape`` (broadcast to [B, H, Mq, Mk] by the kernel): dense, rows of a wider
    buffer (strides not multiples of 8), keys not contiguous, or a broadcast expanded to stride 0."""
    if layout == "padded":
        return torch.randn(*shape[:-1], shape[-1] + 3, device="cuda", dtype=dtype)[..., : shape[-1]]
    if layout == "transposed":
        return torch.randn(*shape[:-2], shape[-1], shape[-2], device="cuda", dtype=dtype).transpose(-1, -2)
    return torch.randn(*shape, device="cuda", dtype=dtype)


# (B, H, Hk, Sq, Sk, D, mask, window, bias shape, layout)
BIAS = [
    (2, 4, 4, 300, 300, 128, 0, 0, (1, 4, 300, 300), "dense"),
    (2, 4, 2, 257, 513, 64, 1, 0, (2, 1, 257, 513), "padded"),
    (2, 3, 3, 200, 333, 128, 2, 0, (2, 3, 1, 333), "dense"),
    (1, 6, 2, 511, 300, 64, 2, 100, (511, 300), "transposed"),
    (3, 2, 2, 1, 1, 128, 0, 0, (3, 2, 1, 1), "dense"),
    (1, 2, 1, 700, 700, 64, 1, 0, (1, 2, 700, 700), "padded"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case", BIAS, ids=lambda c: "b{}h{}/{}q{}k{}d{}m{}w{}-{}-{}".format(*c[:8], "x".join(map(str, c[8])), c[9])
)
def test_bias(case, dtype):
    """S = scale Q K^T + B with B of every broadcast kind ([1, H, ...], [B, 1, ...], one row per head
    expanded, 2-D) and layout, against the fp64 reference."""
    b, h, hk, sq, sk, d, mask, window, shape, layout = case
    torch.manual_seed(sq + sk + d)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    bias = 2 * _bias(shape, layout, dtype)
    assert A.unsupported(q, k, v, mask_type=mask, bias=bias) is None
    out, lse = A.attention_forward_sm90(q, k, v, None, mask, window, bias=bias)
    ref_out, ref_lse = attention_forward_ref(q, k, v, custom_mask_type=mask, window_size=window, bias=bias)
    _check(out, lse[:, :, :sq], ref_out, ref_lse, dtype)


# ------------------------------------------------------------------------- dropout


def _torch_keep_mask(shape, p, seed, offset):
    """torch's memory-efficient dropout mask for (seed, offset): its uniforms > p."""
    u = torch.empty(shape, device="cuda", dtype=torch.float32)
    torch.ops.aten._fill_mem_eff_dropout_mask_(u, p, int(seed), int(offset))
    return u > p


def _philox(seed, offset):
    return torch.tensor(seed, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64)


def forward_reference(
    q,
    k,
    v,
    *,
    mask_type=0,
    window=0,
    scale=None,
    bias=None,
    lengths=None,
    max_q=None,
    max_k=None,
    p=0.0,
    seed=0,
    offset=0,
    grad_out=None,
    out=None,
):
    """fp64 (O, LSE) of the forward's problem, with torch's keep mask for philox (``seed``, ``offset``)
    where ``p`` > 0: dense, the [B, H, Mq, Mk] stream of torch's forward; variable lengths
    (``lengths`` = (query lengths, key lengths), ``max_q`` / ``max_k`` the longest the call passed),
    the backwards' streams our forward draws (sequence i's head h from offset + (i H + h) max_q max_k,
    element (n, m) at n Sk_i + m). LSE [B, H, Mq] dense, [sequences, H, max_q] (+inf past each
    sequence) with variable lengths. With ``grad_out`` a third entry: (dq, dk, dv, dbias) of the same
    problem (dbias [B, H, Mq, Mk] with a bias, else None; Δ from ``out``, by default the exact O rounded)."""
    kw = dict(custom_mask_type=mask_type, window_size=window, scale=scale, dropout_p=p)
    h = q.shape[2]
    if lengths is None:
        b, mq = q.shape[:2]
        keep = _torch_keep_mask((b, h, mq, k.shape[1]), p, seed, offset) if p > 0 else None
        o, lse = attention_forward_ref(q, k, v, bias=bias, dropout_mask=keep, **kw)
        if grad_out is None:
            return o, lse
        grads = attention_backward_ref(
            q, k, v, grad_out, bias=bias, dropout_mask=keep, return_grad_bias=True, out=out, **kw
        )
        return o, lse, tuple(grads[:3]) + (grads[3] if bias is not None else None,)
    assert bias is None, "no bias with variable lengths"
    words = max_q * max_k
    starts_q, starts_k = [0], [0]
    for nq, nk in zip(*lengths):
        starts_q.append(starts_q[-1] + nq)
        starts_k.append(starts_k[-1] + nk)
    o = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=torch.float64, device=q.device)
    lse = torch.full((len(lengths[0]), h, max_q), math.inf, dtype=torch.float64, device=q.device)
    grads = [torch.zeros_like(x, dtype=torch.float64) for x in (q, k, v)]
    for i, (nq, nk) in enumerate(zip(*lengths)):
        if nq == 0:
            continue
        sq, sk = slice(starts_q[i], starts_q[i + 1]), slice(starts_k[i], starts_k[i + 1])
        keep = None
        if p > 0 and nk > 0:
            stream = _torch_keep_mask((1, h, 1, words), p, seed, offset + i * h * words)
            keep = stream[..., : nq * nk].reshape(1, h, nq, nk)
        qs, ks, vs = q[:, sq], k[:, sk], v[:, sk]
        o[:, sq], lse_i = attention_forward_ref(qs, ks, vs, dropout_mask=keep, **kw)
        lse[i, :, :nq] = lse_i[0]
        if grad_out is not None:
            g = attention_backward_ref(
                qs, ks, vs, grad_out[:, sq], dropout_mask=keep, out=None if out is None else out[:, sq], **kw
            )
            grads[0][:, sq], grads[1][:, sk], grads[2][:, sk] = g
    if grad_out is None:
        return o, lse
    return o, lse, (*grads, None)


def _one_hot_values(b, sk, hk, dv, k0, dtype):
    """V whose value row k is the unit vector k - k0 for keys k0 .. k0 + dv - 1 (0 elsewhere): with
    Q = 0 (every visible key's P the same) O[q, j] != 0 exactly where key k0 + j is kept."""
    v = torch.zeros(b, sk, hk, dv, device="cuda", dtype=dtype)
    n = min(dv, sk - k0)
    v[:, k0 : k0 + n, :, :n] = torch.eye(n, device="cuda", dtype=dtype).unsqueeze(1)
    return v


# (B, H, Hk, Sq, Sk, D, mask, p, seed, offset): Sk odd and B H Sq Sk not a multiple of 4 (draws that
# start inside a Philox counter), several key blocks, a seed with the top bit set, a large offset
DROPOUT_MASKS = [
    (2, 4, 2, 200, 333, 64, 0, 0.3, 1234, 0),
    (2, 2, 2, 131, 301, 128, 1, 0.5, 2**63 + 17 - 2**64, 8),
    (1, 3, 1, 129, 257, 64, 2, 0.1, 42, 2**33 + 4),
    (2, 2, 1, 77, 500, 128, 2, 0.25, 7, 12),
]


@pytest.mark.parametrize("case", DROPOUT_MASKS, ids=lambda c: "b{}h{}/{}q{}k{}d{}m{}p{}".format(*c[:8]))
def test_dropout_keeps_torchs_mask(case):
    """The kernel's keep flags, bit for bit: Q = 0 and one-hot value rows make O nonzero exactly at
    the (query, key) pairs kept and visible, for every window of Dv keys; torch's mask from its own
    ``_fill_mem_eff_dropout_mask_`` for the same seed / offset."""
    b, h, hk, sq, sk, d, mask, p, seed, offset = case
    dtype = torch.bfloat16
    q = torch.zeros(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    keep = _torch_keep_mask((b, h, sq, sk), p, seed, offset)
    visible = attention_mask_ref(sq, sk, mask, 0, device="cuda")
    seed_t, offset_t = _philox(seed, offset)
    for k0 in range(0, sk, d):
        v = _one_hot_values(b, sk, hk, d, k0, dtype)
        out, lse = A.attention_forward_sm90(
            q, k, v, None, mask, dropout_p=p, philox_seed=seed_t, philox_offset=offset_t
        )
        n = min(d, sk - k0)
        seen = out[..., :n].permute(0, 2, 1, 3) != 0  # [B, H, Sq, keys k0 ..]
        want = keep[..., k0 : k0 + n] & visible[:, k0 : k0 + n]
        assert torch.equal(seen, want), f"keys {k0}..: {(seen != want).sum().item()} flags differ"
        assert (out[..., n:] == 0).all()
        # the LSE is the undropped softmax's: log of the visible keys' count (S = 0)
        count = visible.sum(1).double().log()
        assert (lse[:, :, :sq].double() - count).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "case",
    [(2, 4, 2, 300, 300, 128, 1, None), (2, 3, 3, 257, 513, 64, 0, (1, 3, 257, 513)), (1, 4, 1, 130, 700, 64, 2, None)],
    ids=lambda c: "b{}h{}/{}q{}k{}d{}m{}".format(*c[:7]) + ("-bias" if c[7] else ""),
)
def test_dropout_matches_torchs_forward(case, dtype):
    """torch.manual_seed(s), then ours (the drop-in ``efficient_attention_forward``) and torch's
    ``_efficient_attention_forward`` (key / value repeated per query head): the same philox seed and
    offset, the generator advanced alike, O and the LSE as the fp64 reference with torch's mask, and
    ours within torch's own distance from it."""
    import ops

    b, h, hk, sq, sk, d, mask, bias_shape = case
    p = 0.2
    torch.manual_seed(sq * sk)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=dtype) for _ in range(2))
    bias = None if bias_shape is None else torch.randn(*bias_shape, device="cuda", dtype=dtype)
    assert A.unsupported(q, k, v, mask_type=mask, bias=bias, dropout_p=p) is None  # ours runs
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    got = {}
    for who in ("ours", "torch"):
        torch.manual_seed(11)
        torch.randn(3, device="cuda")  # an offset that is not 0
        if who == "ours":
            res = ops.efficient_attention_forward(q, k, v, bias, None, None, None, None, p, mask, True)
        else:
            kr, vr = (x.repeat_interleave(h // hk, dim=2) for x in (k, v))
            bias_t = None if bias is None else _prepare_bias(bias, q, k, None)  # rows 16-aligned, as torch wants
            res = torch.ops.aten._efficient_attention_forward(q, kr, vr, bias_t, None, None, None, None, p, mask, True)
        got[who] = (res[0], res[1], int(res[2]), int(res[3]), gen.get_offset())
    (out, lse, seed, offset, after), (t_out, t_lse, t_seed, t_offset, t_after) = got["ours"], got["torch"]
    assert (seed, offset, after) == (t_seed, t_offset, t_after)
    keep = _torch_keep_mask((b, h, sq, sk), p, seed, offset)
    ref_out, ref_lse = attention_forward_ref(q, k, v, custom_mask_type=mask, bias=bias, dropout_mask=keep, dropout_p=p)
    _check(out, lse[:, :, :sq], ref_out, ref_lse, dtype)
    ours_err = (out.double() - ref_out).abs().max().item()
    torch_err = (t_out.double() - ref_out).abs().max().item()
    assert ours_err <= 2 * torch_err + (4e-3 if dtype == torch.bfloat16 else 1e-3), (ours_err, torch_err)
    assert (lse - t_lse)[:, :, :sq].abs().max().item() < 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dropout_autograd_matches_torch(dtype, caplog):
    """Training through ``memory_efficient_attention`` (our forward, our backward) with dropout,
    grouped-query heads, a causal mask and a bias, against torch's forward + backward under the
    same ``torch.manual_seed`` (key / value repeated per query head, autograd summing them back)
    and the fp64 reference with torch's mask."""
    import logging

    import ops

    from .helpers import delta_rounding_floors
    from .test_mem_eff_attention_gpu import check_grad

    b, h, hk, sq, sk, d, p = 2, 4, 2, 200, 256, 64, 0.2
    gen = torch.Generator("cuda").manual_seed(5)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    q, k, v, do = r(b, sq, h, d), r(b, sk, hk, d), r(b, sk, hk, d), r(b, sq, h, d)
    bias = r(1, h, sq, sk)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.manual_seed(23)
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        out = ops.memory_efficient_attention(*leaves, causal=True, attn_bias=bias, dropout_p=p)
    assert "attention forward: sm90" in [r.getMessage() for r in caplog.records]
    out.backward(do)
    # torch's forward under the same seed, its backward (key / value repeated, summed back)
    g = h // hk
    torch.manual_seed(23)
    kr, vr, bias_t = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2), _prepare_bias(bias, q, k, None)
    t_out, t_lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        q, kr, vr, bias_t, None, None, None, None, p, 1, True
    )
    t_dq, t_dk, t_dv, _ = torch.ops.aten._efficient_attention_backward(
        do, q, kr, vr, bias_t, t_out, None, None, sq, sk, t_lse, p, seed, offset, 1, False
    )
    theirs = [t_dq] + [x.view(b, sk, hk, g, d).sum(3) for x in (t_dk, t_dv)]
    keep = _torch_keep_mask((b, h, sq, sk), p, int(seed), int(offset))
    kw = dict(custom_mask_type=1, bias=bias, dropout_mask=keep, dropout_p=p)
    ref_out, _ = attention_forward_ref(q, k, v, **kw)
    ref = attention_backward_ref(q, k, v, do, **kw)
    assert (out.detach().double() - ref_out).abs().max().item() <= _tolerance(out, ref_out, dtype)
    dq_floor, dk_floor = delta_rounding_floors(q, k, do, out.detach(), dtype)
    grads = [x.grad for x in leaves]
    for name, got, want, t, floor in zip(("dq", "dk", "dv"), grads, ref, theirs, (dq_floor, dk_floor, None)):
        check_grad(f"{name} {dtype}", got, want, dtype, t.to(dtype), floor=floor)


def _varlen_one_hot(lens_q, lens_k, h, d, run):
    """(cu_seqlens_q, [(k0, O)]): O of ``run(q, k, v, cu_q, cu_k, max_q, max_k)`` for Q = 0 and value
    rows one-hot for keys k0 .. k0 + d - 1 of every sequence, a call per window k0."""
    cu_q, cu_k = (torch.tensor([0, *x], device="cuda").cumsum(0).int() for x in (lens_q, lens_k))
    q = torch.zeros(1, sum(lens_q), h, d, device="cuda", dtype=torch.float16)
    k = torch.randn(1, sum(lens_k), h, d, device="cuda", dtype=torch.float16)
    windows = []
    for k0 in range(0, max(lens_k), d):
        v = torch.zeros_like(k)
        for i, n in enumerate(lens_k):
            m = min(d, n - k0)
            if m > 0:
                start = int(cu_k[i]) + k0
                v[0, start : start + m, :, :m] = torch.eye(m, device="cuda", dtype=v.dtype).unsqueeze(1)
        windows.append((k0, run(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))))
    return cu_q, windows


def _varlen_seen(out, cu_q, lens_q, lens_k, i, k0, d):
    """Sequence i's O pattern [H, Sq_i, keys k0 ..] of one one-hot window."""
    n = min(d, lens_k[i] - k0)
    rows = out[0, int(cu_q[i]) : int(cu_q[i + 1]), :, : max(n, 0)]
    return rows.permute(1, 0, 2) != 0, n


def test_dropout_varlen_draws_the_backwards_streams():
    """Variable lengths: sequence i's (i, head) stream starts at (i H + head) max_q max_k, element
    (n, m) at n Sk_i + m, as the backwards redraw it (ours and torch's), so training through our
    forward and backward sees one mask."""
    from ops.reference import mem_eff_dropout_keep_mask

    lens_q, lens_k, h, d, p, seed, offset = [70, 0, 130, 5], [90, 3, 150, 1], 2, 64, 0.3, 99, 16
    seed_t, offset_t = _philox(seed, offset)

    def ours(q, k, v, cu_q, cu_k, max_q, max_k):
        return A.attention_forward_sm90(
            q, k, v, None, 0, 0, cu_q, cu_k, max_q, max_k, dropout_p=p, philox_seed=seed_t, philox_offset=offset_t
        )[0]

    cu_q, windows = _varlen_one_hot(lens_q, lens_k, h, d, ours)
    words = max(lens_q) * max(lens_k)
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0 or nk == 0:
            continue
        full = mem_eff_dropout_keep_mask(seed, offset + i * h * words, 1, h, 1, words, p)
        keep = full.view(h, words)[:, : nq * nk].reshape(h, nq, nk).cuda()
        for k0, out in windows:
            seen, n = _varlen_seen(out, cu_q, lens_q, lens_k, i, k0, d)
            if n > 0:
                assert torch.equal(seen, keep[:, :, k0 : k0 + n]), (i, k0)


def test_torchs_varlen_forward_draw():
    """What torch's forward draws with variable lengths (docs/attention_fwd_sm90.md): it passes
    num_keys = 0 into its batch-head offsets (attention.cu: ``max_seqlen_k = 0`` with cu_seqlens), so
    every (sequence, head) reads the stream from the offset itself, element (n, m) at n Sk_i + m:
    not the backwards' streams, which our forward draws instead."""
    from ops.reference import mem_eff_dropout_keep_mask

    lens_q, lens_k, h, d, p = [70, 130], [90, 150], 2, 64, 0.3
    calls = []

    def theirs(q, k, v, cu_q, cu_k, max_q, max_k):
        res = torch.ops.aten._efficient_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, p, 0, False)
        calls.append((int(res[2]), int(res[3])))
        return res[0]

    cu_q, windows = _varlen_one_hot(lens_q, lens_k, h, d, theirs)
    for (k0, out), (seed, offset) in zip(windows, calls):
        for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
            seen, n = _varlen_seen(out, cu_q, lens_q, lens_k, i, k0, d)
            if n > 0:
                keep = mem_eff_dropout_keep_mask(seed, offset, 1, 1, nq, nk, p)[0, 0].cuda()
                assert torch.equal(seen, keep[:, k0 : k0 + n].expand_as(seen)), (i, k0)


def test_dropout_varlen_autograd():
    """Training with variable lengths and dropout through our forward and backward: the gradients
    of the fp64 reference with the backwards' streams (``torch.manual_seed(s)``: seed s, offset 0)."""
    import ops

    from .helpers import delta_rounding_floors
    from .test_mem_eff_attention_features_gpu import _varlen_dropout_ref
    from .test_mem_eff_attention_gpu import check_grad

    lens_q, lens_k, h, d, p, s = [70, 0, 129, 5], [90, 3, 200, 1], 2, 64, 0.25, 31
    dtype = torch.float16
    cu_q, cu_k = (torch.tensor([0, *x], device="cuda").cumsum(0).int() for x in (lens_q, lens_k))
    gen = torch.Generator("cuda").manual_seed(2)
    r = lambda *sh: torch.randn(*sh, device="cuda", dtype=dtype, generator=gen)  # noqa: E731
    q, k, v, do = r(1, sum(lens_q), h, d), r(1, sum(lens_k), h, d), r(1, sum(lens_k), h, d), r(1, sum(lens_q), h, d)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.manual_seed(s)
    out = ops.memory_efficient_attention(
        *leaves, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=129, max_seqlen_k=200, dropout_p=p
    )
    out.backward(do)
    ref, ref_out, _ = _varlen_dropout_ref(q, k, v, do, (lens_q, lens_k), 129, 200, p, s, 0, 1, 0, None)
    assert (out.detach().double() - ref_out).abs().max().item() <= _tolerance(out, ref_out, dtype)
    floors = (*delta_rounding_floors(q, k, do, out.detach(), dtype), None)
    for name, got, want, floor in zip(("dq", "dk", "dv"), (x.grad for x in leaves), ref, floors):
        check_grad(f"{name} varlen", got, want, dtype, floor=floor)


def test_sdpa_with_bias_and_dropout_runs_our_forward(caplog):
    """F.scaled_dot_product_attention with a bias and dropout on the efficient backend: our forward
    (no fallback), torch's mask after ``torch.manual_seed(s)`` (seed s, offset 0), O as the fp64
    reference with that mask and within torch's own distance from it."""
    import logging

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import ops

    dtype, p = torch.float16, 0.2
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=dtype) for _ in range(3))
    bias = torch.randn(1, 4, 300, 300, device="cuda", dtype=dtype)
    outs = {}
    for on in (True, False):
        torch.manual_seed(17)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), ops.use_for_sdpa(enabled=on):
            with caplog.at_level(logging.DEBUG, logger="cute_kernels"):
                outs[on] = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p).transpose(1, 2)
    assert not [r for r in caplog.records if "SDPA efficient forward falls back" in r.getMessage()]
    keep = _torch_keep_mask((2, 4, 300, 300), p, 17, 0)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    ref_out, _ = attention_forward_ref(t(q), t(k), t(v), bias=bias, dropout_mask=keep, dropout_p=p)
    ours_err = (outs[True].double() - ref_out).abs().max().item()
    torch_err = (outs[False].double() - ref_out).abs().max().item()
    assert ours_err <= _tolerance(outs[True], ref_out, dtype) and ours_err <= 2 * torch_err + 1e-3, (
        ours_err,
        torch_err,
    )


def test_dropout_under_graph_capture_runs_torchs_forward(caplog):
    """Under CUDA-graph capture dropout runs torch's forward (its philox state is graph-safe, ours
    from Python is not), with the reason logged; replays draw fresh masks."""
    import logging

    import ops

    q = torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.float16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.memory_efficient_attention(q, q, q, dropout_p=0.3)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.attention"):
        with torch.cuda.graph(graph):
            out = ops.memory_efficient_attention(q, q, q, dropout_p=0.3)
    assert any("CUDA-graph capture" in r.getMessage() for r in caplog.records)
    graph.replay()
    first = out.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and not torch.equal(first, out)
