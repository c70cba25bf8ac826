"""GPU, 2 or 4 devices of one host (NCCL): ``ops.context_parallel_attention`` on our attention
op against the single-GPU op on the full sequence, each measured against fp64 attention
(``ops.reference``); and torch's own ``context_parallel`` under ``ops.use_for_sdpa()`` running
our attention inside its ring. Every rank is a process (``torch.multiprocessing.spawn``, as
torchrun starts them); NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import UNIT_ROUNDOFF, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

# (name, dtype, batch, heads, kv heads, head dim, causal, window_size); 512 tokens a chunk
CASES = [
    ("causal", torch.bfloat16, 1, 8, 8, 128, True, None),
    ("causal gqa fp16", torch.float16, 2, 8, 2, 64, True, None),
    ("full", torch.bfloat16, 1, 8, 8, 128, False, None),
    ("window 300", torch.bfloat16, 1, 4, 4, 128, True, 300),
]
CHUNK = 512


def _env(monkeypatch, world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared machines
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def _init(rank, world, store):
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )


def _full(seed, shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _grads(fn, q, k, v, dout):
    """(out, dq, dk, dv) of ``fn`` on leaves made from q, k, v, backward from dout."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return (out.detach(), *(t.grad for t in leaves))


def _assert_close(name, ours, single, refs, dtype):
    """Ours at most 2x the single-GPU op's error against fp64, plus one rounding."""
    for label, x, s, r in zip(("out", "dq", "dk", "dv"), ours, single, refs):
        err, base = rel_err(x, r), rel_err(s, r)
        assert err <= 2 * base + UNIT_ROUNDOFF[dtype], f"{name} {label}: {err:.3g} against the single GPU's {base:.3g}"


def _check_case(case, world):
    import ops
    from ops.context_parallel import shard, unshard
    from ops.reference import attention_backward_ref, attention_forward_ref

    name, dtype, b, h, hk, d, causal, window = case
    s = 2 * world * CHUNK
    q, k, v = (_full(i, (b, s, n, d), dtype) for i, n in enumerate((h, hk, hk)))
    dout = _full(3, (b, s, h, d), dtype)
    kwargs = dict(causal=causal, window_size=window)
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    out = ops.context_parallel_attention(*leaves, **kwargs)
    out.backward(shard(dout))
    ours = (unshard(out.detach()), *(unshard(t.grad) for t in leaves))
    single = _grads(lambda *x: ops.memory_efficient_attention(*x, **kwargs), q, k, v, dout)
    if dist.get_rank() != 0:
        return
    mask = 1 if causal else 0
    ref_out, _ = attention_forward_ref(q, k, v, custom_mask_type=mask, window_size=window or 0)
    refs = (ref_out, *attention_backward_ref(q, k, v, dout, custom_mask_type=mask, window_size=window or 0))
    _assert_close(f"{name}, {world} GPUs", ours, single, refs, dtype)


def _ours_worker(rank, world, store):
    _init(rank, world, store)
    try:
        for case in CASES:
            _check_case(case, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_matches_the_single_gpu_op(world, tmp_path, monkeypatch):
    _env(monkeypatch, world)
    mp.spawn(_ours_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=True)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _torch_cp(q, k, v, dout, world):
    """torch's context_parallel on [B, H, S, D] copies of the full tensors (its head-tail load
    balancing), SDPA's efficient backend under ops.use_for_sdpa(): (out, dq, dk, dv) gathered and
    in [B, S, H, D], and the messages of logger cute_kernels.attention."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import ops

    mesh = init_device_mesh("cuda", (world,))
    bufs = [t.transpose(1, 2).contiguous() for t in (q, k, v, dout)]
    log, records = logging.getLogger("cute_kernels.attention"), _Records()
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    try:
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)):
            for t in bufs[:3]:
                t.requires_grad_()
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), ops.use_for_sdpa():
                out = F.scaled_dot_product_attention(*bufs[:3], is_causal=True)
                out.backward(bufs[3])
            for t in bufs[:3]:
                t.requires_grad_(False)
    finally:
        log.removeHandler(records)
    full = context_parallel_unshard(mesh, [out.detach(), *(t.grad for t in bufs[:3])], [2] * 4)
    return [t.transpose(1, 2) for t in full], records.messages


def _torch_cp_worker(rank, world, store):
    _init(rank, world, store)
    try:
        import ops
        from ops.context_parallel import shard, unshard
        from ops.reference import attention_backward_ref, attention_forward_ref

        dtype, s = torch.bfloat16, 2 * world * CHUNK
        q, k, v, dout = (_full(i, (1, s, 8, 128), dtype) for i in range(4))
        theirs, messages = _torch_cp(q, k, v, dout, world)
        assert any(m.startswith("attention backward:") for m in messages), messages
        leaves = [shard(t).requires_grad_() for t in (q, k, v)]
        out = ops.context_parallel_attention(*leaves, causal=True)
        out.backward(shard(dout))
        ours = (unshard(out.detach()), *(unshard(t.grad) for t in leaves))
        if rank == 0:
            ref_out, _ = attention_forward_ref(q, k, v, custom_mask_type=1)
            refs = (ref_out, *attention_backward_ref(q, k, v, dout, custom_mask_type=1))
            _assert_close(f"torch's context_parallel, {world} GPUs", theirs, ours, refs, dtype)
    finally:
        dist.destroy_process_group()


def test_torchs_context_parallel_runs_ours(tmp_path, monkeypatch):
    """torch's ring under ops.use_for_sdpa() runs our attention backward (logged) and agrees with
    ops.context_parallel_attention within the same fp64-referenced bound."""
    _env(monkeypatch, 2)
    mp.spawn(_torch_cp_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=True)
