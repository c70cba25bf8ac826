"""CPU: the LayerNorm / RMSNorm backward compiles for its configurations (sm_90a, sm_80),
its tiles follow the documented rule, inputs are validated before any launch, the ops
trace into one graph, and the fp64 reference agrees with torch autograd."""

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
from cute_kernels.layer_norm import config as ln_config
from layouts import layer_norm as tiling
from ops import norm as N
from ops.reference import norm_backward_ref
from tests.helpers import trace_custom_ops

ROW_LENGTHS = (1, 7, 64, 1000, 1024, 4096, 8192, 12288, 16384, 65536)


# ------------------------------------------------------------------------ compile


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype_name", ["Float32", "BFloat16", "Float16"])
def test_compiles_configurations(arch, dtype_name):
    import cutlass

    dtype = getattr(cutlass, dtype_name)
    f32 = cutlass.Float32
    built = 0
    for n in ROW_LENGTHS:
        try:
            t = ln_config.ln_bwd_tiles(n, dtype.width, dtype.width, 32, tiling.widest_vec(n, dtype.width), arch)
        except NotImplementedError:
            assert arch == "sm_80" and n > 8192  # clusters are sm_90 only
            continue
        # LayerNorm with dgamma + dbeta, RMSNorm with dgamma
        assert callable(N._build(dtype, dtype, f32, t, False, True, True, arch))
        assert callable(N._build(dtype, dtype, f32, t, True, True, False, arch))
        built += 2
    assert built >= 14
    ft = ln_config.finalize_tiles(4096)
    assert callable(N._build_finalize(f32, dtype, ft, True, True, arch))
    assert callable(N._build_finalize(dtype, dtype, ln_config.finalize_tiles(7), True, False, arch))


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_compiles_mixed_dtypes_and_flags(arch):
    import cutlass

    bf16, f16, f32 = cutlass.BFloat16, cutlass.Float16, cutlass.Float32
    # fp32 x with bf16 dz, 4-wide vectors (the widest type decides)
    t = ln_config.ln_bwd_tiles(4096, 32, 16, 16, 4, arch)
    assert callable(N._build(f32, bf16, bf16, t, False, True, True, arch))
    # no weight, only dbeta; no weight and no bias
    t = ln_config.ln_bwd_tiles(768, 16, 16, 16, 8, arch, num_partials=1)
    assert callable(N._build(f16, f16, f16, t, False, False, True, arch))
    assert callable(N._build(f16, f16, f16, t, True, False, False, arch))
    assert callable(N._build_finalize(f16, f32, ln_config.finalize_tiles(768), False, True, arch))
    # 1-element vectors (N odd) take the synchronous copy instead of cp.async
    t = ln_config.ln_bwd_tiles(1001, 16, 16, 32, 1, arch)
    assert t.gmem_copy(16, load=True).op == "universal"
    assert callable(N._build(bf16, bf16, f32, t, False, True, True, arch))


@pytest.mark.compile
@pytest.mark.parametrize("exchange", tiling.CLUSTER_EXCHANGES)
@pytest.mark.parametrize("n", [16384, 65536])
def test_compiles_cluster_exchanges(n, exchange):
    """Both cluster row exchanges (st.async + mbarrier, barrier.cluster) build for sm_90a."""
    import cutlass

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    t = ln_config.ln_bwd_tiles(n, 16, 16, 32, 8, "sm_90a", cluster_exchange=exchange)
    assert t.ctas_per_row > 1 and t.cluster_exchange == exchange
    assert t.exchange_mbarriers == (exchange == "mbarrier")
    assert callable(N._build(bf16, bf16, f32, t, False, True, True, "sm_90a"))
    assert callable(N._build(bf16, bf16, f32, t, True, True, False, "sm_90a"))


def test_compile_only_covers_suite(monkeypatch):
    from benchmarks.suites import layer_norm_bwd

    seen = []
    monkeypatch.setattr(N, "compiled", lambda *k: seen.append(k))
    monkeypatch.setattr(N, "compiled_finalize", lambda *k: seen.append(k))
    assert layer_norm_bwd.compile_only("sm_90a") == len(seen) > 0
    assert {k[3].threads_per_row for k in seen if len(k) == 8} >= {1, 256, 512}


# ------------------------------------------------------------------------ tiles


@pytest.mark.parametrize("bits", [16, 32])
@pytest.mark.parametrize("n", ROW_LENGTHS + (3, 100, 129, 4095, 5000, 100000, 131072))
def test_tiles_cover_the_row(n, bits):
    vec = tiling.widest_vec(n, bits)
    t = ln_config.ln_bwd_tiles(n, bits, bits, 32, vec)
    assert t.max_n >= n > (t.ldgs - 1) * t.threads_per_row * t.vec * t.ctas_per_row  # every ldg has columns
    assert t.threads_per_row & (t.threads_per_row - 1) == 0
    assert t.num_threads <= 1024 and t.num_threads % 32 == 0
    assert t.warps_m * t.warps_n * 32 == t.num_threads
    assert t.ctas_per_row <= tiling.MAX_CLUSTER
    assert t.ldgs * t.vec <= ln_config.MAX_ELEMS_PER_THREAD
    assert 1 <= t.stages <= ln_config.MAX_STAGES
    assert t.smem_bytes(bits, bits, 2) * 1 <= 227 * 1024
    assert t.ctas_per_sm * t.num_threads <= tiling.MAX_THREADS_PER_SM


def test_tiles_beyond_the_largest_row_and_on_sm80():
    with pytest.raises(NotImplementedError, match="longer than the largest"):
        ln_config.ln_bwd_tiles(131072 * 2, 16, 16, 32, 8)
    with pytest.raises(NotImplementedError, match="clusters"):
        ln_config.ln_bwd_tiles(65536, 16, 16, 32, 8, arch="sm_80")
    assert ln_config.ln_bwd_tiles(8192, 16, 16, 32, 8, arch="sm_80").ctas_per_row == 1
    with pytest.raises(ValueError, match="not a legal access"):
        ln_config.ln_bwd_tiles(64, 16, 16, 32, 16)
    with pytest.raises(ValueError, match=">= 1"):
        ln_config.ln_bwd_tiles(0, 16, 16, 32, 1)


def test_cluster_exchange_default_and_override():
    t = ln_config.ln_bwd_tiles(16384, 16, 16, 32, 8)
    assert t.ctas_per_row == 2 and t.cluster_exchange == "mbarrier" and t.exchange_mbarriers
    old = ln_config.ln_bwd_tiles(16384, 16, 16, 32, 8, cluster_exchange="barrier", stages=3)
    assert old.cluster_exchange == "barrier" and old.stages == 3 and not old.exchange_mbarriers
    assert t.smem_bytes(16, 16, 2) == old.replace_stages(t.stages).smem_bytes(16, 16, 2) + 16  # two mbarriers
    assert not ln_config.ln_bwd_tiles(4096, 16, 16, 32, 8).exchange_mbarriers  # one CTA per row: sync_threads
    with pytest.raises(ValueError, match="cluster_exchange"):
        ln_config.ln_bwd_tiles(16384, 16, 16, 32, 8, cluster_exchange="dsmem")


def test_documented_table_matches_the_rule():
    """Every row of the module's table is what ln_bwd_tiles returns for bf16."""
    rows = re.findall(
        r"^\| (\d+)\s+\| (\d+)\s+\| (\d+)\s+\| (\d+)\s+\| (\d+)\s+\| (\d+)\s+\|$", ln_config.__doc__, re.M
    )
    assert len(rows) >= 6
    for n, vec, ldgs, tpr, cpr, rpc in rows:
        t = ln_config.ln_bwd_tiles(int(n), 16, 16, 32, int(vec))
        assert (t.ldgs, t.threads_per_row, t.ctas_per_row, t.rows_per_cta) == (
            int(ldgs),
            int(tpr),
            int(cpr),
            int(rpc),
        ), n


def test_grid_is_persistent_and_covers_rows():
    t = ln_config.ln_bwd_tiles(4096, 16, 16, 32, 8)
    assert ln_config.ctas_per_col(1, t, 132) == 1
    assert ln_config.ctas_per_col(10**6, t, 132) == 132 * t.ctas_per_sm
    t = ln_config.ln_bwd_tiles(64, 16, 16, 32, 8)
    assert ln_config.ctas_per_col(100, t, 132) == -(-100 // t.rows_per_cta)


def test_finalize_tiles():
    assert ln_config.finalize_tiles(4096).vec == 4
    assert ln_config.finalize_tiles(1002).vec == 2
    assert ln_config.finalize_tiles(7).vec == 1
    ft = ln_config.finalize_tiles(4096)
    assert ft.col_tiles(4096) * ft.tile_n >= 4096


# ------------------------------------------------------------------------ validation


def fake_cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="cuda", dtype=dtype)


def _ln(**kw):
    args = dict(
        grad_out=fake_cuda(4, 8),
        x=fake_cuda(4, 8),
        weight=fake_cuda(8, dtype=torch.float32),
        mean=fake_cuda(4, dtype=torch.float32),
        rstd=fake_cuda(4, dtype=torch.float32),
    )
    args.update(kw)
    return args


BAD = [
    ("cpu x", lambda: _ln(x=torch.zeros(4, 8), grad_out=torch.zeros(4, 8)), ValueError, "x must be a CUDA"),
    ("int x", lambda: _ln(x=fake_cuda(4, 8, dtype=torch.int32)), TypeError, "x must have dtype"),
    ("scalar x", lambda: _ln(x=fake_cuda(), grad_out=fake_cuda()), ValueError, "at least one dimension"),
    ("empty row", lambda: _ln(x=fake_cuda(4, 0), grad_out=fake_cuda(4, 0)), ValueError, "N >= 1"),
    ("grad shape", lambda: _ln(grad_out=fake_cuda(4, 9)), ValueError, "grad_out must have x's shape"),
    ("grad dtype", lambda: _ln(grad_out=fake_cuda(4, 8, dtype=torch.int64)), TypeError, "grad_out must have dtype"),
    ("weight shape", lambda: _ln(weight=fake_cuda(9)), ValueError, "weight must have shape"),
    ("weight dtype", lambda: _ln(weight=fake_cuda(8, dtype=torch.int32)), TypeError, "weight must have dtype"),
    ("bias shape", lambda: _ln(bias=fake_cuda(4, 2)), ValueError, "bias must have shape"),
    ("mean fp16", lambda: _ln(mean=fake_cuda(4, dtype=torch.float16)), TypeError, "mean must be float32"),
    ("rstd count", lambda: _ln(rstd=fake_cuda(5, dtype=torch.float32)), ValueError, "rstd must have one value per row"),
    ("mean missing", lambda: _ln(mean=None), TypeError, "mean must be a torch.Tensor"),
    ("weight cpu", lambda: _ln(weight=torch.zeros(8)), ValueError, "weight is on cpu"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_raise_before_launch(case):
    _, build, err, fragment = case
    with FakeTensorMode(allow_non_fake_inputs=True):
        kwargs = build()
        with pytest.raises(err, match=re.escape(fragment)):
            ops.layer_norm_backward(**kwargs)


def test_bad_rms_and_training_inputs():
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(ValueError, match="rstd must have one value per row"):
            ops.rms_norm_backward(fake_cuda(4, 8), fake_cuda(4, 8), None, fake_cuda(3, dtype=torch.float32))
        with pytest.raises(ValueError, match="does not end with normalized_shape"):
            ops.layer_norm(fake_cuda(4, 8), (4,))
        with pytest.raises(ValueError, match="weight must have shape"):
            ops.layer_norm(fake_cuda(4, 8), 8, fake_cuda(4))
        with pytest.raises(TypeError, match="eps must be a finite float"):
            ops.rms_norm(fake_cuda(4, 8), 8, None, float("nan"))
    with pytest.raises(ValueError, match="x must be a CUDA"):
        ops.layer_norm(torch.zeros(4, 8))


def test_non_flattenable_layout_is_a_clear_error():
    with FakeTensorMode():
        x = fake_cuda(8, 4).t()
        with pytest.raises(ValueError, match="contiguous"):
            ops.layer_norm_backward(x, x, None, fake_cuda(4, dtype=torch.float32), fake_cuda(4, dtype=torch.float32))


def test_fake_implementation_shapes():
    with FakeTensorMode():
        x = fake_cuda(2, 3, 40)
        stats = fake_cuda(2, 3, 1, dtype=torch.float32)
        dx, dw, db = ops.layer_norm_backward(
            x, x, fake_cuda(40, dtype=torch.float32), stats, stats, fake_cuda(40, dtype=torch.float16)
        )
        assert dx.shape == (2, 3, 40) and dx.dtype == torch.bfloat16
        assert dw.shape == (40,) and dw.dtype == torch.float32
        assert db.shape == (40,) and db.dtype == torch.float16
        dx, dw = ops.rms_norm_backward(x, x, None, stats)
        assert dw is None and dx.shape == x.shape


def test_training_ops_trace_in_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) sees the forward as our op, validation included."""
    monkeypatch.setattr(N, "check_cuda", lambda *a: None)  # CPU tensors stand in for CUDA ones
    x = torch.randn(4, 16)
    w = torch.randn(16)
    found = trace_custom_ops(lambda x, w: ops.layer_norm(x, 16, w, w, 1e-5) * 2, x, w)
    assert any("norm_forward" in f for f in found)
    found = trace_custom_ops(lambda x, w: ops.rms_norm(x, 16, w) + 1, x, w)
    assert any("norm_forward" in f for f in found)


def test_forward_matches_torch_on_cpu_tensors():
    """The forward op's math (run directly on CPU tensors) equals torch's, mixed dtypes included."""
    torch.manual_seed(0)
    x = torch.randn(5, 33, dtype=torch.float64)
    w, b = torch.randn(33, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    y, mean, rstd = N._norm_forward._init_fn(x, w, b, 1e-5, False)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (33,), w, b, 1e-5))
    xb = torch.randn(5, 33, dtype=torch.bfloat16)
    y, _, rstd = N._norm_forward._init_fn(xb, w.float(), None, 1e-6, True)
    ref = (xb.float() * torch.rsqrt(xb.float().square().mean(-1, keepdim=True) + 1e-6) * w.float()).to(torch.bfloat16)
    torch.testing.assert_close(y, ref)
    assert rstd.dtype == torch.float32 and rstd.shape == (5,)


def test_modules_are_drop_in():
    ln = ops.LayerNorm(16)
    ref = torch.nn.LayerNorm(16)
    assert ln.state_dict().keys() == ref.state_dict().keys()
    ln.load_state_dict(ref.state_dict())
    x = torch.randn(3, 16)
    torch.testing.assert_close(ln(x), ref(x))  # CPU tensors take torch's path
    rms = ops.RMSNorm([4, 4], eps=1e-6)
    assert rms.state_dict().keys() == torch.nn.RMSNorm([4, 4]).state_dict().keys()
    assert isinstance(rms, torch.nn.RMSNorm) and isinstance(ln, torch.nn.LayerNorm)


# ------------------------------------------------------------------------ reference


@pytest.mark.parametrize("is_rms", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_reference_matches_autograd(is_rms, affine):
    torch.manual_seed(0)
    x = torch.randn(6, 2, 37, dtype=torch.float64, requires_grad=True)
    w = torch.randn(37, dtype=torch.float64, requires_grad=True) if affine else None
    b = torch.randn(37, dtype=torch.float64, requires_grad=True) if affine and not is_rms else None
    dz = torch.randn(6, 2, 37, dtype=torch.float64)
    if is_rms:
        y = torch.nn.functional.rms_norm(x, (37,), w, 1e-5)
        mean = None
        rstd = torch.rsqrt(x.detach().square().mean(-1) + 1e-5)
    else:
        y = torch.nn.functional.layer_norm(x, (37,), w, b, 1e-5)
        var, mean = torch.var_mean(x.detach(), -1, correction=0)
        rstd = torch.rsqrt(var + 1e-5)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dz)
    dx, dw, db = norm_backward_ref(dz, x.detach(), None if w is None else w.detach(), mean, rstd, b is not None)
    torch.testing.assert_close(dx, grads[0])
    if affine:
        torch.testing.assert_close(dw, grads[1])
    if b is not None:
        torch.testing.assert_close(db, grads[2])
