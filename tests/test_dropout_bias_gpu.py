"""The fused dropout + bias backward on the GPU, against an fp64 reference."""

import math

import pytest
import torch

import ops
from ops import dropout_bias as dbo
from ops.reference import dropout_bias_backward_ref, dropout_keep_mask

from .helpers import poison, rel_err

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTIVATIONS = [None, "relu", "gelu", "gelu_erf"]
SHAPES = [
    (1, 1),
    (1, 7),
    (3, 1),
    (5, 13),
    (17, 8),
    (33, 100),
    (257, 1000),
    (1000, 1024),
    (4097, 4096),
    (70001, 24),
    (3, 12288),
]
# dX is computed in fp32 and rounded once: within one rounding of the fp64 value.
DX_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def make_inputs(shape, dtype, activation, p, mask_dtype=torch.bool, gen=None):
    rows, n = shape
    dy = torch.randn(rows, n, device="cuda", dtype=dtype, generator=gen)
    mask = torch.rand(rows, n, device="cuda", generator=gen) >= p
    mask = mask.to(mask_dtype)
    x = bias = None
    if activation is not None:
        x = torch.randn(rows, n, device="cuda", dtype=dtype, generator=gen)
        bias = torch.randn(n, device="cuda", dtype=dtype, generator=gen)
    return dy, mask, x, bias


def check(dy, mask, p, x, bias, activation, dbias_dtype=None):
    dbias_dtype = dbias_dtype or (bias.dtype if bias is not None else dy.dtype)
    dx = poison(torch.empty_like(dy))
    db = poison(torch.empty(dy.shape[-1], device="cuda", dtype=dbias_dtype))
    dbo.launch(dy, mask, p, x, bias, activation, dx, db)
    torch.cuda.synchronize()
    ref_dx, ref_db = dropout_bias_backward_ref(dy, mask, p, x, bias, activation)
    assert not dx.isnan().any(), "grad_in has unwritten (NaN) elements"
    assert not db.isnan().any(), "grad_bias has unwritten (NaN) elements"
    # elementwise: one rounding of the fp64 value (relative), or tiny absolute near zero
    diff = (dx.double() - ref_dx).abs()
    bound = DX_TOL[dy.dtype] * ref_dx.abs() + 1e-6 * ref_dx.abs().max().clamp(min=1.0)
    assert (diff <= bound).all(), f"max |dX - ref| {diff.max().item()}"
    # dBias: fp32 sums over rows, one final rounding to its dtype
    tol = 1e-5 if dbias_dtype == torch.float32 else DX_TOL[dbias_dtype]
    assert rel_err(db, ref_db) <= tol, (rel_err(db, ref_db), tol)
    return dx, db


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_plain(shape, dtype):
    torch.manual_seed(hash((shape, str(dtype))) % 2**31)
    dy, mask, _, _ = make_inputs(shape, dtype, None, 0.1)
    check(dy, mask, 0.1, None, None, None)


@pytest.mark.parametrize("activation", ACTIVATIONS[1:])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (129, 1024), (2049, 3000)])
def test_activation(shape, dtype, activation):
    torch.manual_seed(1 + hash((shape, str(dtype), activation)) % 2**31)
    dy, mask, x, bias = make_inputs(shape, dtype, activation, 0.25)
    check(dy, mask, 0.25, x, bias, activation)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
@pytest.mark.parametrize("p", [0.0, 0.5, 0.9])
def test_mask_dtype_and_p(mask_dtype, p):
    dy, mask, _, _ = make_inputs((300, 520), torch.bfloat16, None, p, mask_dtype)
    check(dy, mask, p, None, None, None)


@pytest.mark.parametrize("dbias_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dbias_dtype_follows_bias(dbias_dtype):
    dy, mask, _, _ = make_inputs((513, 256), torch.bfloat16, None, 0.1)
    bias = torch.zeros(256, device="cuda", dtype=dbias_dtype)
    gi, gb = ops.dropout_bias_backward(dy, mask, 0.1, bias=bias)
    assert gb.dtype == dbias_dtype
    check(dy, mask, 0.1, None, bias, None)


def test_large_rows():
    dy, mask, _, _ = make_inputs((1 << 20, 64), torch.bfloat16, None, 0.1)
    check(dy, mask, 0.1, None, None, None)


def test_strided_and_misaligned_views():
    """Row-strided views and offsets that break 16-byte alignment take narrower vectors."""
    base = torch.randn(64, 1030, device="cuda", dtype=torch.float16)
    mbase = torch.rand(64, 1030, device="cuda") > 0.3
    for cols in (slice(0, 1024), slice(1, 1025), slice(2, 1026), slice(3, 1030)):
        dy, mask = base[:, cols], mbase[:, cols]
        check(dy, mask, 0.3, None, None, None)


def test_leading_dims():
    dy = torch.randn(2, 3, 5, 40, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(2, 3, 5, 40, device="cuda") > 0.2
    gi, gb = ops.dropout_bias_backward(dy, mask, 0.2)
    ref_dx, ref_db = dropout_bias_backward_ref(dy, mask, 0.2)
    assert gi.shape == dy.shape and gb.shape == (40,)
    assert rel_err(gi, ref_dx) < 4e-3 and rel_err(gb, ref_db) < 4e-3


def test_empty():
    dy = torch.empty(0, 16, device="cuda")
    gi, gb = ops.dropout_bias_backward(dy, torch.empty(0, 16, device="cuda", dtype=torch.bool), 0.1)
    assert gi.shape == (0, 16) and torch.equal(gb, torch.zeros(16, device="cuda"))


def test_deterministic():
    dy, mask, x, bias = make_inputs((20000, 1000), torch.float32, "gelu", 0.1)
    a = ops.dropout_bias_backward(dy, mask, 0.1, x, bias, "gelu")
    b = ops.dropout_bias_backward(dy, mask, 0.1, x, bias, "gelu")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_torch_compile_fullgraph():
    dy, mask, x, bias = make_inputs((300, 256), torch.bfloat16, "relu", 0.1)

    def f(dy, mask, x, bias):
        gi, gb = ops.dropout_bias_backward(dy, mask, 0.1, x, bias, "relu")
        return gi * 2, gb + 1

    got = torch.compile(f, fullgraph=True)(dy, mask, x, bias)
    want = f(dy, mask, x, bias)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _act_ref(z, activation):
    """act(z) written from torch primitives (fp64 in, fp64 out), independent of the op's own code."""
    if activation is None:
        return z
    if activation == "relu":
        return torch.where(z > 0, z, torch.zeros_like(z))
    if activation == "gelu":  # the tanh approximation
        return 0.5 * z * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    assert activation == "gelu_erf"
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_matches_torch(activation, dtype):
    """bias_dropout's forward, judged from its output: every element exactly 0 (dropped) or
    act(x + bias) / (1 - p) within the forward's roundings, about 1 - p of them kept, the kept
    ones those of the forward's draw (its Philox words replayed on the CPU from the generator's
    seed and offset); its gradients equal fp64 autograd through that mask."""
    p = 0.3
    gen = torch.Generator("cuda").manual_seed(7)  # inputs apart from the global generator the forward draws from
    x = torch.randn(64, 7, 96, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    b = torch.randn(96, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    g = torch.randn(64, 7, 96, device="cuda", dtype=dtype, generator=gen)
    torch.manual_seed(123)
    state = torch.cuda.default_generators[torch.cuda.current_device()]
    seed, offset = state.initial_seed(), state.get_offset()
    y = ops.bias_dropout(x, b, p, activation)
    y.backward(g)
    out = y.detach()
    z = x.detach().double() + b.detach().double()
    want = _act_ref(z, activation) / (1 - p)
    # x + bias, act and the scaling each rounded to dtype: a few roundings of |y|, and act's
    # slope (<= 1.13 for these activations) times the rounding of x + bias; in fp32 the math
    # library's tanh / erf (a few ulps, 1 + erf(u) cancelling for negative u) count as much
    bound = (4 if dtype == torch.bfloat16 else 16) * UNIT_ROUNDOFF[dtype] * (want.abs() + 1.2 * z.abs() / (1 - p))
    kept = out != 0
    err = (out.double() - want).abs()
    assert (err[kept] <= bound[kept]).all(), (
        f"kept elements are not act(x + bias) / (1 - p): max |y - want| {err[kept].max().item():.3g}"
    )
    visible = want.abs() > 1e-3  # nonzero before dropout whatever the roundings: y == 0 exactly when dropped
    frac = kept[visible].double().mean().item()
    assert abs(frac - (1 - p)) < 0.02, f"{frac:.4f} of the elements kept, not about {1 - p}"
    mask = dropout_keep_mask(seed, offset, 64 * 7, 96, p).reshape(x.shape).cuda()  # the forward's draw
    assert not out[~mask].any(), "an element the draw dropped is not 0"
    assert torch.equal(kept[visible], mask[visible]), "the kept elements are not the forward's draw"
    x2 = x.detach().double().requires_grad_()
    b2 = b.detach().double().requires_grad_()
    y2 = _act_ref(x2 + b2, activation) * mask / (1 - p)
    y2.backward(g.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(y, y2) < tol
    assert rel_err(x.grad, x2.grad) < tol
    assert rel_err(b.grad, b2.grad) < tol


def test_module_under_compile():
    m = ops.BiasDropout(128, p=0.2, activation="gelu", device="cuda")
    x = torch.randn(4, 33, 128, device="cuda", requires_grad=True)
    cm = torch.compile(m, fullgraph=True)
    torch.manual_seed(5)
    cm(x).sum().backward()
    gx, gb = x.grad.clone(), m.bias.grad.clone()
    x.grad = None
    m.bias.grad = None
    torch.manual_seed(5)
    m(x).sum().backward()
    assert rel_err(gx, x.grad) < 1e-5 and rel_err(gb, m.bias.grad) < 1e-5
    m.eval()
    assert torch.equal(m(x), torch.nn.functional.gelu(x + m.bias, approximate="tanh"))


def test_side_stream():
    dy, mask, _, _ = make_inputs((4096, 1024), torch.bfloat16, None, 0.1)
    ref = ops.dropout_bias_backward(dy, mask, 0.1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = ops.dropout_bias_backward(dy, mask, 0.1)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
