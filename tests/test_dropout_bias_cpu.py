"""CPU: the dropout + bias backward compiles for every configuration, validates its
inputs before any launch, plans its grid sensibly, and its reference is right."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ops
from cute_kernels.common.activation import ACTIVATIONS
from cute_kernels.dropout_bias import config as dropout_bias_config
from ops import _compile as cc
from ops.reference import activation_grad_ref, dropout_bias_backward_ref, dropout_keep_mask, pack_mask


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype_name", ["Float32", "Float16", "BFloat16"])
def test_compiles_every_configuration(arch, dtype_name):
    import cutlass

    from ops.dropout_bias import _build

    dtype = getattr(cutlass, dtype_name)
    vec = 128 // dtype.width
    while vec >= 1:
        for act in (None,) + ACTIVATIONS:
            fn = _build(dtype, dtype, act, vec, arch)
            assert callable(fn)
        vec //= 2
    # a bias gradient in another dtype than dY
    assert callable(_build(dtype, cutlass.Float32, None, 128 // dtype.width, arch))


@pytest.mark.compile
@pytest.mark.parametrize(
    "dtype_name,activation,vec,arch,rng_on_device",
    [
        ("BFloat16", None, 8, "sm_90a", False),
        ("Float32", "gelu", 4, "sm_90a", True),
        ("Float16", "gelu_erf", 1, "sm_80", False),
        ("BFloat16", "relu", 2, "sm_80", True),
    ],
)
def test_forward_compiles(dtype_name, activation, vec, arch, rng_on_device):
    """The forward's switches: every activation, vectors of a byte's bits and narrower (a byte
    shared by threads), the seed and offset as values or on the device (graph capture)."""
    import cutlass

    from ops.dropout_bias_forward import _build

    assert callable(_build(getattr(cutlass, dtype_name), activation, vec, arch, rng_on_device))


@pytest.mark.compile
@pytest.mark.parametrize(
    "dtype_name,activation,vec,arch", [("BFloat16", None, 8, "sm_90a"), ("Float32", "gelu", 1, "sm_80")]
)
def test_backward_compiles_with_a_bit_mask(dtype_name, activation, vec, arch):
    import cutlass

    from ops.dropout_bias import _build

    dtype = getattr(cutlass, dtype_name)
    assert callable(_build(dtype, dtype, activation, vec, arch, True))


def test_keep_threshold_resolves_p_to_16_bits():
    from cute_kernels.common.philox import keep_threshold

    assert keep_threshold(0.0) == 0
    assert keep_threshold(0.5) == 32768
    assert keep_threshold(0.1) == 6554
    assert keep_threshold(1.0 - 1e-9) == 65535  # never all dropped


def test_reference_draw_keeps_one_minus_p_and_depends_on_seed_and_offset():
    rows, n, p = 300, 1001, 0.3
    keep = dropout_keep_mask(1234, 8, rows, n, p)
    assert keep.shape == (rows, n)
    sigma = (p * (1 - p) / keep.numel()) ** 0.5
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * sigma
    assert not torch.equal(keep, dropout_keep_mask(1235, 8, rows, n, p))
    assert not torch.equal(keep, dropout_keep_mask(1234, 12, rows, n, p))
    assert torch.equal(keep, dropout_keep_mask(1234, 9, rows, n, p))  # the same counter: offset // 4
    # a row is the first N columns of its bytes: row r of N columns is not row r of N + 1
    assert torch.equal(dropout_keep_mask(1234, 8, 1, 16, p)[0], dropout_keep_mask(1234, 8, 2, 8, p).reshape(-1))


def test_pack_and_unpack_mask_round_trip():
    from ops.dropout_bias_forward import mask_bytes, unpack_mask

    keep = torch.rand(3, 5, 13) > 0.5
    bits = pack_mask(keep)
    assert bits.shape == (3, 5, mask_bytes(13)) == (3, 5, 2) and bits.dtype == torch.uint8
    assert torch.equal(unpack_mask(bits, 13), keep)
    assert (bits[..., 1] >> 5).eq(0).all()  # bits past N are zero
    assert pack_mask(torch.tensor([True, False, True, True])).tolist() == [0b1101]


def test_philox_draw_advances_the_generator_by_one_counter(monkeypatch):
    from ops import philox
    from ops.dropout_bias_forward import PHILOX_WORDS

    class Generator:
        def __init__(self):
            self.offset = 12

        def initial_seed(self):
            return 2**64 - 3

        def get_offset(self):
            return self.offset

        def set_offset(self, offset):
            self.offset = offset

    gen = Generator()
    monkeypatch.setattr(torch.cuda, "default_generators", (gen,))
    assert philox.philox_seed_offset(torch.device("cuda", 0), PHILOX_WORDS) == (-3, 12)
    assert philox.philox_seed_offset(torch.device("cuda", 0), PHILOX_WORDS) == (-3, 16)
    assert gen.offset == 20


def test_row_chunks_cover_rows_without_empty_chunks():
    t = dropout_bias_config.tiles(16, 8)
    for rows in (1, 15, 16, 17, 1000, 8192, 16384, 65536, 1 << 20):
        for n in (1, 256, 1000, 4096):
            chunks, per = dropout_bias_config.row_chunks(rows, n, t, 132)
            blocks = math.ceil(rows / t.tile[0])
            assert chunks * per >= blocks, "rows left uncovered"
            assert (chunks - 1) * per < blocks, "an empty chunk"
            assert per % t.rows_in_flight == 0


def test_tiles_reject_illegal_vectors():
    with pytest.raises(ValueError):
        dropout_bias_config.tiles(32, 8)  # 256 bits
    with pytest.raises(ValueError):
        dropout_bias_config.tiles(16, 3)


def test_max_vector_elems_follows_length_strides_and_address():
    base = torch.zeros(4, 1030, dtype=torch.float16)
    assert cc.max_vector_elems(128, (base[:, :1024], 1024)) == 2  # row stride 1030
    c = torch.zeros(4, 1024, dtype=torch.float16)
    assert cc.max_vector_elems(128, (c, 1024)) == 8
    assert cc.max_vector_elems(128, (c[:, 1:1001], 1000)) == 1  # odd address
    assert cc.max_vector_elems(128, (torch.zeros(3, 12, dtype=torch.float32), 12)) == 4
    assert cc.max_vector_elems(128, (torch.zeros(3, 6, dtype=torch.float32), 6)) == 2
    m = torch.zeros(4, 1024, dtype=torch.uint8)
    assert cc.max_vector_elems(128, (c, 1024), (m, 1024)) == 8  # bytes limited by the widest


def test_arch_names():
    assert cc.arch_of((9, 0)) == "sm_90a"
    assert cc.arch_of((8, 0)) == "sm_80"
    assert cc.arch_of((8, 9)) == "sm_89"


def test_reference_matches_autograd():
    torch.manual_seed(0)
    for act in (None,) + ACTIVATIONS:
        x = torch.randn(37, 19, dtype=torch.float64, requires_grad=True)
        b = torch.randn(19, dtype=torch.float64, requires_grad=True)
        mask = torch.rand(37, 19) > 0.3
        g = torch.randn(37, 19, dtype=torch.float64)
        z = x + b
        a = {
            None: lambda t: t,
            "relu": torch.relu,
            "gelu": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
            "gelu_erf": torch.nn.functional.gelu,
        }[act](z)
        (a * mask / 0.7).backward(g)
        dx, db = dropout_bias_backward_ref(g, mask, 0.3, x.detach(), b.detach(), act)
        torch.testing.assert_close(dx, x.grad)
        torch.testing.assert_close(db, b.grad)
    z = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64)
    assert activation_grad_ref(z, "relu").tolist() == [0.0, 0.0, 1.0]


def fake_cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, device="cuda", dtype=dtype)


BAD = [
    # (description, kwargs builder, error type, message fragment)
    (
        "cpu tensor",
        lambda: dict(grad_out=torch.zeros(4, 8), mask=torch.ones(4, 8, dtype=torch.bool), p=0.1),
        ValueError,
        "grad_out must be a CUDA",
    ),
    (
        "int dtype",
        lambda: dict(grad_out=fake_cuda(4, 8, dtype=torch.int32), mask=fake_cuda(4, 8, dtype=torch.bool), p=0.1),
        TypeError,
        "grad_out must have dtype",
    ),
    (
        "mask shape",
        lambda: dict(grad_out=fake_cuda(4, 8), mask=fake_cuda(4, 7, dtype=torch.bool), p=0.1),
        ValueError,
        "mask must have shape",
    ),
    (
        "mask dtype",
        lambda: dict(grad_out=fake_cuda(4, 8), mask=fake_cuda(4, 8, dtype=torch.float32), p=0.1),
        TypeError,
        "mask must have dtype",
    ),
    (
        "p = 1",
        lambda: dict(grad_out=fake_cuda(4, 8), mask=fake_cuda(4, 8, dtype=torch.bool), p=1.0),
        ValueError,
        "p must be in [0, 1)",
    ),
    (
        "p < 0",
        lambda: dict(grad_out=fake_cuda(4, 8), mask=fake_cuda(4, 8, dtype=torch.bool), p=-0.1),
        ValueError,
        "p must be in [0, 1)",
    ),
    (
        "p not a number",
        lambda: dict(grad_out=fake_cuda(4, 8), mask=fake_cuda(4, 8, dtype=torch.bool), p="0.1"),
        TypeError,
        "p must be a float",
    ),
    (
        "scalar",
        lambda: dict(grad_out=fake_cuda(), mask=fake_cuda(dtype=torch.bool), p=0.1),
        ValueError,
        "at least one dimension",
    ),
    (
        "unknown activation",
        lambda: dict(grad_out=fake_cuda(4, 8), mask=fake_cuda(4, 8, dtype=torch.bool), p=0.1, activation="tanh"),
        ValueError,
        "activation must be",
    ),
    (
        "activation without x",
        lambda: dict(
            grad_out=fake_cuda(4, 8),
            mask=fake_cuda(4, 8, dtype=torch.bool),
            p=0.1,
            bias=fake_cuda(8),
            activation="relu",
        ),
        ValueError,
        "needs the pre-activation input",
    ),
    (
        "x without activation",
        lambda: dict(grad_out=fake_cuda(4, 8), mask=fake_cuda(4, 8, dtype=torch.bool), p=0.1, x=fake_cuda(4, 8)),
        ValueError,
        "only used with an activation",
    ),
    (
        "x dtype",
        lambda: dict(
            grad_out=fake_cuda(4, 8),
            mask=fake_cuda(4, 8, dtype=torch.bool),
            p=0.1,
            x=fake_cuda(4, 8, dtype=torch.float16),
            bias=fake_cuda(8),
            activation="gelu",
        ),
        TypeError,
        "x must have grad_out's dtype",
    ),
    (
        "bias shape",
        lambda: dict(grad_out=fake_cuda(4, 8), mask=fake_cuda(4, 8, dtype=torch.bool), p=0.1, bias=fake_cuda(9)),
        ValueError,
        "bias must have shape",
    ),
    (
        "bias dtype with activation",
        lambda: dict(
            grad_out=fake_cuda(4, 8),
            mask=fake_cuda(4, 8, dtype=torch.bool),
            p=0.1,
            x=fake_cuda(4, 8),
            bias=fake_cuda(8, dtype=torch.float32),
            activation="relu",
        ),
        TypeError,
        "bias must have grad_out's dtype",
    ),
    (
        "not a tensor",
        lambda: dict(grad_out=fake_cuda(4, 8), mask=[1, 0], p=0.1),
        TypeError,
        "mask must be a torch.Tensor",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_inputs_raise_before_launch(case):
    _, build, err, fragment = case
    with FakeTensorMode(allow_non_fake_inputs=True):
        kwargs = build()
        with pytest.raises(err, match=fragment.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
            ops.dropout_bias_backward(**kwargs)


def test_non_flattenable_layout_is_a_clear_error():
    with FakeTensorMode():
        g = fake_cuda(8, 4).t()  # [4, 8] with column stride 4
        with pytest.raises(ValueError, match="contiguous"):
            ops.dropout_bias_backward(g, fake_cuda(4, 8, dtype=torch.bool), 0.1)


def test_forward_fake_implementation_shapes():
    with FakeTensorMode():
        y, bits = ops.dropout_bias_forward(fake_cuda(2, 3, 41), fake_cuda(41), 0.1, "gelu")
        assert y.shape == (2, 3, 41) and y.dtype == torch.bfloat16
        assert bits.shape == (2, 3, 6) and bits.dtype == torch.uint8


def test_fake_implementation_shapes():
    with FakeTensorMode():
        g = fake_cuda(2, 3, 40)
        gi, gb = ops.dropout_bias_backward(
            g, fake_cuda(2, 3, 40, dtype=torch.bool), 0.1, bias=fake_cuda(40, dtype=torch.float32)
        )
        assert gi.shape == (2, 3, 40) and gi.dtype == torch.bfloat16
        assert gb.shape == (40,) and gb.dtype == torch.float32


def test_module_is_a_module():
    m = ops.BiasDropout(16, p=0.2, activation="relu")
    assert [k for k, _ in m.named_parameters()] == ["bias"]
    with pytest.raises(ValueError):
        ops.BiasDropout(16, p=1.5)


def test_module_on_cpu_is_torchs_math():
    """On CPU tensors the module (and bias_dropout) run torch's dropout, as ops.LayerNorm falls back."""
    torch.manual_seed(0)
    m = ops.BiasDropout(16, p=0.5, activation="relu")
    with torch.no_grad():
        m.bias.uniform_(1.0, 2.0)
    x = torch.rand(3, 5, 16)
    y = m(x)
    z = torch.relu(x + m.bias)
    assert y.shape == x.shape and ((y == 0) | torch.isclose(y, 2 * z)).all() and (y == 0).any()
    y.sum().backward()
    assert m.bias.grad.shape == (16,)
    m.eval()
    torch.testing.assert_close(m(x), z)
    assert torch.equal(ops.bias_dropout(x[0, 0], m.bias, 0.0), torch.nn.functional.dropout(x[0, 0] + m.bias, 0.0))
