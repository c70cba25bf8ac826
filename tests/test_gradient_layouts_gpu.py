"""Every autograd path takes the gradient autograd hands it, whatever its layout.

Losses give strided gradients: ``.sum()`` and ``.mean()`` an expanded one (every stride 0),
a broadcast loss weight an expand, a transposed or sliced view any strides. Each autograd
op (attention through each backend, the SDPA override, LayerNorm, RMSNorm, BiasDropout)
runs its backward with each form and must give (a) the same bits as with the same gradient
made dense and (b) gradients within bounds of the fp64 reference.
"""

import pytest
import torch
import torch.nn.functional as F

import ops
from ops.reference import attention_backward_ref
from tests.test_mem_eff_attention_gpu import check_grad

pytestmark = pytest.mark.gpu
DEV = "cuda"
FORMS = ("sum", "mean", "expand", "transposed", "sliced", "strided")


def gradient(form: str, shape, dtype, gen) -> torch.Tensor:
    """A gradient of ``shape`` in the layout ``form`` (values random except sum / mean)."""
    if form == "sum":
        return torch.ones((), device=DEV, dtype=dtype).expand(shape)
    if form == "mean":
        return torch.full((), 1.0 / torch.Size(shape).numel(), device=DEV, dtype=dtype).expand(shape)
    if form == "expand":  # a loss weight broadcast over all but the last dim
        return torch.randn(shape[-1], device=DEV, dtype=dtype, generator=gen).expand(shape)
    if form == "transposed":  # dims 0 and 1 swapped in memory, the last one moved too
        g = torch.randn((shape[-1], shape[1], shape[0], *shape[2:-1]), device=DEV, dtype=dtype, generator=gen)
        return g.movedim(0, -1).transpose(0, 1)
    if form == "sliced":  # an odd offset: rows start off any vector boundary
        return torch.randn((*shape[:-1], shape[-1] + 3), device=DEV, dtype=dtype, generator=gen)[..., 1 : shape[-1] + 1]
    assert form == "strided"  # every other element of a wider row
    return torch.randn((*shape[:-1], 2 * shape[-1]), device=DEV, dtype=dtype, generator=gen)[..., ::2]


def backward_twice(forward, leaves, grad):
    """Gradients of ``forward(*leaves)`` for ``grad`` as it is, then for its dense copy."""
    runs = []
    for g in (grad, grad.contiguous()):
        xs = [t.detach().clone().requires_grad_() for t in leaves]
        forward(*xs).backward(g)
        runs.append([x.grad for x in xs])
    return runs


def test_gradient_forms_have_their_layouts():
    """The forms are what they claim: expanded, transposed, misaligned, strided."""
    gen = torch.Generator(DEV).manual_seed(0)
    shape = (2, 8, 3, 16)
    g = {f: gradient(f, shape, torch.bfloat16, gen) for f in FORMS}
    assert all(t.shape == shape for t in g.values())
    assert g["sum"].stride() == (0, 0, 0, 0) and g["expand"].stride() == (0, 0, 0, 1)
    assert g["transposed"].stride(-1) != 1 and not g["transposed"].is_contiguous()
    assert g["sliced"].stride(-1) == 1 and g["sliced"].data_ptr() % 16 and g["strided"].stride(-1) == 2


# ------------------------------------------------------------------------ attention

ATTN_SHAPE = (2, 160, 4, 64)  # B, M, H, D: a partial last block, H > 1


def _attention_inputs(dtype, gen, kv_heads=4):
    b, m, h, d = ATTN_SHAPE
    q = torch.randn(b, m, h, d, device=DEV, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, m, kv_heads, d, device=DEV, dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("backend", ["auto", "mem_eff"])
def test_memory_efficient_attention_takes_any_gradient(backend, form):
    gen = torch.Generator(DEV).manual_seed(1)
    dtype = torch.bfloat16
    q, k, v = _attention_inputs(dtype, gen, kv_heads=2)  # grouped-query heads too
    grad = gradient(form, ATTN_SHAPE, dtype, gen)

    def forward(q, k, v):
        return ops.memory_efficient_attention(q, k, v, causal=True, backend=backend, deterministic=True)

    (strided, dense) = backward_twice(forward, (q, k, v), grad)
    for name, a, b in zip(("dq", "dk", "dv"), strided, dense):
        assert torch.equal(a, b), f"{name}: the gradient's layout changed the result"
    ref = attention_backward_ref(q, k, v, grad.contiguous(), custom_mask_type=1)
    for name, got, want in zip(("dq", "dk", "dv"), strided, ref):
        check_grad(name, got, want, dtype)


@pytest.mark.parametrize("form", FORMS)
def test_sdpa_override_takes_any_gradient(form):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(DEV).manual_seed(2)
    dtype = torch.bfloat16  # .mean()'s gradient, 1 / numel, is subnormal in fp16
    q, k, v = (t.transpose(1, 2) for t in _attention_inputs(dtype, gen))  # [B, H, M, D]
    grad = gradient(form, q.shape, dtype, gen)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), ops.use_for_sdpa():
        F.scaled_dot_product_attention(*leaves, is_causal=True).backward(grad)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    ref = attention_backward_ref(t(q), t(k), t(v), t(grad.contiguous()), custom_mask_type=1)
    for name, leaf, want in zip(("dq", "dk", "dv"), leaves, ref):
        check_grad(name, t(leaf.grad), want, dtype)


# -------------------------------------------------------------------- norms, dropout

NORM_SHAPE = (4, 24, 768)  # [B, S, N]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_modules_take_any_gradient(kind, form):
    gen = torch.Generator(DEV).manual_seed(3)
    dtype = torch.bfloat16
    n = NORM_SHAPE[-1]
    module = (ops.LayerNorm if kind == "layer_norm" else ops.RMSNorm)(n, device=DEV, dtype=dtype)
    with torch.no_grad():
        module.weight.normal_(generator=gen)
    x = torch.randn(NORM_SHAPE, device=DEV, dtype=dtype, generator=gen)
    grad = gradient(form, NORM_SHAPE, dtype, gen)
    runs = []
    for g in (grad, grad.contiguous()):
        module.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        module(xs).backward(g)
        runs.append((xs.grad, module.weight.grad))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    # fp64 reference: torch's own norm on doubles
    x64 = x.double().requires_grad_()
    w64 = module.weight.detach().double().requires_grad_()
    if kind == "layer_norm":
        y = F.layer_norm(x64, (n,), w64, module.bias.detach().double(), module.eps)
    else:
        y = F.rms_norm(x64, (n,), w64, module.eps if module.eps is not None else torch.finfo(dtype).eps)
    dx, dw = torch.autograd.grad(y, (x64, w64), grad.double())
    for name, got, want in (("dx", runs[0][0], dx), ("dweight", runs[0][1], dw)):
        err = (got.double() - want).norm() / want.norm()
        assert err < 1e-2, f"{name}: relative error {err:.3g} against fp64"


@pytest.mark.parametrize("form", FORMS)
def test_bias_dropout_takes_any_gradient(form):
    gen = torch.Generator(DEV).manual_seed(4)
    dtype, p = torch.bfloat16, 0.25
    layer = ops.BiasDropout(NORM_SHAPE[-1], p=p, device=DEV, dtype=dtype)
    with torch.no_grad():
        layer.bias.uniform_(0.0, 1.0, generator=gen)
    # x + bias >= 1: an output of 0 was dropped, never a sum that rounded to 0
    x = (torch.rand(NORM_SHAPE, device=DEV, dtype=dtype, generator=gen) + 1).requires_grad_()
    y = layer(x)
    grad = gradient(form, NORM_SHAPE, dtype, gen)
    y.backward(grad)
    keep = (y != 0).double()
    want = grad.double() * keep / (1 - p)
    torch.testing.assert_close(x.grad.double(), want, rtol=1e-2, atol=1e-6)
    want_bias = want.sum((0, 1))
    err = (layer.bias.grad.double() - want_bias).norm() / want_bias.norm()
    assert err < 1e-2, f"dbias: relative error {err:.3g}"
