"""CPU: context-parallel attention (``ops.context_parallel``) on gloo process groups of 2 and 4
ranks against single-process fp64 attention of the full sequence (``ops.reference``), and its
layout (head-tail chunks, key ranges, the slots' order) without processes.

On CPU the per-rank attention is the fp64 reference: these check the host logic, the layout and
the collectives; the kernels inside the ranks are the GPU tests' (test_context_parallel_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ops import context_parallel as cp
from ops import context_parallel_layout as L
from ops.reference import attention_backward_ref, attention_forward_ref

# (name, dtype, batch, heads, kv heads, head dim, value head dim, causal, window_size)
CASES = [
    ("causal gqa", torch.float64, 2, 4, 2, 16, 16, True, None),
    ("full dv", torch.float64, 1, 2, 2, 8, 12, False, None),
    ("window", torch.float64, 1, 2, 1, 8, 8, True, 5),
    ("window as (left, 0)", torch.float64, 1, 2, 2, 8, 8, False, (10, 0)),
    ("causal bf16", torch.bfloat16, 1, 4, 2, 16, 16, True, None),
]
CHUNK = 6  # tokens per chunk: a rank holds 12
TOL = {torch.float64: 1e-10, torch.bfloat16: 2e-2}  # max |x - ref| / max |ref|


# ----------------------------------------------------------------- layout, no processes


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_chunk_on_one_rank(world):
    held = sorted(j for r in range(world) for j in L.rank_chunks(r, world))
    assert held == list(range(2 * world))


@pytest.mark.parametrize("world", [2, 4])
def test_shard_then_gathered_slots_give_the_sequence_back(world):
    x = torch.arange(2 * 2 * world * 3 * 5).reshape(2, 2 * world * 3, 5)  # [B, S, ...], C = 3
    slots = torch.stack([L.shard_for(x, r, world) for r in range(world)])
    assert torch.equal(L.slots_to_global(slots), x)
    assert torch.equal(L.shard_for(x, 0, world)[:, 3:], x[:, -3:])  # rank 0 holds the last chunk
    assert torch.equal(L.slots_as_sequence(slots)[1], slots[:, 1].flatten(0, 1))


def test_shard_needs_whole_chunks():
    with pytest.raises(ValueError, match="2 x 2 ranks"):
        L.shard_for(torch.zeros(1, 10), 0, 2)


def test_causal_calls_balance_the_keys():
    world, local = 4, 8
    calls = [L.chunk_calls(r, world, local, causal=True) for r in range(world)]
    assert calls[1] == [L.ChunkCall(0, 4, 0, 8, 2), L.ChunkCall(4, 8, 0, 28, 2)]
    assert {sum(c.k_end - c.k_start for c in cs) for cs in calls} == {(2 * world + 1) * local // 2}


def test_window_starts_the_keys_late():
    # rank 1 of 2, chunks 1 and 2 of 4 tokens: query 4 with w = 3 sees keys 2..4
    calls = L.chunk_calls(1, 2, 8, causal=True, window=3)
    assert calls == [L.ChunkCall(0, 4, 2, 8, 2), L.ChunkCall(4, 8, 6, 12, 2)]
    assert L.chunk_calls(0, 2, 8, causal=True, window=100)[0].k_start == 0


def test_unmasked_is_one_call_over_all_keys():
    assert L.chunk_calls(1, 4, 8, causal=False) == [L.ChunkCall(0, 8, 0, 32, 0)]


def test_key_gradients_land_on_their_ranks():
    world, b, c = 3, 2, 2
    grad = torch.randn(b, 2 * world * c, 3, dtype=torch.float64)
    acc = torch.zeros(world, b, 2 * c, 3, dtype=torch.float64)
    L.add_keys_to_slots(acc, grad[:, 1:7], 1, global_order=True)  # a range across chunk boundaries
    L.add_keys_to_slots(acc, grad[:, 7:], 7, global_order=True)
    L.add_keys_to_slots(acc, grad[:, :1], 0, global_order=True)
    assert torch.equal(acc, torch.stack([L.shard_for(grad, r, world) for r in range(world)]))
    acc.zero_()
    L.add_keys_to_slots(acc, grad, 0, global_order=False)  # all keys, in the ranks' order
    assert torch.equal(L.slots_as_sequence(acc), grad)


def test_valid_inputs_need_a_process_group():
    """CPU tensors of any float dtype pass validation (the reference runs them); the group is
    looked up last (the other bad inputs: tests/test_bad_inputs.py)."""
    q = torch.zeros(1, 8, 4, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        cp.context_parallel_attention(q, q[:, :, :2], q[:, :, :2], causal=True)


# ------------------------------------------------------------------- gloo process groups


def _full(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _error(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def _check_case(case, world):
    name, dtype, b, h, hk, d, dv, causal, window = case
    s = 2 * world * CHUNK
    q, k, v = (_full(i, (b, s, n, e), dtype) for i, (n, e) in enumerate([(h, d), (hk, d), (hk, dv)]))
    dout = _full(3, (b, s, h, dv), dtype)
    w = window[0] + 1 if isinstance(window, tuple) else (window or 0)
    mask = 1 if (causal or w) else 0
    ref_out, ref_lse = attention_forward_ref(q, k, v, custom_mask_type=mask, window_size=w)
    ref_grads = attention_backward_ref(q, k, v, dout, custom_mask_type=mask, window_size=w)
    leaves = [cp.shard(t).requires_grad_() for t in (q, k, v)]
    out, lse = cp.context_parallel_attention(*leaves, causal=causal, window_size=window, return_lse=True)
    out.backward(cp.shard(dout))
    tol = TOL[dtype]
    assert _error(cp.unshard(out), ref_out) < tol, name
    assert _error(cp.unshard(lse, dim=2), ref_lse) < 1e-6, name
    for grad_name, t, ref in zip("qkv", leaves, ref_grads):
        assert t.grad.dtype == dtype and t.grad.shape == t.shape
        assert _error(cp.unshard(t.grad), ref) < tol, f"{name}: d{grad_name}"


def _check_window_keys(world):
    """The per-rank calls get only the keys their windows reach."""
    seen = []

    def forward(q, k, v, *args):
        seen.append(k.shape[1])
        return cp.REFERENCE_ATTENTION.forward(q, k, v, *args)

    rec = cp.ChunkAttention(forward, cp.REFERENCE_ATTENTION.backward, "recording")
    x = cp.shard(_full(0, (1, 2 * world * CHUNK, 2, 8), torch.float64))
    cp.context_parallel_attention(x, x, x, causal=True, window_size=3, attention=rec)
    rank = dist.get_rank()
    firsts = [min(j * CHUNK, 2) for j in L.rank_chunks(rank, world)]  # w - 1 keys before the chunk, if there
    assert seen == [CHUNK + f for f in firsts]


def _worker(rank, world, store):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        x = _full(9, (2, 2 * world * CHUNK, 3), torch.float64)
        assert torch.equal(cp.unshard(cp.shard(x)), x)
        assert torch.equal(cp.unshard(cp.shard(x[0], dim=0), dim=0), x[0])
        for case in CASES:
            _check_case(case, world)
        _check_window_keys(world)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_matches_full_sequence_attention(world, tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=True)
