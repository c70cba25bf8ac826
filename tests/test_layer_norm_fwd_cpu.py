"""CPU: the LayerNorm / RMSNorm forward compiles for its configurations (sm_90a, sm_80), its
tiles follow the backward's row rule, the host picks the vector, copies only what it cannot
view as rows, and runs torch's forward (with the reason) wherever the kernel does not apply."""

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cute_kernels.layer_norm import config as ln_config
from layouts import layer_norm as tiling
from ops import _compile as cc
from ops import norm as N
from ops import norm_forward as NF
from ops._memo import Memo
from ops._validate import check_tensor

ROW_LENGTHS = (1, 7, 64, 1000, 4096, 8192, 16384, 131072)


# ------------------------------------------------------------------------ compile


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype_name", ["Float32", "BFloat16"])
def test_compiles_configurations(arch, dtype_name):
    """LayerNorm with fp32 weight and bias, RMSNorm with a weight of x's dtype, every row length."""
    import cutlass

    dtype = getattr(cutlass, dtype_name)
    f32 = cutlass.Float32
    built = 0
    for n in ROW_LENGTHS:
        vec = tiling.widest_vec(n, dtype.width)
        try:
            t = ln_config.ln_fwd_tiles(n, dtype.width, 64, vec, arch)
        except NotImplementedError:
            assert arch == "sm_80" and n > 8192  # clusters are sm_90 only
            continue
        assert callable(NF._build(dtype, f32, f32, t, False, arch))
        t = ln_config.ln_fwd_tiles(n, dtype.width, dtype.width, vec, arch)
        assert callable(NF._build(dtype, dtype, None, t, True, arch))
        built += 2
    assert built >= 12


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_compiles_optional_parameters_and_mixed_dtypes(arch):
    import cutlass

    bf16, f16, f32 = cutlass.BFloat16, cutlass.Float16, cutlass.Float32
    t = ln_config.ln_fwd_tiles(768, 16, 0, 8, arch)
    assert callable(NF._build(f16, None, None, t, False, arch))  # neither weight nor bias
    assert callable(NF._build(f16, None, None, t, True, arch))
    t = ln_config.ln_fwd_tiles(768, 16, 16, 8, arch)
    assert callable(NF._build(f16, None, bf16, t, False, arch))  # bias alone, another dtype
    assert callable(NF._build(f16, bf16, None, t, False, arch))  # weight alone
    t = ln_config.ln_fwd_tiles(2048, 32, 32, 4, arch)
    assert callable(NF._build(f32, bf16, f16, t, False, arch))  # fp32 x, half-width parameters
    # 1-element vectors (N odd) take the synchronous copy instead of cp.async
    t = ln_config.ln_fwd_tiles(1001, 16, 64, 1, arch)
    assert t.gmem_copy(16, load=True).op == "universal"
    assert callable(NF._build(bf16, f32, f32, t, False, arch))


@pytest.mark.compile
@pytest.mark.parametrize("exchange", tiling.CLUSTER_EXCHANGES)
@pytest.mark.parametrize("n", [16384, 65536])
def test_compiles_cluster_exchanges(n, exchange):
    """Both cluster row exchanges (st.async + mbarrier, barrier.cluster) build for sm_90a."""
    import cutlass

    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    t = ln_config.ln_fwd_tiles(n, 16, 64, 8, "sm_90a", cluster_exchange=exchange)
    assert t.ctas_per_row > 1 and t.exchange_mbarriers == (exchange == "mbarrier")
    assert callable(NF._build(bf16, f32, f32, t, False, "sm_90a"))
    assert callable(NF._build(bf16, f32, None, t, True, "sm_90a"))


def test_rms_norm_takes_no_bias():
    import cutlass

    from cute_kernels.layer_norm import LnFwd

    t = ln_config.ln_fwd_tiles(64, 16, 32, 8)
    with pytest.raises(ValueError, match="no bias"):
        LnFwd(cutlass.BFloat16, None, cutlass.BFloat16, t, True)


def test_compile_only_covers_suite(monkeypatch):
    from benchmarks.suites import layer_norm_fwd

    seen = []
    monkeypatch.setattr(NF, "compiled", lambda *k: seen.append(k))
    assert layer_norm_fwd.compile_only("sm_90a") == len(seen) > 0
    assert {k[3].threads_per_row for k in seen} >= {1, 256, 512}
    assert {k[3].ctas_per_row for k in seen} >= {1, 2, 8}


# ------------------------------------------------------------------------ tiles


@pytest.mark.parametrize("param_bits", [0, 32, 64])
@pytest.mark.parametrize("bits", [16, 32])
@pytest.mark.parametrize("n", ROW_LENGTHS + (3, 100, 129, 4095, 5000, 12288, 65536, 100000))
def test_tiles_cover_the_row_and_fit(n, bits, param_bits):
    vec = tiling.widest_vec(n, bits)
    t = ln_config.ln_fwd_tiles(n, bits, param_bits, vec)
    assert t.max_n >= n > (t.ldgs - 1) * t.threads_per_row * t.vec * t.ctas_per_row  # every ldg has columns
    assert t.num_threads <= 1024 and t.num_threads % 32 == 0
    assert t.ctas_per_row <= tiling.MAX_CLUSTER
    assert 2 <= t.stages <= ln_config.MAX_STAGES
    assert t.ctas_per_sm * t.smem_bytes(bits) <= ln_config.SMEM_PER_SM
    assert t.ctas_per_sm * t.num_threads <= tiling.MAX_THREADS_PER_SM
    # the row is split as the backward splits it (one table documents both); rows of more
    # than a warp in one CTA stack up to FWD_MIN_THREADS_PER_CTA threads, the others as the backward's
    b = ln_config.ln_bwd_tiles(n, bits, bits, 32, vec)
    assert (t.ldgs, t.threads_per_row, t.ctas_per_row) == (b.ldgs, b.threads_per_row, b.ctas_per_row)
    if t.threads_per_row >= ln_config.FWD_STACK_MIN_THREADS_PER_ROW and t.ctas_per_row == 1:
        assert t.num_threads == max(t.threads_per_row, ln_config.FWD_MIN_THREADS_PER_CTA)
    else:
        assert t.rows_per_cta == b.rows_per_cta


def test_register_estimate_sets_ctas_per_sm():
    """ptxas (sm_90a) gave these tiles 80-94 registers without spills: the estimate keeps the
    launch bound's register cap (65536 / (CTAs x threads)) above what they use."""
    t = ln_config.ln_fwd_tiles(4096, 16, 64, 8)
    assert (t.threads_per_row, t.rows_per_cta, t.ctas_per_sm) == (256, 2, 1)
    assert ln_config.fwd_register_estimate(t, 16, 64) <= tiling.REG_FILE // (t.ctas_per_sm * t.num_threads)
    t = ln_config.ln_fwd_tiles(1024, 16, 32, 8)  # shorter rows: the backward's small CTAs, many a SM
    assert (t.rows_per_cta, t.num_threads, t.ctas_per_sm) == (2, 128, 6)
    # clusters of 4 or 8 CTAs of 256 threads: two CTAs per SM (the estimate alone gives one); else one
    assert ln_config.ln_fwd_tiles(65536, 16, 64, 8).ctas_per_sm == 2
    assert ln_config.ln_fwd_tiles(32768, 16, 64, 8).ctas_per_sm == 2
    assert ln_config.ln_fwd_tiles(16384, 16, 64, 8).ctas_per_sm == 1
    assert ln_config.ln_fwd_tiles(131072, 16, 64, 8).ctas_per_sm == 1


def test_tiles_beyond_the_largest_row_and_on_sm80():
    with pytest.raises(NotImplementedError, match="longer than the largest"):
        ln_config.ln_fwd_tiles(131072 * 2, 16, 32, 8)
    with pytest.raises(NotImplementedError, match="clusters"):
        ln_config.ln_fwd_tiles(16384, 16, 32, 8, arch="sm_80")
    assert ln_config.ln_fwd_tiles(8192, 16, 32, 8, arch="sm_80").ctas_per_row == 1
    with pytest.raises(ValueError, match="not a legal access"):
        ln_config.ln_fwd_tiles(64, 16, 32, 16)
    with pytest.raises(ValueError, match=">= 1"):
        ln_config.ln_fwd_tiles(0, 16, 32, 1)


def test_exchange_bytes_and_smem():
    t = ln_config.ln_fwd_tiles(65536, 16, 64, 8)
    # one exchange: two fp32 per warp of the cluster, its sum and its centred squares (RMSNorm
    # sends the first)
    assert (t.ctas_per_row, t.warps_n, t.one_exchange, t.red_bytes) == (8, 8, True, 8 * 8 * 2 * 4)
    # fewer CTAs: the sum, then the squares, one fp32 per warp each
    four = ln_config.ln_fwd_tiles(32768, 16, 64, 8)
    assert (four.ctas_per_row, four.warps_n, four.one_exchange, four.red_bytes) == (4, 8, False, 4 * 8 * 4)
    assert t.smem_bytes(16) == t.stages * t.stage_bytes(16) + 2 * t.red_bytes + 16  # two mbarriers
    barrier = ln_config.ln_fwd_tiles(65536, 16, 64, 8, cluster_exchange="barrier", stages=t.stages)
    assert barrier.smem_bytes(16) == t.smem_bytes(16) - 16


# ------------------------------------------------------------------------ host


def fake_cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="cuda", dtype=dtype)


@pytest.mark.parametrize(
    "arch,x,w,b,fragment",
    [
        ("sm_100a", (4, 64), torch.float32, None, "sm_100a"),
        ("sm_120a", (4, 64), None, None, "sm_120a"),
        ("sm_90a", (4, 262144), None, None, "longer than the largest"),
        ("sm_80", (4, 16384), None, None, "clusters"),
        ("sm_90a", (4, 0), None, None, "N = 0"),
        ("sm_90a", (4, 64), torch.float64, None, "weight dtype"),
    ],
)
def test_unsupported_reasons(arch, x, w, b, fragment):
    with FakeTensorMode():
        args = (fake_cuda(*x), None if w is None else fake_cuda(x[-1], dtype=w), None if b is None else fake_cuda(b))
        assert fragment in NF.unsupported(*args, arch=arch)


def test_supported_and_no_arch():
    with FakeTensorMode():
        x, w = fake_cuda(4, 64), fake_cuda(64, dtype=torch.float32)
        assert NF.unsupported(x, w, w, arch="sm_90a") is None
        assert NF.unsupported(fake_cuda(4, 131072), w, None, arch="sm_90a") is None
        assert NF.unsupported(x, w, None, arch="sm_86") is None
        assert "no CUDA arch" in NF.unsupported(x, w, None)  # a fake tensor has no device to ask
    assert "cpu" in NF.unsupported(torch.zeros(4, 8), None, None)


@pytest.fixture
def stand_in(monkeypatch):
    """The forward's host path on CPU tensors: the compile cache hands out a recorder."""
    calls = []
    monkeypatch.setattr(NF, "_plans", Memo())
    monkeypatch.setattr(cc, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(cc, "num_sms", lambda index: 132)
    monkeypatch.setattr(NF, "compiled", lambda *key: lambda *args: calls.append((key, args)))
    return calls


def test_forward_arguments(stand_in):
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    w = torch.randn(64)
    y, mean, rstd = NF.forward(x, w, None, 1e-5, False)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    assert mean.shape == rstd.shape == (2, 3) and rstd.dtype == mean.dtype == torch.float32
    ((key, args),) = stand_in
    dtype, w_dt, b_dt, tiles, is_rms, arch = key
    assert (w_dt, b_dt, tiles.vec, is_rms, arch) == (cc.cute_dtype(torch.float32), None, 8, False, "sm_90a")
    xs, wa, ba, ys, mu, rs, eps, ctas = args[:8]
    assert args[8:] == (None,) * 6 + (0, 1.0)  # the plain norm: no dropout + add
    assert xs.shape == ys.shape == (6, 64) and xs.data_ptr() == x.data_ptr()  # a view, no copy
    assert wa is w and ba is None and mu.shape == rs.shape == (6,) and eps == 1e-5 and ctas >= 1
    y, mean, rstd = NF.forward(x, w, None, 1e-6, True)
    assert mean.numel() == 0 and rstd.shape == (2, 3) and stand_in[-1][0][4] is True


def test_forward_views_and_copies(stand_in):
    base = torch.randn(8, 70, dtype=torch.float16)
    NF.forward(base[:, 3:67], None, None, 1e-5, False)  # row stride 70, odd start: a view, 1-wide vectors
    (key, args) = stand_in[-1]
    assert key[3].vec == 1 and args[0].stride() == (70, 1) and args[0].data_ptr() == base[:, 3:67].data_ptr()
    xt = torch.randn(64, 8, dtype=torch.float16).t()  # columns strided: copied
    y, _, _ = NF.forward(xt, None, None, 1e-5, False)
    (key, args) = stand_in[-1]
    assert args[0].is_contiguous() and args[0].data_ptr() != xt.data_ptr() and y.is_contiguous()
    w = torch.randn(65)[1:]  # 4 bytes past an aligned address: fp16 x's 8-wide vector narrows to 1
    NF.forward(torch.randn(4, 64, dtype=torch.float16), w, None, 1e-5, False)
    assert stand_in[-1][0][3].vec == 1


def test_forward_empty_rows_launch_nothing(stand_in):
    y, mean, rstd = NF.forward(torch.empty(0, 5, 64), None, None, 1e-5, False)
    assert y.shape == (0, 5, 64) and mean.shape == rstd.shape == (0, 5) and not stand_in


def test_dispatch_runs_ours_or_torch_with_the_reason(monkeypatch, caplog):
    x, w = torch.randn(4, 32), torch.randn(32)
    ours = []
    monkeypatch.setattr(NF, "forward", lambda *a: ours.append(a) or ("y", "mean", "rstd"))
    monkeypatch.setattr(NF, "unsupported", lambda *a, **k: None)
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.norm"):
        assert N._norm_forward_impl(x, w, None, 1e-5, False) == ("y", "mean", "rstd")
    assert len(ours) == 1 and "layer_norm forward: ours" in caplog.text
    monkeypatch.setattr(NF, "unsupported", lambda *a, **k: "a reason")
    with caplog.at_level(logging.DEBUG, logger="cute_kernels.norm"):
        y, mean, rstd = N._norm_forward_impl(x, w, None, 1e-5, True)
    assert len(ours) == 1 and "rms_norm forward: torch's (a reason)" in caplog.text
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (32,), w, 1e-5))


def test_fake_output_is_contiguous_like_the_real_one():
    with FakeTensorMode():
        x = fake_cuda(64, 8).t()
        y, mean, rstd = N._norm_forward(x, None, None, 1e-5, False)
        assert y.shape == (8, 64) and y.is_contiguous() and mean.shape == rstd.shape == (8,)
    y, _, _ = N._torch_forward(torch.randn(64, 8).t(), None, None, 1e-5, False)
    assert y.is_contiguous()


def test_backward_without_a_gradient_for_y_returns_none():
    """With set_materialize_grads(False) an unused y comes as None: no gradients, no kernels."""
    from ops import norm as N

    assert N._norm_autograd_backward(None, None, None, None) == (None,) * 5


def test_the_usual_call_makes_no_views():
    """A training step's host time counts its views (each a few microseconds, and in a graph a
    ViewBackward node): one normalized dim passes x, weight and bias through as they are, rows
    already [rows, N] and 1-D statistics are used as given; two dims still flatten."""
    from ops._validate import rows_view

    x, w, b = torch.randn(6, 32), torch.randn(32), torch.randn(32)
    xf, wf, bf = N._flatten_normalized(x, (32,), w, b)
    assert xf is x and wf is w and bf is b
    assert rows_view("x", x) is x
    stats = torch.randn(6)
    assert N.stat_view("rstd", stats, 6) is stats
    x3 = torch.randn(2, 3, 4, 8)
    xf, wf, _ = N._flatten_normalized(x3, (4, 8), torch.randn(4, 8), None)
    assert xf.shape == (2, 3, 32) and wf.shape == (32,)
    assert rows_view("x", x3.reshape(2, 3, 32)).shape == (6, 32)


def test_checks_remembered_by_metadata_still_catch_new_metadata_and_eps(monkeypatch):
    """layer_norm / rms_norm check a call's tensors in full once per metadata signature: a call
    whose x, weight, bias or normalized_shape differ is checked again, eps on every call."""
    monkeypatch.setattr(N, "_fronts", Memo())
    monkeypatch.setattr(N, "check_cuda", check_tensor)  # CPU tensors stand in for CUDA ones
    x, w, b = torch.randn(4, 32), torch.randn(32), torch.randn(32)
    want = torch.nn.functional.layer_norm(x, (32,), w, b, 1e-5)
    for _ in range(2):  # checked, then remembered
        torch.testing.assert_close(N.layer_norm(x, 32, w, b, 1e-5), want)
    assert len(N._fronts) == 1
    bad = [
        (lambda: N.layer_norm(x, 32, w, b, float("nan")), TypeError, "eps"),
        (lambda: N.layer_norm(x, 32, w, b, 0), None, None),  # an int eps is a float
        (lambda: N.layer_norm(x, 32, w.to(torch.int32), b), TypeError, "weight"),
        (lambda: N.layer_norm(x, 32, w, b.to("meta")), ValueError, "bias"),
        (lambda: N.layer_norm(x, 32, w[:16], b), ValueError, "weight"),
        (lambda: N.layer_norm(x, 16, w, b), ValueError, "normalized_shape"),
        # equal to the remembered 32, but no int: not the remembered entry, the full check refuses it
        (lambda: N.layer_norm(x, 32.0, w, b), TypeError, "normalized_shape"),
        (lambda: N.layer_norm(x, (32.0,), w, b), TypeError, "normalized_shape"),
        (lambda: N.layer_norm(x, True, w, b), TypeError, "normalized_shape"),
        (lambda: N.layer_norm(x.int(), 32, w, b), TypeError, "x"),
        (lambda: N.layer_norm(x.tolist(), 32, w, b), TypeError, "x"),
        (lambda: N.layer_norm(x, [32], w, b), None, None),  # unhashable: checked every call
        (lambda: N.rms_norm(x, 32, w, float("inf")), TypeError, "eps"),
    ]
    for call, error, fragment in bad:
        if error is None:
            call()
        else:
            with pytest.raises(error, match=fragment):
                call()
    x3, w2 = torch.randn(2, 3, 4, 8), torch.randn(4, 8)
    for _ in range(2):  # two normalized dims: flattened on a remembered call too
        got = N.rms_norm(x3, (4, 8), w2)
        torch.testing.assert_close(got, torch.nn.functional.rms_norm(x3, (4, 8), w2))
