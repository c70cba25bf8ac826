"""GPU: LayerNorm / RMSNorm backward against the fp64 reference, outputs poisoned first;
every row length of the issue, dtypes, with and without weight / bias, RMSNorm, odd
row counts, strided views, determinism, the autograd ops and modules against torch."""

import pytest
import torch

import ops
from ops import norm as N
from ops.reference import norm_backward_ref
from tests.helpers import poison, rel_err

pytestmark = pytest.mark.gpu

ROW_LENGTHS = (1, 7, 64, 1000, 1024, 4096, 8192, 12288, 16384, 65536)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _inputs(shape, dtype, w_dtype, has_w=True, has_b=True, is_rms=False, dz_dtype=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(shape, device="cuda", generator=g) * 2 + 0.5).to(dtype)
    dz = torch.randn(shape, device="cuda", generator=g).to(dz_dtype or dtype)
    w = torch.randn(n, device="cuda", generator=g).to(w_dtype) if has_w else None
    b = torch.randn(n, device="cuda", generator=g).to(w_dtype) if has_b else None
    x32 = x.float()
    if is_rms:
        mean, rstd = None, torch.rsqrt(x32.square().mean(-1) + 1e-5)
    else:
        var, mean = torch.var_mean(x32, -1, correction=0)
        rstd = torch.rsqrt(var + 1e-5)
    return x, dz, w, b, mean, rstd


def _run_poisoned(x, dz, w, b, mean, rstd, is_rms):
    """The kernels into outputs filled with NaN first, so unwritten elements show."""
    dx = poison(torch.empty_like(x))
    dw = poison(torch.empty_like(w)) if w is not None else None
    db = poison(torch.empty_like(b)) if b is not None else None
    N.launch(dz, x, w, mean, rstd, b, is_rms, dx, dw, db)
    return dx, dw, db


def _check(x, dz, w, b, mean, rstd, is_rms, tol=None):
    dx, dw, db = _run_poisoned(x, dz, w, b, mean, rstd, is_rms)
    rdx, rdw, rdb = norm_backward_ref(dz, x, w, mean, rstd, b is not None)
    tol = tol or TOL[x.dtype]
    assert torch.isfinite(dx).all()
    assert rel_err(dx, rdx) < tol
    if w is not None:
        assert torch.isfinite(dw).all() and rel_err(dw, rdw) < max(tol, TOL[w.dtype])
    if b is not None:
        assert torch.isfinite(db).all() and rel_err(db, rdb) < max(tol, TOL[b.dtype])


@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_layer_norm_row_lengths(n, dtype):
    rows = 37 if n > 8192 else 301
    _check(*_inputs((rows, n), dtype, torch.float32), is_rms=False)


@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_row_lengths(n, dtype):
    rows = 37 if n > 8192 else 301
    _check(*_inputs((rows, n), dtype, dtype, has_b=False, is_rms=True), is_rms=True)


@pytest.mark.parametrize("has_w,has_b", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("n", [64, 1000, 4096, 16384])
def test_optional_weight_and_bias(n, has_w, has_b):
    _check(*_inputs((129, n), torch.bfloat16, torch.bfloat16, has_w, has_b), is_rms=False)


@pytest.mark.parametrize("rows", [1, 3, 131, 1031, 20011])
def test_row_counts_not_multiples(rows):
    _check(*_inputs((rows, 1024), torch.bfloat16, torch.float32), is_rms=False)
    _check(*_inputs((rows, 96), torch.float16, torch.float16, has_b=False, is_rms=True), is_rms=True)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_weight_dtypes_and_mixed_grad_dtype(w_dtype):
    _check(*_inputs((77, 2048), torch.bfloat16, w_dtype), is_rms=False)
    _check(*_inputs((77, 2048), torch.float32, w_dtype, dz_dtype=torch.bfloat16), is_rms=False)


def test_strided_and_misaligned_views():
    x, dz, w, b, _, _ = _inputs((64, 1030), torch.bfloat16, torch.float32)
    x, dz = x[:, 3:1027], dz[:, 2:1026]  # row stride 1030, odd starts: narrow vectors
    var, mean = torch.var_mean(x.float(), -1, correction=0)
    rstd = torch.rsqrt(var + 1e-5)
    _check(x, dz, w[:1024], b[:1024], mean, rstd, is_rms=False)


def test_leading_dims_and_aten_statistics():
    x = torch.randn(2, 3, 5, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [256], w, b, 1e-5)
    assert mean.dtype == torch.float32 and mean.shape == (2, 3, 5, 1)
    dz = torch.randn_like(x)
    dx, dw, db = ops.layer_norm_backward(dz, x, w, mean, rstd, b)
    rdx, rdw, rdb = norm_backward_ref(dz, x, w, mean, rstd, True)
    assert dx.shape == x.shape and rel_err(dx, rdx) < 1e-2 and rel_err(dw, rdw) < 1e-2 and rel_err(db, rdb) < 1e-2


def test_empty_rows():
    x = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, device="cuda")
    stats = torch.empty(0, device="cuda")
    dx, dw, db = ops.layer_norm_backward(x, x, w, stats, stats, w)
    assert dx.shape == (0, 64) and (dw == 0).all() and (db == 0).all()


def test_deterministic():
    args = _inputs((4099, 4096), torch.bfloat16, torch.float32)
    first = _run_poisoned(*args, is_rms=False)
    for _ in range(2):
        again = _run_poisoned(*args, is_rms=False)
        assert all(torch.equal(a, c) for a, c in zip(first, again))


@pytest.mark.parametrize("n", [16384, 65536])
def test_cluster_exchanges_agree(n):
    """Many rows per CTA, so both exchange buffers and their mbarrier phases turn over
    many times: the st.async + mbarrier exchange gives the bits of the barrier.cluster one,
    run after run."""
    from cute_kernels.layer_norm import config as ln_config
    from ops import _compile as cc

    rows = 2053
    x, dz, w, b, mean, rstd = _inputs((rows, n), torch.bfloat16, torch.float32)
    dev = x.device.index
    arch = cc.device_arch(dev)
    bf16, f32 = cc.cute_dtype(torch.bfloat16), cc.cute_dtype(torch.float32)
    rdx, rdw, rdb = norm_backward_ref(dz, x, w, mean, rstd, True)
    outs = {}
    for mode in ("barrier", "mbarrier", "mbarrier"):
        t = ln_config.ln_bwd_tiles(n, 16, 16, 32, 8, arch, cluster_exchange=mode)
        ctas = ln_config.ctas_per_col(rows, t, cc.num_sms(dev))
        assert t.ctas_per_row > 1 and rows // ctas >= 4
        fn = N.compiled(bf16, bf16, f32, t, False, True, True, arch)
        dx = poison(torch.empty_like(x))
        pg, pb = (poison(torch.empty(ctas, n, device="cuda")) for _ in range(2))
        fn(x, dz, w, mean, rstd, dx, pg, pb, ctas, None, None, None, None, 1.0)  # no dropout + add
        out = (dx, pg, pb)
        assert rel_err(dx, rdx) < TOL[torch.bfloat16]
        assert rel_err(pg.sum(0), rdw) < TOL[torch.bfloat16] and rel_err(pb.sum(0), rdb) < TOL[torch.bfloat16]
        if outs:
            assert all(torch.equal(o, r) for o, r in zip(out, outs["barrier"])), mode
        outs.setdefault(mode, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_module_matches_torch(dtype, bias):
    torch.manual_seed(0)
    ref = torch.nn.LayerNorm((4, 96), bias=bias, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref.weight.normal_()
        if bias:
            ref.bias.normal_()
    ours = ops.LayerNorm((4, 96), bias=bias, device="cuda", dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 50, 4, 96, device="cuda", dtype=dtype)
    dz = torch.randn_like(x)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), ref(x2)
    torch.testing.assert_close(y1, y2)
    y1.backward(dz)
    y2.backward(dz)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(x1.grad, x2.grad) < tol
    assert rel_err(ours.weight.grad, ref.weight.grad) < tol
    if bias:
        assert rel_err(ours.bias.grad, ref.bias.grad) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_module_matches_torch(dtype):
    torch.manual_seed(0)
    ref = torch.nn.RMSNorm(1000, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref.weight.normal_()
    ours = ops.RMSNorm(1000, device="cuda", dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(7, 33, 1000, device="cuda", dtype=dtype)
    dz = torch.randn_like(x)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ours(x1), ref(x2)
    torch.testing.assert_close(y1, y2, atol=2e-2, rtol=2e-2)
    y1.backward(dz)
    y2.backward(dz)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(x1.grad, x2.grad) < tol and rel_err(ours.weight.grad, ref.weight.grad) < tol


def test_mixed_weight_dtype_training():
    """bf16 activations with an fp32 weight (torch's layer_norm refuses the mix; ours computes it in fp32)."""
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(512, device="cuda", requires_grad=True)
    b = torch.randn(512, device="cuda", requires_grad=True)
    y = ops.layer_norm(x, 512, w, b)
    dz = torch.randn_like(y)
    y.backward(dz)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    y64 = torch.nn.functional.layer_norm(x64, (512,), w64, b64, 1e-5)
    y64.backward(dz.double())
    assert rel_err(y, y64) < 1e-2
    assert rel_err(x.grad, x64.grad) < 1e-2 and rel_err(w.grad, w64.grad) < 1e-4 and rel_err(b.grad, b64.grad) < 1e-4
    assert w.grad.dtype == torch.float32


def test_torch_compile_fullgraph():
    m = ops.LayerNorm(768, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 128, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fn = torch.compile(lambda x: m(x).float().square().sum(), fullgraph=True)
    fn(x).backward()
    g_ours, gw_ours = x.grad.clone(), m.weight.grad.clone()
    x.grad = None
    m.weight.grad = None
    torch.nn.functional.layer_norm(x, (768,), m.weight, m.bias).float().square().sum().backward()
    assert rel_err(g_ours, x.grad) < 2e-2 and rel_err(gw_ours, m.weight.grad) < 2e-2


def test_side_stream():
    args = _inputs((1000, 4096), torch.bfloat16, torch.float32)
    x, dz, w, b, mean, rstd = args
    ref = ops.layer_norm_backward(dz, x, w, mean, rstd, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = ops.layer_norm_backward(dz, x, w, mean, rstd, b)
    torch.cuda.current_stream().wait_stream(s)
    assert all(torch.equal(a, c) for a, c in zip(ref, out))
