"""The fused bias + activation + dropout forward on the GPU: the keep bits against the CPU
draw of the same Philox words, y against an fp64 reference, the keep rate, reproducibility
from torch's seed, CUDA-graph replays, and the training op's gradients through the bit mask."""

import pytest
import torch

import ops
from ops import dropout_bias as dbo
from ops.dropout_bias_forward import PHILOX_WORDS, unpack_mask
from ops.reference import (
    bias_dropout_forward_ref,
    dropout_bias_backward_ref,
    dropout_keep_mask,
    pack_mask,
)

from .helpers import rel_err

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# y is computed in fp32 and rounded once (the activations in fp32 math: a few ulps)
Y_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _generator_state():
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    seed = gen.initial_seed()
    return (seed - (1 << 64) if seed >= 1 << 63 else seed), gen.get_offset()


def _check_forward(x, bias, p, activation):
    seed, offset = _generator_state()
    y, bits = ops.dropout_bias_forward(x, bias, p, activation)
    torch.cuda.synchronize()
    assert _generator_state() == (seed, offset + PHILOX_WORDS), "the generator's offset did not advance by 4"
    rows, n = x.numel() // x.shape[-1], x.shape[-1]
    keep = dropout_keep_mask(seed, offset, rows, n, p).reshape(x.shape)
    assert torch.equal(bits.cpu(), pack_mask(keep)), "keep bits differ from the CPU draw"
    ref = bias_dropout_forward_ref(x, bias, keep.cuda(), p, activation)
    diff = (y.double() - ref).abs()
    bound = Y_TOL[x.dtype] * ref.abs() + 1e-6 * ref.abs().max().clamp(min=1.0)
    assert (diff <= bound).all(), f"max |y - ref| {diff.max().item()}"
    return y, bits, keep


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 13), (33, 100), (257, 1000), (2, 3, 4096), (4097, 24), (3, 12289)])
def test_forward_matches_the_draw_and_the_reference(shape, dtype):
    torch.manual_seed(hash((shape, str(dtype))) % 2**31)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    bias = torch.randn(shape[-1], device="cuda", dtype=dtype)
    _check_forward(x, bias, 0.2, None)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_erf"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_activations(dtype, activation):
    torch.manual_seed(7)
    x = torch.randn(129, 1000, device="cuda", dtype=dtype)
    bias = torch.randn(1000, device="cuda", dtype=dtype)
    _check_forward(x, bias, 0.3, activation)
    _check_forward(x[:, :999], bias[:999], 0.3, activation)  # strided rows, odd N: narrow vectors


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_keep_rate_within_statistical_bounds(p):
    torch.manual_seed(3)
    x = torch.ones(2048, 4096, device="cuda", dtype=torch.bfloat16)
    _, bits = ops.dropout_bias_forward(x, torch.zeros(4096, device="cuda", dtype=torch.bfloat16), p)
    kept = unpack_mask(bits, 4096).float().mean().item()
    sigma = (max(p * (1 - p), 1e-12) / x.numel()) ** 0.5
    assert abs(kept - (1 - p)) <= 6 * sigma + 2**-16, (kept, 1 - p)


def test_seed_reproduces_the_mask():
    x = torch.randn(64, 777, device="cuda", dtype=torch.float16)
    bias = torch.randn(777, device="cuda", dtype=torch.float16)
    torch.manual_seed(11)
    y1, b1 = ops.dropout_bias_forward(x, bias, 0.25)
    y1b, b1b = ops.dropout_bias_forward(x, bias, 0.25)  # the next call draws other bits
    torch.manual_seed(11)
    y2, b2 = ops.dropout_bias_forward(x, bias, 0.25)
    assert torch.equal(b1, b2) and torch.equal(y1, y2)
    assert not torch.equal(b1, b1b)
    torch.manual_seed(12)
    assert not torch.equal(b1, ops.dropout_bias_forward(x, bias, 0.25)[1])


def test_cuda_graph_replays_draw_new_bits():
    """Under capture the seed and offset come from device memory: every replay draws the bits
    an eager call would draw from the generator's state at that replay."""
    torch.manual_seed(5)
    x = torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    ops.dropout_bias_forward(x, bias, 0.4)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.dropout_bias_forward(x, bias, 0.4)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, bits = ops.dropout_bias_forward(x, bias, 0.4)
    seen = []
    for _ in range(2):
        seed, offset = _generator_state()
        graph.replay()
        torch.cuda.synchronize()
        keep = dropout_keep_mask(seed, offset, 300, 1000, 0.4)
        assert torch.equal(bits.cpu(), pack_mask(keep)), "a replay's bits differ from the draw at its offset"
        ref = bias_dropout_forward_ref(x, bias, keep.cuda(), 0.4)
        assert rel_err(y, ref) < 8e-3
        seen.append(bits.clone())
    assert not torch.equal(seen[0], seen[1]), "two replays reused one mask"


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_erf"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_training_op_gradients(dtype, activation):
    """bias_dropout forward and backward ours: gradients of .sum() against fp64 from the mask the
    forward drew (replayed on the CPU from the generator's state)."""
    torch.manual_seed(21)
    shape, p = (3, 41, 1001), 0.15
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(shape[-1], device="cuda", dtype=dtype, requires_grad=True)
    seed, offset = _generator_state()
    y = ops.bias_dropout(x, bias, p, activation)
    y.sum().backward()
    keep = dropout_keep_mask(seed, offset, 3 * 41, 1001, p).reshape(shape).cuda()
    torch.testing.assert_close(
        y.double(), bias_dropout_forward_ref(x.detach(), bias.detach(), keep, p, activation), **_tol(dtype)
    )
    dx, db = dropout_bias_backward_ref(torch.ones_like(y), keep, p, x.detach(), bias.detach(), activation)
    torch.testing.assert_close(x.grad.double(), dx, **_tol(dtype))
    assert rel_err(bias.grad, db) <= (1e-5 if dtype == torch.float32 else 8e-3)


def _tol(dtype):
    return {"rtol": Y_TOL[dtype], "atol": 1e-5 if dtype == torch.float32 else 1e-3}


@pytest.mark.parametrize("activation", [None, "gelu"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (257, 1000), (4097, 4096), (70001, 24)])
def test_backward_reads_the_bit_mask(shape, dtype, activation):
    torch.manual_seed(1 + hash((shape, str(dtype), activation)) % 2**31)
    rows, n = shape
    dy = torch.randn(rows, n, device="cuda", dtype=dtype)
    keep = torch.rand(rows, n, device="cuda") >= 0.3
    x = bias = None
    if activation is not None:
        x = torch.randn(rows, n, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype)
    dx, db = ops.dropout_bias_backward(dy, pack_mask(keep), 0.3, x, bias, activation, mask_bits=True)
    bytes_dx, bytes_db = dbo.dropout_bias_backward(dy, keep, 0.3, x, bias, activation)
    assert torch.equal(dx, bytes_dx) and torch.equal(db, bytes_db), "bits and bytes give different gradients"
    ref_dx, ref_db = dropout_bias_backward_ref(dy, keep, 0.3, x, bias, activation)
    assert rel_err(dx, ref_dx) <= Y_TOL[dtype]
    assert rel_err(db, ref_db) <= (1e-5 if dtype == torch.float32 else 8e-3)


def test_module_trains_on_cuda():
    torch.manual_seed(2)
    m = ops.BiasDropout(1024, p=0.1, activation="gelu", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    m(x).sum().backward()
    assert x.grad.shape == x.shape and m.bias.grad.shape == (1024,)
    assert x.grad.isfinite().all() and (x.grad == 0).float().mean().item() == pytest.approx(0.1, abs=0.01)
