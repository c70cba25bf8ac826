"""The fused dropout + residual add + LayerNorm / RMSNorm on the GPU: y, r and every gradient
(x, residual, weight, bias, x_bias) against fp64 autograd over the same keep mask (unpacked from
the returned bits, which must equal the CPU draw of the same Philox words), dtypes mixed,
prenorm on and off, no residual, p = 0 and p > 0, odd and cluster-sized rows; the mask from
``torch.manual_seed``; a training step under CUDA-graph capture."""

import pytest
import torch

import ops
from ops.dropout_bias_forward import PHILOX_WORDS, unpack_mask
from ops.reference import dropout_keep_mask, pack_mask

from .helpers import rel_err

pytestmark = pytest.mark.gpu

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TOL = {F32: 1e-4, F16: 4e-3, BF16: 2e-2}


def _generator_state():
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    seed = gen.initial_seed()
    return (seed - (1 << 64) if seed >= 1 << 63 else seed), gen.get_offset()


def _cuda(shape, dtype, grad=True):
    return torch.randn(shape, device="cuda", dtype=dtype).requires_grad_(grad)


def _reference(x, res, w, b, xb, keep, p, eps, is_rms, r_dtype):
    """fp64 (y, r) as leaves' functions: r rounded to its dtype as the kernel stores it (the
    rounding passed straight through for the gradients), the norm over that r."""
    leaf = lambda t: None if t is None else t.detach().double().requires_grad_()  # noqa: E731
    x64, res64, w64, b64, xb64 = (leaf(t) for t in (x, res, w, b, xb))
    h = x64 if xb64 is None else x64 + xb64
    r = h * keep.double() / (1.0 - p)
    if res64 is not None:
        r = r + res64
    r = r + (r.detach().to(r_dtype).double() - r.detach())
    n = x.shape[-1]
    y = (
        torch.nn.functional.rms_norm(r, (n,), w64, eps)
        if is_rms
        else torch.nn.functional.layer_norm(r, (n,), w64, b64, eps)
    )
    return y, r, (x64, res64, w64, b64, xb64)


# (x dtype, residual dtype or None, weight dtype or None, LayerNorm bias, x_bias dtype or None,
#  RMSNorm, prenorm, residual_in_fp32, p, shape)
CASES = [
    (BF16, BF16, F32, True, BF16, False, True, False, 0.1, (4, 33, 4096)),
    (F16, F32, F16, True, None, False, False, False, 0.0, (37, 1000)),
    (F32, None, F32, False, F32, True, True, False, 0.2, (29, 777)),  # odd N: 1-wide vectors
    (BF16, None, BF16, False, None, True, True, True, 0.3, (17, 16384)),  # a 2-CTA cluster row, fp32 r
    (BF16, BF16, BF16, False, BF16, False, False, False, 0.5, (301, 24)),  # short rows, 3 partials folded
    (F16, F16, None, False, F16, False, True, False, 0.1, (9, 8192)),  # no weight or bias
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_matches_fp64_over_the_drawn_mask(case):
    x_dt, res_dt, w_dt, has_b, xb_dt, is_rms, prenorm, in_fp32, p, shape = case
    torch.manual_seed(hash(case) % 2**31)
    n = shape[-1]
    x = _cuda(shape, x_dt)
    res = None if res_dt is None else _cuda(shape, res_dt)
    w = None if w_dt is None else _cuda(n, w_dt)
    b = _cuda(n, w_dt or x_dt) if has_b else None
    xb = None if xb_dt is None else _cuda(n, xb_dt)
    eps = 1e-5
    fn = ops.dropout_add_rms_norm if is_rms else ops.dropout_add_layer_norm
    seed, offset = _generator_state()
    out = fn(x, res, w, b, p, eps, x_bias=xb, prenorm=prenorm, residual_in_fp32=in_fp32, return_dropout_mask=True)
    y, r, bits = out if prenorm else (out[0], None, out[1])
    rows = x.numel() // n
    if p > 0:
        assert _generator_state() == (seed, offset + PHILOX_WORDS)
        keep = dropout_keep_mask(seed, offset, rows, n, p).reshape(shape)
        assert torch.equal(bits.cpu(), pack_mask(keep)), "keep bits differ from the CPU draw"
    else:
        assert _generator_state() == (seed, offset) and unpack_mask(bits, n).all()
        keep = torch.ones(shape, dtype=torch.bool)
    r_dt = res_dt or (F32 if in_fp32 else x_dt)
    y_ref, r_ref, leaves = _reference(x, res, w, b, xb, keep.cuda(), p, eps, is_rms, r_dt)
    tol = max(TOL[x_dt], TOL[r_dt])
    assert y.dtype == x_dt and rel_err(y, y_ref) < tol
    if prenorm:
        assert r.dtype == r_dt and rel_err(r, r_ref) < TOL[r_dt]
    dy = torch.randn_like(y)
    dr = torch.randn_like(r) if prenorm else None
    loss = (y.double() * dy).sum() + ((r.double() * dr).sum() if prenorm else 0)
    loss.backward()
    ref_loss = (y_ref * dy.double()).sum() + ((r_ref * dr.double()).sum() if prenorm else 0)
    ref_loss.backward()
    for name, t, t64 in zip(("x", "residual", "weight", "bias", "x_bias"), (x, res, w, b, xb), leaves):
        if t is None:
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert torch.isfinite(t.grad).all() and rel_err(t.grad, t64.grad) < max(tol, TOL[t.dtype]), name
    if p > 0:  # dropped elements get no gradient through x
        assert (x.grad[~keep.cuda()] == 0).all()


def test_seed_reproduces_the_mask_and_the_outputs():
    x, res = _cuda((64, 777), F16, False), _cuda((64, 777), F16, False)
    w = _cuda(777, F32, False)

    def call():
        return ops.dropout_add_layer_norm(x, res, w, None, 0.25, prenorm=True, return_dropout_mask=True)

    torch.manual_seed(11)
    y1, r1, b1 = call()
    _, _, b1b = call()  # the next call draws other bits
    torch.manual_seed(11)
    y2, r2, b2 = call()
    assert torch.equal(b1, b2) and torch.equal(y1, y2) and torch.equal(r1, r2)
    assert not torch.equal(b1, b1b)


def test_module_eval_is_the_plain_composition():
    m = ops.DropoutAddLayerNorm(1024, p=0.3, prenorm=True, device="cuda", dtype=BF16).eval()
    x, res = _cuda((8, 1024), BF16, False), _cuda((8, 1024), BF16, False)
    y, r = m(x, res)
    assert torch.equal(r, x + res)
    ref = torch.nn.functional.layer_norm((x + res).double(), (1024,), m.weight.double(), m.bias.double())
    assert rel_err(y, ref) < TOL[BF16]
    rms = ops.DropoutAddRMSNorm(1024, p=0.3, device="cuda", dtype=BF16).train()
    rms(x, res).float().sum().backward()
    assert rms.weight.grad is not None and torch.isfinite(rms.weight.grad).all()


def test_cuda_graph_training_step():
    """A captured forward + backward: every replay draws the mask an eager call would draw at
    the generator's state of that replay, and its gradients follow that mask."""
    torch.manual_seed(5)
    shape, n, p = (300, 1000), 1000, 0.4
    x, res = _cuda(shape, BF16), _cuda(shape, BF16)
    w, b, xb = _cuda(n, F32), _cuda(n, F32), _cuda(n, BF16)
    dy = torch.randn(shape, device="cuda", dtype=BF16)

    def step():
        y, bits = ops.dropout_add_layer_norm(x, res, w, b, p, x_bias=xb, return_dropout_mask=True)
        grads = torch.autograd.grad(y, (x, res, w, b, xb), dy)
        return y, bits, grads

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, bits, grads = step()
    seen = []
    for _ in range(2):
        seed, offset = _generator_state()
        graph.replay()
        torch.cuda.synchronize()
        keep = dropout_keep_mask(seed, offset, 300, n, p)
        assert torch.equal(bits.cpu(), pack_mask(keep)), "a replay's bits differ from the draw at its offset"
        y_ref, _, leaves = _reference(x, res, w, b, xb, keep.cuda(), p, 1e-5, False, BF16)
        assert rel_err(y, y_ref) < TOL[BF16]
        (y_ref * dy.double()).sum().backward()
        for g, t64 in zip(grads, leaves):
            assert rel_err(g, t64.grad) < TOL[BF16]
        seen.append(bits.clone())
    assert not torch.equal(seen[0], seen[1]), "two replays reused one mask"


@pytest.mark.parametrize("which", ["r", "y"])
def test_a_loss_on_one_output_alone(which):
    """prenorm returns y and r; a loss on one of them leaves the other's gradient None (no zeros
    materialised): the gradients must still be those of that loss alone."""
    torch.manual_seed(3)
    shape, n, p = (40, 1000), 1000, 0.2
    x, res, w, b = _cuda(shape, BF16), _cuda(shape, BF16), _cuda(n, F32), _cuda(n, F32)
    seed, offset = _generator_state()
    y, r = ops.dropout_add_layer_norm(x, res, w, b, p, prenorm=True)
    keep = dropout_keep_mask(seed, offset, shape[0], n, p).reshape(shape).cuda()
    y_ref, r_ref, leaves = _reference(x, res, w, b, None, keep, p, 1e-5, False, BF16)
    out, ref = (r, r_ref) if which == "r" else (y, y_ref)
    g = torch.randn_like(out)
    (out.double() * g).sum().backward()
    (ref * g.double()).sum().backward()
    for name, t, t64 in zip(("x", "residual", "weight", "bias"), (x, res, w, b), leaves):
        if which == "r" and name in ("weight", "bias"):
            assert t.grad is None or not t.grad.any(), name
            continue
        assert rel_err(t.grad, t64.grad) < TOL[BF16], name
