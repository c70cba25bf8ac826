"""CPU: the fused dropout + add + LayerNorm / RMSNorm compiles its new configurations (one forward
and one backward per norm kind), its host path hands the kernels the right arguments (a recorder
stands in for them), its graph face (fakes, autograd) gives the real outputs' shapes and dtypes,
and its CPU path is torch's math with the mask it returns."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
from cute_kernels.layer_norm import config as ln_config
from cute_kernels.layer_norm.dropout_add import DropoutAdd
from ops import _compile as cc
from ops import dropout_add_norm as DAN
from ops import _validate as V
from ops import dropout_add_norm_kernels as K
from ops import norm as N
from ops import norm_forward as NF
from ops._memo import Memo
from ops.dropout_bias_forward import unpack_mask


@pytest.mark.compile
def test_compiles_forward_configurations():
    """LayerNorm: bf16 x and residual, x_bias, dropout with the seed on the device (graph
    capture; the host seed's build is the benchmark suite's), fp32 weight and bias. RMSNorm: fp32
    x, no residual, fp32 r, no dropout, odd N (1-wide vectors)."""
    import cutlass

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    t = ln_config.ln_fwd_tiles(4096, 16, 64 + 16, 8, "sm_90a", 16)
    assert callable(NF._build(bf16, f32, f32, t, False, "sm_90a", DropoutAdd(bf16, bf16, bf16, bf16, True), True))
    t = ln_config.ln_fwd_tiles(1001, 32, 32, 1, "sm_90a")
    assert callable(NF._build(f32, f32, None, t, True, "sm_90a", DropoutAdd(f32, None, f32, None, False), False))


@pytest.mark.compile
def test_compiles_backward_configurations():
    """LayerNorm: the incoming gradient of r, the mask, dresidual and dx_bias (three column
    partials folded across 2 rows a CTA, then finalized). RMSNorm: a 2-CTA cluster row, fp32 r and
    residual under bf16 x, no dropout."""
    import cutlass

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    t = ln_config.ln_bwd_tiles(1000, 16, 16, 32, 8, "sm_90a", num_partials=3, extra_bits=16)
    assert t.rows_per_cta > 1
    fuse = DropoutAdd(bf16, bf16, bf16, bf16, True, bf16)
    assert callable(N._build(bf16, bf16, f32, t, False, True, True, "sm_90a", fuse))
    assert callable(N._build_finalize(f32, f32, ln_config.finalize_tiles(1000), True, True, "sm_90a", bf16))
    t = ln_config.ln_bwd_tiles(16384, 32, 16, 32, 4, "sm_90a", num_partials=1)
    assert t.ctas_per_row > 1
    fuse = DropoutAdd(bf16, f32, f32, None, False)
    assert callable(N._build(f32, bf16, f32, t, True, True, False, "sm_90a", fuse))


@pytest.fixture
def recorder(monkeypatch):
    """The host path on CPU tensors: the compile caches hand out recorders."""
    calls = []
    monkeypatch.setattr(K, "_fwd_plans", Memo())
    monkeypatch.setattr(K, "_bwd_plans", Memo())
    monkeypatch.setattr(K, "unsupported", lambda *a, **k: None)
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(cc, "num_sms", lambda index: 132)
    monkeypatch.setattr(K, "philox_seed_offset", lambda dev, words: (7, 40))
    for module, name in ((NF, "compiled"), (N, "compiled"), (N, "compiled_finalize")):
        monkeypatch.setattr(module, name, lambda *key, _n=name: lambda *args: calls.append((_n, key, args)))
    return calls


def test_forward_arguments(recorder):
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    res = torch.randn(2, 3, 64, dtype=torch.float32)
    w, xb = torch.randn(64), torch.randn(64, dtype=torch.bfloat16)
    y, r, mask, mean, rstd = K.forward(x, res, w, None, xb, 0.25, 1e-5, False, False)
    assert y.dtype == torch.bfloat16 and r.dtype == torch.float32 and y.shape == r.shape == x.shape
    assert mask.shape == (2, 3, 8) and mask.dtype == torch.uint8 and mean.shape == rstd.shape == (2, 3)
    ((_, key, args),) = recorder
    fuse = key[6]
    assert key[-1] is False and key[3].vec == 4  # host seed; fp32 residual: 128-bit vectors of 4
    assert fuse == DropoutAdd(*(cc.cute_dtype(d) for d in (x.dtype, res.dtype, res.dtype, xb.dtype)), True)
    assert args[8].data_ptr() == res.data_ptr() and args[9] is xb and args[10].shape == (6, 64)
    assert args[11].shape == (6, 8) and args[12:14] == (7, 40)
    assert args[14] == 16384 and args[15] == pytest.approx(1 / 0.75)  # round(0.25 * 2^16), 1 / (1 - p)
    _, r, mask, _, _ = K.forward(x, None, None, None, None, 0.0, 1e-5, True, True)
    assert r.dtype == torch.float32 and mask.numel() == 0  # residual_in_fp32; p = 0 draws nothing
    key, args = recorder[-1][1:]
    assert key[6] == DropoutAdd(cc.cute_dtype(x.dtype), None, cc.cute_dtype(torch.float32), None, False)
    assert args[11] is None and args[12] is None


def test_backward_arguments(recorder):
    r = torch.randn(6, 40, dtype=torch.bfloat16)
    dy, dr = torch.randn_like(r), torch.randn(6, 40, dtype=torch.float16)
    w, b, mask = torch.randn(40), torch.randn(40), torch.zeros(6, 5, dtype=torch.uint8)
    mean, rstd = torch.randn(6), torch.rand(6)
    dx, dres, dw, db, dxb = K.backward(
        dy, dr, r, w, b, mean, rstd, mask, 0.5, False, torch.float32, torch.bfloat16, torch.float16
    )
    assert dx.dtype == torch.float32 and dres.dtype == torch.bfloat16 and dxb.dtype == torch.float16
    assert dw.shape == db.shape == dxb.shape == (40,)
    (_, key, args), (_, fkey, fargs) = recorder
    assert key[-1] == DropoutAdd(*(cc.cute_dtype(d) for d in (torch.float32, torch.bfloat16, torch.bfloat16)),
                                 cc.cute_dtype(torch.float16), True, cc.cute_dtype(torch.float16))  # fmt: skip
    assert args[9].dtype == torch.float16 and args[10].shape == (6, 5)
    assert args[11].dtype == torch.bfloat16 and args[12].shape[1] == 40 and args[13] == 2.0
    assert fkey[-1] == cc.cute_dtype(torch.float16) and fargs[4] is args[12] and fargs[5] is dxb
    recorder.clear()
    _, dres, dw, db, dxb = K.backward(
        dy, None, r, None, None, None, rstd, torch.empty(0, dtype=torch.uint8), 0.0, True, r.dtype, None, None
    )
    assert dres.numel() == dw.numel() == db.numel() == dxb.numel() == 0
    ((_, key, args),) = recorder  # nothing to fold: no finalize
    assert args[9] is None and args[10] is None and args[11] is None and args[12] is None


def test_eager_outputs_rows_as_allocated_and_absent_ones_none(recorder):
    """Rows already [rows, N] hand the kernels y, r, the mask and the statistics as allocated (no
    views); the eager path (``stub_mean`` / ``stub`` False) gets None for RMSNorm's mean and for
    absent gradients, where the custom op needs empty tensors. Other ranks and p = 0 still view."""
    x, res, w = torch.randn(6, 64, dtype=torch.bfloat16), torch.randn(6, 64), torch.randn(64)
    y, r, mask, mean, rstd = K.forward(x, res, w, None, None, 0.1, 1e-5, True, False, False)
    ((_, _, args),) = recorder
    assert args[3] is y and args[10] is r and args[11] is mask and args[4] is None and args[5] is rstd
    assert mean is None and y.is_contiguous() and r.dtype == torch.float32
    y3, _, mask3, mean3, _ = K.forward(x.view(2, 3, 64), None, w, w, None, 0.0, 1e-5, False, False, False)
    args = recorder[-1][2]
    assert args[3].shape == (6, 64) and args[4].shape == (6,) and args[11] is None and mask3.numel() == 0
    assert y3.shape == (2, 3, 64) and mean3.shape == (2, 3)
    recorder.clear()
    dy, rstd = torch.randn(2, 3, 64, dtype=torch.bfloat16), torch.rand(2, 3)
    mask = torch.zeros(2, 3, 8, dtype=torch.uint8)
    dx, dres, dw, db, dxb = K.backward(
        dy, None, dy.float(), w, None, None, rstd, mask, 0.5, True, torch.bfloat16, None, None, False
    )
    assert dres is None and db is None and dxb is None and dw.shape == (64,) and dx.shape == (2, 3, 64)
    args = recorder[0][2]
    assert args[5].shape == (6, 64) and args[10].shape == (6, 8) and args[11] is None and args[12] is None


def _fake_cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="cuda", dtype=dtype)


class _Ctx:
    """The autograd context the op's setup and backward see (the engine itself wants a device)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        self.non_differentiable = tensors

    def set_materialize_grads(self, value):
        self.materialize_grads = value


@pytest.mark.parametrize("is_rms", [False, True])
def test_graph_face_shapes_and_gradients(is_rms):
    """Under a fake mode the op is the registered custom op: its fakes, then its backward (the
    backward op's fake) from the context its setup saves."""
    fn = ops.dropout_add_rms_norm if is_rms else ops.dropout_add_layer_norm
    with FakeTensorMode():
        x, res = _fake_cuda(3, 5, 24), _fake_cuda(3, 5, 24, dtype=torch.float32)
        w = _fake_cuda(24, dtype=torch.float32)
        b = None if is_rms else _fake_cuda(24)
        xb = _fake_cuda(24, dtype=torch.float16)
        y, r, mask = fn(x, res, w, b, 0.1, 1e-5, x_bias=xb, prenorm=True, return_dropout_mask=True)
        assert y.dtype == torch.bfloat16 and r.dtype == torch.float32 and mask.shape == (3, 5, 3)
        inputs = (x, res, w, b, xb, 0.1, 1e-5, is_rms, False)
        ctx = _Ctx()
        DAN._setup(ctx, inputs, DAN._forward_op(*inputs))
        grads = DAN._backward(ctx, torch.empty_like(y), torch.empty_like(r), None, None, None)
        dx, dres, dw, db, dxb = grads[:5]
        assert dx.dtype == x.dtype and dres.dtype == torch.float32 and dxb.dtype == torch.float16
        assert dw.shape == (24,) and (db is None) == is_rms and grads[5:] == (None,) * 4
        y = fn(x, None, w, b, 0.0, 1e-5, residual_in_fp32=True, prenorm=True)
        assert y[1].dtype == torch.float32
        inputs = (x, None, None, None, None, 0.0, 1e-5, is_rms, False)
        DAN._setup(ctx, inputs, DAN._forward_op(*inputs))
        dx, dres, dw, db, dxb = DAN._backward(ctx, torch.empty_like(y[0]), None, None, None, None)[:5]
        assert dx.shape == x.shape and dres is None and dw is None and db is None and dxb is None
        assert ctx.materialize_grads is False and len(ctx.non_differentiable) == 3  # mask, mean, rstd
        # outputs that reached no loss come as None: a loss on r alone still has its gradients
        dx, dres = DAN._backward(ctx, None, torch.empty_like(y[1]), None, None, None)[:2]
        assert dx.shape == x.shape and dres is None
        assert DAN._backward(ctx, None, None, None, None, None) == (None,) * 9


def _reference(x, res, w, b, xb, keep, p, eps, is_rms):
    """fp64 y and r from the keep mask (r rounded to its dtype, as the kernels store it)."""
    h = x.double() + (0 if xb is None else xb.double())
    h = h * keep / (1 - p)
    r64 = h + (0 if res is None else res.double())
    r = r64.to(res.dtype if res is not None else x.dtype).double()
    w64 = None if w is None else w.double()
    if is_rms:
        y = torch.nn.functional.rms_norm(r, (x.shape[-1],), w64, eps)
    else:
        y = torch.nn.functional.layer_norm(r, (x.shape[-1],), w64, None if b is None else b.double(), eps)
    return y, r


@pytest.mark.parametrize("is_rms", [False, True])
def test_cpu_path_is_torch_math_with_its_mask(is_rms):
    torch.manual_seed(0)
    x, res = torch.randn(4, 37), torch.randn(4, 37)
    w, xb = torch.randn(37), torch.randn(37)
    b = None if is_rms else torch.randn(37)
    fn = ops.dropout_add_rms_norm if is_rms else ops.dropout_add_layer_norm
    y, r, bits = fn(x, res, w, b, 0.3, 1e-5, x_bias=xb, prenorm=True, return_dropout_mask=True)
    keep = unpack_mask(bits, 37)
    assert 0 < keep.sum() < keep.numel()
    y_ref, r_ref = _reference(x, res, w, b, xb, keep, 0.3, 1e-5, is_rms)
    torch.testing.assert_close(r.double(), r_ref, atol=1e-5, rtol=1e-5)  # fp32 math
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)


def test_modules_drop_only_in_training():
    m = ops.DropoutAddLayerNorm(16, p=0.5, prenorm=True)
    x, res = torch.randn(8, 16), torch.randn(8, 16)
    m.eval()
    y, r = m(x, res)
    torch.testing.assert_close(r, x + res)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x + res, (16,)))
    m.train()
    _, r = m(x, res)
    assert not torch.allclose(r, x + res)
    rms = ops.DropoutAddRMSNorm(16).eval()
    torch.testing.assert_close(rms(x), torch.nn.functional.rms_norm(x, (16,), eps=1e-6))


def test_p_zero_mask_is_all_kept():
    _, bits = ops.dropout_add_layer_norm(torch.randn(3, 11), None, None, None, 0.0, return_dropout_mask=True)
    assert bits.shape == (3, 2) and unpack_mask(bits, 11).all() and (bits[:, 1] == 0b111).all()


def test_checks_remembered_by_metadata_still_catch_new_metadata_and_values(monkeypatch):
    """The tensors are checked in full once per metadata signature (CPU tensors take torch's
    math, so a passing call is remembered here): new metadata is checked again, p, eps, rowscale
    and RMSNorm's bias on every call."""
    monkeypatch.setattr(V, "_validated", Memo())
    x, res, w, b = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16), torch.randn(16)
    for _ in range(2):
        ops.dropout_add_layer_norm(x, res, w, b, 0.1, 1e-5)
    assert len(V._validated) == 1
    bad = [
        (lambda: ops.dropout_add_layer_norm(x, res, w, b, 1.0), ValueError, "p"),
        (lambda: ops.dropout_add_layer_norm(x, res, w, b, float("nan")), ValueError, "p"),
        (lambda: ops.dropout_add_layer_norm(x, res, w, b, True), TypeError, "p"),
        (lambda: ops.dropout_add_layer_norm(x, res, w, b, 0.1, float("inf")), TypeError, "eps"),
        (lambda: ops.dropout_add_layer_norm(x, res, w, b, 0.1, rowscale=x[:, 0]), NotImplementedError, "rowscale"),
        (lambda: ops.dropout_add_rms_norm(x, res, w, b, 0.1), NotImplementedError, "bias"),
        (lambda: ops.dropout_add_layer_norm(x, res[:, :8], w, b, 0.1), ValueError, "residual"),
        (lambda: ops.dropout_add_layer_norm(x, res, w.int(), b, 0.1), TypeError, "weight"),
        (lambda: ops.dropout_add_layer_norm(x, res, w, b.to("meta"), 0.1), ValueError, "bias"),
        (lambda: ops.dropout_add_layer_norm(x.tolist(), res, w, b, 0.1), TypeError, "x"),
    ]
    for call, error, fragment in bad:
        with pytest.raises(error, match=fragment):
            call()
    ops.dropout_add_layer_norm(x, res, w, b, 0, 1)  # int p and eps pass the full value checks
