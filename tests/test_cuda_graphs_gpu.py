"""Every op and module under CUDA-graph capture, and under torch.compile(mode="reduce-overhead").

Each captured call is replayed on new input values (copied into the captured inputs) and
compared with an eager call on the same values; kernels whose results depend on the order
of atomic adds run in deterministic mode, so the comparisons are bitwise. Dropout replays
draw a new mask each time: there the replayed forward's own seed and offset (read back
after the replay) drive the eager reference.
"""

import pytest
import torch

import ops
from ops import attention as A

pytestmark = pytest.mark.gpu
DEV = "cuda"


def capture(fn, *static):
    """``fn(*static)`` captured in a CUDA graph after a warm-up on a side stream (compiles,
    fills host caches); returns (graph, the captured outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*static)
    return graph, outs


def replay_matches_eager(fn, make_inputs, exact=True):
    """Capture ``fn`` on one set of inputs, replay on another, compare with eager on that one."""
    static = make_inputs(0)
    graph, outs = capture(fn, *static)
    fresh = make_inputs(1)
    for s, f in zip(static, fresh):
        if isinstance(s, torch.Tensor):
            s.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    want = fn(*fresh)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for i, (got, w) in enumerate(zip(outs, want)):
        if got is None:
            assert w is None
            continue
        if exact:
            assert torch.equal(got, w), f"output {i}: the replay differs from eager"
        else:
            torch.testing.assert_close(got, w, rtol=2e-2, atol=1e-3)


def randn(seed, *shape, dtype=torch.bfloat16):
    gen = torch.Generator(DEV).manual_seed(seed)
    return torch.randn(shape, device=DEV, dtype=dtype, generator=gen)


# --------------------------------------------------------------------- backward ops

B, S, H, D = 2, 256, 4, 64


def _lse_inputs(seed, dtype=torch.bfloat16, causal=1):
    q, k, v = (randn(seed + i, B, S, H, D, dtype=dtype) for i in range(3))
    out, lse, _, _, _, _ = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, None, None, None, None, 0.0, causal, True
    )
    return q, k, v, out, lse, randn(seed + 7, B, S, H, D, dtype=dtype)


@pytest.mark.parametrize("backend", ["auto", "mem_eff"])
def test_efficient_attention_backward_captured(backend):
    def fn(q, k, v, out, lse, do):
        return A.efficient_attention_backward(
            do,
            q,
            k,
            v,
            None,
            out,
            None,
            None,
            None,
            None,
            lse,
            0.0,
            None,
            None,
            1,
            False,
            backend=backend,
            deterministic=True,
        )[:3]

    replay_matches_eager(fn, _lse_inputs)


@pytest.mark.parametrize("backend", ["auto", "mem_eff"])
def test_dropout_backward_reads_the_seed_on_the_device(backend):
    """The captured forward returns its philox seed / offset on the device; the captured
    backward reads them there. After a replay, the host-scalar path on the same seed,
    offset, out and lse gives the same bits."""
    p = 0.3

    def fn(q, k, v, do):
        out, lse, seed, offset = torch.ops.cute_kernels.memory_efficient_attention(
            q, k, v, None, None, S, S, 1, 0, None, None, p, backend, True
        )
        grads = A.efficient_attention_backward(
            do,
            q,
            k,
            v,
            None,
            out,
            None,
            None,
            None,
            None,
            lse,
            p,
            seed,
            offset,
            1,
            False,
            backend=backend,
            deterministic=True,
        )[:3]
        return out, lse, seed, offset, grads

    static = [randn(i, B, S, H, D) for i in range(4)]
    graph, (out, lse, seed, offset, grads) = capture(fn, *static)
    assert seed.is_cuda and offset.is_cuda
    masks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        host_seed, host_offset = seed.cpu(), offset.cpu()
        q, k, v, do = static
        want = A.efficient_attention_backward(
            do,
            q,
            k,
            v,
            None,
            out,
            None,
            None,
            None,
            None,
            lse,
            p,
            host_seed,
            host_offset,
            1,
            False,
            backend=backend,
            deterministic=True,
        )[:3]
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            assert torch.equal(g, w), f"{name}: device-read seed differs from the host path"
        masks.append((int(host_seed), int(host_offset)))
    assert masks[0] != masks[1], "each replay draws a new dropout mask"


def test_attention_module_path_captured():
    """memory_efficient_attention forward + autograd backward (GQA, varlen with max_seqlen)
    captured whole: replay equals eager."""
    cu = torch.tensor([0, 100, 101, 256], device=DEV, dtype=torch.int32)

    def make(seed):
        q = randn(seed, 1, S, H, D)
        k, v = (randn(seed + i, 1, S, H // 2, D) for i in (1, 2))
        return q, k, v, randn(seed + 3, 1, S, H, D)

    def fn(q, k, v, do):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = ops.memory_efficient_attention(
            *leaves,
            causal=True,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=155,
            max_seqlen_k=155,
            deterministic=True,
        )
        out.backward(do)
        return (out.detach(), *[t.grad for t in leaves])

    replay_matches_eager(fn, make)


def test_sdpa_override_captured():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def make(seed):
        return [randn(seed + i, B, H, S, D, dtype=torch.float16) for i in range(4)]

    def fn(q, k, v, do):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), ops.use_for_sdpa():
            F.scaled_dot_product_attention(*leaves, is_causal=True).backward(do)
        return [t.grad for t in leaves]

    with torch.backends.cudnn.flags(deterministic=True):
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            replay_matches_eager(fn, make)
        finally:
            torch.use_deterministic_algorithms(False)


def _norm_inputs(seed):
    return randn(seed, 512, 1024), randn(seed + 1, 512, 1024), randn(seed + 2, 1024), randn(seed + 3, 1024)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_backward_captured(kind):
    def fn(x, dy, w, b):
        if kind == "layer_norm":
            _, mean, rstd = torch.ops.aten.native_layer_norm(x, [1024], w, b, 1e-5)
            return ops.layer_norm_backward(dy, x, w, mean, rstd, b)
        rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
        return ops.rms_norm_backward(dy, x, w, rstd)

    replay_matches_eager(fn, _norm_inputs)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_forward_and_training_step_captured(kind):
    """Our forward alone (no grad), then forward + backward on leaves, in one captured graph."""

    def norm(x, w, b):
        return ops.layer_norm(x, 1024, w, b) if kind == "layer_norm" else ops.rms_norm(x, 1024, w, 1e-6)

    def fn(x, dy, w, b):
        with torch.no_grad():
            y0 = norm(x, w, b)
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        y = norm(*leaves)
        y.backward(dy)
        return [y0, y.detach()] + [t.grad for t in leaves]

    replay_matches_eager(fn, _norm_inputs)


def test_dropout_bias_backward_captured():
    def make(seed):
        dy, x, bias = randn(seed, 512, 1024), randn(seed + 1, 512, 1024), randn(seed + 2, 1024)
        gen = torch.Generator(DEV).manual_seed(seed + 3)
        mask = torch.rand(512, 1024, device=DEV, generator=gen) > 0.2
        return dy, mask, x, bias

    replay_matches_eager(lambda dy, mask, x, bias: ops.dropout_bias_backward(dy, mask, 0.2, x, bias, "gelu"), make)


def test_prepost_ops_captured():
    def make(seed):
        o, do = randn(seed, B, S, H, 128), randn(seed + 1, B, S, H, 128)
        gen = torch.Generator(DEV).manual_seed(seed + 2)
        dq_accum = torch.randn(B, S, H, 128, device=DEV, generator=gen)
        dk_accum, dv_accum = (torch.randn(B, H, S, 128, device=DEV, generator=gen) for _ in range(2))
        return o, do, dq_accum, dk_accum, dv_accum

    def fn(o, do, dq_accum, dk_accum, dv_accum):
        delta, zeroed = ops.attention_bwd_preprocess(o, do, zero_dq_accum=True)
        delta_mem_eff = ops.attention_bwd_compute_delta(o, do)
        dq = ops.attention_bwd_convert_dq(dq_accum, 0.125, head_dim=128, seqlen_q=S)
        dk, dv = ops.attention_bwd_convert_dkv(dk_accum, dv_accum, 0.125, head_dim=128, seqlen_k=S)
        cleared = [t.clone() for t in (dk_accum, dv_accum)]
        ops.attention_bwd_clear_dkv_accum(*cleared)
        return delta, zeroed, delta_mem_eff, dq, dk, dv, *cleared

    replay_matches_eager(fn, make)


# -------------------------------------------------------------------------- modules


def test_modules_training_step_captured():
    """LayerNorm, RMSNorm and BiasDropout (p = 0, so replay and eager compare) forward +
    backward in one captured graph."""
    n = 1024
    ln, rms = ops.LayerNorm(n, device=DEV, dtype=torch.bfloat16), ops.RMSNorm(n, device=DEV, dtype=torch.bfloat16)
    drop = ops.BiasDropout(n, p=0.0, activation="gelu", device=DEV, dtype=torch.bfloat16)
    params = [*ln.parameters(), *rms.parameters(), *drop.parameters()]

    def fn(x, dy):
        for t in params:
            t.grad = None
        x = x.detach().requires_grad_()
        y = drop(rms(ln(x)))
        y.backward(dy)
        return (y.detach(), x.grad, *[t.grad for t in params])

    replay_matches_eager(fn, lambda seed: (randn(seed, 8, 128, n), randn(seed + 1, 8, 128, n)))


def test_bias_dropout_module_captured_draws_new_masks():
    layer = ops.BiasDropout(1024, p=0.5, device=DEV, dtype=torch.bfloat16)
    x, dy = randn(0, 64, 1024), randn(1, 64, 1024)

    def fn(x, dy):
        layer.bias.grad = None
        xs = x.detach().requires_grad_()
        y = layer(xs)
        y.backward(dy)
        return y.detach(), xs.grad

    graph, (y, dx) = capture(fn, x, dy)
    kept = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        keep = y != 0
        torch.testing.assert_close(dx, torch.where(keep, dy * 2.0, torch.zeros_like(dy)), rtol=0, atol=0)
        kept.append(keep.clone())
    assert not torch.equal(kept[0], kept[1])


def test_reduce_overhead_training_step():
    """torch.compile(mode="reduce-overhead") of a forward with LayerNorm and attention (with
    and without dropout), its backward through autograd: runs, and without dropout its
    gradients equal eager's."""
    ln = ops.LayerNorm(D * H, device=DEV, dtype=torch.bfloat16)

    def loss(x, p):
        h = ln(x).view(B, S, H, D)
        out = ops.memory_efficient_attention(h, h, h, causal=True, dropout_p=p, deterministic=True)
        return out.float().square().mean()

    def step(fn, x, p):
        ln.zero_grad(set_to_none=True)
        x = x.detach().requires_grad_()
        fn(x, p).backward()
        return [x.grad.clone(), ln.weight.grad.clone()]

    compiled = torch.compile(loss, mode="reduce-overhead")
    x = randn(0, B, S, H * D)
    for p in (0.0, 0.1):
        for _ in range(3):  # warm-up, record, replay
            got = step(compiled, x, p)
        assert all(torch.isfinite(t).all() for t in got)
        if p == 0.0:
            for g, w in zip(got, step(loss, x, p)):
                torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-4)
