"""GPU: the LayerNorm / RMSNorm forward against an fp64 reference, outputs poisoned first: every
dtype mix of x, weight and bias, with and without them, N from 1 (odd ones too) to 131072,
many rows, strided / transposed / expanded / misaligned inputs, both cluster exchanges alike
bit for bit; then the autograd ops (forward + backward against torch), torch.compile and
CUDA-graph capture."""

import pytest
import torch

import ops
from ops import _compile as cc
from ops import norm as N
from ops import norm_forward as NF
from tests.helpers import UNIT_ROUNDOFF, poison, rel_err

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
ROW_LENGTHS = (1, 2, 3, 7, 31, 64, 100, 1000, 1024, 1025, 4096, 5000, 8192, 12288, 16384, 30000, 65536, 100000, 131072)


def _reference(x, w, b, eps, is_rms):
    """y, mean (None for RMSNorm), rstd and the normalised x, all fp64."""
    x64 = x.double()
    if is_rms:
        mean, var = None, x64.square().mean(-1)
    else:
        var, mean = torch.var_mean(x64, -1, correction=0)
    rstd = torch.rsqrt(var + eps)
    xhat = (x64 if mean is None else x64 - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    y = xhat * (1.0 if w is None else w.double())
    return (y if b is None else y + b.double()), mean, rstd, xhat


def _inputs(shape, dtype, w_dtype=None, b_dtype=None, offset=0.5, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(shape, device="cuda", generator=g) * 2 + offset).to(dtype)
    w = None if w_dtype is None else torch.randn(n, device="cuda", generator=g).to(w_dtype)
    b = None if b_dtype is None else torch.randn(n, device="cuda", generator=g).to(b_dtype)
    return x, w, b


def _run(x, w, b, eps, is_rms):
    """The kernel into NaN-filled outputs, so that unwritten elements show."""
    assert NF.unsupported(x, w, b) is None
    y = poison(torch.empty(x.shape, dtype=x.dtype, device="cuda"))
    rstd = poison(torch.empty(x.shape[:-1], dtype=torch.float32, device="cuda"))
    mean = None if is_rms else poison(torch.empty_like(rstd))
    NF.launch(x, w, b, eps, is_rms, y, mean, rstd)
    return y, mean, rstd


def _check(x, w=None, b=None, eps=1e-5, is_rms=False):
    y, mean, rstd = _run(x, w, b, eps, is_rms)
    ry, rmean, rrstd, xhat = _reference(x, w, b, eps, is_rms)
    assert torch.isfinite(y).all() and torch.isfinite(rstd).all()
    # each element: its rounding to y's dtype plus fp32 arithmetic on the terms that make it,
    # the mean's among them (a sum's error is relative to the sum of |x|)
    wabs = 1.0 if w is None else w.double().abs()
    mean_term = wabs * (rrstd * x.double().abs().mean(-1)).unsqueeze(-1)
    terms = (xhat * wabs).abs() + (0.0 if b is None else b.double().abs()) + mean_term
    u = UNIT_ROUNDOFF[x.dtype]
    bound = u * (ry.abs() + torch.finfo(x.dtype).tiny) + 2e-5 * terms  # tiny: fp16's subnormal spacing
    err = (y.double() - ry).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    assert rel_err(y, ry) < TOL[x.dtype]
    assert rel_err(rstd, rrstd) < 1e-5
    if not is_rms:
        assert torch.isfinite(mean).all()
        scale = x.double().abs().mean(-1) + 1e-30  # a sum's fp32 error is relative to sum |x|
        assert ((mean.double() - rmean).abs() <= 1e-5 * scale).all()
    return y, mean, rstd


# ----------------------------------------------------------------- the kernel, fp64 reference


@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_norm_row_lengths(n, dtype):
    rows = 301 if n <= 8192 else 37
    _check(*_inputs((rows, n), dtype, torch.float32, torch.float32))


@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_row_lengths(n, dtype):
    rows = 301 if n <= 8192 else 37
    _check(*_inputs((rows, n), dtype, dtype), is_rms=True)


@pytest.mark.parametrize("b_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [None, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_mixes(dtype, w_dtype, b_dtype):
    """x in any float dtype with weight / bias of any (or none): y in x's dtype."""
    x, w, b = _inputs((129, 2048), dtype, w_dtype, b_dtype)
    y, _, _ = _check(x, w, b)
    assert y.dtype == dtype
    if b is None:
        _check(x, w, None, is_rms=True)


@pytest.mark.parametrize("n", [64, 1000, 16384, 65536])
def test_many_rows(n):
    """Each CTA of the persistent grid walks many row blocks: the ring and the exchange
    buffers turn over many times."""
    rows = {64: 100003, 1000: 20011, 16384: 2053, 65536: 517}[n]
    _check(*_inputs((rows, n), torch.bfloat16, torch.float32, torch.float32))
    _check(*_inputs((rows, n), torch.bfloat16, torch.bfloat16), is_rms=True)


@pytest.mark.parametrize("rows", [1, 2, 3, 127, 129, 1031])
def test_row_counts_not_multiples(rows):
    _check(*_inputs((rows, 96), torch.float16, torch.float16, torch.float16))  # 16 rows a CTA
    _check(*_inputs((rows, 7), torch.float32, torch.float32), is_rms=True)  # 128 rows a CTA


def test_eps_and_degenerate_rows():
    x, w, b = _inputs((64, 1024), torch.float32, torch.float32, torch.float32)
    for eps in (1e-6, 1e-2, torch.finfo(torch.bfloat16).eps):
        _check(x, w, b, eps=eps)
        _check(x, w, None, eps=eps, is_rms=True)
    const = torch.full((8, 1000), 3.0, device="cuda")  # variance 0: y = beta, rstd = rsqrt(eps)
    y, mean, rstd = _check(const, w[:1000], b[:1000])
    assert torch.equal(mean, torch.full_like(mean, 3.0))
    zeros = torch.zeros(4, 4096, device="cuda", dtype=torch.bfloat16)
    y, _, _ = _check(zeros, is_rms=True)
    assert (y == 0).all()


def test_offset_rows_keep_their_precision():
    """Two passes over the row in registers: a mean 8 standard deviations away does not cancel
    the variance away (E[x^2] - mean^2 would); y within a few times torch's own error."""
    x, w, b = _inputs((256, 4096), torch.float32, torch.float32, torch.float32, offset=16.0)
    ref, _, rstd, _ = _reference(x, w, b, 1e-5, False)
    y, _, ours_rstd = _run(x, w, b, 1e-5, False)
    assert rel_err(ours_rstd, rstd) < 1e-5
    theirs = rel_err(torch.nn.functional.layer_norm(x, (4096,), w, b, 1e-5), ref)
    assert rel_err(y, ref) < max(4 * theirs, 1e-5)


def test_strided_transposed_expanded_and_misaligned_inputs():
    base, w, b = _inputs((64, 1030), torch.bfloat16, torch.float32, torch.float32)
    _check(base[:, 3:1027], w[:1024], b[:1024])  # row stride 1030, odd start: 1-wide vectors, no copy
    _check(base[:, 2:1026], w[1:1025], b[2:1026])  # misaligned weight and bias narrow the vector too
    _check(base[::2, :1024], w[:1024], is_rms=True)  # every other row
    xt = _inputs((512, 48), torch.float16)[0].t()  # columns strided: a contiguous copy
    _check(xt, None, None)
    row = _inputs((1, 4096), torch.bfloat16)[0]
    _check(row.expand(33, 4096), w.new_ones(4096), is_rms=True)  # every row the same memory
    x = _inputs((2, 3, 5, 256), torch.bfloat16)[0]
    y, mean, rstd = _check(x.permute(1, 0, 2, 3), None, None)  # leading dims in any order
    assert y.shape == (3, 2, 5, 256) and y.is_contiguous() and mean.shape == rstd.shape == (3, 2, 5)


def test_cluster_exchanges_agree():
    """The st.async + mbarrier and the barrier.cluster exchanges add the same values in the
    same order: the same bits, run after run, many rows per CTA."""
    from cute_kernels.layer_norm import config as ln_config

    rows, n = 1031, 65536
    x, w, b = _inputs((rows, n), torch.bfloat16, torch.float32, torch.float32)
    dev = x.device.index
    arch = cc.device_arch(dev)
    bf16, f32 = cc.cute_dtype(torch.bfloat16), cc.cute_dtype(torch.float32)
    outs = []
    for mode in ("barrier", "mbarrier", "mbarrier"):
        for is_rms in (False, True):
            t = ln_config.ln_fwd_tiles(n, 16, 32 if is_rms else 64, 8, arch, cluster_exchange=mode)
            ctas = ln_config.ctas_per_col(rows, t, cc.num_sms(dev))
            assert t.ctas_per_row == 8 and rows // ctas >= 4
            fn = NF.compiled(bf16, f32, None if is_rms else f32, t, is_rms, arch)
            y, mean, rstd = (
                poison(torch.empty_like(x)),
                poison(torch.empty(rows, device="cuda")),
                poison(torch.empty(rows, device="cuda")),
            )
            plain = (None,) * 6 + (0, 1.0)  # no dropout + add
            fn(x, w, None if is_rms else b, y, None if is_rms else mean, rstd, 1e-5, ctas, *plain)
            assert rel_err(y, _reference(x, w, None if is_rms else b, 1e-5, is_rms)[0]) < TOL[torch.bfloat16]
            outs.append((mode, is_rms, y, rstd if is_rms else torch.cat([mean, rstd])))
    for mode, is_rms, y, stats in outs[2:]:
        _, _, y0, s0 = outs[int(is_rms)]
        assert torch.equal(y, y0) and torch.equal(stats, s0), (mode, is_rms)


def test_deterministic():
    x, w, b = _inputs((4099, 4096), torch.bfloat16, torch.float32, torch.float32)
    first = _run(x, w, b, 1e-5, False)
    for _ in range(2):
        assert all(torch.equal(a, c) for a, c in zip(first, _run(x, w, b, 1e-5, False)))


def test_empty_rows():
    y, mean, rstd = NF.forward(torch.empty(0, 3, 64, device="cuda"), None, None, 1e-5, False)
    assert y.shape == (0, 3, 64) and mean.shape == rstd.shape == (0, 3)
    assert ops.layer_norm(torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)).shape == (0, 64)


# ------------------------------------------------------------------------ the autograd ops


def test_ops_run_our_forward_and_its_statistics():
    """The custom op's outputs are the kernel's bit for bit (it did not fall back), and its saved
    statistics are torch's within fp32 rounding."""
    x, w, b = _inputs((300, 3000), torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert N.forward_unsupported(x, w, b) is None
    got = N._norm_forward(x, w, b, 1e-5, False)
    want = NF.forward(x, w, b, 1e-5, False)
    assert all(torch.equal(g, h) for g, h in zip(got, want))
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [3000], w, b, 1e-5)
    torch.testing.assert_close(got[1], mean.view(300), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], rstd.view(300), rtol=1e-5, atol=0)
    y, _, rstd = N._norm_forward(x, w, None, 1e-6, True)
    _, trstd = torch.ops.aten._fused_rms_norm(x, [3000], w, 1e-6)
    torch.testing.assert_close(rstd, trstd.view(300), rtol=1e-5, atol=0)


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 1000, 4096, 16384])
def test_forward_backward_sum_against_torch(n, dtype, is_rms):
    """``.sum()`` through our forward and backward against torch's autograd (parameters in x's
    dtype, as torch's kernels want them)."""
    x, w, b = _inputs((3, 67, n), dtype, dtype, dtype)
    grads = []
    for ours in (True, False):
        leaves = [t.clone().requires_grad_() for t in ((x, w) if is_rms else (x, w, b))]
        if is_rms:
            y = (ops.rms_norm if ours else torch.nn.functional.rms_norm)(leaves[0], (n,), leaves[1], 1e-5)
        else:
            y = (ops.layer_norm if ours else torch.nn.functional.layer_norm)(leaves[0], (n,), *leaves[1:], 1e-5)
        (y.float() * torch.linspace(-1, 1, n, device="cuda")).sum().backward()
        grads.append([y.detach()] + [t.grad for t in leaves])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, (got, want) in enumerate(zip(*grads)):
        assert got.dtype == want.dtype and rel_err(got, want) < tol, i


def test_mixed_parameter_dtypes_run_ours():
    """bf16 x with fp32 weight and bias (torch's CUDA kernels refuse the mix): our forward, y bf16."""
    x, w, b = _inputs((64, 512), torch.bfloat16, torch.float32, torch.float32)
    assert N.forward_unsupported(x, w, b) is None
    x.requires_grad_()
    y = ops.layer_norm(x, 512, w, b)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, _reference(x.detach(), w, b, 1e-5, False)[0]) < TOL[torch.bfloat16]


def test_torch_compile_fullgraph():
    m = ops.RMSNorm(768, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        m.weight.normal_()
    x = torch.randn(8, 128, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    fn = torch.compile(lambda x: m(x), fullgraph=True)
    y = fn(x)
    assert torch.equal(y, m(x))  # the same kernel inside the graph
    y.float().square().sum().backward()
    g, gw = x.grad.clone(), m.weight.grad.clone()
    x.grad = m.weight.grad = None
    torch.nn.functional.rms_norm(x, (768,), m.weight, 1e-6).float().square().sum().backward()
    assert rel_err(g, x.grad) < 2e-2 and rel_err(gw, m.weight.grad) < 2e-2


def test_side_stream():
    x, w, b = _inputs((1000, 4096), torch.bfloat16, torch.float32, torch.float32)
    ref = NF.forward(x, w, b, 1e-5, False)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = NF.forward(x, w, b, 1e-5, False)
    torch.cuda.current_stream().wait_stream(s)
    assert all(torch.equal(a, c) for a, c in zip(ref, out))


def test_unsupported_rows_run_torchs_forward(caplog):
    """A row longer than the kernel takes runs torch's forward, the reason logged."""
    import logging

    x = torch.randn(2, 262144, device="cuda")
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.norm"):
        y = ops.layer_norm(x)
    assert "torch's (N=262144 is longer than the largest supported row" in caplog.text
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (262144,)))


@pytest.mark.parametrize("is_rms", [False, True])
def test_two_normalized_dims_with_gradients(is_rms):
    """normalized_shape of two dims: x, weight and bias flattened into one row and back, their
    gradients in their own shapes (one dim reshapes nothing; this is the other path)."""
    x, w, b = (torch.randn(s, device="cuda", dtype=torch.float32) for s in ((5, 8, 64), (8, 64), (8, 64)))
    grads = []
    for ours in (True, False):
        leaves = [t.clone().requires_grad_() for t in ((x, w) if is_rms else (x, w, b))]
        if is_rms:
            y = (ops.rms_norm if ours else torch.nn.functional.rms_norm)(leaves[0], (8, 64), leaves[1], 1e-5)
        else:
            y = (ops.layer_norm if ours else torch.nn.functional.layer_norm)(leaves[0], (8, 64), *leaves[1:], 1e-5)
        (y * torch.linspace(-1, 1, 64, device="cuda")).sum().backward()
        grads.append([y.detach()] + [t.grad for t in leaves])
    for i, (got, want) in enumerate(zip(*grads)):
        assert got.shape == want.shape and rel_err(got, want) < 1e-4, i
